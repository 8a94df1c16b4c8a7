"""The public names of prefixkv (``prefixkv.__all__``), imported together the first time ``prefixkv.NAME`` is
asked for: ``prefixkv/__init__.py`` re-exports each of them."""

# ruff: noqa: F401

from __future__ import annotations

# the release check first: it refuses an unsupported transformers or torch before anything else imports them
from .compat import releases  # isort: split

from . import display, models
from .base.errors import (
    CacheMisuseError,
    CapacityError,
    ModelCodeError,
    PersistError,
    PrefixKVError,
    UnsupportedModelError,
)
from .base.memory import estimate, kv_bytes_per_token
from .base.stats import CacheStats, RowStats, StoreStats, TierStats
from .enabling import disable, enable
from .hf.cache import PagedPrefixCache
from .kv.prefix_file import PersistStats
from .many.generation import Generation, generate_many
from .score import Score, score
from .store.prefix_store import PrefixStore
