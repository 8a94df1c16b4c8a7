"""How prefixkv changes a model object and undoes the change: the one shape for all of them.

A :class:`MethodPatch` replaces a method by an instance attribute and puts back exactly what was there. A
:class:`SharedPatch` is a change that several users share (every store on a model shares one wrapper of
``prepare_inputs_for_generation`` and one switch to prefixkv's attention): kept on the model under one attribute
with its count of users, made by the first to join and undone by the last to leave. Its record names the model it
was made on, so a ``copy.deepcopy`` of the model, which copies the record (and the change), starts with no users."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class _Missing:
    """No instance attribute was there: one object, in a deep copy of the model too."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self


_MISSING = _Missing()


class MethodPatch:
    """``model.<name>`` replaced by an instance attribute; :meth:`remove` puts back exactly what was
    there (usually nothing, so the class's method shows through again)."""

    def __init__(self, model: Any, name: str, replacement: Callable[..., Any]) -> None:
        self._model, self._name = model, name
        self._previous = model.__dict__.get(name, _MISSING)
        setattr(model, name, replacement)

    def remove(self) -> None:
        if self._previous is _MISSING:
            delattr(self._model, self._name)
        else:
            setattr(self._model, self._name, self._previous)


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
