"""Every difference between the transformers and torch releases prefixkv supports, in this module and
:mod:`prefixkv.compat.generation` (the first step of a ``generate`` call: how each release says which step is a
call's first and how many columns it feeds, and the ``GenerationMixin`` wrappers that let older ones say it).

The rest of prefixkv is written against the newest transformers; this module checks the installed releases
against the supported range (one ImportError outside it, raised when prefixkv's public names first load) and
adapts what older releases name or call differently, found by looking at the installed transformers and torch,
never by comparing version numbers:

- ``generate`` takes the cache as ``cache=`` from transformers 5.24 (``past_key_values=`` is then deprecated),
  as ``past_key_values=`` before: :data:`GENERATE_CACHE_KWARG` is the spelling the installed release prefers, and
  on older releases ``generate`` is given ``cache=`` too (:func:`_taking_cache`), so that one spelling runs without
  a warning on every supported release.
- a model's forward takes its cache as ``cache=`` from transformers 5.24, as ``past_key_values=`` before
  (:func:`forward_cache_kwarg`; :data:`CACHE_KWARGS`, both names).
- transformers 4.57-5.14 call ``crop`` with the length to keep (since 5.15, every caller passes the negative
  number of columns to drop), and 4.57-5.12 ask a cache layer for ``get_max_cache_shape`` where later releases
  ask for ``get_max_length``: :func:`adapt_cache` gives a cache class (and a layer class) both faces.
- transformers 4.57-5.3 give a cache layer's ``get_mask_sizes`` the step's ``cache_position`` where later releases
  give its length (the query length): :func:`adapt_cache` turns the one into the other.
- transformers 4.57 builds a compileable cache's 4-D masks in ``prepare_inputs_for_generation`` with a model's own
  ``_prepare_4d_causal_attention_mask_with_cache_position`` where it has one (OPT among the families of
  docs/architectures.md), as wide as the cache's fixed length (``get_max_cache_shape``), which a
  ``PagedPrefixCache`` has not (later releases build them from ``get_mask_sizes``): :func:`compile_refusal` refuses
  compiled steps on such a model there.
- torch's CPU flash-attention kernel gives a group of query heads its shared K/V head from torch 2.9; the kernel
  of older releases reads K/V head ``h`` for query head ``h``, past the K/V heads of a grouped model, and returns
  numbers without an error. :func:`cpu_flash_attention` repeats the K/V heads for such a kernel, found by
  probing the installed one (:func:`_kernel_reads_grouped_heads`).
- torch's FlexAttention returns its log-sum-exp when asked with an ``AuxRequest`` from torch 2.9 (older releases
  take ``return_lse=``, deprecated since): :func:`flex_aux_request` finds it, and :func:`flex_refusal` says in one
  line why the ``"flex"`` backend cannot serve on a torch without it.

The ``cache=`` alias is installed when this module loads (when prefixkv's public names first load): it only lets a
call that would fail run, and a stock call with a ``DynamicCache`` made before any store (a reference to compare
with) takes it too; its docstring says when it can be deleted.
The inputs only some releases pass (:data:`RELEASE_NEUTRAL_INPUTS`) live here too. The alias, as every change
prefixkv makes to a class of transformers or torch, is made by :func:`prefixkv.compat.patching.install`, recorded and
undoable. Nothing else lives here: only the supported range and what the releases in it that differ need, so that
dropping a release deletes its shims and nothing more.

transformers 4.56 and older are refused: beyond these, their PEFT integration's ``active_adapter`` is a method,
assisted decoding with hidden states takes another path, and Llama 4's text model computes other numbers.

docs/getting-started.md lists the supported range; README.md says which releases CI tests.
"""

from __future__ import annotations

import abc
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import transformers

from .patching import install

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
from transformers import cache_utils as _cache_utils  # noqa: E402
from transformers.cache_utils import CacheLayerMixin, DynamicLayer  # noqa: E402
from transformers.generation import utils as _generation  # noqa: E402

GENERATE_CACHE_KWARG = "cache" if "cache" in _generation.ALL_CACHE_NAMES else "past_key_values"
"""The keyword by which the installed transformers' ``generate`` prefers to take a cache."""

# transformers 5.x's recurrent layers (linear attention, Mamba, short convolutions) and how it reads a config's layer
# kinds; 4.57 has neither (its hybrid models keep caches of their own, refused by hf/support.py). Delete the
# fallbacks when the oldest supported transformers has them
LINEAR_ATTENTION_LAYER: type | None = getattr(_cache_utils, "LinearAttentionLayer", None)
"""transformers' cache layer of a recurrent layer's conv and recurrent states, or ``None`` on releases without it."""
_LAYER_TYPES = getattr(_cache_utils, "get_layer_types_and_kwargs", None)


def cache_layer_types(text_config: Any) -> list[str] | None:
    """The cache layer kind of each of ``text_config``'s layers as transformers reads them (``"full_attention"``,
    ``"linear_attention"``, ``"conv"``, ``"hybrid"``, ``"dummy"``, ...), or ``None`` on a release that does not read
    them (4.57) or for a config it cannot read. Does not mutate."""
    if _LAYER_TYPES is None or LINEAR_ATTENTION_LAYER is None:
        return None
    try:
        types, _ = _LAYER_TYPES(text_config)
    except Exception:  # a config without per-layer configs: the release's reading does not apply
        return None
    return [str(t) for t in types]


