"""Every difference between the transformers and torch releases prefixkv supports, in this one module.

The rest of prefixkv is written against the newest transformers; this module checks the installed releases
against the supported range (one ImportError outside it, raised when prefixkv's public names first load) and
adapts what older releases name or call differently, found by looking at the installed transformers and torch, never by
comparing version numbers:

- ``generate`` takes the cache as ``cache=`` from transformers 5.24 (``past_key_values=`` is then deprecated),
  as ``past_key_values=`` before: :data:`GENERATE_CACHE_KWARG` is the spelling the installed release prefers.
- transformers 5.4-5.14 call ``crop`` with the length to keep (since 5.15, every caller passes the negative
  number of columns to drop), and 5.4-5.12 ask a cache layer for ``get_max_cache_shape`` where later releases
  ask for ``get_max_length``: :func:`adapt_cache` gives a cache class (and a layer class) both faces.
- transformers 5.4-5.13 start assisted and prompt-lookup decoding without calling the cache's
  ``activate_past_recording``, which is how a ``PagedPrefixCache`` learns that the first forward re-feeds the
  columns it holds (docs/correctness.md, rule 7): their ``_assisted_decoding`` is wrapped to call it first, as
  5.14 and later do themselves (:func:`_recording_past`).
- torch's CPU flash-attention kernel gives a group of query heads its shared K/V head from torch 2.9; the kernel
  of older releases reads K/V head ``h`` for query head ``h``, past the K/V heads of a grouped model, and returns
  numbers without an error. :func:`cpu_flash_attention` repeats the K/V heads for such a kernel, found by
  probing the installed one (:func:`_kernel_reads_grouped_heads`).

Older releases are refused: 5.0-5.3 give a
layer's ``get_mask_sizes`` the step's ``cache_position`` instead of its query length, and 5.0-5.2 slice every
step's inputs by ``cache_position`` instead of asking for ``next_sequence_length``, the protocol by which a cache
tells ``generate`` how many prompt columns it holds; 4.x differ in the cache-layer and mask interfaces as well.

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

# the supported releases: transformers [low, high), torch [low, high). torch 2.6 is the oldest release on which every
# supported transformers runs every family: transformers 5.24 requires it, and on 2.5 transformers 5.4 itself refuses
# masks built with or_mask_function (stock generate of Falcon fails there; everything else passed). The blocks path
# alone needs less: torch's CPU flash-attention kernel aten._scaled_dot_product_flash_attention_for_cpu, with
# attn_mask since torch 2.3 (pytorch#115913), which reads grouped K/V heads only since 2.9 (pytorch#157893; 2.6-2.8
# return wrong numbers for them, so cpu_flash_attention repeats the heads there). Tested: 2.6.0 with transformers
# 5.4.0 (CI's oldest job), 2.13.0 (CI's newest), 2.14.1 and 2.15.0 with transformers 5.24.0
TRANSFORMERS_RANGE = ((5, 4), (6, 0))
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

_CROP_TAKES_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters
_ASKS_MAX_CACHE_SHAPE = not hasattr(CacheLayerMixin, "get_max_length")

_C = TypeVar("_C", bound=type)


def adapt_cache(cls: _C) -> _C:
    """Give a cache or cache-layer class written for the newest transformers the methods the installed one calls
    (a class decorator): ``crop`` that also takes a length to keep, and ``get_max_cache_shape`` for its
    ``get_max_length``. On the newest transformers it is returned unchanged. Mutates ``cls``."""
    own = vars(cls)
    if _CROP_TAKES_LENGTH and "crop" in own:
        setattr(cls, "crop", functools.wraps(own["crop"])(_crop_to_length(own["crop"])))  # noqa: B010
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


def _recording_past(assisted_decoding: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin._assisted_decoding`` that first calls ``activate_past_recording`` of a cache that has
    one, as transformers does itself from 5.14 (stock caches of older releases have none, so they run as
    before)."""

    @functools.wraps(assisted_decoding)
    def assisted(self: Any, *args: Any, **model_kwargs: Any) -> Any:
        record = getattr(model_kwargs.get("past_key_values"), "activate_past_recording", None)
        if record is not None:
            record()
        return assisted_decoding(self, *args, **model_kwargs)

    return assisted


_mixin = _generation.GenerationMixin
if "activate_past_recording" not in inspect.getsource(_mixin._assisted_decoding):
    _mixin._assisted_decoding = _recording_past(_mixin._assisted_decoding)  # type: ignore[method-assign]


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
