"""What a store and a cache look like in Jupyter (``_repr_html_``) and as text: block usage as a bar,
hit rate, memory, the most shared cached prefixes, the trie as a tree and each row's block table.

Everything here only reads, from public snapshots (:meth:`BlockManager.prefix_view` of ``store.blocks``,
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

import html
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .memory import format_bytes
from .stats import CacheStats, StoreStats

# in use (live caches or pins), evictable, free; reused, computed
_COLORS = {"used": "#4c78a8", "evictable": "#f2a93b", "free": "#d9d9d9", "reused": "#54a24b", "computed": "#e45756"}
_LABEL_CHARS = 72


@dataclass(frozen=True)
class CachedPrefix:
    """One cached prefix as the display ranks it: its tokens from position 0, how many cached
    sequences continue it (leaves below), and whether anything holds it from eviction."""

    tokens: tuple[int, ...]
    continuations: int
    pinned: bool
    in_use: bool


class NodeLike(Protocol):
    """What the views read of one node of the trie's snapshot (:class:`prefixkv.kv.trie.NodeView`)."""

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
    """What the views read of a store's block manager (``store.blocks``): the snapshot of its trie."""

    def prefix_view(self) -> Sequence[NodeLike]: ...


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
    def blocks(self) -> PrefixesLike: ...


def top_prefixes(store: StoreLike, n: int = 5) -> list[CachedPrefix]:
    """The ``n`` most shared cached prefixes: branch points and leaves of the trie, by the number of
    cached sequences that continue them, then by length. Does not mutate."""
    nodes = store.blocks.prefix_view()
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
    nodes = store.blocks.prefix_view()
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
                f'blocks {_block_ranges(node.blocks)}  {state}  "{_label(node.tokens, tokenizer, 40)}"'
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


def store_html(store: StoreLike, tokenizer: Any = None, top: int = 5) -> str:
    """The HTML a notebook shows for a :class:`~prefixkv.PrefixStore`. Does not mutate."""
    s = store.stats
    in_use = s.blocks_used - s.blocks_evictable
    bounded = store.max_blocks is not None
    budget = (
        f"budget {store.max_blocks} blocks ({format_bytes(store.max_blocks * store.bytes_per_block)})"
        if store.max_blocks is not None
        else "no budget (the pool grows on demand)"
    )
    bar = _bar(
        [
            ("used", in_use, f"in use {in_use} (live requests or pinned)"),
            ("evictable", s.blocks_evictable, f"evictable {s.blocks_evictable}"),
            ("free", s.blocks_free, f"free {s.blocks_free}" + ("" if bounded else " (allocated so far)")),
        ]
    )
    per_token = store.bytes_per_block / store.block_size
    facts = [
        ("hit rate", f"{s.hit_rate:.0%} ({s.hit_tokens} of {s.prompt_tokens} prompt tokens reused)"),
        ("lookups", f"{s.queries} prompts, {s.misses} with nothing reused"),
        ("memory", f"{format_bytes(s.bytes_used)} in {s.blocks_used} blocks; {budget}"),
        (
            "block",
            f"{store.block_size} tokens, {format_bytes(store.bytes_per_block)} ({format_bytes(per_token)}/token)",
        ),
        ("cached", f"{s.cached_tokens} tokens in {s.nodes} trie nodes, {s.blocks_pinned} blocks pinned"),
        ("evictions", str(s.evictions)),
    ]
    if store.kv_dtype is not None:
        facts.insert(
            4, ("storage", f"{store.kv_dtype} with a bfloat16 scale per token and KV head, read as {store.dtype}")
        )
    if s.offload is not None:
        o = s.offload
        limit = "unbounded" if o.max_bytes is None else f"budget {format_bytes(o.max_bytes)}"
        facts.append(
            (
                f"{o.kind} tier",
                f"{o.blocks} blocks, {format_bytes(o.bytes)} ({limit}); {o.offloaded} moved in, {o.restored} brought "
                f"back ({o.hit_tokens} prompt tokens), {o.evictions} dropped",
            )
        )
    prefixes = top_prefixes(store, top)
    rows = "".join(
        f"<tr><td>{i + 1}</td><td style='text-align:right'>{len(p.tokens)}</td>"
        f"<td style='text-align:right;padding-right:1em'>{p.continuations}</td><td>{_state(p)}</td>"
        f"<td>{_prefix_html(p.tokens, tokenizer, _LABEL_CHARS)}</td></tr>"
        for i, p in enumerate(prefixes)
    )
    table = (
        f"<table><tr><th>#</th><th>tokens</th><th>continued by</th><th>state</th><th>prefix</th></tr>{rows}</table>"
        if prefixes
        else "<p><i>nothing cached yet</i></p>"
    )
    return _frame(
        f"PrefixStore · block_size {store.block_size}" + (" · closed" if store.closed else ""),
        bar + _facts(facts) + "<b>most shared cached prefixes</b>" + table,
    )


