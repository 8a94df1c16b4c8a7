"""Hybrid models (issue 45): a Qwen3-Next-shaped model (Gated DeltaNet linear attention, 3 layers to 1 of full
attention) against the pure-attention model of the same size, in one run.

- Time to the first token over a shared prefix of P tokens and a fresh 32-token query: no reuse (stock ``generate``
  with a fresh ``DynamicCache``) and prefixkv (warm store), median of ``--repeat`` calls per variant, interleaved.
- The hit rate (cached / prompt tokens) over a stream of prompts whose shared prefixes end at arbitrary tokens
  (a random length of one of a few documents, never a multiple of the block size, and a unique question), measured
  with prefixkv's stats, against what token-granular reuse could hit at most (each prompt's longest common prefix
  with an earlier one) and what a block-grid policy would hit: state only at multiples of ``--grid`` tokens (528,
  vLLM's align mode for Qwen3.5), every such boundary of every earlier prompt kept.

With ``--parting SIZE`` (``tiny``, ``10M``, ``100M``: the Qwen3-Next-shaped model and the attention model of that
size), issue 56's measures instead (docs/benchmarks.md, "Where prompts part"):

- A = S shared tokens + its own, then B and C the same S + others, on a fresh store: the tokens B and C reuse (and
  B on the attention model), and A's, B's and C's time to the first token over stock ``generate``'s on the same
  prompt, by the wall clock and by the process's CPU time (``--shapes`` picks the prompts).
- The agent-like trace (4 documents of 600 tokens, 40 prompts each of a document's first 100-600 tokens and 30 of
  their own, in random order): the hybrid's hit rate against the attention model's, the most any cache reuses, and
  256- and 528-token grids computed from the same prompts; then under snapshot budgets of 0.5, 1, 2 and 4 times the
  K/V pool's bytes: the grid step, hit rate, snapshots' memory, what was dropped, and every miss's reason checked.
- A 6-turn chat: the warm call's time to the first token over stock's, per turn.

A model ``PrefixStore`` refuses is reported with the reason. Run: ``python benchmarks/hybrid.py [--smoke]`` or
``python benchmarks/hybrid.py --parting 10M`` (several sizes: one run, ``--parting tiny 10M 100M --parts abc``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import interleaved, machine, save, table, tokens
from transformers import DynamicCache

import prefixkv

QUERY = 32
BLOCK_SIZE = 16
# the smoke run's models: the benchmark models' shapes (the hybrid's 3-to-1 pattern kept) at hidden size 64
_SMOKE_SIZES: dict[str, dict[str, Any]] = {
    "attention": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "hybrid": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "mlp_only_layers": [0, 1, 2, 3],
    },
}


def models(smoke: bool) -> dict[str, Any]:
    """The hybrid and the attention benchmark model (~100M parameters each; hidden size 64 with ``smoke``)."""
    return {kind: prefixkv.models.bench_model(kind, **(_SMOKE_SIZES[kind] if smoke else {})) for kind in _SMOKE_SIZES}


def open_store(model: Any) -> tuple[Any, str | None]:
    """A ``PrefixStore`` for ``model``, or ``None`` and the reason it was refused."""
    try:
        return prefixkv.PrefixStore(model, block_size=BLOCK_SIZE), None
    except prefixkv.UnsupportedModelError as e:
        return None, str(e)


def first_token(model: Any, ids: torch.Tensor, cache: Any) -> None:
    model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)


def ttft(model: Any, p: int, repeat: int) -> dict[str, Any]:
    """Median milliseconds to the first token over a ``p``-token prefix and a fresh query: ``none`` (no reuse) and
    ``prefixkv`` (warm store; ``None`` when refused, with ``refused``), and the tokens the warm calls reused."""
    vocab = model.config.vocab_size
    prefix = tokens(p, vocab, seed=p)
    queries = iter([torch.cat([prefix, tokens(QUERY, vocab, seed=1000 + i)])[None] for i in range(4 * repeat + 8)])
    store, refused = open_store(model)
    reused: list[int] = []

    def no_reuse() -> None:
        first_token(model, next(queries), DynamicCache(config=model.config))

    def warm() -> None:
        ids = next(queries)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            first_token(model, ids, cache)
        reused.append(cache.stats.cached_tokens)

    variants: dict[str, Any] = {"none": no_reuse}
    if store is not None:
        with prefixkv.PagedPrefixCache(store, prefix[None]) as cache:
            first_token(model, prefix[None], cache)
        variants["prefixkv"] = warm
    try:
        ms = interleaved(variants, repeat)
    finally:
        if store is not None:
            store.close()
    return {"none": ms["none"], "prefixkv": ms.get("prefixkv"), "reused": min(reused, default=0), "refused": refused}


def stream(vocab: int, n: int, documents: int, lo: int, hi: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` prompts: a prefix of a random length in ``[lo, hi]`` (never a multiple of the block size) of one of
    ``documents`` random documents, then a unique ``QUERY``-token question."""
    g = torch.Generator().manual_seed(seed)
    docs = [tokens(hi, vocab, seed=seed + 1 + d) for d in range(documents)]
    prompts = []
    for i in range(n):
        doc = int(torch.randint(documents, (), generator=g))
        length = int(torch.randint(lo, hi + 1, (), generator=g))
        length -= 1 if length % BLOCK_SIZE == 0 else 0
        prompts.append(torch.cat([docs[doc][:length], tokens(QUERY, vocab, seed=seed + 10_000 + i)]))
    return prompts


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def reachable(prompts: list[torch.Tensor], grid: int = 1) -> list[int]:
    """Per prompt, the tokens a cache of every earlier prompt could give it at most, when states are kept only at
    multiples of ``grid`` tokens (1: every token): the longest common prefix with an earlier prompt, at most all
    tokens but the last (one must be computed to get the first token's logits), rounded down to the grid."""
    best = []
    for i, ids in enumerate(prompts):
        shared = max((common_prefix(ids, earlier) for earlier in prompts[:i]), default=0)
        best.append(min(shared, len(ids) - 1) // grid * grid)
    return best


def grid_states(prompts: list[torch.Tensor], grid: int) -> int:
    """The states a policy keeping one at every multiple of ``grid`` tokens of every prompt (before its last token,
    as :func:`reachable` counts) holds after ``prompts``: one per distinct prefix of such a length."""
    return len({tuple(ids[:k].tolist()) for ids in prompts for k in range(grid, len(ids), grid)})


def hit_rate(model: Any, prompts: list[torch.Tensor]) -> dict[str, Any]:
    """The prompt tokens prefixkv reused over ``prompts`` in order, on one store (``None`` and the reason when
    refused)."""
    store, refused = open_store(model)
    if store is None:
        return {"cached": None, "refused": refused}
    cached = 0
    try:
        for ids in prompts:
            with prefixkv.PagedPrefixCache(store, ids[None]) as cache:
                first_token(model, ids[None], cache)
            cached += cache.stats.cached_tokens
    finally:
        store.close()
    return {"cached": cached, "refused": None}


def run(smoke: bool, prefix: int, repeat: int, prompts: int, documents: int, lo: int, hi: int, grid: int) -> dict:
    built = models(smoke)
    vocab = built["hybrid"].config.vocab_size
    ids = stream(vocab, prompts, documents, lo, hi)
    total = sum(len(p) for p in ids)
    result: dict[str, Any] = {
        "smoke": smoke,
        "prefix": prefix,
        "query": QUERY,
        "grid": grid,
        "machine": machine(),
        "parameters": {k: sum(p.numel() for p in m.parameters()) for k, m in built.items()},
        "stream": {
            "prompts": prompts,
            "documents": documents,
            "lengths": [lo, hi],
            "prompt_tokens": total,
            "token_granular": sum(reachable(ids)),
            "block_grid": sum(reachable(ids, grid)),
        },
    }
    with torch.no_grad():
        for kind, model in built.items():
            result[kind] = {"ttft": ttft(model, prefix, repeat), "hits": hit_rate(model, ids)}
    return result


def _ms(value: float | None) -> str:
    return "refused" if value is None else f"{value:.1f}"


def report(r: dict[str, Any]) -> str:
    """The time-to-first-token table, the hit-rate table, and the reasons of any refusal."""
    names = {"hybrid": "hybrid (Qwen3-Next-shaped)", "attention": "attention (Llama-shaped)"}
    times, hits, refusals = [], [], []
    s = r["stream"]
    for kind, name in names.items():
        t, h = r[kind]["ttft"], r[kind]["hits"]
        speedup = "-" if t["prefixkv"] is None else f"{t['none'] / t['prefixkv']:.1f}x"
        reused = "-" if t["prefixkv"] is None else str(t["reused"])
        size = f"{r['parameters'][kind] / 1e6:.3g}M"
        times.append([f"{name}, {size}", _ms(t["none"]), _ms(t["prefixkv"]), speedup, reused])
        measured = "refused" if h["cached"] is None else f"{100 * h['cached'] / s['prompt_tokens']:.1f}%"
        hits.append([name, measured])
        refusals += [f"- {kind}: {t['refused']}"] if t["refused"] else []
    hits.append([f"at most, token-granular ({s['token_granular']} tokens)", _pct(s["token_granular"], s)])
    hits.append([f"block grid of {r['grid']} tokens ({s['block_grid']} tokens)", _pct(s["block_grid"], s)])
    lo, hi = s["lengths"]
    parts = [
        f"Milliseconds to the first token, {r['prefix']}-token shared prefix + {r['query']}-token query:",
        table(["model", "no reuse", "prefixkv warm", "speed-up", "reused tokens"], times),
        f"Hit rate over {s['prompts']} prompts ({s['prompt_tokens']} tokens): prefixes of {lo}-{hi} tokens of "
        f"{s['documents']} documents, each + a unique {r['query']}-token question:",
        table(["policy", "cached / prompt tokens"], hits),
    ]
    if refusals:
        parts.append("Refused by PrefixStore:\n" + "\n".join(refusals))
    return "\n\n".join(parts)


def _pct(tokens_: int, s: dict[str, Any]) -> str:
    return f"{100 * tokens_ / s['prompt_tokens']:.1f}%"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="hidden-64 models, a short prefix, a few prompts (seconds)")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs=2, default=[100, 1500], metavar=("LO", "HI"))
    ap.add_argument("--grid", type=int, default=528, help="the block-grid policy's state interval in tokens")
    ap.add_argument(
        "--parting", nargs="+", choices=sorted(PARTING_SIZES), help="issue 56's measures at these sizes instead"
    )
    ap.add_argument(
        "--shapes", nargs="+", metavar="S+OWN", help="the A/B/C prompts (shared + own tokens; default: the issue's)"
    )
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.5, 1, 2, 4], help="x the K/V pool's bytes")
    ap.add_argument("--per-document", type=int, default=40, help="the trace's prompts per document")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the parting measures to run")
    args = ap.parse_args(argv)
    if args.parting:
        shapes = [tuple(int(n) for n in s.split("+")) for s in args.shapes] if args.shapes else ABC
        for size in args.parting:  # one run: the same machine and load for every size
            parted = run_parting(size, args.repeat, args.budgets, args.per_document, tuple(args.parts), shapes)
            save(f"hybrid_parting_{size}_{'_'.join(args.parts)}", parted)
            print(report_parting(parted), flush=True)
        return
    if args.smoke:
        args.prefix, args.repeat, args.prompts, args.lengths = 48, 1, 6, [20, 60]
    result = run(args.smoke, args.prefix, args.repeat, args.prompts, args.documents, *args.lengths, args.grid)
    save("hybrid", result)
    print(report(result))


