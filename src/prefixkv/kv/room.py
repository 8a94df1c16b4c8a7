"""Room in a block manager's pool, and the prefixes pinned in it: the two parts a
:class:`~prefixkv.kv.blocks.BlockManager` builds and hands its allocator and trie to.

:class:`Room` grows the pool within the budget, evicts unlocked leaves in the trie's order (into the second tier,
when there is one), brings blocks back from that tier, and copies in the blocks of a saved file. :class:`Pins`
keeps the prefixes ``store.pin`` pinned. Both run under the manager's lock and read of it only what
:class:`Manager` lists."""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ..errors import CapacityError
from ..memory import format_bytes
from . import persist
from .allocator import BlockAllocator
from .namespace import WeightsChanged
from .pool import BlockPool
from .prefix_file import PrefixFile
from .tier import OffloadTier, chunk_keys
from .trie import Node, RadixTrie, path_tokens


class Manager(Protocol):
    """What :class:`Room` and :class:`Pins` read of their block manager (:class:`prefixkv.kv.blocks.BlockManager`):
    its lock, pool, budget and tier, the other part, and the one insert every block enters the trie by."""

    lock: threading.RLock
    pool: BlockPool
    block_size: int
    bytes_per_block: int
    max_blocks: int | None
    tier: OffloadTier | None
    pins: Pins

    def insert(self, tokens: Sequence[int], table: Sequence[int], space: Hashable, **where: Any) -> Node: ...


class Export(NamedTuple):
    """Result of :meth:`Room.export`: what :func:`prefixkv.kv.persist.write` writes."""

    nodes: list[persist.Saved]
    tensors: dict[str, torch.Tensor]
    blocks: list[int]


