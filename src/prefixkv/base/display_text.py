"""What the views of a store and a cache read and show as text: the records (:class:`CachedPrefix`,
:class:`RowTable`), what they read of a store and a cache (:class:`StoreLike`, :class:`CacheLike`), the most
shared prefixes, the trie as a tree and each row's block table. :mod:`prefixkv.display`, the module a user calls,
renders them as HTML too.

Everything here only reads, from public snapshots (:meth:`Ledger.prefix_view` of ``store.blocks.ledger``,
:meth:`PagedPrefixCache.block_tables`) and counters; it mutates nothing and imports neither the store nor the
cache, which sit above it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .stats import CacheStats, StoreStats
from .tokens import token_ids


@dataclass(frozen=True)
class CachedPrefix:
    """One cached prefix as the display ranks it: its tokens from position 0, how many cached
    sequences continue it (leaves below), and whether anything holds it from eviction."""

    tokens: tuple[int, ...]
    continuations: int
    pinned: bool
    in_use: bool


class NodeLike(Protocol):
    """What the views read of one node of the trie's snapshot (:class:`prefixkv.kv.nodes.NodeView`)."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def blocks(self) -> tuple[int, ...]: ...

    @property
    def lock(self) -> int: ...

    @property
    def parent(self) -> int: ...

    @property
    def space(self) -> Hashable: ...

    @property
    def pinned(self) -> bool: ...


class PrefixesLike(Protocol):
    """What the views read of a store's block manager's books (``store.blocks.ledger``): the snapshot of its trie."""

    def prefix_view(self) -> Sequence[NodeLike]: ...


class BlocksLike(Protocol):
    """What the views read of a store's block manager (``store.blocks``): its books."""

    @property
    def ledger(self) -> PrefixesLike: ...


class StoreLike(Protocol):
    """What the views read of a :class:`prefixkv.PrefixStore`: public attributes and snapshots."""

    max_blocks: int | None
    bytes_per_block: int

    @property
    def block_size(self) -> int: ...

    @property
    def kv_dtype(self) -> str | None: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def stats(self) -> StoreStats: ...

    @property
    def closed(self) -> bool: ...

    @property
    def blocks(self) -> BlocksLike: ...


def top_prefixes(store: StoreLike, n: int = 5) -> list[CachedPrefix]:
    """The ``n`` most shared cached prefixes: branch points and leaves of the trie, by the number of
    cached sequences that continue them, then by length. Does not mutate."""
    nodes = store.blocks.ledger.prefix_view()
    children = _children(nodes)
    leaves = _leaf_counts(nodes, children)
    ranked = [(leaves[i], nodes[i].end, i) for i in leaves if len(children[i]) != 1]
    ranked.sort(key=lambda t: (t[0], t[1]), reverse=True)
    return [
        CachedPrefix(tuple(_path_tokens(nodes, i)), count, nodes[i].pinned, nodes[i].lock > 0)
        for count, _, i in ranked[:n]
    ]


def trie_text(store: StoreLike, tokenizer: Any = None, max_nodes: int = 40) -> str:
    """The trie as an indented tree, one line per node: its token span, the blocks holding it, whether it is
    pinned, in use or evictable, and its first tokens (decoded when a tokenizer is given). The default namespace
    comes first, under ``root``; every other one that holds prefixes (a user's ``namespace=``, an adapter, weights
    changed since the store was built) follows under a root line that names it. Does not mutate."""
    nodes = store.blocks.ledger.prefix_view()
    children = _children(nodes)
    spaces = list(dict.fromkeys([None, *(n.space for n in nodes if n.parent < 0)]))
    lines: list[str] = []
    shown = 0
    for space in spaces:
        lines.append("root" if space is None else f"root of namespace {space!r}")
        for i, prefix, last in _walk(nodes, children, space):
            if shown == max_nodes:
                lines.append(f"… {len(nodes) - shown} more nodes")
                return "\n".join(lines)
            shown += 1
            node = nodes[i]
            state = "pinned" if node.pinned else ("in use" if node.lock else "evictable")  # the HTML view's words
            lines.append(
                f"{prefix}{'└── ' if last else '├── '}{len(node.tokens)} tokens [{node.start}, {node.end})  "
                f'blocks {_block_ranges(node.blocks)}  {state}  "{label(node.tokens, tokenizer, 40)}"'
            )
    return "\n".join(lines)


