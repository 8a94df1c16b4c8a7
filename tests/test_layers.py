"""The shape of the package, read from its source with ``ast``: modules import each other in one direction only
(no cycle, counting imports inside functions and under ``TYPE_CHECKING``), and no module uses another module's
underscore names. See docs/how-it-works.md, "The house"."""

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


def packages() -> set[str]:
    """The subpackages (``kv``, ``attention``, ...): a relative import in their ``__init__`` starts from them."""
    return {module_name(p) for p in PACKAGE.rglob("__init__.py")} - {"__init__"}


def resolve(
    module: str, node: ast.ImportFrom | ast.Import, known: set[str], subpackages: frozenset[str] = frozenset()
) -> set[str]:
    """The package modules an import statement in ``module`` imports (``from . import x`` names module ``x``;
    ``module`` is a package's ``__init__`` where it is in ``subpackages``)."""
    if isinstance(node, ast.Import):
        return {n.name.removeprefix("prefixkv.") for n in node.names if n.name.startswith("prefixkv.")} & known
    if node.level == 0:
        if not (node.module or "").startswith("prefixkv"):
            return set()
        base = (node.module or "").removeprefix("prefixkv").removeprefix(".")
    else:
        package = [] if module == "__init__" else module.split(".") if module in subpackages else module.split(".")[:-1]
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


