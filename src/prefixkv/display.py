"""What a store and a cache look like in Jupyter (``_repr_html_``) and as text: block usage as a bar,
hit rate, memory, the most shared cached prefixes, the trie as a tree and each row's block table. This is the
module a user calls; what it names lives on the ground floor (``prefixkv/base/display.py`` and
``display_text.py``), where the store and the cache render themselves through it.

Everything here only reads, from public snapshots (:meth:`Ledger.prefix_view` of ``store.blocks.ledger``,
:meth:`PagedPrefixCache.block_tables`) and counters; it mutates nothing and imports neither the store nor the
cache, which sit above it (they render themselves through it).
The HTML is self-contained (inline styles, no scripts), so it renders offline and in exported notebooks.

>>> import prefixkv, torch
>>> model = prefixkv.models.tiny_model("llama")
>>> store = prefixkv.PrefixStore(model, block_size=4)
>>> _ = store.warm([torch.arange(1, 10)], progress=False)
>>> print(prefixkv.display.trie_text(store))
root
└── 8 tokens [0, 8)  blocks 1-2  evictable  "1 2 3 4 5 6 7 8"
"""

from __future__ import annotations

from .base.display import (
    BlocksLike,
    CachedPrefix,
    CacheLike,
    NodeLike,
    PrefixesLike,
    RowTable,
    StoreLike,
    StoreView,
    block_tables,
    block_tables_text,
    cache_html,
    store_html,
    top_prefixes,
    trie_text,
)

__all__ = [
    "BlocksLike",
    "CacheLike",
    "CachedPrefix",
    "NodeLike",
    "PrefixesLike",
    "RowTable",
    "StoreLike",
    "StoreView",
    "block_tables",
    "block_tables_text",
    "cache_html",
    "store_html",
    "top_prefixes",
    "trie_text",
]