# the keywords by which generate and a model's forward take a cache: ``cache`` from transformers 5.24,
# ``past_key_values`` before (and, deprecated, beside it)
CACHE_KWARGS = ("cache", "past_key_values")


def forward_cache_kwarg(forward: Callable[..., Any]) -> str:
    """The keyword by which a model's ``forward`` takes its cache: ``cache`` where its signature has it (the models
    of transformers 5.24 and later), else ``past_key_values`` (those of older releases). Delete when the oldest
    supported transformers is 5.24 or newer. Does not mutate."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _taking_cache(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin.generate`` of transformers 4.57-5.23, which take the cache only as ``past_key_values=``
    (and refuse ``cache=`` as a keyword the model does not use): also takes it as ``cache=``, the spelling of 5.24
    and later, which deprecate ``past_key_values=``. Only a call that would fail changes: ``cache=None`` is left
    to ``generate``, which ignores a keyword set to ``None`` (beside a ``past_key_values=`` too), and a model whose
    own forward takes a ``cache`` (XLM's and Flaubert's dict of tensors) is given it as before. Delete when the
    oldest supported transformers is 5.24 or newer (its ``generate`` takes ``cache=`` itself)."""

    @functools.wraps(generate)
    def taking_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cache") is not None and "cache" not in inspect.signature(self.forward).parameters:
            if kwargs.get("past_key_values") is not None:
                raise TypeError("generate() got a cache twice, as cache= and as past_key_values=; pass it once")
            kwargs["past_key_values"] = kwargs.pop("cache")
        return generate(self, *args, **kwargs)

    return taking_cache


if GENERATE_CACHE_KWARG != "cache":
    install(_generation.GenerationMixin, "generate", _taking_cache(_generation.GenerationMixin.generate))

_CROP_TAKES_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters
_ASKS_MAX_CACHE_SHAPE = not hasattr(CacheLayerMixin, "get_max_length")
_MASK_SIZES_OF_POSITIONS = "cache_position" in inspect.signature(CacheLayerMixin.get_mask_sizes).parameters

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


# whether generate hands a forward that starts past position 0 the images of its ids (transformers 5: it passes them,
# or their encoded features, to every first forward, is_first_iteration); transformers 4.x's vision-language models
# drop them from any forward whose cache_position does not start at 0, so there a call with images reuses nothing
# (docs/generate.md, "Images"). Delete when the oldest supported release is 5.0 or newer.
WARM_FORWARDS_TAKE_IMAGES = int(transformers.__version__.split(".")[0]) >= 5

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


# whether torch's CPU flash kernel reads grouped K/V heads (torch 2.9 on): the attention kernels (attention/kernels.py)
# call it straight where it does, and through cpu_flash_attention where the heads must be repeated first
CPU_KERNEL_READS_GROUPED_HEADS = _kernel_reads_grouped_heads()


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
    if group > 1 and not CPU_KERNEL_READS_GROUPED_HEADS:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, attn_mask=attn_mask, scale=scale
    )
    return out, lse


# the model's own 4-D mask builder that transformers 4.57's prepare_inputs_for_generation calls for a compileable
# cache, at the cache's fixed length
_FIXED_LENGTH_MASKS = "_prepare_4d_causal_attention_mask_with_cache_position"
_PREPARE_BUILDS_FIXED_LENGTH_MASKS = _FIXED_LENGTH_MASKS in inspect.getsource(
    _generation.GenerationMixin.prepare_inputs_for_generation
)


def compile_refusal(model: torch.nn.Module) -> str | None:
    """Why ``generate`` on the installed transformers cannot hand ``model`` a ``PagedPrefixCache``'s compiled steps,
    in one line, or ``None``. Does not mutate."""
    if not _PREPARE_BUILDS_FIXED_LENGTH_MASKS:
        return None
    base: Any = getattr(model, getattr(model, "base_model_prefix", ""), model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if getattr(base, _FIXED_LENGTH_MASKS, None) is None and getattr(decoder, _FIXED_LENGTH_MASKS, None) is None:
        return None
    return (
        f"transformers {transformers.__version__} builds this model's masks for a compileable cache as wide as a "
        "fixed cache length, which a PagedPrefixCache has not (newer releases build them from get_mask_sizes)"
    )


def flex_aux_request() -> Any:
    """torch's FlexAttention ``AuxRequest`` (``return_aux=AuxRequest(lse=True)`` asks for the log-sum-exp), or
    ``None`` where the installed torch lacks it (before 2.9). Does not mutate."""
    from torch.nn.attention import flex_attention as flex_module

    return getattr(flex_module, "AuxRequest", None)


def flex_refusal() -> str | None:
    """Why the installed torch cannot serve the ``"flex"`` backend (:func:`prefixkv.attention.flex_kernel.can_serve`),
    in one line, or ``None``. Does not mutate."""
    if flex_aux_request() is None:
        return (
            f"torch {torch.__version__} has no flex_attention AuxRequest (the log-sum-exp request of torch 2.9 and "
            "later): upgrade torch"
        )
    return None
