"""``PagedPrefixCache``: the per-call ``transformers.Cache`` whose rows are block tables into a store.

Life of a call. At construction the prompt of each row is matched in the trie; matched whole blocks are
shared (refcount), a matched part-block is copied (copy-on-write), and ``get_seq_length`` reports the
reused columns so ``generate`` only prefills the rest. Before each forward the model hook hands over the
forward's inputs (:class:`prefixkv.proof.ForwardInputs`; the cache itself only ever sees K and V), and
:func:`begin_forward` allocates their slots, applies the proof's verdicts and plans the reads; ``update`` writes
K/V there and hands the attention what the plan says; :func:`end_forward` publishes the blocks that became full.
``close()`` (or dropping the last reference: no reference cycle keeps a cache alive) gives every block back.

The rows (pads, keys, claims) are :mod:`prefixkv.rows`; the proof that their K/V are those of their keys
(docs/correctness.md, "Publish only what is proven") is :mod:`prefixkv.proof`; the first-step protocol of a
``generate`` call is :mod:`prefixkv.call`; the read plan is :mod:`prefixkv.reads`. The module functions
(:func:`begin_forward`, :func:`end_forward`, :func:`plan_call`, :func:`attach_prompt`, :func:`publish_all`) are
prefixkv's own protocol with a cache, for the model hooks and the runner; a user never calls them.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Hashable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _compat, attention, display, proof, reads
from .call import Drop, GenerateCall
from .errors import CacheMisuseError
from .rows import Row, check_prompt, chunk_end, new_slots, real_count
from .stats import CacheStats, RowStats
from .store import PrefixStore


@_compat.adapt_cache
class _PagedLayer(CacheLayerMixin):
    """The per-layer face transformers expects; all state lives in the owning cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedPrefixCache, layer_idx: int) -> None:
        super().__init__()
        # a weak reference: a strong one would make every cache a cycle that only the cyclic garbage collector
        # frees, so `del cache` would not give the blocks back (docs/correctness.md, "Releasing caches")
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    @property
    def _cache(self) -> PagedPrefixCache:
        cache = self._cache_ref()
        if cache is None:
            raise CacheMisuseError("the PagedPrefixCache of this layer was garbage-collected")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(key_states, value_states, self._layer_idx)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None


