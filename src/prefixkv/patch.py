"""Model hooks: the forward pre-hook hands each call's token ids to its ``PagedPrefixCache`` (the
cache itself only ever sees K and V, DESIGN.md rule 1), the forward hook lets it publish what the
forward computed, and a wrapper of ``prepare_inputs_for_generation`` shows it the whole sequence at the
first step of each ``generate`` call, the only place where that sequence is visible. Also the
zero-code-change mode, :func:`enable` and :func:`disable`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .cache import PagedPrefixCache
    from .store import PrefixStore

_CACHE_KWARGS = ("cache", "past_key_values")


def _paged_cache(store: PrefixStore, kwargs: dict[str, Any]) -> PagedPrefixCache | None:
    """The ``PagedPrefixCache`` of ``store`` that a forward carries, if any."""
    cache = _any_paged_cache(kwargs)
    return cache if cache is not None and cache.store is store else None


class Handle(Protocol):
    """What undoes one hook or patch."""

    def remove(self) -> None: ...


def attach_hooks(model: torch.nn.Module, store: PrefixStore) -> list[Handle]:
    """Register the pre/post forward hooks of ``store`` on ``model`` and share the wrapper of its
    ``prepare_inputs_for_generation``; return what undoes them. Mutates."""

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
        _PrepareUser(model),
    ]


# -- instance attributes that wrap a method --------------------------------------------------------

_MISSING = object()


class _MethodPatch:
    """``model.<name>`` replaced by an instance attribute; :meth:`remove` puts back exactly what was
    there (usually nothing, so the class's method shows through again)."""

    def __init__(self, model: torch.nn.Module, name: str, replacement: Callable[..., Any]) -> None:
        self._model, self._name = model, name
        self._previous = model.__dict__.get(name, _MISSING)
        setattr(model, name, replacement)

    def remove(self) -> None:
        if self._previous is _MISSING:
            delattr(self._model, self._name)
        else:
            setattr(self._model, self._name, self._previous)


def _any_paged_cache(kwargs: dict[str, Any]) -> PagedPrefixCache | None:
    from .cache import PagedPrefixCache

    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if isinstance(cache, PagedPrefixCache):
            return cache
    return None


def _checking_prepare(original: Callable[..., Any]) -> Callable[..., Any]:
    """``prepare_inputs_for_generation`` that, at the first step of a call, lets a ``PagedPrefixCache``
    check the call's whole ``input_ids`` against what it holds and choose how many columns to feed."""

    @functools.wraps(original)
    def prepare_inputs_for_generation(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        cache = _any_paged_cache(kwargs)
        if cache is not None and not args and kwargs.get("is_first_iteration") and isinstance(input_ids, torch.Tensor):
            kwargs["next_sequence_length"] = cache._plan_call(
                input_ids,
                kwargs.get("next_sequence_length"),
                kwargs.get("attention_mask"),
                kwargs.get("position_ids"),
                bool(kwargs.get("output_attentions") or kwargs.get("output_hidden_states")),
            )
        return original(input_ids, *args, **kwargs)

    return prepare_inputs_for_generation


_PREPARE = "prepare_inputs_for_generation"
_PREPARE_USERS = "_prefixkv_prepare_users"


class _PrepareUser:
    """One store's share of the ``prepare_inputs_for_generation`` wrapper; the last to leave removes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model: torch.nn.Module | None = model
        users: tuple[_MethodPatch, int] | None = model.__dict__.get(_PREPARE_USERS)
        patch, count = users or (_MethodPatch(model, _PREPARE, _checking_prepare(getattr(model, _PREPARE))), 0)
        setattr(model, _PREPARE_USERS, (patch, count + 1))

    def remove(self) -> None:
        model, self._model = self._model, None
        if model is None:
            return
        patch, count = model.__dict__[_PREPARE_USERS]
        if count > 1:
            setattr(model, _PREPARE_USERS, (patch, count - 1))
            return
        delattr(model, _PREPARE_USERS)
        patch.remove()


# -- zero-code-change mode -------------------------------------------------------------------------

_ENABLED = "_prefixkv_enabled"


@dataclass(frozen=True)
class _Enabled:
    store: PrefixStore
    owns_store: bool
    patch: _MethodPatch


def _cache_for_call(model: Any, store: PrefixStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``PagedPrefixCache`` an enabled model's ``generate`` call gets, or ``None`` to leave the call alone:
    it brings its own cache, turns caching off, asks for another cache implementation, or is an assistant
    model's draft call (which threads its own cache from call to call)."""
    from .cache import PagedPrefixCache

    if any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
        return None
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        return None
    if kwargs.get("cache_implementation", getattr(config, "cache_implementation", None)) is not None:
        return None
    if getattr(config, "is_assistant", False):
        return None
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if ids is None or kwargs.get("inputs_embeds") is not None:
        # the prompt's K/V comes from the embeddings, which need not be those of the ids (a soft prompt)
        return PagedPrefixCache(store)  # inputs_embeds only, or generation from BOS: stores, cannot match
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return None
    return PagedPrefixCache(store, ids, kwargs.get("attention_mask"))


def enable(model: Any, store: PrefixStore | None = None, **store_kwargs: Any) -> PrefixStore:
    """Zero-code-change mode: every ``model.generate`` call that passes no cache gets a ``PagedPrefixCache``
    of ``store`` (built from the call's ``input_ids`` and ``attention_mask``, closed when the call returns),
    so code that never mentions a cache, such as ``pipeline("text-generation")``, reuses cached prefixes.
    Calls that pass ``cache=``/``past_key_values=``, ``use_cache=False`` or a ``cache_implementation`` are left
    alone. Without ``store`` one is built with ``store_kwargs`` (see :class:`PrefixStore`). Returns the store.
    Mutates the model (an instance attribute ``generate``); :func:`disable` undoes it.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.enable(model, block_size=4)
    >>> ids = torch.arange(1, 12).unsqueeze(0)
    >>> first = model.generate(ids, max_new_tokens=3, do_sample=False)
    >>> again = model.generate(ids, max_new_tokens=3, do_sample=False)
    >>> store.stats.hit_tokens
    10
    >>> prefixkv.disable(model)
    """
    from .store import PrefixStore

    current: _Enabled | None = model.__dict__.get(_ENABLED)
    if current is not None:
        if store is None and not store_kwargs:
            return current.store
        raise ValueError(
            "prefixkv is already enabled on this model; call prefixkv.disable(model) before enabling again"
        )
    if store is not None and store_kwargs:
        raise TypeError(f"pass a store or arguments to build one, not both (got {sorted(store_kwargs)})")
    if store is not None and store.model is not model:
        raise ValueError("this PrefixStore was built for another model; build one with PrefixStore(model)")
    owns = store is None
    target = PrefixStore(model, **store_kwargs) if store is None else store
    original = model.generate

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        cache = _cache_for_call(model, target, args, kwargs)
        if cache is None:
            return original(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in _CACHE_KWARGS}  # drop an explicit `cache=None`
        with cache:
            return original(*args, cache=cache, **rest)

    setattr(model, _ENABLED, _Enabled(target, owns, _MethodPatch(model, "generate", generate)))
    return target


def disable(model: Any) -> None:
    """Undo :func:`enable`: ``model.generate`` is the original again, and the store ``enable`` built is
    closed (which restores the model's attention implementation); a store passed to ``enable`` stays open.
    Does nothing if the model is not enabled. Mutates."""
    state: _Enabled | None = model.__dict__.get(_ENABLED)
    if state is None:
        return
    delattr(model, _ENABLED)
    state.patch.remove()
    if state.owns_store:
        state.store.close()
