"""prefixkv: automatic prefix caching and a paged KV cache for Hugging Face ``generate``."""

from __future__ import annotations

from . import models
from .cache import CacheStats, PagedPrefixCache, RowStats
from .errors import CacheMisuseError, CapacityError, PrefixKVError, UnsupportedModelError
from .memory import estimate, kv_bytes_per_token
from .store import PrefixStore, StoreStats

__version__ = "0.1.0"

__all__ = [
    "CacheMisuseError",
    "CacheStats",
    "CapacityError",
    "PagedPrefixCache",
    "PrefixKVError",
    "PrefixStore",
    "RowStats",
    "StoreStats",
    "UnsupportedModelError",
    "__version__",
    "estimate",
    "kv_bytes_per_token",
    "models",
]
