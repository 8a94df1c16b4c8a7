"""Store operations at scale: match + attach + publish time per 2,000-token request against a trie
that already holds 100k cached sequences (allocator and trie only: no model, no tensors).
Run: ``python benchmarks/trie_ops.py``."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from _common import save, table, target

from prefixkv.kv.allocator import BlockAllocator
from prefixkv.kv.trie import RadixTrie


def run(
    sequences: int, systems: int, system_len: int, tail: int, request_len: int, requests: int, block_size: int
) -> dict[str, Any]:
    rng = random.Random(0)
    trie = RadixTrie(block_size)
    alloc = BlockAllocator(1)
    prompts = [[rng.randrange(50_000) for _ in range(system_len)] for _ in range(systems)]

    def publish(seq: list[int]) -> None:
        m = trie.match(seq)
        full = len(seq) // block_size
        have = m.length // block_size
        alloc.grow(alloc.capacity + full - have)
        alloc.incref(m.blocks[:have])  # attach what is cached
        table = m.blocks[:have] + alloc.allocate(full - have)
        ins = trie.insert(seq[: full * block_size], table)
        alloc.incref(ins.added)
        alloc.decref(table)  # the request's own hold ends; the trie keeps what it took

    start = time.perf_counter()
    for i in range(sequences):
        publish(prompts[i % systems] + [rng.randrange(50_000) for _ in range(tail)])
    fill_s = time.perf_counter() - start

    samples = []
    for _ in range(requests):
        seq = prompts[rng.randrange(systems)] + [rng.randrange(50_000) for _ in range(request_len - system_len)]
        t0 = time.perf_counter()
        publish(seq)  # match, attach, allocate the rest, publish, release
        samples.append(1000 * (time.perf_counter() - t0))
    return {
        "sequences": sequences,
        "nodes": len(trie.nodes()),
        "fill_s": fill_s,
        "request_len": request_len,
        "median_ms": statistics.median(samples),
        "p95_ms": sorted(samples)[int(0.95 * len(samples))],
    }


def report(r: dict[str, Any]) -> str:
    return table(
        ["trie", "request", "median ms", "p95 ms", "target < 1 ms"],
        [
            [
                f"{r['sequences']:,} sequences, {r['nodes']:,} nodes",
                f"{r['request_len']} tokens",
                f"{r['median_ms']:.3f}",
                f"{r['p95_ms']:.3f}",
                target(r["median_ms"] < 1.0),
            ]
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sequences", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=500)
    args = ap.parse_args()
    result = run(
        args.sequences, systems=100, system_len=1536, tail=64, request_len=2000, requests=args.requests, block_size=16
    )
    save("trie_ops", result)
    print(report(result))


if __name__ == "__main__":
    main()
