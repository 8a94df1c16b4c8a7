"""Which unlocked leaf of the radix trie goes first: the eviction policy, apart from the tree. No torch.

The trie (:class:`prefixkv.kv.trie.RadixTrie`) owns the tree: edges, blocks, locks, key spaces. It tells its
policy about every event the order can depend on (a node stamped, reused, split, retained, unlocked, evicted)
and asks it for the leaf to evict; the policy never changes the tree. The policy's per-node state sits on the
nodes themselves (``last_access``, ``hits``, ``retains``: fields of a node only the policy writes), so that an
event costs no lookup. To add a policy, write a class with the methods of :class:`EvictionPolicy` and pass it as
``RadixTrie(block_size, policy=...)``; this module's :class:`SegmentedLRU` is the store's.

:class:`SegmentedLRU` follows SGLang: unlocked leaves wait in a heap by last access; evicting one may turn its
parent into an unlocked leaf, which then joins the heap. Two refinements keep a long run of one-off prompts (a
batch job, a scan) from evicting what is reused (docs/generate.md, "Many prompts at once"). A node whose path
holds at least one whole block and that lookups have reused at least ``PROTECT_AFTER`` times is *protected*:
unlocked leaves are evicted least recently used first among the unprotected ones, and a protected leaf goes only
when no unprotected one is left, or when protected nodes hold more than ``PROTECTED_SHARE`` of the most block
occurrences the trie has held (the pool, once full): then its least recently used protected leaf goes first, so
that prefixes that were hot once cannot keep new ones out forever. And a path may be *retained* with a priority
(0-100, as TensorRT-LLM's retention priorities; ``DEFAULT_PRIORITY`` otherwise): a leaf of lower priority always
goes before one of higher priority, and retaining, unlike locking, never makes a node unevictable.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import Protocol

from .nodes import Node

PROTECT_AFTER = 2  # reuses (lookups that match into a node) that protect it from a scan
PROTECTED_SHARE = 0.8  # of the most block occurrences held, beyond which protected leaves are evicted first
DEFAULT_PRIORITY = 35  # the retention priority of a node no retain reaches (TensorRT-LLM's default)


class EvictionPolicy(Protocol):
    """The order in which the trie evicts its unlocked leaves. Every method but :meth:`check` mutates the policy's
    own state (its queues, its counters, its fields on the nodes), never the tree."""

    def inserted(self, leaf: Node) -> None:
        """``leaf`` joined the tree (not yet stamped)."""

    def split(self, upper: Node, lower: Node, moved: int) -> None:
        """``upper`` was cut off the top of ``lower``, taking all but ``moved`` of the block occurrences
        ``upper`` now holds from it (``lower`` lost ``moved``)."""

    def stamp(self, node: Node) -> None:
        """``node`` is used now (an insert ended at it), without a reuse."""

    def touch(self, node: Node, matched: int | None) -> None:
        """A lookup reused ``node``, ``matched`` tokens long if known (see :meth:`RadixTrie.touch`)."""

    def retain(self, node: Node, priority: int) -> None:
        """Give ``node``'s path the retention ``priority`` until :meth:`release`."""

    def release(self, node: Node, priority: int) -> None:
        """Undo one :meth:`retain`."""

    def offer(self, node: Node) -> None:
        """``node`` may have become an unlocked leaf (an unlock)."""

    def pop(self) -> Node | None:
        """The unlocked leaf to evict next, taken off the policy's queues (the trie then removes it), or
        ``None``."""

    def evicted(self, node: Node) -> None:
        """``node`` left the tree; its ``parent`` may be an unlocked leaf now."""

    def check(self, nodes: Iterable[Node]) -> None:
        """Raise ``AssertionError`` where the policy's counters disagree with ``nodes`` (every node of the tree
        but the roots). Does not mutate."""


_Entry = tuple[int, int, int, Node]  # (priority, last access, tiebreak, node)


