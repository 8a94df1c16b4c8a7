"""The cost of the invariant schedule (``PrefixStore(invariant=True)``, docs/correctness.md) against the default
one, the budget for making it the default measured in one run, the two modes taking turns in every repeat
(medians): warm time to first token after a cached prefix (1024 + 32 and 2048 + 32 tokens on the ~100M model,
fresh query tokens every call), warm time to first token of the demo's workload (``python -m prefixkv demo``:
questions after one 2048-token system prompt, on the same model), decode milliseconds per token on a warm call,
cold time to first token (an empty store), and memory (the bytes and blocks each store holds after the same
calls). With ``--real``, SmolLM2's 12-question chat experiment in bfloat16: how many answers are identical
(tokens, and logits bit for bit) cold vs stock and warm vs cold, in both modes. With ``--chunks 64 128 256``,
first the invariant store at those chunk sizes (:func:`chunk_sweep`). With ``--padded 16 32 64 128 256``, only
the forwards a schedule runs, timed (CPU time of one thread) over a plain ``DynamicCache``: a padded schedule
(every prompt forward has exactly C rows, the last one padded) and the unpadded chunked one, against one forward
of the new tokens (:func:`padded_costs`). With ``--rows``, only whether a row's result depends on the other rows
of a call, for the linear layer and the attention kernels on this machine and the model end to end
(:func:`row_independence`). Run:
``python benchmarks/invariance.py [--size 100m] [--real] [--chunks N ...] [--padded N ...] [--rows]``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _common import interleaved, interleaved_samples, machine, model_for, save, table, target, tokens
from torch.nn import functional as F
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import prefixkv
from prefixkv.attention.kernels import attend
from prefixkv.tools.demo import synthetic_workload

SYSTEM = (
    "You are the help desk assistant of the Riverside Public Library. Answer in one or two short sentences, "
    "politely and precisely. The library opens at nine in the morning and closes at eight in the evening on "
    "weekdays, and at five on Saturdays; it is closed on Sundays and public holidays. Members may borrow up to "
    "twelve items at a time for three weeks, renewable twice online or at the desk unless someone reserved "
    "them. Late returns cost twenty cents a day per item, capped at five dollars. Membership is free for "
    "residents with a proof of address; visitors pay ten dollars a year. The first floor holds fiction, "
    "magazines and the children's corner; the second floor holds non-fiction, study rooms and twelve public "
    "computers, bookable for two hours a day. Printing costs ten cents a page in black and white. Lost cards "
    "are replaced at the desk for two dollars, and the new card works at once. Wireless internet is free for "
    "everyone in the building, with no password."
)
QUESTIONS = (
    "When do you open on Saturday?",
    "How many books can I borrow?",
    "What happens if I return a book late?",
    "Can I renew a loan online?",
    "Is membership free?",
    "Where are the study rooms?",
    "How much does printing cost?",
    "Are you open on Sunday?",
    "How long can I use a computer?",
    "Where is the children's corner?",
    "Can a visitor join the library?",
    "How long is a loan?",
)
CHAT = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]

MODES: dict[str, dict[str, Any]] = {"default": {"invariant": False}, "invariant": {"invariant": True}}
BLOCK = 16
QUERY = 32  # the warm and cold calls' query after the prefix
# the budget for making the invariant schedule the default (issue 35): invariant / default at most
BUDGET = {"warm": 1.15, "decode": 1.02, "cold": 1.05, "memory": 1.0}


class _StepClock(LogitsProcessor):
    """The time of every decoding step (generate calls its logits processors once a step, any batch size)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _generate(model: Any, store: prefixkv.PrefixStore | None, ids: torch.Tensor, new: int, **kw: Any) -> Any:
    cache: Any = DynamicCache(config=model.config) if store is None else prefixkv.PagedPrefixCache(store, ids)
    try:
        return model.generate(
            ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw
        )
    finally:
        if store is not None:
            cache.close()


def _stores(model: Any, modes: dict[str, dict[str, Any]] = MODES) -> dict[str, prefixkv.PrefixStore]:
    return {mode: prefixkv.PrefixStore(model, block_size=BLOCK, **kw) for mode, kw in modes.items()}


def _memory(stores: dict[str, prefixkv.PrefixStore]) -> dict[str, dict[str, int]]:
    """What each store holds now: the bytes and blocks of K/V in use (its pool grows to what it holds)."""
    return {mode: {"bytes_used": s.stats.bytes_used, "blocks_used": s.stats.blocks_used} for mode, s in stores.items()}


