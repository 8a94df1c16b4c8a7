"""The read plan of one forward: where every row's held K/V sit in the pool, built once per forward from the rows'
block tables (:class:`ForwardReads`), and the seam behind which attention backends sit (:class:`AttentionBackend`).

A backend plans a forward from the rows' pads and block tables (per-row lengths follow from the pads and the
forward's width) and attends from the plan alone: the plan holds the pool and the store's whole-row reader, never
the cache. ``update`` writes the new K/V and hands the attention either only them (a backend that reads the pool
in place: :attr:`ForwardReads.in_place`) or every row's whole K/V read back (``ForwardReads.gather``);
the tensor it hands out carries the plan (:data:`TAG`), so the attention of that layer, and only it, finds
the plan (no thread-global, no call back into the cache). What a plan derives from the tables and keeps between
forwards (runs of consecutive blocks, the block table) checks itself against the tables it was built from, so
no change of a table has to be announced."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

# the attribute on the K tensor that ``update`` hands out: ``(the plan, the layer)``, so that the attention of that
# layer, with that tensor, finds the plan (a copy of the tensor, or K/V of another cache, carry none)
TAG = "_prefixkv_reads"


# what a model may do with the K/V ``update`` handed out before its attention call without changing them: read their
# shape, dtype or device (a property's ``__get__``, ``size``, ``dim``)
_READS_ONLY = frozenset(
    {"__get__", "size", "dim", "ndimension", "numel", "is_contiguous", "stride", "get_device", "as_subclass"}
)


class Watched(torch.Tensor):
    """K or V that ``update`` hands out in a probe forward: every torch operation on it other than reading its shape
    is noted on the plan (:attr:`ForwardReads.touched`), because a model that computes anything from the K/V before
    its attention call (DiffLlama splits V in two halves, Doge derives its mask from V) would compute it from the
    new K/V alone when ``update`` hands out only those; what an operation returns is a plain tensor. Made by
    :func:`watch`, read back by :func:`unwatched`."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in _READS_ONLY:
            for t in (*args, *kwargs.values()):
                where = getattr(t, WATCH, None) if isinstance(t, Watched) else None
                if where is not None:
                    where[0].touched.add(where[1])
        # torch's own handling, as for a plain tensor: what the operation returns is a plain tensor
        return torch.Tensor.__torch_function__.__func__(torch.Tensor, func, (torch.Tensor,), args, kwargs)  # type: ignore[attr-defined]


# the attribute of a :class:`Watched` tensor: ``(the plan, the layer)``
WATCH = "_prefixkv_watch"


