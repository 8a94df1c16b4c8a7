"""GPU check of the attention that reads the blocks (issues 13 and 22), in one unattended command of a few minutes
on a machine with CUDA:

1. the FlexAttention kernel (``prefixkv.flex``) against a float64 reference computed on the CPU, on random block
   layouts (rows sharing leading blocks, padding, holes, grouped-query heads), decode and prefill, block sizes 16
   and 64, float32 (bound 1e-4) and bfloat16 (beside SDPA's own bfloat16 error on the same inputs);
2. generate with a ``PagedPrefixCache`` against stock ``generate`` with ``DynamicCache``, with the store's default
   backend (the gather on CUDA) and with ``attention="flex"``: a tiny Llama in float64 (every step's logits within
   1e-6; flex does not serve float64) and float32 (1e-4), the ~100M model in float32 and bfloat16, cold with left
   padding, warm, and rows on a shared prefix, each backend eagerly (``disable_compile``: section 6 checks the
   compiled default);
3. attention per decode step, all layers of a Llama-shaped ~1.5B model (28 layers, 12 query and 2 KV heads of
   128): the FlexAttention kernel reading the pool in place, against the gather (each row's K/V copied together,
   then SDPA), ``DynamicCache``'s read (its append, then SDPA) and ``StaticCache``'s (SDPA over the whole
   allocation with a mask), at 512 and 4096 tokens, batch 1, 8 and 16, block sizes 16 and 64, float32 and
   bfloat16, and 16 rows on a shared 2048-token prefix; and how long planning one step's reads takes;
4. milliseconds per new token of ``generate``: ``DynamicCache``, ``StaticCache``, ``StaticCache`` under
   ``torch.compile`` (the fastest stock path) and prefixkv (block sizes 16 and 64, the default backend and
   ``attention="flex"``; on the 1.5B model also the default ``PagedPrefixCache`` of block size 16 under
   ``generate``'s own compile, CUDA graphs through ``mode="reduce-overhead"``, for a 512-token prompt and the shared
   prefix) on the ~100M model (float32, bfloat16) and the ~1.5B model with random weights (bfloat16);
5. time to the first token on a warm 2048-token prefix against stock;
6. the decode corridor (issue 54): a hybrid model (a tiny Qwen3-Next-shaped one) against stock, cold and warm, and
   its eager decode against ``DynamicCache``; prefixkv's default cache under ``generate``'s compile with CUDA graphs
   (``mode="reduce-overhead"``) against prefixkv eager (tokens and logits), compiled ``StaticCache`` and
   ``DynamicCache`` (ms per token); the pool's addresses across those compiled calls (kept but where the pool
   grew, every tensor a static address); and how many of inductor's graphs ran without CUDA graphs (0 expected).

prefixkv's ``generate`` on CUDA runs the gather by default (``attention="auto"``) until these numbers show the
FlexAttention backend (``attention="flex"``) faster; sections 2 and 4 run both, section 3 the kernel alone.

Run: ``python benchmarks/gpu_check.py --out gpu_check.md`` (on CUDA, every section in one run of at most
:data:`BUDGET_S` seconds, which the last line judges: the sections run in :data:`ORDER`, 1, 2, 6, 3, 5, 4, and one
that would start in the budget's last quarter is skipped and reported so; ``--budget S`` sets another);
``--device cpu --quick`` (or ``--cpu-smoke``) runs a tiny version of every measurement on the CPU (to check the
script; ``--quick`` alone, on CUDA: the tiny sizes there); ``--sections corridor ...`` runs only the sections named.
Writes ``results/gpu_check.json`` (and ``$OUT/gpu_check.json``, ``$OUT/gpu_check.md`` when ``OUT`` is set) for a run
on CUDA, after every section, so that a run cut short keeps the tables it finished. Asked for CUDA where there is
none, it says so and exits 0."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import machine, save, table, tokens
from decode import batch_ids, decode_ms
from transformers import CompileConfig, DynamicCache, LogitsProcessor, LogitsProcessorList

import prefixkv
from prefixkv import models
from prefixkv.attention import flex
from prefixkv.tools import census


@dataclass(frozen=True)
class Sizes:
    """What each section measures; :data:`FULL` on CUDA, :data:`SMOKE` on the CPU."""

    block_sizes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    heads: tuple[int, int, int]  # query heads, KV heads, head size of the attention timings
    layers: int
    prompts: tuple[int, ...]
    batches: tuple[int, ...]
    shared: tuple[int, int, int]  # prompt, rows, shared prefix
    new_tokens: int
    ttft_prefix: int
    repeat: int
    big: bool  # the ~1.5B model (else the tiny one stands in for it)


BUDGET_S = 8 * 60  # a full CUDA run, every section: what a lent device's session can spare
# the order a run takes the sections in: what issue 54 and exactness need first, the longest (compiles of the 1.5B
# model) last; on a budget, no section starts in its last quarter (it is reported skipped), and the tables so far are
# written after every section, so a run cut short keeps them
ORDER = ("kernel", "generate exactness", "corridor", "attention", "ttft", "generate speed")
KERNEL_POOL = 64  # blocks in the pool of the kernel section
QUESTION = 32  # tokens after the warm prefix

FULL = Sizes(
    (16, 64),
    (torch.float32, torch.bfloat16),
    (12, 2, 128),
    28,
    (512, 4096),
    (1, 8, 16),
    (2112, 16, 2048),
    32,
    2048,
    5,
    True,
)
SMOKE = Sizes((16,), (torch.float32,), (4, 2, 16), 2, (40,), (4,), (40, 4, 32), 3, 48, 1, False)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def big_model(device: str) -> Any:
    """A Llama-shaped ~1.5B model with random weights in bfloat16, built on ``device`` (28 layers, hidden 1536,
    12 query and 2 KV heads: where reading K/V, not launching kernels, is what a decode step costs)."""
    config = models.tiny_config(
        "llama",
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    with torch.device(device):
        return models.build(config, dtype=torch.bfloat16)


# -- 1. the kernel against a float64 reference ---------------------------------------------------------------------


def layout(batch: int, length: int, shared: int, bs: int, num_blocks: int, seed: int) -> dict[str, Any]:
    """Block tables of ``batch`` rows of ``length`` held tokens whose first ``shared`` tokens' blocks are common,
    the rest scattered over a pool of ``num_blocks``."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    common = [order.pop() for _ in range(shared // bs)]
    need = -(-length // bs)
    tables = [common + [order.pop() for _ in range(need - len(common))] for _ in range(batch)]
    return dict(tables=tables, lengths=[length] * batch)


def rows_kv(pool: torch.Tensor, tables: list[list[int]], lengths: list[int]) -> list[torch.Tensor]:
    """Each row's held K (or V) ``[kv_heads, length, dim]`` in logical order, gathered from a head-major pool."""
    heads, _, bs, dim = pool.shape
    flat = pool.reshape(heads, -1, dim)
    out = []
    for blocks, n in zip(tables, lengths):
        slots = (torch.tensor(blocks, device=pool.device)[:, None] * bs + torch.arange(bs, device=pool.device)).view(-1)
        out.append(flat[:, slots[:n]])
    return out


def masked_sdpa(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], seen: torch.Tensor
) -> torch.Tensor:
    """SDPA row by row (``seen`` ``[B, q, columns]``), zeros where a query sees nothing; ``[B, q, Hq, D]``."""
    out = []
    for row, (k, v) in enumerate(zip(keys, values)):
        mask = seen[row, :, : k.shape[1]]
        o = torch.nn.functional.scaled_dot_product_attention(
            query[row : row + 1], k[None], v[None], attn_mask=mask, enable_gqa=True
        )
        out.append(torch.where(mask.any(-1)[None, None, :, None], o, 0.0))
    return torch.cat(out).transpose(1, 2)