@dataclass(frozen=True)
class RowTable:
    """One row of a cache: its leading padding columns, its block table, and for each block whether
    something else holds it too (the trie, another row, another cache)."""

    pad: int
    blocks: tuple[int, ...]
    shared: tuple[bool, ...]


class CacheLike(Protocol):
    """What the views read of a :class:`prefixkv.PagedPrefixCache`."""

    @property
    def stats(self) -> CacheStats: ...

    @property
    def closed(self) -> bool: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    def block_tables(self) -> list[RowTable]: ...


def block_tables(cache: CacheLike) -> list[RowTable]:
    """The block table of each row of ``cache`` (empty once closed). Does not mutate."""
    return cache.block_tables()


def block_tables_text(cache: CacheLike) -> str:
    """:func:`block_tables` as text, ``*`` on shared blocks. Does not mutate."""
    rows = block_tables(cache)
    if not rows:
        return "no rows (closed, or not started)"
    return "\n".join(
        f"row {i}: pad {r.pad}, blocks {' '.join(f'{b}*' if s else str(b) for b, s in zip(r.blocks, r.shared)) or '-'}"
        for i, r in enumerate(rows)
    )


# -- helpers -------------------------------------------------------------------------------------


def _children(nodes: Sequence[NodeLike]) -> list[list[int]]:
    """The indices of each node's children in the view."""
    children: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        if node.parent >= 0:
            children[node.parent].append(i)
    return children


def _path_tokens(nodes: Sequence[NodeLike], i: int) -> list[int]:
    """The tokens from position 0 to the end of node ``i``'s edge."""
    parts = []
    while i >= 0:
        parts.append(nodes[i].tokens)
        i = nodes[i].parent
    return [t for part in reversed(parts) for t in part]


def _walk(nodes: Sequence[NodeLike], children: list[list[int]], space: Any) -> Iterator[tuple[int, str, bool]]:
    """Depth-first over namespace ``space``, children in token order: (node index, indentation, is last
    child). Iterative: a long chat is a chain of many nodes."""
    top = [i for i, n in enumerate(nodes) if n.parent < 0 and n.space == space]
    stack = _below(nodes, top, "")
    while stack:
        i, prefix, last = stack.pop()
        yield i, prefix, last
        stack.extend(_below(nodes, children[i], prefix + ("    " if last else "│   ")))


def _below(nodes: Sequence[NodeLike], kids: list[int], prefix: str) -> list[tuple[int, str, bool]]:
    """The children ``kids`` as stack entries, the one of the lowest first token on top."""
    ordered = sorted(kids, key=lambda i: nodes[i].tokens[0])
    return [(k, prefix, j == len(ordered) - 1) for j, k in reversed(list(enumerate(ordered)))]


def _leaf_counts(nodes: Sequence[NodeLike], children: list[list[int]]) -> dict[int, int]:
    """Cached sequences (leaves) at or below each node; ``nodes`` lists parents before children."""
    counts: dict[int, int] = {}
    for i in reversed(range(len(nodes))):
        counts[i] = sum(counts[c] for c in children[i]) if children[i] else 1
    return counts


def _block_ranges(blocks: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out: list[str] = []
    i = 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
            j += 1
        out.append(str(blocks[i]) if i == j else f"{blocks[i]}-{blocks[j]}")
        i = j + 1
    return ", ".join(out)


def label(tokens: Sequence[int], tokenizer: Any, chars: int) -> str:
    """The tokens as text (with a tokenizer) or as ids, on one line, at most ``chars`` long: the
    start and the end, which is where prefixes that share a start differ."""
    if tokenizer is None:  # whole ids only: as many from each end as fit
        words = [str(t) for t in tokens]
        if len(" ".join(words)) <= chars:
            return " ".join(words)
        head: list[str] = []
        tail: list[str] = []
        budget = chars - 2
        for word in words:
            if len(word) + 1 > budget // 3 - sum(len(w) + 1 for w in head):
                break
            head.append(word)
        for word in reversed(words[len(head) :]):
            if len(word) + 1 > budget - sum(len(w) + 1 for w in head + tail):
                break
            tail.insert(0, word)
        return " ".join([*head, "…", *tail])
    text = str(tokenizer.decode(token_ids(tokens))).replace("\n", "⏎")
    if len(text) <= chars:
        return text
    cut = chars // 3
    return text[:cut].rstrip() + " … " + text[len(text) - (chars - cut - 3) :].lstrip()
