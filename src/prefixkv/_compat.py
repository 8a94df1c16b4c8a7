"""Every difference between the transformers and torch releases prefixkv supports, in this one module.

The rest of prefixkv is written against the newest transformers; this module checks the installed releases
against the supported range (one ImportError outside it, raised when prefixkv's public names first load) and
adapts what older releases name or call differently, found by looking at the installed transformers and torch,
never by comparing version numbers:

- ``generate`` takes the cache as ``cache=`` from transformers 5.24 (``past_key_values=`` is then deprecated),
  as ``past_key_values=`` before: :data:`GENERATE_CACHE_KWARG` is the spelling the installed release prefers, and
  on older releases ``generate`` is given ``cache=`` too (:func:`_taking_cache`), so that one spelling runs without
  a warning on every supported release.
- transformers 4.57-5.14 call ``crop`` with the length to keep (since 5.15, every caller passes the negative
  number of columns to drop), and 4.57-5.12 ask a cache layer for ``get_max_cache_shape`` where later releases
  ask for ``get_max_length``: :func:`adapt_cache` gives a cache class (and a layer class) both faces.
- transformers 4.57-5.3 give a cache layer's ``get_mask_sizes`` the step's ``cache_position`` where later releases
  give its length (the query length): :func:`adapt_cache` turns the one into the other.
- ``generate`` tells ``prepare_inputs_for_generation`` which step is a call's first and how many trailing columns
  of the inputs a step feeds, the protocol by which a ``PagedPrefixCache`` checks a call and chooses how many
  prompt columns its first step feeds (docs/how-it-works.md, "One forward, and the first step of a call"): from
  5.3 the columns as ``next_sequence_length``; 4.57-5.2 slice the inputs by the step's ``cache_position`` instead
  (counted from the cache's ``get_seq_length`` before the cache chose), and 5.3 still passes one to the model; 4.x
  mark no first step (``is_first_iteration``, from 5.0), so their ``_get_initial_cache_position``, called once
  before a call's first step, is wrapped to note it (:func:`_noting_start`). :func:`generate_step` reads what
  ``generate`` asks for and :func:`ask_columns` asks for what the cache chose, in the installed release's terms;
  5.3's ``_prefill`` cuts ``inputs_embeds`` by the cache's length itself, so it is wrapped to keep the whole ones
  (:func:`_keeping_embeds`). A ``_prefill`` that does the chunked prefill (``prefill_chunk_size``; 5.24's
  does) cuts the prompt by the cache's ``get_seq_length`` before any ``prepare_inputs_for_generation``, so it is
  wrapped to let the cache first fit its reuse to the whole prompt and mask (:func:`_planning_chunks`); 4.57's
  ``_prefill_chunking`` feeds the prompt from its first column whatever the cache holds, and a cache that reused
  columns refuses it.
- transformers 4.57-5.13 start assisted and prompt-lookup decoding without calling the cache's
  ``activate_past_recording``, which is how a ``PagedPrefixCache`` learns that the first forward re-feeds the
  columns it holds (docs/correctness.md, rule 7): their ``_assisted_decoding`` is wrapped to call it first, as
  5.14 and later do themselves, and to start 4.57-5.3's ``cache_position`` from the whole sequence
  (:func:`_recording_past`).
- torch's CPU flash-attention kernel gives a group of query heads its shared K/V head from torch 2.9; the kernel
  of older releases reads K/V head ``h`` for query head ``h``, past the K/V heads of a grouped model, and returns
  numbers without an error. :func:`cpu_flash_attention` repeats the K/V heads for such a kernel, found by
  probing the installed one (:func:`_kernel_reads_grouped_heads`).

The wrappers of ``GenerationMixin`` methods are installed by :func:`install_generation_patches`, which
every ``PrefixStore`` calls when it is built (not on import), except the ``cache=`` alias, installed when this
module loads (when prefixkv's public names first load): it only lets a call that would fail run, and a stock call
with a ``DynamicCache`` made before any store (a reference to compare with) takes it too. Each wrapper's docstring
says when it can be deleted.
Messages that name a release's spelling (:data:`CACHE_ARGUMENT_HINT`) and the inputs only some releases pass
(:data:`RELEASE_NEUTRAL_INPUTS`) live here too.

transformers 4.56 and older are refused: beyond these, their PEFT integration's ``active_adapter`` is a method,
assisted decoding with hidden states takes another path, and Llama 4's text model computes other numbers.

docs/getting-started.md lists the supported range; README.md says which releases CI tests.
"""

from __future__ import annotations

import abc
import functools
import inspect
import re
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import transformers

