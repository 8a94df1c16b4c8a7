"""Time to first token under tensor parallelism: the bench model split over 2 processes (``tp_plan="auto"``,
``torchrun``, gloo on CPU, one thread each), a shared prefix of P tokens and a 32-token query, each process with its
own store. No reuse (a fresh DynamicCache) against prefixkv with the prefix cached (warm) and with nothing cached
(cold: a new prefix every call, the cost of prefixkv when nothing is reused). Run: ``python benchmarks/tp.py``
(it starts torchrun itself; ``--size``, ``--prefixes``, ``--repeat``, ``--procs``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from _common import RESULTS, interleaved, model_for, save, table, tokens
from transformers import DynamicCache

import prefixkv

QUERY = 32


def measure(model: Any, p: int, repeat: int) -> dict[str, float]:
    """Median milliseconds of each variant for a prefix of ``p`` tokens (fresh queries every call), as this process
    saw them (the processes wait for each other at every layer)."""
    vocab = model.config.vocab_size
    prefix = tokens(p, vocab, seed=p)
    queries = iter([torch.cat([prefix, tokens(QUERY, vocab, seed=1000 + i)])[None] for i in range(10 * repeat + 10)])
    fresh = iter([tokens(p + QUERY, vocab, seed=5000 + i)[None] for i in range(10 * repeat + 10)])
    store = prefixkv.PrefixStore(model, block_size=16)
    with prefixkv.PagedPrefixCache(store, prefix[None]) as warmup_cache:
        model.generate(prefix[None], past_key_values=warmup_cache, max_new_tokens=1, do_sample=False)

    def first_token(cache: Any, ids: torch.Tensor) -> None:
        model.generate(ids, past_key_values=cache, max_new_tokens=1, do_sample=False, pad_token_id=0)

    def no_reuse() -> None:
        first_token(DynamicCache(config=model.config), next(queries))

    def prefixkv_cold() -> None:
        ids = next(fresh)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            first_token(cache, ids)

    def prefixkv_warm() -> None:
        ids = next(queries)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            first_token(cache, ids)

    try:
        return interleaved({"none": no_reuse, "cold": prefixkv_cold, "warm": prefixkv_warm}, repeat)
    finally:
        store.close()


def worker(size: str, prefixes: list[int], repeat: int, out: Path) -> None:
    """One process under torchrun: the bench model split with ``tp_plan="auto"``; rank 0 saves the results."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = out / "model"
    if rank == 0:
        model_for(size).save_pretrained(path)
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    rows = [{"prefix": p, **measure(model, p, repeat)} for p in prefixes]
    if rank == 0:
        save("tp", {"size": size, "query": QUERY, "processes": dist.get_world_size(), "rows": rows})
    dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    """The milliseconds and the warm/cold ratios, narrow enough for the docs page."""
    rows = [
        [
            r["prefix"],
            f"{r['none']:.0f}",
            f"{r['cold']:.0f}",
            f"{r['warm']:.0f}",
            f"{r['none'] / r['warm']:.1f}x",
            f"{r['cold'] / r['none']:.2f}",
        ]
        for r in result["rows"]
    ]
    headers = ["P", "no reuse", "prefixkv cold", "prefixkv warm", "warm speed-up", "cold / no reuse"]
    title = f"Milliseconds to the first token, {result['processes']} processes (tensor parallelism, gloo, CPU):"
    return "\n\n".join([title, table(headers, rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set when torchrun starts this file
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.size, args.prefixes, args.repeat, args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        here = Path(__file__).resolve()
        argv = ["--size", args.size, "--repeat", str(args.repeat), "--worker", tmp]
        argv += ["--prefixes", *map(str, args.prefixes)]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}"]
        paths = [str(here.parent), str(Path(prefixkv.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
        subprocess.run([*command, str(here), *argv], check=True, env=env)
    print(report(json.loads((RESULTS / "tp.json").read_text())))


if __name__ == "__main__":
    main()