class Room:
    """Room in a manager's pool: growth within the budget, LRU eviction of unlocked leaves (into the second
    tier, when there is one), blocks brought back from that tier, and the blocks of a saved file. Every method
    runs under the manager's lock (it takes it itself)."""

    def __init__(self, blocks: Manager, allocator: BlockAllocator, trie: RadixTrie) -> None:
        self._blocks = blocks  # its public parts: lock, pool, budget, tier
        self._allocator = allocator
        self._trie = trie
        self.evictions = 0

    def free_range(self, n: int) -> int | None:
        """The first of ``n`` consecutive free blocks, growing the pool by ``n`` for them if it has none and the
        budget allows (never evicting), or ``None``. Mutates (the pool's size)."""
        bm = self._blocks
        alloc, limit = self._allocator, bm.max_blocks
        start = alloc.free_run(n)
        if start is None and (limit is None or alloc.capacity + n <= limit + 1):
            start = alloc.capacity
            bm.pool.grow(alloc.capacity + n)
            alloc.grow(alloc.capacity + n)
        return start

    def ensure_free(self, n: int, spare: int = 0) -> None:
        """Make ``n`` blocks free: grow the pool within the budget (when it grows, by ``spare`` blocks at least:
        a free range for :meth:`free_range`), then evict LRU unlocked leaves. Mutates; raises
        :class:`CapacityError` with the numbers when even that is not enough."""
        bm = self._blocks
        alloc = self._allocator
        with bm.lock:
            if alloc.can_allocate(n):
                return
            limit = None if bm.max_blocks is None else bm.max_blocks + 1
            if limit is None or alloc.capacity < limit:
                want = max(2 * alloc.capacity, alloc.capacity + n - alloc.num_free, alloc.capacity + spare)
                target = want if limit is None else min(want, limit)
                bm.pool.grow(target)
                alloc.grow(target)
            collected = False
            while not alloc.can_allocate(n):
                node = self._trie.evict_lru()
                if node is None:
                    if collected:
                        raise self._capacity_error(n)
                    # caches nobody closed may be waiting for the cyclic collector (a cache kept alive by a
                    # traceback, a user's own cycle): let them give their blocks back once before giving up
                    gc.collect()
                    collected = True
                    continue
                self.evictions += 1
                try:
                    if bm.tier is not None:
                        self._offload(bm.tier, node)
                finally:
                    alloc.decref(node.blocks)  # the node left the trie: its blocks go back whatever the tier did

    def copy_prefix(self, src: int, n: int) -> int:
        """A fresh block holding the first ``n`` slots of ``src`` (copy-on-write). Mutates."""
        bm = self._blocks
        with bm.lock:
            self.ensure_free(1)
            (dst,) = self._allocator.allocate(1)
            try:
                bm.pool.copy_block(src, dst, n)
            except BaseException:
                self._allocator.decref([dst])
                raise
            return dst

    def evictable(self) -> int:
        """Blocks that evicting every unlocked node would free. Does not mutate."""
        bm = self._blocks
        with bm.lock:
            unlocked: Counter[int] = Counter()
            for node in self._trie.nodes():
                if node.lock == 0:
                    unlocked.update(node.blocks)
            rc = self._allocator.refcount
            return sum(1 for b, n in unlocked.items() if rc(b) == n)

    def clear(self) -> int:
        """Drop every cached prefix that is neither pinned nor read by a live cache, and every block of the second
        tier (its files too): a later request recomputes what they held. Returns the number of pool blocks
        freed. Mutates."""
        bm = self._blocks
        with bm.lock:
            freed = self._allocator.decref(self._trie.clear())
            if bm.tier is not None:
                bm.tier.clear()
            return freed

    def export(self, wanted: list[list[int]] | None, space: Hashable) -> Export:
        """What a saved file holds (:func:`prefixkv.kv.persist.write`): the nodes of the cached prefixes in namespace
        ``space`` (all, or the cached part of each of ``wanted``), their tensors (the paths' and the blocks') and
        the blocks. Does not mutate."""
        bm = self._blocks
        with bm.lock:
            nodes = persist.select_nodes(self._trie, wanted, space)
            tensors, blocks = persist.trie_tensors(nodes, bm.block_size)
            tensors.update(bm.pool.read_blocks(blocks))
            return Export(nodes, tensors, blocks)

    def add_file(self, file: PrefixFile, space: Hashable) -> persist.PersistStats:
        """Insert the file's paths in namespace ``space``; copy in only the blocks of positions the store lacks.
        Mutates, or raises :class:`CapacityError` before any change when the budget cannot make room."""
        bm = self._blocks
        bs, trie, alloc = bm.block_size, self._trie, self._allocator
        with bm.lock:
            plans, anchors = persist.plan(trie, file.paths, space)
            needed = list(dict.fromkeys(p.table[c] for p in plans for c in range(p.present // bs, len(p.table))))
            for node in anchors:
                trie.lock(node)  # what the plan counts on must survive the evictions that make room
            try:
                # free blocks, growth left in the budget, and evictable ones (None: the pool grows as needed)
                limit = bm.max_blocks
                room = None if limit is None else alloc.num_free + (limit + 1 - alloc.capacity) + self.evictable()
                if room is not None and len(needed) > room:
                    raise CapacityError(
                        f"prefixkv: the file needs {len(needed)} new KV blocks "
                        f"({format_bytes(len(needed) * bm.bytes_per_block)}) but the store can make room for "
                        f"only {room} (budget {limit} blocks, {alloc.num_used} in use). Raise "
                        "max_memory/num_blocks, close() live caches, unpin or clear() prefixes, or save fewer prefixes"
                    )
                self.ensure_free(len(needed))
                fresh = alloc.allocate(len(needed))
                try:
                    bm.pool.write_blocks(fresh, persist.blocks_of(file, needed))
                    slot = dict(zip(needed, fresh))
                    for plan in plans:
                        live = trie.match(plan.tokens, space)
                        assert live.length == plan.present, "the merge plan went stale under the store lock"
                        cut = live.length // bs
                        bm.insert(plan.tokens, live.blocks[:cut] + [slot[b] for b in plan.table[cut:]], space)
                finally:
                    alloc.decref(fresh)  # the merge's own hold: the trie holds what it inserted, nothing the rest
            finally:
                for node in anchors:
                    trie.unlock(node)
        return persist.PersistStats(
            prefixes=len(plans),
            tokens=sum(len(p.tokens) - p.present for p in plans),
            blocks=len(needed),
        )

    # -- the second tier ------------------------------------------------------------------------------

    def _offload(self, tier: OffloadTier, node: Node) -> None:
        """Copy the whole blocks of an evicted node to the tier. Mutates the tier only."""
        bm = self._blocks
        bs = bm.block_size
        first, end = node.start // bs, node.end // bs  # chunks [first, end) lie wholly before the edge's end
        space = self._trie.space_of(node)
        if end <= first or isinstance(space, WeightsChanged):
            return
        keys = chunk_keys(path_tokens(node), bs, end, space)
        for c in range(first, end):
            if not tier.touch(keys[c]):
                tier.put(keys[c], bm.pool.read_blocks([node.blocks[c - first]]), repr(space))

    def restore(self, rows: list[list[int]], space: Hashable) -> None:
        """Bring back from the second tier the whole blocks that extend each row's match in the trie, and insert
        them. Nodes matched or restored stay locked until every row is done, so that room made for one row
        never evicts another's. Mutates."""
        bm = self._blocks
        tier = bm.tier
        if tier is None or isinstance(space, WeightsChanged):
            return
        bs, trie, alloc, held = bm.block_size, self._trie, self._allocator, []
        with bm.lock:
            try:
                for row in rows:
                    m = trie.match(row, space)
                    if m.length:
                        trie.lock(m.node)
                        held.append(m.node)
                    c0 = m.length // bs
                    if c0 >= len(row) // bs:
                        continue  # the pool holds every whole block of the row
                    keys = chunk_keys(row, bs, len(row) // bs, space)
                    n = 0
                    while c0 + n < len(keys) and keys[c0 + n] in tier:
                        n += 1
                    if (c0 + n) * bs <= m.length:
                        continue
                    for k in reversed(keys[c0 : c0 + n]):
                        tier.touch(k)  # offloading to make room must not drop what this row is about to read
                    try:
                        self.ensure_free(n)
                    except CapacityError:
                        continue  # no room: the row recomputes what the tier holds
                    blocks: list[dict[str, torch.Tensor]] = []
                    for key in keys[c0 : c0 + n]:
                        block = tier.get(key, repr(space))
                        if block is None:  # a file gone, of another store or failing its checksum: recomputed
                            break
                        blocks.append(block)
                    n = len(blocks)
                    if (c0 + n) * bs <= m.length:
                        continue
                    fresh = alloc.allocate(n)
                    try:
                        bm.pool.write_blocks(fresh, {name: torch.cat([b[name] for b in blocks]) for name in blocks[0]})
                        node = bm.insert(row[: (c0 + n) * bs], m.blocks[:c0] + fresh, space)
                    finally:
                        alloc.decref(fresh)  # the restore's own hold: the trie holds them now, or nothing does
                    trie.lock(node)
                    held.append(node)
                    tier.count_restored(n, (c0 + n) * bs - m.length)
            finally:
                for node in held:
                    trie.unlock(node)

    def _capacity_error(self, n: int) -> CapacityError:
        bm = self._blocks
        alloc = self._allocator
        occurrences = self._trie.check_invariants()
        live = sum(1 for b in range(1, alloc.capacity) if alloc.refcount(b) > occurrences.get(b, 0))
        budget = bm.max_blocks if bm.max_blocks is not None else alloc.capacity - 1
        return CapacityError(
            f"prefixkv: {n} more KV blocks are needed, {alloc.num_free} are free and no cached prefix "
            f"can be evicted: budget {budget} blocks ({format_bytes(budget * bm.bytes_per_block)}, "
            f"{bm.block_size} tokens each), {live} held by live caches, {len(bm.pins.blocks())} pinned. "
            "Raise max_memory/num_blocks, close() caches you no longer need, unpin prefixes, "
            "or generate with fewer rows or new tokens."
        )


class Pins:
    """The prefixes pinned in a manager (``store.pin``): a hard pin (``priority=None``) keeps the trie node that
    ends it locked, so that nothing under it is evicted, and counts against the budget; a soft pin retains its
    path at a priority (the trie's :meth:`~prefixkv.kv.trie.RadixTrie.retain`: evicted after every leaf of lower
    priority, but never kept when nothing else is left) and counts against nothing. Pins nest: a prefix pinned
    twice holds two locks (or two retains)."""

    def __init__(self, blocks: Manager, trie: RadixTrie, allocator: BlockAllocator) -> None:
        self._blocks = blocks  # its public parts: lock, budget, room
        self._trie = trie
        self._allocator = allocator
        self._pins: dict[tuple[Hashable, tuple[int, ...], int | None], list[Node]] = {}

    def nodes(self) -> list[Node]:
        """The node each hard pin locks (once per pin). Does not mutate."""
        return [n for (_, _, priority), nodes in self._pins.items() if priority is None for n in nodes]

    def blocks(self, extra: Node | None = None) -> set[int]:
        """The blocks on the paths of every pin (and of ``extra``). Does not mutate."""
        pinned: set[int] = set()
        for node in [*self.nodes(), extra] if extra is not None else self.nodes():
            n: Node | None = node
            while n is not None:
                pinned.update(n.blocks)
                n = n.parent
        return pinned

    def check_budget(self, tokens: list[int], space: Hashable) -> None:
        """Raise :class:`CapacityError` if pinning ``tokens`` in namespace ``space`` surely exceeds the budget.
        Does not mutate."""
        bm = self._blocks
        if bm.max_blocks is None:
            return
        bs = bm.block_size
        with bm.lock:
            m = self._trie.match(tokens, space)
            full = m.length // bs  # chunks cached whole; the rest needs blocks of its own
            pinned = self.blocks()
            total = len(pinned | set(m.blocks[:full])) + -(-len(tokens) // bs) - full
        if total > bm.max_blocks:
            raise self._error(len(tokens), total - len(pinned), len(pinned))

    def add(self, ids: list[int], tokens: list[int], space: Hashable, priority: int | None = None) -> bool:
        """Pin ``tokens`` (the part of ``ids`` kept; ``ids`` and ``priority`` are the pin's key) in namespace
        ``space`` if the trie holds all of them, within the budget, and return whether it did. Mutates (the node's
        lock or retain, and the split that makes a node end at the last token); raises :class:`CapacityError` if
        a hard pin would exceed the budget."""
        bm = self._blocks
        with bm.lock:
            end = self._trie.end_node(tokens, space)
            if end is None:
                return False
            self._allocator.incref(end.added)  # a split made the straddled block occur twice
            if priority is None:
                pinned = self.blocks()
                total = len(self.blocks(end.node))
                if bm.max_blocks is not None and total > bm.max_blocks:
                    raise self._error(len(ids), total - len(pinned), len(pinned))
                self._trie.lock(end.node)
            else:
                self._trie.retain(end.node, priority)
            self._pins.setdefault((space, tuple(ids), priority), []).append(end.node)
            return True

    def remove(self, ids: list[int], space: Hashable, priority: int | None = None) -> None:
        """Undo one :meth:`add` of the same ids and priority. Mutates; raises ``ValueError`` if they are not
        pinned so."""
        key = (space, tuple(ids), priority)
        bm = self._blocks
        with bm.lock:
            nodes = self._pins.get(key)
            if not nodes:
                raise ValueError(
                    f"these {len(ids)} ids are not pinned"
                    + ("" if priority is None else f" at priority {priority}")
                    + f" ({len(self._pins)} prefixes are); pass the same ids (and priority) that were given to pin()"
                )
            if priority is None:
                self._trie.unlock(nodes.pop())
            else:
                self._trie.release(nodes.pop(), priority)
            if not nodes:
                del self._pins[key]

    def _error(self, n: int, blocks: int, pinned: int) -> CapacityError:
        limit = self._blocks.max_blocks
        return CapacityError(
            f"prefixkv: pinning {n} tokens takes {blocks} more blocks of {self._blocks.block_size} tokens; with "
            f"the {pinned} blocks already pinned that is {blocks + pinned}, over the budget of {limit} "
            "blocks. Unpin other prefixes, pin a shorter prefix, or raise max_memory/num_blocks."
        )
