"""Block ids and their reference counts. No tensors here: a block id is an ``int``.

Block 0 is reserved: it is the *null block* whose slots stand in for padding columns, so it is never
handed out. Every other id in ``[1, capacity)`` is either free (refcount 0, in the free list) or used
(refcount >= 1). Refcounts are the single truth about who holds a block: each live cache row holding
the block counts once, and each occurrence of the block in the trie counts once.

Free blocks are handed out lowest id first, and a caller extending a row asks for the blocks right after its
last one (``after``): a request's blocks then form few runs of consecutive ids, which attention reads as views
of the pool instead of gathering them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

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
        self._refcount: list[int] = [1] + [0] * (capacity - 1)  # changed in place only: refcount reads it
        self.refcount: Callable[[int], int] = self._refcount.__getitem__
        """A block's refcount: the list's own lookup, no call of this module's (a decode step asks for every row)."""
        # a min-heap of free ids; an id taken out of order (``after``) stays in it until popped, and is skipped
        # then because its refcount is no longer 0 (or pushed again if it was freed meanwhile: duplicates skip)
        self._free: list[int] = list(range(1, capacity))
        self._num_free = capacity - 1

    @property
    def capacity(self) -> int:
        """Number of block ids, the null block included."""
        return len(self._refcount)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks with a refcount >= 1, the null block excluded."""
        return self.capacity - 1 - self._num_free

    def free_run(self, n: int) -> int | None:
        """The first id of the lowest ``n`` consecutive free ids, or ``None``. Does not mutate.

        >>> a = BlockAllocator(capacity=8)
        >>> a.allocate(2), a.free_run(3), a.free_run(6)
        ([1, 2], 3, None)
        """
        count = 0
        for b, held in enumerate(self._refcount):
            count = 0 if held else count + 1
            if count == n:
                return b - n + 1
        return None

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed. Does not mutate."""
        return n <= self._num_free

    def grow(self, new_capacity: int) -> None:
        """Add free ids up to ``new_capacity``. Mutates."""
        old = self.capacity
        if new_capacity <= old:
            return
        self._refcount.extend([0] * (new_capacity - old))
        self._free.extend(range(old, new_capacity))  # larger than every id in the heap: still a heap
        self._num_free += new_capacity - old

    def shrink(self, new_capacity: int) -> None:
        """Drop the ids from ``new_capacity`` on, all free, and the free list's stale entries: the books of an
        allocator made with ``new_capacity`` and holding what this one holds. Mutates; raises ``ValueError`` where an
        id to drop is held.

        >>> a = BlockAllocator(capacity=8)
        >>> a.allocate(3)
        [1, 2, 3]
        >>> a.decref([3]), a.shrink(3), a.capacity, a.num_free
        (1, None, 3, 0)
        """
        held = [b for b in range(max(1, new_capacity), self.capacity) if self._refcount[b]]
        if new_capacity < 1 or held:
            raise ValueError(f"cannot shrink to {new_capacity} ids: ids {held[:8]} are held (block 0 is reserved)")
        del self._refcount[new_capacity:]
        self._free = [b for b in range(1, new_capacity) if self._refcount[b] == 0]  # sorted: a heap
        self._num_free = len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free blocks, each with refcount 1: those right after block ``after`` while they are free,
        then the lowest free ids. Mutates; raises :class:`OutOfBlocksError`.

        >>> a = BlockAllocator(capacity=8)
        >>> a.allocate(2), a.allocate(1), a.allocate(2, after=2)
        ([1, 2], [3], [4, 5])
        """
        if n > self._num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self._num_free} free")
        rc = self._refcount
        blocks: list[int] = []
        if after is not None:
            b = after + 1
            while len(blocks) < n and b < len(rc) and rc[b] == 0:
                rc[b] = 1
                blocks.append(b)
                b += 1
        while len(blocks) < n:
            b = heapq.heappop(self._free)
            if rc[b] == 0:
                rc[b] = 1
                blocks.append(b)
        self._num_free -= n
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
                heapq.heappush(self._free, b)
                freed += 1
        self._num_free += freed
        return freed

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the free list and the refcounts disagree. Does not mutate."""
        free = {b for b in self._free if self._refcount[b] == 0}
        if len(free) != self._num_free:
            raise AssertionError(f"{self._num_free} blocks counted free, {len(free)} free in the heap")
        if NULL_BLOCK in free or self._refcount[NULL_BLOCK] != 1:
            raise AssertionError("the null block must stay reserved")
        for b in range(1, self.capacity):
            rc = self._refcount[b]
            if rc < 0:
                raise AssertionError(f"block {b} has negative refcount {rc}")
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: refcount {rc} but free-list membership {b in free}")