def import_graph(modules: dict[str, ast.Module], subpackages: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """Every module's imports of other package modules, at any depth of its source."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= resolve(name, node, known, subpackages)
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


def graph() -> dict[str, set[str]]:
    return import_graph(sources(), frozenset(packages()))


def test_the_import_graph_has_no_cycle() -> None:
    found = graph()
    assert found["hf.forward"] >= {"hf.parts", "attention.reader"} and found["store.prefix_store"] >= {"hf.runner"}, (
        "misses imports"
    )
    assert find_cycle(found) is None, f"import cycle: {' -> '.join(find_cycle(found) or [])}"


def test_no_module_uses_another_modules_underscore_names() -> None:
    assert private_uses(sources()) == []


# The house, bottom up (docs/how-it-works.md, "The house"): each floor is a folder. The ground facts every floor
# reads (`base/`); the release shims (`compat/`); the block layer (`kv/`); the attention layer (`attention/`); the
# transformers glue (`hf/`); the store and its composition (`store/`); generate_many and its parts (`many/`); the
# user-facing modules on top, beside the integrations and the tools (`integrations/`, `tools/`, the top floor's
# folders). A module imports modules of its own floor and of those below it, never one above.
LAYERS = ["base", "compat", "kv", "attention", "hf", "store", "many", "top"]
TOP_FOLDERS = ("integrations", "tools")
# within a floor, each module imports only those listed before it: the order a reader can read them in
WITHIN = {
    "base": [
        *("base.errors", "base.settings", "base.tokens", "base.images", "base.slots", "base.family", "base.memory"),
        *("base.stats", "base.display_text", "base.display"),
    ],
    "compat": ["compat.patching", "compat.releases", "compat.generation"],
    "kv": [
        *("kv.allocator", "kv.nodes", "kv.eviction", "kv.trie", "kv.quantization", "kv.pool", "kv.ranks"),
        "kv.fingerprint",
        *("kv.prefix_file", "kv.key_space", "kv.tier", "kv.holdings", "kv.room", "kv.persist", "kv.ledger"),
        "kv.manager",
    ],
    "attention": [
        *("attention.reads", "attention.static", "attention.kernels", "attention.interface", "attention.planner"),
        *("attention.blocks", "attention.gather", "attention.registry", "attention.reader", "attention.flex_kernel"),
        "attention.flex",
    ],
    "hf": [
        *("hf.vision", "hf.proof", "hf.states", "hf.state_files", "hf.layers", "hf.kinds", "hf.linear_cache"),
        *("hf.stepwise", "hf.support", "hf.shapes", "hf.parts", "hf.resume", "hf.rows", "hf.call", "hf.forward"),
        *("hf.cache", "hf.hooks"),
        "hf.runner",
    ],
    "store": ["store.options", "store.parallel", "store.files", "store.prefix_store", "store"],
    "many": ["many.arguments", "many.batches", "many.scheduler", "many.generation", "many"],
    "top": [
        *("models", "display", "enabling", "score", "integrations.lm_eval", "integrations.trl", "lm_eval"),
        *("tools.census", "tools.demo", "tools.cli", "_api"),
    ],
}
# the user-facing modules left at the top of the package (issue 53: at most about 8), beside __init__, __main__
# and _api (the public names, loaded at once)
TOP_MODULES = {"display", "enabling", "lm_eval", "models", "score"}


def layer(module: str) -> str:
    """A module's floor, read from its folder: the top floor for the package's own files and its top folders."""
    folder = module.split(".")[0]
    if "." not in module and module not in LAYERS:
        return "top"
    return "top" if folder in TOP_FOLDERS else folder


def test_the_top_level_holds_only_the_user_facing_modules() -> None:
    flat = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__", "_api"}
    assert flat == TOP_MODULES
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == (set(LAYERS) - {"top"}) | set(TOP_FOLDERS)


def upward_imports(found: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module's imports of modules in a layer above its own, where it has any."""
    rank = {m: LAYERS.index(layer(m)) for m in found}
    upward = {m: sorted(n for n in imported if rank.get(n, rank[m]) > rank[m]) for m, imported in found.items()}
    return {m: up for m, up in upward.items() if up}


def out_of_order(found: dict[str, set[str]], order: list[str]) -> dict[str, list[str]]:
    """Each module of ``order`` that imports one listed after it, with those."""
    later = {m: sorted(found.get(m, set()) & set(order[i + 1 :])) for i, m in enumerate(order)}
    return {m: up for m, up in later.items() if up}


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert upward_imports(graph()) == {}


def test_within_a_layer_modules_import_in_reading_order() -> None:
    found = graph()
    for name, order in WITHIN.items():
        assert set(order) <= set(found), f"modules missing: {set(order) - set(found)}"
        assert out_of_order(found, order) == {}, f"{name}: a module imports one listed after it"


def test_every_module_of_a_package_layer_is_in_its_reading_order() -> None:
    listed = {m for order in WITHIN.values() for m in order}
    unlisted = sorted(m for m in sources() if layer(m) != "top" and m not in packages() and m not in listed)
    assert unlisted == []


def test_the_layer_checks_can_fail() -> None:
    modules = {"kv.blocks": ast.parse("from ..hf import cache"), "hf.cache": ast.parse("from ..kv import blocks")}
    found = import_graph(modules)
    assert upward_imports(found) == {"kv.blocks": ["hf.cache"]}
    assert out_of_order(found, ["kv.blocks", "hf.cache"]) == {"kv.blocks": ["hf.cache"]}
    inside = import_graph({"kv": ast.parse("from . import trie"), "kv.trie": ast.parse("x = 1")}, frozenset({"kv"}))
    assert inside["kv"] == {"kv.trie"}


# the store over the glue: the block manager, the key space and the runner below it, its settings
# (`base.settings.StoreSettings`, on the ground floor) from its options and its files beside it; the hooks and
# caches know it only as `hf.parts.StoreParts`; generate_many's parts above it, the user-facing modules on top
def test_the_store_composes_the_layers_below_it() -> None:
    found = graph()
    store = found["store.prefix_store"]
    assert store >= {"kv.manager", "kv.key_space", "hf.runner", "hf.hooks", "store.options", "store.files"}
    assert "base.settings" in found["store.options"] & found["store.files"] & found["hf.parts"]
    below_store = {m for m in found if LAYERS.index(layer(m)) < LAYERS.index("store")}
    assert not {m for m in below_store if found[m] & {"store", "store.prefix_store", "enabling", "many", "score"}}
    assert not {m for m in found if layer(m) != "top" and found[m] & {"enabling", "score", "models", "display"}}


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
    _, methods = classes(sources()["store.prefix_store"])["PrefixStore"]
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


@pytest.mark.parametrize("module", [m for order in WITHIN.values() for m in order])
def test_no_class_is_over_450_lines_or_25_methods(module: str) -> None:
    for name, (lines, methods) in classes(sources()[module]).items():
        assert len(methods) <= 25, f"{module}.{name} has {len(methods)} methods"
        assert lines <= 450, f"{module}.{name} has {lines} lines"


def test_the_class_size_check_can_fail() -> None:
    body = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(26))
    ((lines, methods),) = classes(ast.parse(f"class C:\n{body}")).values()
    assert (lines, len(methods)) == (53, 26)


