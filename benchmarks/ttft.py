"""Time to first token with a shared prefix of P tokens and a 32-token query.

No reuse (a fresh DynamicCache), transformers' prompt-reuse recipe (prefill a DynamicCache once,
``copy.deepcopy`` it per request) and prefixkv (warm store), against the floor: a bare forward over
the 32 uncached tokens on an already filled cache. Run: ``python benchmarks/ttft.py [--size 100m]``.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch
from _common import interleaved, model_for, save, table, target, tokens
from transformers import DynamicCache

import prefixkv

QUERY = 32


def measure(model: Any, p: int, repeat: int) -> dict[str, float]:
    """Median milliseconds of each variant for a prefix of ``p`` tokens (fresh queries every call)."""
    vocab = model.config.vocab_size
    prefix = tokens(p, vocab, seed=p)
    queries = iter([torch.cat([prefix, tokens(QUERY, vocab, seed=1000 + i)])[None] for i in range(10 * repeat + 10)])
    with torch.no_grad():
        filled = DynamicCache(config=model.config)
        model(prefix[None], cache=filled)
    store = prefixkv.PrefixStore(model, block_size=16)
    with prefixkv.PagedPrefixCache(store, prefix[None]) as warmup_cache:
        model.generate(prefix[None], cache=warmup_cache, max_new_tokens=1, do_sample=False)

    def first_token(cache: Any, ids: torch.Tensor) -> None:
        model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)

    def no_reuse() -> None:
        first_token(DynamicCache(config=model.config), next(queries))

    def deepcopy_recipe() -> None:
        first_token(copy.deepcopy(filled), next(queries))

    def prefixkv_warm() -> None:
        ids = next(queries)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            first_token(cache, ids)

    def bare_forward() -> float:
        cache, ids = copy.deepcopy(filled), next(queries)
        start = time.perf_counter()
        with torch.no_grad():
            model(ids[:, p:], cache=cache)
        return 1000 * (time.perf_counter() - start)

    def lookup() -> float:
        ids = next(queries)
        start = time.perf_counter()
        cache = prefixkv.PagedPrefixCache(store, ids)
        ms = 1000 * (time.perf_counter() - start)
        cache.close()
        return ms

    try:
        return interleaved(
            {
                "none": no_reuse,
                "deepcopy": deepcopy_recipe,
                "prefixkv": prefixkv_warm,
                "bare": bare_forward,
                "lookup": lookup,
            },
            repeat,
        )
    finally:
        store.close()


def run(size: str, prefixes: list[int], repeat: int) -> dict[str, Any]:
    model = model_for(size)
    rows = [{"prefix": p, **measure(model, p, repeat)} for p in prefixes]
    return {"size": size, "query": QUERY, "rows": rows}


def report(result: dict[str, Any]) -> str:
    """Two tables narrow enough for the docs page: the milliseconds, then the ratios and the targets."""
    times, ratios = [], []
    for r in result["rows"]:
        p = r["prefix"]
        ideal = (p + QUERY) / QUERY
        times.append([p, *(f"{r[k]:.1f}" for k in ("none", "deepcopy", "prefixkv", "bare"))])
        ratios.append(
            [
                p,
                f"{r['none'] / r['deepcopy']:.1f}x",
                f"{r['none'] / r['prefixkv']:.1f}x",
                f"{ideal:.0f}x",
                f"{r['prefixkv'] / r['bare']:.2f} ({target(r['prefixkv'] <= 1.05 * r['bare'])})",
                f"{100 * r['lookup'] / r['prefixkv']:.2f}% ({target(r['lookup'] < 0.02 * r['prefixkv'])})",
            ]
        )
    return "\n\n".join(
        [
            "Milliseconds to the first token:",
            table(["P", "no reuse", "deepcopy", "prefixkv", "bare fwd"], times),
            "Speed-up over no reuse, and the targets:",
            table(
                [
                    "P",
                    "deepcopy speedup",
                    "prefixkv speedup",
                    "ideal (P+32)/32",
                    "prefixkv / bare (<= 1.05)",
                    "lookup share (< 2%)",
                ],
                ratios,
            ),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    result = run(args.size, args.prefixes, args.repeat)
    save("ttft", result)
    print(report(result))


if __name__ == "__main__":
    main()
