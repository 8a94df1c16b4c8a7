"""The ``prefixkv`` attention implementation, registered with transformers' ``AttentionInterface``
and, for its masks, ``AttentionMaskInterface``, and the attention backends behind it (:func:`choose_backend`).

The store switches a model whose implementation is ``sdpa`` to it and back (``PrefixStore.close``). In a
forward with a ``PagedPrefixCache`` whose pool is on a device of :data:`READ_DEVICES` (the CPU), ``update``
writes only the new K/V and this attention reads every row's held K/V where they sit in the pool, from the
forward's read plan (:class:`prefixkv.attention.reads.ForwardReads`) that arrives on the K tensor ``update`` hands out
(the ``"blocks"`` backend, :func:`blocks_attention`: views of runs of blocks, one gather of scattered ones,
blocks shared by several rows read once for all of them), merging the parts by their log-sum-exp; the model's own
mask decides what each query sees. Everything else (calls without such a cache, a first forward that checks every
layer reaches this attention, dropout, position bias, CUDA pools, quantized pools: the ``"gather"`` backend) runs
the original ``sdpa`` on whole rows, which ``update`` gathers. ``PrefixStore(attention="flex")`` reads the pool in
place through torch's FlexAttention instead (:class:`~prefixkv.attention.flex.FlexBackend`,
registered with :func:`provide` by that module), on the CPU and CUDA alike. A model on ``eager`` (whose eager
code may be its own, e.g. soft-capping), or whose attention does not go through ``AttentionInterface`` (Falcon,
Bloom), keeps its implementation and is served through ``update`` alone.
docs/architectures.md lists the path of each family.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import _compat
from . import reads
from .reads import AttentionBackend, AttentionCall, ForwardReads, Layout, Read
from .static import STEP_KWARG

NAME = "prefixkv"
_BASE = "_prefixkv_base_attn"
_USERS = "_prefixkv_attention_users"


_F = TypeVar("_F", bound=Callable[..., Any])


def outside_compile(function: _F) -> _F:
    """``function`` run eagerly inside a ``torch.compile``d model: prefixkv's bookkeeping (a thread id, a lock, block
    tables, ints that change every step) would break graphs and recompile there (docs/faq.md, torch.compile)."""
    return cast(_F, torch.compiler.disable(function))


def _base(config: Any) -> str:
    return getattr(config, _BASE, None) or "sdpa"


def prefixkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``prefixkv`` attention: in a compiled decode step (the store's hook passed :data:`STEP_KWARG`; ``key``
    and ``value`` are every row's K/V over the step's bucket, :mod:`prefixkv.attention.static`) the model's own
    implementation, traced into the step's graph; otherwise :func:`paged_attention`, outside any graph."""
    if kwargs.pop(STEP_KWARG, False):
        fn = ALL_ATTENTION_FUNCTIONS[_base(module.config)]
        step: tuple[torch.Tensor, torch.Tensor | None] = fn(module, query, key, value, attention_mask, **kwargs)
        return step
    return paged_attention(module, query, key, value, attention_mask, **kwargs)


@outside_compile
def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over the blocks of the ``PagedPrefixCache`` of this forward, when ``key`` is what the cache's
    ``update`` handed out for this layer (it carries the forward's read plan,
    :data:`prefixkv.attention.reads.TAG`) and the
    plan's backend serves the call; otherwise, or for what reading the blocks does not implement (soft-capping,
    attention sinks, dropout), the implementation the model had before the store switched it, on every row's
    whole K/V."""
    found: tuple[ForwardReads, int] | None = getattr(key, reads.TAG, None)
    if found is not None:
        forward, layer = found
        forward.served.add(layer)
        backend = forward.backend
        if forward.in_place and backend is not None:
            call = AttentionCall(module, query, key, value, attention_mask, kwargs)
            if backend.servable(forward, call):
                return backend.attend(forward, layer, call), None
            key, value = forward.gather(layer)
        elif forward.canonical:
            if canonical_servable(module, query, attention_mask, kwargs, forward):
                return whole_rows_attention(query, key, value, attention_mask, kwargs.get("scaling"), forward), None
            if key.shape[0] == 1:  # a lone row's view of the pool (Reader._gather) as the copy it stands for
                key, value = key.contiguous(), value.contiguous()
    fn = ALL_ATTENTION_FUNCTIONS[_base(module.config)]
    out: tuple[torch.Tensor, torch.Tensor | None] = fn(module, query, key, value, attention_mask, **kwargs)
    return out


def sdpa_servable(
    module: torch.nn.Module,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    forward: ForwardReads,
) -> bool:
    """Whether :func:`blocks_attention` computes what transformers' ``sdpa`` attention (the only implementation
    the store switches from) would for this call: no dropout, no position bias, causal, and a mask that is ``None``
    or boolean over the forward's columns. Other arguments ``sdpa`` ignores, and so does this."""
    if kwargs.get("dropout") or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    causal = kwargs.get("is_causal")
    if not (causal if causal is not None else getattr(module, "is_causal", True)):
        return False
    if mask is None:
        return True
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] in (1, query.shape[0])
        and mask.shape[1] == 1
        and mask.shape[2] == query.shape[2]
        and mask.shape[3] == forward.columns
    )


