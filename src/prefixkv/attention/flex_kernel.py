"""torch's FlexAttention over the pool, the kernel of the ``"flex"`` backend: every row's held K/V read where they lie
in a layer's pool.

A layer's pool ``[kv_heads, num_blocks, block_size, head_dim]`` viewed as ``[1, kv_heads, num_blocks * block_size,
head_dim]`` (no copy) is what the kernel reads; a ``BlockMask`` built from the rows' block tables
(``BlockMask.from_kv_blocks``) lists, per row, which physical blocks to visit, in logical order, and a ``mask_mod``
maps each physical column back to the row's logical column to decide what a query sees: the row's length, its
visibility (padding, masked holes), causality and a sliding window, all by logical column, never by where a block
lies, and each row's blocks are visited in logical order. It splits a prefill into parts merged by their
log-sum-exps, so it is not the canonical read of an invariant store (docs/correctness.md, "Outputs that never
depend on the cache"), which gathers each row whole. A forward plans its reads once (:func:`plan`); every layer
with the same window executes them (:func:`attend`):

- decode (one query per row, its K/V already written to the pool): every row in one compiled call per layer;
- prefill: the held blocks through FlexAttention, the new columns causally through
  :func:`prefixkv.attention.kernels.attend`, merged by their log-sum-exps
  (:func:`prefixkv.attention.kernels.merge_by_lse`).

A block shared by several rows (a system prompt, ``num_return_sequences``) is listed once in each row's table.
Compiled kernels are specialised on shapes, so the batch and the query count are padded to powers of two and every
row's block list is as wide as the pool: a run that decodes at one batch size compiles once (:func:`compiles`),
again only when the pool grows or the batch crosses a power of two.
On the CPU the compiled kernel does not return the log-sum-exp (prefill runs torch's eager FlexAttention there,
which materialises the scores: a reference, not a fast path), and it compiles only when the full-block lists are
given (empty ones serve).

:func:`can_serve` says, in one line, why FlexAttention cannot serve a configuration; the caller then reads the
pool another way. :class:`prefixkv.attention.flex.FlexBackend` is this kernel behind the attention seam
(``PrefixStore(attention="flex")``); ``prefixkv.flex``, the name the docs give users, is that module, which
re-exports this one's public names.

>>> import torch
>>> from prefixkv import flex
>>> pool_k = torch.randn(2, 8, 16, 16)  # [kv_heads, blocks, block_size, head_dim]
>>> pool_v = torch.randn(2, 8, 16, 16)
>>> reads = flex.plan(torch.tensor([[5, 2]]), torch.tensor([20]), torch.tensor([[19]]), block_size=16,
...                   num_blocks=8, device="cpu")
>>> flex.attend(reads, torch.randn(1, 4, 1, 16), pool_k, pool_v, compiled=False).shape
torch.Size([1, 1, 4, 16])
"""

from __future__ import annotations

import threading
import warnings
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from prefixkv.attention.kernels import attend as attend_columns
from prefixkv.attention.kernels import merge_by_lse
from prefixkv.base.errors import PrefixKVError
from prefixkv.compat import releases

__all__ = ["FlexPlan", "FlexUnavailable", "attend", "can_serve", "compiles", "plan"]

# queries per tile of the BlockMask (FlexAttention's default); decode's single query sits in one tile
Q_TILE = 128


