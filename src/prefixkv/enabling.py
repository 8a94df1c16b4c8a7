"""The zero-code-change mode: :func:`enable` patches ``model.generate`` so that every call that passes no cache
gets a ``PagedPrefixCache`` of a store, and :func:`disable` undoes it."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .base.tokens import inferred_mask
from .compat import releases
from .compat.patching import MethodPatch, bound_to_copies
from .compat.releases import CACHE_KWARGS
from .hf.cache import PagedPrefixCache
from .hf.hooks import has_open_store
from .hf.vision import IMAGE_INPUTS
from .kv.key_space import transformers_model, user_space
from .store.prefix_store import PrefixStore

_ENABLED = "_prefixkv_enabled"


@dataclass(frozen=True)
class _Enabled:
    store: PrefixStore
    owns_store: bool
    patch: MethodPatch
    namespace: str | None
    warned: set[str] = field(default_factory=set)  # what a warning said once already (mutated)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Enabled:
        """What a ``copy.deepcopy`` of the enabled model holds: the same store, not a copy (its lock and pool are
        not the copy's to share; :func:`_enabled_generate` runs the copy stock), and the patch of the copy."""
        return _Enabled(self.store, False, copy.deepcopy(self.patch, memo), self.namespace)


TRAINING = (
    "prefixkv: this model is in training mode, where prefixkv reuses and publishes no K/V (dropout and other "
    "randomness make them differ from call to call, docs/correctness.md), so its generate calls run stock, "
    "without a prefixkv cache, until model.eval(); said once per enable()"
)


@dataclass(frozen=True)
class _CallPlan:
    """How an enabled model runs one ``generate`` call: with ``cache`` (``None``: stock, untouched), the
    keyword arguments to add, and whether the caller gets the cache back (then the caller's references,
    not the call's end, release it)."""

    cache: PagedPrefixCache | None
    extra: dict[str, Any]
    returned: bool


_STOCK = _CallPlan(None, {}, False)


def _call_arguments(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Every argument of a ``generate`` call by name, as transformers' ``generate`` reads them (``inputs`` and
    ``generation_config`` may come positionally); ``None`` if they do not bind."""
    signature = inspect.signature(type(transformers_model(model)).generate)
    try:
        bound = signature.bind_partial(None, *args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)), None)  # self
    extra = named.pop("kwargs", None) or {}
    return {**named, **extra}


def _plan_enabled_call(
    model: Any, store: PrefixStore, args: tuple[Any, ...], kwargs: dict[str, Any], namespace: str | None
) -> _CallPlan:
    """How an enabled model's ``generate`` call runs. Stock when the call brings its own cache, turns caching
    off, asks for a cache implementation itself, is an assistant model's draft call (which threads its own
    cache from call to call), or has inputs the cache cannot take (a warning says why). A cache implementation
    that only the checkpoint's ``generation_config`` names (Gemma 2's "hybrid") gives way to prefixkv's."""
    named = _call_arguments(model, args, kwargs)
    if named is None or any(named.get(name) is not None for name in CACHE_KWARGS):
        return _STOCK
    passed = named.get("generation_config")
    default = getattr(model, "generation_config", None)

    diff = passed.to_diff_dict() if passed is not None else {}

    def given(name: str) -> Any:
        """What the call itself sets (a keyword, or a field of the generation_config it passes), or None."""
        return named[name] if name in named else diff.get(name)

    def setting(name: str) -> Any:
        """The value generate uses: what the call sets, else the model's generation_config."""
        value = given(name)
        return value if value is not None or name in named or name in diff else getattr(default, name, None)

    if setting("use_cache") is False or given("cache_implementation") is not None or setting("is_assistant"):
        return _STOCK
    extra = {"cache_implementation": None} if setting("cache_implementation") is not None else {}
    returned = bool(setting("return_dict_in_generate"))
    ids = named.get("inputs", named.get("input_ids"))
    if ids is None or named.get("inputs_embeds") is not None:
        # the prompt's K/V comes from the embeddings, which need not be those of the ids (a soft prompt)
        # stores, never publishes or matches
        return _CallPlan(PagedPrefixCache(store, namespace=namespace), extra, returned)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return _STOCK
    mask = named.get("attention_mask")
    try:
        mask = mask if mask is not None else inferred_mask(ids, setting)
        # a vision-language model's image inputs key its placeholders (docs/generate.md, "Images")
        images = {name: named[name] for name in IMAGE_INPUTS if named.get(name) is not None}
        cache = PagedPrefixCache(store, ids, mask, namespace=namespace, **images)
    except ValueError as e:
        warnings.warn(f"prefixkv: this generate call runs without prefix reuse: {e}", stacklevel=3)
        return _STOCK
    return _CallPlan(cache, extra, returned)


