"""What keys a store's K/V besides the tokens: the active adapters, the weights (however they were written) and
the config fields that change K/V; and where each layer computes. See docs/correctness.md, "Adapters and changed
weights".

A :class:`KeySpace` is made once per store, with the model as it is then; :meth:`KeySpace.space` says, once
per call, under which key K/V computed now are cached. This module knows the model, never the blocks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .fingerprint import adapter_space, config_state, tuner_layers
from .ranks import local_part

# values of each parameter and buffer compared per call, at fixed evenly spaced places (docs/correctness.md)
_SAMPLED = 4


def transformers_model(model: Any) -> Any:
    """The transformers model that computes: ``model`` itself, or the one inside a PEFT wrapper (whose
    ``generate`` calls that model's ``generate``, so hooks on the wrapper would never run)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def _weights_state(model: Any) -> int:
    """A number that changes when any parameter or buffer of ``model`` is written in place (an optimizer step,
    ``load_state_dict``, a write through ``.data`` such as an EMA update) or replaced (``.data =``, a new
    ``Parameter``, ``load_state_dict(assign=True)``), or a config field that changes K/V is edited: a hash of
    every parameter's storage address and version counter (inference tensors have none: 0), of every buffer's shape
    and version counter, of ``_SAMPLED`` of each tensor's values (``.data`` writes bump no version; a buffer's as
    float64, so that a copy of it in another dtype with the same values is the same buffer), and of
    :func:`prefixkv.kv.fingerprint.config_state`. One walk of the model's modules, each tensor read once."""
    state = []
    samples: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    with torch.no_grad():
        for module in model.modules():
            # the module's own tensors, as ``parameters()`` and ``buffers()`` read them, without their second walk
            # (a tensor two modules share is read twice)
            for buffer, t in _own_tensors(module):
                t = local_part(t)
                try:
                    version = t._version
                except RuntimeError:  # an inference tensor keeps no version
                    version = 0
                # a buffer is known by its values alone: CTRL's forward replaces its float32 positions with a
                # float64 copy (the same values) at its first call, which must not hide what that call cached
                state.append((tuple(t.shape), version) if buffer else (t.data_ptr(), version))
                if t.device.type != "meta" and t.numel():
                    t = _few_values(t)
                    if buffer and t.is_floating_point():
                        t = t.to(torch.float64)
                    samples.setdefault((t.dtype, t.device), []).append(t)
    values = tuple(_sampled_bytes(device, group) for (_, device), group in samples.items())
    return hash((tuple(state), values, config_state(model.config)))


def _own_tensors(module: torch.nn.Module) -> Iterator[tuple[bool, torch.Tensor]]:
    """The parameters and buffers ``module`` itself holds (not its submodules'), each with whether it is a buffer.
    Does not mutate."""
    for buffer, tensors in ((False, module._parameters), (True, module._buffers)):
        for t in tensors.values():
            if t is not None:
                yield buffer, t


def _sampled_bytes(device: torch.device, tensors: list[torch.Tensor]) -> bytes:
    """The bytes of every one of ``tensors`` (:func:`_few_values` of one dtype, on ``device``): one copy, whatever
    their number, and none of autocast's casts (its ``cat`` refuses some mixes of dtypes). Does not mutate."""
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        return torch.cat(tensors).cpu().view(torch.uint8).numpy().tobytes()


def _few_values(t: torch.Tensor) -> torch.Tensor:
    """``_SAMPLED`` values of ``t`` at evenly spaced places (all of a smaller one), as a view when it is
    contiguous. Does not mutate."""
    if not t.is_contiguous():
        t = t.reshape(-1)
    n = t.numel()
    return t.as_strided((min(n, _SAMPLED),), (max(1, n // _SAMPLED),), t.storage_offset())


@dataclass(frozen=True)
class WeightsChanged:
    """The key space of K/V computed after the weights changed since the store was built: ``adapters`` as
    :func:`prefixkv.kv.fingerprint.adapter_space`, and ``state`` as :func:`_weights_state`. Only this process can
    tell such weights apart, so the second tier keeps none of their blocks (its files outlive the process)."""

    adapters: Hashable
    state: int


@dataclass(frozen=True)
class Autocast:
    """The key space of K/V computed under ``torch.autocast`` of ``dtype`` on the model's ``device_type``, over
    ``space``, the adapters' key space (:func:`prefixkv.kv.fingerprint.adapter_space`): autocast computes other
    K/V than the model's own dtype (docs/correctness.md, "Autocast"), so neither is ever served to the other."""

    device_type: str
    dtype: torch.dtype
    space: Hashable


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``device_type`` in this thread now, or ``None`` outside autocast.
    Does not mutate."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


@dataclass(frozen=True)
class UserSpace:
    """The key space of K/V cached for one user (``PagedPrefixCache(..., namespace=name)``): ``name`` and the
    store's own key space ``space``, so that users never reuse each other's K/V (docs/generate.md, "Isolation
    between users")."""

    name: str
    space: Hashable


def user_space(name: str | None, space: Hashable) -> Hashable:
    """The key space K/V of user ``name`` are cached under when the store's is ``space``: ``space`` itself for
    ``None`` (the one shared namespace, whose key space saved files and tiers hold), else a :class:`UserSpace`;
    one of :class:`WeightsChanged` stays one (the second tier keeps none of its blocks). Does not mutate.

    >>> user_space(None, None), user_space("alice", None)
    (None, UserSpace(name='alice', space=None))
    """
    if name is None:
        return space
    if not isinstance(name, str):
        raise TypeError(f"namespace= is a user's name, a str (or None: the one shared namespace), got {name!r}")
    if not name:
        raise ValueError("namespace= is a user's name and cannot be empty; pass None for the one shared namespace")
    if isinstance(space, WeightsChanged):
        return WeightsChanged(UserSpace(name, space.adapters), space.state)
    return UserSpace(name, space)


class SpaceNow:
    """What one cache reads as the key space now: ``read()`` (the store's, within a user's namespace), anew at each
    call, but for the space :meth:`for_step` read, which the next call takes: the first step of a ``generate`` call
    reads it, and the forward that follows at once (nothing runs in between that could write the weights) proves
    its rows with it, so a call walks the weights once there, not twice (docs/correctness.md, "Adapters and changed
    weights"). One cache's, used by the thread that owns it."""

    def __init__(self, read: Callable[[], Hashable]) -> None:
        self._read = read
        self._kept: list[Hashable] = []

    def __call__(self) -> Hashable:
        """The key space now, or the one :meth:`for_step` kept, taken. Mutates what it keeps."""
        if self._kept:
            return self._kept.pop()
        return self._read()

    def for_step(self) -> Hashable:
        """The key space now, kept for the next call. Mutates what it keeps."""
        space = self._read()
        self._kept = [space]
        return space


def autocast_in(space: Hashable) -> torch.dtype | None:
    """The autocast dtype of K/V cached under ``space`` (:class:`Autocast`, within a user's or changed weights'
    key space), or ``None``: computed without autocast. Does not mutate."""
    while isinstance(space, (WeightsChanged, UserSpace)):
        space = space.adapters if isinstance(space, WeightsChanged) else space.space
    return space.dtype if isinstance(space, Autocast) else None


class KeySpace:
    """The key of a store's K/V besides the tokens, for one model: its adapters and the state of its weights
    when the store was built."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._tuners = tuner_layers(model)
        self._weights_at_start = _weights_state(model)
        self._device_type = (_execution_device(model) or torch.device("cpu")).type  # where autocast would apply
        self._steady = threading.local()  # this thread's memo of space() inside steady(): [] or [space]

    @contextlib.contextmanager
    def steady(self) -> Iterator[None]:
        """Within the block, :meth:`space` walks the model's tensors once on this thread and then says the same:
        one cache's construction, with the prefills its rows ask of the store's runner (an invariant store's
        chunk forwards, in-batch sharing), computes all its K/V with the same weights. Nested blocks share the
        outer one's memo. Mutates only this thread's memo."""
        if getattr(self._steady, "memo", None) is not None:
            yield
            return
        self._steady.memo = []
        try:
            yield
        finally:
            self._steady.memo = None

    def space(self) -> Hashable:
        """The key space that K/V computed now are cached under: ``None``, or for a PEFT model the active,
        disabled and merged adapters, so that a prefix cached with one adapter is never reused with another
        (or with the adapter disabled); and, once a weight or buffer was written or replaced since the store was
        built (a training step, ``load_state_dict``), :class:`WeightsChanged`, so that K/V of the old weights are
        never reused (they wait for eviction or ``store.clear()``); under ``torch.autocast`` on the model's device,
        within :class:`Autocast`, so that K/V computed with and without it never meet. Walks the model's tensors
        (once per call, not per decode step; once inside :meth:`steady`). Mutates only the list of adapter layers,
        when adapters were added since, and the memo of :meth:`steady`."""
        memo: list[Hashable] | None = getattr(self._steady, "memo", None)
        if memo:
            return memo[0]
        if not self._tuners and hasattr(self.model, "peft_config"):
            self._tuners = tuner_layers(self.model)  # adapters added after the store was built
        adapters: Hashable = adapter_space(self._tuners)
        autocast = autocast_dtype(self._device_type)
        if autocast is not None:  # inside WeightsChanged, if any: the second tier keeps no blocks of changed weights
            adapters = Autocast(self._device_type, autocast, adapters)
        state = _weights_state(self.model)
        space = adapters if state == self._weights_at_start else WeightsChanged(adapters, state)
        if memo is not None:
            memo.append(space)
        return space


def _execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where ``module`` computes: the execution device of the first accelerate hook on it or inside it
    (``dispatch_model`` hooks whole layers, ``cpu_offload``/``disk_offload`` each linear layer, leaving
    the weights on ``meta``), else the device of its first parameter not on ``meta``."""
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or [hook]:
            device = getattr(h, "execution_device", None)
            if device is not None:
                return _with_index(torch.device(device))
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return None


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` as the tensors computed there report it (``cuda:0``), so device checks compare equal."""
    if device.type != "cpu" and device.index is None and device.type != "meta":
        module = getattr(torch, device.type, None)
        current = getattr(module, "current_device", None)
        if current is not None:
            return torch.device(device.type, current())
    return device


def layer_devices(model: Any, num_layers: int) -> list[torch.device]:
    """The device each decoder layer computes on (accelerate's execution device when dispatched)."""
    fallback = _execution_device(model) or torch.device("cpu")
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return [_execution_device(layer) or fallback for layer in module]
    return [fallback] * num_layers
