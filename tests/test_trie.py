"""RadixTrie against a naive list of inserted sequences, under random inserts, matches, locks and
evictions; every matched block must hold the query's tokens."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixkv.kv.trie as trie_module
from prefixkv.kv.eviction import SegmentedLRU
from prefixkv.kv.trie import Node, RadixTrie, path_tokens

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


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.integers(1, 4),
    script=st.lists(st.tuples(st.integers(0, 2), seqs, st.integers(0, 30), st.booleans()), max_size=30),
)
def test_insert_after_a_node_is_insert_from_the_root(
    block_size: int, script: list[tuple[int, list[int], int, bool]]
) -> None:
    """Sequences that grow (and get cropped) publish from the node they hold (``after``/``known``/``end``) and
    move their lock there (``move_lock``): the trie ends up exactly as with whole inserts from the root and
    lock/unlock — same nodes, blocks, locks, added occurrences and eviction order."""
    fast, slow = RadixTrie(block_size), RadixTrie(block_size)
    held: dict[int, tuple[list[int], object, object, int]] = {}  # id -> tokens, fast node, slow node, known
    next_block = 1
    for sid, tail, cut, whole_blocks in script:
        tokens, fnode, snode, known = held.get(sid, ([], None, None, 0))
        known = min(known, cut // block_size * block_size)  # a crop keeps whole published blocks
        tokens = tokens[:known] + tail
        end = len(tokens) // block_size * block_size if whole_blocks else len(tokens)
        if end <= known:
            continue
        table = list(range(next_block, next_block + -(-end // block_size)))
        next_block += len(table)
        f = fast.insert(tokens, table, after=fnode, known=known, end=end)  # type: ignore[arg-type]
        s = slow.insert(tokens[:end], table)
        assert f.added == s.added
        fast.move_lock(fnode, f.node)  # type: ignore[arg-type]
        slow.lock(s.node)
        if snode is not None:
            slow.unlock(snode)  # type: ignore[arg-type]
        held[sid] = (tokens, f.node, s.node, end)
        assert fast.view() == slow.view()
        assert fast.check_invariants() == slow.check_invariants()
        if cut % 3 == 0:
            assert fast.evict_one() == slow.evict_one()
    while (f_out := fast.evict_one()) is not None:
        assert f_out == slow.evict_one()
    assert slow.evict_one() is None


def test_publishing_a_long_chain_compares_no_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence that grows block by block and publishes from the node it holds: each block becomes a leaf
    under that node, with no edge of the chain compared (from the root, every edge would be)."""
    trie = RadixTrie(block_size=4)
    seq = list(range(4096))
    calls = []
    monkeypatch.setattr(trie_module, "_common_prefix", lambda *a: calls.append(a) or 0)
    node = None
    for end in range(4, len(seq) + 1, 4):
        ins = trie.insert(seq, list(range(end // 4)), after=node, known=end - 4, end=end)
        trie.move_lock(node, ins.node)
        node = ins.node
    assert calls == []
    assert len(trie.nodes()) == 1024 and all(n.lock == 1 for n in trie.nodes())  # one locked path
    assert path_tokens(node) == seq


class EagerPolicy(SegmentedLRU):
    """The reference for eviction order: every touch stamps and counts the node and all its ancestors, and every
    eviction scans all leaves for the one that goes first (lowest priority, unprotected before protected, least
    recently used)."""

    def __init__(self, block_size: int, **kwargs: Any) -> None:
        super().__init__(block_size, **kwargs)
        self.made: list[Node] = []

    def inserted(self, leaf: Any) -> None:
        super().inserted(leaf)
        self.made.append(leaf)

    def split(self, upper: Any, lower: Any, moved: int) -> None:
        super().split(upper, lower, moved)
        upper.hits = lower.hits  # every reuse of the lower part went through the upper one
        self.made.append(upper)

    def touch(self, node: Any, matched: int | None) -> None:
        n = node.parent if matched is not None and matched < node.end else node
        while n is not None and n.parent is not None:
            n.hits += 1
            n = n.parent
        self.stamp(node)

    def stamp(self, node: Any) -> None:
        now = next(self._clock)
        n = node
        while n is not None and n.parent is not None:
            n.last_access = now
            n = n.parent

    def offer(self, node: Any) -> None:
        pass

    def pop(self) -> Any:
        leaves = [n for n in self.made if n.alive and not n.lock and not n.children]
        return min(leaves, key=lambda n: (self.priority(n), self.protected(n), n.last_access), default=None)

    def evicted(self, node: Any) -> None:
        self.nodes -= 1


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 3), script=ops, priorities=st.lists(st.sampled_from([10, 35, 80]), max_size=4))
def test_touch_stamps_only_the_node_and_evicts_as_if_it_stamped_the_path(
    block_size: int, script: list[tuple[str, object]], priorities: list[int]
) -> None:
    """touch() is O(1): a parent gets the time of the latest use below it, and every reuse below it, when it
    becomes a leaf. Eviction order (priorities, protection after two reuses, LRU) is exactly that of stamping and
    counting every ancestor on each touch and scanning all leaves (with the protected share unbounded: the
    bound is tested below)."""
    lazy = RadixTrie(block_size, protected_share=1.0)
    eager = RadixTrie(block_size, policy=EagerPolicy(block_size, protected_share=1.0))
    locked: list[tuple[Node, Node]] = []
    retained: list[tuple[Node, Node, int]] = []
    for op, arg in script:
        if op in ("insert", "match"):
            seq = list(arg)  # type: ignore[call-overload]
            if op == "insert":
                table = list(range(1, len(seq) + 1))
                a, b = lazy.insert(seq, table), eager.insert(seq, table)
                if len(locked) < 3 and len(seq) % 2:
                    lazy.lock(a.node)
                    eager.lock(b.node)
                    locked.append((a.node, b.node))
                elif priorities and len(seq) % 3 == 0:
                    p = priorities.pop()
                    lazy.retain(a.node, p)
                    eager.retain(b.node, p)
                    retained.append((a.node, b.node, p))
            else:
                ma, mb = lazy.match(seq), eager.match(seq)
                if ma.length:
                    matched = ma.length if len(seq) % 2 else None  # as the store's lookups tell it, or not
                    lazy.touch(ma.node, matched)
                    eager.touch(mb.node, matched)
        elif op == "unlock" and locked:
            a, b = locked.pop(int(arg) % len(locked))  # type: ignore[call-overload]
            lazy.unlock(a)
            eager.unlock(b)
        elif op == "lock" and retained:
            a, b, p = retained.pop(int(arg) % len(retained))  # type: ignore[call-overload]
            lazy.release(a, p)
            eager.release(b, p)
        elif op == "evict":
            for _ in range(int(arg)):  # type: ignore[call-overload]
                out = lazy.evict_one()
                assert out == eager.evict_one()
                if out is None:
                    break
        assert [v[:5] for v in lazy.view()] == [v[:5] for v in eager.view()]
        lazy.check_invariants()
    while (out := lazy.evict_one()) is not None:
        assert out == eager.evict_one()
    assert eager.evict_one() is None


def test_releasing_a_node_evicted_while_retained_leaves_its_parent_evictable() -> None:
    """A retained leaf evicted (a soft pin keeps nothing when nothing else is left), then released: its parent,
    now a leaf whose priority the release lowered, is still evicted (it was queued under the retained priority,
    an entry the release made stale; found by the hypothesis test above)."""
    trie = RadixTrie(block_size=1, protected_share=1.0)
    trie.insert([0, 0], [1, 2])
    kept = trie.insert([0, 0, 0], [1, 2, 3]).node
    trie.retain(kept, 10)
    assert trie.evict_one() == [3]
    trie.release(kept, 10)
    assert trie.evict_one() == [1, 2]
    assert trie.evict_one() is None
    trie.check_invariants()


def test_reused_prefixes_survive_a_scan_of_one_off_sequences() -> None:
    """Four prefixes reused twice, then a scan of 1,000 one-off sequences under a budget that holds a few of
    them: every eviction takes a one-off, and the four stay whole. Plain LRU (protection switched off) loses them
    in the first evictions."""
    for protect_after in (trie_module.PROTECT_AFTER, 10**9):
        trie = RadixTrie(block_size=4, protect_after=protect_after)
        held: Counter[int] = Counter()
        hot = [[100 + h] * 16 for h in range(4)]
        one_offs = ([i % 97, i // 97, *range(200, 206)] for i in range(1000))  # first tokens shared now and then
        for n, seq in enumerate([*hot, *one_offs]):
            held.update(trie.insert(seq, list(range(10 * n + 1, 10 * n + 1 + len(seq) // 4))).added)
            while held.total() > 32:  # the budget: 32 block occurrences
                released = trie.evict_one()
                assert released is not None
                held.subtract(released)
            if n == len(hot) - 1:
                for seq in 2 * hot:
                    trie.touch(trie.match(seq).node)
        kept = [trie.match(seq).length == 16 for seq in hot]
        assert all(kept) if protect_after == trie_module.PROTECT_AFTER else not any(kept), (protect_after, kept)
        assert +held == trie.check_invariants()


def test_lookups_that_end_inside_an_edge_protect_only_what_they_reused() -> None:
    trie = RadixTrie(block_size=2)
    node = trie.insert([1, 2, 3, 4, 5, 6], [1, 2, 3]).node
    for _ in range(3):
        trie.touch(node, matched=1)  # prompts sharing the first token by chance
    assert node.hits == 0 and not trie.policy.protected(node)
    trie.touch(node, matched=6)
    trie.touch(node)  # the length not known: the whole edge
    assert trie.policy.protected(node)
    trie.check_invariants()


def test_protected_prefixes_cannot_keep_new_ones_out_forever() -> None:
    """Once protected nodes hold more than PROTECTED_SHARE (0.8) of the most block occurrences the trie held, their
    least recently used leaf is evicted before an unprotected one: prefixes that were hot once give way to new
    ones."""
    for hot, first_out in ((4, [50]), (5, [1])):
        trie = RadixTrie(block_size=1)
        for t in range(1, hot + 1):  # one-block leaves, each reused twice
            node = trie.insert([t], [t]).node
            trie.touch(node)
            trie.touch(node)
        trie.insert([50], [50])
        assert trie.policy.protected_occurrences == hot and trie.policy.occurrences == hot + 1
        assert trie.evict_one() == first_out, hot  # 4 of 5 is not over the share; 5 of 6 is
        assert trie.evict_one() == ([1] if hot == 4 else [50])  # 4 of a peak of 6 is not over it either
        trie.check_invariants()


def _protected_leaves(trie: RadixTrie, tokens: range) -> list[Node]:
    """One-block leaves, each reused twice (protected)."""
    nodes = []
    for t in tokens:
        nodes.append(trie.insert([t], [t]).node)
        trie.touch(nodes[-1])
        trie.touch(nodes[-1])
    return nodes


def test_priorities_come_before_the_protected_share() -> None:
    """Priority first, then the protected share: when protected nodes hold too much, their leaves go before
    unprotected ones of the same priority, never before a leaf of lower priority (a soft pin at 90 outlasts a one-off
    at 35), and a protected leaf of lower priority still goes first."""
    for protected_priority, one_off_priority, first_out in ((90, None, [50]), (None, 90, [1]), (None, 10, [50])):
        trie = RadixTrie(block_size=1)
        for node in _protected_leaves(trie, range(1, 6)):
            if protected_priority is not None:
                trie.retain(node, protected_priority)
        one_off = trie.insert([50], [50]).node
        if one_off_priority is not None:
            trie.retain(one_off, one_off_priority)
        assert trie.policy.protected_occurrences == 5 > 0.8 * trie.policy.peak  # over the share
        assert trie.evict_one() == first_out, (protected_priority, one_off_priority)
        trie.check_invariants()


def test_the_protected_share_is_of_the_most_held_not_of_what_is_left() -> None:
    """After evictions shrank what the trie holds, protected nodes that hold most of what is left but not
    PROTECTED_SHARE of the most it held still outlast one-offs: a store that shrank does not give up its reused
    prefixes."""
    trie = RadixTrie(block_size=1)
    _protected_leaves(trie, range(1, 9))  # 8 protected
    for t in range(50, 54):  # 4 one-offs: a peak of 12
        trie.insert([t], [t])
    assert [trie.evict_one() for _ in range(3)] == [[50], [51], [52]]  # 8 of 12 is under the share
    assert trie.policy.protected_occurrences == 8 and trie.policy.occurrences == 9  # 8 of 9 held, 8 of 12 at most
    assert trie.evict_one() == [53]
    assert trie.evict_one() == [1]
    trie.check_invariants()


def test_retained_priorities_order_eviction_and_keep_nothing_forever() -> None:
    trie = RadixTrie(block_size=1)
    low, _, high = (trie.insert([t], [t]).node for t in (1, 2, 3))
    trie.retain(high, 90)
    trie.retain(low, 10)
    trie.touch(low)  # recency does not outrank priority
    assert [trie.evict_one() for _ in range(3)] == [[1], [2], [3]]
    assert trie.evict_one() is None
    with pytest.raises(ValueError, match="from 0 to 100"):
        trie.retain(trie.insert([4], [4]).node, 101)
    trie.release(high, 90)  # also once evicted
    with pytest.raises(ValueError, match="not retained at"):
        trie.release(high, 90)


def test_a_parent_competes_with_the_latest_use_below_it() -> None:
    """A leaf kept locked while a parent's children go keeps its old time; once unlocked it goes before the
    parent, whose children were used after it (the parent's own time is older than that leaf's)."""
    for trie in (RadixTrie(block_size=1), RadixTrie(block_size=1, policy=EagerPolicy(block_size=1))):
        trie.insert([1, 2, 3], [1, 2, 3])  # [1 2 3] used at time 1
        held = trie.insert([9], [9]).node  # time 2
        trie.lock(held)
        trie.insert([1, 2, 4], [1, 2, 4])  # splits [1 2 | 3]: [1 2] keeps time 1; [4] is time 3
        assert trie.evict_one() == [3] and trie.evict_one() == [4]  # [1 2] is a leaf now, last used below at 3
        trie.unlock(held)
        assert trie.evict_one() == [9], type(trie.policy).__name__
        assert trie.evict_one() == [1, 2]


def test_split_mid_block_keeps_both_paths() -> None:
    trie = RadixTrie(block_size=4)
    trie.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    ins = trie.insert([1, 2, 3, 4, 5, 6, 9, 9], [10, 12])
    # the cut chunk is held by both halves: the upper one takes the inserted block, so the new path holds only
    # its own blocks and evicting the old branch frees block 11
    assert ins.added == [12, 12]
    assert trie.match([1, 2, 3, 4, 5, 6, 9, 9]).blocks == [10, 12]
    assert trie.match([1, 2, 3, 4, 5, 6, 7, 8]).blocks == [10, 11]
    m = trie.match([1, 2, 3, 4, 5, 0])
    assert (m.length, m.blocks) == (5, [10, 12])
    assert trie.evict_one() == [11]  # the old branch, least recently used


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


def test_nested_retains_keep_the_highest_priority_on_their_common_path() -> None:
    """A system prompt retained at 90 under a few-shot prompt retained at 10: the shared path keeps 90 (the
    highest retain through a node is its priority, docs/generate.md "Many prompts at once"), so after the
    few-shot tail (10) the unretained one-off prompts (35) go, and the system prompt last."""
    trie = RadixTrie(block_size=1)
    system = trie.insert([1, 2], [1, 2]).node
    few_shot = trie.insert([1, 2, 3, 4], [1, 2, 3, 4]).node
    trie.insert([7], [7])
    trie.insert([8], [8])
    trie.retain(system, 90)
    trie.retain(few_shot, 10)
    order = [trie.evict_one() for _ in range(4)]
    assert order[0] == [3, 4]  # the few-shot tail: only the retain at 10 reaches it
    assert sorted(order[1:3]) == [[7], [8]]  # the one-off prompts, at the default 35
    assert order[3] == [1, 2]  # the system prompt: 90 and 10 reach it, 90 counts
    assert trie.evict_one() is None


def test_a_namespace_per_request_leaves_nothing_once_its_prefixes_are_gone() -> None:
    """Issue 43, review #5: a lookup in a namespace made its root (``match`` is a query), and the roots, and the
    tables that held them, stayed after ``clear()``: 635 bytes per namespace. 1000 namespaces, each looked up in,
    published in and evicted: the roots, the policy's entries and the memory back to where they were."""
    import gc
    import tracemalloc

    t = RadixTrie(block_size=2)
    t.lock(t.insert([1, 2, 3], [1, 2]).node)  # the default namespace holds a locked prefix throughout
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):
            assert t.match([1, 2, 3], ("lookup", i)).length == 0
            assert len(t.spaces()) == 1 + i  # the default and the requests before: a lookup makes no root
            t.insert([4, 5, 6, i], [3, 4], ("request", i))
        assert len(t.spaces()) == 1001
        t.clear()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert t.spaces() == [None] and t.policy.queued() == 0
    assert grown < 4096, grown  # 635 kB before the fix: roots of lookups, and the tables of every root
    assert t.match([1, 2, 3]).length == 3
    t.check_invariants()


def test_a_namespace_loses_its_root_when_eviction_takes_its_last_prefix() -> None:
    """Without ``clear()``: a namespace emptied by eviction keeps its root only until the next one is emptied."""
    t = RadixTrie(block_size=2)
    for i in range(100):
        t.insert([7, 8, i], [1, 2], ("request", i))
    while t.evict_lru() is not None:
        assert len(t.spaces()) <= len({n.space for n in t.view()} | {None}) + 1
    assert len(t.spaces()) <= 2
    t.check_invariants()


@settings(max_examples=300, deadline=None)
@given(
    script=st.lists(
        st.one_of(
            st.tuples(st.just("insert"), st.integers(0, 3), seqs),
            st.tuples(st.just("match"), st.integers(0, 5), seqs),
            st.tuples(st.just("evict"), st.integers(0, 3), st.just([])),
            st.tuples(st.just("clear"), st.just(0), st.just([])),
        ),
        max_size=40,
    )
)
def test_namespaces_have_a_root_while_they_hold_nodes(script: list[tuple[str, int, list[int]]]) -> None:
    """Under random inserts, lookups and evictions in several namespaces: a lookup makes no root, a namespace keeps
    its root while it holds nodes (and at most one emptied namespace keeps it a while longer), a node just evicted
    still names its namespace, and each namespace matches only what was inserted in it."""
    trie = RadixTrie(2)
    inserted: dict[object, list[list[int]]] = {}
    for op, n, seq in script:
        space = None if n == 0 else f"space-{n}"
        before = trie.spaces()
        if op == "insert":
            trie.insert(seq, list(range(1, len(seq) // 2 + 2)), space)
            inserted.setdefault(space, []).append(seq)
            assert trie.match(seq, space).length == len(seq)
        elif op == "match":
            m = trie.match(seq, space)
            assert m.length <= max((lcp(s, seq) for s in inserted.get(space, [])), default=0)
            assert trie.spaces() == before
        elif op == "evict":
            for _ in range(n):
                node = trie.evict_lru()
                if node is None:
                    break
                assert trie.space_of(node) in inserted
        else:
            trie.clear()
            assert trie.spaces() == [None]
        holding = {v.space for v in trie.view()} | {None}
        assert holding <= set(trie.spaces()) and len(trie.spaces()) <= len(holding) + 1
        trie.check_invariants()