# the glue in pieces a reader takes in at once (issue 53): no function of hf/ over 60 lines (methods and nested
# functions too), and the rows of a cache small again once the snapshot rules left them for hf/resume.py
FUNCTION_LINES = 60
ROWSET_LINES, ROWSET_METHODS, ROWS_MODULE_LINES = 300, 15, 400


def long_functions(tree: ast.Module, most: int) -> list[str]:
    """Each function of a module (at any depth) over ``most`` lines, from its ``def`` to its last line."""
    return sorted(
        f"{node.name}: {lines}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (lines := (node.end_lineno or node.lineno) - node.lineno + 1) > most
    )


@pytest.mark.parametrize("module", sorted(m for m in sources() if m.startswith("hf.")))
def test_no_function_of_the_glue_is_over_60_lines(module: str) -> None:
    assert long_functions(sources()[module], FUNCTION_LINES) == []


def rows_too_big(text: str) -> list[str]:
    """What of ``hf/rows.py``'s source ``text`` is over its bound: ``RowSet``'s methods or lines, the module's lines."""
    lines, methods = classes(ast.parse(text))["RowSet"]
    module = len(text.splitlines())
    return [
        *([f"RowSet has {len(methods)} methods"] if len(methods) > ROWSET_METHODS else []),
        *([f"RowSet has {lines} lines"] if lines > ROWSET_LINES else []),
        *([f"hf/rows.py has {module} lines"] if module > ROWS_MODULE_LINES else []),
    ]


def test_the_rows_of_a_cache_are_small() -> None:
    assert rows_too_big((PACKAGE / "hf" / "rows.py").read_text()) == []


def test_the_function_size_check_can_fail() -> None:
    body = "".join(f"    x = {i}\n" for i in range(59))
    nested = "".join(f"            y = {i}\n" for i in range(60))
    tree = ast.parse(f"def short():\n{body}\nclass C:\n    def m(self):\n        def inner():\n{nested}")
    assert long_functions(tree, 60) == ["inner: 61", "m: 62"]
    assert long_functions(tree, 61) == ["m: 62"]
    methods = "".join(f"    def m{i}(self):\n" + "        x = 1\n" * 18 + "\n" for i in range(16))
    big = f"class RowSet:\n{methods}" + "x = 1\n" * 80
    assert rows_too_big(big) == ["RowSet has 16 methods", "RowSet has 320 lines", "hf/rows.py has 401 lines"]


# what a user calls on a PagedPrefixCache (docs/api.md); the rest of its public methods are transformers' Cache
# interface (``get_max_length``: the name prefixkv.compat.releases.adapt_cache gives the interface's max-shape method)
CACHE_USER_FACING = {"stats", "close", "closed", "block_tables"}


def test_the_public_methods_of_pagedprefixcache_are_what_a_user_calls_and_the_cache_interface() -> None:
    from transformers.cache_utils import Cache

    _, methods = classes(sources()["hf.cache"])["PagedPrefixCache"]
    public = {f.name for f in methods if not f.name.startswith("_")}
    interface = {n for n in dir(Cache) if not n.startswith("_")} | {"get_max_length"}
    assert public >= CACHE_USER_FACING
    assert public - CACHE_USER_FACING <= interface, f"not the Cache interface: {public - CACHE_USER_FACING - interface}"


