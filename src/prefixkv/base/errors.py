"""The exceptions prefixkv raises on purpose, so callers can catch them by kind."""

from __future__ import annotations


class PrefixKVError(Exception):
    """Base class of every prefixkv error."""


class CapacityError(PrefixKVError, RuntimeError):
    """The store's budget cannot hold what live requests need; the message gives the numbers."""


class UnsupportedModelError(PrefixKVError, ValueError):
    """The model's family cannot be cached exactly by prefixkv; the message names the reason."""


class CacheMisuseError(PrefixKVError, RuntimeError):
    """A ``PagedPrefixCache`` was used in a way that would give wrong output (another model, another
    prompt, two calls at once, after ``close()``)."""


class PersistError(PrefixKVError, ValueError):
    """A saved prefix file cannot be used: truncated, corrupted, from a newer prefixkv, or made with
    another model, dtype or block size. The store it was meant for is left unchanged."""


class ModelCodeError(PrefixKVError, RuntimeError):
    """The model's own code raised, with no prefixkv code under it, what any forward of the model raises, stock
    ``generate``'s included: a kernel of its family that refuses the model's dtype. The message names the kernel and
    the dtype to build the model in; the model's exception is the ``__cause__``, its traceback the model's frames."""


def refuses_float64(error: BaseException) -> bool:
    """Whether ``error`` is a kernel's refusal of float64 (its message names the dtype): the census then checks the
    family in float32 (docs/architectures.md, "The census"). Does not mutate."""
    text = str(error)
    return any(w in text for w in ("Double", "double", "float64"))
