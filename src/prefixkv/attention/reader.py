"""How one cache's K/V reach the attention (:class:`Reader`): the backend the store chose, the whole-row reader
(:class:`WholeRows`) and an invariant store's canonical read of whole rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..base.settings import StoreSettings
from ..base.slots import slot_table
from . import planner, registry
from .interface import READ_DEVICES, serves, verified
from .reads import ForwardReads, Layout, PoolView, shapes_differ

Gather = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class WholeRows:
    """Reads every row's whole K/V of a layer out of the pool, ``[B, kv_heads, columns, head_dim]``, by slots: one
    ``index_select`` a tensor over the layer's slot views (a quantized pool's codes go through the store's ``gather``,
    which holds its lock and dequantizes). :meth:`begin` takes each forward's layout; the slot index
    (:func:`prefixkv.base.slots.slot_table`) is kept per device and only its new columns are filled while the rows
    keep their padding and their tables only grow, as a decode step's do (checked against a copy, so a change needs no
    notice: anything else builds it anew)."""

    def __init__(self, gather: Gather, block_size: int) -> None:
        self._gather_kv = gather
        self._bs = block_size
        self._pads: list[int] = []
        self._tables: list[list[int]] = []  # each row's blocks at the forward's begin (a copy)
        self._index: dict[torch.device, torch.Tensor] = {}  # [B, capacity] slots; columns [0, _filled) are set
        self._filled: dict[torch.device, int] = {}
        self._columns = 0
        self._now: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # the forward's index, and flat
        self._new: torch.Tensor | None = None  # the forward's own columns' slots, [B, q], which end at _columns
        self._next: tuple[list[int], list[list[int]], int] | None = None

    def begin(self, pads: list[int], tables: list[list[int]], length: int, new: torch.Tensor | None = None) -> None:
        """The layout of the forward about to run, looked at only if the forward reads whole rows; ``new``: the
        slots of the columns it feeds (``[B, q]``, the last of its ``length``), where the rows have them already.
        Mutates."""
        self._next, self._new = (pads, tables, length), new

    def _settle(self) -> None:
        """Take the layout :meth:`begin` was given, keeping the columns already indexed where the rows kept their
        padding and their tables grew only. Mutates."""
        if self._next is None:
            return
        (pads, tables, length), self._next = self._next, None
        if (
            pads != self._pads
            or len(tables) != len(self._tables)
            or any(t[: len(old)] != old for t, old in zip(tables, self._tables))
        ):
            self._index, self._filled, self._pads = {}, {}, list(pads)
        self._tables = [list(t) for t in tables]
        self._columns = length
        self._now = {}

    def index(self, device: torch.device) -> torch.Tensor:
        """``[B, columns]`` pool slots of every row's columns of the forward, on ``device`` (pad columns: slot 0).
        Mutates only what it keeps."""
        self._settle()
        kept = self._now.get(device)
        if kept is not None:  # the forward's later layers
            return kept[0]
        columns, filled = self._columns, self._filled.get(device, 0)
        index = self._index.get(device)
        if index is None or index.shape[1] < columns:
            width = max(columns, 64, 0 if index is None else 2 * index.shape[1])
            grown = torch.zeros((len(self._tables), width), dtype=torch.long, device=device)
            if index is not None and filled:
                grown[:, :filled] = index[:, :filled]
            index = self._index[device] = grown
        new = self._new
        if new is not None and filled == columns - new.shape[1] and filled < columns:  # a step: its own slots
            index[:, filled:columns] = new
            self._filled[device] = columns
        elif filled < columns:
            index[:, filled:columns] = slot_table(self._pads, self._tables, filled, columns, self._bs).to(device)
            # a column past a row's blocks reads slot 0 now, and may lie in blocks the row claims later
            held = min((p + len(t) * self._bs for p, t in zip(self._pads, self._tables)), default=columns)
            self._filled[device] = min(columns, held)
        now = index[:, :columns]
        self._now[device] = (now, now.reshape(-1))  # the flat copy made once a forward, not once a layer
        return now

    def read(
        self, layer: int, views: tuple[torch.Tensor, torch.Tensor], quantized: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V of ``layer`` over the forward's columns, from ``views`` (the layer's K and V by slot,
        :meth:`prefixkv.kv.pool.BlockPool.slots`, on the device they lie on), or through the store's ``gather``
        where the pool is ``quantized``. A lone row's are contiguous. Mutates only what it keeps."""
        k, v = views
        index = self.index(k.device)
        if quantized:
            return self._gather_kv(layer, slots=index)
        rows, columns = index.shape
        flat = self._now[k.device][1]
        if rows == 1:
            return k.index_select(1, flat)[None], v.index_select(1, flat)[None]
        return tuple(  # type: ignore[return-value]
            t.index_select(1, flat).view(t.shape[0], rows, columns, t.shape[2]).transpose(0, 1) for t in (k, v)
        )


