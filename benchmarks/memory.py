"""KV bytes held by 16 live requests sharing a 1024-token prefix: prefixkv vs the deepcopy recipe vs the
ideal shared layout (the prefix once, plus each request's own tail). Run: ``python benchmarks/memory.py``."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from _common import model_for, save, table, target, tokens
from transformers import DynamicCache

import prefixkv
from prefixkv.base.memory import format_bytes, kv_bytes_per_token


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)


def run(size: str, prefix_len: int, requests: int, query: int, new: int) -> dict[str, Any]:
    model = model_for(size)
    vocab = model.config.vocab_size
    prefix = tokens(prefix_len, vocab, seed=0)
    prompts = [torch.cat([prefix, tokens(query, vocab, seed=1 + i)])[None] for i in range(requests)]
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        filled = DynamicCache(config=model.config)
        model(prefix[None], cache=filled)
    copies = []
    for ids in prompts:
        cache = copy.deepcopy(filled)
        model.generate(ids, cache=cache, **gen)
        copies.append(cache)
    deepcopy_bytes = sum(dynamic_bytes(c) for c in copies)
    del copies

    store = prefixkv.PrefixStore(model, block_size=16)
    live = []
    for ids in prompts:
        cache = prefixkv.PagedPrefixCache(store, ids)
        model.generate(ids, cache=cache, **gen)
        live.append(cache)  # all 16 stay open: their blocks are held at once
    stats = store.stats
    pool_bytes = (store.pool.capacity - 1) * store.bytes_per_block
    for cache in live:
        cache.close()
    store.close()

    per_token = kv_bytes_per_token(model.config, model.dtype)
    ideal = (prefix_len + requests * (query + new - 1)) * per_token  # the last new token is never fed
    return {
        "size": size,
        "prefix": prefix_len,
        "requests": requests,
        "ideal": ideal,
        "deepcopy": deepcopy_bytes,
        "prefixkv_blocks": stats.bytes_used,
        "prefixkv_pool": pool_bytes,
    }


def report(r: dict[str, Any]) -> str:
    ideal = r["ideal"]
    rows = [
        ["ideal shared layout", format_bytes(ideal), "1.00x"],
        ["deepcopy recipe", format_bytes(r["deepcopy"]), f"{r['deepcopy'] / ideal:.2f}x"],
        [
            "prefixkv, blocks in use",
            format_bytes(r["prefixkv_blocks"]),
            f"{r['prefixkv_blocks'] / ideal:.2f}x ({target(r['prefixkv_blocks'] <= 1.1 * ideal)}, <= 1.10x)",
        ],
        ["prefixkv, pool allocated", format_bytes(r["prefixkv_pool"]), f"{r['prefixkv_pool'] / ideal:.2f}x"],
    ]
    return table([f"{r['requests']} live requests, {r['prefix']}-token shared prefix", "KV bytes", "vs ideal"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--query", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    result = run(args.size, args.prefix, args.requests, args.query, args.new_tokens)
    save("memory", result)
    print(report(result))


if __name__ == "__main__":
    main()
