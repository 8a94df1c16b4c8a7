"""Block ids and their reference counts. No tensors here: a block id is an ``int``.

Block 0 is reserved: it is the *null block* whose slots stand in for padding columns, so it is never
handed out. Every other id in ``[1, capacity)`` is either free (refcount 0, in the free list) or used
(refcount >= 1). Refcounts are the single truth about who holds a block: each live cache row holding
the block counts once, and each occurrence of the block in the trie counts once.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when fewer blocks are free than asked for."""


class BlockAllocator:
    """Free list and refcounts over block ids ``1 .. capacity - 1``.

    >>> a = BlockAllocator(capacity=4)
    >>> a.allocate(2)
    [1, 2]
    >>> a.num_free
    1
    """

    def __init__(self, capacity: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (block 0 is reserved), got {capacity}")
        self._refcount: list[int] = [1] + [0] * (capacity - 1)
        self._free: deque[int] = deque(range(1, capacity))

    @property
    def capacity(self) -> int:
        """Number of block ids, the null block included."""
        return len(self._refcount)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with a refcount >= 1, the null block excluded."""
        return self.capacity - 1 - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed. Does not mutate."""
        return n <= len(self._free)

    def grow(self, new_capacity: int) -> None:
        """Add free ids up to ``new_capacity``. Mutates."""
        old = self.capacity
        if new_capacity <= old:
            return
        self._refcount.extend([0] * (new_capacity - old))
        self._free.extend(range(old, new_capacity))

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with refcount 1. Mutates; raises :class:`OutOfBlocksError`."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add one holder to each block. Mutates."""
        rc = self._refcount
        for b in blocks:
            if b == NULL_BLOCK or rc[b] <= 0:
                raise ValueError(f"incref of block {b}, which is not allocated")
            rc[b] += 1

    def decref(self, blocks: list[int]) -> int:
        """Drop one holder from each block; blocks reaching 0 return to the free list. Mutates.

        Returns the number of blocks freed.
        """
        rc = self._refcount
        freed = 0
        for b in blocks:
            if b == NULL_BLOCK or rc[b] <= 0:
                raise ValueError(f"decref of block {b}, which is not allocated")
            rc[b] -= 1
            if rc[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the free list and the refcounts disagree. Does not mutate."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        if NULL_BLOCK in free or self._refcount[NULL_BLOCK] != 1:
            raise AssertionError("the null block must stay reserved")
        for b in range(1, self.capacity):
            rc = self._refcount[b]
            if rc < 0:
                raise AssertionError(f"block {b} has negative refcount {rc}")
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: refcount {rc} but free-list membership {b in free}")
