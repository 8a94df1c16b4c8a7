"""End to end on tiny Llama, Qwen2 and Mistral in float64: cold and warm calls give the logits of stock
generate with DynamicCache (within 1e-6) and the same tokens, while the warm prefill is shorter."""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from conftest import SPELLINGS, cache_kw, compare, left_pad, random_tokens

import prefixkv
from prefixkv.attention.reader import WholeRows
from prefixkv.base.slots import slot_table

FAMILIES = ["llama", "qwen2", "mistral"]
TOL = 1e-6


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> object:
    return prefixkv.models.tiny_model(request.param, dtype=torch.float64)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_cold_then_warm_matches_stock(model: object, sampling: bool, spelling: str) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    system = random_tokens(45, seed=1)
    first = torch.cat([system, random_tokens(6, seed=2)])[None]
    second = torch.cat([system, random_tokens(9, seed=3)])[None]
    kw = dict(do_sample=True, top_k=30, top_p=0.9, temperature=0.8) if sampling else dict(do_sample=False)

    cold = compare(model, store, first, spelling=spelling, **kw)
    assert cold.same_tokens and cold.max_diff <= TOL
    assert cold.cache.stats.cached_tokens == 0
    assert cold.fed_tokens == first.shape[1]

    warm = compare(model, store, second, spelling=spelling, **kw)
    assert warm.same_tokens and warm.max_diff <= TOL
    # 45 shared tokens, 44 of them in whole blocks of 4, and the 45th in the copied part-block
    assert warm.cache.stats.cached_tokens == 45
    assert warm.fed_tokens == second.shape[1] - 45
    store.close()


def test_generated_tokens_are_reused_by_the_next_call(model: object) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    prompt = random_tokens(20, seed=4)[None]
    first = compare(model, store, prompt, max_new_tokens=12)
    turn2 = torch.cat([first.out.sequences, random_tokens(5, seed=5)[None]], dim=1)
    second = compare(model, store, turn2)
    assert second.same_tokens and second.max_diff <= TOL
    # 20 prompt + 11 fed generated tokens were computed; 28 of them fill whole blocks
    assert second.cache.stats.cached_tokens == 28
    store.close()


def test_full_match_still_recomputes_the_last_token(model: object) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    prompt = random_tokens(16, seed=6)[None]
    compare(model, store, prompt)
    again = compare(model, store, prompt)
    assert again.same_tokens and again.max_diff <= TOL
    assert again.cache.stats.cached_tokens == 15
    assert again.fed_tokens == 1
    store.close()


def test_partial_block_is_copied_not_shared(model: object) -> None:
    store = prefixkv.PrefixStore(model, block_size=8)
    base = random_tokens(24, seed=7)
    compare(model, store, base[None])
    used_before = store.stats.blocks_used
    # diverges after 13 tokens: block 0 shared, block 1 copied for its first 5 slots
    other = torch.cat([base[:13], random_tokens(6, seed=8)])[None]
    with prefixkv.PagedPrefixCache(store, other) as cache:
        assert cache.stats.cached_tokens == 13
        assert store.stats.blocks_used == used_before + 1
        shared, copied = cache._rowset.rows[0].table
        assert store.blocks.refcount(shared) == 2 and store.blocks.refcount(copied) == 1
    comparison = compare(model, store, other)
    assert comparison.same_tokens and comparison.max_diff <= TOL
    store.close()


def test_padded_batch_with_warm_and_cold_rows(model: object) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    system = random_tokens(32, seed=9)
    compare(model, store, torch.cat([system, random_tokens(3, seed=10)])[None])
    warm = torch.cat([system, random_tokens(4, seed=11)])
    cold = random_tokens(21, seed=12)
    ids, mask = left_pad([warm, cold])
    result = compare(model, store, ids, mask)
    assert result.same_tokens and result.max_diff <= TOL
    # one offset per batch: the cold row (15 pads, nothing cached) allows skipping 15 columns,
    # all padding for it and 15 cached tokens for the warm row
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [15, 0]
    assert result.fed_tokens == ids.shape[1] - 15
    store.close()


