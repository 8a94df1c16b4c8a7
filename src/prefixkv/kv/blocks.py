"""The block manager: which block holds the K/V of which tokens, who holds each block, and room for more.

:class:`BlockManager` ties the allocator, the trie and the pool together under one lock (generate may run in
several threads on one store), and is what caches call (as ``store.blocks``): ``claim``, ``extend``,
``publish``, ``truncate``, ``fork`` and ``release`` over :class:`Claim` objects, and a few queries. Each method
takes the lock itself, says what it mutates and leaves refcounts exact if it raises. Below it, :class:`Room`
makes room (growth within the budget, LRU eviction into the second tier, restores from it, the blocks of a
saved file) and :class:`Pins` keeps the prefixes a user pinned. Every block that enters the trie goes through
one insert, :meth:`BlockManager.insert`. See docs/how-it-works.md, "The block manager"."""

from __future__ import annotations

import gc
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from ..errors import CapacityError
from ..memory import format_bytes
from ..stats import StoreStats
from . import persist
from .allocator import BlockAllocator
from .namespace import Namespace, WeightsChanged
from .pool import BlockPool
from .tier import OffloadTier, chunk_keys
from .trie import Match, Node, NodeView, RadixTrie, path_tokens

# tokens of room kept free after each row of a batch's prefill, for the blocks its decode steps add
_RESERVE_TOKENS = 128


class Claim:
    """What one sequence holds in a store: ``table[c]`` is the block of its chunk ``c`` (each entry one count
    in the block's refcount), ``node`` the trie node it keeps locked (``None``: none). Made and changed only by
    the block manager's methods (:meth:`BlockManager.claim` and the ones after it), which keep refcounts equal to
    the holders: the trie's occurrences plus every live claim's table."""

    __slots__ = ("__weakref__", "node", "table")

    def __init__(self, table: list[int], node: Node | None) -> None:
        self.table = table
        self.node = node


class Claimed(NamedTuple):
    """Result of :meth:`BlockManager.claim`: a claim per row, and how many of its tokens each reuses."""

    claims: list[Claim]
    reused: list[int]


class TableView(NamedTuple):
    """A claim's block table, and for each block whether something else holds it too."""

    blocks: tuple[int, ...]
    shared: tuple[bool, ...]


class Export(NamedTuple):
    """Result of :meth:`Room.export`: what :func:`prefixkv.persist.write` writes."""

    nodes: list[persist.Saved]
    tensors: dict[str, torch.Tensor]
    blocks: list[int]