@_compat.adapt_cache
class PagedPrefixCache(Cache):
    """A ``transformers`` cache whose KV lives in a :class:`PrefixStore`'s shared blocks.

    Build one per ``generate`` call. With ``input_ids`` (and, for a padded batch, ``attention_mask``)
    each row's longest cached prefix is attached at construction, so ``generate`` only prefills the rest;
    at least the last prompt token is always recomputed. Close it (``close()``, ``with``) to give its
    blocks back; what it computed stays cached in the store for later calls.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> ids = torch.arange(1, 12).unsqueeze(0)
    >>> with prefixkv.PagedPrefixCache(store, ids) as cache:
    ...     out = model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    >>> cache.stats.cached_tokens, cache.stats.computed_tokens
    (0, 11)
    """

    def __init__(
        self,
        store: PrefixStore,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(store, PrefixStore):
            raise TypeError(f"PagedPrefixCache needs a PrefixStore, got {type(store).__name__}")
        self.store = store
        self._blocks = blocks = store.blocks  # the store's claim contract
        self._bs = blocks.block_size
        num_layers = len(blocks.pool.specs)
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])
        self._rows: list[Row] = []
        self._length = 0
        self._seen = [0] * num_layers
        # this forward's slots of the new columns and which of them to store (None: all), and its read plan
        self._new = torch.zeros((0, 0), dtype=torch.long)
        self._keep: torch.Tensor | None = None
        self._plan: reads.ForwardReads | None = None
        self._reader = attention.Reader(
            blocks.pool, blocks.gather, self._bs, model=store.hf_model, model_dtype=store.model_dtype,
            invariant=store.invariant,
        )  # fmt: skip
        self._owner: int | None = None
        self._guard = threading.Lock()
        self._is_closed = False
        self._release_pending = False  # closed from another thread mid-forward: that forward releases at its end
        self._stats = CacheStats(0, 0, 0, ())
        # the store's namespace (active adapters) that the reused and published K/V belong to
        self._space: Hashable = blocks.space()
        # whether a forward publishes the blocks it filled (in an invariant store, only the runner's chunk forwards)
        self._publishes = store.chunk_size is None
        blocks.ensure_open()
        self._generate: GenerateCall = GenerateCall(None)
        if input_ids is not None:
            pads, keys = check_prompt(input_ids, attention_mask)
            self._generate = GenerateCall(input_ids.cpu().tolist())
            self._attach(pads, keys)
        elif attention_mask is not None:
            raise ValueError("attention_mask was given without input_ids")

    @property
    def stats(self) -> CacheStats:
        """Prompt tokens reused and computed, per row and in total (fixed at construction)."""
        return self._stats

    # -- construction ----------------------------------------------------------------------------

    def _attach(self, pads: list[int], rows: list[list[int]], *, count: bool = True, chunks: bool = False) -> None:
        """:func:`attach_prompt`. Mutates."""
        store, bs, chunk = self.store, self._bs, self.store.chunk_size
        self._publishes = chunk is None or chunks
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
            return [max(0, offset - p) for p in pads]

        with contextlib.ExitStack() as prefills:
            if chunk is None:
                prefilled = store.runner.prefill_shared(store, rows) if len(rows) > 1 else []
            elif chunks:
                caps, prefilled = [len(r) for r in rows], []
            else:
                caps, prefilled = [chunk_end(r, chunk) for r in rows], []
                # what the runner computes stays locked until the rows hold it
                held = prefills.enter_context(store.runner.prefill_chunks(store, [r[:c] for r, c in zip(rows, caps)]))
            claims, reused = store.blocks.claim(rows, self._space, choose)
        self._rows = [Row(p, keys, c, r // bs) for p, keys, c, r in zip(pads, rows, claims, reused)]
        for row, r in zip(self._rows, reused):
            row.real = real_count(row.keys[:r])
        self._length = offset
        self._seen = [offset] * len(self._seen)
        if held is not None:  # what the canonical prefill computed was computed by this call
            reused = [min(h, r) for h, r in zip(held, reused)]
        # the shared prefill's tokens were computed by this call: charge them to a row that reused them
        for cost, members in prefilled:
            j = max(members, key=lambda i: reused[i])
            reused[j] -= min(cost, reused[j])
        per_row = tuple(RowStats(len(t), r, len(t) - r) for t, r in zip(rows, reused))
        self._stats = CacheStats(
            sum(s.prompt_tokens for s in per_row), sum(reused), sum(s.computed_tokens for s in per_row), per_row
        )
        if count:
            store.blocks.count_query([len(t) for t in rows], reused)

    def _publish_all(self) -> None:
        """:func:`publish_all`. Mutates."""
        (row,) = self._rows
        if not row.proven:
            raise CacheMisuseError("the prefill's K/V could not be proven to be those of its ids; nothing pinned")
        self._blocks.publish(row.claim, row.keys, known=row.published * self._bs, end=len(row.keys), space=self._space)

    # -- the generate-call protocol --------------------------------------------------------------

    def activate_past_recording(self) -> None:
        """Assisted and prompt-lookup decoding call this before their first forward, which feeds the whole
        sequence again (docs/how-it-works.md, "One forward, and the first step of a call"); that forward will
        then skip the columns already held. Mutates."""
        self._generate.refeed = True

    def _plan_call(
        self, input_ids: torch.Tensor, next_sequence_length: int | None, kwargs: dict[str, Any]
    ) -> int | None:
        """:func:`plan_call`: apply :class:`prefixkv.call.GenerateCall`'s decisions. Mutates."""
        if self._is_closed:
            raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
        call = self._generate
        refeed = call.take_refeed()
        if input_ids.dim() != 2:
            return next_sequence_length
        if not call.computed and self._replan(input_ids, kwargs):
            embeds = kwargs.get("inputs_embeds")
            width = embeds.shape[1] if isinstance(embeds, torch.Tensor) else input_ids.shape[1]
            return None if next_sequence_length is None and self._length == 0 else width - self._length
        held = self._length
        if held == 0:
            return next_sequence_length
        if next_sequence_length is None and not refeed:
            call.check_new_tokens(
                self._rows, held, input_ids.shape[1], kwargs.get("attention_mask"), kwargs.get("position_ids")
            )
            return None
        call.check_continues(self._rows, held, input_ids)
        if next_sequence_length is not None:
            return next_sequence_length
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            warnings.warn(
                "prefixkv: assisted or prompt-lookup decoding with output_attentions/output_hidden_states "
                "recomputes the whole prompt, so prefix reuse is off for this generate call",
                stacklevel=4,
            )
            self._drop_reuse()
            return None
        return input_ids.shape[1] - held

    def _replan(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Redo or drop construction's reuse as the call's first step decides; whether what the cache holds
        changed. Mutates."""
        space = self._blocks.space()
        training = self.store.hf_model.training
        decision = self._generate.replan(
            self._rows, input_ids, kwargs, training=training, space=space, held_space=self._space
        )
        if decision is None:
            return False
        if isinstance(decision, Drop):
            had = self._length
            self._drop_reuse()
            for row in self._rows:
                row.forget()
            warnings.warn(
                f"prefixkv: {decision.why}: this PagedPrefixCache neither reuses nor publishes cached K/V in this "
                "generate call",
                stacklevel=5,
            )
            return had > 0
        before = self._stats.per_row
        self._blocks.release([row.claim for row in self._rows])
        self._rows = []
        self._length = 0
        self._space = decision.space
        self._blocks.count_query([r.prompt_tokens for r in before], [r.cached_tokens for r in before], undo=True)
        self._attach(decision.pads, decision.keys)
        return True

    def _drop_reuse(self) -> None:
        """Give back every held column, so the next forward recomputes the sequence from its start. Mutates."""
        self._truncate(0)
        before = self._stats.per_row
        per_row = tuple(RowStats(r.prompt_tokens, 0, r.prompt_tokens) for r in before)
        self._stats = CacheStats(self._stats.prompt_tokens, 0, self._stats.prompt_tokens, per_row)
        # the store counted this lookup's reuse at construction: count it as the miss it has become
        prompts = [r.prompt_tokens for r in before]
        self._blocks.count_query(prompts, [r.cached_tokens for r in before], undo=True)
        self._blocks.count_query(prompts, [0] * len(prompts))

    # -- one forward -----------------------------------------------------------------------------

    def _begin(self, forward: proof.ForwardInputs) -> None:
        """:func:`begin_forward`. Mutates."""
        self._own()
        if self._length != min(self._seen):
            self._truncate(min(self._seen))  # an earlier forward raised half-way: drop its columns
        x = forward.fed
        if x is None:
            raise CacheMisuseError("a forward with a PagedPrefixCache needs input_ids or inputs_embeds")
        self._fit_batch(x.shape[0], forward)
        start, q = self._length, x.shape[1]
        # allocation first: it may raise CapacityError, and the keys the proof records must then not be there yet;
        # if the proof raises, the next forward drops the allocated columns (the `_seen` check above)
        self._allocate(q)
        self._prove(forward, start)
        self._generate.computed = True
        self._plan = self._reader.plan([r.pad for r in self._rows], [r.table for r in self._rows], start, q)

    def _own(self) -> None:
        me = threading.get_ident()
        with self._guard:
            if self._is_closed:
                raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
            if self._owner is not None and self._owner != me:
                raise CacheMisuseError(
                    "this PagedPrefixCache is in use by a generate call in another thread; "
                    "give each concurrent call its own cache"
                )
            self._owner = me

    def _fit_batch(self, batch: int, forward: proof.ForwardInputs) -> None:
        """Rows for a first forward of a cache built without a prompt, or the rows repeated for a batch that
        ``generate`` expanded (``num_return_sequences``, beams). Mutates."""
        if not self._rows:
            pads = [0] * batch
            mask, q = forward.attention_mask, forward.fed.shape[1] if forward.fed is not None else 0
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] >= q:
                pads = (mask[:, : self._length + q].to(torch.long).cpu().cumsum(dim=1) == 0).sum(dim=1).tolist()
            known = forward.input_ids is not None and self._length == 0
            claims = self._blocks.empty_claims(batch)
            self._rows = [Row(p, [] if known else None, c, 0) for p, c in zip(pads, claims)]
        elif batch != len(self._rows):
            if batch % len(self._rows):
                raise CacheMisuseError(
                    f"this cache holds {len(self._rows)} rows but the forward feeds {batch}; "
                    "build the cache from the same batch you pass to generate"
                )
            self._select([i for i in range(len(self._rows)) for _ in range(batch // len(self._rows))])

    def _allocate(self, q: int) -> None:
        """Blocks (and copies of shared part-blocks about to be written) for ``q`` new columns. Mutates."""
        start = self._length
        spans = [(max(0, start - row.pad), start + q - row.pad) for row in self._rows]
        self._blocks.extend([row.claim for row in self._rows], spans)
        self._new, self._keep = new_slots(self._rows, start, q, self._bs)
        self._length = start + q

    def _prove(self, forward: proof.ForwardInputs, start: int) -> None:
        """Apply the proof's verdicts (docs/correctness.md, "Publish only what is proven") to every row: record
        the new keys of a proven row, forget an unproven one, raise where the forward contradicts the prompt or
        what construction reused. Mutates."""
        blocks, rows = self.store.blocks, self._rows
        why = proof.unproven(forward, training=self.store.hf_model.training, space=blocks.space, held_space=self._space)
        verdicts = (
            None if why else proof.prove_rows(forward, rows, start, reused=not self._generate.computed and start > 0)
        )
        if verdicts is None:
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

    def _end(self, ok: bool) -> None:
        """:func:`end_forward`. Mutates."""
        if self._owner != threading.get_ident():
            return  # begin_forward refused this forward (the cache is another thread's): nothing of ours ran
        plan, self._plan = self._plan, None
        if ok and plan is not None and plan.probe and plan.every_layer_served():
            attention.mark_verified(self.store.hf_model)
        try:
            if ok and not self._is_closed and self._publishes:
                self._publish_full()
        finally:
            with self._guard:
                self._owner = None
                release, self._release_pending = self._release_pending, False
            if release:
                self._release()

    def _publish_full(self) -> None:
        """Publish every proven row's blocks that became full, so later calls can reuse them. Mutates."""
        bs, blocks = self._bs, self.store.blocks
        for row in self._rows:
            if not row.proven:
                continue
            full = max(0, self._length - row.pad) // bs
            if full > row.published:
                known = row.published * bs  # on the path of the row's trie node: publish continues from it
                blocks.publish(row.claim, row.keys, known=known, end=full * bs, space=self._space)
                row.published = full

    # -- transformers Cache interface ------------------------------------------------------------

    @attention.outside_compile
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (``[B, kv_heads, q, head_dim]``) into their slots and return what the forward's
        attention reads: the new K/V themselves when it reads the pool in place, else the layer's whole K/V read
        from the blocks, ``[B, kv_heads, columns, head_dim]``."""
        plan = self._plan
        if self._owner != threading.get_ident() or plan is None:
            raise CacheMisuseError(
                "PagedPrefixCache.update was called outside a forward of the model its PrefixStore was built "
                "for (or after the store was closed); pass the cache to that model"
            )
        if self._is_closed:
            raise CacheMisuseError(
                "this PagedPrefixCache was closed during the forward (close() from another thread cancels the "
                "generate call using it); its blocks are given back when the forward ends"
            )
        _check_layer(self.store, key_states, layer_idx, self._seen[layer_idx], self._length)
        device = key_states.device
        keep = None if self._keep is None else self._keep.to(device)
        self._blocks.write(layer_idx, self._new.to(device), key_states, value_states, keep)
        self._seen[layer_idx] = self._length
        if plan.in_place:
            _hand_out(plan, layer_idx, key_states)
            return key_states, value_states
        keys, values = plan.gather(layer_idx)
        if keys.dtype != key_states.dtype:
            keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
        if plan.probe:
            _hand_out(plan, layer_idx, keys)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns stored for ``layer_idx`` (pads included), a Python int."""
        return self._seen[layer_idx] if layer_idx < len(self._seen) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``, sharing its blocks. Mutates."""
        self._select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([i for i in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (a negative int, as in ``DynamicCache``). Mutates."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove:
            self._truncate(max(0, self._length + tokens_to_remove))

    def reset(self) -> None:
        """Give every block back and forget the rows; the cache can start a new sequence. Mutates."""
        self._release()
        self._length = 0
        self._seen = [0] * len(self._seen)

    # -- row surgery -----------------------------------------------------------------------------

    def _select(self, indices: list[int]) -> None:
        if indices == list(range(len(self._rows))):
            return
        claims = self._blocks.fork([self._rows[j].claim for j in indices])
        rows = [self._rows[j].clone(c) for j, c in zip(indices, claims)]
        self._release()
        self._rows = rows

    def _truncate(self, length: int) -> None:
        bs = self._bs
        keeps = [max(0, length - row.pad) for row in self._rows]
        self._blocks.truncate([row.claim for row in self._rows], [-(-keep // bs) for keep in keeps])
        for row, keep in zip(self._rows, keeps):
            row.truncate(keep, bs)
        self._length = length
        self._seen = [length] * len(self._seen)

    def _held_blocks(self) -> Counter[int]:
        """How many of the rows' table entries name each block. Does not mutate."""
        return Counter(b for row in self._rows for b in row.table)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Give the blocks back to the store (what was published stays cached). Idempotent.

        Called from another thread while a forward uses this cache (a cancel), it stops that forward at its
        next layer and the blocks are given back when the forward ends, never while it may still write."""
        with self._guard:
            if self._is_closed:
                return
            self._is_closed = True
            if self._owner is not None and self._owner != threading.get_ident():
                self._release_pending = True
                return
        self._release()

    def _release(self) -> None:
        rows, self._rows = self._rows, []
        self._blocks.release([row.claim for row in rows])

    def __enter__(self) -> PagedPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # at interpreter shutdown, or for a half-built cache, there may be nothing left to give back to; a cache
        # nobody references has no forward running, so a release still pending happens here. A plain try: at
        # shutdown this module's globals (contextlib among them) may already be None
        try:
            if self._release_pending:
                self._release_pending = False
                self._release()
            else:
                self.close()
        except Exception:  # a finalizer must not raise, and has no one to report to
            pass

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedPrefixCache:
        """A second cache holding the same columns, sharing their blocks (copy-on-write), on the same store:
        transformers' recipe of copying a prompt's cache for each continuation, without copying K/V."""
        if self._is_closed:
            raise CacheMisuseError("this PagedPrefixCache is closed; there is nothing to copy")
        if self._owner is not None:
            raise CacheMisuseError("a PagedPrefixCache cannot be copied while a forward uses it")
        other = PagedPrefixCache(self.store)
        claims = self._blocks.fork([row.claim for row in self._rows])
        other._rows = [row.clone(c) for row, c in zip(self._rows, claims)]
        other._length, other._seen = self._length, list(self._seen)
        other._stats, other._space, other._publishes = self._stats, self._space, self._publishes
        other._generate = GenerateCall(self._generate.prompt_ids)
        other._generate.computed = self._generate.computed
        return other

    @property
    def closed(self) -> bool:
        """Whether the cache gave its blocks back (``close()``). Does not mutate."""
        return self._is_closed

    def block_tables(self) -> list[display.RowTable]:
        """Each row's leading padding, block table, and which of its blocks something else holds too (the
        trie, another row, another cache); empty once closed. Does not mutate."""
        rows = list(self._rows)
        views = self._blocks.table_view([row.claim for row in rows])
        return [display.RowTable(row.pad, v.blocks, v.shared) for row, v in zip(rows, views)]

    def __repr__(self) -> str:
        s = self._stats
        state = "closed" if self._is_closed else f"{len(self._rows)} rows x {self._length} columns"
        return (
            f"PagedPrefixCache({state}, prompt_tokens={s.prompt_tokens}, cached_tokens={s.cached_tokens}, "
            f"computed_tokens={s.computed_tokens})"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: reused and computed prompt tokens per row, and each row's block table."""
        return display.cache_html(self)


def _check_layer(store: PrefixStore, key_states: torch.Tensor, layer_idx: int, seen: int, length: int) -> None:
    """Raise :class:`CacheMisuseError` unless ``key_states`` fit the store's layer ``layer_idx`` and a forward that
    allocated ``length - seen`` columns for it."""
    specs = store.blocks.pool.specs
    if layer_idx >= len(specs):
        raise CacheMisuseError(f"layer {layer_idx} does not exist in a store built for {len(specs)} layers")
    spec = specs[layer_idx]
    if key_states.shape[1] != spec.kv_heads or key_states.shape[-1] != spec.head_dim:
        raise CacheMisuseError(
            f"layer {layer_idx} gives K of {key_states.shape[1]} heads x {key_states.shape[-1]}, but the store "
            f"was built for {spec.kv_heads} x {spec.head_dim}: this cache's store belongs to another model"
        )
    if key_states.device != spec.device or key_states.dtype != store.model_dtype:
        raise CacheMisuseError(
            f"layer {layer_idx} now computes in {key_states.dtype} on {key_states.device}, but the store was "
            f"built for {store.model_dtype} on {spec.device}: the model was moved or cast after the "
            "PrefixStore was built; build a new store"
        )
    q = key_states.shape[-2]
    if seen + q != length:
        raise CacheMisuseError(f"layer {layer_idx} got {q} new tokens but this forward allocated {length - seen}")


def _hand_out(plan: reads.ForwardReads, layer: int, key: torch.Tensor) -> None:
    """Note that ``update`` returns ``key`` for ``layer``, on the tensor itself (:data:`prefixkv.reads.TAG`), so that
    only the attention call of that layer, with that tensor, reads the plan. Mutates ``plan`` and ``key``."""
    plan.handed.add(layer)
    setattr(key, reads.TAG, (plan, layer))


# -- prefixkv's own protocol with a cache: the model hooks (prefixkv.hooks) and the runner (prefixkv.runner) ---------


def attach_prompt(
    cache: PagedPrefixCache, pads: list[int], rows: list[list[int]], *, count: bool = True, chunks: bool = False
) -> None:
    """Start ``cache`` (built without ``input_ids``) from prompt rows given as keys (token ids; ``-1 - id`` where a
    mask hides one) after ``pads`` leading pad columns: match each row, keep the batch to one offset, share or copy
    blocks. Rows that share a prefix the store does not hold yet get it computed once, first (in-batch sharing, by
    the store's runner). With ``count=False`` the lookup stays out of the store's statistics (that inner prefill).
    Mutates.

    In an invariant store (docs/correctness.md, "Outputs that never depend on the cache") each row first has its
    canonical chunks computed (:func:`prefixkv.rows.chunk_end`, by the store's runner), reuses exactly those, and
    the cache publishes nothing: every K/V a later call may reuse comes from a canonical chunk forward. With
    ``chunks`` the cache is such a forward's (the runner's): its one row, a whole number of chunks, reuses every
    whole chunk the store holds, and its forwards publish."""
    cache._attach(pads, rows, count=count, chunks=chunks)


def publish_all(cache: PagedPrefixCache) -> None:
    """Publish every token of the one-row ``cache``, a last part-filled block included (what ``PrefixStore.pin``
    keeps; a forward publishes whole blocks only). Raises :class:`CacheMisuseError` when its K/V could not be
    proven to be those of its ids. Mutates."""
    cache._publish_all()


def plan_call(
    cache: PagedPrefixCache, input_ids: torch.Tensor, next_sequence_length: int | None, kwargs: dict[str, Any]
) -> int | None:
    """At the first forward of a ``generate`` call: make what ``cache`` holds fit the call (:mod:`prefixkv.call`),
    and return the ``next_sequence_length`` to feed. Raises :class:`CacheMisuseError` for a second call that does
    not continue what the cache holds. Mutates."""
    return cache._plan_call(input_ids, next_sequence_length, kwargs)


def begin_forward(cache: PagedPrefixCache, forward: proof.ForwardInputs) -> None:
    """Before a forward of the store's model with ``cache``: allocate the slots of the columns it feeds, apply the
    proof's verdicts to every row, and plan the forward's reads. Mutates."""
    cache._begin(forward)


def end_forward(cache: PagedPrefixCache, ok: bool) -> None:
    """After a forward (``ok``: it returned; a forward that raised publishes nothing): publish the blocks it
    filled, and carry out a ``close()`` that another thread asked for meanwhile. Mutates."""
    cache._end(ok)
