"""Mixers that resume a recurrent state only one token at a time: Mamba's (``mamba``, ``falcon_mamba``).

A Mamba mixer's forward of several ids runs its selective scan from a zero state whatever its cache holds (the scan
kernel takes no initial state); only its one-token path (``selective_state_update``) resumes the cached state. Stock
``generate`` never meets the difference (its prefill starts from no state, its decode steps feed one token), but
prefixkv resumes a cached prefix with a forward of the prompt's rest, several ids (docs/architectures.md, "Recurrent
and hybrid layers"). So while a store is attached, such a mixer given several ids *and* a cache that holds its state
(a prefixkv cache only: every other cache is served by the mixer as it is) runs its own one-token path once per id,
each id's pad mask its own column: the state evolves as one forward of the whole sequence evolves it. The store's
measuring forwards prove it on the model (:func:`prefixkv.hf.shapes.measure`, with :func:`stepping` around its check
that a forward resumes a state); a mixer that still does not resume there is refused with the difference measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compat.patching import MethodPatch, SharedPatch, bound_to_copies

STEPWISE_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer"})
"""The mixer classes (by name: each family has its own) whose forward of several ids starts from a zero state."""

_SHARED = SharedPatch("_prefixkv_stepwise_users")


def mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s mixers of :data:`STEPWISE_MIXERS`, each with its ``layer_idx``. Does not mutate."""
    return [m for m in model.modules() if type(m).__name__ in STEPWISE_MIXERS and hasattr(m, "layer_idx")]


def _stepping_forward(
    module: torch.nn.Module,
    original: Callable[..., torch.Tensor],
    serves: Callable[[Any], bool],
    hidden_states: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """The mixer's forward, its own one-token path once per id where ``hidden_states`` (``[B, q, hidden]``) has
    several and the cache that ``serves`` holds the layer's state; its own forward otherwise. Mutates the cache's
    state, as the mixer does."""
    cache = kwargs.get("cache")
    width = hidden_states.shape[1]
    if args or width < 2 or cache is None or not serves(cache):
        return original(hidden_states, *args, **kwargs)
    if cache.get_recurrent_state(module.layer_idx) is None:  # no state yet: the scan from zero is the whole forward
        return original(hidden_states, *args, **kwargs)
    mask = kwargs.pop("attention_mask", None)  # [B, columns]: the last `width` are these ids'
    outputs = []
    for i in range(width):
        column = None if mask is None else mask[:, mask.shape[1] - width + i :][:, :1]  # [B, 1]
        outputs.append(original(hidden_states[:, i : i + 1], attention_mask=column, **kwargs))
    return torch.cat(outputs, dim=1)  # [B, q, hidden]


def _install(model: torch.nn.Module, serves: Callable[[Any], bool]) -> Callable[[], None]:
    """Wrap each stepwise mixer of ``model`` (an instance attribute); return what undoes it. Mutates the mixers."""
    patches = [
        MethodPatch(m, "forward", bound_to_copies(_stepping_forward, m, m.forward, serves)) for m in mixers(model)
    ]

    def undo() -> None:
        for patch in reversed(patches):
            patch.remove()

    return undo


class Stepping:
    """One store's share of the stepwise mixers of its model, for caches that ``serves`` accepts (the store's
    hooks: prefixkv's caches); the last store to leave (:meth:`remove`) puts the mixers' forwards back."""

    def __init__(self, model: torch.nn.Module, serves: Callable[[Any], bool]) -> None:
        self._model: torch.nn.Module | None = model
        _SHARED.join(model, lambda: _install(model, serves))

    def remove(self) -> None:
        model, self._model = self._model, None
        if model is not None:
            _SHARED.leave(model)


@contextlib.contextmanager
def stepping(model: torch.nn.Module) -> Iterator[bool]:
    """Inside the block, ``model``'s stepwise mixers step through several ids with any cache that holds their
    state (a store's check that its forwards resume a state); yields whether it has any. Mutates the mixers inside
    the block only."""
    undo = _install(model, lambda cache: True)
    try:
        yield bool(mixers(model))
    finally:
        undo()
