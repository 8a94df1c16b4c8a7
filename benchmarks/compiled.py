"""Compiled decoding: milliseconds per new token over a cached prefix, batch 1 and 8, for prefixkv compiled (the
default ``PagedPrefixCache`` under ``generate``'s own compile), prefixkv eager (the same cache, no compile),
``StaticCache`` compiled (``cache_implementation="static"``, the same compile) and ``DynamicCache`` eager,
interleaved in one run, each on its own copy of the model; and what ``torch._dynamo`` compiled for prefixkv: graphs
and graph breaks in its first call and per warm call (docs/benchmarks.md, "Compiled decoding"). On the CPU
``generate`` compiles only when the compile config allows every device (``_compile_all_devices``), which this sets.
Run: ``python benchmarks/compiled.py [--size tiny] [--prefix 1024]``."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch._dynamo
from _common import interleaved, machine, model_for, save, table, target, tokens
from decode import StepClock
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache

import prefixkv


def compile_config(device: torch.device, backend: str = "inductor") -> CompileConfig:
    """``generate``'s compile: inductor, CUDA graphs where there is CUDA (``reduce-overhead``), on every device
    (``backend="eager"``: dynamo alone, for a smoke run)."""
    mode = None if backend == "eager" else "reduce-overhead" if device.type == "cuda" else "default"
    config = CompileConfig(backend=backend, mode=mode)
    config._compile_all_devices = True
    return config


def compiles() -> tuple[int, int]:
    """Frames compiled and graph breaks so far, by ``torch._dynamo``'s counters."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def run(size: str, batches: list[int], prefix: int, new: int, repeat: int, backend: str = "inductor") -> dict[str, Any]:
    base = model_for(size)
    vocab = base.config.vocab_size
    models = {name: copy.deepcopy(base) for name in ("pkv_compiled", "pkv_eager", "static", "dynamic")}
    stores = {name: prefixkv.PrefixStore(models[name], block_size=16) for name in ("pkv_compiled", "pkv_eager")}
    config = compile_config(base.device, backend)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        # every row: the shared prefix (cached by the first call), then 8 tokens of its own
        shared = tokens(prefix, vocab, seed=1)
        ids = torch.stack([torch.cat([shared, tokens(8, vocab, seed=100 + r)]) for r in range(batch)])
        seen: dict[str, tuple[int, int]] = {}  # what the latest call of each variant compiled
        first: dict[str, tuple[int, int]] = {}  # what its first call compiled

        def call(
            name: str,
            ids: torch.Tensor = ids,
            seen: dict[str, tuple[int, int]] = seen,
            first: dict[str, tuple[int, int]] = first,
        ) -> float:
            model, kwargs = models[name], {}
            cache: Any = None
            if name == "dynamic":
                kwargs["cache"] = DynamicCache(config=model.config)
            elif name == "static":
                kwargs.update(cache_implementation="static", compile_config=config)
            else:
                compiled = name == "pkv_compiled"
                cache = kwargs["cache"] = prefixkv.PagedPrefixCache(stores[name], ids)
                if compiled:
                    kwargs["compile_config"] = config
            clock = StepClock()
            before = compiles()
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0, **kwargs
            )
            after = compiles()
            seen[name] = (after[0] - before[0], after[1] - before[1])
            first.setdefault(name, seen[name])
            if cache is not None:
                cache.close()
            return clock.ms_per_token()

        variants = {name: (lambda n=name: call(n)) for name in models}
        # two warm-up rounds: the first compiles, the second may recompile once for a shape made dynamic
        ms = interleaved(variants, repeat=repeat, warmup=2)
        rows.append({"batch": batch, "ms": ms, "compiled_first_call": first, "compiled_per_warm_call": dict(seen)})
    return {"machine": machine(), "size": size, "prefix": prefix, "new_tokens": new, "backend": backend, "rows": rows}


def report(result: dict[str, Any]) -> str:
    header = [
        "batch", "prefixkv compiled", "prefixkv eager", "StaticCache compiled", "DynamicCache eager",
        "compiled / StaticCache compiled", "target <= 1.05", "graphs, breaks: first call", "per warm call",
    ]  # fmt: skip
    out = []
    for r in result["rows"]:
        ms = r["ms"]
        ratio = ms["pkv_compiled"] / ms["static"]
        first_graphs, first_breaks = r["compiled_first_call"]["pkv_compiled"]
        graphs, breaks = r["compiled_per_warm_call"]["pkv_compiled"]
        out.append(
            [
                r["batch"],
                f"{ms['pkv_compiled']:.3f}",
                f"{ms['pkv_eager']:.3f}",
                f"{ms['static']:.3f}",
                f"{ms['dynamic']:.3f}",
                f"{ratio:.2f}x",
                target(ratio <= 1.05),
                f"{first_graphs}, {first_breaks}",
                f"{graphs}, {breaks}",
            ]
        )
    return (
        f"Decode ms per new token, {result['size']} model, a {result['prefix']}-token cached prefix plus 8 tokens "
        f"per row, {result['new_tokens']} new tokens, {result['backend']} ({result['machine']}):\n\n"
        + table(header, out)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    result = run(args.size, args.batches, args.prefix, args.new, args.repeat)
    print(report(result))
    save(f"compiled_{args.size}", result)


if __name__ == "__main__":
    main()