def test_blocks_are_released_on_close_and_on_garbage_collection(model: object) -> None:
    import gc

    store = prefixkv.PrefixStore(model, block_size=4)
    prompt = random_tokens(18, seed=13)[None]
    cache = prefixkv.PagedPrefixCache(store, prompt)
    model.generate(prompt, **cache_kw(cache), max_new_tokens=5, do_sample=False)
    held = sum(cache._rowset.held_blocks().values())
    assert held == 6  # 18 prompt + 4 fed generated tokens = 22 -> 6 blocks
    del cache
    gc.collect()
    store.check_invariants()
    s = store.stats
    assert s.blocks_used == s.blocks_evictable == 5  # only the 5 full blocks stay cached
    assert store.clear() == 5
    assert store.stats.blocks_used == 0
    store.close()


def test_a_cache_finalized_at_interpreter_shutdown_stays_quiet(model: object) -> None:
    # at shutdown a cache still alive is finalized after the modules' globals were set to None; its __del__
    # once reached for contextlib there and printed "Exception ignored in ... __del__" at the end of a script
    import sys

    store = prefixkv.PrefixStore(model, block_size=4)
    prompt = random_tokens(18, seed=13)[None]
    cache = prefixkv.PagedPrefixCache(store, prompt)
    model.generate(prompt, **cache_kw(cache), max_new_tokens=5, do_sample=False)
    module = sys.modules["prefixkv.hf.cache"]
    saved = dict(vars(module))
    unraisable: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        for name in saved:
            if not name.startswith("__"):
                setattr(module, name, None)
        cache.__del__()
    finally:
        vars(module).update(saved)
        sys.unraisablehook = hook
    assert not unraisable
    del cache
    store.close()


def test_store_switches_attention_and_restores_it(model: object) -> None:
    assert model.config._attn_implementation == "sdpa"
    store = prefixkv.PrefixStore(model)
    second = prefixkv.PrefixStore(model)
    assert model.config._attn_implementation == "prefixkv"
    store.close()
    assert model.config._attn_implementation == "prefixkv"  # still used by the second store
    second.close()
    assert model.config._attn_implementation == "sdpa"


def test_pool_grows_on_demand_from_a_small_start(model: object) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    assert store.pool.capacity <= 17
    prompt = random_tokens(150, seed=14)[None]
    result = compare(model, store, prompt, max_new_tokens=2)
    assert result.same_tokens
    assert store.pool.capacity >= 38
    store.close()


@pytest.mark.parametrize("pads", [(0, 8), (0, 5)], ids=["whole-block-padding", "part-block-padding"])
def test_whole_rows_under_padding_match_stock_and_padding_is_never_stored(model: object, pads: tuple[int, int]) -> None:
    store = prefixkv.PrefixStore(model, block_size=4, attention="gather")
    system = random_tokens(24, seed=15)
    compare(model, store, torch.cat([system, random_tokens(3, seed=16)])[None])
    long = torch.cat([system, random_tokens(10, seed=17)])
    ids, mask = left_pad([long, long[pads[1] :]])
    cache = prefixkv.PagedPrefixCache(store, ids, mask)
    rows = cache._rowset.rows
    whole = WholeRows(store.blocks.gather, 4)
    length = cache.get_seq_length()
    whole.begin([row.pad for row in rows], [row.table for row in rows], length)
    index = whole.index(torch.device("cpu"))
    assert index.shape == (2, length) and [row.pad for row in rows] == [0, pads[1]]
    assert not index[1, : pads[1]].any(), "a pad column must read the null block"
    assert index.tolist() == [
        ([0] * row.pad + [b * 4 + o for b in row.table for o in range(4)])[:length] for row in rows
    ]
    cache.close()
    result = compare(model, store, ids, mask)
    assert result.same_tokens and result.max_diff <= TOL
    for keys, values in zip(store.pool.keys, store.pool.values):
        assert not keys[:, 0].any() and not values[:, 0].any(), "padding K/V leaked into the null block"
    store.close()


