"""The store and its composition: :class:`PrefixStore` (``prefix_store``), its options checked into the settings
record (``options``), its files (``files``) and a split model's processes (``parallel``)."""

from .prefix_store import PrefixStore

__all__ = ["PrefixStore"]