def decode_step_modules(step: int = 2, apart: bool = False) -> tuple[set[str], set[str]]:
    """The prefixkv modules whose code runs in decode step ``step`` of a warm ``generate`` call on a tiny llama with
    a ``PagedPrefixCache`` (from one step's logits processor to the next one's: the rest of ``generate``'s step, the
    next step's ``prepare_inputs_for_generation``, its forward and hooks), and those within layer 0's attention call.
    The 11-token prompt in blocks of 4: step 2 enters a new block, step 3 is a steady step (within its block). With
    ``apart``, the first call generates 8 tokens, which it publishes after the prompt, so the measured call's own
    blocks lie apart from the prefix it reuses (a warm chat turn: its decode steps fold).
    Measured with ``sys.setprofile``, in this thread."""
    import inspect
    import sys
    import types

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    import prefixkv
    from prefixkv import models
    from prefixkv.compat.releases import GENERATE_CACHE_KWARG

    model = models.tiny_model("llama", dtype=torch.float64)
    attention = inspect.unwrap(type(model.model.layers[0].self_attn).forward).__code__
    layer0 = model.model.layers[0].self_attn
    total: set[str] = set()
    per_layer: set[str] = set()
    inside: list[types.FrameType] = []

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and frame.f_code is attention and frame.f_locals.get("self") is layer0:
            inside.append(frame)
        if name.startswith("prefixkv.") and event == "call":
            total.add(name)
            if inside:
                per_layer.add(name)
        if event == "return" and inside and frame is inside[-1]:
            inside.pop()

    class Profiling(LogitsProcessor):
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == step:  # after decode step ``step - 1``: the next one is measured
                sys.setprofile(profile)
            elif self.calls == step + 1:
                sys.setprofile(None)
            return scores

    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.arange(1, 12).unsqueeze(0)
    for processors in ([], [Profiling()]):  # the first call makes the second one warm (its prefix cached)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            kw = {GENERATE_CACHE_KWARG: cache, "logits_processor": LogitsProcessorList(processors)}
            model.generate(ids, **kw, max_new_tokens=8 if apart and not processors else 4, do_sample=False)
    sys.setprofile(None)
    assert cache.stats.cached_tokens > 0, "the call was not warm"
    return total, per_layer


# the prefixkv modules an eager decode step runs, and one layer's attention call (decode_step_modules), held where
# they are: 19 and 10 before issue 44; 21 and 11 after it. The Forward (hf/forward.py) took hf/layers.py out of the
# step, and the ground floor's one home for each shared fact put two small modules in (slots.py, a layer's slots;
# tokens.py, a token's trie key). Issue 54 took the autocast query (kv/key_space.py) out of the layers, then out of
# the step but where the key space changed, and the block manager's lock out of the write (kv/pool.py's
# write_unlocked): 21 and 8; then the corridor, 19 and 4: the cache hands each layer to its Forward straight, the
# write and the attention read the slot views the plan took once a step (no pool, no slots.py per layer), the
# attention's body runs without torch.compiler.disable's wrapper when nothing compiles and calls the CPU kernel
# straight (no compat/releases.py), each layer's K/V shapes are read once per cache. Step 2 enters a new block
# (kv/manager.py, room.py, allocator.py allocate); step 3, a steady step within its block, asks the manager only
# whether a block must be copied (18: no kv/room.py). The issue aims at about 12 a step: the rest are the hooks, the
# proof (base/tokens.py), generate's step (compat/generation.py, compat/patching.py), the slot table
# (base/slots.py), the plan (attention/reader.py, reads.py, planner.py, whose steady step reuses the last one's
# reads) and the pool's slot views (kv/pool.py). Then the plan took every layer's slot views by one attribute of the
# pool (kv_slots) and the copy-on-write check the refcounts by the list's own lookup: no kv/pool.py, and no
# kv/allocator.py in a steady step: 18 and 16
DECODE_STEP_MODULES = 18
STEADY_STEP_MODULES = 16
LAYER_MODULES = 4


@pytest.mark.parametrize(("step", "most"), [(2, DECODE_STEP_MODULES), (3, STEADY_STEP_MODULES)])
def test_an_eager_decode_step_runs_few_modules(step: int, most: int) -> None:
    total, per_layer = decode_step_modules(step)
    assert per_layer <= total and per_layer, "the measure saw no layer"
    assert len(total) <= most, f"eager decode step {step} runs {len(total)} modules: {sorted(total)}"
    assert len(per_layer) <= LAYER_MODULES, f"one layer's attention runs {len(per_layer)}: {sorted(per_layer)}"


# a warm chat turn's steady step, which folds (attention/planner.py's lone_fold): the row's whole K/V by slots for
# the model's own attention, no plan, no kernel of prefixkv's; 14 a step and 3 a layer (interface, reader, forward)
FOLDED_STEP_MODULES = 14
FOLDED_LAYER_MODULES = 3


def test_a_warm_turns_folded_decode_step_runs_fewer_modules() -> None:
    total, per_layer = decode_step_modules(3, apart=True)
    assert "prefixkv.attention.blocks" not in total, "the step was read by the blocks, not folded"
    assert len(total) <= FOLDED_STEP_MODULES, f"the folded step runs {len(total)} modules: {sorted(total)}"
    assert len(per_layer) <= FOLDED_LAYER_MODULES, f"one layer's attention runs {len(per_layer)}: {sorted(per_layer)}"
