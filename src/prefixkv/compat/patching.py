"""How prefixkv changes a model object, or a class of transformers or torch, and undoes the change: the one shape
for all of them.

A :class:`MethodPatch` replaces a method by an instance attribute and puts back exactly what was there. A
:class:`SharedPatch` is a change that several users share (every store on a model shares one wrapper of
``prepare_inputs_for_generation`` and one switch to prefixkv's attention): kept on the model under one attribute
with its count of users, made by the first to join and undone by the last to leave. Its record names the model it
was made on, so a ``copy.deepcopy`` of the model, which copies the record (and the change), starts with no users.
A change to a class of transformers or torch (a release's shim, :mod:`prefixkv.compat.releases`) is made by
:func:`install`, a :class:`MethodPatch` on the class, and a name added to one of transformers' registries
(``AttentionInterface``, ``AttentionMaskInterface``) by :func:`register`, a :class:`Registration`: each recorded in
:func:`installed` in the order made, and undone by :func:`uninstall`.

The names torch gives a model's compiled call (``model.compile()``), which the store's hooks wrap, are read and set
here too (:func:`compiled_call`, :func:`set_compiled_call`, :func:`plain_call`, :func:`compiled_forward`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class _Missing:
    """No instance attribute was there: one object, in a deep copy of the model too."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self


_MISSING = _Missing()


class MethodPatch:
    """``model.<name>`` replaced by an instance attribute (or, on a class, a class attribute); :meth:`remove` puts
    back exactly what was there (usually nothing, so the class's method shows through again)."""

    def __init__(self, model: Any, name: str, replacement: Callable[..., Any]) -> None:
        self._model, self._name = model, name
        self._previous = vars(model).get(name, _MISSING)
        self.replacement = replacement
        setattr(model, name, replacement)

    @property
    def target(self) -> tuple[Any, str]:
        """The object changed and the name of its attribute."""
        return self._model, self._name

    @property
    def previous(self) -> Any:
        """What the object itself held under the name before (``None`` where nothing: a class's method showed)."""
        return None if self._previous is _MISSING else self._previous

    def held(self) -> Any:
        """What the object itself holds under the name now (``None`` where nothing). Does not mutate."""
        return vars(self._model).get(self._name)

    def remove(self) -> None:
        """Put back what was there. Mutates the object."""
        if self._previous is _MISSING:
            delattr(self._model, self._name)
        else:
            setattr(self._model, self._name, self._previous)


class Registration:
    """``function`` registered under ``name`` in a registry of transformers (a ``GeneralInterface`` such as
    ``AttentionInterface``: its ``register`` adds to its class-wide mapping); :meth:`remove` puts back what the
    mapping held under the name (usually nothing)."""

    def __init__(self, registry: Any, name: str, function: Callable[..., Any]) -> None:
        self._registry, self._name = registry, name
        self._previous = registry._global_mapping.get(name, _MISSING)
        self.replacement = function
        registry.register(name, function)

    @property
    def target(self) -> tuple[Any, str]:
        """The registry and the name."""
        return self._registry, self._name

    @property
    def previous(self) -> Any:
        """What the registry held under the name before (``None`` where nothing)."""
        return None if self._previous is _MISSING else self._previous

    def held(self) -> Any:
        """What the registry holds under the name now (``None`` where nothing). Does not mutate."""
        return self._registry._global_mapping.get(self._name)

    def remove(self) -> None:
        """Put back what the registry held. Mutates the registry."""
        if self._previous is _MISSING:
            del self._registry._global_mapping[self._name]
        else:
            self._registry._global_mapping[self._name] = self._previous


_INSTALLED: list[MethodPatch | Registration] = []


def install(owner: type, name: str, replacement: Callable[..., Any]) -> MethodPatch:
    """Replace ``owner.<name>`` (a class of transformers or torch) by ``replacement``, recorded in :func:`installed`;
    the patch's ``remove`` undoes it (and :func:`uninstall` the record too). Mutates ``owner``."""
    patch = MethodPatch(owner, name, replacement)
    _INSTALLED.append(patch)
    return patch


