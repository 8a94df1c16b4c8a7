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
from safetensors import safe_open
from safetensors.torch import save_file

import prefixkv
from prefixkv import PersistError, PrefixStore
from prefixkv.persist import checksum, convert
from prefixkv.pool import BlockPool, LayerSpec, block_bytes, rotation

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
    assert quantized == 30 * 2 * 16 * 3 * (64 + 2)  # 1-byte codes and a bfloat16 scale per token and head, K and V
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


def _scales(pool: BlockPool, slots: torch.Tensor) -> torch.Tensor:
    """The K scales of the given slots of layer 0, ``[heads, len(slots)]`` float64."""
    return pool.key_scales[0].view(pool.key_scales[0].shape[0], -1)[:, slots].double()


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    magnitudes=st.lists(st.floats(0.01, 100.0), min_size=8, max_size=8),
    kv_dtype=st.sampled_from(["int8", "fp8"]),
    seed=st.integers(0, 2**16),
)
def test_filling_blocks_in_random_chunks_stays_within_the_stated_bound(
    chunks: list[int], magnitudes: list[float], kv_dtype: str, seed: int
) -> None:
    """A row filled a few tokens at a time, tokens of wildly varying size: each token's scale is at most 2%
    above the absolute maximum of its turned head vector over the largest code, and never below it. int8:
    each turned value reads back within half a step, so the token's error (a vector, whose length turning
    back keeps) is at most half a step times sqrt(head_dim); fp8 (e4m3, 3 mantissa bits): each turned value
    within 1/16 of its size plus half the smallest step."""
    bs, length, dim = 4, min(sum(chunks), 16), 8
    pool = _pool(kv_dtype, blocks=length // bs + 2, bs=bs)
    gen = torch.Generator().manual_seed(seed)
    size = torch.tensor(magnitudes)[torch.randint(0, 8, (length,), generator=gen)]
    ref = torch.randn(1, 2, length, dim, generator=gen, dtype=torch.float64) * size[None, None, :, None]
    ref[..., 0] *= 30  # one channel far larger than the rest, as in K
    slots = torch.arange(bs, bs + length)[None]  # block 0 is the null block
    pos = 0
    for q in chunks:
        q = min(q, length - pos)
        if q <= 0:
            break
        pool.write(0, slots[:, pos : pos + q], ref[:, :, pos : pos + q], ref[:, :, pos : pos + q])
        pos += q
    keys, values = pool.gather(0, slots[:, :pos])
    assert torch.equal(keys, values)
    scale = _scales(pool, slots[0, :pos])[None, :, :, None]  # [1, heads, pos, 1]
    turned, r = ref[:, :, :pos] @ rotation(dim).double(), rotation(dim).double()
    amax = turned.abs().amax(-1, keepdim=True)
    top = 127.0 if kv_dtype == "int8" else 448.0
    assert (scale * top >= amax * (1 - 1e-6)).all() and (scale * top <= amax * 1.02).all()
    err = keys.double() @ r - turned  # the error of each turned value
    if kv_dtype == "int8":
        assert (err.abs() <= 0.5 * scale * (1 + 1e-5)).all()
        assert ((keys.double() - ref[:, :, :pos]).norm(dim=-1, keepdim=True) <= 0.5 * scale * dim**0.5 * 1.0001).all()
    else:
        assert (err.abs() <= turned.abs() / 16 + 2**-10 * scale).all()


def test_turning_spreads_one_large_channel() -> None:
    """A K-like token (one channel 100 times the others): per-token int8 without turning would give the
    small channels steps of 100/127; turned, the whole token reads back within 1% of its length."""
    x = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(3))
    x[..., 0] = 100.0
    pool = _pool("int8")
    pool.write(0, torch.tensor([[4]]), x, x)
    keys, _ = pool.gather(0, torch.tensor([[4]]))
    assert float((keys - x).norm(dim=-1).max()) <= 0.01 * float(x.norm(dim=-1).min())
    small = (keys - x)[..., 1:].abs().max()
    assert float(small) < 0.5 * 100 / 127  # finer than half a step of the unturned grid


