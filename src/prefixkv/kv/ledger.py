"""A block manager's books: the lookup counters, and what is read of its blocks without changing them.

:class:`Ledger` counts lookups (:meth:`~Ledger.count_query`), gives the counters and the pool's numbers as one
snapshot (:meth:`~Ledger.stats`), copies each claim's table and the trie for display (:meth:`~Ledger.table_view`,
:meth:`~Ledger.prefix_view`) and recounts every block's holders (:meth:`~Ledger.check_invariants`). A
:class:`~prefixkv.kv.manager.BlockManager` builds it, as ``store.blocks.ledger``, over its holdings, room, pins and
live claims; it runs under the holdings' lock."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..base.stats import StoreStats
from .holdings import Claim, Holdings
from .room import Pins, Room
from .trie import NodeView


class TableView(NamedTuple):
    """A claim's block table, and for each block whether something else holds it too."""

    blocks: tuple[int, ...]
    shared: tuple[bool, ...]


class Ledger:
    """The books of a store's blocks: lookup counters, snapshots and the recount of holders. Every method
    takes the holdings' lock itself."""

    def __init__(self, held: Holdings, room: Room, pins: Pins, claims: Iterable[Claim]) -> None:
        self._holdings = held
        self._allocator = held.allocator
        self._trie = held.trie
        self._room = room
        self._pins = pins
        self._claims = claims  # the live claims (a weak set the manager keeps)
        self._queries = self._misses = self._prompt_tokens = self._hit_tokens = 0

    def count_query(self, prompt_tokens: Sequence[int], reused: Sequence[int], *, undo: bool = False) -> None:
        """Count a lookup in :meth:`stats` (``undo``: take back one counted before, as a cache that redoes its
        reuse does). Mutates the counters."""
        sign = -1 if undo else 1
        with self._holdings.lock:
            self._queries += sign * len(prompt_tokens)
            self._misses += sign * sum(1 for r in reused if r == 0)
            self._prompt_tokens += sign * sum(prompt_tokens)
            self._hit_tokens += sign * sum(reused)

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters. Does not mutate."""
        h = self._holdings
        with h.lock:
            used = self._allocator.num_used
            cap = h.max_blocks if h.max_blocks is not None else self._allocator.capacity - 1
            nodes = self._trie.nodes()
            return StoreStats(
                queries=self._queries,
                misses=self._misses,
                prompt_tokens=self._prompt_tokens,
                hit_tokens=self._hit_tokens,
                hit_rate=self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
                blocks_used=used,
                blocks_free=cap - used,
                blocks_evictable=self._room.evictable(),
                blocks_pinned=len(self._pins.blocks()),
                bytes_used=used * h.bytes_per_block,
                evictions=self._room.evictions,
                cached_tokens=sum(len(n.tokens) for n in nodes),
                nodes=len(nodes),
                offload=None if h.tier is None else h.tier.stats,
            )

    def table_view(self, claims: Sequence[Claim]) -> list[TableView]:
        """Each claim's blocks, and whether something else holds each of them too. Does not mutate."""
        with self._holdings.lock:
            rc = self._allocator.refcount
            return [TableView(tuple(c.table), tuple(rc(b) > 1 for b in c.table)) for c in claims]

    def prefix_view(self) -> list[NodeView]:
        """A copy of every cached prefix node, for display (:meth:`RadixTrie.view`), hard pins marked. Does not
        mutate."""
        with self._holdings.lock:
            return self._trie.view(self._pins.nodes())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any refcount disagrees with its holders (trie nodes and live claims), or
        the trie, the allocator or the second tier is malformed. Does not mutate."""
        h = self._holdings
        with h.lock:
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
            if h.pool.capacity != alloc.capacity:
                raise AssertionError(f"pool has {h.pool.capacity} blocks, allocator {alloc.capacity}")
            if h.tier is not None:
                h.tier.check_invariants()
