"""The compiled decode step: a one-token forward of a ``PagedPrefixCache(..., compileable=True)`` whose
``update`` and attention are one graph per bucket (docs/how-it-works.md, "A decode step that compiles").

Everything such a step decides (the proof, the block allocation, publishing) happens in the model hooks around the
forward, outside any graph; what the forward gets is tensors of fixed shapes: each row's slot for the new column
(``[B]``) and a slot table of every column the step attends (``[B, W]``, ``W`` the columns rounded up to a
bucket, :func:`width`; pad columns and columns past the row's end read slot 0, the null block, which the model's
mask hides). ``update`` writes the new K/V into the pool by index and returns the table's K/V; the model's own
attention (``sdpa``, through ``prefixkv`` attention with no decision of its own, :data:`STEP_KWARG`) attends them
under the mask ``generate`` builds for a compileable cache, ``[B, 1, 1, W]``, as it does for ``StaticCache``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base.settings import StoreSettings
from ..base.slots import slot_table, slot_view
from .reads import PoolView, shapes_differ

# the keyword argument the store's forward pre-hook adds to a forward whose steps are of this module, so that
# ``prefixkv`` attention hands the call to the model's own implementation without looking for a read plan
STEP_KWARG = "prefixkv_static_step"

# columns are rounded up to a multiple of an eighth of their power of two (at least a block): at most an eighth
# more columns attended than held, and eight buckets per doubling of the context
_PER_OCTAVE = 8


def width(columns: int, block_size: int) -> int:
    """The bucket of a step over ``columns`` columns: the mask's and the slot table's width.

    >>> [width(n, 16) for n in (1, 16, 17, 100, 1025, 1100)]
    [16, 16, 32, 112, 1152, 1152]
    """
    step = max(block_size, (1 << max(0, columns.bit_length() - 1)) // _PER_OCTAVE)
    return -(-columns // step) * step


def refusal(settings: StoreSettings, pool: PoolView) -> str | None:
    """Why the caches of a store of these ``settings`` and ``pool`` cannot take compiled decode steps (``None``: they
    can). Does not mutate."""
    if settings.invariant:
        return (
            "an invariant store reads every row's K/V in its canonical order through its own attention, outside "
            "the graph (docs/correctness.md, 'Outputs that never depend on the cache')"
        )
    if pool.kv_dtype is not None:
        return f"the pool stores {pool.kv_dtype} blocks, which are dequantized outside the graph"
    if shapes_differ(pool):
        return (
            "its layers hand K and V of other shapes (multi-head latent attention's latent and rotary key, V heads of "
            "another size), which take the update path, whole rows, outside the graph"
        )
    specs = pool.specs
    if not specs or len({s.device for s in specs}) > 1 or len({s.dtype for s in specs}) > 1:
        return "the pool's layers lie on several devices or dtypes"
    return None


def mark_width(masks: Any) -> None:
    """Mark the last dimension (the bucket's width) of a step's mask, or of each mask of a dict of them (one per
    kind of layer), a size of the graph rather than a constant of it, as :class:`StaticStep` marks its slot table's
    width. Mutates only the tensors' dynamo marks."""
    for mask in masks.values() if isinstance(masks, dict) else (masks,):
        if isinstance(mask, torch.Tensor) and not hasattr(mask, "_dynamo_weak_dynamic_indices"):
            torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)


class StepTables:
    """The slot tables of one cache's compiled steps, kept between steps: rebuilt only when a row's pads or block
    table or the bucket changed (a row enters a new block every ``block_size`` steps), since a table maps every
    column of a row's blocks, the ones to come included. Mutates only itself."""

    def __init__(self, block_size: int) -> None:
        self._bs = block_size
        self._key: tuple[Any, ...] = ()
        self._seen: list[list[int]] = []
        self._table: torch.Tensor | None = None

    def table(self, pads: list[int], tables: list[list[int]], columns: int, device: torch.device) -> torch.Tensor:
        """``[B, columns]`` pool slots of each row's columns (pad columns and columns past the row's blocks: slot
        0). Mutates the memo."""
        key = (columns, device, tuple(pads))
        if key == self._key and tables == self._seen and self._table is not None:
            return self._table  # lists compare in C: a few microseconds for a batch of long rows
        table = slot_table(pads, tables, 0, columns, self._bs).to(device)
        self._key, self._seen, self._table = key, [list(t) for t in tables], table
        return table


class StaticStep:
    """One compiled step's tensors: per layer the pool's K and V (``[kv_heads, blocks, block_size, head_dim]``), the new
    column's slot of each row (``slots``, ``[B]``) and the slot table (``table``, ``[B, W]``). :meth:`update` is
    all that runs in the graph. Read-only after construction."""

    def __init__(self, pool: PoolView, slots: torch.Tensor, table: torch.Tensor, position: torch.Tensor) -> None:
        held = [pool.kv(layer) for layer in range(len(pool.specs))]
        self.keys: list[torch.Tensor] = [k for k, _ in held]
        self.values: list[torch.Tensor] = [v for _, v in held]
        self.slots = slots
        self.table = table
        # the pool's size (it grows) and the bucket's width are sizes of one graph, not graphs of their own: a
        # compile serves batch 1, another every larger batch (dynamo specializes a size of 1)
        for t in (*self.keys, *self.values, table):
            if not hasattr(t, "_dynamo_weak_dynamic_indices"):
                torch._dynamo.maybe_mark_dynamic(t, 1)
        self.position = position  # the new column, a 0-d tensor: what ``get_seq_length`` gives inside the graph

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key``/``value`` ``[B, kv_heads, 1, head_dim]`` at the rows' slots and return every row's K/V
        over the table, ``[B, kv_heads, W, head_dim]``. Mutates the pool, never its autograd state: what is written
        is detached, as the eager write is made under ``no_grad``, or the pool, which every request shares, would
        join this forward's autograd graph (and another request's backward run through it)."""
        k, v = slot_view(self.keys[layer]), slot_view(self.values[layer])
        heads, dim = k.shape[0], k.shape[2]  # a layer's own: layers may differ, a layer's K and V do not (refusal)
        k.index_copy_(1, self.slots, key.detach().transpose(0, 1).reshape(heads, -1, dim).to(k.dtype))
        v.index_copy_(1, self.slots, value.detach().transpose(0, 1).reshape(heads, -1, dim).to(v.dtype))
        b, w = self.table.shape
        flat = self.table.reshape(-1)
        keys = k.index_select(1, flat).view(heads, b, w, dim).transpose(0, 1)
        values = v.index_select(1, flat).view(heads, b, w, dim).transpose(0, 1)
        return keys.to(key.dtype), values.to(value.dtype)

    def carry_over(self, pool: PoolView) -> None:
        """Copy what :meth:`update` wrote (every layer's slots of the new column) into ``pool``'s tensors where they
        are no longer the ones this step was given (the pool grew meanwhile: a growth copies every layer into new
        tensors, and the copy may predate the write). The caller holds the store's lock. Mutates the pool."""
        for layer, pair in enumerate(zip(self.keys, self.values)):
            for old, new in zip(pair, pool.kv(layer)):
                if old is not new:
                    slot_view(new).index_copy_(1, self.slots, slot_view(old).index_select(1, self.slots))