def canonical_servable(
    module: torch.nn.Module,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    forward: ForwardReads,
) -> bool:
    """Whether :func:`whole_rows_attention` serves a call of an invariant store's canonical read (whole rows, in
    logical order): what :func:`sdpa_servable` admits, on a device whose pools attention reads in place (the
    CPU's flash kernel reads grouped heads; elsewhere the model's own attention runs, as it always did)."""
    return query.device.type in READ_DEVICES and sdpa_servable(module, query, mask, kwargs, forward)


def whole_rows_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    forward: ForwardReads | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, q, D]`` over every row's whole ``key``/``value`` ``[B, Hkv, n, D]`` under the
    model's boolean ``mask`` (``None``: every held column, the new ones causally), ``[B, q, Hq, D]``, in one kernel
    call per row that reads the grouped K/V heads without repeating them (:func:`attend`). Its shapes and
    reduction order follow from the call's shapes alone, never from where the K/V came from, which is what an
    invariant store's canonical read needs (docs/correctness.md, "Outputs that never depend on the cache"). With
    ``forward``, the mask in the kernel's form is worked out once per forward for each mask the model passes, not
    per layer (mutates the plan's memo)."""
    key, value = key.to(query.dtype), value.to(query.dtype)
    group = packs(query, key, False)
    memo = (id(mask), -2)  # the reads' memo keys are (mask, part >= 0) and (mask, -1): new_mask
    hit = None if forward is None else forward.masks.get(memo)
    if hit is not None and hit[0] is mask:
        prepared = hit[1]
    else:
        whole = mask
        if whole is None:
            q, n = query.shape[2], key.shape[2]
            whole = torch.ones(q, n, dtype=torch.bool, device=query.device).tril(n - q)[None, None]
        # a mask that lets every query see every column (a decode step without padding): none, which the kernel
        # runs faster; decided by the call's mask alone, so the same cold and warm
        everything = whole.dtype == torch.bool and bool(whole.all())
        prepared = NO_MASK if everything else kernel_mask(whole, query.dtype, group)
        if forward is not None:
            forward.masks[memo] = (mask, prepared)
    out, _ = attend_masked(query, key, value, prepared, scale)
    return out.transpose(1, 2).contiguous()


def prefixkv_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask of the original implementation (a mask for every registered attention name, rule 5)."""
    config = kwargs.get("config")
    return ALL_MASK_ATTENTION_FUNCTIONS[_base(config)](*args, **kwargs)


AttentionInterface.register(NAME, prefixkv_attention_forward)
AttentionMaskInterface.register(NAME, prefixkv_mask)


def install(model: Any) -> bool:
    """Switch ``model`` to ``prefixkv`` attention if it uses ``sdpa`` through ``AttentionInterface``; count
    the stores using it. Mutates the model's config. Returns whether the model runs ``prefixkv`` attention.

    Models whose attention code does not look its function up by name (Falcon, Bloom: transformers'
    ``is_backend_compatible()`` is false) keep their implementation and are served through ``update``."""
    config = model.config
    current = config._attn_implementation
    if current == NAME:
        setattr(model, _USERS, getattr(model, _USERS, 0) + 1)
        return True
    if current != "sdpa" or not model.is_backend_compatible():
        return False
    setattr(config, _BASE, current)
    model.set_attn_implementation(NAME)
    setattr(model, _USERS, 1)
    return True


def uninstall(model: Any) -> None:
    """Undo one :func:`install`; the last store to leave restores the original implementation."""
    users = getattr(model, _USERS, 0)
    if users <= 0:
        return
    if users > 1:
        setattr(model, _USERS, users - 1)
        return
    delattr(model, _USERS)  # leave no trace on the model (prefixkv.disable restores it exactly)
    model.set_attn_implementation(_base(model.config))


# -- reading the blocks ------------------------------------------------------------------------------------------
#
# A forward with a PagedPrefixCache on a model that runs ``prefixkv`` attention hands attention only the new K/V;
# the cache describes where every row's earlier K/V sit in the pool (:class:`Read`), and the attention reads them
# there: a contiguous run of blocks as a view of the pool, a scattered rest by one gather. Rows that hold the same
# leading blocks (one system prompt under a batch of questions, ``num_return_sequences``, beams) read those blocks
# in one pass with all their queries (cascade attention), and every part's result is merged with the others by its
# log-sum-exp. The model's mask decides what each query sees, so padding, holes and sliding windows hold as in the
# model's own implementation.


def part_mask_of(
    forward: ForwardReads, mask: torch.Tensor | None, index: int, q: int, batch: int, dtype: torch.dtype, group: int
) -> KernelMask:
    """The mask of read ``index`` (:func:`_read_mask`) from the model's ``mask`` (its batch dimension 1 or
    ``batch``), in the kernels' form for queries in ``dtype`` packing ``group`` heads (:func:`kernel_mask`), or
    :data:`NO_MASK` where it lets every query see every column (the held columns of a row without padding: the flash
    kernel runs faster without a mask), worked out once per forward for each mask the model passes, not per layer.
    Mutates the plan's memo."""
    key = (id(mask), index)
    hit = forward.masks.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]  # type: ignore[no-any-return]
    part = _read_mask(None if mask is None else _batched(mask, batch), forward.reads[index], q)
    if part is not None and part.dtype == torch.bool and bool(part.all()):
        part = None
    prepared = kernel_mask(part, dtype, group)
    forward.masks[key] = (mask, prepared)
    return prepared