def reference(tensors: list[torch.Tensor], spec: dict[str, Any], seen: torch.Tensor, prefill: bool) -> torch.Tensor:
    """SDPA over each row's held K/V (and the new ones for a prefill) of ``tensors`` (pool K, pool V, queries, new
    K, new V), in their dtype and on their device."""
    pool_k, pool_v, query, new_k, new_v = tensors
    keys, values = rows_kv(pool_k, spec["tables"], spec["lengths"]), rows_kv(pool_v, spec["tables"], spec["lengths"])
    if prefill:
        keys = [torch.cat([k, new_k[row]], 1) for row, k in enumerate(keys)]
        values = [torch.cat([v, new_v[row]], 1) for row, v in enumerate(values)]
    return masked_sdpa(query, keys, values, seen)


def kernel_exactness(device: str, sizes: Sizes) -> list[list[Any]]:
    """flex.attend on ``device`` against float64 SDPA on the CPU over the same values, and SDPA in the same dtype
    on ``device`` against that reference (a kernel's own rounding, the yardstick for bfloat16)."""
    heads, kv_heads, dim = sizes.heads
    rows = []
    for bs in sizes.block_sizes:
        for dtype in sizes.dtypes:
            for prefill in (False, True):
                num_blocks, q = KERNEL_POOL, 5 if prefill else 1
                spec = layout(4, 3 * bs + 5, 2 * bs, bs, num_blocks, seed=bs)
                spec["lengths"] = [3 * bs + 5, 2 * bs + 1, bs, 5]  # ragged rows sharing their leading blocks
                g = torch.Generator().manual_seed(bs + prefill)
                pool_k, pool_v = (torch.randn(kv_heads, num_blocks, bs, dim, generator=g) for _ in range(2))
                query = torch.randn(4, heads, q, dim, generator=g)
                new_k, new_v = (torch.randn(4, kv_heads, q, dim, generator=g) for _ in range(2))
                lengths = torch.tensor(spec["lengths"])
                visible = torch.rand(4, 4 * bs, generator=g) > 0.1  # holes
                visible[1, :3] = False  # left padding
                positions = lengths[:, None] + torch.arange(q) if prefill else lengths[:, None] - 1
                cast = [t.to(dtype) for t in (pool_k, pool_v, query, new_k, new_v)]
                reads = flex.plan(
                    spec["tables"],
                    lengths,
                    positions,
                    block_size=bs,
                    num_blocks=num_blocks,
                    device=device,
                    visible=visible,
                    prefill=prefill,
                )
                dev = [t.to(device) for t in cast]
                extra = dict(key=dev[3], value=dev[4]) if prefill else {}
                case = "prefill (merged)" if prefill else "decode"
                try:
                    out = flex.attend(reads, dev[2], dev[0], dev[1], **extra).cpu().double()
                except flex.FlexUnavailable as error:  # recorded; the other cases still run
                    rows.append([bs, str(dtype).replace("torch.", ""), case, f"unavailable: {error}", "-", "MISSED"])
                    continue
                columns = int(lengths.max()) + q
                seen = torch.zeros(4, q, columns, dtype=torch.bool)
                for row, n in enumerate(spec["lengths"]):
                    cols = torch.arange(n)
                    seen[row, :, :n] = visible[row, :n] & (cols <= positions[row][:, None])
                    if prefill:
                        seen[row, :, n : n + q] = torch.ones(q, q, dtype=torch.bool).tril()

                ref = reference([t.double() for t in cast], spec, seen, prefill)
                own = reference(dev, spec, seen.to(device), prefill).cpu().double()
                flex_diff, sdpa_diff = (out - ref).abs().max().item(), (own - ref).abs().max().item()
                if dtype == torch.float32:
                    verdict = "met" if flex_diff <= 1e-4 else "MISSED"
                else:
                    verdict = "met" if flex_diff <= 2 * sdpa_diff + 1e-6 else "MISSED"
                rows.append(
                    [bs, str(dtype).replace("torch.", ""), case, f"{flex_diff:.2e}", f"{sdpa_diff:.2e}", verdict]
                )
    return rows