class BlockManager:
    """The blocks of one store: the pool of every attention layer, the allocator's refcounts, the radix trie
    of cached prefixes, the live claims and the lock over all of them. Reached as ``store.blocks``.

    ``max_blocks`` bounds the ``pool`` (``None``: it grows as requests need); ``bytes_per_block`` is what one
    block costs (for the messages of :class:`CapacityError`); ``tier`` is the second tier (``None``: evicted
    blocks are dropped); ``namespace`` says under which key K/V computed now are cached."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        chunk_size: int | None,
        max_blocks: int | None,
        bytes_per_block: int,
        tier: OffloadTier | None,
        namespace: Namespace,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.chunk_size = chunk_size
        self.max_blocks = max_blocks
        self.bytes_per_block = bytes_per_block
        self.tier = tier
        self.lock = threading.RLock()
        self._allocator = BlockAllocator(pool.capacity)
        self._trie = RadixTrie(pool.block_size)
        self._claims: weakref.WeakSet[Claim] = weakref.WeakSet()
        self._namespace = namespace
        self._queries = self._misses = self._prompt_tokens = self._hit_tokens = 0
        self.closed = False  # set by close() only
        self.room = Room(self)
        self.pins = Pins(self)

    @property
    def invariant(self) -> bool:
        """Whether prompt K/V are computed in the canonical schedule (``PrefixStore(invariant=True)``)."""
        return self.chunk_size is not None

    def space(self) -> Hashable:
        """The namespace that K/V computed now are cached under (:meth:`Namespace.space`). Does not mutate."""
        return self._namespace.space()

    def ensure_open(self) -> None:
        """Raise ``RuntimeError`` if the store is closed (a new cache cannot use it). Does not mutate."""
        if self.closed:
            raise RuntimeError("this PrefixStore is closed; build a new one for the model")

    def close(self) -> None:
        """Refuse new caches from now on (:meth:`ensure_open`). Mutates :attr:`closed`."""
        self.closed = True

    # -- the claim contract: what caches call --------------------------------------------------------

    def claim(self, rows: list[list[int]], space: Hashable, choose: Callable[[list[int]], list[int]]) -> Claimed:
        """Reuse for each of ``rows`` a prefix of what namespace ``space`` holds, in one critical section (another
        thread cannot evict a match before its blocks are taken). ``choose`` gets the matched length of each row
        and returns how many tokens each reuses (at most its match; the cache's rules, such as one offset per
        batch, live there); it runs under the lock and must not call the store.

        Each row's claim shares the whole blocks it reuses, holds a copy of a part-block it reuses (copy-on-write:
        the row will write after it) and keeps locked the node that ends those whole blocks (an edge that runs on
        past them is split there), so that what the trie holds after them stays evictable: a request whose prefix
        the store holds needs no more room than on a fresh store (docs/memory.md). Mutates LRU times, refcounts,
        locks, the trie (that split; and the pool when blocks come back from the second tier); if it raises, every
        refcount and lock is as before. Callers release the claims (:meth:`release`)."""
        bs, alloc = self.block_size, self._allocator
        with self.lock:
            matches = self.lookup(rows, space)
            reused = choose([m.length for m in matches])
            claims = [Claim([], None) for _ in rows]
            # the part-blocks to copy keep a hold until copied: room made for a copy may evict the node past the
            # whole blocks, which holds them
            sources = [m.blocks[r // bs] if r % bs else None for m, r in zip(matches, reused)]
            held = [b for b in sources if b is not None]
            alloc.incref(held)
            try:
                for claim, row, m, r in zip(claims, rows, matches, reused):
                    claim.table = m.blocks[: r // bs]
                    alloc.incref(claim.table)
                    if r >= bs:  # every row's blocks held before any copy makes room: that must not evict them
                        claim.node = self._lock_prefix(row[: r // bs * bs], space)
                for claim, src, r in zip(claims, sources, reused):
                    if src is not None:
                        claim.table.append(self.room.copy_prefix(src, r % bs))
            except BaseException:
                self.release(claims)
                raise
            finally:
                alloc.decref(held)
            self._claims.update(claims)
            return Claimed(claims, reused)

    def _lock_prefix(self, tokens: list[int], space: Hashable) -> Node:
        """Lock the node that ends exactly after ``tokens`` (which the trie holds, in namespace ``space``),
        splitting the edge that runs on past them; return it. Mutates the trie, locks and refcounts (a split inside
        a block makes it occur twice)."""
        end = self._trie.end_node(tokens, space)
        assert end is not None, "a claim locks only what its match holds"
        self._allocator.incref(end.added)
        self._trie.lock(end.node)
        return end.node

    def empty_claims(self, n: int) -> list[Claim]:
        """``n`` claims that hold nothing yet (rows a cache starts from scratch). Mutates (registers them)."""
        claims = [Claim([], None) for _ in range(n)]
        with self.lock:
            self._claims.update(claims)
        return claims

    def extend(self, claims: Sequence[Claim], spans: Sequence[tuple[int, int]]) -> list[int]:
        """Make room for new tokens: ``spans[i] = (first, last)`` says claim ``i`` is about to write its tokens
        ``first`` to ``last - 1``. A part-block it writes into that something else also holds is replaced by a
        copy of its first ``first % block_size`` slots (copy-on-write; the last holder of a block writes in
        place), and new blocks cover the chunks up to ``last``. Returns the indices of the claims whose block
        under ``first`` was replaced (their earlier slots in that block moved).

        Mutates the claims' tables, refcounts and the pool (making room: growing, evicting); all or nothing: if
        it raises (:class:`CapacityError`), the tables and refcounts are as before."""
        bs, alloc = self.block_size, self._allocator
        cow, grow = [], []
        for i, (claim, (first, last)) in enumerate(zip(claims, spans)):
            if last <= 0:
                grow.append(0)
                continue
            if first % bs and first // bs < len(claim.table) and alloc.refcount(claim.table[first // bs]) > 1:
                cow.append(i)
            grow.append(max(0, -(-last // bs) - len(claim.table)))
        if not cow and not any(grow):
            return []
        copied: list[tuple[int, int]] = []  # (claim, the block it held before its copy)
        grown: list[int] = []
        # several rows growing by more than a block (a batch's prefill) are placed in one free range, each
        # row's run ``stride`` blocks after the previous one's: the blocks its decode steps add later follow it
        # (each row stays one run, and the rows stay evenly spaced: one strided view in attention)
        placed = [i for i, n in enumerate(grow) if n > 1]
        stride = max(grow) + -(-_RESERVE_TOKENS // bs) if len(placed) > 1 else 0
        with self.lock:
            writers = Counter(claims[i].table[spans[i][0] // bs] for i in cow)
            # a copy per writer, except that the last holder of a block takes it over when nothing else holds it
            copies = sum(k if alloc.refcount(b) > k else k - 1 for b, k in writers.items())
            self.room.ensure_free(copies + sum(grow), spare=stride * len(placed))
            try:
                for i in cow:
                    table, first = claims[i].table, spans[i][0]
                    old = table[first // bs]
                    if alloc.refcount(old) == 1:  # the other sharers copied it already: it is this claim's now
                        continue
                    table[first // bs] = self.room.copy_prefix(old, first % bs)
                    copied.append((i, old))
                    alloc.decref([old])
                start = self.room.free_range(stride * len(placed)) if stride else None
                if start is None and stride:  # no room to spare: the runs back to back
                    stride = max(grow)
                    start = alloc.free_run(stride * len(placed))
                where = {} if start is None else {i: start + k * stride - 1 for k, i in enumerate(placed)}
                for i, n in enumerate(grow):
                    if n:  # right after the claim's last block where free: a row's blocks stay a run
                        table = claims[i].table
                        table.extend(alloc.allocate(n, where.get(i, table[-1] if table else None)))
                        grown.append(i)
            except BaseException:
                for i in grown:
                    alloc.decref(claims[i].table[-grow[i] :])
                    del claims[i].table[-grow[i] :]
                for i, old in reversed(copied):
                    table, first = claims[i].table, spans[i][0]
                    alloc.incref([old])
                    alloc.decref([table[first // bs]])
                    table[first // bs] = old
                raise
        return [i for i, _ in copied]

    def publish(self, claim: Claim, tokens: Sequence[int], *, known: int, end: int, space: Hashable) -> bool:
        """Cache ``tokens[:end]``, whose chunk ``c`` the claim's ``table[c]`` holds, in namespace ``space``, and
        move the claim's lock to the node that ends them. ``known`` leading tokens are on the claim's node's
        path already (what it published or reused before): the insert continues from there, so publishing a
        block of a long sequence costs that block, not the sequence. Callers publish only K/V proven to be those
        of ``tokens`` (docs/correctness.md). Where the trie held some of the whole blocks already (another
        request published those tokens first, or the part-block this claim copied), the claim takes the trie's
        blocks and gives its own back, so that the lock holds no block the claim does not read (docs/memory.md).
        Returns whether the claim's table changed so. Mutates the trie, the claim's table, refcounts and locks."""
        with self.lock:
            node = self.insert(tokens, claim.table, space, after=claim.node, known=known, end=end)
            adopted = self._adopt_trie_blocks(claim, node, known // self.block_size, end // self.block_size)
            self._trie.move_lock(claim.node, node)
            claim.node = node
            return adopted

    def _adopt_trie_blocks(self, claim: Claim, node: Node, first: int, stop: int) -> bool:
        """Make the claim's chunks ``first..stop-1`` the blocks the trie holds them in, on the path that ends at
        ``node``: both hold the proven K/V of the same keys. Returns whether any changed. Mutates the claim's
        table and refcounts."""
        bs = self.block_size
        trie_blocks: dict[int, int] = {}  # chunk -> the block the trie holds it in
        n: Node | None = node
        while n is not None and n.parent is not None and n.end > first * bs:
            for i, block in enumerate(n.blocks):
                trie_blocks.setdefault(n.start // bs + i, block)
            n = n.parent
        table = claim.table
        swaps = [(c, trie_blocks[c]) for c in range(first, stop) if trie_blocks.get(c, table[c]) != table[c]]
        for c, block in swaps:
            self._allocator.incref([block])
            self._allocator.decref([table[c]])
            table[c] = block
        return bool(swaps)

    def truncate(self, claims: Sequence[Claim], chunks: Sequence[int]) -> None:
        """Keep the first ``chunks[i]`` blocks of claim ``i`` and give back the rest. Mutates."""
        with self.lock:
            dropped: list[int] = []
            for claim, n in zip(claims, chunks):
                dropped.extend(claim.table[n:])
                del claim.table[n:]
            self._allocator.decref(dropped)

    def fork(self, claims: Sequence[Claim]) -> list[Claim]:
        """A new claim per claim holding the same blocks and lock (beams, ``num_return_sequences``, copies of a
        cache): they share blocks until one writes (:meth:`extend` copies). Mutates refcounts and locks."""
        with self.lock:
            forks = []
            for claim in claims:
                self._allocator.incref(claim.table)
                if claim.node is not None:
                    self._trie.lock(claim.node)
                forks.append(Claim(list(claim.table), claim.node))
            self._claims.update(forks)
            return forks

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back every block and lock of ``claims``, which hold nothing afterwards. Mutates."""
        with self.lock:
            self._allocator.decref([b for claim in claims for b in claim.table])
            for claim in claims:
                claim.table = []
                if claim.node is not None:
                    self._trie.unlock(claim.node)
                    claim.node = None
                self._claims.discard(claim)

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None
    ) -> None:
        """Store new K/V of ``layer`` into their ``slots`` (:meth:`BlockPool.write`), under the lock: another
        thread may grow the pool (a copy) meanwhile, and a write into the old copy would be lost. Mutates the
        pool."""
        with self.lock:
            self.pool.write(layer, slots, key, value, keep)

    def gather(
        self, layer: int, *, table: torch.Tensor | None = None, slots: torch.Tensor | None = None, length: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole rows of ``layer`` copied out of the pool: the first ``length`` columns of block ``table`` rows
        (:meth:`BlockPool.gather_blocks`), or the given ``slots`` (:meth:`BlockPool.gather`). Does not mutate."""
        with self.lock:
            if table is not None:
                return self.pool.gather_blocks(layer, table, length)
            assert slots is not None
            return self.pool.gather(layer, slots)

    def table_view(self, claims: Sequence[Claim]) -> list[TableView]:
        """Each claim's blocks, and whether something else holds each of them too. Does not mutate."""
        with self.lock:
            rc = self._allocator.refcount
            return [TableView(tuple(c.table), tuple(rc(b) > 1 for b in c.table)) for c in claims]

    def prefix_view(self) -> list[NodeView]:
        """A copy of every cached prefix node, for display (:meth:`RadixTrie.view`), pins marked. Does not
        mutate."""
        with self.lock:
            return self._trie.view(self.pins.nodes())

    def count_query(self, prompt_tokens: Sequence[int], reused: Sequence[int], *, undo: bool = False) -> None:
        """Count a lookup in :meth:`stats` (``undo``: take back one counted before, as a cache that redoes its
        reuse does). Mutates the counters."""
        sign = -1 if undo else 1
        with self.lock:
            self._queries += sign * len(prompt_tokens)
            self._misses += sign * sum(1 for r in reused if r == 0)
            self._prompt_tokens += sign * sum(prompt_tokens)
            self._hit_tokens += sign * sum(reused)

    def cached_length(self, tokens: Sequence[int], space: Hashable = None) -> int:
        """How many leading ``tokens`` namespace ``space`` holds. Does not mutate."""
        with self.lock:
            return self._trie.match(tokens, space).length

    # -- what the store and the room call -----------------------------------------------------------

    def lookup(self, rows: list[list[int]], space: Hashable = None) -> list[Match]:
        """Longest cached prefix of each row in namespace ``space``. Mutates LRU times, and the trie and pool
        when blocks come back from the second tier."""
        with self.lock:
            if self.tier is not None:
                self.room.restore(rows, space)
            matches = [self._trie.match(r, space) for r in rows]
            for m in matches:
                if m.length:
                    self._trie.touch(m.node, m.length)
            return matches

    def insert(self, tokens: Sequence[int], table: Sequence[int], space: Hashable, **where: Any) -> Node:
        """Insert ``tokens`` with the blocks of ``table`` and count the block occurrences the trie added: the
        one insert of the store (publishing, restoring from the second tier, loading). Mutates the trie and
        refcounts."""
        with self.lock:
            ins = self._trie.insert(tokens, table, space, **where)
            self._allocator.incref(ins.added)
            return ins.node

    def refcount(self, block: int) -> int:
        """How many holders ``block`` has (the trie's occurrences and claims). Does not mutate."""
        return self._allocator.refcount(block)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any refcount disagrees with its holders (trie nodes and live claims), or
        the trie, the allocator or the second tier is malformed. Does not mutate."""
        with self.lock:
            alloc = self._allocator
            alloc.check_invariants()
            holders = self._trie.check_invariants()
            for claim in list(self._claims):
                holders.update(claim.table)
            for b in range(1, alloc.capacity):
                if alloc.refcount(b) != holders.get(b, 0):
                    raise AssertionError(f"block {b}: refcount {alloc.refcount(b)}, holders {holders.get(b, 0)}")
            if set(holders) - set(range(1, alloc.capacity)):
                raise AssertionError(f"holders name blocks outside the pool: {set(holders)}")
            if self.pool.capacity != alloc.capacity:
                raise AssertionError(f"pool has {self.pool.capacity} blocks, allocator {alloc.capacity}")
            if self.tier is not None:
                self.tier.check_invariants()

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters. Does not mutate."""
        with self.lock:
            used = self._allocator.num_used
            cap = self.max_blocks if self.max_blocks is not None else self._allocator.capacity - 1
            nodes = self._trie.nodes()
            return StoreStats(
                queries=self._queries,
                misses=self._misses,
                prompt_tokens=self._prompt_tokens,
                hit_tokens=self._hit_tokens,
                hit_rate=self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
                blocks_used=used,
                blocks_free=cap - used,
                blocks_evictable=self.room.evictable(),
                blocks_pinned=len(self.pins.blocks()),
                bytes_used=used * self.bytes_per_block,
                evictions=self.room.evictions,
                cached_tokens=sum(len(n.tokens) for n in nodes),
                nodes=len(nodes),
                offload=None if self.tier is None else self.tier.stats,
            )


class Room:
    """Room in a manager's pool: growth within the budget, LRU eviction of unlocked leaves (into the second
    tier, when there is one), blocks brought back from that tier, and the blocks of a saved file. Every method
    runs under the manager's lock (it takes it itself)."""

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        self.evictions = 0

    def free_range(self, n: int) -> int | None:
        """The first of ``n`` consecutive free blocks, growing the pool by ``n`` for them if it has none and the
        budget allows (never evicting), or ``None``. Mutates (the pool's size)."""
        bm = self._blocks
        alloc, limit = bm._allocator, bm.max_blocks
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
        alloc = bm._allocator
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
                node = bm._trie.evict_lru()
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
            (dst,) = bm._allocator.allocate(1)
            try:
                bm.pool.copy_block(src, dst, n)
            except BaseException:
                bm._allocator.decref([dst])
                raise
            return dst

    def evictable(self) -> int:
        """Blocks that evicting every unlocked node would free. Does not mutate."""
        bm = self._blocks
        with bm.lock:
            unlocked: Counter[int] = Counter()
            for node in bm._trie.nodes():
                if node.lock == 0:
                    unlocked.update(node.blocks)
            rc = bm._allocator.refcount
            return sum(1 for b, n in unlocked.items() if rc(b) == n)

    def clear(self) -> int:
        """Drop every cached prefix that is neither pinned nor read by a live cache, and every block of the second
        tier (its files too): a later request recomputes what they held. Returns the number of pool blocks
        freed. Mutates."""
        bm = self._blocks
        with bm.lock:
            freed = bm._allocator.decref(bm._trie.clear())
            if bm.tier is not None:
                bm.tier.clear()
            return freed

    def export(self, wanted: list[list[int]] | None, space: Hashable) -> Export:
        """What a saved file holds (:func:`prefixkv.persist.write`): the nodes of the cached prefixes in namespace
        ``space`` (all, or the cached part of each of ``wanted``), their tensors (the paths' and the blocks') and
        the blocks. Does not mutate."""
        bm = self._blocks
        with bm.lock:
            nodes = persist.select_nodes(bm._trie, wanted, space)
            tensors, blocks = persist.trie_tensors(nodes, bm.block_size)
            tensors.update(bm.pool.read_blocks(blocks))
            return Export(nodes, tensors, blocks)

    def add_file(self, file: persist.PrefixFile, space: Hashable) -> persist.PersistStats:
        """Insert the file's paths in namespace ``space``; copy in only the blocks of positions the store lacks.
        Mutates, or raises :class:`CapacityError` before any change when the budget cannot make room."""
        bm = self._blocks
        bs, trie, alloc = bm.block_size, bm._trie, bm._allocator
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
        space = bm._trie.space_of(node)
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
        bs, trie, alloc, held = bm.block_size, bm._trie, bm._allocator, []
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
        alloc = bm._allocator
        occurrences = bm._trie.check_invariants()
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
    path at a priority (the trie's :meth:`~prefixkv.trie.RadixTrie.retain`: evicted after every leaf of lower
    priority, but never kept when nothing else is left) and counts against nothing. Pins nest: a prefix pinned
    twice holds two locks (or two retains)."""

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
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
            m = bm._trie.match(tokens, space)
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
            end = bm._trie.end_node(tokens, space)
            if end is None:
                return False
            bm._allocator.incref(end.added)  # a split made the straddled block occur twice
            if priority is None:
                pinned = self.blocks()
                total = len(self.blocks(end.node))
                if bm.max_blocks is not None and total > bm.max_blocks:
                    raise self._error(len(ids), total - len(pinned), len(pinned))
                bm._trie.lock(end.node)
            else:
                bm._trie.retain(end.node, priority)
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
                bm._trie.unlock(nodes.pop())
            else:
                bm._trie.release(nodes.pop(), priority)
            if not nodes:
                del self._pins[key]

    def _error(self, n: int, blocks: int, pinned: int) -> CapacityError:
        limit = self._blocks.max_blocks
        return CapacityError(
            f"prefixkv: pinning {n} tokens takes {blocks} more blocks of {self._blocks.block_size} tokens; with "
            f"the {pinned} blocks already pinned that is {blocks + pinned}, over the budget of {limit} "
            "blocks. Unpin other prefixes, pin a shorter prefix, or raise max_memory/num_blocks."
        )
