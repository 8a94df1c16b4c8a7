"""The ``"blocks"`` backend: the attention reads every row's held K/V where they sit in the pool
(:func:`blocks_attention`), from reads planned by :func:`prefixkv.attention.planner.plan_reads`, its parts merged by
their log-sum-exps (:mod:`prefixkv.attention.kernels`); a forward's reads and what its layers work out once for all
of them are its :class:`BlocksForward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from . import planner
from .interface import sdpa_servable
from .kernels import NO_MASK, KernelMask, attend_masked, kernel_mask, merge_by_lse
from .planner import Read
from .reads import AttentionBackend, AttentionCall, ForwardReads, Layout, PoolView


class BlocksForward(ForwardReads):
    """A forward's plan for :class:`BlocksBackend`: besides what every backend's has, its ``reads`` of the pool
    (:func:`prefixkv.attention.planner.plan_reads`; none for a probe), ``new_from`` (the column from which the new
    K/V are attended from the arguments, ``None`` when every column is read from the pool), and what its layers
    work out once for all of them: ``masks``, per model mask (layers share one, sliding-window layers another) and
    part, what the part attends with; ``rows_index``, the batch indices of a read's rows as a tensor."""

    def __init__(
        self,
        pool: PoolView,
        reads: list[Read],
        columns: int,
        new_from: int | None,
        gather: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        *,
        probe: bool = False,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__(pool, columns, gather, probe=probe, backend=backend)
        self.reads = reads
        self.new_from = new_from
        self.masks: dict[tuple[int, int], tuple[torch.Tensor | None, Any]] = {}
        self.rows_index: dict[tuple[int, ...], torch.Tensor] = {}
        # the forward's only read, where it reads each row's own K/V (not K/V shared by several rows' queries) and
        # nothing is attended from the arguments: a decode step's one fold, view or strided view
        lone = reads[0] if len(reads) == 1 and new_from is None else None
        shared = lone is not None and len(lone.rows) > 1 and lone.row_stride is None and lone.valid is None
        self.lone = None if shared else lone


# -- reading the blocks ------------------------------------------------------------------------------------------
#
# A forward with a PagedPrefixCache on a model that runs ``prefixkv`` attention hands attention only the new K/V;
# the cache describes where every row's earlier K/V sit in the pool (:class:`Read`), and the attention reads them
# there: a contiguous run of blocks as a view of the pool, a scattered rest by one gather. Rows that hold the same
# leading blocks (one system prompt under a batch of questions, ``num_return_sequences``, beams) read those blocks
# in one pass with all their queries (cascade attention), and every part's result is merged with the others by its
# log-sum-exp. The model's mask decides what each query sees, so padding, holes and sliding windows hold as in the
# model's own implementation.


def part_mask_of(
    forward: BlocksForward, mask: torch.Tensor | None, index: int, q: int, batch: int, dtype: torch.dtype, group: int
) -> KernelMask:
    """The mask of read ``index`` (:func:`_read_mask`) from the model's ``mask`` (its batch dimension 1 or
    ``batch``), in the kernels' form for queries in ``dtype`` packing ``group`` heads (:func:`kernel_mask`), or
    :data:`NO_MASK` where it lets every query see every column (the held columns of a row without padding: the flash
    kernel runs faster without a mask), worked out once per forward for each mask the model passes, not per layer.
    Mutates the plan's memo."""
    key = (id(mask), index)
    hit = forward.masks.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]  # type: ignore[no-any-return]
    part = _read_mask(None if mask is None else _batched(mask, batch), forward.reads[index], q)
    if part is not None and part.dtype == torch.bool and bool(part.all()):
        part = None
    prepared = kernel_mask(part, dtype, group)
    forward.masks[key] = (mask, prepared)
    return prepared


def new_mask(
    forward: BlocksForward, mask: torch.Tensor | None, q: int, batch: int, dtype: torch.dtype, group: int
) -> tuple[KernelMask, bool]:
    """The mask of the new columns (from ``new_from``) in the kernels' form (``group`` heads packed where it is not
    causal) and whether it is plain causal (then :data:`NO_MASK`, and the kernel's causal flag serves it faster),
    once per forward for each mask. Mutates the plan's memo."""
    key = (id(mask), -1)
    hit = forward.masks.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]  # type: ignore[no-any-return]
    assert forward.new_from is not None
    part = None if mask is None else _batched(mask, batch)[..., forward.new_from :]
    if part is not None and part.dtype == torch.bool and part.shape[-1] == q:
        causal = torch.ones(q, q, dtype=torch.bool, device=part.device).tril()
        if bool((part == causal).all()):
            part = None
    result = (kernel_mask(part, dtype, 1 if part is None else group), part is None)
    forward.masks[key] = (mask, result)
    return result