@pytest.mark.parametrize("head_dim", [8, 64, 80, 96])
def test_rotation_is_orthogonal(head_dim: int) -> None:
    r = rotation(head_dim).double()
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_appending_never_changes_the_tokens_already_written(kv_dtype: str) -> None:
    """Token by token, a large one last: the same codes and scales as writing the block at once."""
    x = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    x[:, :, 3] = 1000.0
    one_by_one, at_once = _pool(kv_dtype), _pool(kv_dtype)
    for t in range(4):
        one_by_one.write(0, torch.tensor([[4 + t]]), x[:, :, t : t + 1], x[:, :, t : t + 1])
    at_once.write(0, torch.arange(4, 8)[None], x, x)
    assert torch.equal(one_by_one.keys[0], at_once.keys[0])
    assert torch.equal(one_by_one.key_scales[0], at_once.key_scales[0])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_reused_block_reads_only_its_new_tokens(kv_dtype: str) -> None:
    pool = _pool(kv_dtype)
    big, small = torch.full((1, 2, 4, 8), 1000.0), torch.full((1, 2, 2, 8), 0.5)
    pool.write(0, torch.arange(4, 8)[None], big, big)  # block 1's earlier life
    pool.write(0, torch.arange(4, 6)[None], small, small)  # freed, reused: its slots 0..1 written again
    keys, _ = pool.gather(0, torch.arange(4, 6)[None])
    # the largest turned value of a small token: all its size in one channel after the Hadamard turn
    top, amax = (127.0 if kv_dtype == "int8" else 448.0), 0.5 * 8**0.5
    assert float(_scales(pool, torch.arange(4, 6)).max()) <= amax / top * 1.02  # the big tokens left no trace
    assert torch.allclose(keys, small, rtol=0, atol=0.5 / 16)


def test_copy_on_write_of_a_part_block_keeps_the_copied_slots() -> None:
    pool = _pool("int8")
    x = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    pool.write(0, torch.arange(4, 8)[None], x, x)
    pool.copy_block(1, 2, 2)
    before, _ = pool.gather(0, torch.arange(8, 10)[None])
    assert torch.equal(before, pool.gather(0, torch.arange(4, 6)[None])[0])
    y = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(2)) * 100
    pool.write(0, torch.tensor([[10]]), y, y)  # a much larger token appended to the copy
    assert torch.equal(pool.gather(0, torch.arange(8, 10)[None])[0], before)


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


def test_a_file_with_the_old_scale_per_block_is_refused(llama64: Any, tmp_path: Path) -> None:
    """Format version 1 kept one float32 scale per block and head, and no turned head vectors; read as
    per-token scales it would be misread, so it is refused with what to do."""
    quant, _ = _saved(llama64, tmp_path / "int8.safetensors", "int8")
    with safe_open(str(tmp_path / "int8.safetensors"), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for name in [n for n in tensors if "_scale." in n]:
        tensors[name] = tensors[name].float().amax(dim=1)  # [blocks, kv_heads] float32: the old layout
    meta["format_version"] = "1"
    meta["checksum"] = checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"})
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    with pytest.raises(PersistError, match=r"one scale per block \(format version 1"):
        PrefixStore.load(tmp_path / "old.safetensors", llama64)
    with pytest.raises(PersistError, match="format version 1"):
        quant.merge(tmp_path / "old.safetensors")
    quant.close()


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
        assert "int8 with a bfloat16 scale per token and KV head" in prefixkv.display.store_html(store)


def test_a_store_kept_in_bfloat16_under_a_float32_model(llama64: Any) -> None:
    """``PrefixStore(dtype=torch.bfloat16)`` for a float32 model (K/V kept in half the memory, read back cast):
    logits within bfloat16 rounding of stock, and a second request reusing what the first published gets the
    same logits as the first (to float32 rounding: one forward over 22 tokens against one over 1)."""
    model = prefixkv.models.tiny_model("llama")
    ids = random_tokens(22, seed=5)[None]
    kw: dict[str, Any] = {"max_new_tokens": 5, "do_sample": False, "output_logits": True}
    kw["return_dict_in_generate"] = True
    ref = model.generate(ids, **kw)
    with PrefixStore(model, block_size=4, dtype=torch.bfloat16) as store:
        outs = []
        for _ in range(2):
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                outs.append(model.generate(ids, cache=cache, **kw))
        assert cache.stats.cached_tokens == 21  # all but the last prompt token, from what the first published
    first, second = (torch.stack(o.logits) for o in outs)
    assert torch.equal(outs[0].sequences, ref.sequences)
    assert float((first - torch.stack(ref.logits)).abs().max()) < 1e-2
    assert float((first - second).abs().max()) < 1e-5
