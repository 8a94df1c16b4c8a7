"""Hybrid models (issue 45): a Qwen3-Next-shaped model (Gated DeltaNet linear attention, 3 layers to 1 of full
attention) against the pure-attention model of the same size, in one run.

- Time to the first token over a shared prefix of P tokens and a fresh 32-token query: no reuse (stock ``generate``
  with a fresh ``DynamicCache``) and prefixkv (warm store), median of ``--repeat`` calls per variant, interleaved.
- The hit rate (cached / prompt tokens) over a stream of prompts whose shared prefixes end at arbitrary tokens
  (a random length of one of a few documents, never a multiple of the block size, and a unique question), measured
  with prefixkv's stats, against what token-granular reuse could hit at most (each prompt's longest common prefix
  with an earlier one) and what a block-grid policy would hit: state only at multiples of ``--grid`` tokens (528,
  vLLM's align mode for Qwen3.5), every such boundary of every earlier prompt kept.

A model ``PrefixStore`` refuses is reported with the reason. Run: ``python benchmarks/hybrid.py [--smoke]``.
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args(argv)
    if args.smoke:
        args.prefix, args.repeat, args.prompts, args.lengths = 48, 1, 6, [20, 60]
    result = run(args.smoke, args.prefix, args.repeat, args.prompts, args.documents, *args.lengths, args.grid)
    save("hybrid", result)
    print(report(result))


if __name__ == "__main__":
    main()
