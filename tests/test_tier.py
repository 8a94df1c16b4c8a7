"""The second tier (``offload="cpu"`` / ``"disk"``): evicted blocks move there and come back exactly; its own
budget and LRU; disk files that survive the store, written atomically, checked by checksum, and refused
when they belong to another model, dtype or quantization."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens

import prefixkv
from prefixkv import PrefixStore
from prefixkv.kv.tier import OffloadTier, chunk_keys

BS = 4


def _entry(value: float, size: int = 64) -> dict[str, torch.Tensor]:
    return {"k.0": torch.full((1, size // 4), value, dtype=torch.float32)}


# -- the tier alone ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_budget_and_lru(kind: str, tmp_path: Path) -> None:
    tier = OffloadTier(
        kind, max_bytes=3 * 64 if kind == "cpu" else 3 * 300, directory=tmp_path if kind == "disk" else None
    )
    for i in range(3):
        assert tier.put(f"k{i}", _entry(i))
    assert tier.touch("k0")  # k1 is now the least recently used
    assert tier.put("k3", _entry(3))
    assert "k1" not in tier and all(f"k{i}" in tier for i in (0, 2, 3))
    assert tier.stats.evictions == 1 and tier.stats.blocks == 3
    got = tier.get("k2")
    assert got is not None and torch.equal(got["k.0"], _entry(2)["k.0"])
    assert not tier.put("huge", _entry(0, size=4096))  # over the whole budget: not kept
    tier.check_invariants()
    assert tier.clear() == 3 and tier.stats.bytes == 0
    tier.check_invariants()


def test_a_directory_the_tier_makes_is_private_to_its_owner(tmp_path: Path) -> None:
    """Whoever can write to offload_dir chooses what the store serves (docs/memory.md): one prefixkv makes is
    not writable, nor readable, by others."""
    OffloadTier("disk", directory=tmp_path / "new" / "tier")
    assert (tmp_path / "new" / "tier").stat().st_mode & 0o777 == 0o700


def test_chunk_keys_chain_the_whole_prefix() -> None:
    a = chunk_keys([1, 2, 3, 4], 2, 2)
    assert chunk_keys([9, 2, 3, 4], 2, 2)[1] != a[1]  # same last block, another prefix: another key
    assert chunk_keys([1, 2, 3, 4, 5], 2, 2) == a


def test_arguments_are_checked(llama64: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="offload must be None"):
        PrefixStore(llama64, offload="gpu")
    with pytest.raises(ValueError, match="needs offload_dir"):
        PrefixStore(llama64, offload="disk")
    with pytest.raises(ValueError, match="max_offload_memory='1MiB' bounds a second tier, and none is asked for"):
        PrefixStore(llama64, max_offload_memory="1MiB")
    with pytest.raises(ValueError, match="for offload='disk'"):
        PrefixStore(llama64, offload="cpu", offload_dir=tmp_path)


# -- a store over a tier ------------------------------------------------------------------------------


def _fill(model: Any, store: PrefixStore, seeds: range, n: int = 37) -> list[torch.Tensor]:
    prompts = [random_tokens(n, seed=s)[None] for s in seeds]
    for ids in prompts:
        assert compare(model, store, ids, do_sample=False).max_diff <= 1e-6
    return prompts


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_evicted_prefixes_come_back_from_the_tier_exactly(llama64: Any, kind: str, tmp_path: Path) -> None:
    directory = tmp_path if kind == "disk" else None
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload=kind, offload_dir=directory) as store:
        first, *_ = _fill(llama64, store, range(3))  # 11 blocks each: the first two calls' prefixes are evicted
        assert store.stats.evictions > 0 and store.stats.offload is not None and store.stats.offload.blocks >= 11
        assert store.blocks._trie.match(first[0].tolist()).length < 36
        again = compare(llama64, store, first, do_sample=False)
        assert again.same_tokens and again.max_diff <= 1e-6
        assert again.cache.stats.cached_tokens == 36  # the prompt's 9 whole blocks, from the tier
        o = store.stats.offload
        assert o is not None and o.restored >= 9 and o.hit_tokens >= 36 - store.blocks._trie.match([]).length
        assert f"{kind} tier" in prefixkv.display.store_html(store)


def test_offload_dir_alone_keeps_evicted_blocks_on_disk(llama64: Any, tmp_path: Path) -> None:
    """Issue 43: ``offload_dir=`` without ``offload=`` was taken, and the store had no second tier (0 files
    written). The directory names the one tier kept in files: it is the disk tier, which brings evicted blocks back
    exactly."""
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload_dir=tmp_path) as store:
        first, *_ = _fill(llama64, store, range(3))
        o = store.stats.offload
        assert o is not None and o.kind == "disk" and o.blocks == len(list(tmp_path.glob("*.safetensors"))) >= 9
        again = compare(llama64, store, first, do_sample=False)
        assert again.same_tokens and again.max_diff <= 1e-6 and again.cache.stats.cached_tokens == 36
        store.check_invariants()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_clear_empties_the_tier_too(llama64: Any, kind: str, tmp_path: Path) -> None:
    """``store.clear()`` drops what the second tier holds, not only the pool's prefixes: a later request for a
    prompt whose blocks were offloaded restores nothing, computes its whole prompt and gets stock's logits, and
    the ordinary request after it reuses what that one published, with stock's logits too."""
    directory = tmp_path if kind == "disk" else None
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload=kind, offload_dir=directory) as store:
        first, *_ = _fill(llama64, store, range(3))  # the first prompt's 9 whole blocks are evicted into the tier
        o = store.stats.offload
        assert o is not None and o.blocks >= 9 and store.blocks._trie.match(first[0].tolist()).length < 36
        store.clear()
        o = store.stats.offload
        assert o is not None and o.blocks == 0 and o.bytes == 0 and store.stats.blocks_used == 0
        assert directory is None or list(directory.iterdir()) == []  # the files go too
        again = compare(llama64, store, first, do_sample=False)
        assert again.cache.stats.cached_tokens == 0 and again.max_diff <= 1e-6 and again.same_tokens
        o = store.stats.offload
        assert o is not None and o.restored == 0
        later = compare(llama64, store, first, do_sample=False)
        assert later.cache.stats.cached_tokens == 36 and later.max_diff <= 1e-6 and later.same_tokens


