"""A store's settings as one frozen record (:class:`StoreSettings`, ``store.settings``), on the ground floor of the
house (docs/how-it-works.md, "The house") so that every layer can read the record itself: the store builds it from
its options (:func:`prefixkv.store.options.check_options`) and hands it down."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoreSettings:
    """A store's settings, fixed when it is built (``store.settings``). ``chunk_size`` is the canonical prefill
    schedule's chunk length of an invariant store, ``None`` for the default schedule; ``attention`` is the backend
    asked for (``PrefixStore(attention=...)``), ``backend`` the one it resolved to for the store's pool and model,
    which every cache of the store reads through (``"blocks"``, ``"gather"`` or ``"flex"``), and ``backend_reason``
    the one line that says why (``store.attention_backend``); none of the three changes K/V.

    >>> import torch
    >>> s = StoreSettings(16, None, torch.float32, torch.float32, None, "auto", "blocks", "blocks: the pool is ...")
    >>> s.invariant, s.backend
    (False, 'blocks')
    """

    block_size: int
    chunk_size: int | None
    dtype: torch.dtype
    model_dtype: torch.dtype
    kv_dtype: str | None
    attention: str
    backend: str
    backend_reason: str

    @property
    def invariant(self) -> bool:
        """Whether prompt K/V are computed in the canonical schedule (``PrefixStore(invariant=True)``)."""
        return self.chunk_size is not None
