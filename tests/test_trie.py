"""RadixTrie against a naive list of inserted sequences, under random inserts, matches, locks and
evictions; every matched block must hold the query's tokens."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.trie import RadixTrie

# a small alphabet makes shared prefixes and mid-edge splits common
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=24)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), seqs),
        st.tuples(st.just("match"), seqs),
        st.tuples(st.just("lock"), st.integers(0, 50)),
        st.tuples(st.just("unlock"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(0, 3)),
    ),
    max_size=60,
)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 5), script=ops)
def test_trie_matches_reference(block_size: int, script: list[tuple[str, object]]) -> None:
    trie = RadixTrie(block_size)
    content: dict[int, list[int]] = {}  # block id -> the tokens its slots hold
    refs: Counter[int] = Counter()
    inserted: list[list[int]] = []
    locked: list[tuple[object, list[int]]] = []
    next_block = 1
    for op, arg in script:
        if op == "insert":
            seq = list(arg)  # type: ignore[call-overload]
            table = []
            for c in range(-(-len(seq) // block_size)):
                content[next_block] = seq[c * block_size : (c + 1) * block_size]
                table.append(next_block)
                next_block += 1
            ins = trie.insert(seq, table)
            refs.update(ins.added)
            inserted.append(seq)
            assert trie.match(seq).length == len(seq)
            if len(locked) < 5:
                trie.lock(ins.node)
                locked.append((ins.node, seq))
        elif op == "match":
            q = list(arg)  # type: ignore[call-overload]
            m = trie.match(q)
            assert m.length <= max((lcp(s, q) for s in inserted), default=0)
            assert len(m.blocks) == -(-m.length // block_size)
            for c, b in enumerate(m.blocks):
                k = min(block_size, m.length - c * block_size)
                assert content[b][:k] == q[c * block_size : c * block_size + k]
        elif op == "lock" and inserted:
            seq = inserted[int(arg) % len(inserted)]  # type: ignore[call-overload]
            m = trie.match(seq)
            if m.length:
                trie.lock(m.node)
                locked.append((m.node, seq[: m.length]))
        elif op == "unlock" and locked:
            node, _ = locked.pop(int(arg) % len(locked))  # type: ignore[call-overload]
            trie.unlock(node)  # type: ignore[arg-type]
        elif op == "evict":
            for _ in range(int(arg)):  # type: ignore[call-overload]
                released = trie.evict_one()
                if released is None:
                    break
                refs.subtract(released)
        assert +refs == trie.check_invariants()
        for _, seq in locked:
            assert trie.match(seq).length == len(seq), "a locked prefix was evicted"


def test_split_mid_block_keeps_both_paths() -> None:
    trie = RadixTrie(block_size=4)
    trie.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    ins = trie.insert([1, 2, 3, 4, 5, 6, 9, 9], [10, 12])
    assert ins.added == [11, 12]  # the cut chunk is now held by both halves
    assert trie.match([1, 2, 3, 4, 5, 6, 9, 9]).blocks == [10, 12]
    assert trie.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == [10, 11]
    m = trie.match([1, 2, 3, 4, 5, 0])
    assert (m.length, m.blocks) == (5, [10, 11])


def test_eviction_is_lru_and_parents_follow() -> None:
    trie = RadixTrie(block_size=2)
    trie.insert([1, 2, 3, 4], [1, 2])
    trie.insert([1, 2, 5, 6], [1, 3])
    trie.touch(trie.match([1, 2, 3, 4]).node)  # [5, 6] is now the least recently used
    assert trie.evict_one() == [3]
    assert trie.evict_one() == [2]
    assert trie.evict_one() == [1]  # the parent became a leaf
    assert trie.evict_one() is None
    assert trie.match([1, 2]).length == 0


def test_match_cost_does_not_depend_on_trie_size() -> None:
    trie = RadixTrie(block_size=16)
    prefix = list(range(1000, 1512))
    for i in range(2000):
        trie.insert([*prefix, i, i + 1], list(range(34)))
    m = trie.match([*prefix, 7, 8])
    assert m.length == 514
    assert len(trie.root.children) == 1
