"""The block manager: which block holds the K/V of which tokens, who holds each block, and room for more.

:class:`BlockManager` ties the allocator, the trie and the pool together under one lock (generate may run in
several threads on one store), and is what caches call (as ``store.blocks``): ``claim``, ``extend``,
``publish``, ``truncate``, ``fork`` and ``release`` over :class:`~prefixkv.kv.holdings.Claim` objects, and a few
queries. Each method takes the lock itself, says what it mutates and leaves refcounts exact if it raises. It builds
its parts over its :class:`~prefixkv.kv.holdings.Holdings` (the pool, allocator, trie, lock, budget and tier, and
the one insert every block enters the trie by): its :class:`~prefixkv.kv.room.Room` makes room (growth within the
budget, LRU eviction into the second tier, restores from it) and its :class:`~prefixkv.kv.room.Pins` keeps the
prefixes a user pinned (``kv/room.py``); its :class:`~prefixkv.kv.persist.Archive` exports a save's prefixes and
merges a read file's (``kv/persist.py``); its :class:`~prefixkv.kv.ledger.Ledger` counts lookups, gives the stats
and the snapshots for display, and recounts every block's holders (``kv/ledger.py``). See docs/how-it-works.md,
"The block manager"."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch

from .holdings import Claim, Holdings
from .key_space import KeySpace
from .ledger import Ledger
from .persist import Archive
from .pool import BlockPool
from .room import Pins, Room
from .tier import OffloadTier
from .trie import Match

# tokens of room kept free after each row of a batch's prefill, for the blocks its decode steps add
_RESERVE_TOKENS = 128


class Claimed(NamedTuple):
    """Result of :meth:`BlockManager.claim`: a claim per row, and how many of its tokens each reuses."""

    claims: list[Claim]
    reused: list[int]


class BlockManager:
    """The blocks of one store: its :class:`Holdings` (the pool of every attention layer, the allocator's
    refcounts, the radix trie of cached prefixes, the lock over all of them), the live claims, and the parts
    built over them. Reached as ``store.blocks``.

    ``max_blocks`` bounds the ``pool`` (``None``: it grows as requests need); ``bytes_per_block`` is what one
    block costs (for the messages of :class:`CapacityError`); ``tier`` is the second tier (``None``: evicted
    blocks are dropped); ``key_space`` says under which key K/V computed now are cached."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        chunk_size: int | None,
        max_blocks: int | None,
        bytes_per_block: int,
        tier: OffloadTier | None,
        key_space: KeySpace,
    ) -> None:
        held = Holdings(pool, max_blocks=max_blocks, bytes_per_block=bytes_per_block, tier=tier)
        self.holdings = held
        # the holdings' parts, by the names the store and the glue read (the same objects, never rebound)
        self.pool, self.block_size, self.lock, self.tier = pool, held.block_size, held.lock, tier
        self.max_blocks, self.bytes_per_block = max_blocks, bytes_per_block
        self.chunk_size = chunk_size
        self._allocator = held.allocator
        self._trie = held.trie
        self._claims: weakref.WeakSet[Claim] = weakref.WeakSet()
        self.key_space = key_space  # what keys the K/V besides the tokens (KeySpace.steady: a memo of space())
        self.closed = False  # set by close() only
        self.pins = Pins(held)
        self.room = Room(held, self.pins)
        self.archive = Archive(held, self.room)
        self.ledger = Ledger(held, self.room, self.pins, self._claims)

    @property
    def invariant(self) -> bool:
        """Whether prompt K/V are computed in the canonical schedule (``PrefixStore(invariant=True)``)."""
        return self.chunk_size is not None

    def space(self) -> Hashable:
        """The key space that K/V computed now are cached under (:meth:`KeySpace.space`). Does not mutate."""
        return self.key_space.space()

    def ensure_open(self) -> None:
        """Raise ``RuntimeError`` if the store is closed (a new cache cannot use it). Does not mutate."""
        if self.closed:
            raise RuntimeError("this PrefixStore is closed; build a new one for the model")

    def close(self) -> None:
        """Refuse new caches from now on (:meth:`ensure_open`). Mutates :attr:`closed`."""
        self.closed = True

    # -- the claim contract: what caches call --------------------------------------------------------

    def claim(self, rows: list[list[int]], space: Hashable, choose: Callable[[list[int]], list[int]]) -> Claimed:
        """Reuse for each of ``rows`` a prefix of what key space ``space`` holds, in one critical section (another
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
                        claim.node = self.holdings.lock_end(row[: r // bs * bs], space)
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

        Mutates the claims' tables, refcounts and the pool (making room: growing, evicting); all or nothing: the
        plan is made first, the blocks taken and copied next (a failure there gives back only what was taken),
        and the tables change last, when nothing can fail (:class:`CapacityError`: the tables and refcounts are
        as before)."""
        bs, alloc = self.block_size, self._allocator
        grow = [max(0, -(-last // bs) - len(c.table)) if last > 0 else 0 for c, (_, last) in zip(claims, spans)]
        # several rows growing by more than a block (a batch's prefill) are placed in one free range, each
        # row's run ``stride`` blocks after the previous one's: the blocks its decode steps add later follow it
        # (each row stays one run, and the rows stay evenly spaced: one strided view in attention)
        placed = [i for i, n in enumerate(grow) if n > 1]
        stride = max(grow) + -(-_RESERVE_TOKENS // bs) if len(placed) > 1 else 0
        # a decode step mostly needs neither: said without the lock, as each claim's blocks are its cache's
        if not any(grow) and not copy_on_write(claims, spans, bs, alloc.refcount):
            return []
        with self.lock:
            copying = copy_on_write(claims, spans, bs, alloc.refcount)
            self.room.ensure_free(len(copying) + sum(grow), spare=stride * len(placed))
            taken: list[int] = []  # given back if a step below fails: no table has changed yet
            try:
                copies = []
                for i in copying:
                    first = spans[i][0]
                    copies.append(self.room.copy_prefix(claims[i].table[first // bs], first % bs))
                    taken.append(copies[-1])
                last = {i: c.table[-1] for i, c in enumerate(claims) if c.table}
                last.update(  # a copy that replaced a claim's last block: its run continues from the copy
                    (i, dst) for i, dst in zip(copying, copies) if spans[i][0] // bs == len(claims[i].table) - 1
                )
                start = self.room.free_range(stride * len(placed)) if stride else None
                if start is None and stride:  # no room to spare: the runs back to back
                    stride = max(grow)
                    start = alloc.free_run(stride * len(placed))
                where = {} if start is None else {i: start + k * stride - 1 for k, i in enumerate(placed)}
                new: dict[int, list[int]] = {}
                for i, n in enumerate(grow):
                    if n:  # right after the claim's last block where free: a row's blocks stay a run
                        new[i] = alloc.allocate(n, where.get(i, last.get(i)))
                        taken.extend(new[i])
            except BaseException:
                alloc.decref(taken)
                raise
            for i, dst in zip(copying, copies):
                table, first = claims[i].table, spans[i][0]
                alloc.decref([table[first // bs]])
                table[first // bs] = dst
            for i, blocks in new.items():
                claims[i].table.extend(blocks)
        return copying

    def publish(self, claim: Claim, tokens: Sequence[int], *, known: int, end: int, space: Hashable) -> bool:
        """Cache ``tokens[:end]``, whose chunk ``c`` the claim's ``table[c]`` holds, in key space ``space``, and
        move the claim's lock to the node that ends them. ``known`` leading tokens are on the claim's node's
        path already (what it published or reused before): the insert continues from there, so publishing a
        block of a long sequence costs that block, not the sequence. Callers publish only K/V proven to be those
        of ``tokens`` (docs/correctness.md). Where the trie held some of the whole blocks already (another
        request published those tokens first, or the part-block this claim copied), the claim takes the trie's
        blocks and gives its own back, so that the lock holds no block the claim does not read (docs/memory.md).
        Returns whether the claim's table changed so. Mutates the trie, the claim's table, refcounts and locks."""
        with self.lock:
            node = self.holdings.insert(tokens, claim.table, space, after=claim.node, known=known, end=end)
            adopted = self.holdings.adopt(claim.table, node, known // self.block_size, end // self.block_size)
            self._trie.move_lock(claim.node, node)
            claim.node = node
            return adopted

    def clear(self) -> int:
        """:meth:`Room.clear <prefixkv.kv.room.Room.clear>`, giving the pool's grown storage back only while no live
        claim reads it: a live cache's compiled step holds the pool's tensors (docs/how-it-works.md, "Blocks"), so
        their storage stays while one lives. Returns the number of pool blocks freed. Mutates."""
        with self.lock:
            return self.room.clear(shrink=not any(claim.table for claim in self._claims))

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

    def write_tensor(
        self,
        layer: int,
        name: str,
        slots: torch.Tensor,
        given: torch.Tensor,
        keep: torch.Tensor | None,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Store new values of ``layer``'s per-token tensor ``name`` (one its kind keeps besides K and V,
        :meth:`BlockPool.write_tensor`) at the ``slots`` ``[B, q]`` of a forward, and return every row's values over
        ``rows`` (the slots of each row's columns, ``[B, columns]``), ``[B, heads, columns, size]``; under the lock,
        as :meth:`write`. Mutates the pool."""
        with self.lock:
            self.pool.write_tensor(layer, name, slots, given, keep)
            return self.pool.gather_tensor(layer, name, rows)

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

    def cached_length(self, tokens: Sequence[int], space: Hashable = None) -> int:
        """How many leading ``tokens`` key space ``space`` holds. Does not mutate."""
        with self.lock:
            return self._trie.match(tokens, space).length

    # -- what the store and the room call -----------------------------------------------------------

    def lookup(self, rows: list[list[int]], space: Hashable = None) -> list[Match]:
        """Longest cached prefix of each row in key space ``space``. Mutates LRU times, and the trie and pool
        when blocks come back from the second tier."""
        with self.lock:
            if self.tier is not None:
                self.room.restore(rows, space)
            matches = [self._trie.match(r, space) for r in rows]
            for m in matches:
                if m.length:
                    self._trie.touch(m.node, m.length)
            return matches

    def refcount(self, block: int) -> int:
        """How many holders ``block`` has (the trie's occurrences and claims). Does not mutate."""
        return self._allocator.refcount(block)


def copy_on_write(
    claims: Sequence[Claim], spans: Sequence[tuple[int, int]], block_size: int, refcount: Callable[[int], int]
) -> list[int]:
    """The claims of :meth:`BlockManager.extend` whose part-block under ``first`` something else also holds, in
    order, but the last writer of a block that nothing besides its writers holds (it takes the block over, and
    writes in place). Does not mutate."""
    bs, rc = block_size, refcount
    writers: dict[int, list[int]] = {}  # block -> the claims that write into it
    for i, (claim, (first, last)) in enumerate(zip(claims, spans)):
        if last > 0 and first % bs and first // bs < len(claim.table) and rc(claim.table[first // bs]) > 1:
            writers.setdefault(claim.table[first // bs], []).append(i)
    if not writers:
        return []
    taking_over = {ids[-1] for block, ids in writers.items() if rc(block) == len(ids)}
    return sorted(i for ids in writers.values() for i in ids if i not in taking_over)
