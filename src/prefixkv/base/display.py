"""The views of :mod:`prefixkv.display`, on the ground floor so that the store and the cache can render
themselves through them: the HTML is rendered here, the records and text views are :mod:`.display_text`'s.
Everything here only reads, from public snapshots and counters, and mutates nothing."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .display_text import (
    BlocksLike,
    CachedPrefix,
    CacheLike,
    NodeLike,
    PrefixesLike,
    RowTable,
    StoreLike,
    block_tables,
    block_tables_text,
    label,
    top_prefixes,
    trie_text,
)
from .memory import format_bytes
from .tokens import token_ids

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

# in use (live caches or pins), evictable, free; reused, computed
_COLORS = {"used": "#4c78a8", "evictable": "#f2a93b", "free": "#d9d9d9", "reused": "#54a24b", "computed": "#e45756"}
_LABEL_CHARS = 72


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


def _state(p: CachedPrefix) -> str:
    if p.pinned:
        return "pinned"
    return "in use" if p.in_use else "evictable"


def _prefix_html(tokens: Sequence[int], tokenizer: Any, chars: int) -> str:
    """A cached prefix in a table cell: as ids without a tokenizer, else as text, each token a span whose
    ``title`` (shown on hover) is its id; a long prefix shows its start and its end, as :func:`label`."""
    if tokenizer is None:
        return f"<code>{html.escape(label(tokens, None, chars))}</code>"
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
    ids = token_ids(tokens)
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