class SegmentedLRU:
    """The store's eviction order (the module's docstring): retention priority first, then unprotected before
    protected (unless protected nodes hold too much), then least recently used.

    >>> from prefixkv.kv.trie import RadixTrie
    >>> t = RadixTrie(block_size=1, policy=SegmentedLRU(block_size=1))
    >>> kept = t.insert([1, 2], [1, 2]).node
    >>> _ = t.insert([3], [3])
    >>> t.retain(kept, 80)
    >>> t.evict_one(), t.evict_one()
    ([3], [1, 2])
    """

    def __init__(
        self, block_size: int, *, protect_after: int = PROTECT_AFTER, protected_share: float = PROTECTED_SHARE
    ) -> None:
        self.block_size = block_size
        self.protect_after = protect_after
        self.protected_share = protected_share
        self._clock = itertools.count(1)
        self._tiebreak = itertools.count()
        # unlocked leaves by (priority, last access): unprotected ones in _cold, protected ones in _hot
        self._cold: list[_Entry] = []
        self._hot: list[_Entry] = []
        self.nodes = 0  # nodes below the roots: bounds the queues' stale entries (see offer)
        self.occurrences = self.protected_occurrences = 0  # block occurrences, all and in protected nodes
        self.peak = 0  # the most block occurrences held at once: the pool's size, once it has been full

    # -- what a node is to this policy ----------------------------------------------------------

    @staticmethod
    def priority(node: Node) -> int:
        """The highest priority of the retains at or below ``node``, or ``DEFAULT_PRIORITY``. Does not mutate."""
        retains = node.retains
        return max(retains) if retains else DEFAULT_PRIORITY

    def protected(self, node: Node) -> bool:
        """Whether lookups reused ``node`` often enough to protect it from a scan, and its path holds a whole block
        (prompts that share only their first few tokens, by chance, do not protect them). Does not mutate."""
        return node.hits >= self.protect_after and node.end >= self.block_size

    def queued(self) -> int:
        """Entries in the queues, stale ones included (at most ``2 * nodes + 65``). Does not mutate."""
        return len(self._cold) + len(self._hot)

    # -- the trie's events ------------------------------------------------------------------------

    def inserted(self, leaf: Node) -> None:
        self.nodes += 1
        self._grow(len(leaf.blocks))

    def split(self, upper: Node, lower: Node, moved: int) -> None:
        upper.last_access = lower.last_access
        upper.retains = lower.retains.copy()
        # upper.hits stays 0: the reuses counted so far are the lower node's, and reach upper when it is evicted
        # (touch), as if every reuse had counted on the whole path
        self.nodes += 1
        self._grow(len(upper.blocks) - moved)  # one more where a block straddles the cut
        if self.protected(lower):
            self.protected_occurrences -= moved

    def stamp(self, node: Node) -> None:
        now = next(self._clock)
        if node.parent is not None:
            node.last_access = now
        self.offer(node)

    def touch(self, node: Node, matched: int | None) -> None:
        """A lookup that ends inside the edge (``matched < node.end``) counts for the parent, the part it reused
        whole: prompts that share a node's first tokens by chance (one-off prompts sorted next to each other) do not
        protect its rest. Without ``matched`` the lookup counts for the whole edge.

        Its ancestors are not stamped nor counted: a node is an eviction candidate only once it is a leaf, and
        every node below it has been evicted by then, each handing its time and its reuses up (:meth:`evicted`).
        So a parent competes with the time of the latest use at or below it and with every reuse at or below it,
        as if every touch stamped and counted the whole path, at O(1) per touch instead of the depth of a long
        chain."""
        counted = node.parent if matched is not None and matched < node.end else node
        if counted is not None and counted.parent is not None:
            self._add_hits(counted, 1)
        self.stamp(node)

    def retain(self, node: Node, priority: int) -> None:
        if not isinstance(priority, int) or not 0 <= priority <= 100:
            raise ValueError(f"a retention priority is an int from 0 to 100, got {priority!r}")
        n: Node | None = node
        while n is not None and n.parent is not None:
            n.retains[priority] += 1
            n = n.parent
        self.offer(node)

    def release(self, node: Node, priority: int) -> None:
        n: Node | None = node
        while n is not None and n.parent is not None:
            if n.retains[priority] <= 0:
                raise ValueError(f"release of {n} at priority {priority}, which it is not retained at")
            n.retains[priority] -= 1
            if not n.retains[priority]:
                del n.retains[priority]
            n = n.parent
        # a node evicted while retained: its nearest live ancestor may be a leaf queued under the old priority
        live: Node | None = node
        while live is not None and not live.alive:
            live = live.parent
        if live is not None:
            self.offer(live)

    def offer(self, node: Node) -> None:
        if node.alive and node.lock == 0 and not node.children and node.parent is not None:
            queue = self._hot if self.protected(node) else self._cold
            heapq.heappush(queue, (self.priority(node), node.last_access, next(self._tiebreak), node))
            # every touch leaves a stale entry behind (and keeps evicted nodes alive): rebuild from the
            # live leaves once stale entries outnumber the nodes, O(1) amortised per push
            if len(self._cold) + len(self._hot) > 2 * self.nodes + 64:
                self._rebuild()

    def pop(self) -> Node | None:
        cold, hot = self._top(self._cold, False), self._top(self._hot, True)
        if cold is None and hot is None:
            return None
        overflow = self.protected_occurrences > self.protected_share * self.peak
        take_hot = cold is None or (hot is not None and (hot[0], not overflow) < (cold[0], True))
        return heapq.heappop(self._hot if take_hot else self._cold)[3]

    def evicted(self, node: Node) -> None:
        self.nodes -= 1
        self.occurrences -= len(node.blocks)
        if self.protected(node):
            self.protected_occurrences -= len(node.blocks)
        parent = node.parent
        if parent is not None and parent.parent is not None:  # see touch()
            parent.last_access = max(parent.last_access, node.last_access)
            self._add_hits(parent, node.hits)
            self.offer(parent)

    def check(self, nodes: Iterable[Node]) -> None:
        listed = list(nodes)
        if self.nodes != len(listed):
            raise AssertionError(f"the policy counts {self.nodes} nodes but the trie holds {len(listed)}")
        held = sum(len(n.blocks) for n in listed)
        protected = sum(len(n.blocks) for n in listed if self.protected(n))
        if (self.occurrences, self.protected_occurrences) != (held, protected):
            raise AssertionError(
                f"the policy counts {self.occurrences} block occurrences ({self.protected_occurrences} protected) "
                f"but the trie holds {held} ({protected})"
            )
        for n in listed:
            assert n.parent is not None
            if n.parent.parent is not None and n.retains - n.parent.retains:
                raise AssertionError(
                    f"{n} is retained at {dict(n.retains)}, its parent only at {dict(n.parent.retains)}"
                )

    # -- the queues -------------------------------------------------------------------------------

    def _grow(self, occurrences: int) -> None:
        self.occurrences += occurrences
        self.peak = max(self.peak, self.occurrences)

    def _add_hits(self, node: Node, n: int) -> None:
        was = self.protected(node)
        node.hits += n
        if self.protected(node) != was:
            self.protected_occurrences += len(node.blocks)

    def _live(self, entry: _Entry, protected: bool) -> bool:
        """Whether ``entry`` still names an evictable leaf of its queue, with the node's current key."""
        node = entry[3]
        return (
            node.alive
            and not node.lock
            and not node.children
            and self.protected(node) == protected
            and entry[:2] == (self.priority(node), node.last_access)
        )

    def _top(self, queue: list[_Entry], protected: bool) -> _Entry | None:
        """The first entry of ``queue`` that is still live, dropping stale ones before it. Mutates the queue."""
        while queue:
            if self._live(queue[0], protected):
                return queue[0]
            heapq.heappop(queue)
        return None

    def _rebuild(self) -> None:
        """The queues with one entry per evictable leaf: every such leaf has a live entry (each change of its key
        or its segment offers it again), so the live entries, once each, are all of them. Mutates."""
        for protected in (False, True):
            queue = self._hot if protected else self._cold
            seen: set[int] = set()
            rebuilt: list[_Entry] = []
            for entry in queue:
                node = entry[3]
                if id(node) not in seen and self._live(entry, protected):
                    seen.add(id(node))
                    rebuilt.append((entry[0], entry[1], next(self._tiebreak), node))
            heapq.heapify(rebuilt)
            if protected:
                self._hot = rebuilt
            else:
                self._cold = rebuilt
