"""Shared-prefix batches (issue 54): milliseconds per decode step of ``rows`` rows on one warm prefix, each row with
32 tokens of its own, prefixkv (the store holds the prefix once and its attention reads it once for all rows, in
the eager step) against ``DynamicCache`` (every row's copy of the prefix, read row by row), over rows 2-16 and
prefixes 512-4096 (``--rows``, ``--prefixes``). The prefix is warmed once per case (``store.warm``), untimed; each
figure is the fastest of ``--repeat`` calls, the two caches taking turns to go first. ``DynamicCache`` prefills each
case once, untimed, and every call decodes from a deepcopy of it (the recipe prefixkv replaces; the steps it
times are those of a fresh cache, without a prefill of every row's prefix per call). Run:
``python benchmarks/shared_decode.py [--size 100m]``; results in docs/benchmarks.md, "Shared-prefix batches"."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from _common import machine, model_for, save, table, target, tokens
from decode import StepClock, decode_ms
from transformers import DynamicCache

import prefixkv
from prefixkv.compat import releases

OWN = 32  # tokens of each row's own after the prefix


def run(size: str, rows: list[int], prefixes: list[int], new: int, repeat: int) -> dict[str, Any]:
    """Every ``prefixes`` x ``rows`` case: the fastest of ``repeat`` calls per cache, taking turns."""
    model = model_for(size)
    vocab = model.config.vocab_size
    out = []
    for p in prefixes:
        prefix = tokens(p, vocab, seed=p)
        store = prefixkv.PrefixStore(model, block_size=16)
        store.warm([prefix], progress=False)
        for b in rows:
            ids = torch.stack([torch.cat([prefix, tokens(OWN, vocab, seed=1000 * p + r)]) for r in range(b)])
            prefilled = prefill(model, ids)
            samples: dict[str, list[float]] = {"dynamic": [], "prefixkv": []}
            for i in range(repeat):
                for variant in ["dynamic", "prefixkv"][:: 1 if i % 2 else -1]:
                    ms = (
                        copied_decode_ms(model, ids, new, prefilled)
                        if variant == "dynamic"
                        else decode_ms(model, ids, new, variant, store)
                    )
                    samples[variant].append(ms)
            best = {k: min(v) for k, v in samples.items()}
            out.append({"prefix": p, "rows": b, **best, "speedup": best["dynamic"] / best["prefixkv"]})
        store.close()
    return {"size": size, "own": OWN, "new_tokens": new, "machine": machine(), "rows": out}


def prefill(model: Any, ids: torch.Tensor) -> DynamicCache:
    """A ``DynamicCache`` holding every column of ``ids`` but the last (what ``generate`` then feeds)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], use_cache=True, **{releases.forward_cache_kwarg(model.forward): cache})
    return cache


def copied_decode_ms(model: Any, ids: torch.Tensor, new: int, prefilled: DynamicCache) -> float:
    """ms per decode step of ``generate`` continuing a deepcopy of ``prefilled`` (:func:`prefill` of ``ids``)."""
    clock = StepClock()
    cache = copy.deepcopy(prefilled)
    model.generate(
        ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0
    )
    return clock.ms_per_token()


def report(result: dict[str, Any]) -> str:
    body = [
        [r["prefix"], r["rows"], f"{r['dynamic']:.2f}", f"{r['prefixkv']:.2f}", f"{r['speedup']:.2f}x",
         target(r["speedup"] >= 1.5) if (r["prefix"], r["rows"]) == (1024, 8) else "-"]
        for r in result["rows"]
    ]  # fmt: skip
    header = ["prefix", "rows", "Dynamic ms/step", "prefixkv ms/step", "Dynamic / prefixkv", "1.5x (1024, 8)"]
    return (
        f"Decode ms per step, rows on one warm prefix plus {result['own']} tokens each, {result['new_tokens']} new "
        f"tokens, {result['size']} model:\n\n" + table(header, body)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    result = run(args.size, args.rows, args.prefixes, args.new_tokens, args.repeat)
    save("shared_decode", result)
    print(report(result))


if __name__ == "__main__":
    main()
