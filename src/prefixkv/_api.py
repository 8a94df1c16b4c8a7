"""The public names of prefixkv (``prefixkv.__all__``), imported together the first time ``prefixkv.NAME`` is
asked for: ``prefixkv/__init__.py`` re-exports each of them."""

# ruff: noqa: F401

from __future__ import annotations

# _compat first: it refuses an unsupported transformers or torch before anything else imports them
from . import _compat, display, models
from .enabling import disable, enable
from .errors import CacheMisuseError, CapacityError, ModelCodeError, PersistError, PrefixKVError, UnsupportedModelError
from .hf.cache import PagedPrefixCache
from .kv.prefix_file import PersistStats
from .many import Generation, generate_many
from .memory import estimate, kv_bytes_per_token
from .score import Score, score
from .stats import CacheStats, RowStats, StoreStats, TierStats
from .store import PrefixStore
