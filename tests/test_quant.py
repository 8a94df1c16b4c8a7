"""8-bit K/V (``kv_dtype="int8"`` / ``"fp8"``): the pool against a float reference under random fills, the
memory per token with scales, the stated fidelity on a tiny model, and quantized files kept apart from
unquantized ones (refused both ways, converted explicitly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixkv
from prefixkv import PersistError, PrefixStore
from prefixkv.persist import convert
from prefixkv.pool import BlockPool, LayerSpec, block_bytes

CPU = torch.device("cpu")
INT8_TOL = 5e-3  # logits of the tiny float64 Llama (|logits| < 1): measured below 1.5e-3
FP8_TOL = 3e-2  # e4m3 keeps 3 mantissa bits: measured 6e-3


# -- memory --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_memory_per_token_with_scales(kv_dtype: str) -> None:
    # SmolLM2-135M's attention (30 layers of 3 KV heads x 64) and the default block of 16 tokens
    def per_block(dtype: torch.dtype, kv: str | None = None) -> int:
        return block_bytes([LayerSpec(3, 64, CPU, dtype)] * 30, 16, kv)

    quantized = per_block(torch.float32, kv_dtype)
    assert quantized == 30 * 2 * (16 * 3 * 64 + 3 * 4)  # 1-byte codes and a float32 scale per head, K and V
    assert quantized / per_block(torch.bfloat16) <= 0.53
    assert quantized / per_block(torch.float32) <= 0.27


def test_the_pool_holds_what_bytes_per_block_says(llama64: Any) -> None:
    store = PrefixStore(llama64, block_size=16, kv_dtype="int8", max_memory="64KiB")
    pool = store.pool
    held = sum(t.numel() * t.element_size() for t in (*pool.keys, *pool.values, *pool.key_scales, *pool.value_scales))
    assert held == pool.capacity * store.bytes_per_block
    plain = PrefixStore(llama64, block_size=16, dtype=torch.bfloat16, max_memory="64KiB")
    assert store.max_blocks is not None and plain.max_blocks is not None
    assert store.max_blocks >= 1.8 * plain.max_blocks  # about twice the prefixes of bf16 in the same memory
    for s in (store, plain):
        s.close()


# -- the pool against a float reference -----------------------------------------------------------------


def _pool(kv_dtype: str, blocks: int = 4, bs: int = 4) -> BlockPool:
    return BlockPool([LayerSpec(2, 8, CPU, torch.float32)], bs, blocks, kv_dtype)


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    magnitudes=st.lists(st.floats(0.01, 100.0), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_filling_blocks_in_random_chunks_stays_within_the_stated_bound(
    chunks: list[int], magnitudes: list[float], seed: int
) -> None:
    """A row filled a few tokens at a time: each value reads back within half a step of its block's final
    scale per write into that block since it was written (each write may re-quantize it once)."""
    bs, length = 4, min(sum(chunks), 16)
    pool = _pool("int8", blocks=length // bs + 2, bs=bs)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor(magnitudes)[torch.randint(0, 8, (length,), generator=gen)]  # wildly varying tokens
    ref = torch.randn(1, 2, length, 8, generator=gen, dtype=torch.float64) * scale[None, None, :, None]
    slots = torch.arange(bs, bs + length)[None]  # block 0 is the null block
    requantized = torch.zeros(length)  # how many writes touched each token's block after it was written
    pos = 0
    for q in chunks:
        q = min(q, length - pos)
        if q <= 0:
            break
        pool.write(0, slots[:, pos : pos + q], ref[:, :, pos : pos + q], ref[:, :, pos : pos + q])
        touched = {(s // bs) for s in range(pos, pos + q)}
        requantized[: pos + q] += torch.tensor([float(p // bs in touched) for p in range(pos + q)])
        pos += q
    keys, values = pool.gather(0, slots[:, :pos])
    assert torch.equal(keys, values)
    step = pool.key_scales[0][torch.arange(pos) // bs + 1]  # [pos, heads]
    bound = 0.5 * step.T[None, :, :, None] * requantized[:pos][None, None, :, None] * (1 + 1e-5)
    assert ((keys.double() - ref[:, :, :pos]).abs() <= bound).all()


def test_codes_stay_put_while_the_maximum_does_not_grow() -> None:
    """The largest value first, then token by token: the same codes as quantizing the block at once."""
    x = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    x[:, :, 0] = 10.0
    one_by_one, at_once = _pool("int8"), _pool("int8")
    for t in range(4):
        one_by_one.write(0, torch.tensor([[4 + t]]), x[:, :, t : t + 1], x[:, :, t : t + 1])
    at_once.write(0, torch.arange(4, 8)[None], x, x)
    assert torch.equal(one_by_one.keys[0], at_once.keys[0])
    assert torch.equal(one_by_one.key_scales[0], at_once.key_scales[0])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_stale_slots_of_a_reused_block_do_not_widen_its_scale(kv_dtype: str) -> None:
    pool = _pool(kv_dtype)
    big, small = torch.full((1, 2, 4, 8), 1000.0), torch.full((1, 2, 2, 8), 0.5)
    pool.write(0, torch.arange(4, 8)[None], big, big)  # block 1's earlier life
    pool.write(0, torch.arange(4, 6)[None], small, small)  # freed, reused: its slots 0..1 written again
    top = 127.0 if kv_dtype == "int8" else 448.0
    assert torch.allclose(pool.key_scales[0][1], torch.tensor(0.5 / top))
    keys, _ = pool.gather(0, torch.arange(4, 6)[None])
    assert torch.allclose(keys, small)


def test_copy_on_write_of_a_part_block_keeps_the_copied_slots() -> None:
    pool = _pool("int8")
    x = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    pool.write(0, torch.arange(4, 8)[None], x, x)
    pool.copy_block(1, 2, 2)
    before, _ = pool.gather(0, torch.arange(8, 10)[None])
    assert torch.equal(before, pool.gather(0, torch.arange(4, 6)[None])[0])
    y = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(2)) * 0.01
    pool.write(0, torch.tensor([[10]]), y, y)  # a narrower scale: the copied slots are rounded once more
    after, _ = pool.gather(0, torch.arange(8, 10)[None])
    step = pool.key_scales[0][2]
    assert ((after - x[:, :, :2]).abs() <= (0.5 * step + 0.5 * pool.key_scales[0][1])[None, :, None, None]).all()


# -- end to end on a tiny model ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kv_dtype", "tol"), [("int8", INT8_TOL), ("fp8", FP8_TOL)])
def test_generate_cold_and_warm_within_the_stated_tolerance(llama64: Any, kv_dtype: str, tol: float) -> None:
    system = random_tokens(32, seed=5)
    with PrefixStore(llama64, block_size=4, kv_dtype=kv_dtype) as store:
        cold = compare(llama64, store, torch.cat([system, random_tokens(5, seed=6)])[None], do_sample=False)
        warm = compare(llama64, store, torch.cat([system, random_tokens(5, seed=7)])[None], do_sample=False)
    assert warm.cache.stats.cached_tokens == 32
    for result in (cold, warm):
        assert result.same_tokens and 0 < result.max_diff <= tol  # not exact, and not far


# -- files: kept apart, converted explicitly ----------------------------------------------------------------


def _saved(model: Any, path: Path, kv_dtype: str | None) -> tuple[PrefixStore, torch.Tensor]:
    store = PrefixStore(model, block_size=4, kv_dtype=kv_dtype)
    ids = random_tokens(21, seed=8)[None]
    compare(model, store, ids, do_sample=False)
    store.save(path)
    return store, ids


def test_a_quantized_file_loads_into_a_quantized_store_with_the_same_codes(llama64: Any, tmp_path: Path) -> None:
    store, ids = _saved(llama64, tmp_path / "q.safetensors", "int8")
    loaded = PrefixStore.load(tmp_path / "q.safetensors", llama64)
    assert loaded.kv_dtype == "int8" and loaded.stats.cached_tokens == store.stats.cached_tokens
    mine, theirs = store._trie.match(ids[0].tolist()), loaded._trie.match(ids[0].tolist())
    a, b = store.pool.read_blocks(mine.blocks), loaded.pool.read_blocks(theirs.blocks)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert compare(llama64, loaded, ids, do_sample=False).cache.stats.cached_tokens == 20
    for s in (store, loaded):
        s.close()


def test_quantized_and_unquantized_files_are_refused_by_each_other(llama64: Any, tmp_path: Path) -> None:
    plain, _ = _saved(llama64, tmp_path / "plain.safetensors", None)
    quant, _ = _saved(llama64, tmp_path / "int8.safetensors", "int8")
    with pytest.raises(PersistError, match=r"unquantized.*convert it explicitly with PrefixStore.convert"):
        PrefixStore.load(tmp_path / "plain.safetensors", llama64, kv_dtype="int8")
    with pytest.raises(PersistError, match="int8, the store unquantized"):
        plain.merge(tmp_path / "int8.safetensors")
    with pytest.raises(PersistError, match="the store int8"):
        quant.merge(tmp_path / "plain.safetensors")
    with pytest.raises(PersistError, match="the store fp8"):
        PrefixStore.load(tmp_path / "int8.safetensors", llama64, kv_dtype="fp8")
    for s in (plain, quant):
        s.close()


def test_convert_both_ways(llama64: Any, tmp_path: Path) -> None:
    plain, ids = _saved(llama64, tmp_path / "plain.safetensors", None)
    convert(tmp_path / "plain.safetensors", tmp_path / "int8.safetensors", "int8")
    quant = PrefixStore.load(tmp_path / "int8.safetensors", llama64)
    assert quant.kv_dtype == "int8" and quant.stats.cached_tokens == plain.stats.cached_tokens
    warm = compare(llama64, quant, ids, do_sample=False)
    assert warm.cache.stats.cached_tokens == 20 and warm.same_tokens and warm.max_diff <= INT8_TOL
    convert(tmp_path / "int8.safetensors", tmp_path / "back.safetensors", None)
    back = PrefixStore.load(tmp_path / "back.safetensors", llama64)
    assert back.kv_dtype is None and back.dtype == torch.float64
    again = compare(llama64, back, ids, do_sample=False)  # the quantized values, now in float64
    assert again.cache.stats.cached_tokens == 20 and again.max_diff <= INT8_TOL
    for s in (plain, quant, back):
        s.close()


def test_kv_dtype_is_checked(llama64: Any) -> None:
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        PrefixStore(llama64, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        convert("unused", "unused", "float8")


def test_the_store_view_names_the_storage(llama64: Any) -> None:
    with PrefixStore(llama64, block_size=4, kv_dtype="int8") as store:
        assert "int8 with a float32 scale per block and KV head" in prefixkv.display.store_html(store)
