"""Every difference between the transformers and torch releases prefixkv supports, in this one module.

The rest of prefixkv is written against the newest transformers; this module checks the installed releases
against the supported range (one ImportError outside it, raised when prefixkv's public names first load) and
adapts what older releases name or call differently, found by looking at the installed transformers, never by
comparing version numbers:

- ``generate`` takes the cache as ``cache=`` from transformers 5.24 (``past_key_values=`` is then deprecated),
  as ``past_key_values=`` before: :data:`GENERATE_CACHE_KWARG` is the spelling the installed release prefers.
- transformers 5.14 calls ``crop`` of an assistant model's cache with the length to keep (since 5.15, every
  caller passes the negative number of columns to drop): :func:`adapt_cache` gives the cache both faces.

Older releases are refused. transformers 5.3-5.13 differ in three more places that a shim would cover (``crop``
with a length everywhere, ``get_max_cache_shape`` for ``get_max_length``, ``get_mask_sizes`` given
``cache_position`` before 5.4), but their assisted and prompt-lookup decoding re-feeds the prompt without calling
``activate_past_recording``, which is how a ``PagedPrefixCache`` learns that a forward repeats columns it holds;
5.0-5.2 slice every step's inputs by ``cache_position`` instead of asking for ``next_sequence_length``, the
protocol by which a cache tells ``generate`` how many prompt columns it holds; 4.x differ in the cache-layer and
mask interfaces as well.

docs/getting-started.md lists the supported range; README.md says which releases CI tests.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import transformers

# the supported releases: transformers [low, high), torch [low, high). torch 2.6 is the oldest release the newest
# transformers runs on (5.14-5.23 accept 2.4). The blocks path calls torch's CPU flash-attention kernel for its
# log-sum-exp, with a mask and with fewer K/V heads than query heads; that older releases' kernel takes both is not
# verified (only torch 2.13 and 2.14 were tried), so they are refused rather than risked
TRANSFORMERS_RANGE = ((5, 14), (6, 0))
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
from transformers.cache_utils import DynamicLayer  # noqa: E402
from transformers.generation import utils as _generation  # noqa: E402

GENERATE_CACHE_KWARG = "cache" if "cache" in _generation.ALL_CACHE_NAMES else "past_key_values"
"""The keyword by which the installed transformers' ``generate`` prefers to take a cache."""

_CROP_TAKES_LENGTH = "max_length" in inspect.signature(DynamicLayer.crop).parameters

_C = TypeVar("_C", bound=type)


def adapt_cache(cls: _C) -> _C:
    """Give a cache class written for the newest transformers the methods the installed one calls (a class
    decorator); on the newest transformers it is returned unchanged. Mutates ``cls``."""
    if _CROP_TAKES_LENGTH:
        own = vars(cls)["crop"]
        setattr(cls, "crop", functools.wraps(own)(_crop_to_length(own)))  # noqa: B010
    return cls


def _crop_to_length(own: Callable[..., Any]) -> Callable[..., Any]:
    """``crop`` as transformers 5.14 calls it: with the length to keep, or (negative) the number of columns
    to drop; a length past the end keeps everything."""

    def crop(self: Any, max_length: int) -> Any:
        return own(self, max_length if max_length < 0 else min(0, max_length - self.get_seq_length()))

    return crop
