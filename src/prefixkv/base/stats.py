"""The statistics records of a store and of a cache: plain frozen data, below every module that makes or
shows them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    """A snapshot of a tier: blocks and bytes held, blocks moved in (``offloaded``), brought back
    (``restored``) and dropped for its budget (``evictions``), and the prompt tokens whose K/V came
    back from it (``hit_tokens``)."""

    kind: str
    blocks: int
    bytes: int
    max_bytes: int | None
    offloaded: int
    restored: int
    hit_tokens: int
    evictions: int


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store. ``hit_rate`` is reused prompt tokens over all prompt tokens looked up;
    ``misses`` counts looked-up rows that reused nothing; ``evictions`` counts the cached prefixes (trie
    nodes) dropped to make room, least recently used first (not those dropped by :meth:`PrefixStore.clear`).
    With a second tier (``offload=``), ``offload`` holds its blocks, bytes and hits; the fields above
    count the pool alone, except ``hit_tokens`` (every reused token, from either tier)."""

    queries: int
    misses: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    blocks_used: int
    blocks_free: int
    blocks_evictable: int
    blocks_pinned: int
    bytes_used: int
    evictions: int
    cached_tokens: int
    nodes: int
    offload: TierStats | None = None
    snapshots: int = 0
    """Recurrent-state snapshots held (a model with recurrent layers: docs/memory.md, "Recurrent state")."""
    snapshot_bytes: int = 0
    """Their bytes, beside ``bytes_used`` (the pool's)."""
    snapshots_taken: int = 0
    """Snapshots taken (at grid positions, junctions, call ends and pins), ``snapshots_used`` of them resumed from
    (each resume counts), ``snapshots_dropped_budget`` dropped for the snapshots' budget and
    ``snapshots_dropped_path`` dropped with the K/V of their path (evicted, in any namespace)."""
    snapshots_used: int = 0
    snapshots_dropped_budget: int = 0
    snapshots_dropped_path: int = 0
    kv_hit_tokens: int = 0
    """Hits per kind, for a model with recurrent layers: of the prompt tokens looked up, those whose K/V the store
    held (what an attention-only model would reuse, one token short of each prompt), beside ``hit_tokens``, those
    resumed from a snapshot of the states there (each attention layer's K/V reused with them)."""


@dataclass(frozen=True)
class RowStats:
    """Prompt tokens of one row, how many were reused from the store and how many computed."""

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int


@dataclass(frozen=True)
class CacheStats:
    """Batch totals of :class:`RowStats`, and ``per_row``. ``not_cached`` says why the call's K/V are not kept for
    later calls, or construction's reuse was dropped (``"use_cache=False"``, ``"inputs_embeds ..."``, a model in
    training mode, ...), or, for a model with recurrent layers, why a row resumed short of the prefix whose K/V the
    store held (no state snapshot taken there yet, or one taken and dropped for the budget or with its path):
    ``None`` when nothing stopped it, so that a call that reuses nothing is never silent."""

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    per_row: tuple[RowStats, ...]
    not_cached: str | None = None
    split_tokens: int = 0
    """Of ``computed_tokens``: those computed, for a model with recurrent layers, by forwards of their own that end
    where a later prompt can resume (a snapshot of the states there: docs/how-it-works.md, "Layer kinds")."""
