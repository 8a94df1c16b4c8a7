"""Overhead when nothing is ever reused: all-distinct prompts, prefixkv vs a fresh DynamicCache.
Run: ``python benchmarks/zero_hit.py``."""

from __future__ import annotations

import argparse
from typing import Any

from _common import interleaved, model_for, save, table, target, tokens
from transformers import DynamicCache

import prefixkv


def run(size: str, prompt: int, new: int, repeat: int) -> dict[str, Any]:
    model = model_for(size)
    store = prefixkv.PrefixStore(model, block_size=16)
    seeds = iter(range(10**6))
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def dynamic() -> None:
        ids = tokens(prompt, model.config.vocab_size, seed=next(seeds))[None]
        model.generate(ids, cache=DynamicCache(config=model.config), **gen)

    def paged() -> None:
        ids = tokens(prompt, model.config.vocab_size, seed=next(seeds))[None]
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            model.generate(ids, cache=cache, **gen)

    t = interleaved({"dynamic": dynamic, "prefixkv": paged}, repeat)
    hits = store.stats.hit_tokens
    store.close()
    return {"size": size, "prompt": prompt, "new_tokens": new, "hit_tokens": hits, **t}


def report(r: dict[str, Any]) -> str:
    overhead = r["prefixkv"] / r["dynamic"] - 1
    return table(
        ["distinct prompts", "DynamicCache ms/request", "prefixkv ms/request", "overhead (target <=3%)"],
        [
            [
                f"{r['prompt']} + {r['new_tokens']} new tokens",
                f"{r['dynamic']:.1f}",
                f"{r['prefixkv']:.1f}",
                f"{100 * overhead:+.1f}% ({target(overhead <= 0.03)})",
            ]
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args()
    result = run(args.size, args.prompt, args.new_tokens, args.repeat)
    save("zero_hit", result)
    print(report(result))


if __name__ == "__main__":
    main()