def _flex_frame(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    """``flex_attention`` called from a frame of prefixkv's own, which is what :data:`_compiled` compiles: dynamo
    keeps graphs and counts recompiles per code object, and ``flex_attention``'s own frame is shared with every
    other compile of it in the process (transformers' flex models, a user's): one that passed its recompile limit
    there would leave that frame to run eagerly from then on, ours included, and ours would count against theirs."""
    return flex_attention(query, key, value, **kwargs)


_compiled: Any = torch.compile(_flex_frame, dynamic=False)
_lock = threading.Lock()
_buckets: set[tuple[Any, ...]] = set()  # the shapes compiled so far (one compile each)
_failed: dict[tuple[str, torch.dtype, int], str] = {}  # (device type, dtype, block size) -> why compiling failed there


class FlexUnavailable(PrefixKVError, RuntimeError):
    """FlexAttention could not compile for these inputs; the message says why. Read the pool another way (the
    gather or the blocks reader): :func:`can_serve` refuses this device, dtype and block size from now on."""


def can_serve(
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    *,
    softcap: float | None = None,
    custom_mask: bool = False,
) -> tuple[bool, str]:
    """Whether this backend computes exactly what the model's attention would, and if not, the one-line reason.

    ``softcap``: the model's attention logit soft-capping (Gemma 2); ``custom_mask``: the model's mask is not
    expressible by logical columns (a float mask, or one that is not padding, holes, causal and a sliding window).
    A query, no state changes.

    >>> can_serve("cpu", torch.float64, 16)[1]
    'float64: FlexAttention computes in at most float32; the blocks reader or the gather serves it exactly'
    """
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        return False, f"device {kind}: FlexAttention compiles for the CPU and CUDA only"
    if dtype == torch.float64:
        return (
            False,
            "float64: FlexAttention computes in at most float32; the blocks reader or the gather serves it exactly",
        )
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return (
            False,
            f"{dtype}: FlexAttention reads float32, float16 and bfloat16 pools (the gather dequantizes 8-bit ones)",
        )
    if kind == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
        return False, (
            f"block size {block_size}: FlexAttention's CUDA kernel needs a power of two >= 16; "
            "make the store with block_size=16 or 64"
        )
    if softcap is not None:
        return False, f"soft-capping ({softcap}): not implemented by this backend; the model's own attention serves it"
    if custom_mask:
        return False, "the model's mask is not padding, holes, causal or a sliding window over logical columns"
    refusal = releases.flex_refusal()
    if refusal is not None:
        return False, refusal
    failed = _failed.get((kind, dtype, block_size))
    if failed is not None:
        return False, failed
    return True, "FlexAttention serves it"


def _graphs_on_frame() -> int:
    """The graphs dynamo holds on :func:`_flex_frame`, which its recompile limit counts whatever guard made each
    (torch's debug listing; this module's bucket count where a release lacks it)."""
    listing = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if listing is None:
        return len(_buckets)
    return max(len(listing(_flex_frame.__code__)), len(_buckets))


def compiles() -> int:
    """How many shapes the compiled kernel was specialised for in this process (each cost one compile)."""
    return len(_buckets)


class FlexPlan(NamedTuple):
    """One forward's reads of the pool, shared by the layers with the same ``window`` (:func:`plan`).

    ``block_mask`` lists every row's blocks (batch padded to ``padded_batch``, queries to ``padded_queries``);
    ``new_mask`` ``[B, 1, q, q]``: what each query sees of the forward's new columns (``None`` for decode, where
    they are in the pool); ``num_blocks``: the pool blocks it reads (a pool grown since is read up to them);
    ``key``: the compiled kernel's shape bucket, without the tensors' own shapes."""

    block_mask: BlockMask
    batch: int
    queries: int
    padded_batch: int
    padded_queries: int
    new_mask: torch.Tensor | None
    num_blocks: int
    key: tuple[Any, ...]


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan(
    tables: torch.Tensor | list[list[int]],
    lengths: torch.Tensor | list[int],
    positions: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int,
    device: torch.device | str,
    visible: torch.Tensor | None = None,
    new_visible: torch.Tensor | None = None,
    window: int | None = None,
    prefill: bool = False,
) -> FlexPlan:
    """Plan one forward's reads (no state changes).

    - ``tables`` ``[B, W]``: row ``b``'s logical block ``j`` is physical block ``tables[b][j]`` (ragged rows padded
      with any block id: only the first ``ceil(lengths[b] / block_size)`` entries are read); no block twice in a row;
    - ``lengths`` ``[B]``: held tokens per row (logical columns ``0 .. lengths[b] - 1``);
    - ``positions`` ``[B, q]``: each query's logical column (decode: ``lengths - 1``, its own K/V in the pool;
      prefill: the columns of the new K/V, after the held ones);
    - ``visible`` ``[B, >= max length]`` (bool, logical columns): False for padding and masked holes;
    - ``new_visible`` ``[B, q]`` (bool, prefill): the same for the new columns;
    - ``window``: a sliding window (a query at ``p`` sees columns ``> p - window``);
    - ``prefill``: the new K/V are passed to :func:`attend` (merged by log-sum-exp) rather than read from the pool.

    A query sees held column ``c`` when ``c < lengths[b]``, ``visible[b, c]``, ``c <= p`` and, with a window,
    ``p - c < window``."""
    device = torch.device(device)
    tables = torch.as_tensor(tables, dtype=torch.int64).to(device)
    lengths = torch.as_tensor(lengths, dtype=torch.int64).to(device)
    positions = positions.to(device=device, dtype=torch.int64)
    batch, width = tables.shape
    q = positions.shape[1]
    if lengths.shape != (batch,) or positions.shape[0] != batch:
        raise ValueError(
            f"plan: tables {tuple(tables.shape)}, lengths {tuple(lengths.shape)} and positions "
            f"{tuple(positions.shape)} must agree on the batch; give one length and one row of positions per table row"
        )
    needed = -(-int(lengths.max()) // block_size) if batch else 0
    if needed > width:
        raise ValueError(
            f"plan: a row holds {int(lengths.max())} tokens, {needed} blocks of {block_size}, "
            f"but the tables list only {width}; pass every block of every row"
        )
    padded_batch, padded_q = _power_of_two(batch), _power_of_two(q)
    # every row's block list as wide as the pool: the CPU kernel needs it, and rows that grow then never recompile
    padded_width = num_blocks
    columns = padded_width * block_size

    logical = torch.zeros(padded_batch, padded_width, dtype=torch.int64, device=device)
    kept = min(width, num_blocks)  # a row never holds more blocks than the pool has
    logical[:batch, :kept] = tables[:, :kept]
    held = torch.zeros(padded_batch, dtype=torch.int64, device=device)
    held[:batch] = lengths
    pos = torch.full((padded_batch, padded_q), -1, dtype=torch.int64, device=device)  # padded queries see nothing
    pos[:batch, :q] = positions
    seen = torch.zeros(padded_batch, columns, dtype=torch.bool, device=device)
    if visible is None:
        seen[:batch] = True
    else:
        n = min(visible.shape[1], columns)
        seen[:batch, :n] = visible[:, :n].to(device=device, dtype=torch.bool)
    col = torch.arange(columns, device=device)
    seen &= col < held[:, None]

    # physical block -> logical block of each row (-1: not the row's), what the mask_mod maps columns back with
    in_row = torch.arange(padded_width, device=device) < -(-held[:, None] // block_size)
    inverse = torch.full((padded_batch, num_blocks), -1, dtype=torch.int64, device=device)
    rows = torch.arange(padded_batch, device=device)[:, None].expand(-1, padded_width)
    inverse[rows[in_row], logical[in_row]] = torch.arange(padded_width, device=device).expand(padded_batch, -1)[in_row]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        block = inverse[b, kv_idx // block_size]
        c = (block * block_size + kv_idx % block_size).clamp(min=0)
        p = pos[b, q_idx]
        ok = (block >= 0) & seen[b, c] & (c <= p)
        if window is not None:
            ok = ok & (p - c < window)
        return ok

    # per query tile and logical block: listed when some query of the tile may see a column of it, full when every
    # query sees every column (the kernel then skips the mask_mod)
    tiles = -(-padded_q // Q_TILE)
    tile_pos = torch.nn.functional.pad(pos, (0, tiles * Q_TILE - padded_q), value=-1).view(padded_batch, tiles, -1)
    last = tile_pos.amax(-1)  # [Bp, tiles]; -1 for a tile of padded queries only
    first = torch.where(tile_pos < 0, last[..., None], tile_pos).amin(-1)
    start = torch.arange(padded_width, device=device) * block_size  # [Wp]
    end = start + block_size - 1
    blocks_seen = seen.view(padded_batch, padded_width, block_size)
    some, every = blocks_seen.any(-1)[:, None, :], blocks_seen.all(-1)[:, None, :]
    listed = some & (start <= last[..., None])
    full = every & (end <= first[..., None]) & (last >= 0)[..., None]
    if window is not None:
        listed &= end > first[..., None] - window
        full &= start > last[..., None] - window
    listed &= in_row[:, None, :]
    partial = listed & ~full

    def indices(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # chosen first, in logical order
        ids = logical[:, None, :].expand(-1, tiles, -1).gather(-1, order)
        return chosen.sum(-1, dtype=torch.int32)[:, None], ids.to(torch.int32)[:, None]

    partial_num, partial_ids = indices(partial)
    full_num, full_ids = indices(full)
    block_mask = BlockMask.from_kv_blocks(
        partial_num,
        partial_ids,
        full_num,
        full_ids,
        BLOCK_SIZE=(Q_TILE, block_size),
        mask_mod=mask_mod,
        seq_lengths=(padded_q, num_blocks * block_size),
        compute_q_blocks=False,
    )
    new_mask = None
    if prefill:
        causal = torch.ones(q, q, dtype=torch.bool, device=device).tril()
        new_mask = causal.expand(batch, q, q).clone()
        if new_visible is not None:
            new_mask &= new_visible.to(device=device, dtype=torch.bool)[:, None, :]
        if window is not None:
            new_mask &= positions[:, :, None] - positions[:, None, :] < window
        new_mask = new_mask[:, None]
    key = (device.type, padded_batch, padded_q, num_blocks, block_size, window)
    return FlexPlan(block_mask, batch, q, padded_batch, padded_q, new_mask, num_blocks, key)


def _flex(
    reads: FlexPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    lse: bool,
    compiled: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention over the pool views; compiled (the log-sum-exp only off the CPU) or torch's eager version."""
    aux = releases.flex_aux_request()(lse=True) if lse else None
    result: Any
    if not compiled:
        with warnings.catch_warnings():  # eager is chosen on purpose (the CPU's log-sum-exp, or a reference)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            result = flex_attention(
                query, key, value, block_mask=reads.block_mask, scale=scale, enable_gqa=True, return_aux=aux
            )
    else:
        # grad and inference mode are guards too: a graph compiled under generate's no_grad does not serve a
        # scoring pass with grad, so each mode is its own bucket
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), query.requires_grad)
        bucket = (*reads.key, query.dtype, query.shape[1], key.shape[1], query.shape[3], lse, modes)
        # every bucket's graph hangs on _flex_frame's one frame, where dynamo compiles at most
        # config.recompile_limit (8) and runs the rest eagerly: a new bucket raises that limit for its compile
        config = torch._dynamo.config
        raised = (
            config.patch(recompile_limit=max(config.recompile_limit, _graphs_on_frame() + 1))
            if bucket not in _buckets
            else nullcontext()
        )
        block_size = reads.block_mask.BLOCK_SIZE[1]
        try:
            with raised:
                result = _compiled(
                    query, key, value, block_mask=reads.block_mask, scale=scale, enable_gqa=True, return_aux=aux,
                    **_kernel_options(query.device, block_size),
                )  # fmt: skip
        except torch._dynamo.exc.BackendCompilerFailed as error:
            reason = (
                f"FlexAttention did not compile on {query.device.type} for {query.dtype} in blocks of {block_size}: "
                f"{str(error).splitlines()[0]}"
            )
            with _lock:
                _failed[(query.device.type, query.dtype, block_size)] = reason
            raise FlexUnavailable(reason) from error
        with _lock:
            _buckets.add(bucket)
    if lse:
        out, extra = result
        return out, extra.lse
    return result, None


def _kernel_options(device: torch.device, block_size: int) -> dict[str, Any]:
    """``flex_attention``'s ``kernel_options`` for a pool of ``block_size``: on CUDA, key tiles of at most the block
    (inductor's main kernel tiles keys by 64 or 128 on recent GPUs and refuses a block mask whose key blocks its tile
    does not divide, as a pool's blocks of 16 are); none elsewhere (the CPU kernel tiles by itself)."""
    if device.type != "cuda":
        return {}
    return {"kernel_options": {"BLOCK_N": min(block_size, 64)}}


def attend(
    reads: FlexPlan,
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    *,
    scale: float | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, q, D]`` (``Hq`` a multiple of the pool's kv heads) over the held K/V that
    ``reads`` lists in one layer's pool ``pool_k``/``pool_v`` ``[kv_heads, num_blocks, block_size, D]``, and for a
    prefill plan over the new ``key``/``value`` ``[B, kv_heads, q, D]`` too. Returns ``[B, q, Hq, D]``, as
    transformers' attention functions do; a query that sees no column gets zeros. ``compiled=False`` runs torch's
    eager FlexAttention (a reference). Raises :class:`FlexUnavailable` when the kernel does not compile."""
    batch, heads, q, dim = query.shape
    if (batch, q) != (reads.batch, reads.queries):
        raise ValueError(
            f"attend: the queries are {batch} rows of {q}, the plan was made for {reads.batch} of {reads.queries}"
        )
    prefill = reads.new_mask is not None
    if prefill and (key is None or value is None):
        raise ValueError("attend: a prefill plan merges the forward's new columns: pass key= and value=")
    padded = query.new_zeros(reads.padded_batch, heads, reads.padded_queries, dim)
    padded[:batch, :, :q] = query
    kv_heads = pool_k.shape[0]
    # [B, Hkv, blocks * block_size, D]: the pool itself, its batch a stride-0 dimension (every kernel takes K/V
    # with the queries' batch; not every one broadcasts a batch of 1)
    n = reads.num_blocks
    k_view = pool_k[:, :n].view(1, kv_heads, -1, dim).expand(reads.padded_batch, -1, -1, -1)
    v_view = pool_v[:, :n].view(1, kv_heads, -1, dim).expand(reads.padded_batch, -1, -1, -1)
    on_cpu = query.device.type == "cpu"
    out, lse = _flex(
        reads,
        padded,
        k_view,
        v_view,
        scale,
        lse=prefill,
        compiled=compiled and not (prefill and on_cpu),
    )
    out = out[:batch, :, :q]
    if prefill:
        assert key is not None and value is not None and lse is not None
        new_out, new_lse = attend_columns(query, key, value, reads.new_mask, scale)
        work = torch.float32 if query.dtype != torch.float64 else torch.float64
        held_lse = lse[:batch, :, :q].to(work)
        out, _ = merge_by_lse(out, held_lse, new_out, new_lse.to(work))
    return out.to(query.dtype).transpose(1, 2).contiguous()
