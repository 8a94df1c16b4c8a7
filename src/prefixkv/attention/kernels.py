"""The attention kernels every backend of the pool builds on: attention over K/V with any strides, returning the
log-sum-exp of the scores (:func:`attend`; :func:`attend_masked` with its mask prepared once per forward,
:func:`kernel_mask`), the merge of two parts by their log-sum-exps (:func:`merge_by_lse`), and the canonical read of
an invariant store, every row's whole K/V in one grouped-head kernel call (:func:`whole_rows_attention`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..compat import releases
from .reads import ForwardReads


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
    if query.device.type == "cpu" and (releases.CPU_KERNEL_READS_GROUPED_HEADS or key.shape[1] == query.shape[1]):
        # torch's CPU flash kernel straight, as releases.cpu_flash_attention calls it: a call less in every layer
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=mask.bias, scale=scale
        )
    elif query.device.type == "cpu":  # a kernel that reads K/V head h for query head h: the heads repeated first
        out, lse = releases.cpu_flash_attention(query, key, value, mask.bias, scale, causal=causal)
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
    hit = None if forward is None else forward.whole_masks.get(id(mask))
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
            forward.whole_masks[id(mask)] = (mask, prepared)
    out, _ = attend_masked(query, key, value, prepared, scale)
    return out.transpose(1, 2).contiguous()
