"""The layers of a :class:`~prefixkv.hf.cache.PagedPrefixCache` and what one forward does with each layer's new K/V:
the per-layer face transformers calls (:class:`PagedLayer`; every call goes to the cache), whether the K/V fit the
store (:func:`check_layer`), their write into the pool and what the attention is handed (:func:`write_layer`,
:func:`hand_out`); and a compiled step (:mod:`prefixkv.attention.static`), which writes every layer in one graph
and whose writes :func:`end_step` carries over a growth of the pool (:func:`begin_step`), where the store allows them
(:func:`compile_refusal`). The cache hands each function the parts it
needs (its rows, the forward's read plan, the store), so none of them reaches into the cache, and this module does
not import it: which thread's forward owns the cache, and a ``close()`` from another one, stay the cache's."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import _compat
from ..attention import interface, reads, static
from ..errors import CacheMisuseError
from ..family import family
from ..kv.key_space import autocast_dtype, autocast_in
from ..kv.manager import BlockManager
from . import proof
from .parts import StoreParts
from .rows import RowSet


@_compat.adapt_cache
class PagedLayer(CacheLayerMixin):
    """The per-layer face transformers expects (``cache.layers``); all state lives in the owning cache, which it
    holds by a weak reference."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: Cache, layer_idx: int) -> None:
        super().__init__()
        # a weak reference: a strong one would make every cache a cycle that only the cyclic garbage collector
        # frees, so `del cache` would not give the blocks back (docs/correctness.md, "Releasing caches")
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    @property
    def _cache(self) -> Cache:
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