def new_mask(
    forward: ForwardReads, mask: torch.Tensor | None, q: int, batch: int, dtype: torch.dtype, group: int
) -> tuple[KernelMask, bool]:
    """The mask of the new columns (from ``new_from``) in the kernels' form (``group`` heads packed where it is not
    causal) and whether it is plain causal (then :data:`NO_MASK`, and the kernel's causal flag serves it faster),
    once per forward for each mask. Mutates the plan's memo."""
    key = (id(mask), -1)
    hit = forward.masks.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]  # type: ignore[no-any-return]
    assert forward.new_from is not None
    part = None if mask is None else _batched(mask, batch)[..., forward.new_from :]
    if part is not None and part.dtype == torch.bool and part.shape[-1] == q:
        causal = torch.ones(q, q, dtype=torch.bool, device=part.device).tril()
        if bool((part == causal).all()):
            part = None
    result = (kernel_mask(part, dtype, 1 if part is None else group), part is None)
    forward.masks[key] = (mask, result)
    return result


# device types whose pools attention reads in place. On CUDA, reading row by row costs a kernel launch per part
# and row, which an H200 showed 4-6x slower than one gather and one batched kernel at batch 8 (docs/benchmarks.md);
# a paged kernel is what reads blocks in place there
READ_DEVICES = frozenset({"cpu"})

# models whose every attention layer was seen to hand the K/V from ``update`` to this attention unchanged
_VERIFIED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def serves(model: Any) -> bool:
    """Whether ``model`` runs ``prefixkv`` attention (so a cache may hand it only the new K/V)."""
    return getattr(model.config, "_attn_implementation", None) == NAME


def verified(model: Any) -> bool:
    """Whether a forward of ``model`` was seen to pass every layer's K/V from the cache to this attention."""
    return _VERIFIED.get(model, False)


def mark_verified(model: Any) -> None:
    """Note that a forward of ``model`` passed every layer's K/V from the cache to this attention. Mutates."""
    _VERIFIED[model] = True


