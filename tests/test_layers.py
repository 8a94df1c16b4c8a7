"""The shape of the package, read from its source with ``ast``: modules import each other in one direction only
(no cycle, counting imports inside functions and under ``TYPE_CHECKING``), and no module uses another module's
underscore names. See docs/how-it-works.md, "Layers"."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "prefixkv"

# No exceptions: every cross-module use goes through public names (the pool write and the whole-row reads of
# `PagedPrefixCache.update` through `store.blocks.write` and `store.blocks.gather`, which hold the store's lock).
ALLOWED: set[tuple[str, str, str]] = set()


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__") or "__init__"


def sources() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(module: str, node: ast.ImportFrom | ast.Import, known: set[str]) -> set[str]:
    """The package modules an import statement in ``module`` imports (``from . import x`` names module ``x``)."""
    if isinstance(node, ast.Import):
        return {n.name.removeprefix("prefixkv.") for n in node.names if n.name.startswith("prefixkv.")} & known
    if node.level == 0:
        if not (node.module or "").startswith("prefixkv"):
            return set()
        base = (node.module or "").removeprefix("prefixkv").removeprefix(".")
    else:
        package = module.split(".")[:-1] if module != "__init__" else []
        package = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        base = ".".join([*package, node.module] if node.module else package)
    found = set()
    for alias in node.names:
        full = f"{base}.{alias.name}" if base else alias.name
        if full in known:
            found.add(full)  # `from . import x`, `from .integrations import lm_eval`
        elif base in known:
            found.add(base)  # `from .x import y`
    return found


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Every module's imports of other package modules, at any depth of its source."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= resolve(name, node, known)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (cycle := visit(n)) is not None:
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)) is not None:
            return cycle
    return None


def defined_names(tree: ast.Module) -> set[str]:
    """The underscore names a module defines for itself: functions, classes and methods, module-level names,
    attributes it assigns on ``self``/``cls``, and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    names |= {
        t.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in ast.walk(node)
        if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)
    }
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


class _Uses(ast.NodeVisitor):
    """``x._name`` attribute reads and writes with ``x`` not ``self``/``cls``, each with its enclosing function."""

    def __init__(self) -> None:
        self.where = ["<module>"]
        self.found: list[tuple[str, ast.Attribute]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        dunder = attr.startswith("__") and attr.endswith("__")
        mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if attr.startswith("_") and not dunder and not mine:
            self.found.append((self.where[-1], node))
        self.generic_visit(node)


def private_uses(modules: dict[str, ast.Module]) -> list[str]:
    """``x._name`` (``x`` not ``self``/``cls``, not a dunder) in one module where ``_name`` is an underscore name
    the package defines (:func:`defined_names`) and either another module defines it or this module does not.
    Private names of other libraries (``config._attn_implementation``) are outside this check."""
    defined = {name: defined_names(tree) for name, tree in modules.items()}
    ours = set().union(*defined.values())
    found = []
    for name, tree in modules.items():
        others = set().union(*(d for m, d in defined.items() if m != name))
        uses = _Uses()
        uses.visit(tree)
        for where, node in uses.found:
            attr = node.attr
            if attr not in ours or (name, where, attr) in ALLOWED:
                continue
            if attr in others or attr not in defined[name]:
                found.append(f"{name}.{where}: {ast.unparse(node)}")
    return sorted(set(found))


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph(sources())
    assert graph["cache"] >= {"parts"} and graph["store"] >= {"runner"}, "the graph reader misses imports"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_no_module_uses_another_modules_underscore_names() -> None:
    assert private_uses(sources()) == []


# the store's modules, top down: each imports none of those above it, and the block layer nothing of the cache
# side (docs/how-it-works.md, "Layers")
STORE_LAYERS = ["store", "blocks", "namespace"]
ABOVE_THE_STORE = {"enabling", "many", "score", "cli", "_api", "__init__"}
CACHE_SIDE_MODULES = {"parts", "cache", "rows", "proof", "call", "reads", "hooks", "runner"}
# what a user calls on a PrefixStore (methods and properties; docs/api.md)
USER_FACING = {
    "stats",
    "check_invariants",
    "cached_length",
    "invariant",
    "pin",
    "unpin",
    "clear",
    "warm",
    "save",
    "load",
    "convert",
    "merge",
    "show",
    "close",
    "closed",
    "is_compileable",
    "get_seq_length",
    "pool",
    "tier",
}


def test_the_store_modules_import_downwards() -> None:
    graph = import_graph(sources())
    for i, module in enumerate(STORE_LAYERS):
        assert not graph[module] & set(STORE_LAYERS[:i]), f"{module} imports a store module above it"
        assert not graph[module] & ABOVE_THE_STORE, f"{module} imports a layer above: {graph[module] & ABOVE_THE_STORE}"
        if module != "store":
            assert not graph[module] & CACHE_SIDE_MODULES, f"{module} imports the cache side"
    assert graph["store"] >= {"blocks", "namespace", "runner", "hooks"} and graph["blocks"] >= {"namespace"}


def classes(tree: ast.Module) -> dict[str, tuple[int, list[ast.FunctionDef | ast.AsyncFunctionDef]]]:
    """Each class of a module: its lines, and the functions its body defines (methods and properties)."""
    return {
        node.name: (
            (node.end_lineno or node.lineno) - node.lineno + 1,
            [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))],
        )
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def test_the_public_methods_of_prefixstore_are_what_a_user_calls() -> None:
    _, methods = classes(sources()["store"])["PrefixStore"]
    public = {f.name for f in methods if not f.name.startswith("_")}
    assert public == USER_FACING


