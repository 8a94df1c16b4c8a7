"""The ``"gather"`` backend: ``update`` reads every row's whole K/V out of the pool and the model's own attention
runs over them."""

from __future__ import annotations

import torch

from . import kernels
from .reads import AttentionCall, ForwardReads, Layout


class GatherBackend:
    """``"gather"``: ``update`` reads every row's whole K/V out of the pool and the model's own attention runs
    over them (CUDA pools, quantized pools, models whose attention does not go through this module)."""

    name = "gather"

    def plan(self, layout: Layout, *, probe: bool) -> ForwardReads:
        """A plan of no reads: whole rows for every layer. Does not mutate."""
        return ForwardReads(layout.pool, layout.start + layout.q, layout.gather, in_place=False)

    def servable(self, forward: ForwardReads, call: AttentionCall) -> bool:
        """Never: the model's own implementation over the whole rows ``update`` handed out is exact."""
        return False

    def attend(self, forward: ForwardReads, layer: int, call: AttentionCall) -> torch.Tensor:
        """Attention of the call's query over every row's whole K/V of ``layer`` (``forward.gather``) under its
        mask (``None``: every held column, the new ones causally), ``[B, q, Hq, D]``. Mutates only the plan's
        mask memo."""
        k, v = forward.gather(layer)
        return kernels.whole_rows_attention(call.query, k, v, call.mask, call.kwargs.get("scaling"), forward)
