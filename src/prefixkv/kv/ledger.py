"""A block manager's books: the lookup counters, and what is read of its blocks without changing them.

:class:`Ledger` counts lookups (:meth:`~Ledger.count_query`), gives the counters and the pool's numbers as one
snapshot (:meth:`~Ledger.stats`), copies each claim's table and the trie for display (:meth:`~Ledger.table_view`,
:meth:`~Ledger.prefix_view`) and recounts every block's holders (:meth:`~Ledger.check_invariants`). A
:class:`~prefixkv.kv.blocks.BlockManager` builds it, as ``store.blocks.ledger``, and hands it its allocator, trie
and live claims; it runs under the manager's lock and reads of it only what :class:`Books` lists."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from ..stats import StoreStats
from .allocator import BlockAllocator
from .room import Manager, Room
from .trie import NodeView, RadixTrie


class Books(Manager, Protocol):
    """What :class:`Ledger` reads of its block manager: what the room reads (lock, pool, budget, tier, pins),
    and the room."""

    room: Room


class Held(Protocol):
    """What :class:`Ledger` reads of a claim (:class:`prefixkv.kv.blocks.Claim`): its block table."""

    @property
    def table(self) -> list[int]: ...


class TableView(NamedTuple):
    """A claim's block table, and for each block whether something else holds it too."""

    blocks: tuple[int, ...]
    shared: tuple[bool, ...]


class Ledger:
    """The books of a manager's blocks: lookup counters, snapshots and the recount of holders. Every method
    takes the manager's lock itself."""

    def __init__(self, blocks: Books, allocator: BlockAllocator, trie: RadixTrie, claims: Iterable[Held]) -> None:
        self._blocks = blocks  # its public parts: lock, pool, budget, tier, room, pins
        self._allocator = allocator
        self._trie = trie
        self._claims = claims  # the live claims (a weak set the manager keeps)
        self._queries = self._misses = self._prompt_tokens = self._hit_tokens = 0

    def count_query(self, prompt_tokens: Sequence[int], reused: Sequence[int], *, undo: bool = False) -> None:
        """Count a lookup in :meth:`stats` (``undo``: take back one counted before, as a cache that redoes its
        reuse does). Mutates the counters."""
        sign = -1 if undo else 1
        with self._blocks.lock:
            self._queries += sign * len(prompt_tokens)
            self._misses += sign * sum(1 for r in reused if r == 0)
            self._prompt_tokens += sign * sum(prompt_tokens)
            self._hit_tokens += sign * sum(reused)

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters. Does not mutate."""
        bm = self._blocks
        with bm.lock:
            used = self._allocator.num_used
            cap = bm.max_blocks if bm.max_blocks is not None else self._allocator.capacity - 1
            nodes = self._trie.nodes()
            return StoreStats(
                queries=self._queries,
                misses=self._misses,
                prompt_tokens=self._prompt_tokens,
                hit_tokens=self._hit_tokens,
                hit_rate=self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
                blocks_used=used,
                blocks_free=cap - used,
                blocks_evictable=bm.room.evictable(),
                blocks_pinned=len(bm.pins.blocks()),
                bytes_used=used * bm.bytes_per_block,
                evictions=bm.room.evictions,
                cached_tokens=sum(len(n.tokens) for n in nodes),
                nodes=len(nodes),
                offload=None if bm.tier is None else bm.tier.stats,
            )

    def table_view(self, claims: Sequence[Held]) -> list[TableView]:
        """Each claim's blocks, and whether something else holds each of them too. Does not mutate."""
        with self._blocks.lock:
            rc = self._allocator.refcount
            return [TableView(tuple(c.table), tuple(rc(b) > 1 for b in c.table)) for c in claims]

    def prefix_view(self) -> list[NodeView]:
        """A copy of every cached prefix node, for display (:meth:`RadixTrie.view`), hard pins marked. Does not
        mutate."""
        with self._blocks.lock:
            return self._trie.view(self._blocks.pins.nodes())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any refcount disagrees with its holders (trie nodes and live claims), or
        the trie, the allocator or the second tier is malformed. Does not mutate."""
        bm = self._blocks
        with bm.lock:
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
            if bm.pool.capacity != alloc.capacity:
                raise AssertionError(f"pool has {bm.pool.capacity} blocks, allocator {alloc.capacity}")
            if bm.tier is not None:
                bm.tier.check_invariants()
