"""Running a store's model: ``PrefixStore.pin`` and ``PrefixStore.warm`` (the prefill of their token ids, and the
pin itself), in-batch sharing (a prefix several rows of one batch share is computed once), and the canonical chunk
schedule of an invariant store (docs/correctness.md, "Outputs that never depend on the cache"). Each store builds
its :class:`ModelRunner` and owns it (``store.runner``); the runner knows the store only as the parts it hands down
(:class:`prefixkv.hf.parts.StoreParts`), so this module never imports the store (docs/how-it-works.md, "Layers")."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Collection, Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from ..base.stats import CacheStats, RowStats
from ..base.tokens import common_length, is_image_key
from ..compat.releases import forward_cache_kwarg
from ..kv.key_space import user_space
from . import kinds, resume, states
from .cache import PagedPrefixCache
from .parts import StoreParts


@contextlib.contextmanager
def prefill(
    store: StoreParts, tokens: list[int], *, keep_partial: bool, count: bool, namespace: str | None = None
) -> Iterator[RowStats]:
    """Compute the uncached rest of ``tokens`` with the store's model (one forward, whose whole blocks the
    forward hook publishes) and, with ``keep_partial``, publish the last part-filled block too (what
    ``PrefixStore.pin`` keeps; ``PrefixStore.warm`` keeps whole blocks). In an invariant store only the whole
    chunks of ``tokens`` are computed and published, each by a forward of its own (:func:`prefill_chunks`).
    Yields the prompt tokens reused and computed; what was published stays locked until the block exits.
    ``count=False`` keeps the lookup out of the store's statistics. All of it in user ``namespace``
    (:class:`PagedPrefixCache`). Mutates the store."""
    if store.settings.chunk_size is not None:
        kept = _kept(tokens, store.settings.chunk_size)
        with prefill_chunks(store, [kept], namespace) as (held,):
            if count:
                store.blocks.ledger.count_query([len(tokens)], [held])
            yield RowStats(len(tokens), held, len(kept) - held)
        return
    ids = torch.tensor([tokens], dtype=torch.long) if count else None
    with PagedPrefixCache(store, ids, namespace=namespace) as cache:
        if not count:
            cache.forward.rows.attach(store, [0], [tokens], count=False)
        _forward(cache, tokens[cache.get_seq_length() :])
        if keep_partial:
            resume.publish_all(cache.forward.rows)
        yield cache.stats.per_row[0]


@contextlib.contextmanager
def prefill_chunks(store: StoreParts, prefixes: list[list[int]], namespace: str | None = None) -> Iterator[list[int]]:
    """The canonical prefill of an invariant store (docs/correctness.md, "Outputs that never depend on the
    cache"): make the store hold each of ``prefixes`` (whole chunks of ``store.settings.chunk_size`` tokens), computing
    every chunk it lacks with a forward of its own, one row, ``[1, chunk_size]``, after the earlier chunks read
    from the pool, so that a chunk's K/V are a function of its tokens and those before it alone (and, for a model
    with recurrent layers, a snapshot of the states at its end, from which the next chunk resumes). A chunk computed
    for one prefix serves every later one that starts with it. Yields how many tokens of each prefix the store
    held before (whole chunks); everything the prefixes hold stays locked until the block exits. All of it in
    user ``namespace``. Mutates the store."""
    chunk = store.settings.chunk_size
    if chunk is None:
        raise ValueError("prefill_chunks is the prefill of an invariant store: StoreParts(model, invariant=True)")
    with contextlib.ExitStack() as holds:
        holds.enter_context(store.blocks.key_space.steady())  # every chunk computed with the same weights
        held = []
        for tokens in prefixes:  # every prefix's cached part locked first: computing the others must not evict it
            cache = holds.enter_context(PagedPrefixCache(store, namespace=namespace))
            if tokens:
                cache.forward.rows.attach(store, [0], [tokens], count=False, chunks=True)
            held.append(cache.get_seq_length())
        for tokens, before in zip(prefixes, held):
            if before < len(tokens):
                cache = holds.enter_context(PagedPrefixCache(store, namespace=namespace))
                # with what earlier prefixes computed
                cache.forward.rows.attach(store, [0], [tokens], count=False, chunks=True)
                for start in range(cache.get_seq_length(), len(tokens), chunk):
                    _forward(cache, tokens[start : start + chunk])
                    if kinds.stateful(store.layer_kinds):  # recurrent layers resume from a chunk end's snapshot
                        resume.snapshot_row(cache.forward.rows, store.snapshots)
        yield held


@contextlib.contextmanager
def prefill_states(
    store: StoreParts, tokens: list[int], stops: list[int], namespace: str | None, junctions: Collection[int] = ()
) -> Iterator[int]:
    """For a model with recurrent layers (docs/how-it-works.md, "Layer kinds"): compute ``tokens`` with a one-row
    cache from the deepest snapshot the store holds on their path, up to the last of ``stops`` (ascending, the last
    ``len(tokens)``), and take a snapshot of the states at each stop and each grid position on the way (multiples of
    ``store.snapshots.step()``: docs/memory.md, "Recurrent state"), their K/V published (a last part-filled block
    included), so that a later prompt with that prefix resumes there, or at most one grid step (and 16 tokens) before
    the point where it parts from these tokens; the ``junctions`` among the stops are kept longest. One forward takes
    them all where the model's recurrent kernel can hand the states inside it (:func:`prefixkv.hf.states.recording`),
    else a forward per position; in an invariant store the stops are chunk ends, and each forward computes one
    chunk (its canonical schedule: docs/correctness.md, "Outputs that never depend on the cache"). Yields how many
    tokens it computed; what it published stays locked until the block exits. In user ``namespace``. Mutates the
    store."""
    snapshots = store.snapshots
    with PagedPrefixCache(store, namespace=namespace) as cache:
        rows = cache.forward.rows
        rows.attach(store, [0], [tokens], count=False, chunks=True)  # reuse only: no stops of its own
        start = cache.get_seq_length()
        pending = sorted(s for s in set(stops) if s > start)
        chunk = store.settings.chunk_size  # an invariant store's canonical schedule: one forward a chunk, to its end
        positions = pending if chunk is not None else states.grid_positions(start, pending, snapshots.step())
        if positions and chunk is None and states.records_inside(store.hf_model):
            # one forward, its states taken at every position on the way
            *cuts, end = positions
            with states.recording([c - start for c in cuts]) as recorded:
                _forward(cache, tokens[start:end])
            for j, c in enumerate(cuts):  # in order, the last newest (kept longest among its like)
                snapshot = states.snapshot_at(rows.states, recorded, 0, j, c)
                if snapshot is not None:
                    snapshots.add(rows.space, tokens, snapshot, junction=c in junctions)
            resume.snapshot_row(rows, snapshots, junction=end in junctions)  # publishes up to end: every cut's path
            positions = []
        done = start
        for stop in positions:  # a model whose recurrent kernel cannot hand inner states: a forward per position
            _forward(cache, tokens[done:stop])
            resume.snapshot_row(rows, snapshots, junction=stop in junctions)
            done = stop
        yield cache.get_seq_length() - start


def _kept(tokens: list[int], chunk_size: int | None) -> list[int]:
    """The part of ``tokens`` that :func:`prefill` computes and :meth:`ModelRunner.pin` keeps: all of them, or in
    the invariant schedule their whole chunks (the only K/V a later call reuses there). Does not mutate."""
    if chunk_size is None:
        return tokens
    return tokens[: len(tokens) // chunk_size * chunk_size]


def _forward(cache: PagedPrefixCache, tokens: list[int]) -> None:
    """One forward of the store's model over ``tokens`` of a one-row prompt, after the columns ``cache`` holds."""
    store = cache.store
    model = store.hf_model  # a PEFT wrapper's adapters live in its layers; its forward renames the cache
    kwargs = forward_kwargs(model, cache, logits_to_keep=1)  # K/V are wanted, not a row of logits per token
    # the first layer's device: model.device is `meta` when accelerate offloads the weights
    ids = torch.tensor([tokens], device=store.blocks.pool.specs[0].device)
    with torch.no_grad():
        model(input_ids=ids, **kwargs)


