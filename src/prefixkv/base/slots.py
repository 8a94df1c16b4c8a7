"""The pool's addressing, on the ground floor: where a column of a row lies in every layer's pool.

A layer's K or V is ``[kv_heads, num_blocks, block_size, head_dim]`` (head-major), so slot ``s`` of a head is
``block s // block_size`` at offset ``s % block_size``, and :func:`slot_view` is the tensor indexed by slot. A row
has ``pad`` leading padding columns, then its tokens: token ``t`` sits at column ``pad + t`` and in slot
``table[t // block_size] * block_size + t % block_size`` of its block ``table``; a pad column, and a column past
the row's blocks, reads slot 0 (the null block, which stays zeros). :func:`slot_table` is that arithmetic, the one
home of it: the cache's rows, the whole-row reader and the compiled step's tables all call it. Nothing here
mutates."""

from __future__ import annotations

import torch

# at most this many columns (a decode step's few), the slots are plain ints made into one tensor at the end: that
# beats setting up a handful of small tensors
_FEW = 8


def slot_table(pads: list[int], tables: list[list[int]], start: int, stop: int, block_size: int) -> torch.Tensor:
    """``[B, stop - start]`` pool slots (a CPU LongTensor) of columns ``[start, stop)`` of the rows with leading
    ``pads`` and block ``tables``; a pad column and a column past a row's blocks read slot 0.

    >>> slot_table([0, 2], [[3, 4], [5]], 0, 4, 2).tolist()
    [[6, 7, 8, 9], [0, 0, 10, 11]]
    """
    if not tables:
        return torch.zeros((0, stop - start), dtype=torch.long)
    if stop - start <= _FEW:
        rows = []
        for pad, table in zip(pads, tables):
            end = len(table) * block_size
            rows.append(
                [
                    table[(c - pad) // block_size] * block_size + (c - pad) % block_size if 0 <= c - pad < end else 0
                    for c in range(start, stop)
                ]
            )
        return torch.tensor(rows, dtype=torch.long)
    n = max(1, max(len(t) for t in tables))
    blocks = torch.tensor([t + [0] * (n - len(t)) for t in tables], dtype=torch.long)  # [B, n]
    t = torch.arange(start, stop)[None, :] - torch.tensor(pads, dtype=torch.long)[:, None]  # [B, W] token index
    held = torch.tensor([len(x) * block_size for x in tables], dtype=torch.long)[:, None]  # [B, 1]
    valid = (t >= 0) & (t < held)
    t = t.clamp(min=0)
    slots = blocks.gather(1, (t // block_size).clamp(max=n - 1)) * block_size + t % block_size
    return slots.masked_fill_(~valid, 0)


def slot_view(t: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, num_blocks * block_size, head_dim]`` view of a layer's K or V (or its 8-bit codes),
    ``[kv_heads, num_blocks, block_size, head_dim]``, indexed by slot."""
    return t.view(t.shape[0], t.shape[1] * t.shape[2], t.shape[3])  # sizes, not -1: a layer of no heads is empty
