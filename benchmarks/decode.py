"""Decode speed: milliseconds per new token after a long prompt, batch 1 and 8, for prefixkv,
DynamicCache and StaticCache. Run: ``python benchmarks/decode.py [--size 100m]``."""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _common import model_for, save, table, target, tokens
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

import prefixkv


class StepClock(BaseStreamer):
    """Timestamps of each generated step (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None

    def ms_per_token(self) -> float:
        steps = self.times[1:]  # drop the prompt
        return 1000 * (steps[-1] - steps[0]) / (len(steps) - 1)


def decode_ms(model: Any, ids: torch.Tensor, new: int, variant: str, store: prefixkv.PrefixStore) -> float:
    clock = StepClock()
    kwargs: dict[str, Any] = {}
    cache: Any = None
    if variant == "dynamic":
        kwargs["cache"] = DynamicCache(config=model.config)
    elif variant == "static":
        kwargs["cache_implementation"] = "static"
    else:
        cache = kwargs["cache"] = prefixkv.PagedPrefixCache(store, ids)
    model.generate(
        ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0, **kwargs
    )
    if cache is not None:
        cache.close()
    return clock.ms_per_token()


def run(size: str, prompts: list[int], batches: list[int], new: int, repeat: int) -> dict[str, Any]:
    model = model_for(size)
    store = prefixkv.PrefixStore(model, block_size=16)
    rows = []
    for p in prompts:
        for b in batches:
            samples: dict[str, list[float]] = {"dynamic": [], "static": [], "prefixkv": []}
            for i in range(repeat):
                ids = torch.stack([tokens(p, model.config.vocab_size, seed=100 * i + r) for r in range(b)])
                for variant in samples:
                    samples[variant].append(decode_ms(model, ids, new, variant, store))
            store.clear()
            rows.append({"prompt": p, "batch": b, **{k: min(v) for k, v in samples.items()}})
    store.close()
    return {"size": size, "new_tokens": new, "rows": rows}


def report(result: dict[str, Any]) -> str:
    out = []
    for r in result["rows"]:
        ratio = r["prefixkv"] / r["dynamic"]
        goal = 1.05 if r["prompt"] <= 512 else 1.0
        out.append(
            [
                r["prompt"],
                r["batch"],
                f"{r['dynamic']:.2f}",
                f"{r['static']:.2f}",
                f"{r['prefixkv']:.2f}",
                f"{ratio:.3f} ({target(ratio <= goal)}, <= {goal:.2f})",
            ]
        )
    return table(
        [
            "prompt",
            "batch",
            "DynamicCache ms/token",
            "StaticCache ms/token",
            "prefixkv ms/token",
            "prefixkv / Dynamic (target)",
        ],
        out,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    result = run(args.size, args.prompts, args.batches, args.new_tokens, args.repeat)
    save("decode", result)
    print(report(result))


if __name__ == "__main__":
    main()