def forward_kwargs(model: torch.nn.Module, cache: PagedPrefixCache, *, logits_to_keep: int) -> dict[str, Any]:
    """The keyword arguments that hand ``model``'s forward ``cache`` (by the name its signature takes: ``cache``,
    or ``past_key_values``) and ask for the last ``logits_to_keep`` rows of logits where it can. Does not mutate."""
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {forward_cache_kwarg(model.forward): cache, "use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = logits_to_keep
    return kwargs


def _shared_prefixes(rows: list[list[int]], block_size: int) -> list[tuple[list[int], list[int]]]:
    """The longest whole-block prefixes that two or more rows share (at most ``len - 1`` tokens of each, what a
    row can reuse), each with the indices of the rows that start with it; a prefix of another one is left
    out, as computing the longer one caches it too. Does not mutate."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    found: dict[tuple[int, ...], None] = {}
    for a, b in itertools.pairwise(order):
        n = min(common_length(rows[a], rows[b]), len(rows[a]) - 1, len(rows[b]) - 1) // block_size * block_size
        if n:
            found[tuple(rows[a][:n])] = None
    longest = [p for p in found if not any(len(q) > len(p) and q[: len(p)] == p for q in found)]
    return [(list(p), [i for i, r in enumerate(rows) if tuple(r[: len(p)]) == p]) for p in longest]


def prefill_shared(store: StoreParts, rows: list[list[int]], namespace: str | None) -> list[tuple[int, list[int]]]:
    """In-batch sharing: compute once, with a one-row cache, each whole-block prefix that several rows share
    beyond what the store holds, and publish it, so every row then reuses it instead of computing it once per
    row, in the rows' user ``namespace``. Returns, per prefix computed, the tokens computed and the rows sharing
    it; none in training mode. Mutates the store."""
    if store.hf_model.training:
        return []  # nothing computed in training mode is published (its dropout would draw from the random stream)
    computed = []
    space = store.blocks.space()
    for prefix, members in _shared_prefixes(rows, store.settings.block_size):
        if any(k < 0 for k in prefix):
            continue  # hidden tokens: a prefill without the rows' mask would compute other K/V
        # an image's placeholders: a prefill of ids alone has no image; the text before it is shared
        prefix = prefix[: next((t for t, k in enumerate(prefix) if is_image_key(k)), len(prefix))]
        prefix = prefix[: len(prefix) // store.settings.block_size * store.settings.block_size]
        if not prefix:
            continue
        if store.blocks.cached_length(prefix, user_space(namespace, space)) >= len(prefix):
            continue
        with prefill(store, prefix, keep_partial=False, count=False, namespace=namespace) as row:
            computed.append((row.computed_tokens, members))
    return computed


class ModelRunner:
    """What runs a store's model (``store.runner``): built by the store, for it, when the store is built."""

    def __init__(self, store: StoreParts) -> None:
        self.store = store

    def prefill(
        self, tokens: list[int], *, keep_partial: bool, count: bool, namespace: str | None = None
    ) -> contextlib.AbstractContextManager[RowStats]:
        """:func:`prefill` with this runner's store. Mutates the store."""
        return prefill(self.store, tokens, keep_partial=keep_partial, count=count, namespace=namespace)

    def prefill_shared(self, rows: list[list[int]], namespace: str | None) -> list[tuple[int, list[int]]]:
        """:func:`prefill_shared` with this runner's store. Mutates the store."""
        return prefill_shared(self.store, rows, namespace)

    def prefill_states(
        self, tokens: list[int], stops: list[int], namespace: str | None, junctions: Collection[int] = ()
    ) -> contextlib.AbstractContextManager[int]:
        """:func:`prefill_states` with this runner's store. Mutates the store."""
        return prefill_states(self.store, tokens, stops, namespace, junctions)

    def prefill_chunks(
        self, prefixes: list[list[int]], namespace: str | None
    ) -> contextlib.AbstractContextManager[list[int]]:
        """:func:`prefill_chunks` with this runner's store. Mutates the store."""
        return prefill_chunks(self.store, prefixes, namespace)

    def pin(self, ids: list[int], priority: int | None, namespace: str | None) -> int:
        """:meth:`prefixkv.PrefixStore.pin` of the token ids ``ids`` (``priority`` checked): pin the part of them
        the store's schedule keeps, computing first what is not cached yet, and return how many tokens that is.
        Mutates the store; raises ``ValueError`` for ids that keep nothing and :class:`CapacityError` for a hard
        pin over the budget, pinning nothing."""
        if not ids:
            raise ValueError("pin() needs at least one token id")
        chunk_size = self.store.settings.chunk_size
        tokens = _kept(ids, chunk_size)
        if not tokens:
            raise ValueError(
                f"an invariant store caches whole chunks of chunk_size={chunk_size} tokens; these "
                f"{len(ids)} ids hold none, so pinning them keeps nothing. Pin a longer prefix, or build the "
                "store with a smaller chunk_size"
            )
        blocks = self.store.blocks
        space = user_space(namespace, blocks.space())
        pins = blocks.pins
        with blocks.lock:
            if priority is None:
                pins.check_budget(tokens, space)
            if pins.add(ids, tokens, space, priority):
                return len(tokens)
        # the prefill keeps the published tokens locked until the pin holds them
        with self.prefill(tokens, keep_partial=True, count=True, namespace=namespace):
            if not pins.add(ids, tokens, space, priority):
                raise RuntimeError("prefixkv: the pin's prefill did not publish its tokens (the model changed?)")
        return len(tokens)

    def warm(self, prompts: list[list[int]], *, progress: bool, namespace: str | None) -> CacheStats:
        """:meth:`prefixkv.PrefixStore.warm` of prompts given as token ids: prefill each in turn (whole blocks
        kept), with a ``tqdm.auto`` progress bar unless ``progress=False``, and return the prompt tokens reused and
        computed. Mutates the store."""
        rows = []
        with tqdm(prompts, desc="prefixkv warm", unit="prompt", disable=not progress) as bar:
            for tokens in bar:
                with self.prefill(tokens, keep_partial=False, count=True, namespace=namespace) as row:
                    rows.append(row)
                reused = sum(r.cached_tokens for r in rows)
                bar.set_postfix(reused=reused, computed=sum(r.computed_tokens for r in rows))
        return CacheStats(
            sum(r.prompt_tokens for r in rows),
            sum(r.cached_tokens for r in rows),
            sum(r.computed_tokens for r in rows),
            tuple(rows),
        )
