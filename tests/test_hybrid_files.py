"""Saved files and the second tier for models with recurrent layers (docs/persistence.md, "Models with recurrent
layers"; docs/memory.md, "Recurrent state"): the recurrent-state snapshots travel with the blocks of their path. For
each hybrid family of the census (Qwen3-Next, Qwen3.5, LFM2, Nemotron-H, Jamba, Falcon-H1), save, load into a fresh
store, merge, convert, and the CPU and disk tiers (blocks evicted to them and brought back) are compared with stock
generate and reuse what they carried, each followed by a later ordinary request; a file or tier entry whose snapshot is
missing or malformed is refused (or not reused) with its reason, never a wrong answer."""

from __future__ import annotations

import gc
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens
from safetensors import safe_open
from safetensors.torch import save_file

import prefixkv
from prefixkv.base.errors import PersistError
from prefixkv.kv import prefix_file
from prefixkv.tools import census

pytestmark = pytest.mark.skipif(
    prefixkv.compat.releases.LINEAR_ATTENTION_LAYER is None,
    reason="transformers before 5 keeps recurrent state in caches of each model's own: refused (test_families)",
)

# each family in float64 where its kernels run it (bound 1e-6), Jamba in float32 (its float64 forward of several ids
# does not resume its state within 1e-6: the census checks it in float32, bound 1e-4)
FAMILIES = {
    "qwen3_next": torch.float64,
    "qwen3_5": torch.float64,
    "lfm2": torch.float64,
    "nemotron_h": torch.float64,
    "jamba": torch.float32,
    "falcon_h1": torch.float64,
}
BOUND = {torch.float64: 1e-6, torch.float32: 1e-4}
BS = 4


def tiny(family: str) -> Any:
    config = census.tiny_config(family)
    config._experts_implementation = "eager"  # mixtures of experts: the eager experts have a float64 kernel
    return prefixkv.models.build(config, dtype=FAMILIES[family])


# Nemotron-H's Mamba-2 reference kernels take about a minute here for the two tests: with PREFIXKV_FULL=1
SLOW = {"nemotron_h"}


@pytest.fixture(
    scope="module", params=[pytest.param(f, marks=[pytest.mark.slow] if f in SLOW else []) for f in FAMILIES]
)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny(request.param)


@pytest.fixture(scope="module")
def lfm2() -> Any:
    return tiny("lfm2")


SHARED = random_tokens(8, seed=11)
A = torch.cat([SHARED, random_tokens(8, seed=12)])[None]  # two prompts that part after 8 tokens
B = torch.cat([SHARED, random_tokens(8, seed=13)])[None]
LATER = torch.cat([SHARED, random_tokens(5, seed=14)])[None]  # an ordinary request: shares only their prefix


def exact(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, **kwargs: Any) -> Any:
    """``compare`` that asserts the logits within the family's bound and the same tokens; returns the comparison."""
    run = compare(model, store, ids, max_new_tokens=4, **kwargs)
    assert run.max_diff <= BOUND[model.dtype] and run.same_tokens, (run.max_diff, run.cache.stats)
    return run


def fill(model: Any, store: prefixkv.PrefixStore) -> None:
    """Run ``A`` and ``B`` on ``store``: each leaves snapshots where they part, at its last prompt token, at its end."""
    for ids in (A, B):
        exact(model, store, ids)