class KernelMask(NamedTuple):
    """A mask in the form the kernels take it, worked out once per forward and part rather than per layer: ``bias``,
    additive (``None``: every column is seen), over the query rows as the kernel sees them (grouped heads packed as
    more rows), and ``unseen`` ``[B, 1, rows]``, the rows that see no column (their output is 0; ``None``: none)."""

    bias: torch.Tensor | None
    unseen: torch.Tensor | None


NO_MASK = KernelMask(None, None)


def kernel_mask(mask: torch.Tensor | None, dtype: torch.dtype, group: int) -> KernelMask:
    """``mask`` (boolean, True: attend, or float, added; ``[B, 1, q, n]``) as :func:`attend_masked` takes it for
    queries in ``dtype`` whose ``group`` query heads per K/V head are packed as rows (1: not packed). Does not
    mutate."""
    if mask is None:
        return NO_MASK
    if group > 1:
        mask = mask.repeat(1, 1, group, 1)
    if mask.dtype != torch.bool:
        return KernelMask(mask.to(dtype), None)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
    seen = mask.any(dim=-1)  # [B, 1, rows]
    return KernelMask(bias, None if bool(seen.all()) else ~seen)


def packs(query: torch.Tensor, key: torch.Tensor, causal: bool) -> int:
    """How many query heads :func:`attend_masked` packs as rows of one K/V head (1: none)."""
    group = query.shape[1] // key.shape[1]
    return group if group > 1 and not causal else 1


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[B, Hq, q, D]`` over ``key``/``value`` ``[B, Hkv, n, D]`` (any strides with a
    contiguous last dimension; ``Hq`` a multiple of ``Hkv``), with a boolean ``mask`` ``[B, 1, q, n]`` (True:
    attend) or a float one (added), or ``causal`` for ``q == n``. Returns the output ``[B, Hq, q, D]`` and the
    log-sum-exp of the scores ``[B, Hq, q]`` in float32 or float64, ``-inf`` where a query sees no column (its
    output is then 0).

    Without ``causal``, the query heads that share a K/V head are packed as more query rows of that head (as
    transformers' ``pack_gqa`` does for decode), so each K/V head is read once, not once per query head."""
    prepared = kernel_mask(mask, query.dtype, packs(query, key, causal))
    return attend_masked(query, key, value, prepared, scale, causal=causal)


def attend_masked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: KernelMask,
    scale: float | None,
    *,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` with its mask already in the kernels' form (:func:`kernel_mask` for :func:`packs` heads), so
    that the layers of one forward share the work. Does not mutate."""
    group = packs(query, key, causal)
    b, heads, q, dim = query.shape
    if group > 1:
        query = query.reshape(b, key.shape[1], group * q, dim)
    if query.device.type == "cpu":
        out, lse = _compat.cpu_flash_attention(query, key, value, mask.bias, scale, causal=causal)
    elif query.dtype != torch.float64 and query.device.type == "cuda":
        out, lse = _attend_cuda(query, key, value, mask.bias, scale, causal)
    else:
        out, lse = _attend_math(query, key, value, mask.bias, scale, causal)
    if mask.unseen is not None:
        lse = lse.masked_fill(mask.unseen, -math.inf)
        out = out.masked_fill(mask.unseen[..., None], 0.0)
    if group > 1:
        return out.reshape(b, heads, q, dim), lse.reshape(b, heads, q)
    return out, lse


def _attend_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    additive: torch.Tensor | None,
    scale: float | None,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` with torch's memory-efficient CUDA kernel, which returns the log-sum-exp (it takes equal
    head counts, so grouped K/V heads are repeated; a mask is padded to its alignment). Falls back to
    :func:`_attend_math` where the kernel refuses the inputs."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    bias = None
    if additive is not None:
        n = additive.shape[-1]
        padded = additive.new_zeros((*additive.shape[:-1], -(-n // 16) * 16))
        padded[..., :n] = additive
        bias = padded[..., :n].expand(query.shape[0], query.shape[1], query.shape[2], n)
    try:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, causal, scale=scale
        )[:2]
    except RuntimeError:
        return _attend_math(query, key, value, additive, scale, causal)
    return out, lse[..., : query.shape[2]]


def _attend_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    additive: torch.Tensor | None,
    scale: float | None,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` in plain tensor operations (devices without a CPU kernel), for reference and fallback."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = query.to(work) @ key.to(work).transpose(-1, -2) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if additive is not None:
        scores = scores + additive.to(work)
    if causal:
        q, n = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(q, n, dtype=torch.bool, device=scores.device).triu(1), -math.inf)
    lse = scores.logsumexp(dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = (scores - safe[..., None]).exp() @ value.to(work)
    return out.to(query.dtype), lse


def merge_by_lse(
    out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint column sets by their log-sum-exps: the first weighs
    ``exp(lse) / (exp(lse) + exp(other_lse))``, a sigmoid of the difference (0 where neither saw a column:
    both outputs are 0 there)."""
    weight = torch.sigmoid(lse - other_lse).nan_to_num_(0.0)  # float32 or float64, as the log-sum-exps
    merged = torch.lerp(other.to(weight.dtype), out.to(weight.dtype), weight[..., None])
    return merged, torch.logaddexp(lse, other_lse)


def _pool_columns(pool: torch.Tensor, read: Read) -> torch.Tensor:
    """``[rows or 1, kv_heads, n, head_dim]`` K or V of a read from a layer's pool tensor ``[kv_heads, num_blocks,
    block_size, head_dim]``: a view for runs (each head one contiguous range), a gather otherwise."""
    heads, dim = pool.shape[0], pool.shape[3]
    flat = pool.view(heads, -1, dim)
    if read.first_slot is not None:
        if read.row_stride is not None:
            return flat.as_strided(
                (len(read.rows), heads, read.length, dim),
                (read.row_stride * dim, flat.stride(0), dim, 1),
                flat.storage_offset() + read.first_slot * dim,
            )
        return flat[:, read.first_slot : read.first_slot + read.length].unsqueeze(0)
    assert read.slots is not None
    slots = read.slots.to(flat.device)
    if slots.dim() == 1:
        return flat.index_select(1, slots).unsqueeze(0)
    rows, n = slots.shape
    return flat.index_select(1, slots.view(-1)).view(heads, rows, n, dim).transpose(0, 1)


def _batched(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The model's mask with its batch dimension expanded to ``batch`` (a view) where it is 1."""
    return mask if mask.shape[0] == batch else mask.expand(batch, *mask.shape[1:])


def _read_mask(mask: torch.Tensor | None, read: Read, q: int) -> torch.Tensor | None:
    """The mask of a read's queries over its columns: ``[rows, 1, q, n]`` (``[1, 1, rows * q, n]`` for shared
    K/V), from the model's ``mask`` (``None``: every column is seen, except a gather's padding)."""
    if read.valid is not None:  # a gather of several rows
        assert read.offsets is not None
        valid = read.valid.to(mask.device if mask is not None else read.valid.device)
        if mask is None:
            return valid[:, None, None, :].expand(len(read.rows), 1, q, read.length)
        rows = torch.tensor(read.rows, device=mask.device)
        index = read.offsets.to(mask.device)[:, None, None, :].expand(len(read.rows), 1, q, read.length)
        return mask.index_select(0, rows).gather(-1, index) & valid[:, None, None, :]
    if mask is None:
        return None
    if read.offsets is not None:
        offsets = read.offsets.to(mask.device)
        parts = [mask[r : r + 1].index_select(-1, offsets + c) for r, c in zip(read.rows, read.columns)]
    else:
        parts = [mask[r : r + 1, :, :, c : c + read.length] for r, c in zip(read.rows, read.columns)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0 if read.row_stride is not None else 2)


def blocks_attention(
    forward: ForwardReads,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, q, D]`` over what ``forward`` describes for ``layer``: its reads of the
    pool, and, when ``forward.new_from`` is set, the new ``key``/``value`` ``[B, Hkv, q, D]``; ``mask`` is the
    model's ``[B, 1, q, columns]`` mask (``None``: every held column and the new ones causally). Returns
    ``[B, q, Hq, D]`` as transformers' attention functions do."""
    batch, heads, q, dim = query.shape
    pool_k, pool_v = forward.pool.keys[layer], forward.pool.values[layer]
    group = max(1, heads // pool_k.shape[0])
    everyone = tuple(range(batch))
    parts: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor]] = []
    for number, read in enumerate(forward.reads):
        k, v = _pool_columns(pool_k, read), _pool_columns(pool_v, read)
        part_mask = part_mask_of(forward, mask, number, q, batch, query.dtype, group)
        if len(read.rows) == 1:
            out, lse = attend_masked(query[read.rows[0] : read.rows[0] + 1], k, v, part_mask, scale)
        else:
            chosen = query if read.rows == everyone else query.index_select(0, _rows_index(forward, read.rows, query))
            if read.row_stride is None and read.valid is None:  # shared K/V: every row's queries in one pass
                stacked = chosen.transpose(0, 1).reshape(1, heads, len(read.rows) * q, dim)
                out, lse = attend_masked(stacked, k, v, part_mask, scale)
                out = out.view(heads, len(read.rows), q, dim).transpose(0, 1)
                lse = lse.view(heads, len(read.rows), q).transpose(0, 1)
            else:
                out, lse = attend_masked(chosen, k, v, part_mask, scale)
        parts.append((read.rows, out, lse))
    if forward.new_from is not None:
        new, causal = new_mask(forward, mask, q, batch, query.dtype, group)
        out, lse = attend_masked(query, key, value, new, scale, causal=causal)
        parts.append((everyone, out, lse))
    if len(parts) == 1 and parts[0][0] == everyone:
        merged = parts[0][1]
    else:
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
        if parts[0][0] == everyone:  # the first part covers every row: start from it
            _, merged, total = parts.pop(0)
            merged, total = merged.to(work), total.to(work)
        else:
            merged = query.new_zeros((batch, heads, q, dim), dtype=work)
            total = query.new_full((batch, heads, q), -math.inf, dtype=work)
        for rows, out, lse in parts:
            if rows == everyone:
                merged, total = merge_by_lse(merged, total, out, lse)
                continue
            index = _rows_index(forward, rows, query)
            m, t = merge_by_lse(merged.index_select(0, index), total.index_select(0, index), out, lse)
            merged.index_copy_(0, index, m.to(work))
            total.index_copy_(0, index, t.to(work))
    return merged.to(query.dtype).transpose(1, 2).contiguous()


def _rows_index(forward: ForwardReads, rows: tuple[int, ...], query: torch.Tensor) -> torch.Tensor:
    """``rows`` as an index tensor on the queries' device, made once per forward. Mutates the plan's memo."""
    index = forward.rows_index.get(rows)
    if index is None:
        index = forward.rows_index[rows] = torch.tensor(rows, device=query.device)
    return index


# -- the backends -----------------------------------------------------------------------------------------------


class BlocksBackend:
    """``"blocks"``: the attention reads every row's held K/V where they sit in the pool (:func:`blocks_attention`),
    from reads planned by :func:`prefixkv.attention.reads.plan_reads`. Keeps each row table's runs of consecutive blocks
    between forwards (a table that only grew is re-walked from its last block), and the index tensors of the last
    folded read."""

    name = "blocks"

    def __init__(self) -> None:
        self._runs: reads.RunsMemo = {}
        self._fold: reads.FoldMemo = {}

    def plan(self, layout: Layout, *, probe: bool) -> ForwardReads:
        """The forward's reads; with ``probe`` none (``update`` hands out whole rows, and the forward only checks
        that every layer reaches this attention). Mutates the runs memo."""
        pool, pads, tables, start, q, block_size, gather = layout
        planned, new_from = (
            ([], None)
            if probe
            else reads.plan_reads(pads, tables, start, q, block_size, self._runs, fold_memo=self._fold)
        )
        return ForwardReads(pool, planned, start + q, new_from, gather, probe=probe, backend=self)

    def servable(self, forward: ForwardReads, call: AttentionCall) -> bool:
        return sdpa_servable(call.module, call.query, call.mask, call.kwargs, forward)

    def attend(self, forward: ForwardReads, layer: int, call: AttentionCall) -> torch.Tensor:
        scale = call.kwargs.get("scaling")
        return blocks_attention(forward, layer, call.query, call.key, call.value, call.mask, scale)


class GatherBackend:
    """``"gather"``: ``update`` reads every row's whole K/V out of the pool and the model's own attention runs
    over them (CUDA pools, quantized pools, models whose attention does not go through this module)."""

    name = "gather"

    def plan(self, layout: Layout, *, probe: bool) -> ForwardReads:
        """A plan of no reads: whole rows for every layer. Does not mutate."""
        return ForwardReads(layout.pool, [], layout.start + layout.q, None, layout.gather, in_place=False)

    def servable(self, forward: ForwardReads, call: AttentionCall) -> bool:
        """Never: the model's own implementation over the whole rows ``update`` handed out is exact."""
        return False

    def attend(self, forward: ForwardReads, layer: int, call: AttentionCall) -> torch.Tensor:
        """Attention of the call's query over every row's whole K/V of ``layer`` (``forward.gather``) under its
        mask (``None``: every held column, the new ones causally), ``[B, q, Hq, D]``. Mutates only the plan's
        mask memo."""
        k, v = forward.gather(layer)
        return whole_rows_attention(call.query, k, v, call.mask, call.kwargs.get("scaling"), forward)


BACKENDS = ("auto", "blocks", "flex", "gather")

# the backend each store asked for (``PrefixStore(attention=...)``), by its pool: what every cache of it reads


# a backend that a module above this one provides, by name: given the pool's device, dtype and block size and the
# model's soft-capping, the backend (``None``: it cannot serve them) and the one-line reason
Provider = Callable[[torch.device, torch.dtype, int, float | None], tuple[AttentionBackend | None, str]]
# prefixkv.attention.flex provides "flex" when it is imported (the store imports it); this module imports none of them
_PROVIDED: dict[str, Provider] = {}


def provide(name: str, provider: Provider) -> None:
    """Make ``provider`` build the backend ``name`` of :data:`BACKENDS` (:func:`choose_backend`). Mutates module
    state."""
    _PROVIDED[check_backend(name)] = provider


def check_backend(name: Any) -> str:
    """``name`` if it names a backend of :data:`BACKENDS`, else a ``ValueError`` that lists them."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(map(repr, BACKENDS))}, got {name!r}")
    return name


def choose_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype | str,
    *,
    model_dtype: torch.dtype,
    block_size: int = 16,
    softcap: float | None = None,
) -> tuple[AttentionBackend, str]:
    """The attention backend called ``name`` (``"blocks"``, ``"gather"``, ``"flex"`` where FlexAttention serves the
    pool, else ``"gather"``, or ``"auto"``: ``"blocks"`` where the pool is on a device of :data:`READ_DEVICES` and
    stored in the dtype the model computes in, else ``"gather"``) for a pool on ``device`` stored as ``dtype`` (a
    torch dtype, or a quantized storage: ``"int8"``, ``"fp8"``) in blocks of ``block_size``, for a model whose
    attention soft-caps its logits at ``softcap``, and a one-line reason. A fresh backend each call: it keeps its
    own metadata. Does not mutate."""
    check_backend(name)
    readable = dtype == model_dtype
    if name == "blocks" and not readable:
        raise ValueError(
            f"the 'blocks' backend reads the pool in the dtype the model computes in ({model_dtype}), but the pool "
            f"is stored as {dtype}: choose 'gather' or 'auto'"
        )
    if name == "gather":
        return GatherBackend(), "gather: asked for by name"
    if name == "blocks":
        return BlocksBackend(), "blocks: asked for by name"
    if name == "flex":
        if not readable or isinstance(dtype, str):
            return GatherBackend(), f"gather: the pool is stored as {dtype}, the model computes in {model_dtype}"
        provider = _PROVIDED.get(name)
        if provider is None:
            return GatherBackend(), "gather: prefixkv.attention.flex, which provides 'flex', was not imported"
        backend, why = provider(device, dtype, block_size, softcap)
        return (GatherBackend() if backend is None else backend), why
    if not readable:
        return GatherBackend(), f"gather: the pool is stored as {dtype}, the model computes in {model_dtype}"
    if device.type not in READ_DEVICES:
        return GatherBackend(), f"gather: reading the blocks in place is not implemented fast on {device.type}"
    return BlocksBackend(), f"blocks: the pool is on {device.type} in {dtype}"


def pool_backend(name: str, pool: Any, model: Any, model_dtype: torch.dtype) -> tuple[AttentionBackend | None, str]:
    """The backend ``name`` (the store's ``attention=``), as :func:`choose_backend` resolves it for the pool, and
    why; ``None`` for layers split across devices or dtypes (whole rows, read layer
    by layer). Does not mutate."""
    specs = pool.specs
    if not specs or len({s.device for s in specs}) > 1 or len({s.dtype for s in specs}) > 1:
        return None, "gather: the pool's layers lie on several devices or dtypes"
    stored = pool.kv_dtype if pool.kv_dtype is not None else specs[0].dtype
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    return choose_backend(
        name,
        specs[0].device,
        stored,
        model_dtype=model_dtype,
        block_size=pool.block_size,
        softcap=softcap,
    )


class Reader:
    """How one cache's K/V reach the attention: the backend ``name`` the store was built with
    (:func:`pool_backend`; ``None`` for layers split across devices or dtypes: whole rows, read layer by layer) and
    the whole-row reader. A backend
    reads in place only on a model that runs ``prefixkv`` attention and, until a forward of that model showed every
    layer handing the K/V from ``update`` to that attention unchanged, only probes (``update`` hands out whole rows). An
    invariant store reads whole rows in logical order, attended in one grouped-head kernel call
    (:func:`whole_rows_attention`) or by the model's own attention (docs/correctness.md, "Outputs that never
    depend on the cache")."""

    def __init__(
        self,
        pool: Any,
        gather: reads.Gather,
        block_size: int,
        *,
        name: str,
        model: Any,
        model_dtype: torch.dtype,
        invariant: bool,
    ) -> None:
        self._pool, self._bs, self._model, self._invariant = pool, block_size, model, invariant
        self._whole = reads.WholeRows(gather, block_size)
        self._backend, _ = pool_backend(name, pool, model, model_dtype)
        self._run: tuple[int, int, int] | None = None  # a lone row's consecutive blocks: first, count, columns

    def plan(self, pads: list[int], tables: list[list[int]], start: int, q: int) -> ForwardReads:
        """The read plan of a forward feeding ``q`` columns after ``start`` (docs/how-it-works.md, "Attention reads
        the blocks"), once per forward. Mutates only what the reader keeps between forwards."""
        self._whole.begin(pads, tables, start + q)
        gather = self._gather
        if self._invariant or not serves(self._model) or self._backend is None:
            canonical = self._invariant and serves(self._model)
            self._run = _lone_run(self._pool, pads, tables, start + q, self._bs) if canonical else None
            return ForwardReads(self._pool, [], start + q, None, gather, in_place=False, canonical=canonical)
        layout = Layout(self._pool, pads, tables, start, q, self._bs, gather)
        return self._backend.plan(layout, probe=not verified(self._model))

    def _gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's whole K/V of ``layer``, ``[B, kv_heads, columns, head_dim]``, copied out of the pool; in an
        invariant store's canonical read, a lone row whose blocks lie one after the other in the pool reads a
        view of them instead: the same values in the same per-head layout (a row's columns ``head_dim`` apart),
        so the same kernel call, without the copy."""
        if self._run is not None:
            first, count, columns = self._run
            heads, _, bs, dim = self._pool.keys[layer].shape
            k, v = (t[layer][:, first : first + count] for t in (self._pool.keys, self._pool.values))
            shape = (heads, count * bs, dim)
            return k.reshape(shape)[None, :, :columns], v.reshape(shape)[None, :, :columns]
        return self._whole.read(layer, self._pool.specs[layer].device)


def _lone_run(
    pool: Any, pads: list[int], tables: list[list[int]], columns: int, bs: int
) -> tuple[int, int, int] | None:
    """``(first block, blocks, columns)`` when the forward has one row, no padding, and its first ``columns``
    lie in consecutive blocks of an unquantized pool on a device whose pools attention reads in place; else
    ``None``. Does not mutate."""
    if len(tables) != 1 or pads[0] or pool.kv_dtype is not None or not pool.keys:
        return None
    if any(k.device.type not in READ_DEVICES for k in pool.keys):
        return None
    count = -(-columns // bs)
    table = tables[0][:count]
    if len(table) < count or any(b != table[0] + i for i, b in enumerate(table)):
        return None
    return table[0], count, columns
