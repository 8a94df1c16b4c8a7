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
