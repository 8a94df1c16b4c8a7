"""Where the rows of a prompt resume: how much of what the store holds each row reuses, at one column for every
row of a batch (one offset per batch), and what the store's runner computes first. The rows that apply these rules
are a cache's :class:`prefixkv.hf.rows.RowSet` (:meth:`~prefixkv.hf.rows.RowSet.attach`; :class:`HeldRows`).

For K/V alone (:func:`attach_kv`) a row reuses its match less its last token (:class:`Offset`), in an invariant store
its canonical chunks (:func:`chunk_end`). For a model with recurrent layers these are the snapshot rules, beside the
snapshots (:mod:`prefixkv.hf.states`; docs/how-it-works.md, "Layer kinds"): a row reuses a prefix only up to a
position where the store holds a snapshot of its states (:class:`SnapshotOffset`, :func:`attach_states`); before
that a prompt is snapshotted where a later prompt may resume (:func:`stops`: where the store's match ends, a
junction; where two rows of the batch part; the grid on the way), by the call's own forward where it can take them
inside it (:attr:`Start.cuts`, :func:`take_cuts`), else by the runner, computing each prompt up to its last token
first (:func:`snapshot_row`); a call's end keeps a snapshot after its rows' tokens (:func:`keep_ends`), where the
next turn of a chat resumes. A pin publishes its one row whole (:func:`publish_all`), so that later prompts resume
after it."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

from ..base.errors import CacheMisuseError
from ..base.stats import CacheStats, RowStats
from ..base.tokens import common_length, is_image_key
from ..kv.holdings import Claim
from ..kv.manager import BlockManager
from . import shapes, states, vision
from .parts import StoreParts
from .proof import RowFacts
from .states import Cuts, Recorded, Snapshot, Snapshots, StateLayers


class Start(NamedTuple):
    """How a batch of prompt rows starts: each row's claim in the store and how many of its tokens it reuses, the
    column every row starts at (one offset per batch), what the prompt reused (its stats), and where the call's own
    forwards take snapshots (:func:`take_cuts`; ``None``: nowhere)."""

    claims: list[Claim]
    reused: list[int]
    offset: int
    stats: CacheStats
    cuts: Cuts | None = None


class HeldRow(RowFacts, Protocol):
    """What the snapshot rules read of a row (:class:`prefixkv.hf.rows.Row`): what the proof reads, and how many of
    its blocks are published."""

    @property
    def published(self) -> int: ...

    @property
    def claim(self) -> Claim: ...


class HeldRows(Protocol):
    """What the snapshot rules read of a cache's rows (:class:`prefixkv.hf.rows.RowSet`)."""

    @property
    def broken(self) -> bool: ...

    @property
    def blocks(self) -> BlockManager: ...

    @property
    def space(self) -> Hashable: ...

    @property
    def states(self) -> StateLayers: ...

    @property
    def snapshots(self) -> Snapshots | None: ...

    @property
    def publishes(self) -> bool: ...

    @property
    def rows(self) -> Sequence[HeldRow]: ...

    @property
    def length(self) -> int: ...

    # where the call's own forwards take snapshots, and what the one running captures for them (:func:`begin_cuts`)
    cuts: Cuts | None
    recording: tuple[int, Recorded] | None


def chunk_end(keys: list[int], chunk: int) -> int:
    """Where the canonical chunks of a prompt row end in an invariant store: after the whole chunks before the
    one that holds its last token (generate's own forward computes that one) and before its first token the mask
    hides (a prefill without the row's mask would compute other K/V) or its first image placeholder (a prefill of ids
    alone has no image). Does not mutate."""
    hidden = next((t for t, k in enumerate(keys) if k < 0 or is_image_key(k)), len(keys))
    return min(len(keys) - 1, hidden) // chunk * chunk


def state_cap(keys: list[int], chunk: int | None, split: bool) -> int:
    """How far a row of a model with recurrent layers may resume (the position of a snapshot at most this deep): up
    to its last token (one stays uncached); in an invariant store the end of its canonical chunks (:func:`chunk_end`),
    or, for the runner's chunk forwards (not ``split``), every whole chunk it holds. Does not mutate."""
    if chunk is None:
        return len(keys) - 1
    return chunk_end(keys, chunk) if split else len(keys) // chunk * chunk