def watch(plan: ForwardReads, layer: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a :class:`Watched` view whose operations note ``layer`` on ``plan``. Does not mutate ``tensor``."""
    watched = tensor.as_subclass(Watched)
    setattr(watched, WATCH, (plan, layer))
    return watched


def unwatched(tensor: torch.Tensor) -> torch.Tensor:
    """A plain view of a :class:`Watched` tensor (``tensor`` itself otherwise), noting nothing."""
    if not isinstance(tensor, Watched):
        return tensor
    return tensor.as_subclass(torch.Tensor)


class LayerView(Protocol):
    """Where one layer's K/V lie in the pool (:class:`prefixkv.kv.pool.LayerSpec`)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def key_shape(self) -> tuple[int, int]: ...

    @property
    def value_shape(self) -> tuple[int, int]: ...


def shapes_differ(pool: PoolView) -> bool:
    """Whether a layer of ``pool`` keeps K and V of other shapes (multi-head latent attention's latent and rotary key,
    V heads of another size): such a model's layers take the ``update`` path, whole rows, and no compiled step
    (docs/architectures.md, "Latent attention and mixed shapes"). Does not mutate."""
    return any(s.key_shape != s.value_shape for s in pool.specs)


class PoolView(Protocol):
    """What the attention reads of a store's pool (:class:`prefixkv.kv.pool.BlockPool`; the attention never writes
    it): per layer the K and V tensors ``[kv_heads, num_blocks, block_size, head_dim]`` (``kv``, read at each call: a
    growth of the pool replaces them), its blocks (``capacity``), where each layer lies (``specs``), and the 8-bit
    storage (``kv_dtype``, ``None`` when the pool is stored in a float dtype), and each layer's K and V by slot
    (``slots``, and all layers' at once: ``kv_slots``)."""

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V tensors."""
        ...

    @property
    def capacity(self) -> int: ...

    @property
    def specs(self) -> Sequence[LayerView]: ...

    @property
    def kv_dtype(self) -> str | None: ...

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V indexed by slot, ``[kv_heads, num_blocks * block_size, head_dim]`` views
        (:func:`prefixkv.base.slots.slot_view`), kept by the pool between growths."""
        ...

    @property
    def kv_slots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's :meth:`slots`, a list the pool replaces (never changes) when its tensors change."""
        ...


class ForwardReads:
    """What every backend's forward needs, built once when the forward begins: the pool (read at each call: another
    thread may grow it), ``columns`` (the width of the model's mask), ``gather(layer)``: every row's whole K/V, and
    the ``backend`` that attends from it. ``in_place``: ``update`` hands out only the new K/V and the attention reads
    the pool; otherwise it hands out whole rows, and with ``probe`` the forward notes which layers reach the
    attention (a model is read in place once a forward showed that every layer hands its K/V to the attention
    unchanged). ``canonical``: an invariant store's read of whole rows, which the attention computes in one
    grouped-head kernel call (:func:`prefixkv.attention.kernels.whole_rows_attention`; ``whole_masks`` is its memo,
    per model mask, of the mask in the kernel's form: the canonical read, the gather and a fallback to whole rows
    share it). Records per layer what ``update`` handed out. A backend that keeps more per forward subclasses it
    (:class:`prefixkv.attention.blocks.BlocksForward`, :class:`prefixkv.attention.flex.FlexForward`)."""

    def __init__(
        self,
        pool: PoolView,
        columns: int,
        gather: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        *,
        probe: bool = False,
        in_place: bool = True,
        backend: AttentionBackend | None = None,
        canonical: bool = False,
    ) -> None:
        self.pool = pool
        # every layer's K and V by slot, taken once a step: the write and the attention of each layer read them here
        # (one call less a layer); the pool count of moves they are of (set by the cache, whose write refreshes both
        # where another thread's growth moved the pool meanwhile, prefixkv.hf.forward.write_layer)
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = pool.kv_slots
        self.moves = -1
        # the step's new slots, flat, per device (set by the cache's first write on that device)
        self.new_slots: dict[torch.device, torch.Tensor] = {}
        self.columns = columns
        self.gather = gather
        self.probe = probe
        self.in_place = in_place and not probe
        self.backend = backend
        self.canonical = canonical and not self.in_place
        self.handed: set[int] = set()
        self.served: set[int] = set()
        # the autocast dtype (or None) the forward was planned under, until its first layer checked it (then False):
        # a step asks once, not each layer (prefixkv.hf.forward.check_autocast)
        self.autocast: torch.dtype | bool | None = None
        # layers whose handed-out K or V a probe forward's model computed something from (:class:`Watched`)
        self.touched: set[int] = set()
        # per model mask (layers share one, sliding-window layers another): the whole-row attention's kernel mask
        self.whole_masks: dict[int, tuple[torch.Tensor | None, Any]] = {}

    def every_layer_served(self) -> bool:
        """Whether every layer that ``update`` handed K/V out for passed them to the attention unchanged and computed
        nothing else from them (:class:`Watched`)."""
        return bool(self.handed) and self.served == self.handed and not self.touched


class Layout(NamedTuple):
    """What a backend plans a forward from: the pool, each row's leading pads and block table, the forward's
    ``q`` columns after ``start`` (row ``i`` holds ``start + q - pads[i]`` tokens once they are written), the block
    size, and ``gather(layer)``, the store's read of every row's whole K/V."""

    pool: PoolView
    pads: list[int]
    tables: list[list[int]]
    start: int
    q: int
    block_size: int
    gather: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class AttentionCall(NamedTuple):
    """One layer's call of the attention function, as transformers makes it: ``query`` ``[B, Hq, q, D]``, what
    ``update`` handed out as ``key``/``value``, the model's ``mask`` and the other keyword arguments."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    kwargs: dict[str, Any]


class AttentionBackend(Protocol):
    """How a forward's attention reads the pool: ``plan`` builds the forward's :class:`ForwardReads` from the
    :class:`Layout` (a plan not ``in_place`` has ``update`` hand the model's own attention whole rows; with
    ``probe``, whole rows while the forward checks that every layer reaches the attention); ``servable`` says
    whether ``attend`` computes what the model's own attention would for a call (its mask, dropout,
    soft-capping), and ``attend`` runs one layer's attention from the plan alone, returning ``[B, q, Hq, D]``.
    :class:`prefixkv.attention.flex.FlexBackend` plugs in here: its plan keeps the layout, and makes from it one
    FlexAttention plan per model mask and window."""

    name: str

    def plan(self, layout: Layout, *, probe: bool) -> ForwardReads: ...

    def servable(self, forward: ForwardReads, call: AttentionCall) -> bool: ...

    def attend(self, forward: ForwardReads, layer: int, call: AttentionCall) -> torch.Tensor: ...
