"""A bounded store over many requests: 1,000 random requests (a few shared prefixes of different
popularity, each with its own question) through a small pool on the tiny model. Reports the hit rate,
the evictions, and the time spent in store operations per request: match + attach (building the
cache), allocate (with eviction), publish, release.

Then the bookkeeping of one long sequence (512, 8k and 32k tokens), decoded token by token through the
cache's forward protocol without the model: per step, ``cache.forward.begin`` (allocate, prove) and
``cache.forward.end`` (publish the block the step filled), and the whole sequence's publishing. Publishing
continues from the row's trie node, so its cost per block stays flat as the context grows.
Run: ``python benchmarks/store_ops.py``."""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _common import machine, model_for, save, table, tokens

import prefixkv
from prefixkv.hf.cache import PagedPrefixCache
from prefixkv.hf.proof import ForwardInputs
from prefixkv.hf.rows import RowSet
from prefixkv.kv.room import Room

# the store operations of one request, and the method that performs each: a cache's rows claim, extend, publish
# and release their blocks through the store's block manager (docs/how-it-works.md, "The block manager")
OPERATIONS: dict[str, tuple[type, str]] = {
    "match + attach": (RowSet, "attach"),
    "allocate (with eviction)": (RowSet, "allocate"),
    "publish": (RowSet, "publish_full"),
    "release": (PagedPrefixCache, "close"),
}
# inside the above: making room, i.e. growing the pool or evicting
MAKE_ROOM = (Room, "ensure_free")


@contextmanager
def timed_operations() -> Iterator[dict[str, float]]:
    """Seconds spent in each store operation while the block runs (wraps the methods, then restores)."""
    targets = {**OPERATIONS, "make room": MAKE_ROOM}
    spent = dict.fromkeys(targets, 0.0)
    originals = {name: getattr(cls, method) for name, (cls, method) in targets.items()}

    def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapped

    for name, (cls, method) in targets.items():
        setattr(cls, method, timer(name, originals[name]))
    try:
        yield spent
    finally:
        for name, (cls, method) in targets.items():
            setattr(cls, method, originals[name])


def workload(requests: int, prefixes: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Requests over ``prefixes`` shared prefixes (32-160 tokens, Zipf-like popularity), each followed
    by a 4-40-token question; a fifth of them continue a longer, less common prefix."""
    rng = random.Random(seed)
    shared = [tokens(rng.randrange(32, 161), vocab, seed=i) for i in range(prefixes)]
    weights = [1 / (i + 1) for i in range(prefixes)]
    out = []
    for i in range(requests):
        base = rng.choices(shared, weights)[0]
        if rng.random() < 0.2:
            base = torch.cat([base, tokens(48, vocab, seed=10_000 + rng.randrange(20))])
        out.append(torch.cat([base, tokens(rng.randrange(4, 41), vocab, seed=100_000 + i)])[None])
    return out


def run(
    requests: int = 1000, prefixes: int = 12, num_blocks: int = 64, block_size: int = 16, new_tokens: int = 4
) -> dict[str, Any]:
    model = model_for("tiny")
    vocab = model.config.vocab_size
    prompts = workload(requests, prefixes, vocab)
    store = prefixkv.PrefixStore(model, block_size=block_size, num_blocks=num_blocks)
    started = time.perf_counter()
    with timed_operations() as spent, torch.no_grad():
        for ids in prompts:
            with PagedPrefixCache(store, ids) as cache:
                model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    total = time.perf_counter() - started
    store.check_invariants()
    s = store.stats
    store.close()
    return {
        "requests": requests,
        "prefixes": prefixes,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "prompt_tokens": s.prompt_tokens,
        "hit_tokens": s.hit_tokens,
        "hit_rate": s.hit_rate,
        "evictions": s.evictions,
        "misses": s.misses,
        "us_per_request": {name: 1e6 * sec / requests for name, sec in spent.items()},
        "request_ms": 1000 * total / requests,
        "machine": machine(),
    }


def sequence(length: int, block_size: int = 16, window: int = 1024) -> dict[str, Any]:
    """One row decoded token by token to ``length`` tokens through the cache's forward protocol, without the
    model and without the attention read path (``decode.py`` measures those): seconds in ``Forward.begin``
    and in ``Forward.end`` of :mod:`prefixkv.hf.forward` (which publishes each block as it fills), over the whole
    sequence and per step over its last ``window`` steps."""
    model = model_for("tiny")
    store = prefixkv.PrefixStore(model, block_size=block_size)
    layers = len(store.pool.specs)
    rng = random.Random(length)
    ids = [torch.tensor([[rng.randrange(3, model.config.vocab_size)]]) for _ in range(length)]
    begin, end = [0.0] * length, [0.0] * length
    with PagedPrefixCache(store) as cache:
        for t, x in enumerate(ids):
            # decode_step: as generate's decode steps, the namespace was checked at the first
            forward = ForwardInputs(x, decode_step=t > 0)
            a = time.perf_counter()
            cache.forward.begin(forward)
            b = time.perf_counter()
            cache._rowset.seen = [t + 1] * layers  # stands in for update(): every layer stored the step's column
            cache.forward.end(True)
            begin[t], end[t] = b - a, time.perf_counter() - b
        assert store.cached_length([int(x) for x in ids]) == length // block_size * block_size
    store.check_invariants()
    store.close()
    last = min(window, length)
    return {
        "tokens": length,
        "block_size": block_size,
        "publish_ms_per_sequence": 1000 * sum(end),
        "begin_us_per_step": 1e6 * sum(begin[-last:]) / last,
        "end_us_per_step": 1e6 * sum(end[-last:]) / last,
    }


def sequence_report(rows: list[dict[str, Any]]) -> str:
    return table(
        ["one sequence", "publishing, whole sequence ms", "end_forward µs/step", "begin_forward µs/step"],
        [
            [
                f"{r['tokens']:,} tokens",
                f"{r['publish_ms_per_sequence']:.1f}",
                f"{r['end_us_per_step']:.1f}",
                f"{r['begin_us_per_step']:.1f}",
            ]
            for r in rows
        ],
    )


def report(r: dict[str, Any]) -> str:
    ops = dict(r["us_per_request"])
    room = ops.pop("make room")
    store_us = sum(ops.values())
    head = (
        f"{r['requests']:,} requests over {r['prefixes']} shared prefixes, pool of {r['num_blocks']} blocks x "
        f"{r['block_size']} tokens: hit rate {r['hit_rate']:.1%} ({r['hit_tokens']:,} of {r['prompt_tokens']:,} "
        f"prompt tokens reused), {r['evictions']:,} prefixes evicted, {r['misses']} requests reused nothing.\n\n"
    )
    rows = [[name, f"{us:.0f}"] for name, us in ops.items()]
    rows.append(["all store operations", f"{store_us:.0f}"])
    rows.append(["  of which making room (growing the pool, evicting)", f"{room:.0f}"])
    rows.append(["whole request (generate, 4 new tokens)", f"{1000 * r['request_ms']:.0f}"])
    return head + table(["per request", "µs"], rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 8192, 32768])
    args = ap.parse_args(argv)
    result = run(args.requests, num_blocks=args.num_blocks)
    sequence(256)  # warm-up: the first steps pay for first calls
    result["sequences"] = [sequence(n) for n in args.lengths]
    save("store_ops", result)
    print(report(result))
    print()
    print(sequence_report(result["sequences"]))
    print(f"\n{result['machine']}")


if __name__ == "__main__":
    main()
