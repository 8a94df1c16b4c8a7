"""Everything that runs or hooks the model, above the store and the cache.

Model hooks: the forward pre-hook hands each call's token ids to its ``PagedPrefixCache`` (the
cache itself only ever sees K and V, DESIGN.md rule 1), the forward hook lets it publish what the
forward computed, and a wrapper of ``prepare_inputs_for_generation`` shows it the whole sequence at the
first step of each ``generate`` call, the only place where that sequence is visible.

The prefill that ``PrefixStore.pin`` and ``PrefixStore.warm`` need, and in-batch sharing (a prefix several
rows of one batch share is computed once). The store needs both but sits below the cache, so it cannot
import them: this module installs them in it (:func:`prefixkv.store.set_runner`) when prefixkv is imported,
and every store hooks its model and prefills through them.

Also the zero-code-change mode, :func:`enable` and :func:`disable`."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import _compat
from .attention import outside_compile
from .cache import PagedPrefixCache
from .errors import CacheMisuseError
from .stats import RowStats
from .store import Handle, PrefixStore, set_runner, transformers_model

_CACHE_KWARGS = ("cache", "past_key_values")
# forward inputs that do not change the K/V of the ids; any other input a forward gets (token_type_ids, say)
# makes its rows unproven (DESIGN.md rule 11: publish only what is proven)
_NEUTRAL_INPUTS = frozenset(
    {
        "input_ids",
        "inputs_embeds",
        "attention_mask",
        "position_ids",
        *_CACHE_KWARGS,
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "logits_to_keep",
        "num_logits_to_keep",
        "labels",
        "cache_position",
    }
)


def _paged_cache(store: PrefixStore, kwargs: dict[str, Any]) -> PagedPrefixCache | None:
    """The ``PagedPrefixCache`` of ``store`` that a forward carries, if any."""
    cache = _any_paged_cache(kwargs)
    return cache if cache is not None and cache.store is store else None


def attach_hooks(model: torch.nn.Module, store: PrefixStore) -> list[Handle]:
    """Register the pre/post forward hooks of ``store`` on ``model`` and share the wrapper of its
    ``prepare_inputs_for_generation``; return what undoes them. Mutates."""

    params = inspect.signature(model.forward).parameters
    positional = [name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # a model that takes no position_ids (Bloom's ALiBi) has K/V that do not depend on them
    positions_matter = "position_ids" in params

    def named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The forward's inputs by name, positional ones too (their order differs by family)."""
        return {**dict(zip(positional, args)), **kwargs} if args else kwargs

    @outside_compile
    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs = named(args, kwargs)
        cache = _paged_cache(store, inputs)
        if cache is None:
            return
        if module is not model:
            # `copy.deepcopy(model)` copies these hooks: the copy's weights are not the store's model's
            raise CacheMisuseError(
                "this PagedPrefixCache's PrefixStore was built for another model (this one is a copy.deepcopy of "
                "it, which carries the store's hooks, not the store): build a PrefixStore for this model"
            )
        cache.begin_forward(
            inputs.get("input_ids"),
            inputs.get("inputs_embeds"),
            inputs.get("attention_mask"),
            inputs.get("position_ids"),
            inputs.get("use_cache"),
            others=sorted(k for k, v in inputs.items() if v is not None and k not in _NEUTRAL_INPUTS),
            positions_matter=positions_matter,
        )

    @outside_compile
    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = _paged_cache(store, named(args, kwargs))
        if cache is not None and module is model:
            cache.end_forward(output is not None)  # torch passes None when the forward raised

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        # always_call: a forward that raises (or is cancelled by close() from another thread) still ends
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
        _PrepareUser(model),
    ]


# -- instance attributes that wrap a method --------------------------------------------------------


