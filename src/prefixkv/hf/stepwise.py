"""Recurrent layers that resume a state only one token at a time: Mamba's mixers (``mamba``, ``falcon_mamba``) and
RecurrentGemma's recurrent blocks (``recurrent_gemma``), whose state besides lives in the blocks themselves.

A Mamba mixer's forward of several ids runs its selective scan from a zero state whatever its cache holds (the scan
kernel takes no initial state); only its one-token path (``selective_state_update``) resumes the cached state.
RecurrentGemma's recurrent block restarts its convolution's state from zeros in a forward of several ids (2e-2 off
in float64), and keeps its conv and LRU states as attributes of the block (``conv1d_state``,
``rg_lru.recurrent_states``), not in the cache. Stock ``generate`` never meets the difference (its prefill starts from
no state, its decode steps feed one token), but prefixkv resumes a cached prefix with a forward of the prompt's rest,
several ids (docs/architectures.md, "Recurrent and hybrid layers"). So while a store is attached, such a layer given
several ids *and* a cache that holds its state (a prefixkv cache only: every other cache is served by the layer as
it is) runs its own one-token path once per id, each id's pad mask and position its own: the state evolves as one
forward of the whole sequence evolves it. A RecurrentGemma block besides takes its states from the cache's layer
(transformers' ``LinearAttentionLayer``, which prefixkv snapshots) before it runs and hands them back after, so each
row of each call has its own. The store's measuring forwards run with these steps (:func:`stepping`) and prove them on
the model (:func:`prefixkv.hf.shapes.measure`); a layer that still does not resume is refused with the difference
measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compat.patching import MethodPatch, SharedPatch, bound_to_copies

STEPWISE_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer"})
"""The mixer classes (by name: each family has its own) whose forward of several ids starts from a zero state."""
BRIDGED_BLOCKS = frozenset({"RecurrentGemmaRecurrentBlock"})
"""The recurrent block classes that keep their states as attributes of their own and restart their conv state in a
forward of several ids: bridged to the cache's layer and stepped."""

_SHARED = SharedPatch("_prefixkv_stepwise_users")


def mixers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """``model``'s layers of :data:`STEPWISE_MIXERS` and :data:`BRIDGED_BLOCKS`, each with its layer index (its
    ``layer_idx``, or the last index in its name: ``model.layers.3.temporal_block``). Does not mutate."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ not in STEPWISE_MIXERS | BRIDGED_BLOCKS:
            continue
        numbers = [int(part) for part in name.split(".") if part.isdigit()]
        index = getattr(module, "layer_idx", numbers[-1] if numbers else None)
        if isinstance(index, int):
            found.append((module, index))
    return found


def bridged(model: Any) -> bool:
    """Whether ``model`` has recurrent blocks whose states prefixkv bridges to its cache (RecurrentGemma). Does not
    mutate."""
    return isinstance(model, torch.nn.Module) and any(type(m).__name__ in BRIDGED_BLOCKS for m, _ in mixers(model))


def _stepping_forward(
    module: torch.nn.Module,
    index: int,
    serves: Callable[[Any], bool],
    original: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """A Mamba mixer's forward, its own one-token path once per id where ``hidden_states`` (``[B, q, hidden]``) has
    several and the cache that ``serves`` holds the layer's state; its own forward otherwise. Mutates the cache's
    state, as the mixer does."""
    cache = kwargs.get("cache")
    width = hidden_states.shape[1]
    if args or width < 2 or cache is None or not serves(cache):
        return original(hidden_states, *args, **kwargs)
    state = cache.get_recurrent_state(index)
    if state is None:  # no state yet: the scan from zero is the whole forward
        return original(hidden_states, *args, **kwargs)
    mask = kwargs.pop("attention_mask", None)  # [B, columns]: the last `width` are these ids'
    outputs = []
    for i in range(width):
        column = None if mask is None else mask[:, mask.shape[1] - width + i :][:, :1]  # [B, 1]
        outputs.append(original(hidden_states[:, i : i + 1], attention_mask=column, **kwargs))
    cache.update_recurrent_state(state, index)  # the one-token path updates in place: say that it did
    return torch.cat(outputs, dim=1)  # [B, q, hidden]


def _bridged_forward(
    module: Any,
    index: int,
    serves: Callable[[Any], bool],
    original: Callable[..., tuple[torch.Tensor, Any]],
    input_states: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: Any = None,
    use_cache: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """A RecurrentGemma recurrent block's forward with the cache that ``serves``: its conv and LRU states taken from
    the cache's layer ``index`` (none before the layer has any), its own one-token path once per id where it has
    states and ``input_states`` (``[B, q, hidden]``) several ids, and the states handed back to the layer after; its
    own forward otherwise. Mutates the block's and the cache's states."""
    cache = kwargs.get("cache")
    if not use_cache or cache is None or not serves(cache):
        return original(input_states, position_ids, attention_mask, use_cache, **kwargs)
    layer = cache.layers[index]
    resumed = bool(layer.has_previous_state[0])
    module.conv1d_state = layer.conv_states[0] if resumed else None  # None: the block starts from zeros
    module.rg_lru.recurrent_states = layer.recurrent_states[0] if resumed else None
    width = input_states.shape[1]
    if resumed and width > 1:
        outputs = [
            original(input_states[:, i : i + 1], position_ids[:, i : i + 1], attention_mask, use_cache, **kwargs)[0]
            for i in range(width)
        ]
        out: tuple[torch.Tensor, Any] = (torch.cat(outputs, dim=1), None)  # [B, q, hidden]
    else:
        out = original(input_states, position_ids, attention_mask, use_cache, **kwargs)
    conv = module.conv1d_state  # [B, channels, conv1d_width - 1]
    cache.update_conv_state(conv, index, conv_kernel_size=conv.shape[-1])
    cache.update_recurrent_state(module.rg_lru.recurrent_states, index)
    return out


def _install(model: torch.nn.Module, serves: Callable[[Any], bool]) -> Callable[[], None]:
    """Wrap each stepwise layer of ``model`` (an instance attribute); return what undoes it. Mutates the layers."""
    patches = []
    for module, index in mixers(model):
        step = _bridged_forward if type(module).__name__ in BRIDGED_BLOCKS else _stepping_forward
        patches.append(MethodPatch(module, "forward", bound_to_copies(step, module, index, serves, module.forward)))

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
def stepping(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s stepwise layers step (and bridge) with any cache (a store's measuring forwards).
    Mutates the layers inside the block only."""
    undo = _install(model, lambda cache: True)
    try:
        yield
    finally:
        undo()
