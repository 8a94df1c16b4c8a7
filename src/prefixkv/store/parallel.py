"""A store per process of a model split by transformers' tensor parallelism (``tp_plan="auto"`` under ``torchrun``;
docs/getting-started.md, "Several GPUs"): the budget the processes agree on, and the debug check that their stores
decided alike.

Each process holds its share of every layer's K/V heads and builds its own :class:`~prefixkv.PrefixStore`, whose
pool is sized from the K/V its layers hand over (:mod:`prefixkv.hf.shapes`). Every decision of a store (what the
trie holds, what is evicted, admitted, pinned) is a pure function of the calls and their tokens, never of a Python
``hash()`` of a string or of a probe of this process's memory, so the processes decide alike when they make the
same calls; :func:`check_ranks_agree` checks it."""

from __future__ import annotations

import hashlib
from typing import Any

from ..kv.ranks import agree_min, gathered, model_ranks


def agreed_budget(max_blocks: int | None, model: Any) -> int | None:
    """The pool's bound in blocks that every process of a split ``model`` keeps (the least of theirs: an
    all-reduce MIN, which every process calls as it builds its store), ``max_blocks`` itself when the model is
    whole or unbounded. Does not mutate."""
    ranks = model_ranks(model)
    if ranks is None:
        return max_blocks
    bounded = agree_min(0 if max_blocks is None else 1, ranks)
    least = agree_min(max_blocks if max_blocks is not None else 2**62, ranks)
    return least if bounded else None


def decisions_digest(store: Any) -> str:
    """A sha256 of what ``store`` decided: every cached prefix (its tokens, blocks, locks, pins and the kind of its
    namespace), its pool's capacity and its counters. Equal in every process of a split model that made the same
    calls. Does not mutate."""
    digest = hashlib.sha256()
    for n in store.blocks.ledger.prefix_view():
        kind = type(n.space).__name__, getattr(n.space, "name", None)
        digest.update(f"{n.tokens}|{n.start}|{n.blocks}|{n.lock}|{n.parent}|{kind}|{n.pinned}\n".encode())
    s = store.stats
    counters = (s.queries, s.misses, s.prompt_tokens, s.hit_tokens, s.blocks_used, s.blocks_free, s.blocks_evictable)
    digest.update(repr((*counters, s.blocks_pinned, s.evictions, s.nodes, store.pool.capacity)).encode())
    return digest.hexdigest()


def check_ranks_agree(store: Any) -> str:
    """Raise ``AssertionError`` unless the stores of every process of ``store``'s split model decided alike
    (:func:`decisions_digest`, all-gathered: every process calls it at the same point); the digest. A debug
    check, as :meth:`prefixkv.PrefixStore.check_invariants`: the tests call it after each call."""
    mine = decisions_digest(store)
    ranks = model_ranks(store.hf_model)
    if ranks is None:
        return mine
    digests = gathered(mine, ranks)
    if len(set(digests)) > 1:
        per_rank = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise AssertionError(
            f"the stores of the {ranks.size} processes decided differently ({per_rank}): each process must make the "
            "same calls with the same ids, in the same order"
        )
    return mine
