"""Cached prefixes in and out of a store: what a save takes out of its trie and pool (:meth:`Archive.export`,
of the nodes :func:`select_nodes` picks) and what a read file adds to them (:meth:`Archive.merge`, of the paths
:func:`missing_paths` finds), and the metadata that ties a file's K/V to the store that computed them
(:func:`store_meta`). The file itself (its format, writing, reading and checks) is :mod:`prefixkv.kv.prefix_file`'s.

Merging inserts each saved leaf's whole path into the trie with its block table: positions the store
already holds keep their blocks, and only the blocks of new positions are copied in.

A :class:`~prefixkv.kv.manager.BlockManager` builds its :class:`Archive` (``store.blocks.archive``) over its
holdings and its room; the store's ``save``, ``load`` and ``merge`` call it through :mod:`prefixkv.store.files`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from ..base.errors import CapacityError
from ..base.family import family
from ..base.memory import format_bytes
from ..base.settings import StoreSettings
from .holdings import Holdings
from .pool import LayerSpec
from .prefix_file import (
    FORMAT,
    FORMAT_VERSION,
    PersistStats,
    PrefixFile,
    Saved,
    blocks_of,
    shapes_meta,
    trie_tensors,
)
from .room import Room
from .trie import Node, RadixTrie


def store_meta(
    settings: StoreSettings, specs: list[LayerSpec], model: Any, model_print: str, format: str = FORMAT
) -> dict[str, str]:
    """The metadata that ties K/V to the store that computed them (format, shapes, dtypes, quantization,
    model fingerprint): its ``settings``, the ``specs`` of its pool's layers and its ``model``, without the
    checksum. Does not mutate."""
    meta = {
        "format": format,
        "format_version": str(FORMAT_VERSION),
        "block_size": str(settings.block_size),
        "dtype": _dtype_name(settings.dtype),
        "model_dtype": _dtype_name(settings.model_dtype),
        "num_layers": str(len(specs)),
        **shapes_meta(specs),
        "model_type": family(model),
        "model_fingerprint": model_print,
    }
    if settings.kv_dtype is not None:  # absent in unquantized files, as in those written before quantization
        meta["kv_dtype"] = settings.kv_dtype
    return meta


class Export(NamedTuple):
    """Result of :meth:`Archive.export`: what :func:`prefixkv.kv.prefix_file.write` writes."""

    nodes: list[Saved]
    tensors: dict[str, torch.Tensor]
    blocks: list[int]


class Archive:
    """A store's prefixes as a file holds them: exported for a save, merged in from a read file. Every method
    runs under the holdings' lock (it takes it itself)."""

    def __init__(self, held: Holdings, room: Room) -> None:
        self._holdings = held
        self._room = room

    def export(self, wanted: list[list[int]] | None, space: Hashable) -> Export:
        """What a saved file holds (:func:`prefixkv.kv.prefix_file.write`): the nodes of the cached prefixes in key
        space ``space`` (all, or the cached part of each of ``wanted``), their tensors (the paths' and the
        blocks') and the blocks. Does not mutate."""
        h = self._holdings
        with h.lock:
            nodes = select_nodes(h.trie, wanted, space)
            tensors, blocks = trie_tensors(nodes, h.block_size)
            tensors.update(h.pool.read_blocks(blocks))
            return Export(nodes, tensors, blocks)

    def merge(self, file: PrefixFile, space: Hashable) -> PersistStats:
        """Insert the file's paths in key space ``space``; copy in only the blocks of positions the store lacks.
        Mutates, or raises :class:`CapacityError` before any change when the budget cannot make room."""
        h = self._holdings
        bs, trie, alloc = h.block_size, h.trie, h.allocator
        with h.lock:
            missing, anchors = missing_paths(trie, file.paths, space)
            needed = list(dict.fromkeys(p.table[c] for p in missing for c in range(p.present // bs, len(p.table))))
            for node in anchors:
                trie.lock(node)  # what the count of present tokens relies on must survive the evictions for room
            try:
                self._check_room(len(needed))
                self._room.ensure_free(len(needed))
                fresh = alloc.allocate(len(needed))
                try:
                    h.pool.write_blocks(fresh, blocks_of(file, needed))
                    slot = dict(zip(needed, fresh))
                    for path in missing:
                        live = trie.match(path.tokens, space)
                        assert live.length == path.present, "the present tokens changed under the store lock"
                        cut = live.length // bs
                        h.insert(path.tokens, live.blocks[:cut] + [slot[b] for b in path.table[cut:]], space)
                finally:
                    alloc.decref(fresh)  # the merge's own hold: the trie holds what it inserted, nothing the rest
            finally:
                for node in anchors:
                    trie.unlock(node)
        return PersistStats(
            prefixes=len(missing),
            tokens=sum(len(p.tokens) - p.present for p in missing),
            blocks=len(needed),
        )

    def _check_room(self, needed: int) -> None:
        """Raise :class:`CapacityError` if ``needed`` more blocks exceed the free blocks, the growth left in the
        budget and the evictable ones (no budget: the pool grows as needed). Does not mutate."""
        h, alloc = self._holdings, self._holdings.allocator
        limit = h.max_blocks
        room = None if limit is None else alloc.num_free + (limit + 1 - alloc.capacity) + self._room.evictable()
        if room is not None and needed > room:
            raise CapacityError(
                f"prefixkv: the file needs {needed} new KV blocks ({format_bytes(needed * h.bytes_per_block)}) but "
                f"the store can make room for only {room} (budget {limit} blocks, {alloc.num_used} in use). Raise "
                "max_memory/num_blocks, close() live caches, unpin or clear() prefixes, or save fewer prefixes"
            )


def select_nodes(trie: RadixTrie, wanted: list[list[int]] | None, space: Hashable) -> list[Saved]:
    """The saved part of key space ``space`` of the trie, parents first: every node, or the paths of the cached
    part of each wanted prefix (a path may end inside an edge). Does not mutate."""
    keep: dict[int, int] = {}  # id(node) -> tokens of its edge kept
    order: list[Node] = []
    if wanted is None:
        order = trie.nodes(space)
        keep = {id(n): len(n.tokens) for n in order}
    else:
        for i, tokens in enumerate(wanted):
            m = trie.match(tokens, space)
            if m.length == 0:
                raise ValueError(
                    f"prefix {i} ({len(tokens)} tokens) is not cached in this store, so there is nothing to save "
                    "for it; generate with it first (pin it to keep it from eviction) or leave it out"
                )
            path: list[Node] = []
            n: Node | None = m.node
            while n is not None and n.parent is not None:
                path.append(n)
                n = n.parent
            for n in reversed(path):
                if id(n) not in keep:
                    order.append(n)
                    keep[id(n)] = 0
            for n in path[1:]:
                keep[id(n)] = len(n.tokens)
            keep[id(m.node)] = max(keep[id(m.node)], m.length - m.node.start)
    index = {id(n): i for i, n in enumerate(order)}
    bs = trie.block_size
    saved = []
    for n in order:
        k = keep[id(n)]
        chunks = (n.start + k - 1) // bs - n.start // bs + 1
        parent = -1 if n.parent is None or n.parent.parent is None else index[id(n.parent)]
        saved.append(Saved(n.tokens[:k], n.blocks[:chunks], parent, []))
    for i, s in enumerate(saved):
        if s.parent >= 0:
            saved[s.parent].children.append(i)
    return saved


class MissingPath(NamedTuple):
    """A saved path the store lacks in part: its tokens and block table in the file, and how many of its tokens
    the store will already hold when it is inserted."""

    tokens: list[int]
    table: list[int]
    present: int


def missing_paths(
    trie: RadixTrie, paths: list[tuple[list[int], list[int]]], space: Hashable
) -> tuple[list[MissingPath], list[Node]]:
    """The paths key space ``space`` of the trie lacks in part, each with how much of it the trie (with the paths
    before it) will hold; and the nodes the paths already match in the trie. Does not mutate ``trie``."""
    earlier = RadixTrie(trie.block_size)
    missing: list[MissingPath] = []
    anchors: list[Node] = []
    for tokens, table in paths:
        live = trie.match(tokens, space)
        if live.length:
            anchors.append(live.node)
        present = max(live.length, earlier.match(tokens).length)
        if present < len(tokens):
            missing.append(MissingPath(tokens, table, present))
            earlier.insert(tokens, table)
    return missing, anchors


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
