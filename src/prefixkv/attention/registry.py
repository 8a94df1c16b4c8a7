"""The attention backends by name (``PrefixStore(attention=...)``): :data:`BACKENDS`, the ones this package builds
(``"blocks"``, ``"gather"``), those a module provides when it is imported (:func:`provide`: ``"flex"``), and how a
name resolves for a pool (:func:`choose_backend`, :func:`pool_backend`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .blocks import BlocksBackend
from .gather import GatherBackend
from .interface import READ_DEVICES
from .reads import AttentionBackend

BACKENDS = ("auto", "blocks", "flex", "gather")
# the backends a module of this package provides when it is imported (:func:`provide`), by name: the module
PROVIDED_BY = {"flex": "prefixkv.attention.flex"}

# a backend that a module above this one provides, by name: given the pool's device, dtype and block size and the
# model's soft-capping, the backend (``None``: it cannot serve them) and the one-line reason
Provider = Callable[[torch.device, torch.dtype, int, float | None], tuple[AttentionBackend | None, str]]
# each module of PROVIDED_BY provides its backend when it is imported (the store imports it); this one imports none
_PROVIDED: dict[str, Provider] = {}


def provide(name: str, provider: Provider) -> None:
    """Make ``provider`` build the backend ``name`` of :data:`BACKENDS` (:func:`choose_backend`). Mutates module
    state."""
    _PROVIDED[check_backend(name)] = provider


def check_backend(name: Any) -> str:
    """``name`` if it names a backend of :data:`BACKENDS`, else a ``ValueError`` that lists them."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


def choose_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | str,
    *,
    model_dtype: torch.dtype,
    block_size: int = 16,
    softcap: float | None = None,
) -> tuple[AttentionBackend, str]:
    """The attention backend called ``name`` (``"blocks"``, ``"gather"``, ``"flex"`` where FlexAttention serves the
    pool, else ``"gather"``, or ``"auto"``: ``"blocks"`` where the pool is on a device of :data:`READ_DEVICES` and
    stored in the dtype the model computes in, else ``"gather"``) for a pool on ``device`` stored as ``dtype`` (a
    torch dtype, or a quantized storage: ``"int8"``, ``"fp8"``) in blocks of ``block_size``, for a model whose
    attention soft-caps its logits at ``softcap``, and a one-line reason. A fresh backend each call: it keeps its
    own metadata. Does not mutate."""
    check_backend(name)
    readable = dtype == model_dtype
    if name == "blocks" and not readable:
        raise ValueError(
            f"the 'blocks' backend reads the pool in the dtype the model computes in ({model_dtype}), but the pool "
            f"is stored as {dtype}: choose 'gather' or 'auto'"
        )
    if name == "gather":
        return GatherBackend(), "gather: asked for by name"
    if name == "blocks":
        return BlocksBackend(), "blocks: asked for by name"
    if name in PROVIDED_BY:
        if not readable or isinstance(dtype, str):
            return GatherBackend(), f"gather: the pool is stored as {dtype}, the model computes in {model_dtype}"
        provider = _PROVIDED.get(name)
        if provider is None:
            return GatherBackend(), f"gather: {PROVIDED_BY[name]}, which provides {name!r}, was not imported"
        backend, why = provider(device, dtype, block_size, softcap)
        return (GatherBackend() if backend is None else backend), why
    if not readable:
        return GatherBackend(), f"gather: the pool is stored as {dtype}, the model computes in {model_dtype}"
    if device.type not in READ_DEVICES:
        return GatherBackend(), f"gather: reading the blocks in place is not implemented fast on {device.type}"
    return BlocksBackend(), f"blocks: the pool is on {device.type} in {dtype}"


def pool_backend(name: str, pool: Any, model: Any, model_dtype: torch.dtype) -> tuple[AttentionBackend | None, str]:
    """The backend ``name`` (the store's ``attention=``), as :func:`choose_backend` resolves it for the pool, and
    why; ``None`` for layers split across devices or dtypes (whole rows, read layer
    by layer). Does not mutate."""
    specs = pool.specs
    if not specs or len({s.device for s in specs}) > 1 or len({s.dtype for s in specs}) > 1:
        return None, "gather: the pool's layers lie on several devices or dtypes"
    stored = pool.kv_dtype if pool.kv_dtype is not None else specs[0].dtype
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    return choose_backend(
        name,
        specs[0].device,
        stored,
        model_dtype=model_dtype,
        block_size=pool.block_size,
        softcap=softcap,
    )
