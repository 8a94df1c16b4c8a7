"""``PagedPrefixCache``: the per-call ``transformers.Cache`` whose rows are block tables into a store.

Life of a call. At construction the prompt of each row is matched in the trie; matched whole blocks are
shared (refcount), a matched part-block is copied (copy-on-write), and ``get_seq_length`` reports the
reused columns so ``generate`` only prefills the rest. Before each forward the model hook hands over the
forward's inputs (:class:`prefixkv.hf.proof.ForwardInputs`; the cache itself only ever sees K and V), and
:func:`begin_forward` allocates their slots, applies the proof's verdicts and plans the reads; ``update`` writes
K/V there and hands the attention what the plan says; :func:`end_forward` publishes the blocks that became full.
``close()`` (or dropping the last reference: no reference cycle keeps a cache alive) gives every block back.

This module is the transformers interface and the lifetime (which thread's forward owns the cache, a ``close()``
from another thread); the jobs behind them have their own objects, which never call the cache: the rows (pads,
keys, claims; attaching a prompt, a forward's slots, publishing, cropping, selecting) are a
:class:`prefixkv.hf.rows.RowSet`; the proof that their K/V are those of their keys (docs/correctness.md, "Publish only
what is proven") is :mod:`prefixkv.hf.proof`; the first-step protocol of a ``generate`` call is
:class:`prefixkv.hf.call.GenerateCall`; the read plan is :mod:`prefixkv.attention.reads`; the write of a layer's K/V
once the forward is known to be the owner's, and a compiled step's tensors, are :mod:`prefixkv.hf.layers` (beside
the layer objects transformers calls, which pass each call on to the cache). The module functions
(:func:`begin_forward`, :func:`end_forward`, :func:`plan_call`, :func:`attach_prompt`, :func:`publish_all`) are
prefixkv's own protocol with a cache, for the model hooks and the runner; a user never calls them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers.cache_utils import Cache

from .. import _compat, display, patching
from ..attention import interface, reads, static
from ..attention.reader import Reader
from ..errors import CacheMisuseError
from ..kv.key_space import user_space
from ..stats import CacheStats
from . import proof
from .call import GenerateCall
from .layers import PagedLayer, begin_step, check_layer, compile_refusal, end_step, write_layer
from .parts import StoreParts
from .rows import RowSet, check_prompt


@_compat.adapt_cache
class PagedPrefixCache(Cache):
    """A ``transformers`` cache whose KV lives in a :class:`PrefixStore`'s shared blocks.

    Build one per ``generate`` call. With ``input_ids`` (and, for a padded batch, ``attention_mask``)
    each row's longest cached prefix is attached at construction, so ``generate`` only prefills the rest;
    at least the last prompt token is always recomputed. Close it (``close()``, ``with``) to give its
    blocks back; what it computed stays cached in the store for later calls. ``namespace="alice"`` (a str)
    reuses and publishes only the K/V of caches built with the same name; ``None``, the default, is the one
    namespace every user shares (docs/generate.md, "Isolation between users"). A cache is compileable by default
    (:attr:`is_compileable`, :attr:`compile_reason` says why not where it is not): where ``generate`` compiles its
    decode steps on its own (on accelerators, or where its compile config says every device), each one-token
    forward of that call is a step of fixed shapes per bucket, one graph, with the prefix still reused, as is
    each one of a model whose forward ``torch.compile`` returned; eager calls keep the eager read.
    ``compileable=True`` makes every one-token forward such a step (for another compile of one's own:
    ``model.compile()``), ``compileable=False`` keeps ``generate`` from compiling (docs/generate.md, "Compiled
    decoding").

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
        store: StoreParts,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        namespace: str | None = None,
        compileable: bool | None = None,
    ) -> None:
        if not isinstance(store, StoreParts):
            raise TypeError(f"PagedPrefixCache needs a PrefixStore, got {type(store).__name__}")
        if compileable is not None and not isinstance(compileable, bool):
            raise TypeError(
                f"compileable takes True (every one-token forward a compiled step), False (never compiled) or None "
                f"(the default: compiled where generate compiles), got {compileable!r}"
            )
        self.store = store
        self._blocks = blocks = store.blocks  # the store's claim contract
        num_layers = len(blocks.pool.specs)
        super().__init__(layers=[PagedLayer(self, i) for i in range(num_layers)])
        # the rows, their columns and claims; the namespace K/V computed now are cached under is read here only:
        # the store's, within the user's `namespace` (docs/generate.md, "Isolation between users")
        user_space(namespace, None)  # a wrong name fails here, before any block is claimed
        self.namespace = namespace
        space_now = blocks.space if namespace is None else lambda: user_space(namespace, blocks.space())
        self._reads: reads.ForwardReads | None = None  # this forward's read plan
        self._reader = Reader(blocks.pool, blocks.gather, store.settings, model=store.hf_model)
        # compiled decode steps (prefixkv.attention.static): why not, or None where a one-token forward may be one;
        # which are: every one (compileable=True), or those of a generate call that compiles them (note_compile)
        self._compile_refusal = (
            "it was built with compileable=False" if compileable is False else compile_refusal(store)
        )
        self._asked = compileable  # True: every one-token forward is a compiled step
        self._compiled_call: bool | None = None  # generate's choice for the call now, None before it chose
        self._compile_noted = False  # the choice was made for the call whose first step comes next
        self.compile_reason = (
            f"not compileable: {self._compile_refusal}"
            if self._compile_refusal is not None
            else "every one-token forward is one graph per bucket of columns and batch"
            if compileable
            else "generate may compile it: each one-token forward of a call it compiles is one graph per bucket "
            "of columns and batch"
        )
        """Why :attr:`is_compileable` is what it is, one line."""
        self._step_tables = static.StepTables(blocks.block_size)
        self._step: static.StaticStep | None = None  # this forward's, when it is such a step
        self._owner: int | None = None
        self._guard = threading.Lock()
        self._is_closed = False
        self._release_pending = False  # closed from another thread mid-forward: that forward releases at its end
        blocks.ensure_open()
        self._gen_call: GenerateCall = GenerateCall(None)
        # the construction, the runner's prefills for its rows included, walks the model's weights once
        with blocks.key_space.steady():
            self._rowset = RowSet(blocks, num_layers, space_now=space_now, namespace=namespace)
            if input_ids is not None:
                pads, keys = check_prompt(input_ids, attention_mask)
                self._gen_call = GenerateCall(input_ids.cpu().tolist())
                self._rowset.attach(store, pads, keys)
            elif attention_mask is not None:
                raise ValueError("attention_mask was given without input_ids")

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile this cache's decode steps: built without ``compileable=False`` on a
        store whose caches can take them (:attr:`compile_reason` says why not). Then each one-token forward of a
        call that ``generate`` compiles (every one, with ``compileable=True``) is a step of fixed shapes per
        bucket whose ``update`` and attention compile to one graph (docs/generate.md, "Compiled decoding"). During
        a call that ``generate`` chose to run eagerly it is ``False`` (unless its one-token forwards are steps all
        the same: built with ``compileable=True``, or on a model whose forward ``torch.compile`` returned), so that
        the call's forwards build their masks as with any other cache; each call chooses anew. It is ``True``
        whenever a one-token forward is a step (:func:`takes_steps`): transformers drops the mask of a one-token
        forward with a cache that is not compileable, and a step attends a whole bucket, whose columns past the
        row only the mask hides. Does not mutate."""
        return self._compile_refusal is None and (self._compiled_call is not False or takes_steps(self))

    @property
    def stats(self) -> CacheStats:
        """Prompt tokens reused and computed, per row and in total (fixed at construction)."""
        return self._rowset.stats

    # -- the generate-call protocol --------------------------------------------------------------

    def activate_past_recording(self) -> None:
        """Assisted and prompt-lookup decoding call this before their first forward, which feeds the whole
        sequence again (docs/how-it-works.md, "One forward, and the first step of a call"); that forward will
        then skip the columns already held. Mutates."""
        self._gen_call.refeed = True

    # -- one forward -----------------------------------------------------------------------------

    def _begin(self, forward: proof.ForwardInputs) -> None:
        """:func:`begin_forward`. Mutates."""
        self._own()
        self._step = None  # a compiled step whose end never came (its forward raised past its end hook)
        x = forward.fed
        if x is None:
            raise CacheMisuseError("a forward with a PagedPrefixCache needs input_ids or inputs_embeds")
        held, call, q = self._rowset, self._gen_call, x.shape[1]
        # allocation first: it may raise CapacityError, and the keys the proof records must then not be there yet;
        # if the proof raises, the next forward drops the allocated columns (RowSet.allocate)
        start = held.allocate(forward, x.shape[0], q)
        held.prove(forward, start, training=self.store.hf_model.training, reused=not call.computed and start > 0)
        call.computed = True
        if q == 1 and takes_steps(self):
            self._step = begin_step(held, self._blocks, self._step_tables, forward, start)
            return
        self._reads = self._reader.plan([r.pad for r in held.rows], [r.table for r in held.rows], start, q)

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

    def _end(self, ok: bool) -> None:
        """:func:`end_forward`. Mutates."""
        if self._owner != threading.get_ident():
            return  # begin_forward refused this forward (the cache is another thread's): nothing of ours ran
        plan, self._reads = self._reads, None
        step, self._step = self._step, None
        if step is not None:
            end_step(self._rowset, self._blocks, step, ok)
        if ok and plan is not None and plan.probe and plan.every_layer_served():
            interface.mark_verified(self.store.hf_model)
        try:
            if ok and not self._is_closed and self._rowset.publishes:
                self._rowset.publish_full()
        finally:
            with self._guard:
                self._owner = None
                release, self._release_pending = self._release_pending, False
            if release:
                self._rowset.release()

    # -- transformers Cache interface ------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (``[B, kv_heads, q, head_dim]``) into their slots and return what the forward's
        attention reads: the new K/V themselves when it reads the pool in place, else the layer's whole K/V read
        from the blocks, ``[B, kv_heads, columns, head_dim]`` (a compiled step's: as wide as its bucket, in the
        graph, :class:`prefixkv.attention.static.StaticStep`)."""
        step = self._step
        if step is None:
            return _paged_update(self, key_states, value_states, layer_idx)
        if not torch.compiler.is_compiling():
            _check_static(self, key_states, layer_idx)
        return step.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns stored for ``layer_idx`` (pads included), a Python int (inside a compiled step's graph: a 0-d
        tensor, as ``StaticCache`` gives, so the graph does not depend on it)."""
        if self._step is not None and torch.compiler.is_compiling():
            return self._step.position  # type: ignore[return-value]
        seen = self._rowset.seen
        return seen[layer_idx] if layer_idx < len(seen) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The mask's width: the columns after the forward, or for a compiled step (one token, :func:`takes_steps`)
        their bucket (:func:`prefixkv.attention.static.width`), so that a step's shapes change only between
        buckets."""
        if self._step is not None:
            return self._step.table.shape[1], 0
        columns = self.get_seq_length(layer_idx) + query_length
        if query_length == 1 and takes_steps(self):
            return static.width(columns, self._blocks.block_size), 0
        return columns, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``, sharing its blocks. Mutates."""
        self._rowset.select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rowset.select([i for i in range(len(self._rowset.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rowset.select(indices.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (a negative int, as in ``DynamicCache``). Mutates."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove:
            self._rowset.truncate(max(0, self._rowset.length + tokens_to_remove))

    def reset(self) -> None:
        """Give every block back and forget the rows; the cache can start a new sequence. Mutates."""
        self._rowset.reset()

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
        self._rowset.release()

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
                self._rowset.release()
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
        other = PagedPrefixCache(self.store, namespace=self.namespace, compileable=self._asked)
        other._rowset = self._rowset.fork()
        other._gen_call = GenerateCall(self._gen_call.prompt_ids)
        other._gen_call.computed = self._gen_call.computed
        return other

    @property
    def closed(self) -> bool:
        """Whether the cache gave its blocks back (``close()``). Does not mutate."""
        return self._is_closed

    def block_tables(self) -> list[display.RowTable]:
        """Each row's leading padding, block table, and which of its blocks something else holds too (the
        trie, another row, another cache); empty once closed. Does not mutate."""
        rows = list(self._rowset.rows)
        views = self._blocks.ledger.table_view([row.claim for row in rows])
        return [display.RowTable(row.pad, v.blocks, v.shared) for row, v in zip(rows, views)]

    def __repr__(self) -> str:
        s, held = self._rowset.stats, self._rowset
        state = "closed" if self._is_closed else f"{len(held.rows)} rows x {held.length} columns"
        return (
            f"PagedPrefixCache({state}, prompt_tokens={s.prompt_tokens}, cached_tokens={s.cached_tokens}, "
            f"computed_tokens={s.computed_tokens})"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: reused and computed prompt tokens per row, and each row's block table."""
        return display.cache_html(self)