class Reader:
    """How one cache's K/V reach the attention: through the backend the store chose when it was built
    (``settings.backend``, :func:`prefixkv.attention.registry.choose`; this cache's own, :func:`registry.build`) and
    the whole-row reader. The ``"gather"`` backend, and a model switched away from ``prefixkv`` attention since the
    store was built (it would get only the new K/V), read whole rows; a backend that reads in place does so only
    once a forward of the model showed every layer handing the K/V from ``update`` to that attention unchanged, and
    until then probes (``update`` hands out whole rows). An invariant store's choice is the gather: its whole rows in
    logical order, attended in one grouped-head kernel call (:func:`prefixkv.attention.kernels.whole_rows_attention`)
    or by the model's own attention (docs/correctness.md, "Outputs that never depend on the cache")."""

    def __init__(self, pool: PoolView, gather: Gather, settings: StoreSettings, *, model: Any) -> None:
        self._pool, self._bs, self._model = pool, settings.block_size, model
        self._invariant = settings.invariant
        self._whole = WholeRows(gather, settings.block_size)
        self._backend = registry.build(settings.backend, settings.block_size)
        self._run: tuple[int, int, int] | None = None  # a lone row's consecutive blocks: first, count, columns
        self._whole_rows_only = shapes_differ(pool)  # K and V of other shapes: the backends read one head size
        self._reads: ForwardReads | None = None  # the plan of the forward now: its slot views are what reads read

    def plan(
        self, pads: list[int], tables: list[list[int]], start: int, q: int, new: torch.Tensor | None = None
    ) -> ForwardReads:
        """The read plan of a forward feeding ``q`` columns after ``start`` (docs/how-it-works.md, "Attention reads
        the blocks"), whose slots are ``new`` (``[B, q]``, where the caller has them), once per forward. Mutates
        only what the reader keeps between forwards."""
        self._whole.begin(pads, tables, start + q, new)
        gather = self._gather
        if torch.is_autocast_enabled(self._pool.specs[0].device.type):  # torch's own query: once a step, no hop
            # under torch.autocast the model's own attention, on whole rows in the dtypes the layers handed over,
            # computes what it computes without a cache (docs/correctness.md, "Autocast")
            self._run = None
            return self._planned(ForwardReads(self._pool, start + q, gather, in_place=False))
        # a lone row's decode step that the blocks would read in one gather (planner.lone_fold) reads the same
        # gather as whole rows for the model's own attention: no plan, no kernel of ours, the same copy
        # (docs/how-it-works.md, "Attention reads the blocks")
        folds = self._backend.name == "blocks" and planner.lone_fold(pads, tables, start, q, self._bs)
        if self._backend.name == "gather" or folds or not serves(self._model) or self._whole_rows_only:
            canonical = self._invariant and serves(self._model)
            self._run = _lone_run(self._pool, pads, tables, start + q, self._bs) if canonical else None
            return self._planned(ForwardReads(self._pool, start + q, gather, in_place=False, canonical=canonical))
        layout = Layout(self._pool, pads, tables, start, q, self._bs, gather)
        return self._planned(self._backend.plan(layout, probe=not verified(self._model)))

    def _planned(self, reads: ForwardReads) -> ForwardReads:
        self._reads = reads
        return reads

    def end(self) -> None:
        """The forward ended: drop its plan, which holds the pool's tensors of its step (an idle cache must not keep
        a grown pool's old storage) and this reader (through its ``gather``). Mutates."""
        self._reads = None

    def _gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's whole K/V of ``layer``, ``[B, kv_heads, columns, head_dim]``, copied out of the pool; in an
        invariant store's canonical read, a lone row whose blocks lie one after the other in the pool reads a
        view of them instead: the same values in the same per-head layout (a row's columns ``head_dim`` apart),
        so the same kernel call, without the copy."""
        if self._run is not None:
            first, count, columns = self._run
            k, v = (t[:, first : first + count] for t in self._pool.kv(layer))
            k, v = (t.reshape(t.shape[0], -1, t.shape[3]) for t in (k, v))
            return k[None, :, :columns], v[None, :, :columns]
        reads = self._reads
        assert reads is not None  # a forward's reads come after its plan
        # the plan's views: a write that found the pool grown since the step began refreshed them
        return self._whole.read(layer, reads.views[layer], self._pool.kv_dtype is not None)


def _lone_run(
    pool: PoolView, pads: list[int], tables: list[list[int]], columns: int, bs: int
) -> tuple[int, int, int] | None:
    """``(first block, blocks, columns)`` when the forward has one row, no padding, and its first ``columns``
    lie in consecutive blocks of an unquantized pool on a device whose pools attention reads in place; else
    ``None``. Does not mutate."""
    if len(tables) != 1 or pads[0] or pool.kv_dtype is not None or not pool.specs:
        return None
    if any(s.device.type not in READ_DEVICES for s in pool.specs):
        return None
    count = -(-columns // bs)
    table = tables[0][:count]
    if len(table) < count or not planner.one_run(table):
        return None
    return table[0], count, columns
