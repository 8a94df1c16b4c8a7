"""``generate_many``'s whole-batch planner: which prompts go in which ``generate`` call, in what order.

The prompts are sorted by their token ids, so that prompts sharing a prefix lie next to each other; a group whose
prefix the store holds already goes first, before other work can evict it (:func:`row_order`). Consecutive prompts
then fill batches of at most ``batch_size`` rows and, in a store with a budget, of at most :func:`room` blocks
(:func:`batch_rows`). The refill (:class:`prefixkv.many.scheduler.Scheduler`) takes its waiting prompts in the
same order.
"""

from __future__ import annotations

from ..base.tokens import common_length
from ..store.prefix_store import PrefixStore


def batch_rows(
    rows: list[list[int]], store: PrefixStore, batch_size: int, new_tokens: int, namespace: str | None = None
) -> list[list[int]]:
    """The batches (lists of row indices) in the order to run them: the rows in :func:`row_order`, consecutive rows
    filling batches of at most ``batch_size`` rows and, in a store with a budget, of at most :func:`room` blocks.
    A row larger than that goes in a batch of its own. Does not mutate.

    >>> import prefixkv
    >>> store = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
    >>> batch_rows([[5, 6, 7, 8, 1], [9, 9], [5, 6, 7, 8, 2]], store, batch_size=2, new_tokens=4)
    [[0, 2], [1]]
    """
    most = room(store)
    batches: list[list[int]] = []
    need = 0
    for i, blocks in row_order(rows, store, new_tokens, namespace):
        if not batches or len(batches[-1]) >= batch_size or (most is not None and need + blocks > most):
            batches.append([])
            need = 0
        batches[-1].append(i)
        need += blocks
    return batches


def room(store: PrefixStore) -> int | None:
    """The most blocks the rows running at once may need, in a store with a budget: half the blocks it holds
    beside its pins; the other half keeps what was cached before, so that a long job cannot flush a hot prefix by
    its batches' size alone. In an invariant store half its budget, whatever it holds: its batches, and so its
    results, must not follow its contents, pins included. ``None`` without a budget. Does not mutate."""
    if store.max_blocks is None:
        return None
    return store.max_blocks // 2 if store.invariant else (store.max_blocks - store.stats.blocks_pinned) // 2


def row_order(
    rows: list[list[int]], store: PrefixStore, new_tokens: int, namespace: str | None
) -> list[tuple[int, int]]:
    """The rows to run, in order, each with the blocks it needs. Rows are sorted by their tokens, so that rows
    sharing a prefix are consecutive; runs of rows sharing a whole block go together, the run whose prefix the
    store holds most of first (before other work can evict it; what it holds for user ``namespace``). A row needs
    its prompt and new tokens, less the whole blocks it reuses from the store or the row before it. In an
    invariant store neither the order nor the needs count what the store holds. Does not mutate."""
    bs = store.block_size
    # an invariant store's results must not depend on what it holds (docs/correctness.md, "Outputs that never
    # depend on the cache"): its batches do not follow its contents either
    cached = [0 if store.invariant else store.cached_length(r, store.blocks.space(), namespace=namespace) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    runs: list[list[int]] = []
    shared = [0] * len(rows)  # tokens, in whole blocks, that row i shares with the row before it in `order`
    for prev, i in zip([None, *order], order):
        shared[i] = 0 if prev is None else common_length(rows[prev], rows[i]) // bs * bs
        if shared[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    runs.sort(key=lambda run: -cached[run[0]])  # stable: sorted order among equal hits
    return [(i, -(-(len(rows[i]) + new_tokens) // bs) - max(cached[i], shared[i]) // bs) for run in runs for i in run]
