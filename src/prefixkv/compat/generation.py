"""The first step of a ``generate`` call on each transformers release prefixkv supports: the other module, beside
:mod:`prefixkv.compat.releases`, that knows the releases (issue 34: these two are the only ones). ``generate`` tells
``prepare_inputs_for_generation`` which step is a call's first and how many trailing columns of the inputs a step
feeds, the protocol by which a ``PagedPrefixCache`` checks a call and chooses how many prompt columns its first step
feeds (docs/how-it-works.md, "One forward, and the first step of a call"):

- from 5.3 the columns as ``next_sequence_length``; 4.57-5.2 slice the inputs by the step's ``cache_position``
  instead (counted from the cache's ``get_seq_length`` before the cache chose), and 5.3 still passes one to the
  model; 4.x mark no first step (``is_first_iteration``, from 5.0), so their ``_get_initial_cache_position``, called
  once before a call's first step, is wrapped to note it (:func:`_noting_start`). :func:`generate_step` reads what
  ``generate`` asks for and :func:`ask_columns` asks for what the cache chose, in the installed release's terms;
  5.3's ``_prefill`` cuts ``inputs_embeds`` by the cache's length itself, so it is wrapped to keep the whole ones
  (:func:`_keeping_embeds`). A ``_prefill`` that does the chunked prefill (``prefill_chunk_size``; 5.24's does)
  cuts the prompt by the cache's ``get_seq_length`` before any ``prepare_inputs_for_generation``, so it is wrapped
  to let the cache first fit its reuse to the whole prompt and mask (:func:`_planning_chunks`); 4.57's
  ``_prefill_chunking`` feeds the prompt from its first column whatever the cache holds, and a cache that reused
  columns refuses it.
- transformers 4.57-5.13 start assisted and prompt-lookup decoding without calling the cache's
  ``activate_past_recording``, which is how a ``PagedPrefixCache`` learns that the first forward re-feeds the
  columns it holds (docs/correctness.md, rule 7): their ``_assisted_decoding`` is wrapped to call it first, as
  5.14 and later do themselves, and to start 4.57-5.3's ``cache_position`` from the whole sequence
  (:func:`_recording_past`).

The wrappers of ``GenerationMixin`` methods are installed by :func:`install_generation_patches`, which every
``PrefixStore`` calls when it is built (not on import). Each wrapper's docstring says when it can be deleted. As in
:mod:`prefixkv.compat.releases`, what a release does is found by looking at the installed transformers, never by
comparing version numbers.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers.generation import utils as _generation

from . import patching, releases  # noqa: F401  (the release check, with its message, as for every module that knows releases)

_KEEPS_CACHE_POSITION = hasattr(_generation.GenerationMixin, "_get_initial_cache_position")
_PREPARE_PARAMETERS = inspect.signature(_generation.GenerationMixin.prepare_inputs_for_generation).parameters
_PREPARE_TAKES_LENGTH = "next_sequence_length" in _PREPARE_PARAMETERS
_MARKS_FIRST_STEP = "is_first_iteration" in _PREPARE_PARAMETERS

# a cache -> the whole inputs_embeds of its call's first step, which transformers 5.3's _prefill cuts to those after the
# columns the cache holds before the cache has chosen (:func:`_keeping_embeds`)
_WHOLE_EMBEDS: weakref.WeakKeyDictionary[Any, torch.Tensor] = weakref.WeakKeyDictionary()


class Step(NamedTuple):
    """What a step of ``generate`` tells ``prepare_inputs_for_generation``: whether it is the first step of a call
    (``None``: it does not say, as its decode loops do not), and how many trailing ``columns`` of the inputs to
    feed (``None``: all of them)."""

    first: bool | None
    columns: int | None


# caches whose call has begun (transformers 4.x): the next prepare_inputs_for_generation with them is a first step
_STARTING: weakref.WeakSet[Any] = weakref.WeakSet()


def generate_step(kwargs: dict[str, Any], cache: Any, input_ids: torch.Tensor) -> Step:
    """What the step of ``generate`` that calls ``prepare_inputs_for_generation`` with ``kwargs``, ``input_ids``
    and ``cache`` asks for: before ``next_sequence_length``, the number of columns is the length of the step's
    ``cache_position`` (all of them when it is as long as the inputs), and 4.x mark no first step (the decoding
    methods' ``_get_initial_cache_position`` is wrapped to note it, :func:`_noting_start`). At the first step of a
    call on transformers 5.3 with ``inputs_embeds``, gives ``kwargs`` back the whole embeddings and asks for those
    after the held columns, as later releases do. Mutates ``kwargs`` then."""
    if _MARKS_FIRST_STEP:
        first: bool | None = kwargs.get("is_first_iteration")
    else:
        first = True if cache in _STARTING else None
        _STARTING.discard(cache)
    if first and cache in _WHOLE_EMBEDS:
        embeds = kwargs["inputs_embeds"] = _WHOLE_EMBEDS.pop(cache)
        held: int = cache.get_seq_length()
        return Step(first, embeds.shape[1] - held)
    if _PREPARE_TAKES_LENGTH:
        return Step(first, kwargs.get("next_sequence_length"))
    positions = kwargs.get("cache_position")
    if not isinstance(positions, torch.Tensor) or positions.shape[0] == input_ids.shape[1]:
        return Step(first, None)
    return Step(first, positions.shape[0])


# a cache -> the position of the first column its call's first step fed: transformers 4.57-5.2 extend the first step's
# cache_position at each step of a call with use_cache=False, which re-feeds every column from there
_FIRST_FED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def ask_columns(
    kwargs: dict[str, Any], cache: Any, input_ids: torch.Tensor, length: int | None, *, first: bool
) -> None:
    """Make ``prepare_inputs_for_generation`` (called with ``kwargs``, ``input_ids`` and ``cache``) feed the last
    ``length`` columns of its inputs (``None``: all) after the columns ``cache`` holds, the number that ``cache``
    chose at the ``first`` step of a call. On releases that keep a ``cache_position`` (4.57-5.3), the first step's
    becomes the positions of those columns: 4.57-5.2 slice the inputs by it, and 5.3's, built before the cache
    chose, may count the held columns twice (assisted decoding's first step adds them to the whole sequence's); a
    later step of 4.57-5.2 with ``use_cache=False`` re-feeds every column from the first step's first. Mutates
    ``kwargs``."""
    if _PREPARE_TAKES_LENGTH and first:
        kwargs["next_sequence_length"] = length
    positions = kwargs.get("cache_position")
    if not isinstance(positions, torch.Tensor):
        return
    if first:
        embeds = kwargs.get("inputs_embeds")
        fed = length if length is not None else (embeds if isinstance(embeds, torch.Tensor) else input_ids).shape[1]
        start = _FIRST_FED[cache] = cache.get_seq_length()
        kwargs["cache_position"] = torch.arange(start, start + fed, device=positions.device)
    elif not _PREPARE_TAKES_LENGTH and kwargs.get("use_cache") is False and cache in _FIRST_FED:
        kwargs["cache_position"] = torch.arange(_FIRST_FED[cache], input_ids.shape[1], device=positions.device)


def _recording_past(assisted_decoding: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin._assisted_decoding`` that first calls ``activate_past_recording`` of a cache that has
    one, as transformers does itself from 5.14 (stock caches of older releases have none, so they run as
    before). That first step re-feeds the whole sequence: on releases that keep a ``cache_position`` (4.57-5.3) it
    starts as the whole sequence's positions, those they build for an empty cache (from the cache's
    ``get_seq_length``, 4.57-5.2 would skip the held columns and 5.3 count them twice); the cache then chooses
    which columns to feed (:func:`ask_columns`). Delete when the oldest supported transformers is 5.14 or newer.
    """

    @functools.wraps(assisted_decoding)
    def assisted(self: Any, input_ids: torch.Tensor, *args: Any, **model_kwargs: Any) -> Any:
        record = getattr(model_kwargs.get("past_key_values"), "activate_past_recording", None)
        if record is not None:
            record()
            if _KEEPS_CACHE_POSITION and model_kwargs.get("cache_position") is None:
                model_kwargs["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        return assisted_decoding(self, input_ids, *args, **model_kwargs)

    return assisted


def _keeping_embeds(prefill: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin._prefill`` of transformers 5.3, which cuts ``inputs_embeds`` to those after the columns
    the cache holds before the first step, where later releases leave the cut to ``prepare_inputs_for_generation``
    (by ``next_sequence_length``): for a cache that chooses its columns at that step (a ``PagedPrefixCache`` drops
    its reuse for embeddings that are not its ids), it keeps the whole embeddings for :func:`generate_step`.
    Delete when the oldest supported transformers is 5.4 or newer."""

    @functools.wraps(prefill)
    def keeping(
        self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: Any, *a: Any, **k: Any
    ) -> Any:
        cache, embeds = model_kwargs.get("past_key_values"), model_kwargs.get("inputs_embeds")
        if not hasattr(cache, "activate_past_recording") or not isinstance(embeds, torch.Tensor):
            return prefill(self, input_ids, generation_config, model_kwargs, *a, **k)
        _WHOLE_EMBEDS[cache] = embeds
        try:
            return prefill(self, input_ids, generation_config, model_kwargs, *a, **k)
        finally:
            _WHOLE_EMBEDS.pop(cache, None)

    return keeping


def _planning_chunks(
    prefill: Callable[..., Any], plan: Callable[[Any, torch.Tensor, dict[str, Any]], None]
) -> Callable[..., Any]:
    """``GenerationMixin._prefill`` that does the chunked prefill (``prefill_chunk_size``) itself, cutting the
    prompt by the cache's ``get_seq_length`` before the first ``prepare_inputs_for_generation``, which then sees a
    chunk only: for a cache that chooses its columns at the first step, it first calls ``plan`` (the model, the
    whole ``input_ids`` and the call's keywords, its mask included), so the chunks start after the columns that
    fit the call. Unchunked prefill and other caches run as before. It can be deleted once the oldest supported
    release lets the cache choose its columns before the chunks are cut (none does up to 5.24)."""

    @functools.wraps(prefill)
    def planning(
        self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: Any, *a: Any, **k: Any
    ) -> Any:
        first = (a[0] if a else k.get("is_first_iteration", True)) is not False
        cache = next((model_kwargs.get(name) for name in _generation.ALL_CACHE_NAMES if name in model_kwargs), None)
        if (
            first
            and generation_config.prefill_chunk_size is not None
            and hasattr(cache, "activate_past_recording")
            and not isinstance(model_kwargs.get("inputs_embeds"), torch.Tensor)
        ):
            plan(self, input_ids, model_kwargs)
        return prefill(self, input_ids, generation_config, model_kwargs, *a, **k)

    return planning


def _noting_start(initial: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin._get_initial_cache_position`` of transformers 4.x, which every decoding method calls once
    before its first step (their steps do not say which is the first): notes that the next step with the call's
    cache (one that chooses its columns at the first step) is a first step, for :func:`generate_step`. Delete when
    the oldest supported transformers is 5.0 or newer (their ``prepare_inputs_for_generation`` takes
    ``is_first_iteration``)."""

    @functools.wraps(initial)
    def noting(self: Any, seq_length: Any, device: Any, model_kwargs: Any) -> Any:
        cache = model_kwargs.get("past_key_values")
        if hasattr(cache, "activate_past_recording"):
            _STARTING.add(cache)
        return initial(self, seq_length, device, model_kwargs)

    return noting


_installed = False


def install_generation_patches(plan_chunks: Callable[[Any, torch.Tensor, dict[str, Any]], None]) -> None:
    """Wrap the ``GenerationMixin`` methods this release needs for a cache that chooses its columns at the first
    step (:func:`_recording_past`, :func:`_keeping_embeds`, :func:`_planning_chunks` with ``plan_chunks``,
    :func:`_noting_start`); each wrapper changes nothing for other caches. Called once per process, when the first
    ``PrefixStore`` is built (:func:`prefixkv.hf.hooks.install_generation_wrappers`; no ``PagedPrefixCache`` exists
    before one). Mutates ``transformers.generation.utils.GenerationMixin``, each change through
    :func:`prefixkv.compat.patching.install` (recorded, undoable)."""
    global _installed
    if _installed:
        return
    _installed = True
    mixin = _generation.GenerationMixin
    if "activate_past_recording" not in inspect.getsource(mixin._assisted_decoding):
        patching.install(mixin, "_assisted_decoding", _recording_past(mixin._assisted_decoding))
    if hasattr(mixin, "_prefill") and "inputs_embeds[:, past_length:" in inspect.getsource(mixin._prefill):
        patching.install(mixin, "_prefill", _keeping_embeds(mixin._prefill))
    if hasattr(mixin, "_prefill") and "prefill_chunk_size" in inspect.getsource(mixin._prefill):
        patching.install(mixin, "_prefill", _planning_chunks(mixin._prefill, plan_chunks))
    if not _MARKS_FIRST_STEP:
        initial_positions = vars(mixin)["_get_initial_cache_position"]  # a name the newest transformers lacks
        patching.install(mixin, "_get_initial_cache_position", _noting_start(initial_positions))