def _first_tokens(model: Any, stores: dict[str, prefixkv.PrefixStore], prompts: list[torch.Tensor]) -> dict[str, float]:
    """Median ms of a one-token generate call (cache construction included) over ``prompts`` in turn, each mode's
    store seeing the same prompts in the same order (the first one a warm-up)."""

    def call(store: prefixkv.PrefixStore, queue: Iterator[torch.Tensor]) -> Callable[[], None]:
        def first_token() -> None:
            _generate(model, store, next(queue), 1)

        return first_token

    return interleaved({mode: call(s, iter(prompts)) for mode, s in stores.items()}, len(prompts) - 1, warmup=1)


def warm_ttft(
    model: Any, prefix: int, repeat: int, query: int = QUERY, modes: dict[str, dict[str, Any]] = MODES
) -> dict[str, Any]:
    """Median ms of a one-token call after a cached ``prefix``, with a ``query``-token query, fresh query
    tokens every call; and what each store holds after the calls (:func:`_memory`)."""
    vocab = model.config.vocab_size
    system = tokens(prefix, vocab, seed=prefix)
    stores = _stores(model, modes)
    try:
        for store in stores.values():
            _generate(model, store, system[None], 1)
        prompts = [torch.cat([system, tokens(query, vocab, seed=1000 + i)])[None] for i in range(repeat + 1)]
        return {**_first_tokens(model, stores, prompts), "memory": _memory(stores)}
    finally:
        for store in stores.values():
            store.close()


def cold_ttft(model: Any, length: int, repeat: int, modes: dict[str, dict[str, Any]] = MODES) -> dict[str, float]:
    """Median ms of a one-token call of ``length`` prompt tokens on an empty store (built outside the timing)."""
    vocab = model.config.vocab_size

    def call(kw: dict[str, Any], seeds: Iterator[int]) -> Callable[[], float]:
        def first_token() -> float:
            ids = tokens(length, vocab, seed=next(seeds))[None]
            with prefixkv.PrefixStore(model, block_size=BLOCK, **kw) as store:
                start = time.perf_counter()
                _generate(model, store, ids, 1)
                return 1000 * (time.perf_counter() - start)

        return first_token

    return interleaved({mode: call(kw, itertools.count()) for mode, kw in modes.items()}, repeat)


def demo_ttft(model: Any, system: int, repeat: int) -> dict[str, float]:
    """Median ms of the first token of the demo's questions (``prefixkv demo``'s workload) once its first
    question cached the system prompt, up to ``repeat`` of them."""
    workload = synthetic_workload(model.config.vocab_size, system_len=system, new_tokens=1)
    questions = [turn([]) for turn in workload.turns[:-1]]  # the follow-up continues an answer
    stores = _stores(model)
    try:
        for store in stores.values():
            _generate(model, store, questions[0], 1)
        return _first_tokens(model, stores, questions[1 : repeat + 2])
    finally:
        for store in stores.values():
            store.close()


def decode(model: Any, context: int, batch: int, new: int, repeat: int) -> dict[str, float]:
    """Median ms per decoding step of a warm call: ``batch`` rows of ``context`` prompt tokens sharing all but
    their last 16, ``new`` tokens each."""
    vocab = model.config.vocab_size
    system = tokens(context - 16, vocab, seed=context)
    stores = _stores(model)
    counter = itertools.count()

    def prompt() -> torch.Tensor:
        return torch.stack([torch.cat([system, tokens(16, vocab, seed=next(counter))]) for _ in range(batch)])

    for store in stores.values():
        _generate(model, store, prompt(), 1)

    def call(store: prefixkv.PrefixStore) -> Callable[[], float]:
        def per_step() -> float:
            clock = _StepClock()
            _generate(model, store, prompt(), new, logits_processor=LogitsProcessorList([clock]))
            return 1000 * (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)

        return per_step

    try:
        return interleaved({mode: call(store) for mode, store in stores.items()}, repeat)
    finally:
        for store in stores.values():
            store.close()


def chat_prompts(tokenizer: Any) -> list[torch.Tensor]:
    """The chat experiment's prompts (:data:`CHAT` through the chat template), ``[1, n]`` each."""
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt") for m in CHAT]
    return [p if isinstance(p, torch.Tensor) else p["input_ids"] for p in prompts]


