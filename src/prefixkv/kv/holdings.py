"""What one store's blocks are held in and by: :class:`Holdings`, the parts a block manager
(:class:`prefixkv.kv.manager.BlockManager`) shares with its room, pins, archive and ledger (the pool, the
allocator's refcounts, the trie, the lock over them, the budget, the second tier, and the one insert every block
enters the trie by, with the two other trie changes that change refcounts); and :class:`Claim`, one sequence's hold
on them."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

from .allocator import BlockAllocator
from .pool import BlockPool
from .tier import OffloadTier
from .trie import Node, RadixTrie


class Holdings:
    """The blocks of one store as its manager's parts read them: the ``pool`` of every attention layer, the
    ``allocator``'s refcounts, the ``trie`` of cached prefixes and the ``lock`` over all of them (an ``RLock``:
    the parts call each other under it). ``max_blocks`` bounds the pool (``None``: it grows as requests need);
    ``bytes_per_block`` is what one block costs (for the messages of :class:`~prefixkv.base.errors.CapacityError`);
    ``tier`` is the second tier (``None``: evicted blocks are dropped); ``first_capacity`` is the pool's size when the
    store was made, which :meth:`~prefixkv.kv.room.Room.clear` gives it back."""

    def __init__(
        self, pool: BlockPool, *, max_blocks: int | None, bytes_per_block: int, tier: OffloadTier | None
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_blocks = max_blocks
        self.bytes_per_block = bytes_per_block
        self.tier = tier
        self.lock = threading.RLock()
        self.allocator = BlockAllocator(pool.capacity)
        self.first_capacity = pool.capacity
        self.trie = RadixTrie(pool.block_size)

    def insert(self, tokens: Sequence[int], table: Sequence[int], space: Hashable, **where: Any) -> Node:
        """Insert ``tokens`` with the blocks of ``table`` in key space ``space`` and count the block occurrences
        the trie added: the one insert of the store (publishing, restoring from the second tier, loading).
        Mutates the trie and refcounts."""
        with self.lock:
            ins = self.trie.insert(tokens, table, space, **where)
            self.allocator.incref(ins.added)
            return ins.node

    def lock_end(self, tokens: list[int], space: Hashable) -> Node:
        """Lock the node that ends exactly after ``tokens`` (which the trie holds, in key space ``space``),
        splitting the edge that runs on past them; return it. Mutates the trie, locks and refcounts (a split inside
        a block makes it occur twice)."""
        with self.lock:
            end = self.trie.end_node(tokens, space)
            assert end is not None, "a claim locks only what its match holds"
            self.allocator.incref(end.added)
            self.trie.lock(end.node)
            return end.node

    def adopt(self, table: list[int], node: Node, first: int, stop: int) -> bool:
        """Make chunks ``first..stop-1`` of a claim's ``table`` the blocks the trie holds them in, on the path that
        ends at ``node``: both hold the proven K/V of the same keys. Returns whether any changed. Mutates
        ``table`` and refcounts."""
        bs = self.block_size
        with self.lock:
            trie_blocks: dict[int, int] = {}  # chunk -> the block the trie holds it in
            n: Node | None = node
            while n is not None and n.parent is not None and n.end > first * bs:
                for i, block in enumerate(n.blocks):
                    trie_blocks.setdefault(n.start // bs + i, block)
                n = n.parent
            swaps = [(c, trie_blocks[c]) for c in range(first, stop) if trie_blocks.get(c, table[c]) != table[c]]
            for c, block in swaps:
                self.allocator.incref([block])
                self.allocator.decref([table[c]])
                table[c] = block
            return bool(swaps)


class Claim:
    """What one sequence holds in a store: ``table[c]`` is the block of its chunk ``c`` (each entry one count
    in the block's refcount), ``node`` the trie node it keeps locked (``None``: none). Made and changed only by
    the block manager's methods (:meth:`~prefixkv.kv.manager.BlockManager.claim` and the ones after it), which
    keep refcounts equal to the holders: the trie's occurrences plus every live claim's table."""

    __slots__ = ("__weakref__", "node", "table")

    def __init__(self, table: list[int], node: Node | None) -> None:
        self.table = table
        self.node = node