# the supported releases: transformers [low, high), 4.57 and every 5.x (4.56 and older differ beyond this module),
# and torch [low, high). torch 2.6 is the oldest release on which every
# supported transformers runs every family: transformers 5.24 requires it, and on 2.5 transformers 5.4 itself refuses
# masks built with or_mask_function (stock generate of Falcon fails there; everything else passed). The blocks path
# alone needs less: torch's CPU flash-attention kernel aten._scaled_dot_product_flash_attention_for_cpu, with
# attn_mask since torch 2.3 (pytorch#115913), which reads grouped K/V heads only since 2.9 (pytorch#157893; 2.6-2.8
# return wrong numbers for them, so cpu_flash_attention repeats the heads there). Tested: 2.6.0 with transformers
# 4.57.1 (CI's oldest job) and 5.4.0, 2.13.0 (CI's newest), 2.14.1 and 2.15.0 with transformers 5.24.0
TRANSFORMERS_RANGE = ((4, 57), (6, 0))
TORCH_RANGE = ((2, 6), (3, 0))


def release(version: str) -> tuple[int, int]:
    """The (major, minor) of a version string such as ``"5.24.0"``, ``"2.13.0+cpu"`` or ``"5.25.0.dev0"``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"cannot read a release number from the version {version!r}")
    return int(found.group(1)), int(found.group(2))


def _spelled(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    """A range as pip writes it: ``>=5.3,<6``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = bounds
    high = f"{hi_major}" if hi_minor == 0 else f"{hi_major}.{hi_minor}"
    return f">={lo_major}.{lo_minor},<{high}"


def unsupported(transformers_version: str, torch_version: str) -> str | None:
    """Why these releases of transformers and torch cannot run prefixkv, or ``None`` when they can. Does not
    mutate."""
    ranges = {"transformers": TRANSFORMERS_RANGE, "torch": TORCH_RANGE}
    installed = {"transformers": transformers_version, "torch": torch_version}
    problems = [
        f"{name} {installed[name]} is installed; prefixkv supports {name}{_spelled(bounds)}"
        for name, bounds in ranges.items()
        if not bounds[0] <= release(installed[name]) < bounds[1]
    ]
    if not problems:
        return None
    wanted = " ".join(f"'{name}{_spelled(bounds)}'" for name, bounds in ranges.items())
    return "; ".join(problems) + f". Install a supported release: pip install {wanted}"


def check_versions() -> None:
    """Raise ImportError, naming the supported range, unless the installed transformers and torch are in it."""
    reason = unsupported(transformers.__version__, torch.__version__)
    if reason is not None:
        raise ImportError(reason)


check_versions()

# imported after the check: older releases lack some of these names, and the check's message says more
from transformers.cache_utils import CacheLayerMixin, DynamicLayer  # noqa: E402
from transformers.generation import utils as _generation  # noqa: E402

GENERATE_CACHE_KWARG = "cache" if "cache" in _generation.ALL_CACHE_NAMES else "past_key_values"
"""The keyword by which the installed transformers' ``generate`` prefers to take a cache."""


