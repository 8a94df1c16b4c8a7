"""One cache's forwards: :class:`Forward`, what a ``PagedPrefixCache`` does from a forward's begin to its end.

The model hooks (:mod:`prefixkv.hf.hooks`) begin and end each forward (:meth:`Forward.begin`, :meth:`Forward.end`)
and, at the first step of a ``generate`` call, make the rows fit the call (:meth:`Forward.fit_call`); the cache's
``update`` hands each layer's K/V to :meth:`Forward.update`. Between begin and end the Forward holds which thread's
forward owns the cache (a ``close()`` from another thread waits for that forward's end to give the blocks back),
and either the forward's read plan (:mod:`prefixkv.attention.reads`) or, for a one-token forward that compiles, the
step's tensors (:mod:`prefixkv.attention.static`): the compiled path is hooks, this module, ``static``. Which
one-token forwards are such steps is the compile choice it keeps too: every one of a cache built with
``compileable=True``, else those of a call ``generate`` compiles (:meth:`Forward.note_compile`).

A layer's K/V are checked (:func:`check_layer`), written and handed out (:func:`write_layer`, :func:`hand_out`) by
the functions below the class, and a compiled step begun and ended by :func:`begin_step` and :func:`end_step`,
where the store allows them (:func:`compile_refusal`). Nothing here holds the cache: no reference cycle keeps a
cache alive (docs/correctness.md, "Releasing caches")."""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..attention import interface, reads, static
from ..attention.reader import Reader
from ..base.errors import CacheMisuseError
from ..base.family import family
from ..base.slots import slot_table
from ..compat import patching, releases
from ..kv.key_space import autocast_dtype, autocast_in
from ..kv.manager import BlockManager
from . import kinds, proof, resume, support
from .call import GenerateCall
from .parts import StoreParts
from .rows import RowSet

_NO_SPACE = object()  # a Forward's key space before its first forward