class _Missing:
    """No instance attribute was there: one object, in a deep copy of the model too."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self


_MISSING = _Missing()


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
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if isinstance(cache, PagedPrefixCache):
            return cache
    return None


def _bound_to_copies(function: Callable[..., Any], *model_args: Any) -> Callable[..., Any]:
    """``function`` with ``model_args`` (the model, the bound method it wraps) first, as an instance attribute
    that ``copy.deepcopy`` of the model copies rightly: a partial's arguments are deep-copied, so the copy's gets
    the copy and the method bound to it (a closure would keep the original's)."""
    return functools.update_wrapper(functools.partial(function, *model_args), model_args[-1])


def _checking_prepare(original: Callable[..., Any], input_ids: Any, *args: Any, **kwargs: Any) -> Any:
    """``prepare_inputs_for_generation`` that, at the first step of a call, lets a ``PagedPrefixCache``
    check the call's whole ``input_ids`` against what it holds and choose how many columns to feed."""
    cache = _any_paged_cache(kwargs)
    if cache is None or args or not isinstance(input_ids, torch.Tensor):
        return original(input_ids, *args, **kwargs)
    if kwargs.get("is_first_iteration"):
        kwargs["next_sequence_length"] = cache.plan_call(input_ids, kwargs.get("next_sequence_length"), kwargs)
    inputs = original(input_ids, *args, **kwargs)
    if isinstance(inputs, dict) and all(inputs.get(name) is not cache for name in _CACHE_KWARGS):
        raise CacheMisuseError(
            "this model's prepare_inputs_for_generation replaced the PagedPrefixCache (Phi-3 does so with "
            "rope scaling on long inputs), so prefixkv cannot serve this model: generate without it"
        )
    # a decode step of generate, whose mask is the one checked at the first step grown by ones: generate's decode
    # loops pass one new column and no is_first_iteration, assisted decoding is_first_iteration=False; a call of
    # one's own without either is checked in full
    first = kwargs.get("is_first_iteration")
    cache.decode_step = first is False or (first is None and kwargs.get("next_sequence_length") == 1)
    return inputs


_PREPARE = "prepare_inputs_for_generation"
_PREPARE_USERS = "_prefixkv_prepare_users"


class _PrepareUser:
    """One store's share of the ``prepare_inputs_for_generation`` wrapper; the last to leave removes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model: torch.nn.Module | None = model
        users: tuple[_MethodPatch, int, weakref.ref[torch.nn.Module]] | None = model.__dict__.get(_PREPARE_USERS)
        if users is None:
            patch = _MethodPatch(model, _PREPARE, _bound_to_copies(_checking_prepare, getattr(model, _PREPARE)))
            users = (patch, 0, weakref.ref(model))
        patch, count, owner = users
        if owner() is not model:  # a copy.deepcopy of a model with stores: the wrapper is the copy's, no store yet
            count = 0
        setattr(model, _PREPARE_USERS, (patch, count + 1, weakref.ref(model)))

    def remove(self) -> None:
        model, self._model = self._model, None
        if model is None:
            return
        patch, count, owner = model.__dict__[_PREPARE_USERS]
        if count > 1:
            setattr(model, _PREPARE_USERS, (patch, count - 1, owner))
            return
        delattr(model, _PREPARE_USERS)
        patch.remove()


def _has_open_store(model: torch.nn.Module) -> bool:
    """Whether a store is attached to ``model`` itself (a deep copy carries the original's record, not a store)."""
    users = model.__dict__.get(_PREPARE_USERS)
    return users is not None and users[2]() is model


# -- zero-code-change mode -------------------------------------------------------------------------

_ENABLED = "_prefixkv_enabled"


@dataclass(frozen=True)
class _Enabled:
    store: PrefixStore
    owns_store: bool
    patch: _MethodPatch

    def __deepcopy__(self, memo: dict[int, Any]) -> _Enabled:
        """What a ``copy.deepcopy`` of the enabled model holds: the same store, not a copy (its lock and pool are
        not the copy's to share; :func:`_enabled_generate` runs the copy stock), and the patch of the copy."""
        return _Enabled(self.store, False, copy.deepcopy(self.patch, memo))


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


def _inferred_mask(ids: torch.Tensor, setting: Callable[[str], Any]) -> torch.Tensor | None:
    """The attention mask ``generate`` infers when none is passed: the pad token's places, if the pad token
    occurs and is not an end-of-sequence token (SmolLM2's chat prompts hold it), else none."""
    pad = setting("pad_token_id")
    if pad is None or not bool((ids == pad).any()):
        return None
    eos = setting("eos_token_id")
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return None if int(pad) in eos_ids else ids != pad


def _plan_enabled_call(model: Any, store: PrefixStore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _CallPlan:
    """How an enabled model's ``generate`` call runs. Stock when the call brings its own cache, turns caching
    off, asks for a cache implementation itself, is an assistant model's draft call (which threads its own
    cache from call to call), or has inputs the cache cannot take (a warning says why). A cache implementation
    that only the checkpoint's ``generation_config`` names (Gemma 2's "hybrid") gives way to prefixkv's."""
    named = _call_arguments(model, args, kwargs)
    if named is None or any(named.get(name) is not None for name in _CACHE_KWARGS):
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
        return _CallPlan(PagedPrefixCache(store), extra, returned)  # stores, never publishes or matches
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return _STOCK
    mask = named.get("attention_mask")
    try:
        cache = PagedPrefixCache(store, ids, mask if mask is not None else _inferred_mask(ids, setting))
    except ValueError as e:
        warnings.warn(f"prefixkv: this generate call runs without prefix reuse: {e}", stacklevel=3)
        return _STOCK
    return _CallPlan(cache, extra, returned)


def enable(model: Any, store: PrefixStore | None = None, **store_kwargs: Any) -> PrefixStore:
    """Zero-code-change mode: every ``model.generate`` call that passes no cache gets a ``PagedPrefixCache``
    of ``store`` (built from the call's ``input_ids`` and ``attention_mask``, or the mask ``generate`` infers
    from the pad token; closed when the call returns, or, with ``return_dict_in_generate=True``, when the
    caller drops the output that hands it back), so code that never mentions a cache, such as
    ``pipeline("text-generation")``, reuses cached prefixes. Arguments are read as ``generate`` reads them
    (positional ``inputs`` and ``generation_config`` too). Calls that pass ``cache=``/``past_key_values=``,
    ``use_cache=False`` or a ``cache_implementation`` of their own are left alone; one that only the
    checkpoint's ``generation_config`` names gives way to prefixkv's cache. Without ``store`` one is built
    with ``store_kwargs`` (see :class:`PrefixStore`). Returns the store.
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
        if store is None and not store_kwargs:
            return current.store
        raise ValueError(
            "prefixkv is already enabled on this model; call prefixkv.disable(model) before enabling again"
        )
    if store is None and _has_open_store(transformers_model(model)):
        raise ValueError(
            "a PrefixStore is already open on this model, and one store attaches to a model at a time: "
            "pass it (prefixkv.enable(model, store=store)) or close it first"
        )
    if store is not None and store_kwargs:
        raise TypeError(f"pass a store or arguments to build one, not both (got {sorted(store_kwargs)})")
    if store is not None and store.model is not model:
        raise ValueError("this PrefixStore was built for another model; build one with PrefixStore(model)")
    owns = store is None
    target = PrefixStore(model, **store_kwargs) if store is None else store
    generate = _bound_to_copies(_enabled_generate, model, model.generate)
    setattr(model, _ENABLED, _Enabled(target, owns, _MethodPatch(model, "generate", generate)))
    return target


def _enabled_generate(model: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``generate`` of an enabled ``model`` (``original``: what it was before): with a cache of its store, as
    :func:`_plan_enabled_call` plans. A ``copy.deepcopy`` of the model runs stock: the store is the original's."""
    state: _Enabled | None = model.__dict__.get(_ENABLED)
    if state is None or state.store.model is not model:
        return original(*args, **kwargs)
    plan = _plan_enabled_call(model, state.store, args, kwargs)
    if plan.cache is None:
        return original(*args, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in _CACHE_KWARGS}  # drop an explicit `cache=None`
    rest.update(plan.extra)
    if plan.returned:
        # the output hands the cache back (to continue from it): it lives as long as the caller keeps it
        try:
            return original(*args, **{_compat.GENERATE_CACHE_KWARG: plan.cache}, **rest)
        except BaseException:
            plan.cache.close()
            raise
    with plan.cache:
        return original(*args, **{_compat.GENERATE_CACHE_KWARG: plan.cache}, **rest)


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


# -- prefill: running the model for a store ----------------------------------------------------------


@contextlib.contextmanager
def prefill(store: PrefixStore, tokens: list[int], *, keep_partial: bool, count: bool) -> Iterator[RowStats]:
    """Compute the uncached rest of ``tokens`` with the store's model (one forward, whose whole blocks the
    forward hook publishes) and, with ``keep_partial``, publish the last part-filled block too (what
    ``PrefixStore.pin`` keeps; ``PrefixStore.warm`` keeps whole blocks). In an invariant store only the whole
    chunks of ``tokens`` are computed and published, each by a forward of its own (:func:`prefill_chunks`).
    Yields the prompt tokens reused and computed; what was published stays locked until the block exits.
    ``count=False`` keeps the lookup out of the store's statistics. Mutates the store."""
    if store.chunk_size is not None:
        kept = tokens[: len(tokens) // store.chunk_size * store.chunk_size]
        with prefill_chunks(store, [kept]) as (held,):
            if count:
                store.count_query([len(tokens)], [held])
            yield RowStats(len(tokens), held, len(kept) - held)
        return
    ids = torch.tensor([tokens], dtype=torch.long) if count else None
    with PagedPrefixCache(store, ids) as cache:
        if not count:
            cache.attach_prompt([0], [tokens], count=False)
        _forward(cache, tokens[cache.get_seq_length() :])
        if keep_partial:
            cache.publish_all()
        yield cache.stats.per_row[0]


@contextlib.contextmanager
def prefill_chunks(store: PrefixStore, prefixes: list[list[int]]) -> Iterator[list[int]]:
    """The canonical prefill of an invariant store (docs/correctness.md, "Outputs that never depend on the
    cache"): make the store hold each of ``prefixes`` (whole chunks of ``store.chunk_size`` tokens), computing
    every chunk it lacks with a forward of its own, one row, ``[1, chunk_size]``, after the earlier chunks read
    from the pool, so that a chunk's K/V are a function of its tokens and those before it alone. A chunk computed
    for one prefix serves every later one that starts with it. Yields how many tokens of each prefix the store
    held before (whole chunks); everything the prefixes hold stays locked until the block exits. Mutates the
    store."""
    chunk = store.chunk_size
    if chunk is None:
        raise ValueError("prefill_chunks is the prefill of an invariant store: PrefixStore(model, invariant=True)")
    with contextlib.ExitStack() as holds:
        held = []
        for tokens in prefixes:  # every prefix's cached part locked first: computing the others must not evict it
            cache = holds.enter_context(PagedPrefixCache(store))
            if tokens:
                cache.attach_prompt([0], [tokens], count=False, chunks=True)
            held.append(cache.get_seq_length())
        for tokens, before in zip(prefixes, held):
            if before < len(tokens):
                cache = holds.enter_context(PagedPrefixCache(store))
                cache.attach_prompt([0], [tokens], count=False, chunks=True)  # with what earlier prefixes computed
                for start in range(cache.get_seq_length(), len(tokens), chunk):
                    _forward(cache, tokens[start : start + chunk])
        yield held


def _forward(cache: PagedPrefixCache, tokens: list[int]) -> None:
    """One forward of the store's model over ``tokens`` of a one-row prompt, after the columns ``cache`` holds."""
    store = cache.store
    model = store.hf_model  # a PEFT wrapper's adapters live in its layers; its forward renames the cache
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1  # K/V are wanted, not a row of logits per token
    # the first layer's device: model.device is `meta` when accelerate offloads the weights
    ids = torch.tensor([tokens], device=store.pool.specs[0].device)
    with torch.no_grad():
        model(input_ids=ids, **kwargs)


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _shared_prefixes(rows: list[list[int]], block_size: int) -> list[tuple[list[int], list[int]]]:
    """The longest whole-block prefixes that two or more rows share (at most ``len - 1`` tokens of each, what a
    row can reuse), each with the indices of the rows that start with it; a prefix of another one is left
    out, as computing the longer one caches it too. Does not mutate."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    found: dict[tuple[int, ...], None] = {}
    for a, b in itertools.pairwise(order):
        n = min(_common_length(rows[a], rows[b]), len(rows[a]) - 1, len(rows[b]) - 1) // block_size * block_size
        if n:
            found[tuple(rows[a][:n])] = None
    longest = [p for p in found if not any(len(q) > len(p) and q[: len(p)] == p for q in found)]
    return [(list(p), [i for i, r in enumerate(rows) if tuple(r[: len(p)]) == p]) for p in longest]


def _prefill_shared(store: PrefixStore, rows: list[list[int]]) -> list[tuple[int, list[int]]]:
    """In-batch sharing: compute once, with a one-row cache, each whole-block prefix that several rows share
    beyond what the store holds, and publish it, so every row then reuses it instead of computing it once per
    row. Returns, per prefix computed, the tokens computed and the rows sharing it. Mutates the store."""
    computed = []
    space = store.space()
    for prefix, members in _shared_prefixes(rows, store.block_size):
        if any(k < 0 for k in prefix):
            continue  # hidden tokens: a prefill without the rows' mask would compute other K/V
        if store.cached_length(prefix, space) >= len(prefix):
            continue
        with prefill(store, prefix, keep_partial=False, count=False) as row:
            computed.append((row.computed_tokens, members))
    return computed


class _Runner:
    """What every store runs its model with (:class:`prefixkv.store.ModelRunner`)."""

    def attach(self, store: PrefixStore) -> list[Handle]:
        return attach_hooks(store.hf_model, store)

    def prefill(
        self, store: PrefixStore, tokens: list[int], *, keep_partial: bool, count: bool
    ) -> contextlib.AbstractContextManager[RowStats]:
        return prefill(store, tokens, keep_partial=keep_partial, count=count)

    def prefill_shared(self, store: PrefixStore, rows: list[list[int]]) -> list[tuple[int, list[int]]]:
        return _prefill_shared(store, rows)

    def prefill_chunks(
        self, store: PrefixStore, prefixes: list[list[int]]
    ) -> contextlib.AbstractContextManager[list[int]]:
        return prefill_chunks(store, prefixes)


set_runner(_Runner())