def _taking_cache(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin.generate`` of transformers 4.57-5.23, which take the cache only as ``past_key_values=``
    (and refuse ``cache=`` as a keyword the model does not use): also takes it as ``cache=``, the spelling of 5.24
    and later, which deprecate ``past_key_values=``. A model whose own forward takes a ``cache`` (XLM's and
    Flaubert's dict of tensors) is given it as before. Delete when the oldest supported transformers is 5.24 or
    newer (its ``generate`` takes ``cache=`` itself)."""

    @functools.wraps(generate)
    def taking_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "cache" in kwargs and "cache" not in inspect.signature(self.forward).parameters:
            if kwargs.get("past_key_values") is not None:
                raise TypeError("generate() got a cache twice, as cache= and as past_key_values=; pass it once")
            kwargs["past_key_values"] = kwargs.pop("cache")
        return generate(self, *args, **kwargs)

    return taking_cache


if GENERATE_CACHE_KWARG != "cache":
    _generation.GenerationMixin.generate = _taking_cache(  # type: ignore[method-assign]
        _generation.GenerationMixin.generate
    )

_CROP_TAKES_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters
_ASKS_MAX_CACHE_SHAPE = not hasattr(CacheLayerMixin, "get_max_length")
_MASK_SIZES_OF_POSITIONS = "cache_position" in inspect.signature(CacheLayerMixin.get_mask_sizes).parameters
_KEEPS_CACHE_POSITION = hasattr(_generation.GenerationMixin, "_get_initial_cache_position")
_PREPARE_PARAMETERS = inspect.signature(_generation.GenerationMixin.prepare_inputs_for_generation).parameters
_PREPARE_TAKES_LENGTH = "next_sequence_length" in _PREPARE_PARAMETERS
_MARKS_FIRST_STEP = "is_first_iteration" in _PREPARE_PARAMETERS

_C = TypeVar("_C", bound=type)


def adapt_cache(cls: _C) -> _C:
    """Give a cache or cache-layer class written for the newest transformers the methods the installed one calls
    (a class decorator): ``crop`` that also takes a length to keep, ``get_max_cache_shape`` for its
    ``get_max_length``, and ``get_mask_sizes`` that also takes the step's ``cache_position``. On the newest
    transformers it is returned unchanged. Mutates ``cls``."""
    own = vars(cls)
    if _CROP_TAKES_LENGTH and "crop" in own:
        setattr(cls, "crop", functools.wraps(own["crop"])(_crop_to_length(own["crop"])))  # noqa: B010
    if _MASK_SIZES_OF_POSITIONS and "get_mask_sizes" in own:
        sizes = own["get_mask_sizes"]
        setattr(cls, "get_mask_sizes", functools.wraps(sizes)(_sizes_of_positions(sizes)))  # noqa: B010
    if _ASKS_MAX_CACHE_SHAPE and "get_max_length" in own:
        setattr(cls, "get_max_cache_shape", own["get_max_length"])  # noqa: B010
        abc.update_abstractmethods(cls)  # an abstract method of these releases' CacheLayerMixin until now
    return cls


def _crop_to_length(own: Callable[..., Any]) -> Callable[..., Any]:
    """``crop`` as transformers 5.4-5.14 call it: with the length to keep, or (negative) the number of columns
    to drop; a length past the end keeps everything."""

    def crop(self: Any, max_length: int) -> Any:
        return own(self, max_length if max_length < 0 else min(0, max_length - self.get_seq_length()))

    return crop


def _sizes_of_positions(own: Callable[..., Any]) -> Callable[..., Any]:
    """``get_mask_sizes`` as transformers 4.57-5.3 call it: with the step's ``cache_position`` (one position per
    query column) where later releases pass the query length."""

    def get_mask_sizes(self: Any, cache_position: torch.Tensor | int, *args: Any) -> Any:
        query_length = cache_position.shape[-1] if isinstance(cache_position, torch.Tensor) else cache_position
        return own(self, query_length, *args)

    return get_mask_sizes


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
    :func:`_noting_start`); each wrapper changes nothing for other caches. Called by every ``PrefixStore`` when it
    is built (no ``PagedPrefixCache`` exists before one), once per process. Mutates
    ``transformers.generation.utils.GenerationMixin``."""
    global _installed
    if _installed:
        return
    _installed = True
    mixin = _generation.GenerationMixin
    if "activate_past_recording" not in inspect.getsource(mixin._assisted_decoding):
        mixin._assisted_decoding = _recording_past(mixin._assisted_decoding)  # type: ignore[method-assign]
    if hasattr(mixin, "_prefill") and "inputs_embeds[:, past_length:" in inspect.getsource(mixin._prefill):
        mixin._prefill = _keeping_embeds(mixin._prefill)  # type: ignore[method-assign]
    if hasattr(mixin, "_prefill") and "prefill_chunk_size" in inspect.getsource(mixin._prefill):
        mixin._prefill = _planning_chunks(mixin._prefill, plan_chunks)  # type: ignore[method-assign]
    if not _MARKS_FIRST_STEP:
        initial_positions = vars(mixin)["_get_initial_cache_position"]  # a name the newest transformers lacks
        setattr(mixin, "_get_initial_cache_position", _noting_start(initial_positions))  # noqa: B010


# how messages spell passing a cache to generate (every supported release takes cache=, see _taking_cache)
CACHE_ARGUMENT_HINT = "cache=prefixkv.PagedPrefixCache(store, ids)"

# inputs of a forward that do not change K/V and that only some releases pass: num_logits_to_keep (4.x, before
# logits_to_keep), cache_position (dropped by the newest releases), is_first_iteration and next_sequence_length
# (prepare_inputs_for_generation's first-step markers, 5.x); prefixkv.hf.proof.NEUTRAL_INPUTS adds them to its own
RELEASE_NEUTRAL_INPUTS = frozenset(
    {"num_logits_to_keep", "cache_position", "is_first_iteration", "next_sequence_length"}
)


def _kernel_reads_grouped_heads() -> bool:
    """Whether torch's CPU flash-attention kernel reads, for two query heads over one K/V head, that K/V head for
    both. The K/V head is a view into a buffer of two heads whose second (what an older kernel reads for the
    second query head) holds other values, so the probe reads only memory it owns."""
    values = torch.ones(1, 2, 3, 4, dtype=torch.float64)
    values[:, 1] = 2.0  # the head past the view
    keys = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    query = torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys[:, :1], values[:, :1], 0.0, False)
    except RuntimeError:  # a kernel that checks the head counts instead
        return False
    return torch.allclose(out[0], torch.ones_like(out[0]))


_READS_GROUPED_HEADS = _kernel_reads_grouped_heads()


def cpu_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    *,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, no dropout):
    the output ``[B, Hq, q, D]`` of ``query`` ``[B, Hq, q, D]`` over ``key``/``value`` ``[B, Hkv, n, D]`` (``Hq``
    a multiple of ``Hkv``) under an additive ``attn_mask`` or ``causal``, and the log-sum-exp ``[B, Hq, q]``. On a
    kernel that does not read grouped heads (torch before 2.9) the K/V heads are repeated first. Does not mutate."""
    group = query.shape[1] // key.shape[1]
    if group > 1 and not _READS_GROUPED_HEADS:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return out, lse