def test_the_whole_row_index_is_the_slot_table_of_every_layout_it_is_given() -> None:
    """The index WholeRows keeps, filled a few columns at a time while the rows grow and built anew when they change,
    is at every step the slot table of the layout it was given (the rule it caches)."""
    rng = random.Random(3)
    whole = WholeRows(lambda *a, **k: (torch.empty(0), torch.empty(0)), 4)
    pads, tables, length = [0, 3], [[5], [7]], 4
    for step in range(200):
        change = rng.random()
        if change < 0.6:  # a decode step: one more column, a new block where it crosses one
            length += 1
            for pad, table in zip(pads, tables):
                if len(table) * 4 < length - pad:
                    table.append(rng.randrange(8, 99))
        elif change < 0.7:  # a block of a row replaced (a copy on write, a truncation and new claim)
            row = rng.randrange(len(tables))
            tables[row][rng.randrange(len(tables[row]))] = rng.randrange(8, 99)
        elif change < 0.8:  # columns dropped
            length = max(max(pads) + 1, length - rng.randrange(1, 6))
            tables = [t[: -(-(length - p) // 4)] for p, t in zip(pads, tables)]
        elif change < 0.9:  # other padding
            pads = [0] + [rng.randrange(0, 6) for _ in pads[1:]]
            length = max(length, max(pads) + 1)
            tables = [
                t + [rng.randrange(8, 99) for _ in range(-(-(length - p) // 4) - len(t))] for p, t in zip(pads, tables)
            ]
        else:  # a row fewer or more
            pads, tables = (
                (pads[:1], tables[:1]) if len(pads) == 2 else ([*pads, 1], [*tables, [9] * -(-(length - 1) // 4)])
            )
        # a forward's own slots where the rows have them (as a decode step's begin passes them), or not
        q = rng.randrange(1, 3) if length > max(pads) + 2 else 1
        new = slot_table(pads, tables, length - q, length, 4) if rng.random() < 0.7 else None
        whole.begin(list(pads), [list(t) for t in tables], length, new)
        assert whole.index(torch.device("cpu")).tolist() == slot_table(pads, tables, 0, length, 4).tolist(), step


@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_an_idle_cache_keeps_none_of_a_grown_pools_old_storage(model: object, attention: str) -> None:
    """A forward's read plan holds the pool's tensors of its step; once the forward ends, nothing of the cache does:
    after another request's growth replaced the tensors, an open, idle cache (a chat loop between turns) keeps no
    reference to the old ones, so their memory is freed (docs/correctness.md, "Releasing caches")."""
    store = prefixkv.PrefixStore(model, block_size=4, attention=attention)
    prompt = random_tokens(14, seed=41)
    compare(model, store, prompt[None], max_new_tokens=2)  # warm: the next call's row is read as whole rows too
    ids = torch.cat([prompt, random_tokens(2, seed=42)])[None]
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        model.generate(ids, **cache_kw(cache), max_new_tokens=6, do_sample=False, pad_token_id=0)
        pool = store.blocks.pool
        old = [weakref.ref(t) for t in (*pool.keys, *pool.values)]
        with store.blocks.lock:  # as the store's room grows the pool for another request (kv/room.py)
            pool.grow(pool.capacity + 8)
            store.blocks._allocator.grow(pool.capacity)
        assert all(ref() is None for ref in old), "an idle cache keeps the pool's old tensors alive"
        assert not cache.forward.in_use()
    store.close()


def test_the_last_sharer_of_a_part_block_writes_in_place(model: object) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    first = random_tokens(12, seed=18)
    compare(model, store, first[None], max_new_tokens=1)
    prompt = torch.cat([first[:10], random_tokens(2, seed=19)])[None]
    copies: list[int] = []
    original = store.blocks.room.copy_prefix
    store.blocks.room.copy_prefix = lambda src, n: copies.append(src) or original(src, n)  # type: ignore[method-assign]
    result = compare(model, store, prompt, max_new_tokens=2, do_sample=True, num_return_sequences=3)
    assert result.same_tokens and result.max_diff <= TOL
    # 10 tokens reused: the 2 of the third block are copied at construction (1 copy); the 3 sequences then
    # write into that block: two copy it, and the third owns it by then and writes in place
    assert result.cache.stats.cached_tokens == 10
    assert len(copies) == 3
    store.close()