@dataclass(frozen=True)
class StoreView:
    """What :meth:`PrefixStore.show <prefixkv.PrefixStore.show>` returns: the store as a notebook shows it,
    with each cached prefix as text when there is a tokenizer (hover over a token for its id), and as the
    trie in text when printed. It renders the store as it is when displayed, not when made."""

    store: StoreLike
    tokenizer: Any = None
    top: int = 5

    def _repr_html_(self) -> str:
        return store_html(self.store, self.tokenizer, self.top)

    def __repr__(self) -> str:
        return trie_text(self.store, self.tokenizer)


def _held(rows: int, columns: int, stats: Any) -> str:
    """What a cache holds now: before ``generate`` runs, only the reused prefix of its prompt columns."""
    prompt = max((r.prompt_tokens for r in stats.per_row), default=0)
    held = f"{rows} row{'' if rows == 1 else 's'} × {columns} columns held"
    return held + (
        f" (the reused prefix of {prompt} prompt tokens; generate computes the rest)" if columns < prompt else ""
    )


def cache_html(cache: CacheLike, max_rows: int = 8, max_blocks: int = 24) -> str:
    """The HTML a notebook shows for a :class:`~prefixkv.PagedPrefixCache`: per row the reused and
    computed prompt tokens as a bar, and its block table (blocks shared with others in bold).
    Does not mutate."""
    s = cache.stats
    tables = block_tables(cache)
    state = "closed" if cache.closed else _held(len(tables), cache.get_seq_length(), s)
    n = len(tables) or len(s.per_row)
    body = ""
    for i in range(min(n, max_rows)):
        # num_return_sequences and beams repeat each prompt row in place: row i comes from prompt row i // r
        st = s.per_row[i * len(s.per_row) // n] if s.per_row else None
        prompt, reused = (st.prompt_tokens, st.cached_tokens) if st is not None else (0, 0)
        bar = _bar(
            [("reused", reused, f"reused {reused}"), ("computed", prompt - reused, f"computed {prompt - reused}")],
            legend=False,
        )
        row = tables[i] if i < len(tables) else RowTable(0, (), ())
        listed = ", ".join(f"<b>{b}</b>" if sh else str(b) for b, sh in zip(row.blocks[:max_blocks], row.shared))
        if len(row.blocks) > max_blocks:
            listed += f", … ({len(row.blocks)} blocks)"
        body += (
            f"<tr><td>{i}</td><td style='text-align:right'>{row.pad}</td>"
            f"<td style='text-align:right'>{prompt}</td><td style='text-align:right'>{reused}</td>"
            f"<td style='min-width:160px'>{bar}</td><td><code>{listed or '-'}</code></td></tr>"
        )
    more = f"<p>… {n - max_rows} more rows</p>" if n > max_rows else ""
    table = (
        "<table><tr><th>row</th><th>pad</th><th>prompt</th><th>reused</th><th>prompt tokens</th>"
        f"<th>block table (<b>bold</b>: shared)</th></tr>{body}</table>{more}"
        if n
        else "<p><i>no rows: closed, or built without input_ids and not used yet</i></p>"
    )
    total = _facts(
        [
            ("reused", f"{s.cached_tokens} of {s.prompt_tokens} prompt tokens"),
            ("computed", f"{s.computed_tokens} prompt tokens"),
        ]
    )
    return _frame(f"PagedPrefixCache · {state}", total + table)


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


def _state(p: CachedPrefix) -> str:
    if p.pinned:
        return "pinned"
    return "in use" if p.in_use else "evictable"


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


def _label(tokens: Sequence[int], tokenizer: Any, chars: int) -> str:
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
    text = str(tokenizer.decode(_token_ids(tokens))).replace("\n", "⏎")
    if len(text) <= chars:
        return text
    cut = chars // 3
    return text[:cut].rstrip() + " … " + text[len(text) - (chars - cut - 3) :].lstrip()


def _token_ids(keys: Sequence[int]) -> list[int]:
    """The token ids of trie keys: a token that an attention mask hid is keyed ``-1 - id`` (its K/V differ from
    the shown token's), and its text is still that token's."""
    return [k if k >= 0 else -1 - k for k in keys]


def _prefix_html(tokens: Sequence[int], tokenizer: Any, chars: int) -> str:
    """A cached prefix in a table cell: as ids without a tokenizer, else as text, each token a span whose
    ``title`` (shown on hover) is its id; a long prefix shows its start and its end, as :func:`_label`."""
    if tokenizer is None:
        return f"<code>{html.escape(_label(tokens, None, chars))}</code>"
    n = len(tokens)
    first = _pieces(tokens, tokenizer, 0, min(n, chars))
    if n <= chars and sum(len(p) for p in first) <= chars:
        return _spans(tokens, first)
    head = _fitting(first, chars // 3)
    start = max(len(head), n - chars)
    tail = _fitting(_pieces(tokens, tokenizer, start, n)[::-1], chars - chars // 3 - 3)[::-1]
    hidden = n - len(head) - len(tail)
    return (
        _spans(tokens[: len(head)], head)
        + f"<span title='{hidden} tokens not shown'> … </span>"
        + _spans(tokens[n - len(tail) :], tail)
    )


def _pieces(tokens: Sequence[int], tokenizer: Any, start: int, stop: int) -> list[str]:
    """The text that each of ``tokens[start:stop]`` adds to the tokens before it. A token decoded alone
    loses the space in front of it in most tokenizers, so each piece is the growth of a decode that starts
    a few tokens earlier."""
    context = max(0, start - 4)
    ids = _token_ids(tokens)
    before = str(tokenizer.decode(ids[context:start])) if start > context else ""
    pieces = []
    for k in range(start, stop):
        text = str(tokenizer.decode(ids[context : k + 1]))
        pieces.append(text[len(before) :] if text.startswith(before) else str(tokenizer.decode([ids[k]])))
        before = text
    return pieces


def _fitting(pieces: list[str], chars: int) -> list[str]:
    """The leading pieces whose text fits in ``chars`` (at least one)."""
    taken: list[str] = []
    used = 0
    for piece in pieces:
        if taken and used + len(piece) > chars:
            break
        taken.append(piece)
        used += len(piece)
    return taken


def _spans(tokens: Sequence[int], pieces: Sequence[str]) -> str:
    return "".join(
        f"<span title='id {t}'>{html.escape(p.replace(chr(10), '⏎'))}</span>" for t, p in zip(tokens, pieces)
    )


def _bar(parts: list[tuple[str, int, str]], legend: bool = True) -> str:
    total = sum(n for _, n, _ in parts) or 1
    segments = "".join(
        f"<div title='{html.escape(label)}' style='width:{100 * n / total:.2f}%;background:{_COLORS[key]}'></div>"
        for key, n, label in parts
        if n
    )
    bar = f"<div style='display:flex;height:14px;border:1px solid #999;margin:4px 0'>{segments}</div>"
    if not legend:
        return bar
    keys = " &nbsp; ".join(
        f"<span style='color:{_COLORS[key]}'>■</span> {html.escape(label)}" for key, _, label in parts
    )
    return bar + f"<div style='font-size:90%'>{keys}</div>"


def _facts(facts: list[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><td><b>{html.escape(k)}</b></td><td>{html.escape(v)}</td></tr>" for k, v in facts)
    return f"<table>{rows}</table>"


def _frame(title: str, body: str) -> str:
    page = (
        "<div class='prefixkv' style='font-family:system-ui,sans-serif;font-size:13px;max-width:760px'>"
        f"<div style='font-weight:bold;margin-bottom:4px'>{html.escape(title)}</div>{body}</div>"
    )
    # character references for everything past ASCII (·, ×, …, decoded text): right in any encoding
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")
