"""The attention that reads the blocks (``blocks.blocks_attention``, with the reads ``reads.plan_reads``
makes) against ``scaled_dot_product_attention`` over each row's whole K/V, in float64: random block layouts,
rows sharing leading blocks (cascade), left padding, holes, sliding windows, grouped-query heads, one-token and
longer forwards."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import prefixkv
from prefixkv.attention import blocks, gather, interface, kernels, reads, registry
from prefixkv.attention.blocks import BlocksForward
from prefixkv.attention.planner import lone_fold, plan_reads, table_runs
from prefixkv.base.slots import slot_view


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    batch = draw(st.integers(1, 4))
    q = draw(st.sampled_from([1, 1, 2, 5]))
    pads = [draw(st.integers(0, 6)) for _ in range(batch)]
    held = max(pads) + draw(st.integers(0, 20))  # columns held before this forward, pads included
    # rows share leading blocks: a common prefix of some rows' tables
    share = draw(st.integers(0, 6))
    sharers = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    holes = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    contiguous = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dict(
        bs=bs,
        kv_heads=kv_heads,
        group=group,
        batch=batch,
        q=q,
        pads=pads,
        held=held,
        share=share,
        sharers=sharers,
        holes=holes,
        window=window,
        contiguous=contiguous,
        seed=seed,
    )


def build(layout: dict) -> tuple:
    g = torch.Generator().manual_seed(layout["seed"])
    bs, batch, q, held, pads = layout["bs"], layout["batch"], layout["q"], layout["held"], layout["pads"]
    kv_heads, heads, dim = layout["kv_heads"], layout["kv_heads"] * layout["group"], 4
    need = [-(-max(0, held + q - p) // bs) for p in pads]  # blocks each row's tokens fill after this forward
    num_blocks = 1 + sum(need) + layout["share"] + 4
    free = list(range(1, num_blocks))
    if not layout["contiguous"]:
        free = [free[i] for i in torch.randperm(len(free), generator=g).tolist()]
    shared = [free.pop(0) for _ in range(layout["share"])]
    tables = []
    for i in range(batch):
        # only blocks the row has filled before this forward are shared (a write copies a shared block first)
        table = list(shared[: max(0, held - pads[i]) // bs]) if layout["sharers"][i] and pads[i] == pads[0] else []
        while len(table) < need[i]:
            table.append(free.pop(0))
        tables.append(table)
    pool_k = torch.randn(num_blocks, bs, kv_heads, dim, generator=g, dtype=torch.float64)
    pool_v = torch.randn(num_blocks, bs, kv_heads, dim, generator=g, dtype=torch.float64)
    pool_k[0], pool_v[0] = 0, 0  # block-major while the test fills it; the pool is head-major
    columns = held + q
    # every row's whole K/V by column (pads 0), and the new K/V
    full_k = torch.zeros(batch, kv_heads, columns, dim, dtype=torch.float64)
    full_v = torch.zeros_like(full_k)
    new_k = torch.randn(batch, kv_heads, q, dim, generator=g, dtype=torch.float64)
    new_v = torch.randn(batch, kv_heads, q, dim, generator=g, dtype=torch.float64)
    for i in range(batch):
        for c in range(pads[i], columns):
            t = c - pads[i]
            block, offset = tables[i][t // bs], t % bs
            if c >= held:  # the new columns: update writes them into their slots
                pool_k[block, offset] = new_k[i, :, c - held]
                pool_v[block, offset] = new_v[i, :, c - held]
            full_k[i, :, c] = pool_k[block, offset]
            full_v[i, :, c] = pool_v[block, offset]
    # the model's mask: causal, padding hidden, maybe holes and a sliding window
    mask = torch.ones(batch, 1, q, columns, dtype=torch.bool)
    positions = torch.arange(columns)
    for i in range(batch):
        mask[i, :, :, : pads[i]] = False
        if layout["holes"] and columns - pads[i] > 2:
            hole = pads[i] + int(torch.randint(0, columns - pads[i] - 1, (1,), generator=g))
            mask[i, :, :, hole] = False
    for j in range(q):
        query_column = held + j
        mask[:, :, j, positions > query_column] = False
        if layout["window"] is not None:
            mask[:, :, j, positions <= query_column - layout["window"]] = False
    query = torch.randn(batch, heads, q, dim, generator=g, dtype=torch.float64)
    pool_k, pool_v = pool_k.permute(2, 0, 1, 3).contiguous(), pool_v.permute(2, 0, 1, 3).contiguous()
    return pool_k, pool_v, tables, query, new_k, new_v, full_k, full_v, mask


class _Pool:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys, self.values = [k], [v]

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return slot_view(self.keys[layer]), slot_view(self.values[layer])

    @property
    def kv_slots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:  # what the plan takes, once a step
        return [self.slots(layer) for layer in range(len(self.keys))]

    @property
    def specs(self) -> list[None]:  # one a layer
        return [None] * len(self.keys)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.booleans(), st.booleans())
def test_reading_the_blocks_is_sdpa_over_the_whole_rows(layout: dict, with_mask: bool, fold: bool) -> None:
    # fold: short rows are one gather (as decode steps of small rows read them); else views, cascade and gathers
    pool_k, pool_v, tables, query, new_k, new_v, full_k, full_v, mask = build(layout)
    held, q, batch = layout["held"], layout["q"], layout["batch"]
    plain = not any(layout["pads"]) and not layout["holes"] and layout["window"] is None
    if not with_mask and not plain:
        with_mask = True  # a None mask means: no padding, no holes, no window
    reads, new_from = plan_reads(layout["pads"], tables, held, q, layout["bs"], fold_tokens=1024 if fold else 0)
    forward = BlocksForward(_Pool(pool_k, pool_v), reads, held + q, new_from, lambda layer, k=full_k, v=full_v: (k, v))
    scale = 0.7
    got = blocks.blocks_attention(forward, 0, query, new_k, new_v, mask if with_mask else None, scale)
    want = torch.nn.functional.scaled_dot_product_attention(
        query,
        full_k,
        full_v,
        attn_mask=mask if with_mask else None,
        is_causal=False if with_mask else q > 1 and held == 0,
        scale=scale,
        enable_gqa=True,
    )
    if not with_mask and held and q > 1:
        causal = torch.ones(q, held + q, dtype=torch.bool).tril(held)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, full_k, full_v, attn_mask=causal, scale=scale, enable_gqa=True
        )
    want = want.transpose(1, 2)
    seen = mask.any(dim=-1)[:, 0]  # [B, q]: a query that sees no column has no defined output
    for i in range(batch):
        for j in range(q):
            if seen[i, j]:
                assert torch.allclose(got[i, j], want[i, j], atol=1e-10, rtol=0), (i, j)
            else:
                assert not got[i, j].any()
    assert not math.isnan(got.sum().item())


def test_rows_sharing_leading_blocks_read_them_once() -> None:
    # 3 rows on one 8-block prefix (contiguous), each with 2 blocks of its own, allocated one row after the other:
    # one cascade read of the prefix, one strided view of the rows' own blocks
    prefix = list(range(1, 9))
    tables = [[*prefix, 9 + 2 * i, 10 + 2 * i] for i in range(3)]
    reads, new_from = plan_reads([0, 0, 0], tables, 8 * 4 + 7, 1, 4, fold_tokens=0)
    assert new_from is None
    shared, own = reads
    assert shared.rows == (0, 1, 2) and shared.length == 32 and shared.first_slot == 4 and shared.row_stride is None
    assert own.rows == (0, 1, 2) and own.length == 8 and own.first_slot == 36 and own.row_stride == 8


def test_a_batch_is_one_strided_view_and_one_gather_of_the_decode_blocks() -> None:
    # 4 rows prefilled together (16 blocks each, one after the other), then decode blocks taken in turn
    tables = [[*range(1 + 16 * i, 17 + 16 * i), 65 + i, 69 + i] for i in range(4)]
    reads, _ = plan_reads([0] * 4, tables, 16 * 4 + 5, 1, 4, fold_tokens=0)
    strided, gathered = reads
    assert strided.rows == (0, 1, 2, 3) and strided.length == 64 and strided.row_stride == 64
    assert gathered.rows == (0, 1, 2, 3) and gathered.slots is not None and tuple(gathered.slots.shape) == (4, 6)
    assert gathered.valid is not None and bool(gathered.valid.all())
    # a single row that is one run is one view, nothing else
    (one,) = plan_reads([0], [list(range(3, 20))], 60, 1, 4)[0]
    assert one.rows == (0,) and one.first_slot == 12 and one.length == 61


def test_a_batch_prefilled_together_decodes_as_one_strided_view(monkeypatch: pytest.MonkeyPatch) -> None:
    # the store places a batch's rows in one free range with room after each, so every decode block follows its
    # row's prompt blocks: each row stays one run, the rows evenly spaced, and every decode step is one read
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    steps: list[tuple[int, list[list[int]]]] = []
    original = prefixkv.attention.planner.plan_reads

    def recording(pads: list[int], tables: list[list[int]], start: int, q: int, *rest: Any, **kw: Any) -> Any:
        planned = original(pads, tables, start, q, *rest, **kw)
        if q == 1:  # a decode step
            steps.append((len(planned[0]), [list(t) for t in tables]))
        return planned

    monkeypatch.setattr(prefixkv.attention.planner, "plan_reads", recording)
    folds: list[bool] = []
    lone_fold = prefixkv.attention.planner.lone_fold
    monkeypatch.setattr(prefixkv.attention.planner, "lone_fold", lambda *a: folds.append(lone_fold(*a)) or folds[-1])
    for seed in (1, 2):  # a fresh store, then one whose pool holds what the first call published
        steps.clear()
        ids = torch.stack([random_tokens(18, seed=10 * seed + r) for r in range(3)])
        result = compare(model, store, ids, max_new_tokens=12)
        assert result.same_tokens and result.max_diff <= 1e-6
        assert steps and all(n == 1 for n, _ in steps)
        tables = steps[-1][1]  # 18 + 11 columns: 8 blocks a row
        assert all(len(t) == 8 and t == list(range(t[0], t[0] + 8)) for t in tables)
        assert len({b[0] - a[0] for a, b in itertools.pairwise(tables)}) == 1
    store.close()


def test_a_lone_row_reads_its_cached_prefix_and_its_own_blocks_as_views() -> None:
    # one row: a cached prefix (blocks 3-12), then its own block elsewhere in the pool (others' blocks between):
    # two views, no gather (no index tensors, no padding mask); with more short runs than that, one gather
    prefix = list(range(3, 13))
    reads, _ = plan_reads([0], [[*prefix, 40]], 10 * 4 + 2, 1, 4, fold_tokens=0)
    assert [(r.rows, r.first_slot, r.length, r.slots) for r in reads] == [((0,), 12, 40, None), ((0,), 160, 3, None)]
    reads, _ = plan_reads([0], [[3, 4, 9, 20, 30]], 19, 1, 4, fold_tokens=0)
    assert (
        len(reads) == 1
        and reads[0].slots is not None
        and reads[0].slots.tolist()
        == [[12, 13, 14, 15, 16, 17, 18, 19, 36, 37, 38, 39, 80, 81, 82, 83, 120, 121, 122, 123]]
    )


def test_short_rows_are_one_gather_rather_than_parts_to_merge() -> None:
    # the lone row above, 43 tokens: one gather of its prefix and its own block (one kernel call, no merge); with
    # more tokens than the fold takes, the two views again
    prefix = list(range(3, 13))
    (read,) = plan_reads([0], [[*prefix, 40]], 10 * 4 + 2, 1, 4)[0]
    assert read.slots is not None and read.slots.tolist() == [[*range(12, 52), 160, 161, 162]]
    assert read.offsets is not None and read.offsets.tolist() == [list(range(43))]
    assert read.valid is not None and bool(read.valid.all())
    assert len(plan_reads([0], [[*prefix, 40]], 10 * 4 + 2, 1, 4, fold_tokens=42)[0]) == 2
    # a batch of two short rows of different lengths, each two runs: one gather, padded and masked
    (read,) = plan_reads([0, 4], [[1, 2, 9], [5, 11]], 10, 1, 4)[0]
    assert read.rows == (0, 1) and read.valid is not None
    assert read.valid.tolist() == [[True] * 11, [True] * 7 + [False] * 4]
    assert read.slots is not None and read.slots[1, :7].tolist() == [20, 21, 22, 23, 44, 45, 46]
    assert read.offsets is not None and read.offsets[1, :7].tolist() == list(range(4, 11))
    # the index tensors kept between decode steps give the fresh ones, as rows grow, enter new blocks, are cut
    memo: dict = {}
    grown, cut = [[1, 2, 9, 30], [5, 11, 31]], [[1, 2, 9], [5, 12]]
    for end, tables in [(9, grown), (10, grown), (11, grown), (12, grown), (13, grown), (10, cut), (11, cut)]:
        kept = plan_reads([0, 4], tables, end, 1, 4, fold_memo=memo)[0]
        fresh = plan_reads([0, 4], tables, end, 1, 4)[0]
        assert [(r.rows, r.length, r.slots.tolist(), r.offsets.tolist(), r.valid.tolist()) for r in kept] == [
            (r.rows, r.length, r.slots.tolist(), r.offsets.tolist(), r.valid.tolist()) for r in fresh
        ], end


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_warm_row_whose_own_blocks_lie_apart_decodes_as_stock(monkeypatch: pytest.MonkeyPatch, dtype, fold) -> None:
    # the first call publishes the block holding the prompt's end and its first generated tokens; a second call
    # on that prompt reuses the prefix and gets a block of its own after it: every decode step reads two views,
    # merged by their log-sum-exps (rows too long to fold), or one gather of both (fold), which a lone row reads
    # as whole rows for the model's own attention, without a plan of the blocks. Then an ordinary request reuses
    # what that call published
    model = prefixkv.models.tiny_model("llama", dtype=dtype)
    store = prefixkv.PrefixStore(model, block_size=4)
    plans: list[list[tuple]] = []
    original = prefixkv.attention.planner.plan_reads

    def recording(pads: list[int], tables: list[list[int]], start: int, q: int, *rest: Any, **kw: Any) -> Any:
        planned = original(pads, tables, start, q, *rest, **kw)
        if q == 1:
            plans.append([(r.rows, r.slots is None) for r in planned[0]])
        return planned

    monkeypatch.setattr(prefixkv.attention.planner, "plan_reads", recording)
    folds: list[bool] = []
    lone_fold = prefixkv.attention.planner.lone_fold
    monkeypatch.setattr(prefixkv.attention.planner, "lone_fold", lambda *a: folds.append(lone_fold(*a)) or folds[-1])
    if not fold:
        monkeypatch.setattr(prefixkv.attention.planner, "_FOLD_TOKENS", 0)
    expected = [((0,), True), ((0,), True)]
    tolerance = 1e-6 if dtype == torch.float64 else 1e-4
    ids = random_tokens(23, seed=7)[None]
    for call in range(3):
        plans.clear()
        folds.clear()
        result = compare(model, store, ids, max_new_tokens=12)
        assert result.same_tokens and result.max_diff <= tolerance, (call, result.max_diff)
        if call:
            assert result.cache.stats.cached_tokens >= 20
            if fold:  # a decode step the blocks would read in one gather: whole rows, and no plan of the blocks
                assert folds.count(True) >= 8, (folds, plans)
                assert [((0,), False)] not in plans, "the planner folded a lone row's step"
            else:
                assert any(plan == expected for plan in plans) and not any(folds)
    result = compare(model, store, torch.cat([ids[0], random_tokens(6, seed=8)])[None], max_new_tokens=6)
    assert result.same_tokens and result.max_diff <= tolerance
    store.close()


def test_a_part_every_query_sees_whole_goes_to_the_kernel_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # a 5-token forward after 8 held columns: over the held ones the model's mask is all True (no padding), over
    # the new ones plain causal; the kernel gets no mask there (it runs faster without one), worked out once for
    # all the layers that share the mask, also when the model's mask has a batch dimension of 1 for 2 rows.
    # Under a sliding window both parts keep their masks
    layout = dict(
        bs=4, kv_heads=2, group=2, batch=2, q=5, pads=[0, 0], held=8, share=0, sharers=[False, False], holes=False,
        window=None, contiguous=True, seed=5,
    )  # fmt: skip
    calls: list[tuple[bool, bool]] = []
    original = kernels.attend_masked
    sliced: list[int] = []
    original_read_mask = blocks._read_mask

    def recording(query, key, value, mask, scale, *, causal=False):  # type: ignore[no-untyped-def]
        calls.append((mask.bias is None, causal))
        return original(query, key, value, mask, scale, causal=causal)

    def counting(*args):  # type: ignore[no-untyped-def]
        sliced.append(1)
        return original_read_mask(*args)

    monkeypatch.setattr(blocks, "attend_masked", recording)
    monkeypatch.setattr(blocks, "_read_mask", counting)
    for window, expected in ((None, [(True, False), (True, True)]), (3, [(False, False), (False, False)])):
        pool_k, pool_v, tables, query, new_k, new_v, full_k, full_v, mask = build({**layout, "window": window})
        assert torch.equal(mask[0], mask[1])
        reads, new_from = plan_reads(layout["pads"], tables, 8, 5, 4)
        for model_mask in (mask, mask[:1]):
            pool = _Pool(pool_k, pool_v)
            pool.keys, pool.values = pool.keys * 2, pool.values * 2  # two layers (the same tensors)
            forward = BlocksForward(pool, reads, 13, new_from, lambda layer, k=full_k, v=full_v: (k, v))
            sliced.clear()
            for layer in range(2):  # two layers sharing the model's mask
                calls.clear()
                got = blocks.blocks_attention(forward, layer, query, new_k, new_v, model_mask, None)
                assert [calls[0], calls[-1]] == expected, (window, layer, calls)  # (grouped heads: one call inside)
                want = torch.nn.functional.scaled_dot_product_attention(
                    query, full_k, full_v, attn_mask=mask, enable_gqa=True
                )
                assert torch.allclose(got, want.transpose(1, 2), atol=1e-10, rtol=0)
            assert len(sliced) == len(reads), (window, model_mask.shape)  # each read's mask sliced once, not per layer


def test_merging_two_parts_is_attention_over_their_union() -> None:
    # parts over disjoint columns, some queries seeing columns of one part only, one seeing none at all
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 1, 4, 10, dtype=torch.bool)
    mask[..., 1, :6] = False  # query 1 sees only the second part
    mask[..., 2, 6:] = False  # query 2 only the first
    mask[..., 3, :] = False  # query 3 nothing
    a, lse_a = kernels.attend(q, k[..., :6, :], v[..., :6, :], mask[..., :6], None)
    b, lse_b = kernels.attend(q, k[..., 6:, :], v[..., 6:, :], mask[..., 6:], None)
    merged, total = kernels.merge_by_lse(a, lse_a, b, lse_b)
    whole, lse = kernels.attend(q, k, v, mask, None)
    assert torch.allclose(merged, whole, atol=1e-12, rtol=0) and not merged[..., 3, :].any()
    assert torch.equal(total.isinf(), lse.isinf())
    assert torch.allclose(total[..., :3], lse[..., :3], atol=1e-12, rtol=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "cow", "cut", "publish"]), st.integers(1, 60)), max_size=40))
def test_the_runs_kept_between_forwards_are_those_of_a_fresh_walk(steps: list[tuple[str, int]]) -> None:
    # a row's table grows at its end, has its last block replaced (copy-on-write), is cut, or has a block anywhere
    # replaced by the one the trie held those tokens in (publish); nobody tells the memo: every forward's runs must
    # still equal a walk of the whole table
    memo: dict = {}
    table = [5]
    for kind, value in steps:
        if kind == "append":
            table.append(table[-1] + 1 if value % 3 else value)
        elif kind == "cow":
            table[-1] = value
        elif kind == "publish":
            table[value % len(table)] = 100 + value
        elif len(table) > 1:
            del table[max(1, value % len(table)) :]
        assert table_runs(table, memo) == table_runs(table, None)


def test_a_layer_that_does_not_hand_its_cache_kv_to_the_attention_keeps_whole_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a model whose layer 0 changes K/V between update and attention (here: a copy) must never be served from
    # the blocks: the first forward sees layer 0 miss, the model stays unverified, every step gets whole rows
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    served = ALL_ATTENTION_FUNCTIONS[interface.NAME]

    def copying(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a, **k):
        if module.layer_idx == 0:
            key, value = key.clone(), value.clone()
        return served(module, query, key, value, *a, **k)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, interface.NAME, copying)
    system = random_tokens(30, seed=1)
    for seed in (2, 3):  # cold, then a warm call reusing what the first published
        result = compare(model, store, torch.cat([system, random_tokens(5, seed=seed)])[None])
        assert result.same_tokens and result.max_diff <= 1e-6
    assert result.cache.stats.cached_tokens == 30
    assert not interface.verified(model)
    store.close()


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 3),
    st.sampled_from([1, 2, 3]),
    st.integers(1, 4),
    st.integers(1, 9),
    st.booleans(),
    st.integers(0, 999),
)
def test_the_plain_tensor_attention_is_the_cpu_kernel(
    batch: int, group: int, q: int, n: int, masked: bool, seed: int
) -> None:
    # the path of devices without the CPU kernel (and the fallback of the CUDA one), checked on the CPU
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, 2 * group, q, 4, generator=g, dtype=torch.float64)
    key = torch.randn(batch, 2, n, 4, generator=g, dtype=torch.float64)
    value = torch.randn(batch, 2, n, 4, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, 1, q, n, generator=g) > 0.3 if masked else None
    causal = not masked and q == n
    additive = None if mask is None else torch.zeros(mask.shape, dtype=torch.float64).masked_fill_(~mask, -math.inf)
    want, want_lse = kernels.attend(query, key, value, mask, 0.5, causal=causal)
    got, got_lse = kernels._attend_math(query, key, value, additive, 0.5, causal)
    if mask is not None:  # rows that see nothing: attend() zeroes them; compare the others
        seen = mask.any(dim=-1).expand(batch, 2 * group, q)
        got, got_lse, want, want_lse = got[seen], got_lse[seen], want[seen], want_lse[seen]
    assert torch.allclose(got, want, atol=1e-10, rtol=0) and torch.allclose(got_lse, want_lse, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "name, device, dtype, expected",
    [
        ("auto", "cpu", torch.float32, "blocks"),
        ("auto", "cpu", "int8", "gather"),
        ("auto", "cpu", torch.bfloat16, "gather"),
        ("auto", "cuda", torch.float32, "gather"),
        ("gather", "cpu", torch.float32, "gather"),
        ("blocks", "cuda", torch.float32, "blocks"),
    ],
)
def test_the_backend_is_chosen_by_name_device_and_dtype(name: str, device: str, dtype: Any, expected: str) -> None:
    backend, reason = registry.choose_backend(name, torch.device(device), dtype, model_dtype=torch.float32)
    assert backend.name == expected and reason.startswith(expected + ": ")


@pytest.mark.parametrize("name, dtype", [("flash", torch.float32), ("blocks", "fp8")])
def test_a_backend_that_cannot_read_the_pool_is_refused(name: str, dtype: Any) -> None:
    with pytest.raises(ValueError, match="backend"):
        registry.choose_backend(name, torch.device("cpu"), dtype, model_dtype=torch.float32)


def test_the_gather_backend_attends_over_whole_rows_as_sdpa() -> None:
    # its plan reads nothing in place; attending from it reads every row's whole K/V, with and without a mask
    g = torch.Generator().manual_seed(4)
    full_k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    full_v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    query = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    backend = gather.GatherBackend()
    pool = _Pool(torch.zeros(2, 7, 4, 8, dtype=torch.float64), torch.zeros(2, 7, 4, 8, dtype=torch.float64))
    layout = reads.Layout(pool, [0, 0], [[1, 2, 3], [4, 5, 6]], 6, 3, 4, lambda layer: (full_k, full_v))
    forward = backend.plan(layout, probe=False)
    assert not forward.in_place and type(forward) is reads.ForwardReads  # no reads of its own
    causal = torch.ones(3, 9, dtype=torch.bool).tril(6)[None, None].expand(2, 1, 3, 9)
    for mask in (None, causal):
        call = reads.AttentionCall(torch.nn.Module(), query, full_k, full_v, mask, {"scaling": 0.5})
        assert not backend.servable(forward, call)
        got = backend.attend(forward, 0, call)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, full_k, full_v, attn_mask=causal, scale=0.5, enable_gqa=True
        )
        assert torch.allclose(got, want.transpose(1, 2), atol=1e-10, rtol=0)


def test_eight_rows_on_one_warm_prefix_read_it_once_a_step_and_decode_as_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54's shared-prefix batch, eager: 8 rows on one warm 40-token prefix, 6 tokens each of their own. Every
    decode step reads the prefix's blocks once for all 8 rows (one read of every row, as long as the prefix's whole
    blocks at least), and the call gives stock's tokens and logits (float64); a later ordinary request too."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    prefix = random_tokens(40, seed=41)
    store.warm([prefix], progress=False)
    shared_reads: list[int] = []
    original = prefixkv.attention.planner.plan_reads

    def recording(pads: list[int], tables: list[list[int]], start: int, q: int, *rest: Any, **kw: Any) -> Any:
        planned = original(pads, tables, start, q, *rest, **kw)
        if q == 1:  # a decode step: how many of its reads serve all 8 rows over the whole prefix
            shared_reads.append(sum(1 for r in planned[0] if len(r.rows) == 8 and r.row_stride is None and
                                    r.slots is None and r.length >= 40))  # fmt: skip
        return planned

    monkeypatch.setattr(prefixkv.attention.planner, "plan_reads", recording)
    folds: list[bool] = []
    lone_fold = prefixkv.attention.planner.lone_fold
    monkeypatch.setattr(prefixkv.attention.planner, "lone_fold", lambda *a: folds.append(lone_fold(*a)) or folds[-1])
    ids = torch.stack([torch.cat([prefix, random_tokens(6, seed=50 + r)]) for r in range(8)])
    result = compare(model, store, ids, max_new_tokens=10)
    assert result.same_tokens and result.max_diff <= 1e-10
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [40] * 8
    assert len(shared_reads) == 9 and all(n == 1 for n in shared_reads)
    later = compare(model, store, torch.cat([prefix, random_tokens(9, seed=60)])[None], max_new_tokens=6)
    assert later.same_tokens and later.max_diff <= 1e-10
    store.close()


def _described(reads: list) -> list[tuple]:
    return [
        (r.rows, r.columns, r.length, r.first_slot, r.row_stride, *(None if t is None else t.tolist() for t in r[5:]))
        for r in reads
    ]


@settings(max_examples=300, deadline=None)
@example(runs=[(1, 10), (5, 2)], extra=0, pad=0, rows=1, q=1)  # a warm turn: folded, so whole rows
@example(runs=[(1, 12)], extra=1, pad=0, rows=1, q=1)  # one run: a view of the pool
@example(runs=[(1, 60), (5, 10)], extra=0, pad=0, rows=1, q=1)  # past 1024 tokens: two views
@given(
    runs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=4, unique_by=lambda r: r[0]),
    extra=st.integers(0, 3),
    pad=st.sampled_from([0, 0, 0, 2]),
    rows=st.sampled_from([1, 1, 1, 2]),
    q=st.sampled_from([1, 1, 3]),
)
def test_a_lone_fold_is_exactly_a_step_the_planner_reads_in_one_gather(
    runs: list[tuple[int, int]], extra: int, pad: int, rows: int, q: int
) -> None:
    """The rule that has a lone row's decode step read whole rows (planner.lone_fold) says yes exactly where the
    planner, from scratch, reads the step in one gather of that row (a fold), so the blocks read a row in place
    wherever the planner would read it in place."""
    bs = 16
    table: list[int] = []
    for first, length in runs:  # runs of consecutive blocks, anywhere in the pool
        table += list(range(100 * first, 100 * first + length))
    start = pad + len(table) * bs - extra - q  # the step's new columns lie in the row's last block
    if start < pad + 1:
        return
    pads, tables = [pad] * rows, [list(table) for _ in range(rows)]
    planned, new_from = plan_reads(pads, tables, start, q, bs)
    folded = rows == 1 and q == 1 and new_from is None and len(planned) == 1 and planned[0].slots is not None
    assert lone_fold(pads, tables, start, q, bs) == folded, (planned, new_from)


@pytest.mark.parametrize("seed", range(12))
def test_a_steady_decode_step_reuses_the_last_plan_and_gets_the_fresh_one(seed: int) -> None:
    # decode steps of a few rows on a shared prefix, blocks taken as rows enter them, some copied (copy-on-write)
    # or replaced (the trie) meanwhile, a row forked from another (their part-block shared), steps skipped, the
    # rows moved, the fold threshold crossed on the way: the plan a steady step reuses from the last one
    # (planner.steady_reads) is what planning from scratch gives, and steady steps do occur
    rng = random.Random(seed)
    bs = rng.choice([4, 8])
    batch = rng.randint(1, 4)
    # pads a whole number of blocks apart: a step is steady only where every row's new token is inside its block
    base = rng.randrange(bs)
    pads = [base + bs * rng.randint(0, 1) for _ in range(batch)]
    prefix = list(range(1, 1 + rng.randint(0, 3)))
    tables = [list(prefix) for _ in range(batch)]
    fold = rng.choice([60, 90, 1024])
    fresh_id = 100
    start = max(pads) + len(prefix) * bs + 1
    for r in range(batch):  # each row's blocks up to column start - 1
        while len(tables[r]) * bs < start - pads[r]:
            tables[r].append(fresh_id)
            fresh_id += 2  # apart: each block a run of its own, so the rows fold
    memo: dict = {}
    runs: dict = {}
    steady = 0
    for _ in range(60):
        for r in range(batch):  # the step's allocation: a row entering a new block takes one
            if (start - pads[r]) % bs == 0:
                tables[r].append(fresh_id)
                fresh_id += 2
        if rng.random() < 0.05:  # a step planned elsewhere (a compiled one): the next is not the one after the last
            start += 1
            continue
        if rng.random() < 0.03:  # another layout of the same blocks: every row a block later
            pads = [p + bs for p in pads]
        if batch > 1 and pads[0] == pads[1] and rng.random() < 0.1:  # row 1 a fork of row 0: every block shared
            tables[1] = list(tables[0])
        if rng.random() < 0.1:  # copy-on-write of a row's last block, or the trie's replacement of an earlier one
            r = rng.randrange(batch)
            tables[r][rng.choice([-1, 0])] = fresh_id
            fresh_id += 2
        last = memo.get(None)
        kept = plan_reads(pads, tables, start, 1, bs, runs, fold_tokens=fold, fold_memo={}, step_memo=memo)
        steady += last is not None and memo.get(None) is not None and memo[None].blocks is last.blocks
        fresh = plan_reads(pads, tables, start, 1, bs, fold_tokens=fold)
        assert _described(kept[0]) == _described(fresh[0]), start
        assert kept[1] == fresh[1]
        start += 1
    assert steady > 0