# -- 2. generate against stock (the default backend, the gather on CUDA, and flex) ------------------------------------


def logits_diff(
    model: Any, stock: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, mask: torch.Tensor | None
) -> tuple:
    """Largest logit difference against stock (run on ``stock``, a copy of the model taken before any store
    existed) over the steps up to the first differing token, whether all tokens agree, stock's smallest top-2
    margin at the differing step (a near-tie explains a flip), and tokens reused."""
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    # each backend's own read, eagerly: on CUDA generate would compile the default cache's decode steps, which read
    # whole rows in the graph whatever the backend (section 6 checks the compiled default)
    kwargs["disable_compile"] = True
    ref = stock.generate(ids, attention_mask=mask, cache=DynamicCache(config=stock.config), **kwargs)
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        out = model.generate(ids, attention_mask=mask, cache=cache, **kwargs)
    n = len(ref.logits)
    differ = (ref.sequences[:, -n:] != out.sequences[:, -n:]).any(dim=0).nonzero()
    steps = n if len(differ) == 0 else int(differ[0]) + 1
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(ref.logits[:steps], out.logits[:steps]))
    margin = None
    if len(differ):
        top = ref.logits[steps - 1].double().topk(2, dim=-1).values
        margin = (top[:, 0] - top[:, 1]).min().item()
    return diff, not len(differ), margin, cache.stats.cached_tokens


def generate_exactness(device: str, sizes: Sizes) -> list[list[Any]]:
    """Three cases per model and backend (the default; ``"flex"`` where the dtype is not float64): cold with left
    padding, the same warm, rows on a shared prefix (``system`` tokens)."""
    rows = []
    cases = [
        ("tiny llama", prefixkv.models.tiny_model("llama", dtype=torch.float64), torch.float64, 1e-6),
        ("tiny llama", prefixkv.models.tiny_model("llama", dtype=torch.float32), torch.float32, 1e-4),
    ]
    system_len, tails, rows_shared = (300, (20, 37), 6) if sizes.big else (40, (5, 9), 2)
    if sizes.big:
        cases += [
            ("100M", prefixkv.models.bench_model(), torch.float32, 1e-3),
            ("100M", prefixkv.models.bench_model(), torch.bfloat16, None),
        ]
    runs = [
        (*case, backend)
        for case in cases
        for backend in ("auto", "flex")
        if backend == "auto" or case[2] != torch.float64
    ]
    stocks: dict[int, Any] = {}
    for name, model, dtype, tol, backend in runs:
        if id(model) not in stocks:
            model = model.to(device=device, dtype=dtype)
            stocks[id(model)] = copy.deepcopy(model)  # before any store: the reference never runs prefixkv's code
        stock = stocks[id(model)]
        vocab = model.config.vocab_size
        store = prefixkv.PrefixStore(model, block_size=16, attention=backend)
        read = store.attention_backend.split(":")[0]
        system = batch_ids(system_len, 1, 0, vocab, seed=1)[0]
        a = torch.cat([system, batch_ids(tails[0], 1, 0, vocab, seed=2)[0]])
        b = torch.cat([system, batch_ids(tails[1], 1, 0, vocab, seed=3)[0]])
        ids = torch.full((2, len(b)), 0, dtype=torch.long)
        ids[0, len(b) - len(a) :], ids[1] = a, b
        mask = (ids != 0).long()
        mask[1] = 1
        shared = batch_ids(system_len + 40, rows_shared, system_len, vocab, seed=4)
        for case, x, m in (
            ("cold, left padding", ids, mask),
            ("warm, left padding", ids, mask),
            (f"{rows_shared} rows, shared prefix", shared, None),
        ):
            diff, same, margin, cached = logits_diff(
                model, stock, store, x.to(device), None if m is None else m.to(device)
            )
            ok = "-" if tol is None else ("met" if diff <= tol and same else "MISSED")
            tie = "-" if margin is None else f"{margin:.2e}"
            rows.append([name, str(dtype).replace("torch.", ""), read, case, cached, f"{diff:.2e}", same, tie, ok])
        store.close()
    return rows


