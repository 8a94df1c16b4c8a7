"""Shared pieces of the benchmarks: models, interleaved timing, tables, machine description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

import prefixkv

RESULTS = Path(__file__).parent / "results"


def model_for(size: str) -> Any:
    """``small``: the demo's 4-layer model; ``100m``: the ~100M-parameter Llama-shaped model; ``tiny``: the 2-layer
    model of the tests, ``tiny-N`` its shape with ``N`` layers."""
    if size.startswith("tiny-"):
        return prefixkv.models.tiny_model("llama", vocab_size=512, num_hidden_layers=int(size[5:]))
    if size == "100m":
        return prefixkv.models.bench_model()
    if size == "small":
        return prefixkv.models.demo_model()
    if size == "tiny":
        return prefixkv.models.tiny_model("llama", vocab_size=512)
    raise ValueError(f"unknown size {size!r}: small, 100m, tiny or tiny-N (N layers)")


def tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def interleaved_samples(
    variants: dict[str, Callable[[], float | None]], repeat: int, warmup: int = 1
) -> dict[str, list[float]]:
    """The milliseconds of every repeat of each variant, run round-robin so that machine noise hits all alike.

    A variant may return its own measured milliseconds (to exclude set-up); else it is timed whole.
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + repeat):
        for name, fn in variants.items():
            start = time.perf_counter()
            own = fn()
            ms = own if own is not None else 1000 * (time.perf_counter() - start)
            if i >= warmup:
                samples[name].append(ms)
    return samples


def interleaved(variants: dict[str, Callable[[], float | None]], repeat: int, warmup: int = 1) -> dict[str, float]:
    """Median milliseconds of each variant (:func:`interleaved_samples`)."""
    return {name: statistics.median(v) for name, v in interleaved_samples(variants, repeat, warmup).items()}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, Python {platform.python_version()}"
    )


def save(name: str, payload: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))


# set by run_all.py --quick: at smoke sizes the targets (set for the full run's sizes) do not apply
SMOKE = False


def target(ok: bool) -> str:
    """The verdict on a target: met or MISSED; "n/a" in a smoke run, whose sizes the targets were not set for."""
    if SMOKE:
        return "n/a"
    return "met" if ok else "MISSED"
