"""The ground floor's shared facts: the slot arithmetic (one function for the cache's rows, the whole-row reader and
the compiled step's tables) against a naive reference, the pool's slot view, and the token helpers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.base import tokens
from prefixkv.base.slots import slot_table, slot_view
from prefixkv.kv.pool import BlockPool, LayerSpec


def naive_slot(pad: int, table: list[int], column: int, block_size: int) -> int:
    """Column ``column`` of a row, one column at a time: a pad or a column past the row's blocks reads slot 0."""
    t = column - pad
    if t < 0 or t >= len(table) * block_size:
        return 0
    return table[t // block_size] * block_size + t % block_size


rows = st.lists(
    st.tuples(st.integers(0, 12), st.lists(st.integers(1, 40), max_size=5)),  # (pad, block table without block 0)
    min_size=1,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(rows=rows, block_size=st.sampled_from([1, 2, 4, 16]), start=st.integers(0, 20), width=st.integers(0, 30))
def test_the_slot_table_is_the_naive_one_per_column(
    rows: list[tuple[int, list[int]]], block_size: int, start: int, width: int
) -> None:
    """Both ways the table is computed (plain ints for a few columns, tensors for many) give the naive slots."""
    pads, tables = [p for p, _ in rows], [t for _, t in rows]
    table = slot_table(pads, tables, start, start + width, block_size)
    expected = [[naive_slot(p, t, c, block_size) for c in range(start, start + width)] for p, t in rows]
    assert table.dtype == torch.long and tuple(table.shape) == (len(rows), width)
    assert table.tolist() == expected


def test_no_rows_give_an_empty_table() -> None:
    assert tuple(slot_table([], [], 0, 3, 4).shape) == (0, 3)
    assert tuple(slot_table([], [], 0, 30, 4).shape) == (0, 30)


def test_the_pools_slots_are_its_blocks_offsets() -> None:
    """Slot ``block * block_size + offset`` of ``pool.slots(layer)`` is that block's offset in the pool's K and V."""
    pool = BlockPool([LayerSpec(2, 3, torch.device("cpu"), torch.float64)], block_size=4, capacity=5)
    pool.keys[0].copy_(torch.randn(pool.keys[0].shape, dtype=torch.float64))
    k, v = pool.slots(0)
    assert torch.equal(k[:, 3 * 4 + 2], pool.keys[0][:, 3, 2]) and torch.equal(v, slot_view(pool.values[0]))
    k[:, 7] = 1.5  # a view: written through, the pool holds it
    assert bool((pool.keys[0][:, 1, 3] == 1.5).all())


def _views_of_the_tensors_now(pool: BlockPool) -> bool:
    """Whether every layer's ``kv_slots`` (what a decode step's plan takes) are the slot views of its K and V now."""
    return len(pool.kv_slots) == len(pool.specs) and all(
        k.data_ptr() == key.data_ptr() and v.data_ptr() == value.data_ptr()
        and k.shape == slot_view(key).shape and v.shape == slot_view(value).shape
        for (k, v), key, value in zip(pool.kv_slots, pool.keys, pool.values)
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_the_slot_views_a_step_takes_follow_every_change_of_the_tensors(kv_dtype: str | None) -> None:
    """``kv_slots`` (all layers' ``slots`` at once, by one attribute) are a new list of views of the tensors after
    every change of them: a growth, a shrink, tensors set through ``keys`` and ``values``; a list taken before the
    change keeps the old views (a step's plan notes the pool's moves and takes the new list itself)."""
    spec = LayerSpec(2, 3, torch.device("cpu"), torch.float32)
    pool = BlockPool([spec, spec], block_size=4, capacity=5, kv_dtype=kv_dtype)
    assert _views_of_the_tensors_now(pool)
    assert all(torch.equal(k, pool.slots(layer)[0]) for layer, (k, _) in enumerate(pool.kv_slots))
    for change in (
        lambda: pool.grow(9),
        lambda: pool.shrink(6),
        lambda: setattr(pool, "keys", [k.clone() for k in pool.keys]),
        lambda: setattr(pool, "values", [v.clone() for v in pool.values]),
    ):
        taken = pool.kv_slots
        kept = [(k.data_ptr(), v.data_ptr()) for k, v in taken]
        change()
        assert pool.kv_slots is not taken and [(k.data_ptr(), v.data_ptr()) for k, v in taken] == kept
        assert _views_of_the_tensors_now(pool)


@pytest.mark.parametrize(
    "visible, token",
    [(True, 0), (True, 7), (False, 0), (False, 7)],
)
def test_a_tokens_key_gives_the_token_back(visible: bool, token: int) -> None:
    key = tokens.key(token, visible)
    assert (key >= 0) == visible and tokens.token(key) == token and tokens.token_ids([key, 3]) == [token, 3]


def test_common_length() -> None:
    assert [tokens.common_length(a, b) for a, b in (([], [1]), ([1, 2], [1, 2]), ([1, 2, 3], [1, 5]))] == [0, 2, 1]