def test_the_tier_keeps_its_budget_and_drops_least_recently_used(llama64: Any) -> None:
    block = PrefixStore(llama64, block_size=BS).bytes_per_block
    with PrefixStore(llama64, block_size=BS, num_blocks=12, offload="cpu", max_offload_memory=10 * block) as store:
        prompts = _fill(llama64, store, range(5))
        o = store.stats.offload
        assert o is not None and o.bytes <= 10 * block and o.evictions > 0
        store.check_invariants()
        oldest = compare(llama64, store, prompts[0], do_sample=False)  # dropped from both tiers: recomputed
        assert oldest.cache.stats.cached_tokens == 0 and oldest.max_diff <= 1e-6


def test_a_disk_tier_outlives_its_store(llama64: Any, tmp_path: Path) -> None:
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload="disk", offload_dir=tmp_path) as store:
        first, *_ = _fill(llama64, store, range(3))
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload="disk", offload_dir=tmp_path) as later:
        o = later.stats.offload
        assert o is not None and o.blocks == len(list(tmp_path.glob("*.safetensors"))) > 0
        again = compare(llama64, later, first, do_sample=False)
        assert again.cache.stats.cached_tokens == 36 and again.max_diff <= 1e-6


@pytest.mark.parametrize(
    "other",
    [
        dict(model_seed=1),
        dict(kv_dtype="int8"),
        dict(block_size=8),
        dict(invariant=True),
        dict(invariant=True, chunk_size=8),
    ],
    ids=["another model", "quantized", "another block size", "the invariant schedule", "another chunk size"],
)
def test_a_disk_tier_of_another_store_is_not_read(llama64: Any, tmp_path: Path, other: dict[str, Any]) -> None:
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload="disk", offload_dir=tmp_path) as store:
        _fill(llama64, store, range(3))
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64, seed=other.pop("model_seed", 0))
    kw = {"block_size": BS, "num_blocks": 16, "offload": "disk", "offload_dir": tmp_path, **other}
    with PrefixStore(model, **kw) as theirs:  # the files of another store are left alone, never listed
        assert theirs.stats.offload is not None and theirs.stats.offload.blocks == 0


def test_a_damaged_block_file_is_dropped_and_recomputed(llama64: Any, tmp_path: Path) -> None:
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload="disk", offload_dir=tmp_path) as store:
        first, *_ = _fill(llama64, store, range(3))
        keys = chunk_keys(first[0].tolist(), BS, 9)
        damaged = store.tier.path(keys[4]) if store.tier is not None else tmp_path
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF  # one bit of K/V
        damaged.write_bytes(bytes(data))
        with pytest.warns(UserWarning, match="fails its checksum"):
            again = compare(llama64, store, first, do_sample=False)
        assert again.cache.stats.cached_tokens < 36 and again.max_diff <= 1e-6  # the rest was recomputed
        assert not damaged.exists()
        store.check_invariants()


def _wider_k(t: dict[str, torch.Tensor]) -> None:
    t["k.0"] = torch.cat([t["k.0"], t["k.0"][..., :1]], dim=-1)


def _nan(t: dict[str, torch.Tensor]) -> None:
    t["v.1"][0, 1, 0, 0] = float("nan")


