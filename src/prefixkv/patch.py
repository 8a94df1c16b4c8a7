"""Model hooks: the forward pre-hook hands each call's token ids to its ``PagedPrefixCache`` (the
cache itself only ever sees K and V, DESIGN.md rule 1), the forward hook lets it publish what the
forward computed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .store import PrefixStore

_CACHE_KWARGS = ("cache", "past_key_values")


def _paged_cache(store: PrefixStore, kwargs: dict[str, Any]) -> Any:
    from .cache import PagedPrefixCache

    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if isinstance(cache, PagedPrefixCache) and cache.store is store:
            return cache
    return None


def attach_hooks(model: torch.nn.Module, store: PrefixStore) -> list[RemovableHandle]:
    """Register the pre/post forward hooks of ``store`` on ``model``; return their handles. Mutates."""

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = _paged_cache(store, kwargs)
        if cache is None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache._begin_forward(input_ids, kwargs.get("inputs_embeds"), kwargs.get("attention_mask"))

    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = _paged_cache(store, kwargs)
        if cache is not None:
            cache._end_forward()

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