def write_layer(
    plan: reads.ForwardReads,
    held: RowSet,
    store: StoreParts,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``update`` of a forward that is not a compiled step, once the cache knows the forward is its owner's and
    the cache open: write the new K/V (``[B, kv_heads, q, head_dim]``) of layer ``layer_idx`` into the slots of
    ``held``'s new columns and return what the attention reads, as ``plan`` says (the new K/V themselves, or the
    layer's whole rows read from the pool). Mutates the pool, ``held.seen`` and ``plan``."""
    check_layer(store, key_states, layer_idx, held.seen[layer_idx], held.length, value_states)
    device = key_states.device
    computed, planned = autocast_dtype(device.type), autocast_in(held.space)
    if computed != planned:
        raise CacheMisuseError(
            f"layer {layer_idx} computes under torch.autocast(dtype={computed}), but this PagedPrefixCache was "
            f"built and planned under autocast={planned}: an autocast entered inside the model's forward (as "
            "accelerate's mixed precision does) is not seen before it runs. Enter the same autocast around the "
            "generate call too (with torch.autocast(...): or accelerator.autocast())"
        )
    keep = None if held.keep is None else held.keep.to(device)
    store.blocks.write(layer_idx, held.new.to(device), key_states, value_states, keep)
    held.seen[layer_idx] = held.length
    if plan.in_place:
        hand_out(plan, layer_idx, key_states)
        return key_states, value_states
    keys, values = plan.gather(layer_idx)
    if not plan.canonical:  # contiguous, as a DynamicCache hands them out: a model's own attention may .view them
        keys, values = keys.contiguous(), values.contiguous()
    if keys.dtype != key_states.dtype:
        keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
    if plan.probe:  # proven only if the model hands both, untouched, to the attention (docs/how-it-works.md)
        keys, values = reads.watch(plan, layer_idx, keys), reads.watch(plan, layer_idx, values)
    if plan.probe or plan.canonical:
        hand_out(plan, layer_idx, keys)
    return keys, values


def check_layer(
    store: StoreParts,
    key_states: torch.Tensor,
    layer_idx: int,
    seen: int,
    length: int,
    value_states: torch.Tensor | None = None,
) -> None:
    """Raise :class:`CacheMisuseError` unless ``key_states`` (and ``value_states``) fit the store's layer
    ``layer_idx`` and a forward that allocated ``length - seen`` columns for it."""
    specs = store.blocks.pool.specs
    if layer_idx >= len(specs):
        raise CacheMisuseError(f"layer {layer_idx} does not exist in a store built for {len(specs)} layers")
    spec = specs[layer_idx]
    if key_states.shape[1] != spec.kv_heads or key_states.shape[-1] != spec.head_dim:
        raise CacheMisuseError(
            f"layer {layer_idx} gives K of {key_states.shape[1]} heads x {key_states.shape[-1]}, but the store "
            f"was built for {spec.kv_heads} x {spec.head_dim}: this cache's store belongs to another model"
        )
    for t in (key_states,) if value_states is None else (key_states, value_states):
        if t.device == spec.device and t.dtype == store.settings.model_dtype:
            continue
        autocast = autocast_dtype(spec.device.type)
        if t.device == spec.device and autocast is not None:
            if _holds_exactly(store.settings.dtype, t.dtype):
                continue  # stored exactly, handed back in this dtype (docs/correctness.md, "Autocast")
            raise CacheMisuseError(
                f"layer {layer_idx} computes K/V in {t.dtype} under torch.autocast({spec.device.type!r}, "
                f"dtype={autocast}), which the store's pool of {store.settings.dtype} cannot hold exactly: build "
                "the store with dtype=torch.float32 (it then holds autocast's K/V exactly), or generate without "
                "autocast"
            )
        raise CacheMisuseError(
            f"layer {layer_idx} now computes in {t.dtype} on {t.device}, but the store was "
            f"built for {store.settings.model_dtype} on {spec.device}: the model was moved or cast after the "
            "PrefixStore was built; build a new store"
        )
    q = key_states.shape[-2]
    if seen + q != length:
        raise CacheMisuseError(f"layer {layer_idx} got {q} new tokens but this forward allocated {length - seen}")


def _holds_exactly(pool: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a pool of ``pool`` holds every value of ``dtype`` exactly (bfloat16 and float16 in float32, anything
    narrower in float64), so that reading it back as ``dtype`` gives what was written. Does not mutate."""
    wider = pool in (torch.float32, torch.float64) and dtype.is_floating_point and dtype.itemsize < pool.itemsize
    return dtype == pool or wider


def hand_out(plan: reads.ForwardReads, layer: int, key: torch.Tensor) -> None:
    """Note that ``update`` returns ``key`` for ``layer``, on the tensor itself
    (:data:`prefixkv.attention.reads.TAG`), so that only the attention call of that layer, with that tensor,
    reads the plan. Mutates ``plan`` and ``key``."""
    plan.handed.add(layer)
    setattr(key, reads.TAG, (plan, layer))


def begin_step(
    held: RowSet, blocks: BlockManager, tables: static.StepTables, forward: proof.ForwardInputs, start: int
) -> static.StaticStep:
    """The tensors of a compiled step (:mod:`prefixkv.attention.static`) feeding column ``start`` of ``held``'s
    rows: as wide as the mask ``generate`` built from ``get_mask_sizes``, else the bucket of ``start + 1`` columns.
    Holds no lock: a forward may end without its end hook (``KeyboardInterrupt``, an exception in a compiled
    call), so nothing it takes may wait for :func:`end_step`. Does not mutate."""
    pool = blocks.pool  # its devices: a growth keeps them
    mask = forward.attention_mask
    columns = (
        mask.shape[-1]
        if isinstance(mask, torch.Tensor) and mask.dim() == 4
        else static.width(start + 1, blocks.block_size)
    )
    if columns <= start:
        raise CacheMisuseError(f"the forward's mask has {columns} columns, but it feeds column {start}")
    device = pool.specs[0].device
    table = tables.table([r.pad for r in held.rows], [r.table for r in held.rows], columns, device)
    with blocks.lock:  # the pool's tensors of now, not those of a growth half done in another thread
        return static.StaticStep(blocks.pool, held.new.view(-1).to(device), table, torch.tensor(start, device=device))


def end_step(held: RowSet, blocks: BlockManager, step: static.StaticStep, ok: bool) -> None:
    """The end of a compiled step that :func:`begin_step` began (``ok``: its forward returned). Under the store's
    lock: the step's writes carried into the pool's tensors where another thread grew the pool meanwhile (a growth
    copies every layer into new tensors, and the graph wrote into the ones it was given), and the null block kept
    zeros; then note that the step wrote every layer. Mutates."""
    with blocks.lock:
        if ok:
            step.carry_over(blocks.pool)
        if held.keep is not None:  # a pad column's K/V went to the null block: it must stay zeros
            for t in (*blocks.pool.keys, *blocks.pool.values):
                t[:, 0].zero_()
    if ok:  # a compiled step wrote every layer (the graph has no per-layer record)
        held.seen[:] = [held.length] * len(held.seen)


def compile_refusal(store: StoreParts) -> str | None:
    """Why ``store``'s caches cannot take compiled decode steps (:func:`prefixkv.attention.static.refusal`), or a
    model whose attention is its own (the ``update`` path of docs/architectures.md: ALiBi, soft-capping, eager only),
    to which a compiled step does not hand its K/V, or one whose masks the installed transformers builds at a fixed
    length (:func:`prefixkv._compat.compile_refusal`); ``None`` where they can. Does not mutate."""
    release = _compat.compile_refusal(store.hf_model)
    if release is not None:
        return release
    if not interface.serves(store.hf_model):
        return (
            f"this {family(store.hf_model)} model runs its own attention, not prefixkv's (docs/architectures.md), and "
            "its compiled step is not one of prefixkv's"
        )
    return static.refusal(store)
