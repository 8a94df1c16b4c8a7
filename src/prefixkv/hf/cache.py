"""``PagedPrefixCache``: the per-call ``transformers.Cache`` whose rows are block tables into a store.

Life of a call. At construction the prompt of each row is matched in the trie; matched whole blocks are
shared (refcount), a matched part-block is copied (copy-on-write), and ``get_seq_length`` reports the
reused columns so ``generate`` only prefills the rest. Before each forward the model hook hands over the
forward's inputs (:class:`prefixkv.hf.proof.ForwardInputs`; the cache itself only ever sees K and V), and the
cache's :class:`prefixkv.hf.forward.Forward` allocates their slots, applies the proof's verdicts and plans the
reads; ``update`` writes K/V there and hands the attention what the plan says; the forward's end publishes the
blocks that became full. ``close()`` (or dropping the last reference: no reference cycle keeps a cache alive)
gives every block back.

This module is the transformers interface and the lifetime a user sees; the jobs behind them have their own
objects, which never call the cache: the rows (pads, keys, claims; attaching a prompt, a forward's slots,
publishing, cropping, selecting) are a :class:`prefixkv.hf.rows.RowSet`; one forward from its begin to its end
(which thread's forward owns the cache, a ``close()`` from another thread, the read plan or compiled step, the
compile choice) is the :class:`prefixkv.hf.forward.Forward` the cache holds as ``cache.forward``, which the model
hooks and the runner call; the proof that the rows' K/V are those of their keys (docs/correctness.md, "Publish only
what is proven") is :mod:`prefixkv.hf.proof`; the first-step protocol of a ``generate`` call is
:class:`prefixkv.hf.call.GenerateCall`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from ..attention import static
from ..base import display
from ..base.errors import CacheMisuseError
from ..base.family import model_errors
from ..base.stats import CacheStats
from ..compat import releases
from ..kv.key_space import SpaceNow, user_space
from . import kinds, linear_cache, vision
from .call import GenerateCall
from .forward import Forward
from .layers import StateLayer
from .parts import StoreParts
from .rows import RowSet, check_prompt


def _check_arguments(store: Any, compileable: Any, inputs: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless a ``PagedPrefixCache`` is built on a store, ``compileable`` is a bool or ``None``,
    and the other keywords are a processor's image inputs. Does not mutate."""
    if not isinstance(store, StoreParts):
        raise TypeError(f"PagedPrefixCache needs a PrefixStore, got {type(store).__name__}")
    if compileable is not None and not isinstance(compileable, bool):
        raise TypeError(
            f"compileable takes True (every one-token forward a compiled step), False (never compiled) or None "
            f"(the default: compiled where generate compiles), got {compileable!r}"
        )
    unknown = sorted(set(inputs) - vision.IMAGE_INPUTS)
    if unknown:
        raise TypeError(
            f"PagedPrefixCache got unexpected keyword arguments {unknown}; besides input_ids and attention_mask it "
            f"takes a processor's image inputs ({', '.join(sorted(vision.IMAGE_INPUTS))})"
        )


