"""prefixkv: automatic prefix caching and a paged KV cache for Hugging Face ``generate``."""

from __future__ import annotations

# _compat first: it refuses an unsupported transformers or torch before anything else imports them
from . import _compat, display, models  # noqa: F401
from .cache import PagedPrefixCache
from .errors import CacheMisuseError, CapacityError, PersistError, PrefixKVError, UnsupportedModelError
from .memory import estimate, kv_bytes_per_token
from .patch import disable, enable
from .persist import PersistStats
from .score import Score, score
from .stats import CacheStats, RowStats, StoreStats
from .store import PrefixStore
from .tier import TierStats

__version__ = "0.1.0"

__all__ = [
    "CacheMisuseError",
    "CacheStats",
    "CapacityError",
    "PagedPrefixCache",
    "PersistError",
    "PersistStats",
    "PrefixKVError",
    "PrefixStore",
    "RowStats",
    "Score",
    "StoreStats",
    "TierStats",
    "UnsupportedModelError",
    "__version__",
    "disable",
    "display",
    "enable",
    "estimate",
    "kv_bytes_per_token",
    "models",
    "score",
]