class Forward:
    """The forward state of one cache: its ``rows`` and ``call`` protocol (shared with the cache), the owner thread
    and its guard, a release pending for a ``close()`` from another thread, the forward's read plan or compiled
    ``step``, the step's slot tables, and the compile choice (``refusal``: why the cache takes no compiled steps;
    ``asked``: the ``compileable=`` it was built with). Between a prepare of ``generate`` and its forward it also
    holds what the prepare noted for the forward's proof (:attr:`next_decode_step`, :attr:`built_masks`)."""

    def __init__(self, store: StoreParts, rows: RowSet, call: GenerateCall, compileable: bool | None) -> None:
        self.store = store
        self.rows = rows
        self.call = call
        blocks = store.blocks
        self._reads: reads.ForwardReads | None = None  # this forward's read plan
        self._reader = Reader(blocks.pool, blocks.gather, store.settings, model=store.hf_model)
        # compiled decode steps: why not, or None where a one-token forward may be one; which are: every one
        # (compileable=True), or those of a generate call that compiles them (note_compile)
        self.refusal = "it was built with compileable=False" if compileable is False else compile_refusal(store)
        self.asked = compileable
        self._compiled_call: bool | None = None  # generate's choice for the call now, None before it chose
        self._takes: bool | None = None  # takes_steps, read once a forward (None: to be read)
        self._compile_noted = False  # the choice was made for the call whose first step comes next
        self._tables = static.StepTables(blocks.block_size)
        self._bs = blocks.block_size
        self._shapes = layer_shapes(store)  # each layer's K and V shapes, which every layer's update checks
        self._space: Any = _NO_SPACE  # the rows' key space of the last forward, and the autocast dtype it names
        self._autocast: torch.dtype | None = None
        self.step: static.StaticStep | None = None  # this forward's, when it is such a step
        self._owner: int | None = None
        self._guard = threading.Lock()
        self.closed = False
        self._release_pending = False  # closed from another thread mid-forward: that forward releases at its end
        # noted by generate's prepare for the next forward (prefixkv.hf.hooks), taken by its pre-hook: whether it is
        # a decode step, and for a compileable cache the 2-D mask (or None) and the 4-D masks generate built from
        # it: the proof reads the 2-D mask in their place only for a forward that got exactly what was built
        # (docs/correctness.md, "Publish only what is proven")
        self.next_decode_step = False
        self.built_masks: tuple[torch.Tensor | None, Any] | None = None

    # -- the compile choice ---------------------------------------------------------------------------------------

    def compileable(self) -> bool:
        """``PagedPrefixCache.is_compileable``: no refusal, and not in a call ``generate`` chose to run eagerly
        unless its one-token forwards are steps all the same (:meth:`takes_steps`). Does not mutate."""
        return self.refusal is None and (self._compiled_call is not False or self.takes_steps())

    def takes_steps(self) -> bool:
        """Whether a one-token forward now is a compiled step (:mod:`prefixkv.attention.static`): every one of a
        cache built with ``compileable=True`` or on a model whose forward ``torch.compile`` returned, else those of
        a call that ``generate`` compiles. Read once a forward (mutates only that memo)."""
        if self.refusal is not None:
            return False
        # asked several times a step (generate's prepare and masks, the begin, the mask sizes): read once, until the
        # forward ends or generate chooses again
        if self._takes is None:
            model = self.store.hf_model
            self._takes = self.asked is True or self._compiled_call is True or patching.compiled_forward(model)
        return self._takes

    def note_compile(self, compiled: bool | None) -> None:
        """``generate`` chose whether to compile the forwards of the call it runs with this cache (``None``: it is
        about to choose): its one-token forwards are compiled steps if so (:meth:`takes_steps`). Mutates."""
        self._compiled_call, self._compile_noted, self._takes = compiled, True, None

    # -- a generate call ------------------------------------------------------------------------------------------

    def fit_call(self, input_ids: torch.Tensor, length: int | None, kwargs: dict[str, Any]) -> int | None:
        """At the first forward of a ``generate`` call: make what the rows hold fit the call
        (:meth:`prefixkv.hf.call.GenerateCall.fit`), and return the ``next_sequence_length`` to feed (``length``:
        what ``generate`` asked for). Raises :class:`CacheMisuseError` for a closed cache or a second call that does
        not continue what the cache holds. Mutates."""
        if self.closed:
            raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
        # generate chose whether to compile this call's forwards before its first step, or did not choose (a decoding
        # loop that never compiles: beams), and then the call is eager whatever an earlier call on the cache chose
        if not self._compile_noted:
            self._compiled_call = False
        self._compile_noted, self._takes = False, None
        return self.call.fit(self.rows, self.store, input_ids, length, kwargs)

    def fit_prompt(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """Before ``generate``'s chunked prefill cuts the prompt: make what the rows hold fit the call's whole
        ``input_ids`` and the mask in ``kwargs`` (:meth:`prefixkv.hf.call.GenerateCall.fit_prompt`). Mutates."""
        if not self.closed:  # a closed cache raises at the call's first forward
            self.call.fit_prompt(self.rows, self.store, input_ids, kwargs)

    # -- one forward ----------------------------------------------------------------------------------------------

    def begin(self, forward: proof.ForwardInputs) -> None:
        """Before a forward of the store's model with the cache: allocate the slots of the columns it feeds, apply
        the proof's verdicts to every row, and plan the forward's reads, or begin its compiled :attr:`step`.
        Mutates."""
        self._own()
        self.step = None  # a compiled step whose end never came (its forward raised past its end hook)
        x = forward.fed
        if x is None:
            raise CacheMisuseError("a forward with a PagedPrefixCache needs input_ids or inputs_embeds")
        held, call, q = self.rows, self.call, x.shape[1]
        # allocation first: it may raise CapacityError, and the keys the proof records must then not be there yet;
        # if the proof raises, the next forward drops the allocated columns (RowSet.allocate)
        start = held.allocate(forward, x.shape[0], q)
        held.prove(forward, start, training=self.store.hf_model.training, reused=not call.computed and start > 0)
        call.computed = True
        if q == 1 and self.takes_steps():
            self.step = begin_step(held, self.store.blocks, self._tables, forward, start)
            return
        moves = self.store.blocks.pool.moves  # before the plan takes the pool's views: a growth after it is seen
        rows = held.rows
        self._reads = self._reader.plan([r.pad for r in rows], [r.table for r in rows], start, q, held.new)
        self._reads.moves = moves
        if held.space is not self._space:  # the key space's autocast, read again only where the space changed
            self._space, self._autocast = held.space, autocast_in(held.space)
        self._reads.autocast = self._autocast  # checked at the forward's first layer (check_autocast)
        if held.cuts is not None:  # last: a begin that raised leaves no recording running
            resume.begin_cuts(held, start, q)

    def _own(self) -> None:
        me = threading.get_ident()
        with self._guard:
            if self.closed:
                raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
            if self._owner is not None and self._owner != me:
                raise CacheMisuseError(
                    "this PagedPrefixCache is in use by a generate call in another thread; "
                    "give each concurrent call its own cache"
                )
            self._owner = me

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``PagedPrefixCache.update``, which the cache hands its layers straight (the ``cache_kwargs`` that
        releases before transformers 5 pass are not read): write the new K/V of layer ``layer_idx`` into their
        slots and return what the forward's attention reads (a compiled step's: in the graph,
        ``StaticStep.update``). Mutates the pool and the rows."""
        step = self.step
        if step is None:  # eagerly, the call itself: torch.compiler.disable's wrapper costs a microsecond a layer
            paged = self._paged_update if torch.compiler.is_compiling() else self._paged_update_eagerly
            return paged(key_states, value_states, layer_idx)
        if not torch.compiler.is_compiling():
            self._check_step(key_states, layer_idx)
        return step.update(layer_idx, key_states, value_states)

    @interface.outside_compile
    def _check_step(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """:meth:`update`'s checks, for an eager compiled step."""
        if self._owner != threading.get_ident():
            raise CacheMisuseError("PagedPrefixCache.update was called outside a forward of its store's model")
        check_layer(self.store, self._shapes, key_states, layer_idx, self.rows.length - 1, self.rows.length)

    def _paged_update_eagerly(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` of a forward that is not a compiled step (:meth:`_paged_update` inside a compiled
        model's call)."""
        plan = self._reads
        if self._owner != threading.get_ident() or plan is None:
            raise CacheMisuseError(
                "PagedPrefixCache.update was called outside a forward of the model its PrefixStore was built "
                "for (or after the store was closed); pass the cache to that model"
            )
        if self.closed:
            raise CacheMisuseError(
                "this PagedPrefixCache was closed during the forward (close() from another thread cancels the "
                "generate call using it); its blocks are given back when the forward ends"
            )
        return write_layer(plan, self.rows, self.store, self._shapes, key_states, value_states, layer_idx)

    _paged_update = interface.outside_compile(_paged_update_eagerly)

    @interface.outside_compile
    def update_tensor(self, name: str, states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Write the new values ``[B, heads, q, size]`` of layer ``layer_idx``'s per-token tensor ``name`` (one its
        kind keeps besides K and V, :mod:`prefixkv.hf.kinds`) at the slots of this forward's new columns, and return
        every row's whole tensor over the forward's columns, ``[B, heads, columns, size]`` (pad columns: the null
        block's zeros). Mutates the pool."""
        if self._owner != threading.get_ident() or self._reads is None or self.closed:
            raise CacheMisuseError(
                f"PagedPrefixCache got layer {layer_idx}'s {name!r} outside a forward of a cache that is open, or in "
                "a compiled step (which carries K and V only)"
            )
        spec, held = self.store.blocks.pool.specs[layer_idx], self.rows
        shape = spec.tensors.get(name)
        if shape is None or (states.shape[1], states.shape[-1]) != shape or states.shape[-2] != held.new.shape[-1]:
            raise CacheMisuseError(
                f"layer {layer_idx} gives {name!r} of shape {tuple(states.shape)} for {held.new.shape[-1]} new "
                f"columns, but the store keeps {shape} (heads, size) of it: this cache's store belongs to another model"
            )
        device = states.device
        rows = slot_table([r.pad for r in held.rows], [r.table for r in held.rows], 0, held.length, self._bs)
        keep = None if held.keep is None else held.keep.to(device)
        return self.store.blocks.write_tensor(layer_idx, name, held.new.to(device), states, keep, rows.to(device))

    def end(self, ok: bool) -> None:
        """After a forward (``ok``: it returned; a forward that raised publishes nothing): publish the blocks it
        filled, and carry out a ``close()`` that another thread asked for meanwhile. Mutates."""
        self._takes = None  # a model compiled between forwards takes steps from its next one
        if self._owner != threading.get_ident():
            return  # begin refused this forward (the cache is another thread's): nothing of ours ran
        plan, self._reads = self._reads, None
        self._reader.end()
        step, self.step = self.step, None
        if step is not None:
            end_step(self.rows, self.store.blocks, step, ok)
        self.rows.note_silent(ok)
        if self.rows.cuts is not None:
            resume.end_cuts(self.rows, ok and not self.closed)
        if ok and plan is not None and plan.probe and plan.every_layer_served():
            interface.mark_verified(self.store.hf_model)
        try:
            if ok and not self.closed and self.rows.publishes:
                self.rows.publish_full()
        finally:
            with self._guard:
                self._owner = None
                release, self._release_pending = self._release_pending, False
            if release:
                self.rows.release()

    # -- lifetime -------------------------------------------------------------------------------------------------

    def in_use(self) -> bool:
        """Whether a forward runs with the cache now (begun, not ended). Does not mutate."""
        return self._owner is not None

    def close(self) -> None:
        """``PagedPrefixCache.close``: give the rows' blocks back, now, or where another thread's forward uses them,
        at that forward's end. Idempotent. Mutates."""
        with self._guard:
            if self.closed:
                return
            self.closed = True
            if self._owner is not None and self._owner != threading.get_ident():
                self._release_pending = True
                return
        try:
            resume.keep_ends(self.rows)  # a model with recurrent layers: the call's end, where its next turn resumes
        finally:
            self.rows.release()

    def finalize(self) -> None:
        """The cache's finalizer: nobody references the cache, so no forward runs with it, and a release still
        pending happens now. Mutates."""
        if self._release_pending:
            self._release_pending = False
            self.rows.release()
        else:
            self.close()


def write_layer(
    plan: reads.ForwardReads,
    held: RowSet,
    store: StoreParts,
    shapes: list[tuple[tuple[int, int], tuple[int, int]]],
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``update`` of a forward that is not a compiled step, once the forward is known to be the owner's and the
    cache open: write the new K/V (``[B, kv_heads, q, head_dim]``) of layer ``layer_idx`` into the slots of
    ``held``'s new columns and return what the attention reads, as ``plan`` says (the new K/V themselves, or the
    layer's whole rows read from the pool); ``shapes``: each layer's K and V shapes (:func:`layer_shapes`). Mutates
    the pool, ``held.seen`` and ``plan`` (its slot views, where another thread's growth moved the pool)."""
    check_layer(store, shapes, key_states, layer_idx, held.seen[layer_idx], held.length, value_states)
    device = key_states.device
    if plan.autocast is not False:  # the forward's first layer: the step's autocast, asked once
        check_autocast(plan, device.type, layer_idx)
    blocks = store.blocks
    pool = blocks.pool
    if held.keep is None and pool.kv_dtype is None and not pool.growing and pool.moves == plan.moves:
        # the decode step's write, into the slot views the plan took at the step's begin: no lock, no call into
        # the pool, as BlockPool.write_unlocked writes ([B, H, q, D] -> [H, B*q, D], a view for a decode step)
        k, v = plan.views[layer_idx]
        slots = plan.new_slots.get(device)
        if slots is None:  # the step's slots, flat, on each device once
            slots = plan.new_slots[device] = held.new.reshape(-1).to(device)
        for pool_t, t in ((k, key_states), (v, value_states)):
            if t.requires_grad:
                t = t.detach()
            t = t.transpose(0, 1).reshape(pool_t.shape[0], -1, pool_t.shape[2])
            pool_t.index_copy_(1, slots, t if t.dtype == pool_t.dtype else t.to(pool_t.dtype))
        landed = not pool.growing and pool.moves == plan.moves
    else:
        keep = None if held.keep is None else held.keep.to(device)
        landed = pool.write_unlocked(layer_idx, held.new.to(device), key_states, value_states, keep)
    if not landed or pool.moves != plan.moves:
        with blocks.lock:  # a growth in another thread moved the tensors since the step began
            if not landed:  # and copied them before the write landed: written again, after it
                keep = None if held.keep is None else held.keep.to(device)
                pool.write(layer_idx, held.new.to(device), key_states, value_states, keep)
            # the step's later writes and reads go to the new tensors
            plan.views, plan.moves = pool.kv_slots, pool.moves
    held.seen[layer_idx] = held.length
    if plan.in_place:
        hand_out(plan, layer_idx, key_states)
        return key_states, value_states
    keys, values = plan.gather(layer_idx)
    if not plan.canonical and not (keys.is_contiguous() and values.is_contiguous()):
        # contiguous, as a DynamicCache hands them out: a model's own attention may .view them
        keys, values = keys.contiguous(), values.contiguous()
    if keys.dtype != key_states.dtype:
        keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
    if plan.probe:  # proven only if the model hands both, untouched, to the attention (docs/how-it-works.md)
        keys, values = reads.watch(plan, layer_idx, keys), reads.watch(plan, layer_idx, values)
    if plan.probe or plan.canonical:
        hand_out(plan, layer_idx, keys)
    return keys, values


def check_autocast(plan: reads.ForwardReads, device_type: str, layer: int) -> None:
    """Raise :class:`CacheMisuseError` unless the forward computes under the autocast its plan was made under
    (``plan.autocast``, the dtype of :func:`prefixkv.kv.key_space.autocast_in`), and note that the forward checked
    it: an autocast entered inside the model's forward is seen at its first layer, once a step. Mutates ``plan``."""
    # torch's own query, as prefixkv.kv.key_space.autocast_dtype asks it: two C calls where a step is counted
    computed = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    planned, plan.autocast = plan.autocast, False
    if computed != planned:
        raise CacheMisuseError(
            f"layer {layer} computes under torch.autocast(dtype={computed}), but this PagedPrefixCache was "
            f"built and planned under autocast={planned}: an autocast entered inside the model's forward (as "
            "accelerate's mixed precision does) is not seen before it runs. Enter the same autocast around the "
            "generate call too (with torch.autocast(...): or accelerator.autocast())"
        )


def check_layer(
    store: StoreParts,
    shapes: list[tuple[tuple[int, int], tuple[int, int]]],
    key_states: torch.Tensor,
    layer_idx: int,
    seen: int,
    length: int,
    value_states: torch.Tensor | None = None,
) -> None:
    """Raise :class:`CacheMisuseError` unless ``key_states`` (and ``value_states``) fit the store's layer
    ``layer_idx``, whose K and V shapes are ``shapes[layer_idx]`` (:func:`layer_shapes`), and a forward that
    allocated ``length - seen`` columns for it."""
    specs = store.blocks.pool.specs
    if layer_idx >= len(specs):
        raise CacheMisuseError(f"layer {layer_idx} does not exist in a store built for {len(specs)} layers")
    spec = specs[layer_idx]
    key_shape, value_shape = shapes[layer_idx]
    if (key_states.shape[1], key_states.shape[-1]) != key_shape:
        _wrong_shape(layer_idx, "K", key_states, key_shape)
    if value_states is not None and (value_states.shape[1], value_states.shape[-1]) != value_shape:
        _wrong_shape(layer_idx, "V", value_states, value_shape)
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


def layer_shapes(store: StoreParts) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each layer's K and V shapes (heads, head size) in ``store``'s pool, which :func:`check_layer` reads at every
    layer of every step: worked out once per cache. Does not mutate."""
    return [(s.key_shape, s.value_shape) for s in store.blocks.pool.specs]


def _wrong_shape(layer: int, name: str, given: torch.Tensor, built: tuple[int, int]) -> None:
    """Raise :class:`CacheMisuseError`: ``layer`` hands ``name`` (K or V) of another shape than the store's."""
    raise CacheMisuseError(
        f"layer {layer} gives {name} of {given.shape[1]} heads x {given.shape[-1]}, but the store was built for "
        f"{built[0]} x {built[1]}: this cache's store belongs to another model"
    )


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
            blocks.pool.zero_null_block()
    if ok:  # a compiled step wrote every layer (the graph has no per-layer record)
        held.seen[:] = [held.length] * len(held.seen)


def compile_refusal(store: StoreParts) -> str | None:
    """Why ``store``'s caches cannot take compiled decode steps (:func:`prefixkv.attention.static.refusal`), or a
    model whose attention is its own (the ``update`` path of docs/architectures.md: ALiBi, soft-capping, eager only),
    to which a compiled step does not hand its K/V, or one whose masks the installed transformers builds at a fixed
    length (:func:`prefixkv.compat.releases.compile_refusal`); ``None`` where they can. Does not mutate."""
    release = releases.compile_refusal(store.hf_model)
    if release is not None:
        return release
    kept = sorted({name for s in store.blocks.pool.specs for name, _ in s.extra})
    if kept:
        return f"its layers keep per-token tensors besides K and V ({', '.join(kept)}), which the step does not write"
    # a hybrid's recurrent layers step in the graph as they do eagerly (transformers 5's LinearAttentionLayer keeps
    # static shapes); transformers' hybrids run sdpa through AttentionInterface without declaring it, and the step's
    # K/V reach that sdpa under the step's mask as a StaticCache's do (docs/architectures.md, "Recurrent and hybrid")
    hybrid_sdpa = kinds.stateful(store.layer_kinds) and support.attends_through_interface(store.hf_model)
    if not interface.serves(store.hf_model) and not hybrid_sdpa:
        return (
            f"this {family(store.hf_model)} model runs its own attention, not prefixkv's (docs/architectures.md), and "
            "its compiled step is not one of prefixkv's"
        )
    return static.refusal(store.settings, store.blocks.pool)
