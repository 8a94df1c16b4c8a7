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

The rows of one cache are a :class:`RowSet`: it attaches a prompt (by the rules of :mod:`prefixkv.hf.resume`),
allocates a forward's columns, applies the proof's verdicts, publishes, crops, selects and forks rows, all through the
block manager's claim contract (docs/how-it-works.md, "The block manager"); it never calls the cache."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..base.errors import CacheMisuseError
from ..base.slots import slot_table
from ..base.stats import CacheStats, RowStats
from ..base.tokens import key, relabel
from ..kv.holdings import Claim
from ..kv.key_space import SpaceNow
from ..kv.manager import BlockManager
from . import proof, resume, states, vision
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


def first_rows(blocks: BlockManager, forward: proof.ForwardInputs, batch: int, length: int) -> list[Row]:
    """Rows for a first forward of ``batch`` rows of a cache built without a prompt (``length`` columns so far):
    their leading pads read from the forward's mask, their keys known when it feeds ids from the start. Mutates
    ``blocks`` (registers their empty claims)."""
    pads = [0] * batch
    mask, q = forward.attention_mask, forward.fed.shape[1] if forward.fed is not None else 0
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= q:
        pads = (mask[:, : length + q].to(torch.long).cpu().cumsum(dim=1) == 0).sum(dim=1).tolist()
    known = forward.input_ids is not None and length == 0
    claims = blocks.empty_claims(batch)
    return [Row(p, [] if known else None, c, 0) for p, c in zip(pads, claims)]


class RowSet:
    """The rows of one ``PagedPrefixCache`` over a store's ``blocks``: the columns every row has (``length``), how
    many of them each layer stored (``seen``), the pool slots of the forward's new columns and which of them to
    store (``new``, ``keep``: ``None`` for all), the namespace the reused and published K/V belong to (``space``;
    ``space_now`` says the store's namespace now, within user ``namespace``: the runner's prefills for these rows
    run in it too), whether forwards publish the blocks they fill, and what the prompt reused (``stats``)."""

    def __init__(
        self,
        blocks: BlockManager,
        num_layers: int,
        space_now: SpaceNow,
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
        self.cuts: Cuts | None = None  # where this call's own forwards take snapshots (resume.begin_cuts)
        self.recording: tuple[int, Recorded] | None = None

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
        canonical chunks computed (:func:`prefixkv.hf.resume.chunk_end`, by the store's runner), reuses exactly
        those, and the cache publishes nothing: every K/V a later call may reuse comes from a canonical chunk
        forward. With ``chunks`` the cache is such a forward's (the runner's): its one row, a whole number of chunks,
        reuses every whole chunk the store holds, and its forwards publish. The rules of reuse, for K/V and for a
        model with recurrent layers (the snapshot rules), are :mod:`prefixkv.hf.resume`'s."""
        plan = self.images
        if plan is not None:  # an image's placeholders are keyed by the image (hf/vision.py)
            rows = [relabel(r, known) for r, known in zip(rows, plan.keys)]
        # in an invariant store only the runner's chunk forwards publish, for K/V and for recurrent states alike
        self.publishes = store.settings.chunk_size is None or chunks
        if self.states:
            states.clear(self.states)
            start = resume.attach_states(self, store, pads, rows, plan, self.namespace, count=count, split=not chunks)
            self.cuts = start.cuts
        else:
            start = resume.attach_kv(
                self.blocks, store, self.space, self.namespace, plan, pads, rows, count=count, chunks=chunks
            )
        bs = self.block_size
        self.rows = [Row(p, keys, c, r // bs) for p, keys, c, r in zip(pads, rows, start.claims, start.reused)]
        for row, r in zip(self.rows, start.reused):
            row.real = real_count(row.keys[:r])
        self.length = start.offset
        self.seen = [start.offset] * len(self.seen)
        self.stats = start.stats

    def note_silent(self, ok: bool) -> None:
        """At a forward's end: the layers that write no K/V count its columns too (``ok``: it returned);
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
        """Fit the rows to the forward's ``batch`` (rows for a first forward of a cache built without a prompt, or the
        rows repeated for a batch that ``generate`` expanded), then claim blocks (and copies of shared part-blocks
        about to be written) for its ``q`` new columns; where they start. Mutates."""
        if self.broken:
            raise CacheMisuseError(
                "an earlier forward with this cache raised half-way, and the recurrent layers' states it left cannot "
                "be rolled back; build a new PagedPrefixCache"
            )
        if self.length != min(self.seen):
            self.truncate(min(self.seen))  # an earlier forward raised half-way: drop its columns
        if not self.rows:  # a first forward of a cache built without a prompt
            self.rows = first_rows(self.blocks, forward, batch, self.length)
        elif batch != len(self.rows):  # the rows repeated for a batch generate expanded (num_return_sequences, beams)
            if batch % len(self.rows):
                raise CacheMisuseError(
                    f"this cache holds {len(self.rows)} rows but the forward feeds {batch}; "
                    "build the cache from the same batch you pass to generate"
                )
            self.select([i for i in range(len(self.rows)) for _ in range(batch // len(self.rows))])
        start, rows = self.length, self.rows
        self.blocks.extend(
            [row.claim for row in rows], [(max(0, start - row.pad), start + q - row.pad) for row in rows]
        )
        self.new, self.keep = new_slots(rows, start, q, self.block_size)
        self.length = start + q
        return start

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
