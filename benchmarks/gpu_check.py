"""GPU check of the attention that reads the blocks (issue 13), in one short command on a machine with CUDA:

1. exactness: generate with a PagedPrefixCache against stock generate with DynamicCache, on a tiny Llama in
   float64 (every step's logits within 1e-6) and on the ~100M benchmark model in float32 and bfloat16, for a
   cold batch with left padding, a warm call, and a batch of rows on one shared prefix (cascade);
2. speed: milliseconds per decoded token for prefixkv, DynamicCache and StaticCache (no torch.compile), at
   512 and 4096 tokens, batch 1 and 8, and 16 rows on a shared 2048-token prefix.

Run: ``python benchmarks/gpu_check.py [--dtype bfloat16] [--new-tokens 64]``; writes ``results/gpu_check.json``
(and ``$OUT/gpu_check.json`` when ``OUT`` is set)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from _common import machine, save, table
from decode import batch_ids, decode_ms
from transformers import DynamicCache

import prefixkv
from prefixkv import attention


def served_calls() -> dict[str, int]:
    """Count the attention calls that read the blocks (to show the path really ran)."""
    counts = {"blocks": 0}
    original = attention.blocks_attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts["blocks"] += 1
        return original(*args, **kwargs)

    attention.blocks_attention = counting  # type: ignore[assignment]
    return counts


def logits_diff(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    """Largest logit difference against stock over the steps up to the first differing token, whether all tokens
    agree, stock's smallest top-2 margin at the differing step (a near-tie explains a flip), and tokens reused."""
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config), **kwargs)
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        out = model.generate(ids, attention_mask=mask, cache=cache, **kwargs)
    n = len(ref.logits)
    differ = (ref.sequences[:, -n:] != out.sequences[:, -n:]).any(dim=0).nonzero()
    steps = n if len(differ) == 0 else int(differ[0]) + 1
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(ref.logits[:steps], out.logits[:steps]))
    margin = None
    if len(differ):
        top = ref.logits[steps - 1].double().topk(2, dim=-1).values
        margin = (top[:, 0] - top[:, 1]).min().item()
    return diff, not len(differ), margin, cache.stats.cached_tokens


def exactness(device: str, quick: bool) -> list[list[Any]]:
    rows = []
    cases = [("tiny llama", prefixkv.models.tiny_model("llama", dtype=torch.float64), torch.float64, 1e-6)]
    if not quick:
        cases += [
            ("100M", prefixkv.models.bench_model(), torch.float32, 1e-3),
            ("100M", prefixkv.models.bench_model(), torch.bfloat16, None),
        ]
    for name, model, dtype, tol in cases:
        model = model.to(device=device, dtype=dtype)
        vocab = model.config.vocab_size
        store = prefixkv.PrefixStore(model, block_size=16)
        system = batch_ids(300, 1, 0, vocab, seed=1)[0]
        a = torch.cat([system, batch_ids(20, 1, 0, vocab, seed=2)[0]])
        b = torch.cat([system, batch_ids(37, 1, 0, vocab, seed=3)[0]])
        ids = torch.full((2, len(b)), 0, dtype=torch.long)
        ids[0, len(b) - len(a) :], ids[1] = a, b
        mask = (ids != 0).long()
        mask[1] = 1
        shared = batch_ids(340, 6, 300, vocab, seed=4)
        for case, x, m in (
            ("cold, left padding", ids, mask),
            ("warm, left padding", ids, mask),
            ("6 rows, shared prefix", shared, None),
        ):
            diff, same, margin, cached = logits_diff(model, store, x.to(device), None if m is None else m.to(device))
            ok = "-" if tol is None else ("met" if diff <= tol and same else "MISSED")
            tie = "-" if margin is None else f"{margin:.2e}"
            rows.append([name, str(dtype).replace("torch.", ""), case, cached, f"{diff:.2e}", same, tie, ok])
        store.close()
    return rows


def speed(device: str, dtype: torch.dtype, new: int, quick: bool) -> list[list[Any]]:
    model = (prefixkv.models.tiny_model("llama") if quick else prefixkv.models.bench_model()).to(device, dtype)
    cases = (
        ((64, 1, 0), (64, 4, 48)) if quick else ((512, 1, 0), (512, 8, 0), (4096, 1, 0), (4096, 8, 0), (2112, 16, 2048))
    )
    store = prefixkv.PrefixStore(model, block_size=16)
    vocab = model.config.vocab_size
    rows = []
    for prompt, batch, shared in cases:
        ids = batch_ids(prompt, batch, shared, vocab, seed=7).to(device)
        times: dict[str, list[float]] = {"dynamic": [], "static": [], "prefixkv": [], "blocks": []}
        for _ in range(2):
            for variant in times:
                # "blocks": the attention reads the pool in place on CUDA too (attention.READ_DEVICES)
                attention.READ_DEVICES = frozenset({"cpu", "cuda"} if variant == "blocks" else {"cpu"})
                kind = "prefixkv" if variant == "blocks" else variant
                times[variant].append(decode_ms(model, ids, new, kind, store, disable_compile=True))
                store.clear()
        attention.READ_DEVICES = frozenset({"cpu"})
        best = {k: min(v) for k, v in times.items()}
        rows.append(
            [
                prompt,
                batch,
                shared or "-",
                f"{best['dynamic']:.2f}",
                f"{best['static']:.2f}",
                f"{best['prefixkv']:.2f}",
                f"{best['blocks']:.2f}",
                f"{best['prefixkv'] / best['dynamic']:.3f}",
                f"{best['prefixkv'] / best['static']:.3f}",
            ]
        )
    store.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny model and prompts: check the script itself")
    args = ap.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs CUDA (the CPU path is checked by the test suite and benchmarks/decode.py)")
    counts = served_calls()
    started = time.perf_counter()
    exact = exactness(device, args.quick)
    exact_table = table(
        [
            "model",
            "dtype",
            "case",
            "cached tokens",
            "max logit diff (to first differing token)",
            "same tokens",
            "stock's top-2 margin there",
            "1e-6 / 1e-3",
        ],
        exact,
    )
    print(exact_table, flush=True)
    fast = speed(device, getattr(torch, args.dtype), args.new_tokens, args.quick)
    speed_table = table(
        [
            "prompt",
            "batch",
            "shared",
            "Dynamic ms/token",
            "Static ms/token",
            "prefixkv ms/token",
            "prefixkv reading blocks in place",
            "prefixkv / Dynamic",
            "prefixkv / Static",
        ],
        fast,
    )
    print(speed_table, flush=True)
    result = {
        "machine": f"{torch.cuda.get_device_name() if device == 'cuda' else device}; {machine()}",
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "attention_calls_reading_blocks": counts["blocks"],
        "exactness": exact_table,
        "speed": speed_table,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(f"attention calls that read the blocks: {counts['blocks']}; {result['seconds']} s; {result['machine']}")
    save("gpu_check", result)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
