"""Run every benchmark and write ``docs/benchmarks.md`` (tables) and ``docs/benchmarks.png`` (plot).

``python benchmarks/run_all.py`` (full: the ~100M model, about 25 min on 2 cores) or ``--quick`` (the small
model and sizes, a smoke run: 4.6 min on a loaded 2-core machine; prints :data:`SMOKE_NOTE` first, then the
tables with no verdicts, as the targets are set for the full run's sizes, and writes nothing). Also
``python -m prefixkv bench [--quick]``. A line on stderr as each benchmark starts and ends says where the run is.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _common
import decode
import memory
import throughput
import trie_ops
import ttft
import zero_hit
from _common import machine

DOCS = Path(__file__).parent.parent / "docs"


def plot(ttft_result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ttft_result["rows"]
    xs = [r["prefix"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in [
        ("none", "no reuse (fresh DynamicCache)"),
        ("deepcopy", "deepcopy recipe"),
        ("prefixkv", "prefixkv (warm)"),
        ("bare", "bare forward, 32 tokens"),
    ]:
        ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("shared prefix length P (tokens), + 32-token query")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT, {ttft_result['size']} model, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SECTIONS = (
    "Time to first token",
    "Decode speed",
    "Memory",
    "Throughput",
    "Throughput, answers that end anywhere",
    "Zero-hit overhead",
    "Store operations",
)


class Progress:
    """Lines on stderr as each benchmark starts and ends, with its time and the run's: a full run takes about
    25 minutes and prints its tables only at the end."""

    def __init__(self, total: int, started: float) -> None:
        self.total, self.started, self.done = total, started, 0

    @contextlib.contextmanager
    def section(self, title: str) -> Iterator[None]:
        self.done += 1
        tag = f"[bench {self.done}/{self.total}] {title}"
        print(f"{tag}: started", file=sys.stderr, flush=True)
        begun = time.perf_counter()
        yield
        now = time.perf_counter()
        print(
            f"{tag}: done in {now - begun:.1f} s ({now - self.started:.1f} s since the start)",
            file=sys.stderr,
            flush=True,
        )


# what --quick prints first (stderr) and above its tables: why its numbers do not show what the library is for
SMOKE_NOTE = (
    "bench --quick is a smoke run: it checks that every benchmark runs, on the 4-layer model with prompts of "
    "128-512 tokens and answers of 8-16, where a prefill costs little more than a few decode steps. Reuse has "
    "little to save there, so prefixkv can come out slower than stock (its decode step can cost more than "
    "DynamicCache's) and generate_batch faster than generate_many; the targets do not apply (n/a), and timings "
    "this short swing from run to run. The published tables come from the full run (python -m prefixkv bench, "
    "the ~100M model and 512-4096-token prefixes); python -m prefixkv demo --small shows reuse at work in "
    "about a minute. This run takes about 5 minutes on 2 busy cores."
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small model and sizes (a smoke run)")
    ap.add_argument("--out", type=Path, default=DOCS / "benchmarks.md")
    args = ap.parse_args(argv)
    q = args.quick
    _common.SMOKE = q
    size = "small" if q else "100m"
    if q:
        print(SMOKE_NOTE + "\n", file=sys.stderr, flush=True)
    started = time.perf_counter()
    sections = []
    progress = Progress(len(SECTIONS), started)
    with progress.section("Time to first token"):
        r = ttft.run(size, [128, 512] if q else [256, 1024, 2048], repeat=2 if q else 5)
        if not q:  # a smoke run must not replace the published figures
            plot(r, args.out.with_suffix(".png"))
        sections.append(("Time to first token", ttft.report(r)))
    with progress.section("Decode speed"):
        if q:
            r = decode.run(size, [128], [1, 8], new=16, repeat=1, shared=[(80, 4, 64)], warm=[96])
        else:  # a 4096-token batch of 8 takes minutes to prefill: measured once
            short = decode.run(size, [512], [1, 8], 128, repeat=3, warm=[512])
            one = decode.run(size, [4096], [1], 128, repeat=3)
            long = decode.run(size, [4096], [8], 128, repeat=1, shared=[(2112, 16, 2048)])
            r = {**short, "rows": short["rows"] + one["rows"] + long["rows"]}
        sections.append(("Decode speed", decode.report(r)))
    with progress.section("Memory"):
        r = memory.run(size, 256 if q else 1024, 16, 32, 8 if q else 32)
        sections.append(("Memory", memory.report(r)))
    with progress.section("Throughput"):
        r = throughput.run(
            size,
            2 if q else 4,
            4 if q else 16,
            128 if q else 512,
            8 if q else 32,
            ["plain", "deepcopy", "prefixkv", "prefixkv_batched", "generate_many", "generate_batch"],
        )
        sections.append(("Throughput", throughput.report(r)))
    with progress.section("Throughput, answers that end anywhere"):
        variants = ["prefixkv_batched", "generate_many", "generate_many_batches", "generate_batch"]
        r = throughput.run(
            size, 2 if q else 4, 4 if q else 16, 128 if q else 512, 8 if q else 64, variants, stops="varied"
        )
        sections.append(("Throughput, answers that end anywhere", throughput.report(r)))
    with progress.section("Zero-hit overhead"):
        r = zero_hit.run(size, 128 if q else 512, 8 if q else 32, repeat=2 if q else 6)
        sections.append(("Zero-hit overhead", zero_hit.report(r)))
    with progress.section("Store operations"):
        r = trie_ops.run(2_000 if q else 100_000, 100, 1536, 64, 2000, 100 if q else 500, 16)
        sections.append(("Store operations", trie_ops.report(r)))
    elapsed = time.perf_counter() - started
    command = "python benchmarks/run_all.py" + (" --quick" if q else "")
    text = [f"Machine: {machine()}. Command: `{command}` ({elapsed / 60:.1f} min).", ""]
    if q:
        text += [SMOKE_NOTE, ""]
    for title, body in sections:
        text += [f"### {title}", "", body, ""]
    print("\n".join(text))
    if not q:
        write_docs(args.out, "\n".join(text))


def write_docs(path: Path, results: str) -> None:
    """Replace the generated part of docs/benchmarks.md (between the markers), keeping the prose."""
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    page = path.read_text() if path.exists() else f"# Benchmarks\n\n{start}\n{end}\n"
    head, rest = page.split(start, 1)
    tail = rest.split(end, 1)[1]
    path.write_text(f"{head}{start}\n{results}\n{end}{tail}")


if __name__ == "__main__":
    main()
