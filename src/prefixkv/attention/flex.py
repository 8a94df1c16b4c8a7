"""The ``"flex"`` attention backend (``PrefixStore(attention="flex")``): :class:`FlexBackend` reads every row's held
K/V where they lie in the pool through torch's FlexAttention (:mod:`prefixkv.attention.flex_kernel`: :func:`plan`,
:func:`attend`), one plan per forward and model mask, used only where the mask it implies is the model's; importing
this module registers the backend with :func:`prefixkv.attention.registry.provide`. ``prefixkv.flex`` is this
module: it re-exports the kernel's public names (:func:`can_serve`, :func:`compiles`, :func:`plan`, :func:`attend`).

>>> import torch
>>> from prefixkv import flex
>>> flex.can_serve("cpu", torch.float32, 16)
(True, 'FlexAttention serves it')
"""

from __future__ import annotations

import warnings

import torch

from prefixkv.attention import interface, registry
from prefixkv.attention.flex_kernel import FlexPlan, FlexUnavailable, attend, can_serve, compiles, plan
from prefixkv.attention.gather import GatherBackend
from prefixkv.attention.reads import AttentionCall, ForwardReads, Layout

__all__ = ["FlexBackend", "FlexForward", "FlexPlan", "FlexUnavailable", "attend", "can_serve", "compiles", "plan"]


# -- the backend behind the attention seam (prefixkv.attention.reads.AttentionBackend) ---------------------------


class FlexForward(ForwardReads):
    """A forward's plan for :class:`FlexBackend`: besides what every backend's has, its
    :class:`~prefixkv.attention.reads.Layout`, and the :class:`FlexPlan` of each model mask and window (``None``:
    FlexAttention cannot express that mask), made on the first layer that attends with it."""

    def __init__(self, layout: Layout, *, probe: bool, backend: FlexBackend) -> None:
        super().__init__(layout.pool, layout.start + layout.q, layout.gather, probe=probe, backend=backend)
        self.layout = layout
        self.plans: dict[tuple[int, int | None], tuple[torch.Tensor | None, FlexPlan | None]] = {}


