"""BlockAllocator against a plain dict of refcounts, under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kv.allocator import NULL_BLOCK, BlockAllocator, OutOfBlocksError

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5)),
        st.tuples(st.just("incref"), st.integers(0, 40)),
        st.tuples(st.just("decref"), st.integers(0, 40)),
        st.tuples(st.just("grow"), st.integers(0, 8)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 12), script=ops)
def test_allocator_matches_reference(capacity: int, script: list[tuple[str, int]]) -> None:
    alloc = BlockAllocator(capacity)
    ref: dict[int, int] = {b: 0 for b in range(1, capacity)}
    for op, arg in script:
        used = sorted(b for b, rc in ref.items() if rc > 0)
        if op == "alloc":
            free = sum(1 for rc in ref.values() if rc == 0)
            assert alloc.can_allocate(arg) == (arg <= free)
            if arg > free:
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(arg)
            else:
                got = alloc.allocate(arg)
                assert len(set(got)) == arg and all(ref[b] == 0 for b in got)
                for b in got:
                    ref[b] = 1
        elif op == "incref" and used:
            b = used[arg % len(used)]
            alloc.incref([b])
            ref[b] += 1
        elif op == "decref" and used:
            b = used[arg % len(used)]
            freed = alloc.decref([b])
            ref[b] -= 1
            assert freed == (ref[b] == 0)
        elif op == "grow":
            new = alloc.capacity + arg
            alloc.grow(new)
            ref.update({b: 0 for b in range(len(ref) + 1, new)})
        alloc.check_invariants()
        assert alloc.capacity == len(ref) + 1
        assert alloc.num_free == sum(1 for rc in ref.values() if rc == 0)
        assert all(alloc.refcount(b) == rc for b, rc in ref.items())


def test_null_block_is_never_handed_out_or_released() -> None:
    alloc = BlockAllocator(3)
    assert NULL_BLOCK not in alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.decref([NULL_BLOCK])
    with pytest.raises(ValueError):
        alloc.incref([NULL_BLOCK])


def test_decref_of_free_block_is_refused() -> None:
    alloc = BlockAllocator(3)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.decref([1])
    alloc.check_invariants()
