"""A layer kind is one object (docs/how-it-works.md, "Layer kinds"): a kind registered from this file, whose layers
keep a per-token "index" key besides K and V (as a sparse attention's indexer does), is served exactly by a store,
through a saved file and the CPU tier, with nothing under ``src/`` written for it. And the seams hold: only the pool
reads its tensors and names them for files and tiers, and kind names are compared in the kinds module alone."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import DynamicIndexedLayer
from transformers.models.llama.modeling_llama import LlamaAttention

import prefixkv
from prefixkv import PrefixStore
from prefixkv.base.errors import PersistError
from prefixkv.hf import kinds
from prefixkv.hf.layers import PagedLayer
from prefixkv.kv import prefix_file

SRC = Path(__file__).parent.parent / "src" / "prefixkv"
INDEX = 8  # the index key's size


class ToyIndexedLayer(DynamicIndexedLayer):
    """Stock's cache layer of the toy's layers: transformers maps a layer type to it by ``_layer_type``."""

    _layer_type = "toy_indexed"


class IndexedAttention(LlamaAttention):
    """Llama's attention, plus an attention over every cached index key (of size :data:`INDEX`, one per token, kept
    by the cache through ``update_indexer`` as DeepSeek sparse attention's indexer keys are), added to its output."""

    index_q: torch.nn.Linear
    index_k: torch.nn.Linear
    index_o: torch.nn.Linear

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        out, weights = super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        key = self.index_k(hidden_states)  # [B, q, INDEX]
        keys = key if cache is None else cache.update_indexer(key, self.layer_idx)  # [B, columns, INDEX]
        q, columns = hidden_states.shape[1], keys.shape[1]
        scores = self.index_q(hidden_states) @ keys.transpose(1, 2) * INDEX**-0.5
        future = torch.arange(columns)[None, :] > torch.arange(columns - q, columns)[:, None]
        scores = scores.masked_fill(future.to(scores.device), float("-inf"))
        return out + self.index_o(scores.softmax(-1) @ keys), weights


class IndexedFace(PagedLayer):
    """The cache's face of a toy layer: K/V as any layer's, the index keys through the pool's named tensor."""

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        return self.update_tensor("index_k", indexer_key_states[:, None])[:, 0]


class IndexedKind(kinds.LayerKind):
    """The toy kind: K, V and an index key per token."""

    def measure(self, layer: Any) -> dict[str, tuple[int, int]]:
        return {"index_k": (1, int(layer.indexer_keys.shape[-1]))}

    def face(self, cache: Any, layer_idx: int, number_of_states: int) -> Any:
        return IndexedFace(cache, layer_idx)


@pytest.fixture
def indexed() -> Iterator[Any]:
    """A tiny Llama in float64 whose attention is :class:`IndexedAttention`, with the toy kind registered."""
    kinds.register("toy_indexed", IndexedKind("toy_indexed"))
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    model.config.layer_types = ["toy_indexed"] * model.config.num_hidden_layers
    hidden = model.config.hidden_size
    torch.manual_seed(1)
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.__class__ = IndexedAttention
        attention.index_q = torch.nn.Linear(hidden, INDEX, bias=False, dtype=torch.float64)
        attention.index_k = torch.nn.Linear(hidden, INDEX, bias=False, dtype=torch.float64)
        attention.index_o = torch.nn.Linear(INDEX, hidden, bias=False, dtype=torch.float64)
    try:
        yield model
    finally:
        kinds.unregister("toy_indexed")