def common_length(prompts: list[torch.Tensor]) -> int:
    """How many leading tokens every prompt shares with the first."""
    first = prompts[0][0]
    return min(int((p[0, : len(first)] == first[: p.shape[1]]).cumprod(0).sum()) for p in prompts[1:])


def chat_counts(new: int = 32, modes: tuple[str, ...] = tuple(MODES)) -> dict[str, Any]:
    """SmolLM2 in bfloat16, 12 questions after one system prompt (:data:`CHAT`; tests/test_invariance.py runs
    the same), ``new`` greedy tokens: per mode of ``modes``, answers identical cold vs stock and warm vs cold
    (tokens; logits bit for bit), and the tokens before the first difference."""
    model, tok = prefixkv.models.smollm2(dtype=torch.bfloat16)
    prompts = chat_prompts(tok)
    kw: dict[str, Any] = {"output_logits": True, "return_dict_in_generate": True}
    stock = [_generate(model, None, ids, new, **kw) for ids in prompts]
    result: dict[str, Any] = {"questions": len(prompts), "system_tokens": common_length(prompts)}
    for mode in modes:
        options = MODES[mode]
        cold = []
        for ids in prompts:
            with prefixkv.PrefixStore(model, block_size=BLOCK, **options) as fresh:
                cold.append(_generate(model, fresh, ids, new, **kw))
        with prefixkv.PrefixStore(model, block_size=BLOCK, **options) as shared:
            warm = [_generate(model, shared, ids, new, **kw) for ids in prompts]
        result[mode] = {"cold_vs_stock": _agreement(cold, stock), "warm_vs_cold": _agreement(warm, cold)}
    return result


def _agreement(outs: list[Any], refs: list[Any]) -> dict[str, int]:
    """How many answers have the same tokens, how many bit-identical logits at every step, and the generated
    tokens before the first difference (summed over answers)."""
    same_tokens = same_logits = before = 0
    for out, ref in zip(outs, refs):
        a, b = out.sequences[0], ref.sequences[0]
        same_tokens += bool(torch.equal(a, b))
        same_logits += all(torch.equal(x, y) for x, y in zip(out.logits, ref.logits))
        new = len(out.logits)
        differ = (a[-new:] != b[-new:]).nonzero()
        before += int(differ[0]) if len(differ) else new
    return {"same_tokens": same_tokens, "same_logits": same_logits, "tokens_before_difference": before}