# -- 3. attention per decode step: the kernel against the reads of the other caches -------------------------------


def timed(device: str, variants: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Median milliseconds of each variant, taking turns (one untimed warm-up round: compiles, allocations)."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(1 + repeat):
        for name, fn in variants.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if i:
                samples[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(v) for name, v in samples.items()}


def attention_case(
    device: str, sizes: Sizes, pools: list[torch.Tensor], case: tuple[int, int, int], dtype: torch.dtype
) -> dict[str, float]:
    """One case of :func:`attention_step`: ``pools`` ``[2, kv_heads, blocks, block_size, dim]`` per layer."""
    heads, kv_heads, dim = sizes.heads
    prompt, batch, shared = case
    bs, num_blocks = pools[0].shape[3], pools[0].shape[2]
    spec = layout(batch, prompt, shared, bs, num_blocks, seed=prompt + batch)
    lengths = torch.tensor(spec["lengths"])
    query = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)
    new = torch.randn(batch, kv_heads, 1, dim, device=device, dtype=dtype)

    def plan() -> flex.FlexPlan:
        positions = lengths[:, None] - 1
        return flex.plan(spec["tables"], lengths, positions, block_size=bs, num_blocks=num_blocks, device=device)

    reads = plan()
    # the contiguous caches' K/V (K stands for V too: the same bytes are read)
    dynamic = [torch.stack(rows_kv(p[0], spec["tables"], spec["lengths"])) for p in pools]  # [B, Hkv, L, D]
    static = [torch.nn.functional.pad(k, (0, 0, 0, sizes.new_tokens)) for k in dynamic]
    static_mask = (torch.arange(prompt + sizes.new_tokens, device=device) < prompt).view(1, 1, 1, -1)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run_flex() -> None:
        for p in pools:
            flex.attend(reads, query, p[0], p[1])

    blocks = torch.tensor(spec["tables"], device=device)  # rows of equal length here
    slots = (blocks[:, :, None] * bs + torch.arange(bs, device=device)).view(-1)  # every row's, row after row

    def gather(p: torch.Tensor) -> torch.Tensor:  # what prefixkv's update does on CUDA: one index_select for K, V
        k, v = (t.reshape(kv_heads, -1, dim).index_select(1, slots).view(kv_heads, batch, -1, dim) for t in p)
        return sdpa(query, k.transpose(0, 1)[:, :, :prompt], v.transpose(0, 1)[:, :, :prompt], enable_gqa=True)

    def run_gather() -> None:
        for p in pools:
            gather(p)

    def run_dynamic() -> None:
        for k in dynamic:
            grown = torch.cat([k, new], 2), torch.cat([k, new], 2)  # DynamicCache appends K and V each step
            sdpa(query, *grown, enable_gqa=True)

    def run_static() -> None:
        for k in static:
            k[:, :, prompt - 1 : prompt] = new
            # as transformers calls sdpa with a mask on CUDA: the K/V heads repeated first (enable_gqa with a mask
            # falls back to the math kernel there, which StaticCache's decode does not run)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            sdpa(query, k, k, attn_mask=static_mask)

    def run_plan() -> None:
        plan()

    others = {"gather": run_gather, "dynamic": run_dynamic, "static": run_static}
    times = {**timed(device, others, sizes.repeat), **timed(device, {"plan": run_plan}, sizes.repeat)}
    try:  # what is timed computes the same: the kernel against SDPA over the gathered rows, on the first layer
        diff = (flex.attend(reads, query, pools[0][0], pools[0][1]).transpose(1, 2) - gather(pools[0])).abs().max()
    except flex.FlexUnavailable as error:  # the others are measured all the same
        return {**times, "flex": float("nan"), "diff": float("nan"), "unavailable": str(error)}
    return {**times, **timed(device, {"flex": run_flex}, sizes.repeat), "diff": diff.item()}