def register(registry: Any, name: str, function: Callable[..., Any]) -> Registration:
    """Register ``function`` as ``name`` in ``registry`` (one of transformers' ``GeneralInterface`` classes),
    recorded in :func:`installed`; :func:`uninstall` undoes it. Mutates the registry."""
    registration = Registration(registry, name, function)
    _INSTALLED.append(registration)
    return registration


def installed() -> list[MethodPatch | Registration]:
    """Every change :func:`install` and :func:`register` made to transformers' or torch's objects and
    :func:`uninstall` did not undo, in the order made. Does not mutate."""
    return list(_INSTALLED)


def uninstall(patch: MethodPatch | Registration) -> None:
    """Undo ``patch`` (the last change made to its attribute or name) and drop its record. Mutates its object."""
    later = [p for p in _INSTALLED[_INSTALLED.index(patch) + 1 :] if p.target == patch.target]
    if later:
        raise ValueError(f"{patch.target[1]} was patched again after this patch: undo the later patch first")
    patch.remove()
    _INSTALLED.remove(patch)


def bound_to_copies(function: Callable[..., Any], *model_args: Any) -> Callable[..., Any]:
    """``function`` with ``model_args`` (the model, the bound method it wraps) first, as an instance attribute
    that ``copy.deepcopy`` of the model copies rightly: a partial's arguments are deep-copied, so the copy's gets
    the copy and the method bound to it (a closure would keep the original's)."""
    return functools.update_wrapper(functools.partial(function, *model_args), model_args[-1])


@dataclass(frozen=True)
class _Shared:
    """What a :class:`SharedPatch` keeps on a model: how to undo the change, its users, the model it counts them
    on (a weak reference: ``copy.deepcopy`` keeps it, so a copy's record names the original)."""

    undo: Callable[[], None]
    users: int
    owner: weakref.ref[Any]


class SharedPatch:
    """A change to a model shared by its users, kept on the model under the instance attribute ``name``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def join(self, model: Any, make: Callable[[], Callable[[], None]]) -> None:
        """One more user of the change on ``model``; the first makes it (``make`` returns what undoes it). A deep
        copy's record keeps the copied change and starts counting afresh. Mutates the model."""
        record: _Shared | None = model.__dict__.get(self._name)
        if record is None:
            record = _Shared(make(), 0, weakref.ref(model))
        users = record.users if record.owner() is model else 0
        setattr(model, self._name, _Shared(record.undo, users + 1, weakref.ref(model)))

    def leave(self, model: Any) -> None:
        """One user fewer; the last undoes the change and leaves no trace on the model. Mutates the model."""
        record: _Shared = model.__dict__[self._name]
        if record.users > 1:
            setattr(model, self._name, _Shared(record.undo, record.users - 1, record.owner))
            return
        delattr(model, self._name)
        record.undo()

    def held(self, model: Any) -> bool:
        """Whether ``model`` itself has users (a deep copy carries the original's record, not its users)."""
        record: _Shared | None = model.__dict__.get(self._name)
        return record is not None and record.owner() is model


def compiled_forward(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` is a function ``torch.compile`` returned (``model.forward =
    torch.compile(model.forward)``), by the attribute torch 2.6 to 2.13 give it, or the model's call one
    (``model.compile()``, which torch 2.6 to 2.13 keep as ``_compiled_call_impl``). Does not mutate."""
    return hasattr(model.forward, "_torchdynamo_orig_callable") or compiled_call(model) is not None


def compiled_call(model: torch.nn.Module) -> Any:
    """What ``model.compile()`` made of the model's call (torch 2.6 to 2.13 keep it as ``_compiled_call_impl``,
    which ``model(...)`` then runs instead of the plain ``_call_impl``), or ``None``. Does not mutate."""
    return getattr(model, "_compiled_call_impl", None)


def set_compiled_call(model: torch.nn.Module, call: Any) -> None:
    """Make ``call`` what ``model(...)`` runs in place of ``model.compile()``'s result (:func:`compiled_call`).
    Mutates the model."""
    model._compiled_call_impl = call


def plain_call(model: torch.nn.Module) -> Callable[..., Any]:
    """The model's call as ``model(...)`` runs it without ``model.compile()`` (hooks, then ``forward``): torch 2.6 to
    2.13's ``_call_impl``. Does not mutate."""
    call: Callable[..., Any] = getattr(model, "_call_impl")  # noqa: B009  (a name torch does not type)
    return call