def run(size: str, prefixes: list[int], context: int, batches: list[int], system: int, repeat: int) -> dict[str, Any]:
    model = model_for(size)
    result: dict[str, Any] = {"size": size, "machine": machine(), "chunk_size": 4 * BLOCK, "query": QUERY}
    result["warm"] = [{"prefix": p, **warm_ttft(model, p, repeat)} for p in prefixes]
    result["demo"] = {"system": system, **demo_ttft(model, system, repeat)}
    result["decode"] = [{"batch": b, "context": context, **decode(model, context, b, 16, repeat)} for b in batches]
    result["cold"] = {"length": prefixes[0] + QUERY, **cold_ttft(model, prefixes[0] + QUERY, max(2, repeat // 2))}
    return result


def chunk_sweep(
    model: Any, chunks: list[int], repeat: int, prefix: int = 1024, inside: int = 1000
) -> list[dict[str, Any]]:
    """For each of ``chunks`` (the invariant store's ``chunk_size``), the median ms of both modes: cold time to
    first token of ``prefix`` + 32 tokens, warm after a cached ``prefix`` + 32, and warm after a cached ``inside``
    prefix + 40, a prefix that ends inside a chunk (the invariant call recomputes from that chunk's start);
    each chunk size's ratios printed."""
    out = []
    for chunk in chunks:
        modes = {"default": {"invariant": False}, "invariant": {"invariant": True, "chunk_size": chunk}}
        row: dict[str, Any] = {"chunk_size": chunk}
        row[f"cold {prefix + QUERY}"] = cold_ttft(model, prefix + QUERY, max(2, repeat // 2), modes)
        row[f"warm {prefix}+{QUERY}"] = warm_ttft(model, prefix, repeat, QUERY, modes)
        row[f"warm {inside}+40"] = warm_ttft(model, inside, repeat, 40, modes)
        out.append(row)
        ratio = {k: v["invariant"] / v["default"] for k, v in row.items() if k != "chunk_size"}
        row["ratios"] = ratio
        print(f"chunk_size {chunk}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()), flush=True)
    return out


# the calls of --padded: (tokens of the prompt an earlier call cached, new tokens after them)
PADDED_CALLS = ((1024, 32), (1024, 40), (2048, 32), (2048, 40), (1000, 40), (0, 1056))


def schedule(length: int, chunk: int, padded: bool) -> list[int]:
    """The rows of each forward that computes ``length`` prompt tokens from a chunk boundary in ``chunk``-row
    forwards: padded, ceil(length / chunk) forwards of ``chunk`` rows (the last one's pads included); unpadded (the
    invariant store's), the whole chunks before the last token, then one forward of the rest."""
    if padded:
        return [chunk] * -(-length // chunk)
    whole = (length - 1) // chunk
    return [chunk] * whole + [length - whole * chunk]


def plan(cached: int, new: int, chunk: int | None = None, padded: bool = False) -> tuple[int, list[int]]:
    """Where a call's prompt forwards start and the rows of each, after an earlier call cached ``cached`` tokens of
    its prompt, for ``new`` more. ``chunk`` None: the default store, one forward after the match's whole blocks.
    Unpadded: the invariant store, which holds the whole chunks of the cached tokens (:func:`schedule`). Padded:
    every forward ``chunk`` rows at a chunk boundary, the cached tokens' whole blocks held (a padded chunk's real
    rows are those of the full chunk), so a call recomputes from the chunk boundary at or below its match."""
    end, match = cached + new, cached // BLOCK * BLOCK
    if chunk is None:
        return match, [end - match]
    start = (match if padded else cached) // chunk * chunk
    return start, schedule(end - start, chunk, padded)


def _forwards(model: Any, cache: DynamicCache, sizes: list[int], seed: int) -> float:
    """CPU milliseconds of this thread (with one torch thread, all of the work) of forwards of ``sizes`` rows in
    turn over ``cache`` (which grows), the model's causal mask keeping every row from the rows after it (a padded
    forward's pads stand last). Other jobs on a shared machine stretch wall time, not this."""
    ids = tokens(sum(sizes), model.config.vocab_size, seed=seed)[None]
    start, done = time.thread_time(), 0
    for rows in sizes:
        model(ids[:, done : done + rows], cache=cache, use_cache=True, logits_to_keep=1)
        done += rows
    return 1000 * (time.thread_time() - start)


def _prefix(model: Any, held: DynamicCache, length: int) -> DynamicCache:
    """A cache of the first ``length`` tokens of ``held`` (views: its own updates leave ``held`` as it is)."""
    cache = DynamicCache(config=model.config)
    if length:
        for i, layer in enumerate(held.layers):
            cache.update(layer.keys[:, :, :length], layer.values[:, :, :length], i)
    return cache


def padded_costs(
    model: Any, chunks: list[int], repeat: int, calls: tuple[tuple[int, int], ...] = PADDED_CALLS
) -> dict[str, Any]:
    """Median and fastest CPU ms (:func:`_forwards`) of the prompt forwards each schedule runs (:func:`plan`) for
    each of ``calls``, over a plain ``DynamicCache`` holding what the schedule reuses (the forwards alone: no pool,
    no gather, no runner, but a ``DynamicCache`` concatenates its K/V in every forward), the default store's and,
    at every chunk size of ``chunks``, the unpadded and the padded schedule's taking turns in every repeat (a cold
    call, ``cached`` 0, half as many repeats)."""
    seeds = itertools.count()
    held = DynamicCache(config=model.config)
    out: dict[str, Any] = {"chunks": chunks, "calls": []}
    with torch.inference_mode():
        _forwards(model, held, [max(cached for cached, _ in calls) or 1], seed=0)

        def timed(start: int, sizes: list[int]) -> Callable[[], float]:
            return lambda: _forwards(model, _prefix(model, held, start), sizes, next(seeds))

        for cached, new in calls:
            plans = {"default": plan(cached, new)}
            for c in chunks:
                plans |= {f"unpadded {c}": plan(cached, new, c), f"padded {c}": plan(cached, new, c, padded=True)}
            variants = {name: timed(*p) for name, p in plans.items()}
            samples = interleaved_samples(variants, repeat if cached else max(2, repeat // 2))
            ms = {name: statistics.median(v) for name, v in samples.items()}
            fastest = {name: min(v) for name, v in samples.items()}
            out["calls"].append({"cached": cached, "new": new, "plans": plans, "ms": ms, "fastest": fastest})
            print(f"{cached} + {new}: " + ", ".join(f"{k} {v / ms['default']:.2f}x" for k, v in ms.items()), flush=True)
    return out


def padded_report(result: dict[str, Any]) -> str:
    """:func:`padded_costs` as a table: per schedule and call, its median time over the default's (in brackets,
    fastest over fastest) and its forwards."""

    def cell(call: dict[str, Any], name: str) -> str:
        start, rows = call["plans"][name]
        whole = rows[:-1] if rows[-1] != rows[0] else rows
        shape = f"{len(whole)} x {rows[0]}" + (f" + {rows[-1]}" if len(whole) < len(rows) else "")
        median, fastest = (call[k][name] / call[k]["default"] for k in ("ms", "fastest"))
        return f"{median:.2f}x ({fastest:.2f}x), {shape} from {start}"

    calls = result["calls"]
    headers = ["schedule", *(f"{c['cached']} + {c['new']}" if c["cached"] else f"cold {c['new']}" for c in calls)]
    first = (
        f"{c['ms']['default']:.1f} ms ({c['fastest']['default']:.1f}), 1 x {c['plans']['default'][1][0]} from "
        f"{c['plans']['default'][0]}"
        for c in calls
    )
    rows = [["default store", *first]]
    for chunk in result["chunks"]:
        rows += [[f"{kind} {chunk}", *(cell(c, f"{kind} {chunk}") for c in calls)] for kind in ("unpadded", "padded")]
    return table(headers, rows)


ROW_COUNTS = (1, 2, 3, 4, 7, 8, 15, 16, 17, 32, 33, 64, 128, 256, 1056)


def _classes(results: dict[Any, list[torch.Tensor]], common: Callable[[Any, Any], int]) -> list[list[Any]]:
    """The keys of ``results`` grouped by bit-equal results (the first ``common(a, b)`` rows of every tensor)."""
    groups: list[list[Any]] = []
    for key, out in results.items():
        for group in groups:
            rows = common(group[0], key)
            if all(torch.equal(a[:rows], b[:rows]) for a, b in zip(results[group[0]], out)):
                group.append(key)
                break
        else:
            groups.append([key])
    return groups


def _linear_rows(config: Any, dtype: torch.dtype, chunks: list[int], counts: tuple[int, ...]) -> dict[str, Any]:
    """``F.linear`` over the model's weight shapes (random values): the row counts M whose common rows are
    bit-equal, grouped; and per chunk size C, whether a C-row call's rows are the same whatever the other rows hold
    (half of them replaced by zeros, then by large values) and wherever the row stands (the rows permuted)."""
    g = torch.Generator().manual_seed(0)
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in ((h, h), (i, h), (h, i), (v, h))]
    inputs = [torch.randn(max(counts), w.shape[1], generator=g).to(dtype) for w in weights]
    outs = {m: [F.linear(x[:m], w) for x, w in zip(inputs, weights)] for m in counts}
    fixed = {}
    for c in chunks:
        same, placed = True, True
        for x, w in zip(inputs, weights):
            rows = x[:c]
            ref = F.linear(rows, w)
            for filler in (torch.zeros_like(rows[c // 2 :]), 100 * torch.randn(c - c // 2, rows.shape[1], generator=g)):
                other = torch.cat([rows[: c // 2], filler.to(dtype)])
                same &= torch.equal(F.linear(other, w)[: c // 2], ref[: c // 2])
            order = torch.randperm(c, generator=g)
            placed &= torch.equal(F.linear(rows[order], w), ref[order])
        fixed[c] = {"other_rows": same, "row_place": placed}
    return {"classes": _classes(outs, min), "fixed": fixed}


def _attention_rows(config: Any, dtype: torch.dtype, chunks: list[int], positions: range) -> dict[str, Any]:
    """The store's canonical attention read (:func:`prefixkv.attention.kernels.attend`) and
    ``F.scaled_dot_product_attention``, both under a boolean causal mask over the keys before the call and its
    own: per chunk size C, how many of the rows at ``positions`` get other bits when the C-row forward that
    computes them starts at another block boundary (multiple of 16), and whether a C-row call's first half is
    the same when its second half (queries, keys, values) holds pads; and for the middle position, the
    bit-distinct results over calls of any row count in :data:`ROW_COUNTS` up to 128 starting anywhere before it."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    n = positions.stop + max(chunks)
    middle = positions[len(positions) // 2]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, n, dim, generator=g).to(dtype)
    k, v = (torch.randn(1, kv_heads, n, dim, generator=g).to(dtype) for _ in range(2))

    def store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        return attend(q, k, v, mask[None, None], None)[0]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def row(kernel: Callable[..., torch.Tensor], p: int, start: int, rows: int) -> torch.Tensor:
        return kernel(q[:, :, start : start + rows], k[:, :, : start + rows], v[:, :, : start + rows])[:, :, p - start]

    out: dict[str, Any] = {}
    for name, kernel in (("attend", store), ("sdpa", sdpa)):
        fixed = {}
        for c in chunks:
            moved = 0
            for p in positions:
                starts = range((max(0, p - c + 1) + 15) // 16 * 16, p + 1, 16)
                first, *rest = (row(kernel, p, s, c) for s in starts)
                moved += any(not torch.equal(first, other) for other in rest)
            start, half = middle // 16 * 16, c // 2
            qq, kk, vv = q[:, :, start : start + c].clone(), k[:, :, : start + c].clone(), v[:, :, : start + c].clone()
            ref = kernel(qq, kk, vv)
            qq[:, :, half:], kk[:, :, start + half :], vv[:, :, start + half :] = 0, 7, -3
            same = torch.equal(kernel(qq, kk, vv)[:, :, :half], ref[:, :, :half])
            fixed[c] = {"moved": moved, "rows": len(positions), "other_rows": same}
        calls = {
            (s, m): [row(kernel, middle, s, m)]
            for m in ROW_COUNTS
            if m <= 128
            for s in range(max(0, middle - m + 1), middle + 1)
        }
        out[name] = {
            "fixed": fixed,
            "position": middle,
            "calls": len(calls),
            "distinct": len(_classes(calls, lambda a, b: 1)),
        }
    return out


def _padded_run(model: Any, ids: torch.Tensor, cache: DynamicCache, start: int, chunk: int) -> torch.Tensor:
    """The logits of ``ids[start:]`` computed in ``chunk``-row forwards from ``start`` over ``cache``, the last one
    padded (the pads' K/V cropped from the cache after it). Mutates ``cache``."""
    out = []
    for s in range(start, len(ids), chunk):
        real = ids[s : s + chunk]
        rows = torch.cat([real, real.new_zeros(chunk - len(real))])
        out.append(model(rows[None], cache=cache, use_cache=True).logits[0, : len(real)])
        cache.crop(len(real) - chunk)
    return torch.cat(out)


def _same_kv(a: DynamicCache, b: DynamicCache, length: int) -> bool:
    """Whether the first ``length`` tokens' K/V of ``a`` and ``b`` are bit-identical in every layer."""
    return all(
        torch.equal(x.keys[:, :, :length], y.keys[:, :, :length])
        and torch.equal(x.values[:, :, :length], y.values[:, :, :length])
        for x, y in zip(a.layers, b.layers)
    )


def _model_rows(model: Any, chunks: list[int], length: int) -> dict[int, dict[str, Any]]:
    """End to end on ``model``, a prompt of ``length`` tokens computed in C-row forwards from position 0, the last
    one padded, per chunk size C: "pads", whether a shorter prompt whose pads stand where the longer one has
    tokens gets the same K/V (what publishing a padded chunk's whole blocks needs); "moved", of up to three block
    boundaries b that are no chunk boundary, those from which C-row forwards over the first b tokens' K/V give the
    rest of the prompt other K/V or logits (what starting a forward at any block boundary needs)."""
    ids = tokens(length, model.config.vocab_size, seed=length)
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        full = DynamicCache(config=model.config)
        logits = _padded_run(model, ids, full, 0, chunk)
        cut = length - chunk // 2 - 3
        short = DynamicCache(config=model.config)
        _padded_run(model, ids[:cut], short, 0, chunk)
        inside = [b for b in range(BLOCK, length, BLOCK) if b % chunk]
        tried = inside[:: max(1, len(inside) // 3)][:3]
        moved = []
        for b in tried:
            cache = _prefix(model, full, b)
            if not (
                torch.equal(_padded_run(model, ids, cache, b, chunk), logits[b:]) and _same_kv(cache, full, length)
            ):
                moved.append(b)
        out[chunk] = {"pads": _same_kv(short, full, cut), "tried": tried, "moved": moved}
    return out


def row_independence(
    model: Any, chunks: list[int], positions: range = range(0, 1100, 11), length: int = 1100
) -> dict[str, Any]:
    """Whether a row's result depends on the other rows of a call, in float32 and bfloat16 on this machine's
    kernels: the linear layer (:func:`_linear_rows`) and the attention (:func:`_attention_rows`) at the model's
    shapes, and the model end to end over a ``length``-token prompt (:func:`_model_rows`)."""
    out: dict[str, Any] = {"machine": machine()}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            out[str(dtype).removeprefix("torch.")] = {
                "linear": _linear_rows(model.config, dtype, chunks, ROW_COUNTS),
                "attention": _attention_rows(model.config, dtype, chunks, positions),
                "model": _model_rows(copy.deepcopy(model).to(dtype), chunks, length),
            }
    return out


def rows_report(result: dict[str, Any]) -> str:
    """:func:`row_independence` as a table, one line per kernel and dtype."""

    def counts(group: list[int]) -> str:
        """A run of :data:`ROW_COUNTS` as its ends (``4-1056``), any other group in full."""
        at = ROW_COUNTS.index(group[0])
        run = len(group) > 2 and list(ROW_COUNTS[at : at + len(group)]) == group
        return f"{group[0]}-{group[-1]}" if run else ", ".join(map(str, group))

    lines = []
    for dtype in ("float32", "bfloat16"):
        linear, attention = result[dtype]["linear"], result[dtype]["attention"]
        groups = " / ".join(counts(g) for g in linear["classes"])
        fixed = ", ".join(
            f"{c}: {'yes' if f['other_rows'] and f['row_place'] else 'NO'}" for c, f in linear["fixed"].items()
        )
        lines.append([f"linear, {dtype}", groups, fixed, ""])
        for name, label in (("attend", "the store's attend"), ("sdpa", "SDPA, boolean causal mask")):
            a = attention[name]
            fixed = ", ".join(f"{c}: {'yes' if f['other_rows'] else 'NO'}" for c, f in a["fixed"].items())
            moved = ", ".join(f"{c}: {f['moved']} of {f['rows']}" for c, f in a["fixed"].items())
            lines.append([f"{label}, {dtype}", f"{a['distinct']} distinct in {a['calls']} calls", fixed, moved])
    headers = [
        "kernel",
        "row counts M with bit-equal common rows (attention: one row, any M and start)",
        "C rows: a row the same whatever the other rows hold, by C",
        "C rows from any block boundary: rows that change, by C",
    ]
    model = [
        [
            f"model, {dtype}, C = {c}",
            "same" if m["pads"] else "OTHER",
            f"{len(m['moved'])} of {len(m['tried'])} ({', '.join(map(str, m['tried']))})",
        ]
        for dtype in ("float32", "bfloat16")
        for c, m in result[dtype]["model"].items()
    ]
    end_to_end = [
        "end to end",
        "K/V with pads where a longer prompt has tokens",
        "forwards from block boundary b: b that change",
    ]
    return table(headers, lines) + "\n\n" + table(end_to_end, model)


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Invariant over default for every measure of :func:`run`, by name."""
    out = {f"warm {w['prefix']}+{result['query']}": w["invariant"] / w["default"] for w in result["warm"]}
    out[f"demo {result['demo']['system']}"] = result["demo"]["invariant"] / result["demo"]["default"]
    out.update({f"decode batch {d['batch']}": d["invariant"] / d["default"] for d in result["decode"]})
    out[f"cold {result['cold']['length']}"] = result["cold"]["invariant"] / result["cold"]["default"]
    memory = result["warm"][-1]["memory"]
    out["memory"] = memory["invariant"]["bytes_used"] / memory["default"]["bytes_used"]
    return out


def report(result: dict[str, Any]) -> str:
    def row(label: str, r: dict[str, float], digits: int, budget: float) -> list[str]:
        ratio = r["invariant"] / r["default"]
        budgeted = f"{ratio:.2f}x ({target(ratio <= budget)}: <= {budget}x)"
        return [label, f"{r['default']:.{digits}f}", f"{r['invariant']:.{digits}f}", budgeted]

    q, d, c = result["query"], result["demo"], result["cold"]
    memory = result["warm"][-1]["memory"]
    pool = {mode: m["bytes_used"] / 2**20 for mode, m in memory.items()}
    rows = [
        *(row(f"warm TTFT, {w['prefix']} + {q} tokens, ms", w, 1, BUDGET["warm"]) for w in result["warm"]),
        row(f"warm TTFT, demo workload ({d['system']}-token system prompt), ms", d, 1, BUDGET["warm"]),
        *(
            row(f"decode, batch {r['batch']}, {r['context']}-token context, ms/token", r, 2, BUDGET["decode"])
            for r in result["decode"]
        ),
        row(f"cold TTFT, {c['length']} tokens, empty store, ms", c, 0, BUDGET["cold"]),
        row(
            f"memory: K/V held after the {result['warm'][-1]['prefix']}-token warm calls, MiB",
            pool,
            2,
            BUDGET["memory"],
        ),
    ]
    out = [table(["measure", "default", "invariant", "invariant / default (budget)"], rows)]
    chat = result.get("chat")
    if chat is not None:
        n = chat["questions"]
        lines = []
        for mode in (m for m in MODES if m in chat):
            for what, label in (("cold_vs_stock", "cold vs stock"), ("warm_vs_cold", "warm vs cold")):
                c = chat[mode][what]
                same = [f"{c['same_tokens']} / {n}", f"{c['same_logits']} / {n}"]
                lines.append([mode, label, *same, f"{c['tokens_before_difference']} / {32 * n}"])
        headers = ["mode", "comparison", "same answers", "bit-identical logits", "tokens before first difference"]
        out.append(f"SmolLM2 bfloat16, {n} questions after a {chat['system_tokens']}-token system prompt:")
        out.append(table(headers, lines))
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 2048], help="the warm calls' cached prefixes")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--system", type=int, default=2048, help="the demo workload's system prompt (the demo's 2048)")
    ap.add_argument("--runs", type=int, default=1, help="whole runs, one after the other, each one's ratios printed")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--real", action="store_true", help="also SmolLM2's chat experiment (bfloat16: slow on CPUs)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (1 on a shared machine: small matmuls suffer most)"
    )
    sizes: dict[str, Any] = {"type": int, "nargs": "+", "default": None}
    ap.add_argument(
        "--chunks",
        **sizes,
        help="also the invariant store at these chunk sizes: cold 1056, warm 1024+32, warm 1000+40 (mid-chunk)",
    )
    ap.add_argument("--only-chunks", action="store_true", help="with --chunks, only that sweep")
    ap.add_argument(
        "--padded",
        **sizes,
        help="only the forwards of the padded and unpadded schedules at these chunk sizes, over a DynamicCache "
        "(CPU time of the calling thread: with --threads 1)",
    )
    ap.add_argument("--rows", action="store_true", help="only whether a row's result depends on the call's other rows")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.padded or args.rows:
        model = model_for(args.size)
        print(machine(), flush=True)
        if args.rows:
            rows = row_independence(model, args.padded or [16, 32, 64, 128, 256])
            save("invariance_rows", rows)
            print(rows_report(rows), flush=True)
        if args.padded:
            costs = padded_costs(model, args.padded, args.repeat)
            save("invariance_padded", {"size": args.size, "machine": machine(), **costs})
            print(padded_report(costs))
        return
    if args.chunks:
        sweep = chunk_sweep(model_for(args.size), args.chunks, args.repeat)
        if args.only_chunks:
            save("invariance_chunks", {"size": args.size, "machine": machine(), "chunks": sweep})
            return
    runs = []
    for i in range(args.runs):
        result = run(args.size, args.prefixes, args.context, args.batches, args.system, args.repeat)
        runs.append(ratios(result))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}x" for k, v in runs[-1].items()), flush=True)
    if args.real:
        result["chat"] = chat_counts()
    result["runs"] = runs
    if args.chunks:
        result["chunks"] = sweep
    save("invariance", result)
    print(f"{result['machine']}; chunk_size {result['chunk_size']}, block_size {BLOCK}\n")
    print(report(result))


if __name__ == "__main__":
    main()