def _window(call: AttentionCall) -> int | None:
    """The call's sliding window: what the model passes the attention (Mistral, Qwen 2), or its module's."""
    window = call.kwargs.get("sliding_window", getattr(call.module, "sliding_window", None))
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def _logical(layout: Layout, q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the held tokens FlexAttention reads from the pool (decode: its new one too, ``update`` wrote it
    there), each query's logical column, and the mask column of logical column 0 (its pads)."""
    pads = torch.tensor(layout.pads, dtype=torch.int64)
    held = layout.start + (1 if q == 1 else 0) - pads
    positions = (layout.start - pads)[:, None] + torch.arange(q)[None, :]
    return held.clamp(min=0), positions, pads


def _implied(
    lengths: torch.Tensor,
    positions: torch.Tensor,
    pads: torch.Tensor,
    visible: torch.Tensor | None,
    new_visible: torch.Tensor | None,
    window: int | None,
    start: int,
    columns: int,
) -> torch.Tensor:
    """``[B, q, columns]``: what :func:`plan` with these inputs lets each query see, over the model's mask columns
    (a query sees column ``pads + c`` of its row's logical column ``c``), for comparing with the model's mask."""
    col = torch.arange(columns)[None, None, :]
    c = col - pads[:, None, None]  # [B, 1, columns] logical columns, negative over the pads
    p = positions[:, :, None]
    held_cols = (c >= 0) & (c < lengths[:, None, None])
    if visible is not None:
        seen = visible.gather(1, c[:, 0].clamp(min=0, max=visible.shape[1] - 1))[:, None, :]
        held_cols = held_cols & seen
    sees = held_cols & (c <= p)
    q = positions.shape[1]
    if q > 1:  # the new columns, attended from the arguments: causal, by index
        j = col - start
        new_cols = (j >= 0) & (j <= torch.arange(q)[None, :, None])
        if new_visible is not None:
            index = j[:, 0].clamp(min=0, max=q - 1).expand(new_visible.shape[0], -1)
            new_cols = new_cols & new_visible.gather(1, index)[:, None, :]
        sees = sees | new_cols
    if window is not None:
        sees = sees & (p - c < window)
    return sees


class FlexBackend:
    """``"flex"``: every row's held K/V read where they lie in the pool by torch's FlexAttention (:func:`attend`),
    one :func:`plan` per forward and mask (one per window for sliding-window layers) made from the rows' block
    tables, lengths, the visibility the model's mask gives each logical column (pads, holes) and the queries'
    positions. A plan is used only when the mask it implies equals the model's mask, column for column; a call it
    cannot serve (another mask, dropout, soft-capping) or a kernel that does not compile runs on whole rows (the
    gather), with a warning that says why."""

    name = "flex"

    def __init__(self, block_size: int) -> None:
        self._bs = block_size

    def plan(self, layout: Layout, *, probe: bool) -> ForwardReads:
        """The forward's layout; its FlexAttention plans are made by the layers that attend. Does not mutate."""
        return FlexForward(layout, probe=probe, backend=self)

    def servable(self, forward: ForwardReads, call: AttentionCall) -> bool:
        """Whether FlexAttention computes this call exactly: a call the blocks reader would serve, on a device and
        dtype it compiles for, with a mask it expresses. Warns (once per reason) when it does not. Mutates only the
        forward's plans."""
        if not interface.sdpa_servable(call.module, call.query, call.mask, call.kwargs, forward):
            return False
        ok, why = can_serve(call.query.device, call.query.dtype, self._bs)
        if not ok:
            _fall_back(why)
            return False
        assert isinstance(forward, FlexForward)
        if self._plan(forward, call) is None:
            _fall_back(can_serve(call.query.device, call.query.dtype, self._bs, custom_mask=True)[1])
            return False
        return True

    def attend(self, forward: ForwardReads, layer: int, call: AttentionCall) -> torch.Tensor:
        """One layer's attention from the forward's plan, ``[B, q, Hq, D]``; where the kernel does not compile,
        the same attention on whole rows (and a warning). Mutates only the forward's plans."""
        assert isinstance(forward, FlexForward)
        reads = self._plan(forward, call)
        assert reads is not None
        try:
            return attend(
                reads,
                call.query,
                *forward.pool.kv(layer),
                scale=call.kwargs.get("scaling"),
                key=call.key if reads.new_mask is not None else None,
                value=call.value if reads.new_mask is not None else None,
            )
        except FlexUnavailable as error:
            _fall_back(str(error))
            return GatherBackend().attend(forward, layer, call)

    def _plan(self, forward: FlexForward, call: AttentionCall) -> FlexPlan | None:
        """The plan of the call's mask and window, made once per forward. Mutates the forward's plans."""
        mask, window = call.mask, _window(call)
        key = (id(mask), window if mask is not None else None)
        hit = forward.plans.get(key)
        if hit is not None and hit[0] is mask:
            return hit[1]
        layout, q = forward.layout, call.query.shape[2]
        lengths, positions, pads = _logical(layout, q)
        visible = new_visible = None
        if mask is None:
            window = None  # sdpa's plain causal mask: no window cuts any column
        else:
            seen = mask[:, 0].any(dim=1).cpu()  # [B or 1, columns]: what some query of the row sees
            seen = seen.expand(len(layout.pads), -1)
            width = max(int(lengths.max()), 1)
            index = (pads[:, None] + torch.arange(width)[None, :]).clamp(max=seen.shape[1] - 1)
            visible = seen.gather(1, index)
            if q > 1:
                new_visible = seen[:, layout.start : layout.start + q]
            implied = _implied(lengths, positions, pads, visible, new_visible, window, layout.start, forward.columns)
            if not bool((implied[:, None] == mask.cpu()).all()):
                forward.plans[key] = (mask, None)
                return None
        bs = self._bs
        width = max(-(-int(lengths.max()) // bs), 1)
        tables = [t[:width] + [0] * (width - len(t[:width])) for t in layout.tables]
        reads = plan(
            tables,
            lengths,
            positions,
            block_size=bs,
            num_blocks=forward.pool.capacity,
            device=call.query.device,
            visible=visible,
            new_visible=new_visible,
            window=window,
            prefill=q > 1,
        )
        forward.plans[key] = (mask, reads)
        return reads


def _fall_back(reason: str) -> None:
    """Tell the user, once per reason (Python's default warning filter), that a call runs on whole rows."""
    warnings.warn(f"prefixkv: attention='flex' reads whole rows (the gather) here: {reason}", stacklevel=3)


def _check(device: torch.device, dtype: torch.dtype, block_size: int, softcap: float | None) -> tuple[bool, str]:
    """Whether the ``"flex"`` backend serves a pool (the table's check, :func:`prefixkv.attention.registry.choose`):
    where :func:`can_serve` allows it."""
    return can_serve(device, dtype, block_size, softcap=softcap)


registry.provide("flex", FlexBackend, _check)