# -- issue 56: where the next prompt parts --------------------------------------------------------------------------

# the sizes of the Qwen3-Next-shaped model the parting benchmark runs: hidden 64 (smoke), ~10M and ~100M
PARTING_SIZES: dict[str, dict[str, Any]] = {
    "tiny": _SMOKE_SIZES["hybrid"],
    "10M": {
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
    "100M": {},
}
# the attention model of each size: the hybrid's hidden size, layers and attention heads
_ATTENTION_OF = {
    "tiny": _SMOKE_SIZES["attention"],
    "10M": {
        k: PARTING_SIZES["10M"][k]
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    },
    "100M": {},
}
# (S, own): A = S shared + own, then B and C the same S + others (the table)
ABC = [(100, 40), (527, 40), (1000, 40), (1500, 40), (1500, 700)]


def timed(model: Any, ids: torch.Tensor, store: Any = None) -> tuple[float, Any]:
    """Milliseconds to ``ids``'s first token: with a ``PagedPrefixCache`` of ``store``, built inside the time (it
    reuses and computes the prompt up to its last token then), or stock ``generate`` with a fresh ``DynamicCache``
    (``store=None``); and the cache's stats (``None`` for stock)."""
    wall, _, stats = timed_both(model, ids, store)
    return wall, stats


def timed_both(model: Any, ids: torch.Tensor, store: Any = None) -> tuple[float, float, Any]:
    """:func:`timed`, with the milliseconds of this process's CPU time beside the wall clock's (one thread: what other
    jobs on a shared machine take of it counts in the wall clock only)."""
    start, cpu = time.perf_counter(), time.process_time()
    if store is None:
        first_token(model, ids, DynamicCache(config=model.config))
        return 1000 * (time.perf_counter() - start), 1000 * (time.process_time() - cpu), None
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        first_token(model, ids, cache)
    return 1000 * (time.perf_counter() - start), 1000 * (time.process_time() - cpu), cache.stats


def abc(model: Any, shared: int, own: int, repeat: int) -> dict[str, Any]:
    """A, B, C over ``shared`` tokens on a fresh store per repeat (each repeat its own prefix): the tokens each
    reused, and each one's time to the first token over stock ``generate``'s on the same prompt, by the wall clock
    and by this process's CPU time (medians of the ratios and of the milliseconds, stock timed right after each)."""
    vocab = model.config.vocab_size
    reused: dict[str, int] = {}
    ratios: dict[str, list[float]] = {k: [] for k in ("A", "B", "C", "cpu A", "cpu B", "cpu C")}
    ms: dict[str, list[float]] = {f"{w}{k}": [] for w in ("", "stock ") for k in "ABC"}
    for r in range(repeat):
        prefix = tokens(shared, vocab, seed=7000 + r)
        store, _ = open_store(model)
        assert store is not None
        try:
            for name, seed in (("A", 1), ("B", 2), ("C", 3)):
                ids = torch.cat([prefix, tokens(own, vocab, seed=8000 + 10 * r + seed)])[None]
                took, cpu, stats = timed_both(model, ids, store)
                reused[name] = stats.cached_tokens
                stock, stock_cpu, _ = timed_both(model, ids)
                ms[name].append(took)
                ms[f"stock {name}"].append(stock)
                ratios[name].append(took / stock)
                ratios[f"cpu {name}"].append(cpu / stock_cpu)
        finally:
            store.close()
    median = statistics.median
    return {
        "shared": shared,
        "own": own,
        "reused": reused,
        "ratio": {k: median(v) for k, v in ratios.items()},
        "ms": {k: median(v) for k, v in ms.items()},
    }


def trace(vocab: int, documents: int = 4, length: int = 600, per_document: int = 40, own: int = 30) -> list[list[int]]:
    """The issue's agent-like trace: per document of ``length`` tokens, ``per_document`` prompts of its first X
    tokens (X from 100 to ``length``) and ``own`` tokens of their own, all in one random order."""
    g = torch.Generator().manual_seed(56)
    docs = [tokens(length, vocab, seed=560 + d).tolist() for d in range(documents)]
    prompts = []
    for d, doc in enumerate(docs):
        for k in range(per_document):
            x = int(torch.randint(100, length + 1, (), generator=g))
            prompts.append(doc[:x] + tokens(own, vocab, seed=56_000 + 100 * d + k).tolist())
    return [prompts[i] for i in torch.randperm(len(prompts), generator=g).tolist()]


def run_trace(model: Any, prompts: list[list[int]], budget: int | None = None, pool: int | None = None) -> dict:
    """``prompts`` in turn on one store whose snapshots get ``budget`` bytes (the grid sized against a ``pool`` of
    that many bytes): the hit rate, the K/V the store held, the snapshots' memory and what the stats say of the
    drops, and every miss (a prompt that resumes short of the K/V the store held) with its reason checked against the
    snapshots that were taken (``right``: "dropped" where one was taken at the point the K/V end, "was taken yet"
    where none was)."""
    store, refused = open_store(model)
    if store is None:
        return {"refused": refused}
    snapshots = store.snapshots
    snapshots.max_bytes, snapshots.pool_bytes = budget, pool
    taken: set[tuple[Any, tuple[int, ...]]] = set()
    add = snapshots.add

    def noting(space: Any, keys: Any, snapshot: Any, **kw: Any) -> None:
        taken.add((space, tuple(keys[: snapshot.position])))
        add(space, keys, snapshot, **kw)

    snapshots.add = noting  # type: ignore[method-assign]
    misses = right = peak = 0
    try:
        for p in prompts:
            space = store.blocks.space()
            held = store.cached_length(p[:-1])
            dropped = (space, tuple(p[:held])) in taken  # before this call takes one there
            with prefixkv.PagedPrefixCache(store, torch.tensor([p])) as cache:
                first_token(model, torch.tensor([p]), cache)
            if cache.stats.cached_tokens < held and snapshots is not None:
                misses += 1
                why = cache.stats.not_cached or ""
                right += ("dropped" in why) if dropped else ("no recurrent-state snapshot was taken yet" in why)
            peak = max(peak, snapshots.bytes_used)
        s = store.stats
    finally:
        store.close()
    return {
        "prompt_tokens": s.prompt_tokens,
        "hit_tokens": s.hit_tokens,
        "kv_hit_tokens": s.kv_hit_tokens,
        "kv_bytes": s.bytes_used,
        "snapshot_bytes": s.snapshot_bytes,
        "peak_snapshot_bytes": peak,
        "snapshots": s.snapshots,
        "taken": s.snapshots_taken,
        "used": s.snapshots_used,
        "dropped_budget": s.snapshots_dropped_budget,
        "dropped_path": s.snapshots_dropped_path,
        "step": snapshots.step(),
        "misses": misses,
        "reasons_right": right,
        "refused": None,
    }


def chat(model: Any, turns: int = 6, system: int = 300, user: int = 30, answer: int = 40) -> list[dict[str, Any]]:
    """A ``turns``-turn chat on one store: each turn's prompt is the conversation so far and ``user`` new tokens
    (the answers are ``answer`` random tokens, the same for both); milliseconds to the first token warm and with
    stock ``generate``, and the tokens reused."""
    vocab = model.config.vocab_size
    store, _ = open_store(model)
    assert store is not None
    history = tokens(system, vocab, seed=600)
    rows = []
    try:
        for t in range(turns):
            history = torch.cat([history, tokens(user, vocab, seed=610 + t)])
            ids = history[None]
            warm, stats = timed(model, ids, store)
            cold, _ = timed(model, ids)
            rows.append(
                {"turn": t + 1, "prompt": len(history), "reused": stats.cached_tokens, "warm": warm, "cold": cold}
            )
            history = torch.cat([history, tokens(answer, vocab, seed=620 + t)])
    finally:
        store.close()
    return rows


PARTS = ("abc", "trace", "chat")


def run_parting(
    size: str,
    repeat: int,
    budgets: list[float],
    per_document: int,
    parts: tuple[str, ...] = PARTS,
    shapes: list[tuple[int, int]] = ABC,
) -> dict[str, Any]:
    """Issue 56's measures (those of ``parts``; A, B, C at each of ``shapes``) on the Qwen3-Next-shaped model of
    ``size`` and the attention model of its size."""
    hybrid_model = prefixkv.models.bench_model("hybrid", **PARTING_SIZES[size])
    attention = prefixkv.models.bench_model("attention", **_ATTENTION_OF[size])
    vocab = hybrid_model.config.vocab_size
    prompts = trace(vocab, per_document=per_document)
    result: dict[str, Any] = {
        "size": size,
        "machine": machine(),
        "repeat": repeat,
        "parameters": {
            "hybrid": sum(p.numel() for p in hybrid_model.parameters()),
            "attention": sum(p.numel() for p in attention.parameters()),
        },
    }
    with torch.no_grad():
        first_token(hybrid_model, tokens(64, vocab, seed=1)[None], DynamicCache(config=hybrid_model.config))  # warm-up
        if "abc" in parts:
            result["abc"] = [abc(hybrid_model, s, o, repeat) for s, o in shapes]
            result["abc_attention"] = [abc(attention, s, o, 1)["reused"] for s, o in shapes]
        if "chat" in parts:
            result["chat"] = chat(hybrid_model)
        if "trace" not in parts:
            return result
        unbounded = run_trace(hybrid_model, prompts)
        pool = unbounded["kv_bytes"]
        result["trace"] = {
            "prompts": len(prompts),
            "prompt_tokens": unbounded["prompt_tokens"],
            "ceiling": sum(reachable([torch.tensor(p) for p in prompts])),
            "grid_256": sum(reachable([torch.tensor(p) for p in prompts], 256)),
            "grid_528": sum(reachable([torch.tensor(p) for p in prompts], 528)),
            "grid_256_states": grid_states([torch.tensor(p) for p in prompts], 256),
            "grid_528_states": grid_states([torch.tensor(p) for p in prompts], 528),
            "attention": run_trace(attention, prompts),
            "hybrid": unbounded,
            "budgets": {str(f): run_trace(hybrid_model, prompts, int(f * pool), pool) for f in budgets},
        }
    return result


def report_parting(r: dict[str, Any]) -> str:
    """The B/C table, B's and A's time to the first token over stock's, the trace's hit rates and the snapshots'
    memory under each budget, and the chat's turns."""
    size = f"{r['parameters']['hybrid'] / 1e6:.3g}M"
    parts = [
        f"Qwen3-Next-shaped hybrid, {size} (attention model {r['parameters']['attention'] / 1e6:.3g}M); {r['machine']}"
    ]
    if "abc" in r:
        rows = []
        for row, att in zip(r["abc"], r["abc_attention"]):
            re_, ratio, ms = row["reused"], row["ratio"], row["ms"]
            rows.append(
                [
                    f"{row['shared']} + {row['own']}",
                    re_["B"],
                    att["B"],
                    re_["C"],
                    *(f"{ratio[k]:.2f}x ({ratio.get('cpu ' + k, float('nan')):.2f}x)" for k in "ABC"),
                    " / ".join(f"{ms[k]:.0f}" for k in ("A", "stock A", "B", "stock B")),
                ]
            )
        parts += [
            f"A = S shared + own tokens, then B and C the same S + others; time to the first token over stock's, by "
            f"the wall clock (by CPU time), median of {r['repeat']}:",
            table(
                [
                    "S + own",
                    "B reuses (hybrid)",
                    "B reuses (attention)",
                    "C reuses (hybrid)",
                    "A / stock",
                    "B / stock",
                    "C / stock",
                    "ms: A / stock, B / stock",
                ],
                rows,
            ),
        ]
    if "trace" in r:
        t = r["trace"]
        total = t["prompt_tokens"]
        pct = lambda n: f"{100 * n / total:.1f}%"  # noqa: E731
        of = lambda n: f"{n / t['ceiling']:.2f}"  # noqa: E731
        mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
        h = t["hybrid"]
        one = h["snapshot_bytes"] / max(h["snapshots"], 1)  # one snapshot's bytes
        grid = lambda g: mib(t[f"grid_{g}_states"] * one) if f"grid_{g}_states" in t else "-"  # noqa: E731
        hits = [
            ["attention model, prefixkv", pct(t["attention"]["hit_tokens"]), of(t["attention"]["hit_tokens"]), "-"],
            ["at most (token-granular)", pct(t["ceiling"]), "1.00", "-"],
            [
                "hybrid, prefixkv (default grid)",
                pct(h["hit_tokens"]),
                of(h["hit_tokens"]),
                mib(h["peak_snapshot_bytes"]),
            ],
            ["256-token grid (SGLang's interval)", pct(t["grid_256"]), of(t["grid_256"]), grid(256)],
            ["528-token grid (vLLM's align mode)", pct(t["grid_528"]), of(t["grid_528"]), grid(528)],
        ]
        memory = []
        for name, h in [("none (unbounded)", t["hybrid"]), *((f"{f}x pool", h) for f, h in t["budgets"].items())]:
            memory.append(
                [
                    name,
                    h["step"],
                    pct(h["hit_tokens"]),
                    mib(h["peak_snapshot_bytes"]),
                    mib(h["kv_bytes"]),
                    h["taken"],
                    h["dropped_budget"],
                    h["dropped_path"],
                    f"{h['reasons_right']} / {h['misses']}",
                ]
            )
        parts += [
            f"Trace: {t['prompts']} prompts ({total} tokens), 4 documents of 600 tokens, each prompt a document's "
            "first 100-600 tokens + 30 of its own, in random order:",
            f"(a grid's states: one snapshot, {mib(one)} MiB, at every multiple of the grid of every prompt, all kept)",
            table(["policy", "hit rate", "of the ceiling", "states MiB"], hits),
            "The hybrid on the trace with its snapshots' budget a multiple of the K/V pool's bytes after the trace:",
            table(
                [
                    "snapshot budget",
                    "grid step",
                    "hit rate",
                    "snapshots MiB (peak)",
                    "K/V pool MiB",
                    "taken",
                    "dropped (budget)",
                    "dropped (path)",
                    "misses' reasons right",
                ],
                memory,
            ),
        ]
    if "chat" in r:
        chat_rows = [
            [
                c["turn"],
                c["prompt"],
                c["reused"],
                f"{c['warm']:.0f}",
                f"{c['cold']:.0f}",
                f"{c['warm'] / c['cold']:.2f}",
            ]
            for c in r["chat"]
        ]
        parts += [
            "A 6-turn chat (300-token system prompt, 30-token user turns, 40-token answers), ms to the first token:",
            table(["turn", "prompt", "reused", "warm", "stock", "warm / stock"], chat_rows),
        ]
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