class Offset:
    """``choose`` for :meth:`prefixkv.kv.manager.BlockManager.claim` on a model without recurrent layers: each row
    reuses its match up to its cap in ``caps`` (in an invariant store, in whole chunks of ``chunk`` tokens), at one
    column for every row (one offset per batch, after ``pads``), and not inside any row's image (``plan``). Once
    called, :attr:`offset` is that column. Mutates itself only."""

    def __init__(self, pads: list[int], caps: list[int], chunk: int | None, plan: vision.ImagePlan | None) -> None:
        self.pads, self.caps, self.chunk, self.plan = pads, caps, chunk, plan
        self.offset = 0

    def __call__(self, lengths: list[int]) -> list[int]:
        pads, chunk, plan = self.pads, self.chunk, self.plan
        matched = [min(n, c) for n, c in zip(lengths, self.caps)]
        if chunk is not None:
            matched = [m // chunk * chunk for m in matched]
        offset = min(p + m for p, m in zip(pads, matched))  # one offset per batch
        while plan is not None:  # nor inside any row's image (hf/vision.py: a forward feeds whole images)
            snapped = min(p + plan.snap(i, max(0, offset - p)) for i, p in enumerate(pads))
            if snapped == offset:
                break
            offset = snapped
        self.offset = offset
        return [max(0, offset - p) for p in pads]


def attach_kv(
    blocks: BlockManager,
    store: StoreParts,
    space: Hashable,
    namespace: str | None,
    plan: vision.ImagePlan | None,
    pads: list[int],
    rows: list[list[int]],
    *,
    count: bool,
    chunks: bool,
) -> Start:
    """:meth:`prefixkv.hf.rows.RowSet.attach` for a model without recurrent layers: claim what each row reuses in
    ``space``, after the runner computed (in user ``namespace``) the prefixes rows of the batch share, or in an
    invariant store each row's canonical chunks (none with ``chunks``: the runner's own chunk forward). Counts the
    lookup in the store's statistics where ``count``. Mutates the store."""
    chunk = store.settings.chunk_size
    held: list[int] | None = None
    with contextlib.ExitStack() as prefills:
        if chunk is None:
            # one prompt token stays uncached (docs/how-it-works.md, "Reuse, step by step")
            caps = [len(r) - 1 for r in rows]
            prefilled = store.runner.prefill_shared(rows, namespace) if len(rows) > 1 else []
        elif chunks:
            caps, prefilled = [len(r) for r in rows], []
        else:
            caps, prefilled = [chunk_end(r, chunk) for r in rows], []
            # what the runner computes stays locked until the rows hold it
            kept = [r[:c] for r, c in zip(rows, caps)]
            held = prefills.enter_context(store.runner.prefill_chunks(kept, namespace))
        choose = Offset(pads, caps, chunk, plan)
        claims, reused = blocks.claim(rows, space, choose)
    charged = list(reused)
    if held is not None:  # what the canonical prefill computed was computed by this call
        charged = [min(h, r) for h, r in zip(held, charged)]
    # the shared prefill's tokens were computed by this call: charge them to a row that reused them
    for cost, members in prefilled:
        j = max(members, key=lambda i: charged[i])
        charged[j] -= min(cost, charged[j])
    per_row = tuple(RowStats(len(t), r, len(t) - r) for t, r in zip(rows, charged))
    stats = CacheStats(
        sum(s.prompt_tokens for s in per_row), sum(charged), sum(s.computed_tokens for s in per_row), per_row
    )
    if count:
        blocks.ledger.count_query([len(t) for t in rows], charged)
    return Start(claims, reused, choose.offset, stats)


class SnapshotOffset:
    """``choose`` for :meth:`prefixkv.kv.manager.BlockManager.claim`: the deepest column where every row of ``rows``
    (after ``pads``) holds a snapshot in ``space`` (at that column less its pads), within each row's match and its
    ``caps``, and not inside any row's image (``plan``). Once called, :attr:`offset` is that column and
    :attr:`chosen` each row's snapshot there. Mutates itself only."""

    def __init__(
        self,
        snapshots: Snapshots,
        space: Hashable,
        rows: list[list[int]],
        pads: list[int],
        caps: list[int],
        plan: vision.ImagePlan | None,
    ) -> None:
        self.snapshots, self.space, self.rows = snapshots, space, rows
        self.pads, self.caps, self.plan = pads, caps, plan
        self.offset = 0
        self.chosen: list[Snapshot | None] = [None] * len(rows)

    def __call__(self, lengths: list[int]) -> list[int]:
        pads, plan = self.pads, self.plan
        c = min(p + min(m, cap) for p, m, cap in zip(pads, lengths, self.caps))
        while c > 0:
            if plan is not None:  # nor inside any row's image (hf/vision.py: a forward feeds whole images)
                c = min(p + plan.snap(i, max(0, c - p)) for i, p in enumerate(pads))
            if any(c - p < 1 for p in pads):
                c = 0
                break
            found = [self.snapshots.find(self.space, r, c - p) for r, p in zip(self.rows, pads)]
            lowest = min(0 if f is None else p + f.position for f, p in zip(found, pads))
            if lowest == c:
                self.chosen = found
                break
            c = lowest
        self.offset = c
        return [max(0, c - p) for p in pads]


def attach_states(
    held: HeldRows,
    store: StoreParts,
    pads: list[int],
    rows: list[list[int]],
    plan: vision.ImagePlan | None,
    namespace: str | None,
    *,
    count: bool,
    split: bool,
) -> Start:
    """:meth:`prefixkv.hf.rows.RowSet.attach` for a model with recurrent layers: a row reuses a prefix only up to a
    position where the store holds a snapshot of its states (and the K/V before it), at one column for every row (one
    offset per batch; a left-padded row at that column less its pads, where the store measured that the model keeps
    pads out of its state, else a padded batch reuses nothing and its stats say why). With ``split``, first each row's
    prompt up to its last token is computed by the runner, stopping at every position a later prompt may resume from
    (:func:`stops`), each stop snapshotted: the call then resumes at its last token. One unpadded row of a model whose
    forward can hand the states inside it (:func:`prefixkv.hf.states.records_inside`) is not computed first: the
    call's own forward takes the same snapshots on its way (:attr:`Start.cuts`), so the prompt costs one forward, as
    without a cache. Mutates ``held``'s states (restored from the snapshots chosen) and the store; the caller starts
    its rows from what it returns."""
    snapshots, n = store.snapshots, len(rows)
    # a left-padded row resumes its unpadded prefix's snapshot only where the model keeps pads out of its state
    refusal = shapes.padded_refusal(store.hf_model) if any(pads) else None
    chunk = store.settings.chunk_size
    caps = [0 if refusal is not None else state_cap(r, chunk, split) for r in rows]
    if held.blocks.tier is not None:  # the blocks a row starts with come back first, with their snapshots
        held.blocks.lookup(rows, held.space)
    # what the store held before this call computed anything: the K/V an attention-only model would reuse
    cached = [held.blocks.cached_length(r[: len(r) - 1], held.space) for r in rows] if split or count else [0] * n
    computed = [0] * n
    missed: str | None = None  # why the first row that resumes short of the K/V held does
    choose = SnapshotOffset(snapshots, held.space, rows, pads, caps, plan)
    inside = split and refusal is None and _in_forward(store, pads, plan)
    planned: tuple[list[int], list[int]] | None = None
    with contextlib.ExitStack() as prefills:
        if split and refusal is None:
            for i, prompt in enumerate(rows):
                at, junctions, why = stops(snapshots, held.space, rows, i, caps[i], cached[i], chunk)
                missed = missed or (why if n == 1 or not why else f"row {i}: {why}")
                if at and inside:
                    planned = (at, junctions)
                elif at:
                    run = store.runner.prefill_states(prompt[: at[-1]], at, namespace, junctions)
                    computed[i] = prefills.enter_context(run)
        claims, reused = held.blocks.claim(rows, held.space, choose)
    if choose.offset:
        states.restore(held.states, [s for s in choose.chosen if s is not None])
        for keys, snapshot in zip(rows, choose.chosen):
            if snapshot is not None:
                snapshots.use(held.space, keys, snapshot)
    if refusal is not None:
        missed = f"a left-padded batch of this model reuses no prefix: {refusal[0]}; it is computed whole, its K/V kept"
    stats = _stats(rows, reused, computed, missed)
    if count:
        held.blocks.ledger.count_query([len(t) for t in rows], [r.cached_tokens for r in stats.per_row])
        snapshots.count_kv_hits(sum(cached))
    return Start(claims, reused, choose.offset, stats, _cuts(snapshots, planned, choose.offset))


def _in_forward(store: StoreParts, pads: list[int], plan: vision.ImagePlan | None) -> bool:
    """Whether the call's own forward takes its row's snapshots, with no runner: one unpadded row, no image, not an
    invariant store, a model whose forward can hand its states inside it. Does not mutate."""
    if len(pads) != 1 or pads[0] or plan is not None or store.settings.chunk_size is not None:
        return False
    return states.records_inside(store.hf_model)


def _cuts(snapshots: Snapshots, planned: tuple[list[int], list[int]] | None, offset: int) -> Cuts | None:
    """Where the call's own forwards take snapshots after resuming at ``offset``: the ``planned`` stops and
    junctions, and the grid's positions on the way (``None``: none planned). Does not mutate."""
    if planned is None:
        return None
    at, junctions = planned
    positions = states.grid_positions(offset, [s for s in at if s > offset], snapshots.step())
    return Cuts(tuple(positions), frozenset(junctions))


def _stats(rows: list[list[int]], reused: list[int], computed: list[int], why: str | None) -> CacheStats:
    """What the prompt ``rows`` reused: what each row's claim ``reused`` less what the runner ``computed`` for it
    meanwhile, and ``why`` a row resumed short of the K/V held."""
    cached = [max(0, r - c) for r, c in zip(reused, computed)]
    per_row = tuple(RowStats(len(t), r, len(t) - r) for t, r in zip(rows, cached))
    return CacheStats(
        sum(x.prompt_tokens for x in per_row),
        sum(cached),
        sum(x.computed_tokens for x in per_row),
        per_row,
        why,
        split_tokens=sum(computed),
    )


def stops(
    snapshots: Snapshots,
    space: Hashable,
    rows: list[list[int]],
    i: int,
    cap: int,
    held: int,
    chunk: int | None = None,
) -> tuple[list[int], list[int], str | None]:
    """Where the runner stops and snapshots row ``i`` (up to ``cap``, its last token excluded), which of those
    stops are junctions (where prompts part: kept longest, :class:`prefixkv.hf.states.Snapshots`), and why the
    row resumes short of the ``held`` tokens whose K/V the store holds (``None``: it does not). It stops at the
    store's match if no snapshot is there yet (a junction), where it parts from another row of the batch, after each
    token of :attr:`~prefixkv.hf.states.Snapshots.marks` (a message's end), and at ``cap`` (or the row's first image
    placeholder, which the runner cannot compute); only past the deepest snapshot the store holds, and nowhere if one
    is at ``cap`` already or the row has tokens its mask hides (the runner computes without the row's mask). The
    grid's stops on the way are added to them (:func:`prefixkv.hf.states.grid_positions`); in an invariant store (a
    ``chunk`` size) the stops are the ends of its chunks past the deepest snapshot. Does not mutate."""
    row = rows[i]
    # the runner computes ids alone: never an image (hf/vision.py), so it stops before the first one
    cap = min(cap, next((t for t, k in enumerate(row) if is_image_key(k)), cap))
    if cap < 1 or any(k < 0 for k in row[:cap]):
        return [], [], None
    found = snapshots.find(space, row, cap)
    deepest = 0 if found is None else found.position
    match = min(held, cap)
    why = None
    if deepest < match:
        dropped = snapshots.why_missing(space, row, match)
        what = {
            None: "no recurrent-state snapshot was taken yet",
            "budget": "its recurrent-state snapshot was taken and then dropped for the snapshots' budget "
            '(store.snapshots.max_bytes: docs/memory.md, "Recurrent state")',
            "path": "its recurrent-state snapshot was dropped when that path's K/V were evicted",
        }[dropped]
        why = (
            f"the prefix the store holds ends at token {match}, where {what}: resumed at token {deepest} (the "
            f"deepest snapshot on the path) and took one at {match} on the way, so the next prompt with that "
            "prefix resumes there"
        )
    if deepest == cap:
        return [], [], why
    if chunk is not None:  # the canonical schedule: a snapshot at every chunk's end
        return list(range(deepest + chunk, cap + 1, chunk)), [], why
    junctions = {match} | {common_length(row, other) for j, other in enumerate(rows) if j != i}
    if snapshots.marks:  # after each message's end (Snapshots.marks), where the next prompt likely parts
        junctions |= {t + 1 for t in range(deepest, cap) if row[t] in snapshots.marks}
    kept = sorted(j for j in junctions if deepest < j < cap)
    return sorted({*kept, cap}), kept, why


def publish_all(held: HeldRows) -> None:
    """Publish every token of the one row, a last part-filled block included (what ``PrefixStore.pin`` keeps; a
    forward publishes whole blocks only). Raises :class:`CacheMisuseError` when its K/V could not be proven to be
    those of its ids. Mutates the store."""
    (row,) = held.rows
    if not row.proven:
        raise CacheMisuseError("the prefill's K/V could not be proven to be those of its ids; nothing pinned")
    known = row.published * held.blocks.block_size
    held.blocks.publish(row.claim, row.keys, known=known, end=len(row.keys), space=held.space)


def snapshot_row(held: HeldRows, snapshots: Snapshots, *, junction: bool = False) -> None:
    """Publish the one row's tokens (a last part-filled block included) and a snapshot of its states after them
    (the runner's stops; a ``junction`` is kept longest). Mutates the store."""
    (row,) = held.rows
    end = held.length  # the row's keys are its whole prompt's from the start; its columns, what was computed
    known = row.published * held.blocks.block_size
    held.blocks.publish(row.claim, row.keys, known=known, end=end, space=held.space)
    snapshots.add(held.space, row.keys, states.take(held.states, 0, end), junction=junction)


def begin_cuts(held: HeldRows, start: int, q: int) -> None:
    """Before a forward of ``q`` columns after ``start``: have it capture the states at the call's cuts inside it
    (``held.cuts``; :func:`end_cuts` takes the snapshots). Mutates ``held``."""
    cuts = held.cuts
    if cuts is None:
        return
    inner = [p - start for p in cuts.positions if start < p < start + q]
    held.recording = (start, states.start_recording(inner)) if inner else None


def end_cuts(held: HeldRows, ok: bool) -> None:
    """After a forward (``ok``: it returned, and the cache is open): the snapshots at the cuts it reached
    (:func:`take_cuts`); the cuts past it wait for the next forward. Mutates ``held`` and the store."""
    cuts, recording = held.cuts, held.recording
    if cuts is None:
        return
    held.recording = None
    if recording is not None:
        states.stop_recording()
    later = tuple(p for p in cuts.positions if p > held.length)
    held.cuts = Cuts(later, cuts.junctions) if later and ok else None
    if ok:
        take_cuts(held, cuts, *(recording or (held.length, None)))


def take_cuts(held: HeldRows, cuts: Cuts, start: int, recorded: Recorded | None) -> None:
    """After a forward from column ``start`` to ``held.length`` that ``recorded`` the states inside it (``None``: none):
    publish the first row's tokens up to each of ``cuts`` it reached, a last part-filled block included, and a
    snapshot of its states there (a junction is kept longest). Nothing for a row whose K/V are not proven. Mutates the
    store."""
    end, snapshots = held.length, held.snapshots
    row = held.rows[0] if held.rows else None
    if held.broken or row is None or not row.proven or snapshots is None:
        return
    for p in cuts.positions:
        if not start < p <= end:
            continue
        if p == end:
            snapshot: Snapshot | None = states.take(held.states, 0, p)
        else:
            assert recorded is not None  # begin_cuts recorded every cut inside the forward
            snapshot = states.snapshot_at(held.states, recorded, 0, recorded.cuts.index(p - start), p)
        if snapshot is None:
            continue
        known = row.published * held.blocks.block_size
        held.blocks.publish(row.claim, row.keys, known=known, end=p, space=held.space)
        snapshots.add(held.space, row.keys, snapshot, junction=p in cuts.junctions)


def keep_ends(held: HeldRows) -> None:
    """At the end of a call (the cache closes), for a model with recurrent layers: publish every proven,
    unpadded row's tokens, a last part-filled block included, and a snapshot of its states after them, so that
    the next turn of a chat resumes there. Mutates the store."""
    snapshots = held.snapshots
    if not held.states or held.broken or not held.publishes or not held.rows or snapshots is None:
        return
    for b, row in enumerate(held.rows):
        end = held.length - row.pad
        if not row.proven or row.pad or end < 1 or len(row.keys) != end:
            continue
        found = snapshots.find(held.space, row.keys, end)
        if found is not None and found.position == end:
            continue  # the runner's last stop
        known = row.published * held.blocks.block_size
        held.blocks.publish(row.claim, row.keys, known=known, end=end, space=held.space)
        snapshots.add(held.space, row.keys, states.take(held.states, b, end))
