"""The ``prefixkv`` attention implementation, registered with transformers' ``AttentionInterface``
and, for its masks, ``AttentionMaskInterface``.

A ``PagedPrefixCache`` hands attention the K/V of each row read back from its blocks (a gather by the
row's block table in ``update``; torch has no paged kernel on CPU to read them in place). The
``prefixkv`` implementation runs the model's original implementation on them, so the numbers are
exactly those of that implementation; calls that carry no ``PagedPrefixCache`` reach the original
unchanged. The store switches a model whose implementation is ``sdpa`` to it and back
(``PrefixStore.close``); a model on ``eager`` (whose eager code may be its own, e.g. soft-capping), or whose
attention does not go through ``AttentionInterface`` (Falcon, Bloom), keeps its implementation and is
served through ``update`` alone, which is exact for every implementation. docs/architectures.md lists the
path of each family.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "prefixkv"
_BASE = "_prefixkv_base_attn"
_USERS = "_prefixkv_attention_users"


def _base(config: Any) -> str:
    return getattr(config, _BASE, None) or "sdpa"


def prefixkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over K/V read from the blocks (``[B, kv_heads, columns, head_dim]``), computed by the
    implementation the model had before the store switched it."""
    fn = ALL_ATTENTION_FUNCTIONS[_base(module.config)]
    out: tuple[torch.Tensor, torch.Tensor | None] = fn(module, query, key, value, attention_mask, **kwargs)
    return out


def prefixkv_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask of the original implementation (a mask for every registered attention name, rule 5)."""
    config = kwargs.get("config")
    return ALL_MASK_ATTENTION_FUNCTIONS[_base(config)](*args, **kwargs)


AttentionInterface.register(NAME, prefixkv_attention_forward)
AttentionMaskInterface.register(NAME, prefixkv_mask)


def install(model: Any) -> bool:
    """Switch ``model`` to ``prefixkv`` attention if it uses ``sdpa`` through ``AttentionInterface``; count
    the stores using it. Mutates the model's config. Returns whether the model runs ``prefixkv`` attention.

    Models whose attention code does not look its function up by name (Falcon, Bloom: transformers'
    ``is_backend_compatible()`` is false) keep their implementation and are served through ``update``."""
    config = model.config
    current = config._attn_implementation
    if current == NAME:
        setattr(model, _USERS, getattr(model, _USERS, 0) + 1)
        return True
    if current != "sdpa" or not model.is_backend_compatible():
        return False
    setattr(config, _BASE, current)
    model.set_attn_implementation(NAME)
    setattr(model, _USERS, 1)
    return True


def uninstall(model: Any) -> None:
    """Undo one :func:`install`; the last store to leave restores the original implementation."""
    users = getattr(model, _USERS, 0)
    if users <= 0:
        return
    if users > 1:
        setattr(model, _USERS, users - 1)
        return
    delattr(model, _USERS)  # leave no trace on the model (prefixkv.disable restores it exactly)
    model.set_attn_implementation(_base(model.config))
