"""prefixkv: automatic prefix caching and a paged KV cache for Hugging Face ``generate``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

__version__ = "0.1.0"

__all__ = [
    "CacheMisuseError",
    "CacheStats",
    "CapacityError",
    "Generation",
    "ModelCodeError",
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
    "generate_many",
    "kv_bytes_per_token",
    "models",
    "score",
]


def __getattr__(name: str) -> Any:
    """The public names load on first use, all at once (``prefixkv._api``: torch, transformers, and the check
    that their releases are supported), so that ``python -m prefixkv --help`` answers without importing torch."""
    # the FlexAttention backend's module, `prefixkv.attention.flex`, by the name the docs give users
    if name == "flex":
        import prefixkv.attention.flex as flex

        return flex
    if name not in __all__:
        raise AttributeError(f"module 'prefixkv' has no attribute {name!r}")
    # `from . import display` inside prefixkv asks here too: load only that module
    if name == "display":
        import prefixkv.display as display

        return display
    if name == "models":
        import prefixkv.models as models

        return models
    from . import _api

    exported = {n: getattr(_api, n) for n in __all__ if n != "__version__"}
    globals().update(exported)
    return exported[name]