def test_save_load_merge_and_convert_carry_the_snapshots(model: Any, tmp_path: Path) -> None:
    path, converted = tmp_path / "p.safetensors", tmp_path / "c.safetensors"
    with prefixkv.PrefixStore(model, block_size=BS) as store:
        fill(model, store)
        held = store.stats.snapshots
        store.save(path)
    assert int(prefix_file.read(path).meta["states"]) == held > 0
    with prefixkv.PrefixStore.load(path, model) as loaded:
        assert loaded.stats.snapshots == held
        for ids in (B, A):  # each resumes its own snapshot, never the other's: they lie on two paths
            assert exact(model, loaded, ids).cache.stats.cached_tokens == ids.shape[1] - 1
        assert exact(model, loaded, LATER).cache.stats.cached_tokens == 8
    prefixkv.PrefixStore.convert(path, converted, None)
    with prefixkv.PrefixStore(model, block_size=BS) as merged:
        exact(model, merged, LATER)  # the store holds a part of the path already
        stats = merged.merge(converted)
        assert stats.tokens > 0
        assert exact(model, merged, B).cache.stats.cached_tokens == B.shape[1] - 1
        exact(model, merged, torch.cat([A, torch.tensor([[7, 8]])], dim=1))


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_the_tiers_carry_the_snapshots_with_their_blocks(model: Any, offload: str, tmp_path: Path) -> None:
    where = {"offload_dir": tmp_path} if offload == "disk" else {"offload": "cpu"}
    with prefixkv.PrefixStore(model, block_size=BS, num_blocks=8, **where) as store:
        exact(model, store, A)
        for seed in (21, 22):  # two other prompts push A's blocks out of the pool, into the tier
            exact(model, store, random_tokens(16, seed=seed)[None])
        assert store.cached_length(A[0].tolist()) == 0 and store.stats.offload.blocks > 0
        again = exact(model, store, A)
        assert again.cache.stats.cached_tokens == A.shape[1] - 1, again.cache.stats
        assert store.stats.offload.restored > 0
        exact(model, store, LATER)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_clear_leaves_no_snapshot_behind_in_a_store_with_a_tier(lfm2: Any, offload: str, tmp_path: Path) -> None:
    """``clear()`` in a store with a second tier drops every snapshot it took, the one of the node evicted last
    too, which the tier's carrier holds until a room offloads it (docs/memory.md, "Recurrent state": the snapshots
    go with the prefixes ``clear`` drops); a later request is still exact."""
    where = {"offload_dir": tmp_path} if offload == "disk" else {"offload": "cpu"}
    with prefixkv.PrefixStore(lfm2, block_size=BS, num_blocks=8, **where) as store:
        taken: list[weakref.ref[Any]] = []
        add = store.snapshots.add

        def noting(space: Any, keys: Any, snapshot: Any, **kw: Any) -> None:
            taken.extend(weakref.ref(t) for t in snapshot.tensors.values())
            add(space, keys, snapshot, **kw)

        store.snapshots.add = noting  # type: ignore[method-assign]
        fill(lfm2, store)
        assert taken and len(store.snapshots) > 0
        store.clear()
        gc.collect()
        assert len(store.snapshots) == 0 and store.snapshots.bytes_used == 0
        assert [r for r in taken if r() is not None] == []
        exact(lfm2, store, LATER)


# -- a snapshot missing or malformed --------------------------------------------------------------------------