@pytest.mark.parametrize(
    "source, expected",
    [
        ({"a": "from . import b", "b": "def f():\n    from .a import g"}, ["a", "b", "a"]),
        (
            {
                "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B",
                "b": "import prefixkv.a",
            },
            ["a", "b", "a"],
        ),
        ({"a": "from .b import x", "b": "x = 1"}, None),
    ],
)
def test_the_cycle_check_can_fail(source: dict[str, str], expected: list[str] | None) -> None:
    modules = {name: ast.parse(text) for name, text in source.items()}
    assert find_cycle(import_graph(modules)) == expected


def test_the_private_use_check_can_fail() -> None:
    modules = {
        "store": ast.parse("class S:\n    def __init__(self):\n        self._lock = 1\n    def _match(self): ..."),
        "cache": ast.parse("def f(store):\n    with store._lock:\n        store._match()\n    return store.__class__"),
    }
    assert private_uses(modules) == ["cache.f: store._lock", "cache.f: store._match"]


# the cache side, bottom up (docs/how-it-works.md, "Layers"): each module imports only those listed before it, so
# nothing below the cache calls back up into it
# and the store on top of it: it composes them (the runner, the hooks) and they know it only as ``parts.StoreParts``
CACHE_SIDE = ["proof", "reads", "attention", "parts", "rows", "call", "cache", "hooks", "runner", "store", "enabling"]


def test_the_cache_side_imports_downwards_only() -> None:
    graph = import_graph(sources())
    assert set(CACHE_SIDE) <= set(graph), f"modules missing: {set(CACHE_SIDE) - set(graph)}"
    upward = {m: sorted(graph[m] & set(CACHE_SIDE[i + 1 :])) for i, m in enumerate(CACHE_SIDE)}
    assert {m: up for m, up in upward.items() if up} == {}


def dynamic_imports(modules: dict[str, ast.Module]) -> list[str]:
    """Calls that import by name at run time (``importlib.import_module(...)``, ``__import__(...)``), which the
    import graph cannot see: a layer that reaches up that way closes a circle at run time."""
    found = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called in ("__import__", "import_module") or called.endswith(".import_module"):
                    found.append(f"{name}: {ast.unparse(node)}")
    return sorted(found)


def private_imports(modules: dict[str, ast.Module]) -> list[str]:
    """``from x import _name`` of a package module ``x`` (the name is ``x``'s own, not for other modules)."""
    known = set(modules)
    found = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and resolve(name, node, known):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name not in known:
                        found.append(f"{name}: from {'.' * node.level}{node.module or ''} import {alias.name}")
    return sorted(found)


def test_no_module_imports_by_name_at_run_time() -> None:
    assert dynamic_imports(sources()) == []


def test_no_module_imports_another_modules_underscore_names() -> None:
    assert private_imports(sources()) == []


def test_the_dynamic_and_private_import_checks_can_fail() -> None:
    modules = {
        "store": ast.parse("import importlib\ndef f():\n    return importlib.import_module('prefixkv._api')"),
        "flex": ast.parse("from .attention import _merge, merge\nx = __import__('os')"),
        "attention": ast.parse("def _merge(): ...\ndef merge(): ..."),
        "_api": ast.parse("from . import _compat"),
        "_compat": ast.parse("x = 1"),
    }
    assert dynamic_imports(modules) == ["flex: __import__('os')", "store: importlib.import_module('prefixkv._api')"]
    assert private_imports(modules) == ["flex: from .attention import _merge"]


@pytest.mark.parametrize("module", [*STORE_LAYERS, *CACHE_SIDE, "trie", "allocator", "pool", "tier", "flex", "many"])
def test_no_class_of_the_store_or_the_cache_side_is_over_450_lines_or_25_methods(module: str) -> None:
    for name, (lines, methods) in classes(sources()[module]).items():
        assert len(methods) <= 25, f"{module}.{name} has {len(methods)} methods"
        assert lines <= 450, f"{module}.{name} has {lines} lines"


def test_the_class_size_check_can_fail() -> None:
    body = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(26))
    ((lines, methods),) = classes(ast.parse(f"class C:\n{body}")).values()
    assert (lines, len(methods)) == (53, 26)


# what a user calls on a PagedPrefixCache (docs/api.md); the rest of its public methods are transformers' Cache
# interface (``get_max_length``: the name prefixkv._compat.adapt_cache gives the interface's max-shape method)
CACHE_USER_FACING = {"stats", "close", "closed", "block_tables"}


def test_the_public_methods_of_pagedprefixcache_are_what_a_user_calls_and_the_cache_interface() -> None:
    from transformers.cache_utils import Cache

    _, methods = classes(sources()["cache"])["PagedPrefixCache"]
    public = {f.name for f in methods if not f.name.startswith("_")}
    interface = {n for n in dir(Cache) if not n.startswith("_")} | {"get_max_length"}
    assert public >= CACHE_USER_FACING
    assert public - CACHE_USER_FACING <= interface, f"not the Cache interface: {public - CACHE_USER_FACING - interface}"
