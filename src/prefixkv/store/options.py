"""``PrefixStore``'s options, checked and turned into what the store builds: its settings (the frozen
:class:`~prefixkv.base.settings.StoreSettings`, ``store.settings``), the attention backend every cache of the store
reads the pool through and why (:func:`choose_attention`, carried by the settings), the pool's budget in blocks; and the
priority of a pin. Every option is checked, and the backend chosen, before anything is built, so a wrong one
changes nothing."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ..attention import interface, registry
from ..base.memory import attention_shape, parse_bytes
from ..base.settings import StoreSettings
from ..hf.support import check_supported
from ..kv.key_space import layer_devices, transformers_model
from ..kv.quantization import check_kv_dtype

_DTYPE_NAMES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def check_options(
    model: Any,
    *,
    block_size: Any,
    max_memory: int | str | None,
    num_blocks: int | None,
    dtype: Any,
    kv_dtype: str | None,
    offload: str | None,
    max_offload_memory: int | str | None,
    offload_dir: str | os.PathLike[str] | None,
    invariant: Any,
    chunk_size: Any,
    attention: Any,
) -> StoreSettings:
    """The settings of a store of ``model`` built with these options (``PrefixStore``'s arguments), after checking
    each of them and then ``model`` (:func:`prefixkv.hf.support.check_supported`), with the attention backend chosen
    for them (:func:`choose_attention`); raises ``ValueError`` or ``TypeError`` for the first wrong option. Does not
    mutate."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    # the canonical prefill schedule's chunk length; None: the default schedule (reuse at any block)
    chunk = _check_chunk_size(invariant, chunk_size, block_size)
    if max_memory is not None and num_blocks is not None:
        raise ValueError("give the budget as max_memory or as num_blocks, not both")
    store_dtype = _check_dtype(dtype)
    check_kv_dtype(kv_dtype)
    # how attention reads the pool; it changes no K/V, so keys and files leave it out
    asked = registry.check_backend(attention)
    offload_kind(offload, max_offload_memory, offload_dir)  # the offload options, checked
    check_supported(model)
    model_dtype: torch.dtype = getattr(model, "dtype", torch.float32)
    stored = store_dtype or model_dtype
    backend, reason = choose_attention(
        asked,
        model,
        block_size=block_size,
        stored=kv_dtype or stored,
        model_dtype=model_dtype,
        invariant=chunk is not None,
    )
    return StoreSettings(block_size, chunk, stored, model_dtype, kv_dtype, asked, backend, reason)


def offload_kind(
    offload: str | None, max_offload_memory: int | str | None, offload_dir: str | os.PathLike[str] | None
) -> str | None:
    """The second tier a store builds: ``offload``, or ``"disk"`` where only ``offload_dir`` is given (the one tier
    kept in a directory: a directory named for nothing would be a tier silently missing). Raises ``ValueError`` for
    ``max_offload_memory`` without a tier (it could bound either). Does not mutate."""
    if offload is not None:
        return offload
    if offload_dir is not None:
        return "disk"
    if max_offload_memory is not None:
        raise ValueError(
            f"max_offload_memory={max_offload_memory!r} bounds a second tier, and none is asked for: pass "
            "offload='cpu' (host memory) or offload='disk' with offload_dir"
        )
    return None


def _check_chunk_size(invariant: Any, chunk_size: Any, block_size: int) -> int | None:
    """The chunk length of an invariant store (``None`` for the default schedule), after checking the options."""
    if not isinstance(invariant, bool):
        raise TypeError(f"invariant must be True or False, got {invariant!r}")
    if not invariant:
        if chunk_size is not None:
            raise ValueError(f"chunk_size={chunk_size!r} sets the invariant schedule; pass invariant=True with it")
        return None
    if chunk_size is None:
        return 4 * block_size
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size must be a positive multiple of block_size={block_size}, got {chunk_size!r}; "
            f"for example {4 * block_size}"
        )
    return chunk_size