def attention_step(device: str, sizes: Sizes) -> list[list[Any]]:
    """Milliseconds of one decode step's attention over every layer (each layer its own pool, as in a model)."""
    _, kv_heads, dim = sizes.heads
    cases = [(p, b, 0) for p in sizes.prompts for b in sizes.batches] + [sizes.shared]
    most = max(p * b for p, b, _ in cases)
    rows = []
    for dtype in sizes.dtypes:
        for bs in sizes.block_sizes:
            # at least the kernel section's pool: the smoke then compiles one shape for both
            shape = (2, kv_heads, max(KERNEL_POOL, -(-most // bs) + 1), bs, dim)
            pools = [torch.randn(shape, device=device, dtype=dtype) for _ in range(sizes.layers)]
            for case in cases:
                shown = [str(dtype).replace("torch.", ""), bs, case[0], case[1], case[2] or "-"]
                ms = attention_case(device, sizes, pools, case, dtype)
                flex_ms = f"unavailable: {ms['unavailable']}" if "unavailable" in ms else f"{ms['flex']:.3f}"
                rows.append(
                    [
                        *shown,
                        flex_ms,
                        *(f"{ms[k]:.3f}" for k in ("gather", "dynamic", "static")),
                        f"{ms['flex'] / ms['dynamic']:.2f}",
                        f"{ms['flex'] / ms['gather']:.2f}",
                        f"{ms['plan']:.3f}",
                        f"{ms['diff']:.1e}",
                    ]
                )
            del pools
    return rows


# -- 4. generate: ms per new token -----------------------------------------------------------------------------------


def generate_case(
    model: Any,
    ids: torch.Tensor,
    sizes: Sizes,
    stores: dict[str, prefixkv.PrefixStore],
    with_compile: bool,
    compile_config: CompileConfig | None = None,
) -> dict[str, float]:
    """The fastest of ``min(repeat, 2)`` calls per cache, taking turns (the eager ones with ``disable_compile``);
    ``with_compile``: also ``StaticCache`` and prefixkv's default cache (the first store that is not flex's: a
    compile costs about a minute on the 1.5B model, and the compiled step reads whole rows whatever the backend)
    under transformers' own ``torch.compile`` of the decode steps (inductor with CUDA graphs,
    ``mode="reduce-overhead"``), or under ``compile_config``."""
    compiling = {} if compile_config is None else {"compile_config": compile_config}
    new, any_store = sizes.new_tokens, next(iter(stores.values()))
    variants: dict[str, Callable[[], float]] = {
        "dynamic": lambda: decode_ms(model, ids, new, "dynamic", any_store, disable_compile=True),
        "static": lambda: decode_ms(model, ids, new, "static", any_store, disable_compile=True),
    }
    if with_compile:
        variants["static compiled"] = lambda: decode_ms(model, ids, new, "static", any_store, **compiling)
    compiled = [label for label in stores if not label.startswith("flex")][:1]
    for label, store in stores.items():
        variants[f"prefixkv {label}"] = lambda store=store: decode_ms(
            model, ids, new, "prefixkv", store, disable_compile=True
        )  # type: ignore[misc]
        if with_compile and label in compiled:
            variants[f"prefixkv {label} compiled"] = lambda store=store: decode_ms(
                model, ids, new, "prefixkv", store, **compiling
            )  # type: ignore[misc]
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(min(sizes.repeat, 2)):
        for variant, fn in variants.items():
            samples[variant].append(fn())
            for store in stores.values():
                store.clear()  # every prefixkv call starts cold: decode speed, not reuse
    return {k: min(v) for k, v in samples.items()}


def generate_speed(device: str, sizes: Sizes) -> list[list[Any]]:
    """ms per new token of ``generate`` with each cache, on each model of this device."""
    config = None
    if device == "cpu":  # the smoke compiles with dynamo alone: inductor takes minutes on a CPU
        todo: list[tuple[str, Callable[[], Any], bool]] = [("tiny", lambda: models.tiny_model("llama"), True)]
        config = CompileConfig(backend="eager", mode=None)
        config._compile_all_devices = True
    else:
        todo = [
            ("100M", lambda: models.bench_model().to(device), False),
            ("100M", lambda: models.bench_model(dtype=torch.bfloat16).to(device), False),
            ("1.5B", lambda: big_model(device), True),
        ]
    cases = [(p, b, 0) for p in sizes.prompts for b in sizes.batches] + [sizes.shared]
    rows = []
    for name, make, with_compile in todo:
        model = make()
        dtype = str(model.dtype).replace("torch.", "")
        stores: dict[str, prefixkv.PrefixStore] = {}
        for bs in sizes.block_sizes:
            for backend in ("auto", "flex"):  # the default (the gather on CUDA, the blocks on the CPU) and flex
                store = prefixkv.PrefixStore(model, block_size=bs, attention=backend)
                stores[f"{store.attention_backend.split(':')[0]} {bs}"] = store
        for prompt, batch, shared in cases:
            ids = batch_ids(prompt, batch, shared, model.config.vocab_size, seed=7).to(device)
            # StaticCache under torch.compile compiles per shape (a minute each on the 1.5B model): two cases, the
            # short prompt alone and the shared prefix
            targeted = (prompt, batch) == (min(sizes.prompts), 1) or shared > 0
            # every compiled variant shares the model's one compiled call: each cache class and shape is a
            # recompile of it, past dynamo's default limit of 8
            with torch._dynamo.config.patch(recompile_limit=64):
                best = generate_case(model, ids, sizes, stores, with_compile and targeted, config)
            for variant, ms in best.items():
                ratio = f"{ms / best['dynamic']:.2f}"
                rows.append([name, dtype, prompt, batch, shared or "-", variant, f"{ms:.2f}", ratio])
        for store in stores.values():
            store.close()
    return rows


# -- 5. time to the first token on a warm prefix ----------------------------------------------------------------------


def first_token_ms(device: str, model: Any, prefix_len: int, repeat: int) -> dict[str, float]:
    """Median ms to the first token of a 32-token question after a ``prefix_len``-token prefix (a fresh question
    each call), variants taking turns: no reuse, the deepcopy recipe, prefixkv with the prefix warm."""
    vocab = model.config.vocab_size
    prefix = tokens(prefix_len, vocab, seed=prefix_len).to(device)
    questions = iter(
        [torch.cat([prefix, tokens(QUESTION, vocab, seed=1000 + i).to(device)])[None] for i in range(3 * repeat + 3)]
    )
    with torch.no_grad():
        filled = DynamicCache(config=model.config)
        model(prefix[None], cache=filled)
    store = prefixkv.PrefixStore(model, block_size=16)
    with prefixkv.PagedPrefixCache(store, prefix[None]) as cache:  # the prefix, computed once
        model.generate(prefix[None], cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)

    def first(cache: Any, ids: torch.Tensor) -> None:
        model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)

    def no_reuse() -> None:
        first(DynamicCache(config=model.config), next(questions))

    def deepcopy_recipe() -> None:
        first(copy.deepcopy(filled), next(questions))

    def warm() -> None:
        ids = next(questions)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            first(cache, ids)

    try:
        return timed(device, {"none": no_reuse, "deepcopy": deepcopy_recipe, "prefixkv": warm}, repeat)
    finally:
        store.close()


def first_token(device: str, sizes: Sizes) -> list[list[Any]]:
    """Time to the first token on a warm prefix, on each model of this device."""
    if device == "cpu":
        todo: list[tuple[str, Callable[[], Any]]] = [("tiny", lambda: models.tiny_model("llama"))]
    else:
        todo = [
            ("100M", lambda: models.bench_model(dtype=torch.bfloat16).to(device)),
            ("1.5B", lambda: big_model(device)),
        ]
    rows = []
    for name, make in todo:
        ms = first_token_ms(device, make(), sizes.ttft_prefix, sizes.repeat)
        ratio = ms["none"] / ms["prefixkv"]
        verdict = ("met" if ratio >= 10 else "MISSED") if device != "cpu" else "n/a"
        times = [f"{ms[k]:.1f}" for k in ("none", "deepcopy", "prefixkv")]
        rows.append([name, sizes.ttft_prefix, *times, f"{ratio:.1f}x", verdict])
    return rows


# -- 6. the decode corridor: a hybrid model, CUDA graphs, the pool's addresses -----------------------------------------


class PoolAddresses(LogitsProcessor):
    """After each forward of a ``generate`` call: the storage of every tensor of ``store``'s pool, and its growths
    (``BlockPool.moves``), so that a run shows the addresses a compiled step captured kept (kv/pool.py)."""

    def __init__(self, store: prefixkv.PrefixStore) -> None:
        self.store, self.seen = store, []  # type: list[tuple[int, tuple[int, ...]]]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        pool = self.store.blocks.pool
        self.seen.append((pool.moves, tuple(t.data_ptr() for t in (*pool.keys, *pool.values))))
        return scores

    def verdict(self) -> str:
        """``kept`` where the storage changed only at a growth (and every tensor is a static address), else what
        moved."""
        pool = self.store.blocks.pool
        if not all(getattr(t, "_dynamo_static_input_type", None) for t in (*pool.keys, *pool.values)):
            return "NOT static addresses"
        moved = [i for i, (a, b) in enumerate(zip(self.seen, self.seen[1:])) if a[0] == b[0] and a[1] != b[1]]
        grown = self.seen[-1][0] - self.seen[0][0] if self.seen else 0
        return f"MOVED after steps {moved}" if moved else f"kept ({grown} growths)"


def outputs(model: Any, ids: torch.Tensor, new: int, processors: list[Any] = (), **kwargs: Any) -> Any:
    """One greedy ``generate`` call's tokens and logits."""
    return model.generate(
        ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, logits_processor=LogitsProcessorList(list(processors)),
        **kwargs,
    )  # fmt: skip


def versus(out: Any, ref: Any) -> tuple[str, bool]:
    """The largest logit difference of ``out`` against ``ref`` and whether their tokens agree."""
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(out.logits, ref.logits))
    return f"{diff:.1e}", bool(torch.equal(out.sequences, ref.sequences))


def hybrid_model(device: str) -> Any:
    """A tiny Qwen3-Next-shaped model (linear attention and full attention layers, prefixkv.tools.census), float32."""
    with torch.device(device):
        return models.build(census.tiny_config("qwen3_next"), dtype=torch.float32)


def corridor(device: str, sizes: Sizes) -> list[list[Any]]:
    """A hybrid model, eager (its recurrent layers take no compiled step): a cold and a warm call on a shared
    prefix against stock, and ms per token against ``DynamicCache``. The ~100M model (the tiny one on the CPU):
    prefixkv's default cache under ``generate``'s own compile with CUDA graphs (``mode="reduce-overhead"``; the
    CPU smoke compiles with dynamo alone) against prefixkv eager, compiled ``StaticCache`` and ``DynamicCache``,
    its tokens and logits against prefixkv eager, and the pool's addresses across the compiled calls, on a store of
    its first size (which a long prompt grows)."""
    rows: list[list[Any]] = []
    new, prompt = sizes.new_tokens, min(sizes.prompts)
    # the hybrid model
    model = hybrid_model(device)
    stock = copy.deepcopy(model)
    ids = batch_ids(prompt, 2, prompt - 8, model.config.vocab_size, seed=11).to(device)
    store = prefixkv.PrefixStore(model, block_size=16)
    # eager, both: on CUDA generate would compile prefixkv's default cache (not stock's), and time that instead
    ref = outputs(stock, ids, new, cache=DynamicCache(config=stock.config), disable_compile=True)
    for turn in ("cold", "warm"):
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            out = outputs(model, ids, new, cache=cache, disable_compile=True)
        rows.append(["hybrid", turn, "-", "-", *versus(out, ref), f"{cache.stats.cached_tokens} reused"])
    ms = {
        v: min(decode_ms(model, ids, new, v, store, disable_compile=True) for _ in range(2))
        for v in ("dynamic", "prefixkv")
    }
    rows.append(["hybrid", "eager decode", f"{ms['prefixkv']:.2f}", f"{ms['prefixkv'] / ms['dynamic']:.2f}", "-", "-",
                 "-"])  # fmt: skip
    store.close()
    # the compiled default with CUDA graphs
    if device == "cuda":
        model = models.bench_model().to(device)
        config = CompileConfig(mode="reduce-overhead")
    else:
        model = models.tiny_model("llama")
        config = CompileConfig(backend="eager", mode=None)
        config._compile_all_devices = True
    ids = batch_ids(prompt, 2, 0, model.config.vocab_size, seed=12).to(device)
    store = prefixkv.PrefixStore(model, block_size=16)
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        eager = outputs(model, ids, new, cache=cache, disable_compile=True)
    store.close()
    store = prefixkv.PrefixStore(model, block_size=16)  # at its first size: the compiled calls grow it
    addresses = PoolAddresses(store)
    # inductor counts the graphs it ran without CUDA graphs (a CPU input, a mutated input that is no static address)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    with torch._dynamo.config.patch(recompile_limit=64):
        for turn in ("cold", "warm"):
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                out = outputs(model, ids, new, [addresses], cache=cache, compile_config=config)
            rows.append(["compiled default", turn, "-", "-", *versus(out, eager), addresses.verdict()])
        variants = {
            "dynamic": lambda: decode_ms(model, ids, new, "dynamic", store, disable_compile=True),
            "prefixkv eager": lambda: decode_ms(model, ids, new, "prefixkv", store, disable_compile=True),
            "static compiled": lambda: decode_ms(model, ids, new, "static", store, compile_config=config),
            "prefixkv compiled": lambda: decode_ms(model, ids, new, "prefixkv", store, compile_config=config),
        }
        best = {name: min(fn() for _ in range(2)) for name, fn in variants.items()}
    for name, ms_ in best.items():
        versus_static = f"{ms_ / best['static compiled']:.2f} of compiled Static"
        rows.append(["100M" if device == "cuda" else "tiny", name, f"{ms_:.2f}", f"{ms_ / best['dynamic']:.2f}", "-",
                     "-", versus_static])  # fmt: skip
    if device == "cuda":  # 0: every compiled call above replayed CUDA graphs
        skipped = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
        rows.append(["100M", "CUDA graph skips", "-", "-", "-", "-", f"{skipped} (0: CUDA graphs ran throughout)"])
    store.close()
    return rows


SECTIONS: list[tuple[str, str, list[str], Callable[[str, Sizes], list[list[Any]]]]] = [
    (
        "kernel",
        "The FlexAttention kernel against float64 SDPA on the CPU (max abs difference; bfloat16 beside SDPA's own)",
        ["block size", "dtype", "case", "flex diff", "SDPA in this dtype", "1e-4 / <= 2x SDPA"],
        kernel_exactness,
    ),
    (
        "generate exactness",
        "generate with a PagedPrefixCache (each backend) against stock DynamicCache, to the first differing token",
        [
            "model",
            "dtype",
            "attention",
            "case",
            "cached",
            "max logit diff",
            "same tokens",
            "stock's top-2 margin",
            "1e-6 / 1e-4 / 1e-3",
        ],
        generate_exactness,
    ),
    (
        "attention",
        "Attention of one decode step over every layer, ms (the kernel reading the pool in place; the gather; "
        "DynamicCache's append and read; StaticCache's masked read), and planning the step's reads",
        [
            "dtype",
            "block",
            "prompt",
            "batch",
            "shared",
            "flex",
            "gather",
            "Dynamic",
            "Static",
            "flex / Dynamic",
            "flex / gather",
            "plan",
            "flex vs gather",
        ],
        attention_step,
    ),
    (
        "generate speed",
        "ms per new token of generate (prefixkv with its default backend and with attention='flex')",
        ["model", "dtype", "prompt", "batch", "shared", "cache", "ms/token", "/ Dynamic"],
        generate_speed,
    ),
    (
        "ttft",
        f"Time to the first token of a {QUESTION}-token question on a warm prefix, ms: no reuse, the deepcopy "
        "recipe, prefixkv (target: prefixkv >= 10x faster than no reuse)",
        ["model", "prefix", "no reuse", "deepcopy", "prefixkv", "no reuse / prefixkv", "target"],
        first_token,
    ),
    (
        "corridor",
        "The decode corridor (issue 54): a hybrid model against stock; prefixkv's default under generate's compile "
        "with CUDA graphs against eager and compiled StaticCache; the pool's addresses across the compiled calls",
        ["model", "case", "ms/token", "/ Dynamic", "max logit diff", "same tokens", "note"],
        corridor,
    ),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the tables as Markdown to this file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to measure (default: cuda)")
    ap.add_argument("--quick", action="store_true", help="the tiny sizes (what --device cpu is meant for)")
    ap.add_argument("--cpu-smoke", action="store_true", help="--device cpu --quick: check the script on the CPU")
    ap.add_argument(
        "--sections", nargs="+", choices=[key for key, *_ in SECTIONS], help="run only these sections (default: all)"
    )
    ap.add_argument(
        "--budget", type=float, help=f"seconds: start no section in the last quarter (a full CUDA run: {BUDGET_S})"
    )
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu_smoke else args.device
    quick = args.quick or args.cpu_smoke
    if device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); run it on a GPU machine, or --device cpu "
              "--quick")  # fmt: skip
        return 0
    sizes = SMOKE if quick else FULL
    full = device == "cuda" and not quick and not args.sections
    budget = args.budget if args.budget is not None else (BUDGET_S if full else None)
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    where += " (quick)" if quick else ""
    report = [f"# gpu_check: {where}; {machine()}", ""]
    result: dict[str, Any] = {"machine": report[0][2:], "tables": {}}
    failed, skipped = [], []
    by_key = {key: (title, header, section) for key, title, header, section in SECTIONS}
    for key in ORDER:
        title, header, section = by_key[key]
        if args.sections and key not in args.sections:
            continue
        if budget is not None and time.perf_counter() - started > 0.75 * budget:
            skipped.append(key)
            body = f"skipped: {time.perf_counter() - started:.0f} s of the {budget:.0f} s budget had passed"
            print(f"## {title}\n\n{body}\n", flush=True)
            report.append(f"## {title}\n\n{body}\n")
            result["tables"][key] = body
            continue
        begun = time.perf_counter()
        # an unattended run records a section's failure and goes on: one broken measurement keeps the others
        try:
            body = table(header, section(device, sizes))
        except Exception as error:
            failed.append(key)
            body = f"FAILED: {type(error).__name__}: {error}\n\n```\n{traceback.format_exc(limit=4)}```"
        text = f"## {title}\n\n{body}\n\n({time.perf_counter() - begun:.0f} s)"
        print(text + "\n", flush=True)
        report.append(text + "\n")
        result["tables"][key] = body
        write(args.out, device, report, result)  # each section as it ends: a run cut short keeps what it measured
    seconds = time.perf_counter() - started
    verdict = f" (budget {budget:.0f} s: {'met' if seconds <= budget else 'MISSED'})" if budget is not None else ""
    tail = f"flex compiles: {flex.compiles()}; {seconds:.0f} s in all{verdict}" + (
        f"; FAILED: {', '.join(failed)}" if failed else ""
    )
    tail += f"; skipped for the budget: {', '.join(skipped)}" if skipped else ""
    print(tail)
    report.append(tail)
    result["summary"] = tail
    write(args.out, device, report, result)
    return 1 if failed else 0


def write(out: Path | None, device: str, report: list[str], result: dict[str, Any]) -> None:
    """The report so far as Markdown to ``out``; on CUDA also ``results/gpu_check.json`` and, where ``OUT`` is set,
    ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.md``."""
    markdown = "\n".join(report) + "\n"
    if out:
        out.write_text(markdown)
    if device == "cuda":
        save("gpu_check", result)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(result, indent=2))
            Path(os.environ["OUT"], "gpu_check.md").write_text(markdown)


if __name__ == "__main__":
    sys.exit(main())
