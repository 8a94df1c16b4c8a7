"""A row of a ``PagedPrefixCache``: its leading padding, the keys its K/V are cached under, whether those K/V are
proven to be the keys' (docs/correctness.md, "Publish only what is proven"), its claim in the store, and the pool
slots of its columns.

Layout. Every row of a batch has the same number of *columns* (pads included). Row ``i`` has ``pad`` leading
padding columns that read the null block, then its tokens: token ``t`` sits at column ``pad + t`` and in slot
``table[t // block_size] * block_size + t % block_size`` (:func:`prefixkv.base.slots.slot_table`, the one home of that
arithmetic). One block id indexes every layer's pool, so a row has one table for all layers.

Keys. A row's ``keys`` are the token ids where the attention mask is 1, and ``-1 - id`` where a mask with holes
hides a token (:func:`prefixkv.base.tokens.key`): a hole shifts the positions after it, so the K/V that follow are not
those of the unmasked ids. Leading padding is not part of a row.

The rows of one cache are a :class:`RowSet`: it attaches a prompt, allocates a forward's columns, applies the
proof's verdicts, publishes, crops, selects and forks rows, all through the block manager's claim contract
(docs/how-it-works.md, "The block manager"); it never calls the cache."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ..base.errors import CacheMisuseError
from ..base.slots import slot_table
from ..base.stats import CacheStats, RowStats
from ..base.tokens import common_length, is_image_key, key, relabel
from ..kv.holdings import Claim
from ..kv.manager import BlockManager
from . import proof, shapes, states, vision
from .parts import StoreParts
from .states import Cuts, Recorded


class Row:
    """One batch row: leading pad columns, its keys and whether they are ``proven`` (an unproven row has no keys
    and never publishes again), the prompt's length among them, its claim in the store (block table and the trie
    node it keeps locked), its blocks already in the trie, and ``real``: the shown tokens among its stored columns
    (the position of its next shown token)."""

    __slots__ = ("claim", "keys", "pad", "prompt_len", "proven", "published", "real")

    def __init__(self, pad: int, keys: list[int] | None, claim: Claim, published: int) -> None:
        self.pad = pad
        self.proven = keys is not None
        self.keys: list[int] = [] if keys is None else keys
        self.prompt_len = len(self.keys)
        self.claim = claim
        self.published = published
        self.real = 0

    @property
    def table(self) -> list[int]:
        """The row's block table: its claim's, which only the store changes."""
        return self.claim.table

    def forget(self) -> None:
        """From now on the row's K/V are not provably those of its ids: it drops its keys and never publishes
        again. Mutates."""
        self.proven = False
        self.keys = []

    def clone(self, claim: Claim) -> Row:
        """This row holding ``claim`` (a fork of its own)."""
        row = Row(self.pad, list(self.keys) if self.proven else None, claim, self.published)
        row.prompt_len = self.prompt_len
        row.real = self.real
        return row

    def truncate(self, keep: int, block_size: int) -> None:
        """Keep the first ``keep`` tokens (the prompt's keys stay: a later call re-feeds them). Mutates."""
        self.published = min(self.published, keep // block_size)
        if self.proven:
            del self.keys[max(keep, self.prompt_len) :]
            self.real = real_count(self.keys[:keep])


def real_count(keys: list[int]) -> int:
    """How many of ``keys`` the mask shows (the position of the next shown token)."""
    return sum(1 for k in keys if k >= 0)


def new_slots(rows: list[Row], start: int, q: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, q]`` pool slots of the columns a forward feeds after ``start``, and which of them (flat indices) to
    store (``None``: all; pads are skipped so the null block stays zeros). Does not mutate."""
    new = slot_table([row.pad for row in rows], [row.table for row in rows], start, start + q, block_size)
    pads = any(row.pad > start for row in rows)  # a pad column reads slot 0; no table holds block 0
    return new, (new.reshape(-1) != 0).nonzero().view(-1) if pads else None


def chunk_end(keys: list[int], chunk: int) -> int:
    """Where the canonical chunks of a prompt row end in an invariant store: after the whole chunks before the
    one that holds its last token (generate's own forward computes that one) and before its first token the mask
    hides (a prefill without the row's mask would compute other K/V) or its first image placeholder (a prefill of ids
    alone has no image). Does not mutate."""
    hidden = next((t for t, k in enumerate(keys) if k < 0 or is_image_key(k)), len(keys))
    return min(len(keys) - 1, hidden) // chunk * chunk


def check_mask(attention_mask: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """``attention_mask`` as a CPU bool tensor, after checking its shape and that it holds only 0 and 1 (of
    any dtype: a float 0.5 is an error, not padding). Does not mutate."""
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(shape)}, got {got}")
    mask = attention_mask.detach().cpu()
    if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        bad = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got {bad}")
    return mask.to(torch.bool)


def layout(input_ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[list[int], list[list[int]]]:
    """Each row's leading padding and its keys (:func:`prefixkv.base.tokens.key`) under ``mask`` (a bool tensor,
    ``None``: all ones). Does not mutate."""
    ids = input_ids.detach().cpu().tolist()
    if mask is None:
        return [0] * len(ids), ids
    pads = (mask.to(torch.long).cumsum(dim=1) == 0).sum(dim=1).tolist()
    visible = mask.tolist()
    return pads, [[key(t, v) for t, v in zip(row[p:], vis[p:])] for row, vis, p in zip(ids, visible, pads)]


def check_prompt(input_ids: Any, attention_mask: Any) -> tuple[list[int], list[list[int]]]:
    """Validate a prompt batch; return each row's pad count and keys (a mask with holes or right padding
    keys the hidden tokens apart, so their rows reuse and publish only what was computed under that mask)."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
        or input_ids.is_complex()
        or input_ids.dtype == torch.bool
    ):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"input_ids must be a 2-D integer tensor [batch, seq_len] (e.g. tokenizer(..., return_tensors='pt')), "
            f"got {shape}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)})")
    mask = None if attention_mask is None else check_mask(attention_mask, tuple(input_ids.shape))
    if mask is not None and not mask.any(dim=1).all():
        row = int((~mask.any(dim=1)).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask is all padding")
    return layout(input_ids, mask)


class RowSet:
    """The rows of one ``PagedPrefixCache`` over a store's ``blocks``: the columns every row has (``length``), how
    many of them each layer stored (``seen``), the pool slots of the forward's new columns and which of them to
    store (``new``, ``keep``: ``None`` for all), the namespace the reused and published K/V belong to (``space``;
    ``space_now`` says the store's namespace now, within user ``namespace``: the runner's prefills for these rows
    run in it too), whether forwards publish the blocks they fill, and what the
    prompt reused (``stats``)."""

    def __init__(
        self,
        blocks: BlockManager,
        num_layers: int,
        space_now: Callable[[], Hashable],
        namespace: str | None = None,
        *,
        states: states.StateLayers = (),
        silent: Sequence[int] = (),
        snapshots: states.Snapshots | None = None,
    ) -> None:
        self.blocks = blocks
        self.snapshots = snapshots
        # a model with recurrent layers: their faces holding each row's states, and the layers that never call
        # update (their count of columns moves at each forward's end)
        self.states = list(states)
        self.silent = list(silent)
        self.broken = False  # a forward raised half-way through the states, which cannot be rolled back
        self.namespace = namespace
        self.block_size = blocks.block_size
        self.rows: list[Row] = []
        self.length = 0
        self.seen = [0] * num_layers
        self.new = torch.zeros((0, 0), dtype=torch.long)
        self.keep: torch.Tensor | None = None
        self.space_now = space_now
        self.space: Hashable = space_now()
        # in an invariant store only the runner's chunk forwards publish
        self.publishes = blocks.chunk_size is None
        self.stats = CacheStats(0, 0, 0, ())
        self.images: vision.ImagePlan | None = None  # the prompt's images, keyed by what they are
        # a model with recurrent layers: where this call's own forwards take snapshots, and what the one running
        # captures for them (prefixkv.hf.states.recording)
        self.cuts: Cuts | None = None
        self._recording: tuple[int, Recorded] | None = None

    # -- a prompt --------------------------------------------------------------------------------

    def attach(
        self, store: StoreParts, pads: list[int], rows: list[list[int]], *, count: bool = True, chunks: bool = False
    ) -> None:
        """Start the rows (none yet) from prompt rows given as keys (token ids; ``-1 - id`` where a mask hides one)
        after ``pads`` leading pad columns: match each row, keep the batch to one offset, share or copy blocks. Rows
        that share a prefix the store does not hold yet get it computed once, first (in-batch sharing, by the
        store's runner). With ``count=False`` the lookup stays out of the store's statistics (that inner prefill).
        Mutates.

        In an invariant store (docs/correctness.md, "Outputs that never depend on the cache") each row first has its
        canonical chunks computed (:func:`chunk_end`, by the store's runner), reuses exactly those, and the cache
        publishes nothing: every K/V a later call may reuse comes from a canonical chunk forward. With ``chunks``
        the cache is such a forward's (the runner's): its one row, a whole number of chunks, reuses every whole
        chunk the store holds, and its forwards publish."""
        plan = self.images
        if plan is not None:  # an image's placeholders are keyed by the image (hf/vision.py)
            rows = [relabel(r, known) for r, known in zip(rows, plan.keys)]
        if self.states:
            self._attach_states(store, pads, rows, count=count, split=not chunks)
            return
        bs, chunk = self.block_size, store.settings.chunk_size
        self.publishes = chunk is None or chunks
        # one prompt token stays uncached (docs/how-it-works.md, "Reuse, step by step")
        caps = [len(r) - 1 for r in rows]
        held: list[int] | None = None
        offset = 0

        def choose(lengths: list[int]) -> list[int]:
            nonlocal offset
            matched = [min(n, c) for n, c in zip(lengths, caps)]
            if chunk is not None:
                matched = [m // chunk * chunk for m in matched]
            offset = min(p + m for p, m in zip(pads, matched))  # one offset per batch
            while plan is not None:  # nor inside any row's image (hf/vision.py: a forward feeds whole images)
                snapped = min(p + plan.snap(i, max(0, offset - p)) for i, p in enumerate(pads))
                if snapped == offset:
                    break
                offset = snapped
            return [max(0, offset - p) for p in pads]

        with contextlib.ExitStack() as prefills:
            if chunk is None:
                prefilled = store.runner.prefill_shared(rows, self.namespace) if len(rows) > 1 else []
            elif chunks:
                caps, prefilled = [len(r) for r in rows], []
            else:
                caps, prefilled = [chunk_end(r, chunk) for r in rows], []
                # what the runner computes stays locked until the rows hold it
                kept = [r[:c] for r, c in zip(rows, caps)]
                held = prefills.enter_context(store.runner.prefill_chunks(kept, self.namespace))
            claims, reused = self.blocks.claim(rows, self.space, choose)
        self.rows = [Row(p, keys, c, r // bs) for p, keys, c, r in zip(pads, rows, claims, reused)]
        for row, r in zip(self.rows, reused):
            row.real = real_count(row.keys[:r])
        self.length = offset
        self.seen = [offset] * len(self.seen)
        if held is not None:  # what the canonical prefill computed was computed by this call
            reused = [min(h, r) for h, r in zip(held, reused)]
        # the shared prefill's tokens were computed by this call: charge them to a row that reused them
        for cost, members in prefilled:
            j = max(members, key=lambda i: reused[i])
            reused[j] -= min(cost, reused[j])
        per_row = tuple(RowStats(len(t), r, len(t) - r) for t, r in zip(rows, reused))
        self.stats = CacheStats(
            sum(s.prompt_tokens for s in per_row), sum(reused), sum(s.computed_tokens for s in per_row), per_row
        )
        if count:
            self.blocks.ledger.count_query([len(t) for t in rows], reused)

    def _attach_states(
        self, store: StoreParts, pads: list[int], rows: list[list[int]], *, count: bool, split: bool
    ) -> None:
        """:meth:`attach` for a model with recurrent layers: a row reuses a prefix only up to a position where the
        store holds a snapshot of its states (and the K/V before it), at one column for every row (one offset per
        batch; a left-padded row at that column less its pads, where the store measured that the model keeps pads out
        of its state, else a padded batch reuses nothing and its stats say why). With ``split``, first each row's
        prompt up to its last token is computed by the runner, stopping at every position a later prompt may resume
        from (where the store's match ends: a junction; where two rows of the batch part), each stop snapshotted: the
        call then resumes at its last token. One unpadded row of a model whose forward can hand the states inside it
        (:func:`prefixkv.hf.states.records_inside`) is not computed first: the call's own forward takes the same
        snapshots on its way (:meth:`begin_cuts`), so the prompt costs one forward, as without a cache. Mutates."""
        snapshots, n, plan = store.snapshots, len(rows), self.images
        states.clear(self.states)
        self.publishes = True
        # a left-padded row resumes its unpadded prefix's snapshot only where the model keeps pads out of its state
        refusal = shapes.padded_refusal(store.hf_model) if any(pads) else None
        caps = [0 if refusal is not None else len(r) - 1 for r in rows]
        # what the store held before this call computed anything: the K/V an attention-only model would reuse
        held = [self.blocks.cached_length(r[: len(r) - 1], self.space) for r in rows] if split or count else [0] * n
        computed = [0] * n
        missed: str | None = None  # why the first row that resumes short of the K/V held does
        chosen: list[states.Snapshot | None] = [None] * n
        offset = 0
        # the call's own forward takes the snapshots where it can (no runner, no padding, no image)
        inside = (
            split
            and refusal is None
            and n == 1
            and not pads[0]
            and plan is None
            and store.settings.chunk_size is None
            and states.records_inside(store.hf_model)
        )
        planned: tuple[list[int], list[int]] | None = None

        def choose(lengths: list[int]) -> list[int]:
            nonlocal offset, chosen
            # the deepest column where every row holds a snapshot (at that column less its pads)
            c = min(p + min(m, cap) for p, m, cap in zip(pads, lengths, caps))
            while c > 0:
                if plan is not None:  # nor inside any row's image (hf/vision.py: a forward feeds whole images)
                    c = min(p + plan.snap(i, max(0, c - p)) for i, p in enumerate(pads))
                if any(c - p < 1 for p in pads):
                    c = 0
                    break
                found = [snapshots.find(self.space, r, c - p) for r, p in zip(rows, pads)]
                lowest = min(0 if f is None else p + f.position for f, p in zip(found, pads))
                if lowest == c:
                    chosen = found
                    break
                c = lowest
            offset = c
            return [max(0, c - p) for p in pads]

        with contextlib.ExitStack() as prefills:
            if split and refusal is None:
                for i, prompt in enumerate(rows):
                    stops, junctions, why = self._stops(store, rows, i, caps[i], held[i])
                    missed = missed or (why if n == 1 or not why else f"row {i}: {why}")
                    if stops and inside:
                        planned = (stops, junctions)
                    elif stops:
                        run = store.runner.prefill_states(prompt[: stops[-1]], stops, self.namespace, junctions)
                        computed[i] = prefills.enter_context(run)
            claims, reused = self.blocks.claim(rows, self.space, choose)
        if planned is not None:
            stops, junctions = planned
            positions = states.grid_positions(offset, [s for s in stops if s > offset], snapshots.step())
            self.cuts = states.Cuts(tuple(positions), frozenset(junctions))
        if offset:
            states.restore(self.states, [s for s in chosen if s is not None])
            for keys, snapshot in zip(rows, chosen):
                if snapshot is not None:
                    snapshots.use(self.space, keys, snapshot)
        self.rows = [Row(p, keys, c, r // self.block_size) for p, keys, c, r in zip(pads, rows, claims, reused)]
        for row, r in zip(self.rows, reused):
            row.real = real_count(row.keys[:r])
        self.length = offset
        self.seen = [offset] * len(self.seen)
        cached = [max(0, r - c) for r, c in zip(reused, computed)]
        per_row = tuple(RowStats(len(t), r, len(t) - r) for t, r in zip(rows, cached))
        self.stats = CacheStats(
            sum(x.prompt_tokens for x in per_row),
            sum(cached),
            sum(x.computed_tokens for x in per_row),
            per_row,
            f"a left-padded batch of this model reuses no prefix: {refusal[0]}; it is computed whole, its K/V kept"
            if refusal is not None
            else missed,
            split_tokens=sum(computed),
        )
        if count:
            self.blocks.ledger.count_query([len(t) for t in rows], cached)
            snapshots.count_kv_hits(sum(held))

    def _stops(
        self, store: StoreParts, rows: list[list[int]], i: int, cap: int, held: int
    ) -> tuple[list[int], list[int], str | None]:
        """Where the runner stops and snapshots row ``i`` (up to ``cap``, its last token excluded), which of those
        stops are junctions (where prompts part: kept longest, :class:`prefixkv.hf.states.Snapshots`), and why the
        row resumes short of the ``held`` tokens whose K/V the store holds (``None``: it does not). It stops at the
        store's match if no snapshot is there yet (a junction), where it parts from another row of the batch, and at
        ``cap`` (or the row's first image placeholder, which the runner cannot compute); only past the deepest snapshot
        the store holds, and nowhere if one is at ``cap`` already or the row has tokens its mask hides (the runner
        computes without the row's mask). The runner adds the grid's stops on the way (:func:`prefill_states`). Does
        not mutate."""
        row = rows[i]
        # the runner computes ids alone: never an image (hf/vision.py), so it stops before the first one
        cap = min(cap, next((t for t, k in enumerate(row) if is_image_key(k)), cap))
        if cap < 1 or any(k < 0 for k in row[:cap]):
            return [], [], None
        found = store.snapshots.find(self.space, row, cap)
        deepest = 0 if found is None else found.position
        match = min(held, cap)
        why = None
        if deepest < match:
            dropped = store.snapshots.why_missing(self.space, row, match)
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
        junctions = {match} | {common_length(row, other) for j, other in enumerate(rows) if j != i}
        kept = sorted(j for j in junctions if deepest < j < cap)
        return sorted({*kept, cap}), kept, why

    def keep_ends(self) -> None:
        """At the end of a call (the cache closes), for a model with recurrent layers: publish every proven,
        unpadded row's tokens, a last part-filled block included, and a snapshot of its states after them, so that
        the next turn of a chat resumes there. Mutates the store."""
        if not self.states or self.broken or not self.publishes or not self.rows:
            return
        for b, row in enumerate(self.rows):
            end = self.length - row.pad
            if not row.proven or row.pad or end < 1 or len(row.keys) != end or self.snapshots is None:
                continue
            found = self.snapshots.find(self.space, row.keys, end)
            if found is not None and found.position == end:
                continue  # the runner's last stop
            self.blocks.publish(row.claim, row.keys, known=row.published * self.block_size, end=end, space=self.space)
            self.snapshots.add(self.space, row.keys, states.take(self.states, b, end))

    def begin_cuts(self, start: int, q: int) -> None:
        """Before a forward of ``q`` columns after ``start``: have it capture the states at the call's cuts inside it
        (:attr:`cuts`; :meth:`end_cuts` takes the snapshots). Mutates."""
        cuts = self.cuts
        if cuts is None:
            return
        inner = [p - start for p in cuts.positions if start < p < start + q]
        self._recording = (start, states.start_recording(inner)) if inner else None

    def end_cuts(self, ok: bool) -> None:
        """After a forward (``ok``: it returned, and the cache is open): publish the first row's tokens up to each cut
        it reached, a last part-filled block included, and a snapshot of its states there; the cuts past it wait for
        the next forward. Mutates the store."""
        cuts, recording = self.cuts, self._recording
        if cuts is None:
            return
        self._recording = None
        if recording is not None:
            states.stop_recording()
        end = self.length
        row = self.rows[0] if self.rows else None
        if not ok or self.broken or row is None or not row.proven or self.snapshots is None:
            self.cuts = None
            return
        later = tuple(p for p in cuts.positions if p > end)
        self.cuts = states.Cuts(later, cuts.junctions) if later else None
        start, recorded = recording if recording is not None else (end, None)
        for p in cuts.positions:
            if not start < p <= end:
                continue
            if p == end:
                snapshot: states.Snapshot | None = states.take(self.states, 0, p)
            else:
                assert recorded is not None
                snapshot = states.snapshot_at(self.states, recorded, 0, recorded.cuts.index(p - start), p)
            if snapshot is None:
                continue
            known = row.published * self.block_size
            self.blocks.publish(row.claim, row.keys, known=known, end=p, space=self.space)
            self.snapshots.add(self.space, row.keys, snapshot, junction=p in cuts.junctions)

    def snapshot_row(self, snapshots: states.Snapshots, *, junction: bool = False) -> None:
        """Publish the one row's tokens (a last part-filled block included) and a snapshot of its states after them
        (the runner's stops; a ``junction`` is kept longest). Mutates the store."""
        (row,) = self.rows
        end = self.length  # the row's keys are its whole prompt's from the start; its columns, what was computed
        self.blocks.publish(row.claim, row.keys, known=row.published * self.block_size, end=end, space=self.space)
        snapshots.add(self.space, row.keys, states.take(self.states, 0, end), junction=junction)

    def note_silent(self, ok: bool) -> None:
        """At a forward's end: the layers that write no K/V now count its columns too (``ok``: it returned);
        a forward that raised leaves the recurrent states half-updated. Mutates."""
        if ok:
            for i in self.silent:
                self.seen[i] = self.length
        elif self.states:
            self.broken = True

    def reattach(self, store: StoreParts, pads: list[int], rows: list[list[int]], space: Hashable) -> None:
        """Give back what construction reused and attach ``rows`` again, under ``space``, as the lookup of the
        same call (the store counts it once). Mutates."""
        before = self.stats.per_row
        self.release()
        self.length = 0
        self.space = space
        self.blocks.ledger.count_query([r.prompt_tokens for r in before], [r.cached_tokens for r in before], undo=True)
        self.attach(store, pads, rows)

    def drop_reuse(self) -> None:
        """Give back every held column, so the next forward recomputes the sequence from its start. Mutates."""
        self.truncate(0)
        before = self.stats.per_row
        per_row = tuple(RowStats(r.prompt_tokens, 0, r.prompt_tokens) for r in before)
        self.stats = CacheStats(self.stats.prompt_tokens, 0, self.stats.prompt_tokens, per_row, self.stats.not_cached)
        # the store counted this lookup's reuse at construction: count it as the miss it has become
        prompts = [r.prompt_tokens for r in before]
        self.blocks.ledger.count_query(prompts, [r.cached_tokens for r in before], undo=True)
        self.blocks.ledger.count_query(prompts, [0] * len(prompts))

    # -- one forward -----------------------------------------------------------------------------

    def allocate(self, forward: proof.ForwardInputs, batch: int, q: int) -> int:
        """Fit the rows to the forward's ``batch``, then claim blocks (and copies of shared part-blocks about to be
        written) for its ``q`` new columns; where they start. Mutates."""
        if self.broken:
            raise CacheMisuseError(
                "an earlier forward with this cache raised half-way, and the recurrent layers' states it left cannot "
                "be rolled back; build a new PagedPrefixCache"
            )
        if self.length != min(self.seen):
            self.truncate(min(self.seen))  # an earlier forward raised half-way: drop its columns
        self._fit_batch(batch, forward)
        start, rows = self.length, self.rows
        self.blocks.extend(
            [row.claim for row in rows], [(max(0, start - row.pad), start + q - row.pad) for row in rows]
        )
        self.new, self.keep = new_slots(rows, start, q, self.block_size)
        self.length = start + q
        return start

    def _fit_batch(self, batch: int, forward: proof.ForwardInputs) -> None:
        """Rows for a first forward of a cache built without a prompt, or the rows repeated for a batch that
        ``generate`` expanded (``num_return_sequences``, beams). Mutates."""
        if not self.rows:
            pads = [0] * batch
            mask, q = forward.attention_mask, forward.fed.shape[1] if forward.fed is not None else 0
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= q:
                pads = (mask[:, : self.length + q].to(torch.long).cpu().cumsum(dim=1) == 0).sum(dim=1).tolist()
            known = forward.input_ids is not None and self.length == 0
            claims = self.blocks.empty_claims(batch)
            self.rows = [Row(p, [] if known else None, c, 0) for p, c in zip(pads, claims)]
        elif batch != len(self.rows):
            if batch % len(self.rows):
                raise CacheMisuseError(
                    f"this cache holds {len(self.rows)} rows but the forward feeds {batch}; "
                    "build the cache from the same batch you pass to generate"
                )
            self.select([i for i in range(len(self.rows)) for _ in range(batch // len(self.rows))])

    def prove(self, forward: proof.ForwardInputs, start: int, *, training: bool, reused: bool) -> None:
        """Apply the proof's verdicts (docs/correctness.md, "Publish only what is proven") to every row: record
        the new keys of a proven row, forget an unproven one, raise where the forward contradicts the prompt or
        what construction ``reused``. Mutates."""
        rows = self.rows
        why = proof.unproven(forward, training=training, space=self.space_now, held_space=self.space)
        verdicts = None if why else proof.prove_rows(forward, rows, start, reused=reused)
        if verdicts is None:
            self.not_cached(why or "positions or a mask that do not follow the ids")
            for row in rows:
                row.forget()
            return
        for row, verdict in zip(rows, verdicts):
            if verdict is None:
                continue
            if verdict.error is not None:
                raise CacheMisuseError(verdict.error)
            if verdict.keys is None:
                row.forget()
                continue
            row.keys.extend(verdict.keys)
            row.real += verdict.shown

    def not_cached(self, why: str) -> None:
        """Note in the stats why this cache's K/V are not kept (the first reason given). Mutates."""
        if self.stats.not_cached is None:
            self.stats = dataclasses.replace(self.stats, not_cached=why)

    def publish_full(self) -> None:
        """Publish every proven row's blocks that became full, so later calls can reuse them. Mutates."""
        bs = self.block_size
        for row in self.rows:
            if not row.proven:
                continue
            full = max(0, self.length - row.pad) // bs
            if full > row.published:
                known = row.published * bs  # on the path of the row's trie node: publish continues from it
                self.blocks.publish(row.claim, row.keys, known=known, end=full * bs, space=self.space)
                row.published = full

    def publish_all(self) -> None:
        """Publish every token of the one row, a last part-filled block included (what ``PrefixStore.pin`` keeps; a
        forward publishes whole blocks only). Raises :class:`CacheMisuseError` when its K/V could not be proven to be
        those of its ids. Mutates."""
        (row,) = self.rows
        if not row.proven:
            raise CacheMisuseError("the prefill's K/V could not be proven to be those of its ids; nothing pinned")
        bs = self.block_size
        self.blocks.publish(row.claim, row.keys, known=row.published * bs, end=len(row.keys), space=self.space)

    # -- row surgery -----------------------------------------------------------------------------

    def select(self, indices: list[int]) -> None:
        """Row ``i`` becomes old row ``indices[i]``, sharing its blocks. Mutates."""
        if indices == list(range(len(self.rows))):
            return
        claims = self.blocks.fork([self.rows[j].claim for j in indices])
        rows = [self.rows[j].clone(c) for j, c in zip(indices, claims)]
        self.release()
        self.rows = rows
        states.select(self.states, indices)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` columns. Mutates."""
        bs = self.block_size
        if self.states and length != self.length:
            if length:
                raise CacheMisuseError(
                    f"cannot cut this cache back from {self.length} to {length} columns: a recurrent layer's state "
                    "cannot be rolled back; build a new PagedPrefixCache"
                )
            states.clear(self.states)
        keeps = [max(0, length - row.pad) for row in self.rows]
        self.blocks.truncate([row.claim for row in self.rows], [-(-keep // bs) for keep in keeps])
        for row, keep in zip(self.rows, keeps):
            row.truncate(keep, bs)
        self.length = length
        self.seen = [length] * len(self.seen)

    def fork(self, state_layers: states.StateLayers = ()) -> RowSet:
        """A second row set holding the same columns, sharing their blocks (copy-on-write); its recurrent states, in
        ``state_layers`` (the other cache's), copies of these."""
        other = RowSet(
            self.blocks,
            len(self.seen),
            self.space_now,
            self.namespace,
            states=state_layers,
            silent=self.silent,
            snapshots=self.snapshots,
        )
        states.copy(self.states, other.states)
        other.broken = self.broken
        claims = self.blocks.fork([row.claim for row in self.rows])
        other.rows = [row.clone(c) for row, c in zip(self.rows, claims)]
        other.length, other.seen = self.length, list(self.seen)
        other.stats, other.space, other.publishes = self.stats, self.space, self.publishes
        return other

    def release(self) -> None:
        """Give every row's blocks back and forget the rows (the columns stay counted until :meth:`reset`).
        Mutates."""
        rows, self.rows = self.rows, []
        self.blocks.release([row.claim for row in rows])

    def reset(self) -> None:
        """Give every block back, forget the rows and their columns. Mutates."""
        self.release()
        self.length = 0
        self.seen = [0] * len(self.seen)
        states.clear(self.states)
        self.broken = False

    def held_blocks(self) -> Counter[int]:
        """How many of the rows' table entries name each block. Does not mutate."""
        return Counter(b for row in self.rows for b in row.table)
