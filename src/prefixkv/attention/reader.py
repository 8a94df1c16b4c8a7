"""How one cache's K/V reach the attention (:class:`Reader`): the backend the store chose, the whole-row reader
(:class:`WholeRows`) and an invariant store's canonical read of whole rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..base.settings import StoreSettings
from ..base.slots import slot_table
from . import registry
from .interface import READ_DEVICES, serves, verified
from .reads import ForwardReads, Layout, PoolView, shapes_differ

Gather = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class WholeRows:
    """Reads every row's whole K/V of a layer out of the pool, ``[B, kv_heads, columns, head_dim]``, through the
    store's ``gather`` (which holds its lock): by a block table when every row's padding is whole blocks, else by
    slots. :meth:`begin` takes each forward's layout; the index tensor is built on the first read that needs it
    and kept while the layout stays the same (checked against a copy, so a change needs no notice)."""

    def __init__(self, gather: Gather, block_size: int) -> None:
        self._gather_kv = gather
        self._bs = block_size
        self._layout: tuple[list[int], list[list[int]], int] = ([], [], 0)
        self._by_table = False
        self._built: dict[torch.device, torch.Tensor] = {}
        self._columns = 0
        self._next: tuple[list[int], list[list[int]], int] | None = None

    def begin(self, pads: list[int], tables: list[list[int]], length: int) -> None:
        """The layout of the forward about to run, looked at only if the forward reads whole rows. Mutates."""
        self._next = (pads, tables, length)

    def _settle(self) -> None:
        """Take the layout :meth:`begin` was given, keeping what was built for an equal one. Mutates."""
        if self._next is None:
            return
        (pads, tables, length), self._next = self._next, None
        bs = self._bs
        by_table = bool(tables) and all(p % bs == 0 for p in pads)
        # a block table depends on the blocks the columns span, a slot table on the columns themselves
        extent = -(-length // bs) if by_table else length
        layout = (list(pads), [list(t) for t in tables], extent)
        if layout != self._layout or by_table != self._by_table:
            self._layout, self._by_table, self._built = layout, by_table, {}
        self._columns = length

    @property
    def by_table(self) -> bool:
        """Whether this forward reads by a block table (every row's padding is whole blocks), else by slots."""
        self._settle()
        return self._by_table

    def read(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V of ``layer`` over the forward's columns. Mutates only what it keeps."""
        self._settle()
        table = self._built.get(device)
        if table is None:
            table = self._built[device] = self._table().to(device)
        if self._by_table:
            return self._gather_kv(layer, table=table, length=self._columns)
        return self._gather_kv(layer, slots=table)

    def _table(self) -> torch.Tensor:
        bs = self._bs
        pads, tables, extent = self._layout
        if self._by_table:
            lists = [[0] * (p // bs) + t for p, t in zip(pads, tables)]
            return torch.tensor([t[:extent] + [0] * (extent - len(t)) for t in lists], dtype=torch.long)
        return slot_table(pads, tables, 0, extent, bs)


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

    def plan(self, pads: list[int], tables: list[list[int]], start: int, q: int) -> ForwardReads:
        """The read plan of a forward feeding ``q`` columns after ``start`` (docs/how-it-works.md, "Attention reads
        the blocks"), once per forward. Mutates only what the reader keeps between forwards."""
        self._whole.begin(pads, tables, start + q)
        gather = self._gather
        if torch.is_autocast_enabled(self._pool.specs[0].device.type):  # torch's own query: once a step, no hop
            # under torch.autocast the model's own attention, on whole rows in the dtypes the layers handed over,
            # computes what it computes without a cache (docs/correctness.md, "Autocast")
            self._run = None
            return ForwardReads(self._pool, start + q, gather, in_place=False)
        if self._backend.name == "gather" or not serves(self._model) or self._whole_rows_only:
            canonical = self._invariant and serves(self._model)
            self._run = _lone_run(self._pool, pads, tables, start + q, self._bs) if canonical else None
            return ForwardReads(self._pool, start + q, gather, in_place=False, canonical=canonical)
        layout = Layout(self._pool, pads, tables, start, q, self._bs, gather)
        return self._backend.plan(layout, probe=not verified(self._model))

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
        return self._whole.read(layer, self._pool.specs[layer].device)


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
    if len(table) < count or any(b != table[0] + i for i, b in enumerate(table)):
        return None
    return table[0], count, columns