def rewrite(path: Path, change: Any, meta_change: Any = None) -> None:
    """Rewrite the file at ``path`` with ``change(tensors)`` and ``meta_change(meta)`` applied and a right
    checksum: a file edited by hand, which only the checks of its contents can refuse."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    change(tensors)
    if meta_change is not None:
        meta_change(meta)
    meta["checksum"] = prefix_file.checksum(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def state_name(tensors: dict[str, torch.Tensor]) -> str:
    return next(n for n in sorted(tensors) if n.startswith("state.") and n.endswith(("conv", "recurrent")))


def nan(tensors: dict[str, torch.Tensor]) -> None:
    name = state_name(tensors)
    tensors[name] = torch.full_like(tensors[name], float("nan"))


def misshapen(tensors: dict[str, torch.Tensor]) -> None:
    name = state_name(tensors)
    tensors[name] = tensors[name][..., :-1].contiguous()


def missing(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[state_name(tensors)]


def uncounted(meta: dict[str, str]) -> None:
    del meta["states"]


@pytest.mark.parametrize(
    ("change", "meta_change", "match"),
    [
        (nan, None, "non-finite"),
        (misshapen, None, "expected .* shape .* model's states"),
        (missing, None, "lack state"),
        (lambda t: None, uncounted, "names no count of recurrent-state snapshots"),
    ],
)
def test_a_file_with_a_bad_snapshot_is_refused(
    lfm2: Any, tmp_path: Path, change: Any, meta_change: Any, match: str
) -> None:
    path = tmp_path / "p.safetensors"
    with prefixkv.PrefixStore(lfm2, block_size=BS) as store:
        fill(lfm2, store)
        store.save(path)
        rewrite(path, change, meta_change)
        with pytest.raises(PersistError, match=match):
            prefixkv.PrefixStore.load(path, lfm2)
        before = store.stats.cached_tokens
        with pytest.raises(PersistError, match=match):
            store.merge(path)
        assert store.stats.cached_tokens == before  # refused before anything changed
        exact(lfm2, store, LATER)  # a later ordinary request


def evict_a_to_disk(model: Any, directory: Path) -> None:
    """Run ``A``, then two other prompts that push its blocks into a disk tier in ``directory``, and close the store:
    the files stay for the next store of the model there."""
    with prefixkv.PrefixStore(model, block_size=BS, num_blocks=8, offload_dir=directory) as store:
        exact(model, store, A)
        for seed in (21, 22):
            exact(model, store, random_tokens(16, seed=seed)[None])
        assert store.cached_length(A[0].tolist()) == 0


def carrying(directory: Path) -> list[Path]:
    """The tier's files that carry snapshots."""
    return [p for p in sorted(directory.iterdir()) if "state.position" in safe_open(str(p), framework="pt").keys()]  # noqa: SIM118


def test_a_later_store_resumes_from_the_disk_tiers_snapshots(lfm2: Any, tmp_path: Path) -> None:
    evict_a_to_disk(lfm2, tmp_path)
    assert carrying(tmp_path)
    with prefixkv.PrefixStore(lfm2, block_size=BS, num_blocks=8, offload_dir=tmp_path) as store:
        assert exact(lfm2, store, A).cache.stats.cached_tokens == A.shape[1] - 1
        exact(lfm2, store, LATER)


@pytest.mark.parametrize(("change", "why"), [(nan, "non-finite"), (misshapen, "model's states"), (missing, "lack")])
def test_a_disk_entry_with_a_bad_snapshot_is_dropped_and_recomputed(
    lfm2: Any, tmp_path: Path, change: Any, why: str
) -> None:
    evict_a_to_disk(lfm2, tmp_path)
    for p in carrying(tmp_path):  # edited by hand, with a right checksum
        rewrite(p, change)
    with prefixkv.PrefixStore(lfm2, block_size=BS, num_blocks=8, offload_dir=tmp_path) as store:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            again = exact(lfm2, store, A)  # exact: never resumed from the bad snapshot
        assert any(why in str(w.message) and "dropped and recomputed" in str(w.message) for w in seen)
        assert again.cache.stats.cached_tokens < A.shape[1] - 1
        exact(lfm2, store, LATER)


def test_a_tier_entry_without_its_snapshot_is_not_reused_for_the_state(lfm2: Any, tmp_path: Path) -> None:
    evict_a_to_disk(lfm2, tmp_path)
    for p in carrying(tmp_path):
        rewrite(p, lambda t: [t.pop(n) for n in [n for n in t if n.startswith("state.")]])
    with prefixkv.PrefixStore(lfm2, block_size=BS, num_blocks=8, offload_dir=tmp_path) as store:
        again = exact(lfm2, store, A)  # the blocks come back, the state is computed
        assert again.cache.stats.cached_tokens < A.shape[1] - 1
        assert "snapshot" in (again.cache.stats.not_cached or ""), again.cache.stats
        assert store.stats.offload.restored > 0
        exact(lfm2, store, LATER)