@interface.outside_compile
def _check_static(cache: PagedPrefixCache, key_states: torch.Tensor, layer_idx: int) -> None:
    """:meth:`PagedPrefixCache.update`'s checks, for an eager compiled step."""
    if cache._owner != threading.get_ident():
        raise CacheMisuseError("PagedPrefixCache.update was called outside a forward of its store's model")
    held = cache._rowset
    check_layer(cache.store, key_states, layer_idx, held.length - 1, held.length)


@interface.outside_compile
def _paged_update(
    cache: PagedPrefixCache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`update` of a forward that is not a compiled step, outside any graph."""
    plan = cache._reads
    if cache._owner != threading.get_ident() or plan is None:
        raise CacheMisuseError(
            "PagedPrefixCache.update was called outside a forward of the model its PrefixStore was built "
            "for (or after the store was closed); pass the cache to that model"
        )
    if cache._is_closed:
        raise CacheMisuseError(
            "this PagedPrefixCache was closed during the forward (close() from another thread cancels the "
            "generate call using it); its blocks are given back when the forward ends"
        )
    return write_layer(plan, cache._rowset, cache.store, key_states, value_states, layer_idx)


# -- prefixkv's own protocol with a cache: the model hooks (prefixkv.hf.hooks) and the runner (prefixkv.hf.runner) ---


def attach_prompt(
    cache: PagedPrefixCache, pads: list[int], rows: list[list[int]], *, count: bool = True, chunks: bool = False
) -> None:
    """Start ``cache`` (built without ``input_ids``) from prompt rows given as keys after ``pads`` leading pad
    columns (:meth:`prefixkv.hf.rows.RowSet.attach`, which says how). Mutates."""
    cache._rowset.attach(cache.store, pads, rows, count=count, chunks=chunks)


def publish_all(cache: PagedPrefixCache) -> None:
    """Publish every token of the one-row ``cache``, a last part-filled block included (what ``PrefixStore.pin``
    keeps; a forward publishes whole blocks only). Raises :class:`CacheMisuseError` when its K/V could not be
    proven to be those of its ids. Mutates."""
    cache._rowset.publish_all()


def plan_call(
    cache: PagedPrefixCache, input_ids: torch.Tensor, next_sequence_length: int | None, kwargs: dict[str, Any]
) -> int | None:
    """At the first forward of a ``generate`` call: make what ``cache`` holds fit the call (:mod:`prefixkv.hf.call`),
    and return the ``next_sequence_length`` to feed. Raises :class:`CacheMisuseError` for a second call that does
    not continue what the cache holds. Mutates."""
    if cache.closed:
        raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
    # generate chose whether to compile this call's forwards before its first step, or did not choose (a decoding
    # loop that never compiles: beams), and then the call is eager whatever an earlier call on the cache chose
    if not cache._compile_noted:
        cache._compiled_call = False
    cache._compile_noted = False
    return cache._gen_call.plan(cache._rowset, cache.store, input_ids, next_sequence_length, kwargs)


def plan_prompt(cache: PagedPrefixCache, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Before ``generate``'s chunked prefill cuts the prompt: make what ``cache`` holds fit the call's whole
    ``input_ids`` and the mask in ``kwargs`` (:meth:`prefixkv.hf.call.GenerateCall.plan_prompt`). Mutates."""
    if not cache.closed:  # a closed cache raises at the call's first forward
        cache._gen_call.plan_prompt(cache._rowset, cache.store, input_ids, kwargs)


def begin_forward(cache: PagedPrefixCache, forward: proof.ForwardInputs) -> None:
    """Before a forward of the store's model with ``cache``: allocate the slots of the columns it feeds, apply the
    proof's verdicts to every row, and plan the forward's reads. Mutates."""
    cache._begin(forward)


def end_forward(cache: PagedPrefixCache, ok: bool) -> None:
    """After a forward (``ok``: it returned; a forward that raised publishes nothing): publish the blocks it
    filled, and carry out a ``close()`` that another thread asked for meanwhile. Mutates."""
    cache._end(ok)


def note_compile(cache: PagedPrefixCache, compiled: bool | None) -> None:
    """``generate`` chose whether to compile the forwards of the call it runs with ``cache`` (``None``: it is about
    to choose): its one-token forwards are compiled steps if so (:func:`takes_steps`). Mutates."""
    cache._compiled_call, cache._compile_noted = compiled, True


def takes_steps(cache: PagedPrefixCache) -> bool:
    """Whether a one-token forward with ``cache`` now is a compiled step (:mod:`prefixkv.attention.static`): every
    one of a cache built with ``compileable=True`` or on a model whose forward ``torch.compile`` returned, else
    those of a call that ``generate`` compiles."""
    if cache._compile_refusal is not None:
        return False
    return cache._asked is True or cache._compiled_call is True or patching.compiled_forward(cache.store.hf_model)


def static_step(cache: PagedPrefixCache) -> bool:
    """Whether the forward that :func:`begin_forward` just began is a compiled step
    (:mod:`prefixkv.attention.static`)."""
    return cache._step is not None