@pytest.mark.parametrize(
    ("plant", "why"),
    [(_wider_k, "does not hold the K/V its metadata names"), (lambda t: t.pop("v.1"), "v.1 is missing"), (_nan, "NaN")],
    ids=["a wider K", "a missing V", "NaN"],
)
def test_a_block_file_with_a_right_checksum_but_wrong_tensors_is_dropped_and_recomputed(
    llama64: Any, tmp_path: Path, plant: Any, why: str
) -> None:
    """Issue 43, review #6: a file whose checksum and metadata are right but whose tensors are not what the metadata
    names (another writer of a shared offload_dir) made every request sharing its prefix raise (``index_copy_()``,
    ``KeyError: 'v.1'``) or be served NaN logits, and the file stayed. It is dropped with a warning and its blocks
    recomputed, exactly; a later ordinary request reuses them, exactly."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from prefixkv.kv.prefix_file import checksum

    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload="disk", offload_dir=tmp_path) as store:
        first, *_ = _fill(llama64, store, range(3))
        assert store.tier is not None
        planted = store.tier.path(chunk_keys(first[0].tolist(), BS, 9)[4])
        with safe_open(str(planted), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        plant(tensors)
        save_file(tensors, str(planted), metadata={**meta, "checksum": checksum(tensors, meta)})
        with pytest.warns(UserWarning, match=why):
            again = compare(llama64, store, first, do_sample=False)
        assert again.same_tokens and again.max_diff <= 1e-6, again.max_diff
        assert again.cache.stats.cached_tokens == 16  # the 4 blocks before the planted one, from the tier
        assert not planted.exists()
        later = compare(llama64, store, first, do_sample=False)  # what the last call recomputed and published
        assert later.same_tokens and later.max_diff <= 1e-6 and later.cache.stats.cached_tokens == 36
        store.check_invariants()


_WRITER = """
import sys, torch
from prefixkv.kv.tier import OffloadTier
tier = OffloadTier("disk", directory=sys.argv[1], meta={"format": "prefixkv.block"})
print("ready", flush=True)
i = 0
while True:
    tier.put(f"{i:064x}", {"k.0": torch.full((1, 256, 64, 16), float(i))})
    i += 1
"""


def test_a_writer_killed_mid_write_leaves_no_file_that_loads(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(prefixkv.__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.safetensors"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file to drop: a cut write left only its temporary name
        tier = OffloadTier("disk", directory=tmp_path, meta={"format": "prefixkv.block"})
    assert len(tier) >= 3
    for i in range(len(tier)):
        got = tier.get(f"{i:064x}")
        assert got is not None and bool((got["k.0"] == float(i)).all())
    tier.check_invariants()


# -- namespaces: adapters ----------------------------------------------------------------------------------------


def _adapted() -> Any:
    """A fresh float64 Llama with two LoRA adapters (random, so that each changes K/V), ``fr`` active."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(prefixkv.models.tiny_model("llama", dtype=torch.float64), config, adapter_name="fr")
    wrapped.add_adapter("de", peft.LoraConfig(r=4, target_modules=["k_proj", "v_proj"], init_lora_weights=False))
    wrapped.set_adapter("fr")
    return wrapped


def _under(wrapped: Any, adapter: str) -> Any:
    """A context in which ``adapter`` is active (``"off"``: adapters disabled)."""
    if adapter == "off":
        return wrapped.disable_adapter()
    wrapped.set_adapter(adapter)
    return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize(("first", "then"), [("fr", "off"), ("off", "fr"), ("fr", "de")])
def test_kv_offloaded_under_one_adapter_never_come_back_under_another(
    kind: str, first: str, then: str, tmp_path: Path
) -> None:
    """K/V computed under ``first`` (an adapter, or adapters disabled) and evicted into the tier are never
    restored under ``then``: that request reuses nothing and gets stock's logits under ``then``; a later
    ordinary request under ``first`` brings them back from the tier and gets stock's logits too."""
    wrapped = _adapted()
    ids = torch.cat([random_tokens(36, seed=41), random_tokens(5, seed=42)])[None]
    directory = tmp_path if kind == "disk" else None
    with PrefixStore(wrapped, block_size=BS, num_blocks=16, offload=kind, offload_dir=directory) as store:
        with _under(wrapped, first):
            assert compare(wrapped, store, ids, do_sample=False).max_diff <= 1e-6
        with store.blocks.lock:
            store.blocks.room.ensure_free(16)  # every cached block evicted into the tier
        o = store.stats.offload
        assert store.stats.blocks_used == 0 and o is not None and o.blocks >= 10
        with _under(wrapped, then):
            other = compare(wrapped, store, ids, do_sample=False)
        assert other.cache.stats.cached_tokens == 0 and other.max_diff <= 1e-6 and other.same_tokens
        assert store.stats.offload is not None and store.stats.offload.restored == 0
        with _under(wrapped, first):
            again = compare(wrapped, store, ids, do_sample=False)
        assert again.cache.stats.cached_tokens == 40 and again.max_diff <= 1e-6 and again.same_tokens
        assert store.stats.offload is not None and store.stats.offload.restored >= 10