@releases.adapt_cache
class PagedPrefixCache(linear_cache.LinearCacheNames, Cache):
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
        **inputs: Any,
    ) -> None:
        _check_arguments(store, compileable, inputs)
        self.store = store
        self._blocks = blocks = store.blocks  # the store's claim contract
        num_layers = len(blocks.pool.specs)
        super().__init__(layers=_layers(self, store, num_layers))
        # the rows, their columns and claims; the namespace K/V computed now are cached under is read here only:
        # the store's, within the user's `namespace` (docs/generate.md, "Isolation between users")
        user_space(namespace, None)  # a wrong name fails here, before any block is claimed
        self.namespace = namespace
        space_now = SpaceNow(blocks.space if namespace is None else lambda: user_space(namespace, blocks.space()))
        blocks.ensure_open()
        # the construction, the runner's prefills for its rows included, walks the model's weights once; a kernel of
        # the model that refuses its dtype is reported as the model's (docs/faq.md)
        with blocks.key_space.steady(), model_errors(store.hf_model):
            self._rowset = RowSet(
                blocks,
                num_layers,
                space_now=space_now,
                namespace=namespace,
                states=self._state_layers(),
                silent=kinds.silent_layers(store.layer_kinds),
                snapshots=store.snapshots,
            )
            self.forward = Forward(store, self._rowset, GenerateCall(None), compileable)
            """This cache's forwards, from begin to end (:class:`prefixkv.hf.forward.Forward`): what the model hooks
            and the runner call; a user never does."""
            if type(self).update is PagedPrefixCache.update:  # a subclass's own update keeps its place
                # each layer's update goes to the Forward straight, one call less in every layer of every step
                # (docs/how-it-works.md, "The decode corridor"); a copy builds its own (__deepcopy__)
                self.update = self.forward.update  # type: ignore[method-assign]
            if input_ids is not None:
                pads, keys = check_prompt(input_ids, attention_mask)
                self._rowset.images = vision.plan(store.hf_model.config, pads, keys, inputs)
                vision.reset_rope_deltas(store.hf_model)
                self.forward.call = GenerateCall(input_ids.cpu().tolist())
                self._rowset.attach(store, pads, keys)
                if self._rowset.images is not None and self._rowset.images.refusal is not None:
                    self._rowset.not_cached(self._rowset.images.refusal)
            elif attention_mask is not None or any(v is not None for v in inputs.values()):
                raise ValueError("attention_mask or image inputs were given without input_ids")
        refusal = self.forward.refusal
        self.compile_reason = (
            f"not compileable: {refusal}"
            if refusal is not None
            else "every one-token forward is one graph per bucket of columns and batch"
            if compileable
            else "generate may compile it: each one-token forward of a call it compiles is one graph per bucket "
            "of columns and batch"
        )
        """Why :attr:`is_compileable` is what it is, one line."""

    def _state_layers(self) -> list[tuple[int, StateLayer]]:
        """The layers that hold a recurrent state, with their indices."""
        return [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer, StateLayer)]

    @property
    def is_linear(self) -> list[bool]:
        """``False`` for every layer: transformers' name for layers without a sequence axis, whose caches
        ``generate`` cannot slice its inputs by (it feeds a Mamba model the whole sequence again); this cache counts
        columns in every layer, recurrent ones included (:meth:`get_seq_length`), so ``generate`` feeds only what it
        does not hold. Does not mutate."""
        return [False] * len(self.layers)

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile this cache's decode steps: built without ``compileable=False`` on a
        store whose caches can take them (:attr:`compile_reason` says why not). Then each one-token forward of a
        call that ``generate`` compiles (every one, with ``compileable=True``) is a step of fixed shapes per
        bucket whose ``update`` and attention compile to one graph (docs/generate.md, "Compiled decoding"). During
        a call that ``generate`` chose to run eagerly it is ``False`` (unless its one-token forwards are steps all
        the same: built with ``compileable=True``, or on a model whose forward ``torch.compile`` returned), so that
        the call's forwards build their masks as with any other cache; each call chooses anew. It is ``True``
        whenever a one-token forward is a step (:meth:`Forward.takes_steps`): transformers drops the mask of a one-token
        forward with a cache that is not compileable, and a step attends a whole bucket, whose columns past the
        row only the mask hides. Does not mutate."""
        return self.forward.compileable()

    @property
    def stats(self) -> CacheStats:
        """Prompt tokens reused and computed, per row and in total (fixed at construction)."""
        return self._rowset.stats

    # -- the generate-call protocol --------------------------------------------------------------

    def activate_past_recording(self) -> None:
        """Assisted and prompt-lookup decoding call this before their first forward, which feeds the whole
        sequence again (docs/how-it-works.md, "One forward, and the first step of a call"); that forward will
        then skip the columns already held. Refused for a model with recurrent layers, whose state cannot be cropped
        back to the tokens a draft got wrong. Mutates."""
        if self._rowset.states:
            raise CacheMisuseError(
                "assisted and prompt-lookup decoding crop the cache back to the accepted tokens, and a recurrent "
                "layer's state cannot be cropped; prefixkv refuses them for models with recurrent layers: generate "
                "without assistant_model / prompt_lookup_num_tokens, or without prefixkv"
            )
        self.forward.call.refeed = True

    # -- transformers Cache interface ------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (``[B, kv_heads, q, head_dim]``) into their slots and return what the forward's
        attention reads: the new K/V themselves when it reads the pool in place, else the layer's whole K/V read
        from the blocks, ``[B, kv_heads, columns, head_dim]`` (a compiled step's: as wide as its bucket, in the
        graph, :class:`prefixkv.attention.static.StaticStep`)."""
        return self.forward.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns stored for ``layer_idx`` (pads included), a Python int (inside a compiled step's graph: a 0-d
        tensor, as ``StaticCache`` gives, so the graph does not depend on it)."""
        step = self.forward.step
        if step is not None and torch.compiler.is_compiling():
            return step.position  # type: ignore[return-value]
        seen = self._rowset.seen
        return seen[layer_idx] if layer_idx < len(seen) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The mask's width: the columns after the forward, or for a compiled step (one token,
        :meth:`Forward.takes_steps`) their bucket (:func:`prefixkv.attention.static.width`), so that a step's shapes
        change only between buckets."""
        step = self.forward.step
        if step is not None:
            return step.table.shape[1], 0
        columns = self.get_seq_length(layer_idx) + query_length
        if query_length == 1 and self.forward.takes_steps():
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
        if tokens_to_remove and self._rowset.states:
            raise CacheMisuseError(
                f"crop({tokens_to_remove}) of a cache of a model with recurrent layers: their state cannot be cropped "
                "back to an earlier token; build a new cache for the shorter sequence"
            )
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
        self.forward.close()

    def __enter__(self) -> PagedPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # at interpreter shutdown, or for a half-built cache, there may be nothing left to give back to; a cache
        # nobody references has no forward running, so a release still pending happens here. A plain try: at
        # shutdown this module's globals (contextlib among them) may already be None
        try:  # noqa: SIM105
            self.forward.finalize()
        except Exception:  # a finalizer must not raise, and has no one to report to
            pass

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedPrefixCache:
        """A second cache holding the same columns, sharing their blocks (copy-on-write), on the same store:
        transformers' recipe of copying a prompt's cache for each continuation, without copying K/V."""
        forward = self.forward
        if forward.closed:
            raise CacheMisuseError("this PagedPrefixCache is closed; there is nothing to copy")
        if forward.in_use():
            raise CacheMisuseError("a PagedPrefixCache cannot be copied while a forward uses it")
        other = PagedPrefixCache(self.store, namespace=self.namespace, compileable=forward.asked)
        other._rowset = other.forward.rows = self._rowset.fork(other._state_layers())
        call = other.forward.call = GenerateCall(forward.call.prompt_ids)
        call.computed = forward.call.computed
        return other

    @property
    def closed(self) -> bool:
        """Whether the cache gave its blocks back (``close()``). Does not mutate."""
        return self.forward.closed

    def block_tables(self) -> list[display.RowTable]:
        """Each row's leading padding, block table, and which of its blocks something else holds too (the
        trie, another row, another cache); empty once closed. Does not mutate."""
        rows = list(self._rowset.rows)
        views = self._blocks.ledger.table_view([row.claim for row in rows])
        return [display.RowTable(row.pad, v.blocks, v.shared) for row, v in zip(rows, views)]

    def __repr__(self) -> str:
        s, held = self._rowset.stats, self._rowset
        state = "closed" if self.forward.closed else f"{len(held.rows)} rows x {held.length} columns"
        return (
            f"PagedPrefixCache({state}, prompt_tokens={s.prompt_tokens}, cached_tokens={s.cached_tokens}, "
            f"computed_tokens={s.computed_tokens})"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: reused and computed prompt tokens per row, and each row's block table."""
        return display.cache_html(self)


def _layers(cache: PagedPrefixCache, store: StoreParts, num_layers: int) -> list[Any]:
    """The cache's face of each layer (``cache.layers``), its kind's (:meth:`prefixkv.hf.kinds.LayerKind.face`): a
    :class:`PagedLayer` for K/V (and for a layer without a cache, which never calls it), a
    :class:`~prefixkv.hf.layers.StateLayer` for a recurrent layer's states, a :class:`~prefixkv.hf.layers.HybridLayer`
    for both."""
    return kinds.faces(cache, store.layer_kinds, num_layers, kinds.number_of_states(store.hf_model.config))
