"""Room in a block manager's pool, and the prefixes pinned in it: two parts a
:class:`~prefixkv.kv.manager.BlockManager` builds over its :class:`~prefixkv.kv.holdings.Holdings`.

:class:`Room` grows the pool within the budget, evicts unlocked leaves in the trie's order (into the second tier,
when there is one) and brings blocks back from that tier. :class:`Pins` keeps the prefixes ``store.pin`` pinned.
Both run under the holdings' lock. A saved file's blocks are :mod:`prefixkv.kv.persist`'s."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Hashable

import torch

from ..base.errors import CapacityError
from ..base.memory import format_bytes
from . import prefix_file
from .holdings import Holdings
from .key_space import WeightsChanged
from .tier import OffloadTier, chunk_keys
from .trie import Node, path_tokens


class Room:
    """Room in a store's pool: growth within the budget, LRU eviction of unlocked leaves (into the second
    tier, when there is one), and blocks brought back from that tier. Every method runs under the holdings' lock
    (it takes it itself); :attr:`evictions` counts the leaves evicted."""

    def __init__(self, held: Holdings, pins: Pins) -> None:
        self._holdings = held
        self._allocator = held.allocator
        self._trie = held.trie
        self._pins = pins
        self.evictions = 0

    def free_range(self, n: int) -> int | None:
        """The first of ``n`` consecutive free blocks, growing the pool by ``n`` for them if it has none and the
        budget allows (never evicting), or ``None``. Mutates (the pool's size)."""
        h = self._holdings
        alloc, limit = self._allocator, h.max_blocks
        start = alloc.free_run(n)
        if start is None and (limit is None or alloc.capacity + n <= limit + 1):
            start = alloc.capacity
            h.pool.grow(alloc.capacity + n)
            alloc.grow(alloc.capacity + n)
        return start

    def ensure_free(self, n: int, spare: int = 0) -> None:
        """Make ``n`` blocks free: grow the pool within the budget (when it grows, by ``spare`` blocks at least:
        a free range for :meth:`free_range`), then evict LRU unlocked leaves. Mutates; raises
        :class:`CapacityError` with the numbers when even that is not enough."""
        h = self._holdings
        alloc = self._allocator
        with h.lock:
            if alloc.can_allocate(n):
                return
            limit = None if h.max_blocks is None else h.max_blocks + 1
            if limit is None or alloc.capacity < limit:
                want = max(2 * alloc.capacity, alloc.capacity + n - alloc.num_free, alloc.capacity + spare)
                target = want if limit is None else min(want, limit)
                h.pool.grow(target)
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
                    if h.tier is not None:
                        self._offload(h.tier, node)
                finally:
                    alloc.decref(node.blocks)  # the node left the trie: its blocks go back whatever the tier did

    def copy_prefix(self, src: int, n: int) -> int:
        """A fresh block holding the first ``n`` slots of ``src`` (copy-on-write). Mutates."""
        h = self._holdings
        with h.lock:
            self.ensure_free(1)
            (dst,) = self._allocator.allocate(1)
            try:
                h.pool.copy_block(src, dst, n)
            except BaseException:
                self._allocator.decref([dst])
                raise
            return dst

    def evictable(self) -> int:
        """Blocks that evicting every unlocked node would free. Does not mutate."""
        h = self._holdings
        with h.lock:
            unlocked: Counter[int] = Counter()
            for node in self._trie.nodes():
                if node.lock == 0:
                    unlocked.update(node.blocks)
            rc = self._allocator.refcount
            return sum(1 for b, n in unlocked.items() if rc(b) == n)

    def clear(self, *, shrink: bool = True) -> int:
        """Drop every cached prefix that is neither pinned nor read by a live cache, and every block of the second
        tier (its files too): a later request recomputes what they held. With ``shrink``, the pool and the
        allocator's books go back to the store's first size, or to the last block still held where that lies beyond
        it (a pinned prefix): a workload that grew the pool (a namespace per request, no budget) leaves nothing
        behind. Returns the number of pool blocks freed. Mutates."""
        h = self._holdings
        alloc = self._allocator
        with h.lock:
            freed = alloc.decref(self._trie.clear())
            if h.tier is not None:
                h.tier.clear()
            if shrink:
                held = max((b for b in range(1, alloc.capacity) if alloc.refcount(b)), default=0)
                size = max(h.first_capacity, held + 1)
                h.pool.shrink(size)
                alloc.shrink(size)
            return freed

    # -- the second tier ------------------------------------------------------------------------------

    def _offload(self, tier: OffloadTier, node: Node) -> None:
        """Copy the whole blocks of an evicted node to the tier, each with the section its payload gives it (an
        entry held already is written again when it gets one). Mutates the tier only."""
        h = self._holdings
        bs = h.block_size
        first, end = node.start // bs, node.end // bs  # chunks [first, end) lie wholly before the edge's end
        space = self._trie.space_of(node)
        extra = {} if tier.payload is None else tier.payload.leaving(space, node, bs)
        if end <= first or isinstance(space, WeightsChanged):
            return
        keys = chunk_keys(path_tokens(node), bs, end, space)
        for c in range(first, end):
            if c in extra or not tier.touch(keys[c]):
                block = h.pool.read_blocks([node.blocks[c - first]])
                tier.put(keys[c], {**block, **extra.get(c, {})}, repr(space), replace=c in extra)

    def restore(self, rows: list[list[int]], space: Hashable) -> None:
        """Bring back from the second tier the whole blocks that extend each row's match in the trie, and insert
        them. Nodes matched or restored stay locked until every row is done, so that room made for one row
        never evicts another's. Mutates."""
        h = self._holdings
        tier = h.tier
        if tier is None or isinstance(space, WeightsChanged):
            return
        bs, trie, alloc, held = h.block_size, self._trie, self._allocator, []
        with h.lock:
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
                    kv = [name for name in blocks[0] if not name.startswith(prefix_file.SECTION)]
                    try:
                        h.pool.write_blocks(fresh, {name: torch.cat([b[name] for b in blocks]) for name in kv})
                        node = h.insert(row[: (c0 + n) * bs], m.blocks[:c0] + fresh, space)
                    finally:
                        alloc.decref(fresh)  # the restore's own hold: the trie holds them now, or nothing does
                    for j, block in enumerate(blocks):
                        section = {name: t for name, t in block.items() if name.startswith(prefix_file.SECTION)}
                        if section and tier.payload is not None:
                            tier.payload.arrived(space, row, c0 + j, bs, section)
                    trie.lock(node)
                    held.append(node)
                    tier.count_restored(n, (c0 + n) * bs - m.length)
            finally:
                for node in held:
                    trie.unlock(node)

    def _capacity_error(self, n: int) -> CapacityError:
        h = self._holdings
        alloc = self._allocator
        occurrences = self._trie.check_invariants()
        live = sum(1 for b in range(1, alloc.capacity) if alloc.refcount(b) > occurrences.get(b, 0))
        budget = h.max_blocks if h.max_blocks is not None else alloc.capacity - 1
        return CapacityError(
            f"prefixkv: {n} more KV blocks are needed, {alloc.num_free} are free and no cached prefix "
            f"can be evicted: budget {budget} blocks ({format_bytes(budget * h.bytes_per_block)}, "
            f"{h.block_size} tokens each), {live} held by live caches, {len(self._pins.blocks())} pinned. "
            "Raise max_memory/num_blocks, close() caches you no longer need, unpin prefixes, "
            "or generate with fewer rows or new tokens."
        )


class Pins:
    """The prefixes pinned in a store (``store.pin``): a hard pin (``priority=None``) keeps the trie node that
    ends it locked, so that nothing under it is evicted, and counts against the budget; a soft pin retains its
    path at a priority (the trie's :meth:`~prefixkv.kv.trie.RadixTrie.retain`: evicted after every leaf of lower
    priority, but never kept when nothing else is left) and counts against nothing. Pins nest: a prefix pinned
    twice holds two locks (or two retains)."""

    def __init__(self, held: Holdings) -> None:
        self._holdings = held
        self._trie = held.trie
        self._allocator = held.allocator
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
        """Raise :class:`CapacityError` if pinning ``tokens`` in key space ``space`` surely exceeds the budget.
        Does not mutate."""
        h = self._holdings
        if h.max_blocks is None:
            return
        bs = h.block_size
        with h.lock:
            m = self._trie.match(tokens, space)
            full = m.length // bs  # chunks cached whole; the rest needs blocks of its own
            pinned = self.blocks()
            total = len(pinned | set(m.blocks[:full])) + -(-len(tokens) // bs) - full
        if total > h.max_blocks:
            raise self._error(len(tokens), total - len(pinned), len(pinned))

    def add(self, ids: list[int], tokens: list[int], space: Hashable, priority: int | None = None) -> bool:
        """Pin ``tokens`` (the part of ``ids`` kept; ``ids`` and ``priority`` are the pin's key) in key space
        ``space`` if the trie holds all of them, within the budget, and return whether it did. Mutates (the node's
        lock or retain, and the split that makes a node end at the last token); raises :class:`CapacityError` if
        a hard pin would exceed the budget."""
        h = self._holdings
        with h.lock:
            end = self._trie.end_node(tokens, space)
            if end is None:
                return False
            self._allocator.incref(end.added)  # a split made the straddled block occur twice
            if priority is None:
                pinned = self.blocks()
                total = len(self.blocks(end.node))
                if h.max_blocks is not None and total > h.max_blocks:
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
        h = self._holdings
        with h.lock:
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
        limit = self._holdings.max_blocks
        return CapacityError(
            f"prefixkv: pinning {n} tokens takes {blocks} more blocks of {self._holdings.block_size} tokens; with "
            f"the {pinned} blocks already pinned that is {blocks + pinned}, over the budget of {limit} "
            "blocks. Unpin other prefixes, pin a shorter prefix, or raise max_memory/num_blocks."
        )