def _prompts(shared: int, tail: int, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` prompts sharing their first ``shared`` tokens, each ``tail`` of its own after them."""
    head = random_tokens(shared, seed)
    return [torch.cat([head, random_tokens(tail, seed + 1 + i)])[None] for i in range(count)]


def _exact(model: Any, store: PrefixStore, ids: torch.Tensor, cached: int | None = None) -> None:
    """Generate ``ids`` with ``store`` and stock: the same tokens, logits within 1e-6, ``cached`` prompt tokens
    reused (when given)."""
    c = compare(model, store, ids, do_sample=False)
    assert c.same_tokens and c.max_diff <= 1e-6, c.max_diff
    if cached is not None:
        assert c.cache.stats.cached_tokens == cached


def test_a_kind_registered_from_a_test_is_served_exactly(indexed: Any) -> None:
    with PrefixStore(indexed, block_size=4) as store:
        assert store.layer_kinds == ["toy_indexed"] * 2
        assert [s.tensors["index_k"] for s in store.blocks.pool.specs] == [(1, INDEX)] * 2
        assert "index_k" in store.blocks.pool.layer(1)
        first, second, later = _prompts(12, 5, 3)
        _exact(indexed, store, first, cached=0)
        _exact(indexed, store, second, cached=12)  # the shared prefix's K/V and index keys, reused
        assert bool(store.blocks.pool.layer(0)["index_k"].abs().sum() > 0)
        _exact(indexed, store, later)  # a later ordinary request
        with prefixkv.PagedPrefixCache(store) as cache:  # no compiled step: it carries K and V alone
            assert "index_k" in cache.compile_reason and not cache.is_compileable


def test_a_kinds_named_tensor_is_saved_loaded_and_tiered(indexed: Any, tmp_path: Path) -> None:
    first, second, later = _prompts(16, 5, 3, seed=10)
    path = tmp_path / "indexed.safetensors"
    with PrefixStore(indexed, block_size=4) as store:
        _exact(indexed, store, first, cached=0)
        store.save(path)
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    assert {"k.0", "v.1", "index_k.0", "index_k.1"} <= names
    with safe_open(str(path), framework="pt") as f:  # a file without one of them is refused as malformed
        tensors, meta = {n: f.get_tensor(n) for n in names - {"index_k.1"}}, dict(f.metadata())
    meta["checksum"] = prefix_file.checksum(tensors, meta)
    save_file(tensors, str(tmp_path / "short.safetensors"), metadata=meta)
    with pytest.raises(PersistError, match=r"tensor index_k\.1 is missing"):
        PrefixStore.load(tmp_path / "short.safetensors", indexed)
    with PrefixStore.load(path, indexed) as loaded:
        _exact(indexed, loaded, second, cached=16)  # the index keys came back from the file
        _exact(indexed, loaded, later)
    # the CPU tier: a small pool evicts the first prompt's blocks to the tier, and they come back
    with PrefixStore(indexed, block_size=4, num_blocks=12, offload="cpu") as store:
        prompts = _prompts(0, 20, 3, seed=20)
        for ids in prompts:
            _exact(indexed, store, ids, cached=0)
        offload = store.stats.offload
        assert offload is not None and offload.blocks > 0
        _exact(indexed, store, prompts[0], cached=19)  # from the tier (its last token is always computed)
        assert store.stats.offload is not None and store.stats.offload.restored > 0
        _exact(indexed, store, _prompts(0, 9, 1, seed=40)[0], cached=0)  # a later ordinary request


# -- the seams, counted from the source -----------------------------------------------------------------------

KIND_NAMES = {"kv", "state", "kv+state", "none"}
ASKED = {"writes_kv", "has_state"}  # the functions of a kind's name that the kind objects replaced


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(SRC)): ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}


def _pool_reads(tree: ast.Module) -> list[int]:
    """Lines that read a pool's per-layer tensor lists (``pool.keys``, ``pool.values``, their scales)."""
    fields = {"keys", "values", "key_scales", "value_scales", "tensors", "scales"}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in fields:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("pool", "_pool"):
                out.append(node.lineno)
    return out


def _names_formed(tree: ast.Module) -> list[int]:
    """Lines that form a file or tier tensor name: an f-string like ``f"k.{i}"`` or ``f"{kv}_scale.{layer}"``
    (a name, a dot, a layer index)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and isinstance(node.values[-1], ast.FormattedValue):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            index = node.values[-1].value
            if re.fullmatch(r"(k|v|\{\})(_scale)?\.\{\}", text) and getattr(index, "id", "") in ("i", "layer"):
                out.append(node.lineno)
    return out


def _compares_kind_names(tree: ast.Module) -> bool:
    """Whether a module compares something with a kind's name or a kind of the kinds module, asks a kind's name
    what it does (``writes_kv(kind)``, ``has_state(kind)``), or takes a store's having kinds for its having
    recurrent layers (``store.layer_kinds is not None``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ASKED:
            return True
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Is | ast.IsNot):
            left = node.left.func if isinstance(node.left, ast.Call) else node.left
            if isinstance(left, ast.Attribute) and left.attr == "layer_kinds":
                return True
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                if any(isinstance(i, ast.Constant) and i.value in KIND_NAMES for i in items):
                    return True
                if any(isinstance(i, ast.Attribute) and i.attr in ("KV", "STATE", "BOTH", "NONE") for i in items):
                    return True
    return False


def test_only_the_pool_reads_its_tensors_and_names_them() -> None:
    sources = _sources()
    reads = {m: lines for m, t in sources.items() if m != "kv/pool.py" and (lines := _pool_reads(t))}
    assert reads == {}
    named = {m: lines for m, t in sources.items() if m != "kv/pool.py" and (lines := _names_formed(t))}
    assert named == {}
    assert _names_formed(sources["kv/pool.py"])  # the counter sees the pool's own


def test_kind_names_are_compared_in_at_most_three_modules() -> None:
    comparing = sorted(m for m, t in _sources().items() if m != "hf/kinds.py" and _compares_kind_names(t))
    assert len(comparing) <= 3, comparing
    for seen in ('kind == "state"', "k in (KV, x.BOTH)", "kinds.writes_kv(k)", "store.layer_kinds is not None"):
        assert _compares_kind_names(ast.parse(seen)), seen


def test_a_kinds_named_tensor_under_an_invariant_store_and_the_disk_tier(indexed: Any, tmp_path: Path) -> None:
    first, second, later = _prompts(16, 5, 3, seed=50)
    with PrefixStore(indexed, block_size=4, invariant=True, chunk_size=8) as store:
        _exact(indexed, store, first, cached=0)
        _exact(indexed, store, second, cached=16)  # whole chunks of the shared prefix, index keys included
        _exact(indexed, store, later)
    with PrefixStore(indexed, block_size=4, num_blocks=12, offload="disk", offload_dir=tmp_path) as store:
        prompts = _prompts(0, 20, 3, seed=60)
        for ids in prompts:
            _exact(indexed, store, ids, cached=0)
        _exact(indexed, store, prompts[0], cached=19)  # from the disk tier's files, index keys included
        assert store.stats.offload is not None and store.stats.offload.restored > 0
        _exact(indexed, store, later)