def _pool_columns(flat: torch.Tensor, read: Read) -> torch.Tensor:
    """``[rows or 1, kv_heads, n, head_dim]`` K or V of a read from a layer's pool tensor by slot ``[kv_heads,
    num_blocks * block_size, head_dim]`` (:meth:`prefixkv.attention.reads.PoolView.slots`): a view for runs (each
    head one contiguous range), a gather otherwise."""
    heads, dim = flat.shape[0], flat.shape[2]
    if read.first_slot is not None:
        if read.row_stride is not None:
            return flat.as_strided(
                (len(read.rows), heads, read.length, dim),
                (read.row_stride * dim, flat.stride(0), dim, 1),
                flat.storage_offset() + read.first_slot * dim,
            )
        return flat[:, read.first_slot : read.first_slot + read.length].unsqueeze(0)
    assert read.slots is not None
    slots = read.slots.to(flat.device)
    if slots.dim() == 1:
        return flat.index_select(1, slots).unsqueeze(0)
    rows, n = slots.shape
    return flat.index_select(1, slots.view(-1)).view(heads, rows, n, dim).transpose(0, 1)


def _batched(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The model's mask with its batch dimension expanded to ``batch`` (a view) where it is 1."""
    return mask if mask.shape[0] == batch else mask.expand(batch, *mask.shape[1:])


def _read_mask(mask: torch.Tensor | None, read: Read, q: int) -> torch.Tensor | None:
    """The mask of a read's queries over its columns: ``[rows, 1, q, n]`` (``[1, 1, rows * q, n]`` for shared
    K/V), from the model's ``mask`` (``None``: every column is seen, except a gather's padding)."""
    if read.valid is not None:  # a gather of several rows
        assert read.offsets is not None
        valid = read.valid.to(mask.device if mask is not None else read.valid.device)
        if mask is None:
            return valid[:, None, None, :].expand(len(read.rows), 1, q, read.length)
        rows = torch.tensor(read.rows, device=mask.device)
        index = read.offsets.to(mask.device)[:, None, None, :].expand(len(read.rows), 1, q, read.length)
        return mask.index_select(0, rows).gather(-1, index) & valid[:, None, None, :]
    if mask is None:
        return None
    if read.offsets is not None:
        offsets = read.offsets.to(mask.device)
        parts = [mask[r : r + 1].index_select(-1, offsets + c) for r, c in zip(read.rows, read.columns)]
    else:
        parts = [mask[r : r + 1, :, :, c : c + read.length] for r, c in zip(read.rows, read.columns)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0 if read.row_stride is not None else 2)


def blocks_attention(
    forward: BlocksForward,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, q, D]`` over what ``forward`` describes for ``layer``: its reads of the
    pool, and, when ``forward.new_from`` is set, the new ``key``/``value`` ``[B, Hkv, q, D]``; ``mask`` is the
    model's ``[B, 1, q, columns]`` mask (``None``: every held column and the new ones causally). Returns
    ``[B, q, Hq, D]`` as transformers' attention functions do."""
    batch, heads, q, dim = query.shape
    pool_k, pool_v = forward.views[layer]
    group = max(1, heads // pool_k.shape[0])
    everyone = tuple(range(batch))
    if forward.lone is not None and forward.lone.rows == everyone:
        read = forward.lone
        if part_mask_of(forward, mask, 0, q, batch, query.dtype, group) is NO_MASK:
            # a decode step's one read of every row, every column seen: no part to merge by its log-sum-exp, so
            # torch's own attention, the query heads of a K/V head packed as its rows as attend_masked packs them
            k, v = _pool_columns(pool_k, read), _pool_columns(pool_v, read)
            packed = query.reshape(batch, k.shape[1], heads // k.shape[1] * q, dim)
            out = torch.nn.functional.scaled_dot_product_attention(packed, k, v, scale=scale)
            return out.reshape(batch, heads, q, dim).transpose(1, 2).contiguous()
    parts: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = []
    for number, read in enumerate(forward.reads):
        k, v = _pool_columns(pool_k, read), _pool_columns(pool_v, read)
        part_mask = part_mask_of(forward, mask, number, q, batch, query.dtype, group)
        if len(read.rows) == 1:
            out, lse = attend_masked(query[read.rows[0] : read.rows[0] + 1], k, v, part_mask, scale)
        else:
            chosen = query if read.rows == everyone else query.index_select(0, _rows_index(forward, read.rows, query))
            if read.row_stride is None and read.valid is None:  # shared K/V: every row's queries in one pass
                stacked = chosen.transpose(0, 1).reshape(1, heads, len(read.rows) * q, dim)
                out, lse = attend_masked(stacked, k, v, part_mask, scale)
                out = out.view(heads, len(read.rows), q, dim).transpose(0, 1)
                lse = lse.view(heads, len(read.rows), q).transpose(0, 1)
            else:
                out, lse = attend_masked(chosen, k, v, part_mask, scale)
        parts.append((read.rows, out, lse))
    if forward.new_from is not None:
        new, causal = new_mask(forward, mask, q, batch, query.dtype, group)
        out, lse = attend_masked(query, key, value, new, scale, causal=causal)
        parts.append((everyone, out, lse))
    if len(parts) == 1 and parts[0][0] == everyone:
        merged = parts[0][1]
    else:
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        if parts[0][0] == everyone:  # the first part covers every row: start from it
            _, merged, total = parts.pop(0)
            merged, total = merged.to(work), total.to(work)
        else:
            merged = query.new_zeros((batch, heads, q, dim), dtype=work)
            total = query.new_full((batch, heads, q), -math.inf, dtype=work)
        for rows, out, lse in parts:
            if rows == everyone:
                merged, total = merge_by_lse(merged, total, out, lse)
                continue
            index = _rows_index(forward, rows, query)
            m, t = merge_by_lse(merged.index_select(0, index), total.index_select(0, index), out, lse)
            merged.index_copy_(0, index, m.to(work))
            total.index_copy_(0, index, t.to(work))
    return merged.to(query.dtype).transpose(1, 2).contiguous()


def _rows_index(forward: BlocksForward, rows: tuple[int, ...], query: torch.Tensor) -> torch.Tensor:
    """``rows`` as an index tensor on the queries' device, made once per forward. Mutates the plan's memo."""
    index = forward.rows_index.get(rows)
    if index is None:
        index = forward.rows_index[rows] = torch.tensor(rows, device=query.device)
    return index


class BlocksBackend:
    """``"blocks"``: the attention reads every row's held K/V where they sit in the pool (:func:`blocks_attention`),
    from reads planned by :func:`prefixkv.attention.planner.plan_reads`. Keeps each row table's runs of consecutive
    blocks between forwards (a table that only grew is re-walked from its last block), and the index tensors of the
    last folded read."""

    name = "blocks"

    def __init__(self) -> None:
        self._runs: planner.RunsMemo = {}
        self._fold: planner.FoldMemo = {}
        self._step: planner.StepMemo = {}

    def plan(self, layout: Layout, *, probe: bool) -> BlocksForward:
        """The forward's reads; with ``probe`` none (``update`` hands out whole rows, and the forward only checks
        that every layer reaches this attention). Mutates the runs memo."""
        pool, pads, tables, start, q, block_size, gather = layout
        planned, new_from = (
            ([], None)
            if probe
            else planner.plan_reads(
                pads, tables, start, q, block_size, self._runs, fold_memo=self._fold, step_memo=self._step
            )
        )
        return BlocksForward(pool, planned, start + q, new_from, gather, probe=probe, backend=self)

    def servable(self, forward: ForwardReads, call: AttentionCall) -> bool:
        return sdpa_servable(call.module, call.query, call.mask, call.kwargs, forward)

    def attend(self, forward: ForwardReads, layer: int, call: AttentionCall) -> torch.Tensor:
        assert isinstance(forward, BlocksForward)  # made by plan
        scale = call.kwargs.get("scaling")
        return blocks_attention(forward, layer, call.query, call.key, call.value, call.mask, scale)