def enable(
    model: Any, store: PrefixStore | None = None, *, namespace: str | None = None, **store_kwargs: Any
) -> PrefixStore:
    """Zero-code-change mode: every ``model.generate`` call that passes no cache gets a ``PagedPrefixCache``
    of ``store`` (built from the call's ``input_ids`` and ``attention_mask``, or the mask ``generate`` infers
    from the pad token; closed when the call returns, or, with ``return_dict_in_generate=True``, when the
    caller drops the output that hands it back), so code that never mentions a cache, such as
    ``pipeline("text-generation")``, reuses cached prefixes. Arguments are read as ``generate`` reads them
    (positional ``inputs`` and ``generation_config`` too). Calls that pass ``cache=``/``past_key_values=``,
    ``use_cache=False`` or a ``cache_implementation`` of their own are left alone; one that only the
    checkpoint's ``generation_config`` names gives way to prefixkv's cache. A model in training mode runs stock
    (a warning says so once), as prefixkv reuses nothing there. Without ``store`` one is built
    with ``store_kwargs`` (see :class:`PrefixStore`). Every call's cache is built with ``namespace``
    (:class:`PagedPrefixCache`; ``None``: the one shared namespace). Returns the store.
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
    current: _Enabled | None = model.__dict__.get(_ENABLED)
    if current is not None and current.store.model is not model:  # a deep copy of an enabled model
        disable(model)
        current = None
    if current is not None:
        if store is None and not store_kwargs and namespace == current.namespace:
            return current.store
        raise ValueError(
            "prefixkv is already enabled on this model; call prefixkv.disable(model) before enabling again"
        )
    if store is None and has_open_store(transformers_model(model)):
        raise ValueError(
            "a PrefixStore is already open on this model, and one store attaches to a model at a time: "
            "pass it (prefixkv.enable(model, store=store)) or close it first"
        )
    if store is not None and store_kwargs:
        raise TypeError(f"pass a store or arguments to build one, not both (got {sorted(store_kwargs)})")
    if store is not None and store.model is not model:
        raise ValueError("this PrefixStore was built for another model; build one with PrefixStore(model)")
    user_space(namespace, None)  # a wrong name fails before anything is built
    owns = store is None
    target = PrefixStore(model, **store_kwargs) if store is None else store
    generate = bound_to_copies(_enabled_generate, model, model.generate)
    setattr(model, _ENABLED, _Enabled(target, owns, MethodPatch(model, "generate", generate), namespace))
    return target


def _enabled_generate(model: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``generate`` of an enabled ``model`` (``original``: what it was before): with a cache of its store, as
    :func:`_plan_enabled_call` plans. A ``copy.deepcopy`` of the model runs stock: the store is the original's."""
    state: _Enabled | None = model.__dict__.get(_ENABLED)
    if state is None or state.store.model is not model:
        return original(*args, **kwargs)
    if transformers_model(model).training:
        # nothing could be reused or published, and a cache's in-batch prefill would draw from the random stream
        if TRAINING not in state.warned:
            state.warned.add(TRAINING)
            warnings.warn(TRAINING, stacklevel=3)
        return original(*args, **kwargs)
    plan = _plan_enabled_call(model, state.store, args, kwargs, state.namespace)
    if plan.cache is None:
        return original(*args, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}  # drop an explicit `cache=None`
    rest.update(plan.extra)
    if plan.returned:
        # the output hands the cache back (to continue from it): it lives as long as the caller keeps it
        try:
            return original(*args, **{releases.GENERATE_CACHE_KWARG: plan.cache}, **rest)
        except BaseException:
            plan.cache.close()
            raise
    with plan.cache:
        return original(*args, **{releases.GENERATE_CACHE_KWARG: plan.cache}, **rest)


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
