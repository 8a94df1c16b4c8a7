"""8-bit K/V (``kv_dtype="int8"`` / ``"fp8"``): the pool against a float reference under random fills, the
memory per token with scales, the stated fidelity on a tiny model, and quantized files kept apart from
unquantized ones (refused both ways, converted explicitly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, max_logit_diff, random_tokens, stock_twin
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import prefixkv
from prefixkv import PersistError, PrefixStore
from prefixkv.kv.pool import BlockPool, LayerSpec, block_bytes
from prefixkv.kv.prefix_file import checksum, convert
from prefixkv.kv.quantization import turn, turn_back

CPU = torch.device("cpu")
EXACT = 1e-6  # an 8-bit store against a DynamicCache that quantizes as it does (conftest.QuantizingCache), float64
# quality, not correctness: how far 8-bit K/V move the logits of the tiny float64 Llama (|logits| < 1) from an
# unquantized cache, about 2x the largest measured (int8 1.14e-3, fp8 7.7e-3); both must also stay above 1e-5
INT8_QUALITY = 2.5e-3
FP8_QUALITY = 1.6e-2
GREEDY: dict[str, Any] = dict(
    max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0
)


def _reference(model: Any, ids: torch.Tensor) -> Any:
    """Stock greedy ``generate`` on a copy of ``model`` that prefixkv never touched."""
    return stock_twin(model).generate(ids, **GREEDY)


def _diff(out: Any, ref: Any) -> float:
    return max_logit_diff(out.logits, ref.logits)


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
    r = _matrix(dim)
    turned = ref[:, :, :pos] @ r
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


def _matrix(head_dim: int) -> torch.Tensor:
    """The matrix :func:`turn` applies (``turn(x) = x @ m`` up to float32 rounding), in float64: its rows are
    the turned unit vectors."""
    return turn(torch.eye(head_dim)).double()


@pytest.mark.parametrize("head_dim", [1, 7, 8, 12, 16, 64, 80, 96, 128, 256])
def test_the_turn_is_orthogonal_and_turning_back_inverts_it(head_dim: int) -> None:
    """The matrix is orthogonal to float32 rounding (1e-6; measured at most 9e-8), spreads a lone channel over
    all ``head_dim`` channels (no turned unit vector keeps more than half its length in one channel; for a
    power of two, every entry is ``1 / sqrt(head_dim)`` in float32), and ``turn_back`` undoes ``turn`` within
    float32 rounding of the vector's size (2e-6; measured at most 7e-7)."""
    m = _matrix(head_dim)
    assert torch.allclose(m @ m.T, torch.eye(head_dim, dtype=torch.float64), rtol=0, atol=1e-6)
    if head_dim > 1:
        assert float(m.abs().max()) <= 0.5**0.5
    if head_dim & (head_dim - 1) == 0:
        assert torch.allclose(m.abs(), torch.full_like(m, head_dim**-0.5), rtol=1e-7, atol=0)
    x = torch.randn(64, 3, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 10
    x[..., 0] *= 30  # one large channel, as in K
    assert torch.allclose(turn(x).double(), x.double() @ m, rtol=0, atol=2e-6 * float(x.abs().max()))
    back = turn_back(turn(x))
    assert float((back - x).abs().max()) <= 2e-6 * float(x.abs().max())
    assert turn(x).dtype == back.dtype == torch.float32


@pytest.mark.parametrize("head_dim", [8, 16, 64, 80, 96, 128])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_tokens_codes_never_depend_on_the_tokens_written_or_read_with_it(kv_dtype: str, head_dim: int) -> None:
    """The same 64 tokens written alone and in groups of 3, 4, 7, 16 and 64 rows (and K/V values of every size,
    zeros and negative zeros included): bit-identical codes and scales, and bit-identical values read back
    one slot at a time, a block at a time and all at once. A matmul over the rows (``x @ rotation``) sums in
    an order that depends on how many rows go through it on some CPUs (AVX-512), which this catches there."""
    n, bs = 64, 16
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(1, 2, n, head_dim, generator=gen) * torch.logspace(-6, 3, n)[None, None, :, None]
    x[..., 0] *= 30
    x[:, :, 5] = 0.0
    x[:, :, 6] = -0.0
    x[:, :, 7, ::2] = -0.0
    spec = LayerSpec(2, head_dim, CPU, torch.float32)
    pools = []
    for group in (1, 3, 4, 7, 16, 64):
        pool = BlockPool([spec], bs, n // bs + 1, kv_dtype)
        for start in range(0, n, group):
            end = min(start + group, n)
            pool.write(0, torch.arange(bs + start, bs + end)[None], x[:, :, start:end], x[:, :, start:end])
        pools.append(pool)
    first = pools[0]
    for pool in pools[1:]:
        for mine, theirs in zip(first._stored().values(), pool._stored().values()):
            assert torch.equal(_bits(mine), _bits(theirs))  # bytes, so -0.0 and +0.0 differ
    slots = torch.arange(bs, bs + n)
    together = first.gather(0, slots[None])[0]
    alone = torch.cat([first.gather(0, slots[i : i + 1][None])[0] for i in range(n)], dim=2)
    blocks = first.gather_blocks(0, torch.arange(1, n // bs + 1)[None], n)[0]
    assert torch.equal(_bits(together), _bits(alone)) and torch.equal(_bits(together), _bits(blocks))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as integers of its width, for comparisons that tell -0.0 from +0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


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


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_generate_cold_and_warm_equal_a_cache_that_quantizes_alike(llama64: Any, kv_dtype: str) -> None:
    """Cold and warm (32 tokens reused), an 8-bit store gives the logits of a ``DynamicCache`` that keeps each
    token quantized by the same quantizer, within float64 rounding (measured 0.0 to 3e-17): any logic bug (a
    wrong mask, position or block) shows here at its full size, not hidden under the quantization error."""
    system = random_tokens(32, seed=5)
    with PrefixStore(llama64, block_size=4, kv_dtype=kv_dtype) as store:
        cold = compare(llama64, store, torch.cat([system, random_tokens(5, seed=6)])[None], do_sample=False)
        warm = compare(llama64, store, torch.cat([system, random_tokens(5, seed=7)])[None], do_sample=False)
    assert warm.cache.stats.cached_tokens == 32
    for result in (cold, warm):
        assert result.same_tokens and result.max_diff <= EXACT, result.max_diff


@pytest.mark.parametrize(("kv_dtype", "quality"), [("int8", INT8_QUALITY), ("fp8", FP8_QUALITY)])
def test_quality_of_8bit_kv_against_unquantized(llama64: Any, kv_dtype: str, quality: float) -> None:
    """The quality figure, apart from correctness: an 8-bit store, cold and warm, moves the logits from stock
    ``generate`` by more than rounding (it is not secretly unquantized) and by less than ``quality``."""
    system = random_tokens(32, seed=5)
    prompts = [torch.cat([system, random_tokens(5, seed=s)])[None] for s in (6, 7)]
    refs = [_reference(llama64, ids) for ids in prompts]
    with PrefixStore(llama64, block_size=4, kv_dtype=kv_dtype) as store:
        for ids, ref in zip(prompts, refs):
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                out = llama64.generate(ids, cache=cache, **GREEDY)
            assert torch.equal(out.sequences, ref.sequences)
            assert 1e-5 < _diff(out, ref) <= quality, _diff(out, ref)
    assert cache.stats.cached_tokens == 32


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
    mine, theirs = store.blocks._trie.match(ids[0].tolist()), loaded.blocks._trie.match(ids[0].tolist())
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


def _as_version(saved: Path, out: Path, version: int, old_scales: bool = False) -> Path:
    """``saved`` rewritten as an older prefixkv wrote it (format ``version``, a valid checksum); with
    ``old_scales``, its scales in version 1's layout (one float32 per block and head)."""
    with safe_open(str(saved), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for name in [n for n in tensors if "_scale." in n and old_scales]:
        tensors[name] = tensors[name].float().amax(dim=1)  # [blocks, kv_heads] float32
    meta["format_version"] = str(version)
    meta["checksum"] = checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"})
    save_file(tensors, str(out), metadata=meta)
    return out


def test_quantized_files_of_older_formats_are_refused(llama64: Any, tmp_path: Path) -> None:
    """Format version 1 kept one float32 scale per block and head, version 2 turned head vectors by a matmul
    (``x @ rotation``): their codes mean something else now, so both are refused with what to do."""
    quant, _ = _saved(llama64, tmp_path / "int8.safetensors", "int8")
    v1 = _as_version(tmp_path / "int8.safetensors", tmp_path / "v1.safetensors", 1, old_scales=True)
    v2 = _as_version(tmp_path / "int8.safetensors", tmp_path / "v2.safetensors", 2)
    with pytest.raises(PersistError, match=r"one scale per block \(format version 1.*Save the prefixes again"):
        PrefixStore.load(v1, llama64)
    with pytest.raises(PersistError, match=r"format version 1"):
        quant.merge(v1)
    with pytest.raises(PersistError, match=r"turned by another transform \(format version 2.*version 3\)"):
        PrefixStore.load(v2, llama64)
    with pytest.raises(PersistError, match=r"format version 2"):
        quant.merge(v2)
    quant.close()


def test_unquantized_files_of_older_formats_still_load(llama64: Any, tmp_path: Path) -> None:
    """Unquantized K/V mean the same in every format version: a version 2 file loads, and a later ordinary
    request reusing its blocks gets stock's logits."""
    ids = random_tokens(21, seed=8)[None]
    ref = _reference(llama64, ids)
    plain, _ = _saved(llama64, tmp_path / "plain.safetensors", None)
    plain.close()
    with PrefixStore.load(_as_version(tmp_path / "plain.safetensors", tmp_path / "v2.safetensors", 2), llama64) as old:
        assert old.kv_dtype is None and old.stats.cached_tokens == 28  # 21 prompt and 7 fed generated tokens
        with prefixkv.PagedPrefixCache(old, ids) as cache:
            out = llama64.generate(ids, cache=cache, **GREEDY)
        assert cache.stats.cached_tokens == 20
    assert torch.equal(out.sequences, ref.sequences) and _diff(out, ref) <= EXACT


def test_convert_both_ways(llama64: Any, tmp_path: Path) -> None:
    """A file converted to int8 holds the quantized K/V of the unquantized model (its later layers' K/V come
    from hidden states that attended to unquantized K/V, so no quantizing cache reproduces them): a request
    reusing them is within the int8 quality figure of stock, and so is one reusing them converted back."""
    plain, ids = _saved(llama64, tmp_path / "plain.safetensors", None)
    ref = _reference(llama64, ids)
    convert(tmp_path / "plain.safetensors", tmp_path / "int8.safetensors", "int8")
    convert(tmp_path / "int8.safetensors", tmp_path / "back.safetensors", None)
    for name, kv_dtype in (("int8", "int8"), ("back", None)):
        with PrefixStore.load(tmp_path / f"{name}.safetensors", llama64) as store:
            assert store.kv_dtype == kv_dtype and store.dtype == torch.float64
            assert store.stats.cached_tokens == plain.stats.cached_tokens
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                out = llama64.generate(ids, cache=cache, **GREEDY)
            assert cache.stats.cached_tokens == 20 and torch.equal(out.sequences, ref.sequences)
            assert 1e-5 < _diff(out, ref) <= INT8_QUALITY, _diff(out, ref)  # measured 7.5e-4 and 6.3e-4
    plain.close()


def test_kv_dtype_is_checked(llama64: Any) -> None:
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        PrefixStore(llama64, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        convert("unused", "unused", "float8")


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_the_blocks_backend_over_8bit_blocks_is_refused_at_construction(llama64: Any, invariant: bool) -> None:
    """The 'blocks' backend cannot read 8-bit blocks: every store refuses it when built (issue 32, review #6: an
    invariant store was built, reported the gather, then every cache raised), and the model carries on."""
    with pytest.raises(ValueError, match="the 'blocks' backend reads the pool in the dtype the model computes in"):
        PrefixStore(llama64, block_size=4, kv_dtype="int8", attention="blocks", invariant=invariant)
    with PrefixStore(llama64, block_size=4, kv_dtype="int8", invariant=invariant) as store:
        ids = random_tokens(20, seed=3)[None]
        for warm in (False, True):  # against a DynamicCache that quantizes alike
            run = compare(llama64, store, ids, do_sample=False)
            assert (run.cache.stats.cached_tokens >= 16) == warm
            assert run.same_tokens and run.max_diff <= EXACT, run.max_diff


def test_the_store_view_names_the_storage(llama64: Any) -> None:
    with PrefixStore(llama64, block_size=4, kv_dtype="int8") as store:
        assert "int8 with a bfloat16 scale per token and KV head" in prefixkv.display.store_html(store)


def test_a_store_kept_in_bfloat16_under_a_float32_model() -> None:
    """``PrefixStore(dtype=torch.bfloat16)`` for a float32 model (K/V kept in half the memory, read back cast):
    logits within bfloat16 rounding of stock (6e-4, 2.5x the 2.4e-4 measured) but not equal to them, and a
    second request reusing what the first published gets the first's logits to float32 rounding (1e-6: one
    forward over 22 tokens against one over 1; measured 7.5e-8)."""
    model = prefixkv.models.tiny_model("llama")
    ids = random_tokens(22, seed=5)[None]
    ref = _reference(model, ids)
    with PrefixStore(model, block_size=4, dtype=torch.bfloat16) as store:
        outs = []
        for _ in range(2):
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                outs.append(model.generate(ids, cache=cache, **GREEDY))
        assert cache.stats.cached_tokens == 21  # all but the last prompt token, from what the first published
    for out in outs:
        assert torch.equal(out.sequences, ref.sequences)
        assert 1e-6 < _diff(out, ref) < 6e-4, _diff(out, ref)
    assert _diff(outs[0], outs[1]) < 1e-6
