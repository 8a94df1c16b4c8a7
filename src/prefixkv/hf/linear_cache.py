"""MiniMax's lightning attention, whose running key-value product is a recurrent state under names of its own.

MiniMax (``minimax``) keeps, per lightning-attention layer, the product of its keys and values so far (``[B, heads,
head_dim, head_dim]``), which it reads and writes through its ``MiniMaxCache``'s ``get_linear_cache`` and
``set_linear_cache``; a forward of several ids that finds one resumes it token by token, exactly as one forward of the
whole sequence computes it (1e-7 off in float32). It is a recurrent state like any other: transformers' cache layer
for the model's ``linear_attention`` layers (``LinearAttentionLayer``) holds it, prefixkv snapshots it at token
positions (docs/architectures.md, "Recurrent and hybrid layers"). Two things stand between MiniMax and such a cache:

- the names: :class:`LinearCacheNames` gives a cache ``get_linear_cache``/``set_linear_cache`` over the layer's
  recurrent state (prefixkv's cache and the store's measuring caches have them);
- the model's forward refuses every cache but a ``MiniMaxCache`` (``ValueError``) when ``use_cache`` is set, and reads
  ``use_cache`` for nothing else: while a store is open (:class:`Admitting`), and around the store's measuring
  forwards (:func:`admitting`), a forward of the inner model given a cache with these names is given
  ``use_cache=False``, which only skips that check (the cache is used all the same, and returned).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

OWN_CACHE_MODELS = frozenset({"MiniMaxModel"})
"""The inner model classes (by name) whose forward refuses, by ``use_cache``, every cache but their own class."""


class LinearCacheNames:
    """``get_linear_cache``/``set_linear_cache`` (MiniMax's names) over a transformers cache's recurrent state of
    each ``linear_attention`` layer (its ``LinearAttentionLayer``, state 0)."""

    layers: list[Any]

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """``layer_idx``'s running key-value product, ``None`` before the layer has one. Does not mutate."""
        layer = self.layers[layer_idx]
        return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """Keep ``linear_cache`` as ``layer_idx``'s running key-value product. Mutates."""
        self.update_recurrent_state(linear_cache, layer_idx)  # type: ignore[attr-defined]


def _admit(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The inner model's forward pre-hook: ``use_cache=False`` where its cache has :class:`LinearCacheNames`."""
    if kwargs.get("use_cache") and isinstance(kwargs.get("cache"), LinearCacheNames):
        return args, {**kwargs, "use_cache": False}
    return None


def _inner_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in OWN_CACHE_MODELS]


def admits(model: Any) -> bool:
    """Whether ``model`` refuses other caches only by the check :class:`Admitting` skips (MiniMax). Does not
    mutate."""
    return isinstance(model, torch.nn.Module) and bool(_inner_models(model))


class Admitting:
    """The hooks that admit caches with :class:`LinearCacheNames` to ``model``'s inner models of
    :data:`OWN_CACHE_MODELS`, for one store (each store its own: the hooks are alike and independent)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._handles = [m.register_forward_pre_hook(_admit, with_kwargs=True) for m in _inner_models(model)]

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def admitting(model: torch.nn.Module) -> Iterator[None]:
    """:class:`Admitting` inside the block (the store's measuring forwards). Mutates the model's hooks inside the
    block only."""
    admitted = Admitting(model)
    try:
        yield
    finally:
        admitted.remove()
