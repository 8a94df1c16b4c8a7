"""Time to first token when a P-token shared prefix comes back from each tier, against recomputing it.

The prefix is computed once into three stores: one keeps it in its pool (a plain hit), two have a
second tier (``offload="cpu"``, ``offload="disk"``) and are emptied into it before every timed call, so
that call's TTFT includes finding the prefix in the tier and copying its blocks back into the pool. No
reuse is a fresh ``DynamicCache``. Each call adds a fresh 32-token query and generates one token. The
disk tier's files are in the OS page cache (as blocks evicted a moment ago are); a cold read adds the
disk's read time for the bytes listed. Run: ``python benchmarks/tiers.py [--size 100m]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from _common import interleaved, model_for, save, table, target, tokens
from transformers import DynamicCache

import prefixkv
from prefixkv.base.memory import format_bytes

QUERY = 32
BS = 16


def _offload_all(store: prefixkv.PrefixStore) -> None:
    """Evict every cached prefix into the store's second tier."""
    assert store.max_blocks is not None
    store.blocks.room.ensure_free(store.max_blocks)


def measure(model: Any, p: int, repeat: int, directory: str) -> dict[str, float]:
    vocab = model.config.vocab_size
    prefix = tokens(p, vocab, seed=p)
    queries = iter([torch.cat([prefix, tokens(QUERY, vocab, seed=1000 + i)])[None] for i in range(8 * repeat + 8)])
    budget = p // BS + 8  # the prefix, the query and its new token
    stores = {
        "pool": prefixkv.PrefixStore(model, block_size=BS),
        "cpu": prefixkv.PrefixStore(model, block_size=BS, num_blocks=budget, offload="cpu"),
        "disk": prefixkv.PrefixStore(model, block_size=BS, num_blocks=budget, offload="disk", offload_dir=directory),
    }
    for store in stores.values():
        store.warm([prefix], progress=False)
    restore: dict[str, list[float]] = {"cpu": [], "disk": []}

    def first_token(cache: Any, ids: torch.Tensor) -> None:
        model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)

    def no_reuse() -> None:
        first_token(DynamicCache(config=model.config), next(queries))

    def hit(kind: str) -> Any:
        store = stores[kind]

        def run() -> float:
            if kind != "pool":
                _offload_all(store)  # not timed: the prefix is now only in the tier
            ids = next(queries)
            start = time.perf_counter()
            with prefixkv.PagedPrefixCache(store, ids) as cache:
                looked_up = time.perf_counter()
                first_token(cache, ids)
            end = time.perf_counter()
            assert cache.stats.cached_tokens == p, cache.stats
            if kind != "pool":
                restore[kind].append(1000 * (looked_up - start))
            return 1000 * (end - start)

        return run

    try:
        result = interleaved({"none": no_reuse, "pool": hit("pool"), "cpu": hit("cpu"), "disk": hit("disk")}, repeat)
    finally:
        for store in stores.values():
            store.close()
    result["restore_cpu"] = sorted(restore["cpu"])[len(restore["cpu"]) // 2]
    result["restore_disk"] = sorted(restore["disk"])[len(restore["disk"]) // 2]
    result["bytes"] = p // BS * stores["pool"].bytes_per_block
    return result


def run(size: str, prefixes: list[int], repeat: int) -> dict[str, Any]:
    model = model_for(size)
    with tempfile.TemporaryDirectory() as directory:
        rows = [{"prefix": p, **measure(model, p, repeat, f"{directory}/{p}")} for p in prefixes]
    return {"size": size, "query": QUERY, "rows": rows}


def report(result: dict[str, Any]) -> str:
    out = []
    for r in result["rows"]:
        out.append(
            [
                r["prefix"],
                format_bytes(r["bytes"]),
                f"{r['none']:.1f}",
                f"{r['pool']:.1f}",
                f"{r['cpu']:.1f} ({r['restore_cpu']:.1f})",
                f"{r['disk']:.1f} ({r['restore_disk']:.1f})",
                f"{r['none'] / r['pool']:.1f}x",
                f"{r['none'] / r['cpu']:.1f}x",
                f"{r['none'] / r['disk']:.1f}x ({target(r['none'] >= 3 * r['disk'])})",
            ]
        )
    return table(
        [
            "P",
            "prefix K/V",
            "no reuse ms",
            "pool hit ms",
            "cpu tier hit ms (restore)",
            "disk tier hit ms (restore)",
            "pool speedup",
            "cpu tier speedup",
            "disk tier speedup (target >=3x)",
        ],
        out,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    result = run(args.size, args.prefixes, args.repeat)
    save("tiers", result)
    print(report(result))


if __name__ == "__main__":
    main()