def _check_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a floating torch dtype (names such as ``"bfloat16"`` too), or ``None``."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        named = _DTYPE_NAMES.get(dtype.removeprefix("torch."))
        if named is None:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPE_NAMES)}")
        return named
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch dtype (torch.float16, torch.bfloat16, torch.float32, torch.float64) "
            f"or its name, got {dtype!r}; for 8-bit blocks pass kv_dtype='int8' or 'fp8' with it"
        )
    return dtype


def max_blocks(
    max_memory: int | str | None, num_blocks: int | None, bytes_per_block: int, block_size: int
) -> int | None:
    """The pool's bound in blocks (``None``: it grows as requests need), from ``max_memory`` or ``num_blocks``."""
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        return num_blocks
    if max_memory is None:
        return None
    budget = parse_bytes(max_memory)
    # the pool's tensors stay within max_memory: the null block (padding) is paid from it too
    blocks = budget // bytes_per_block - 1
    if blocks < 1:
        raise ValueError(
            f"max_memory={max_memory!r} ({budget} bytes) is less than one block of {block_size} tokens "
            f"({bytes_per_block} bytes) plus the reserved padding block; raise max_memory or lower block_size"
        )
    return blocks


def choose_attention(
    name: str,
    model: Any,
    *,
    block_size: int,
    stored: torch.dtype | str,
    model_dtype: torch.dtype,
    invariant: bool,
) -> registry.Choice:
    """The backend every cache of a store of ``model`` reads the pool through, and the one line that says why
    (``store.settings.backend``, ``store.settings.backend_reason``, ``store.attention_backend``), for the backend
    ``name`` asked for and a pool in blocks of ``block_size`` stored as ``stored`` (a torch dtype, or ``"int8"``,
    ``"fp8"``) on the devices of the model's layers: chosen once, when the store is built, and read by each cache
    (:class:`prefixkv.attention.reader.Reader`), so what the line says is what runs. The gather where the pool's
    layers lie on several devices, for an invariant store (its canonical read of whole rows) and for a model whose
    attention ``prefixkv`` cannot switch to (:func:`prefixkv.attention.interface.can_install`); else
    :func:`prefixkv.attention.registry.choose`. Raises ``ValueError`` for a backend that cannot read the pool
    (``"blocks"`` over 8-bit blocks), in every store alike; warns when an explicit ``"flex"``
    (:mod:`prefixkv.attention.flex`) falls back. Does not mutate."""
    if name == "flex":  # the module that provides the backend, imported when asked for (it loads torch's compiler)
        from ..attention import flex  # noqa: F401
    hf_model = transformers_model(model)
    devices = layer_devices(model, attention_shape(model.config).num_layers)
    softcap = getattr(hf_model.config, "attn_logit_softcapping", None)
    named = registry.choose(name, devices[0], stored, model_dtype=model_dtype, block_size=block_size, softcap=softcap)
    if len(set(devices)) > 1:
        chosen = registry.Choice("gather", "gather: the pool's layers lie on several devices or dtypes")
    elif invariant:
        chosen = registry.Choice(
            "gather",
            "gather: an invariant store reads each row whole, in logical order (its canonical read, "
            "docs/correctness.md), which FlexAttention's split-and-merge prefill is not",
        )
    elif not interface.can_install(hf_model):
        chosen = registry.Choice(
            "gather",
            "gather: the model's attention is not 'sdpa' through transformers' AttentionInterface (eager, or its "
            "own code), so update hands it whole rows",
        )
    else:
        chosen = named
    if name == "flex" and chosen.name != "flex":
        warnings.warn(f"prefixkv: PrefixStore(attention='flex') falls back to the {chosen.reason}", stacklevel=4)
    return chosen


def check_priority(priority: Any) -> None:
    """Raise ``ValueError`` unless ``priority`` is a soft pin's (an int from 0 to 100) or ``None`` (a hard pin):
    ``PrefixStore.pin``'s option. Does not mutate."""
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100
    ):
        raise ValueError(f"pin(priority=) is an int from 0 to 100 (or None: a hard pin), got {priority!r}")
