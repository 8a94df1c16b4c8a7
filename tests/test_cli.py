"""``python -m prefixkv demo``: the workload it runs (shared system prompt, follow-up turn), the reuse it
reports against a reference computed from the token ids, outputs equal to stock generate, and the printed
table of ``demo --small`` (what CI runs; the default, ~100M-parameter demo takes about 50 s on quiet cores)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixkv.tools import cli, demo


def _reusable(prompts: list[torch.Tensor], sequences: list[torch.Tensor]) -> list[int]:
    """Tokens each call could reuse: its longest common prefix with an earlier call's prompt and answer,
    less that call's last token (generated, never fed back), and at most all but its own last token."""
    reused = []
    for i, p in enumerate(prompts):
        best = 0
        for seq in sequences[:i]:
            known = seq[0, :-1]
            n = min(len(known), p.shape[1])
            differ = (known[:n] != p[0, :n]).nonzero()
            best = max(best, int(differ[0]) if len(differ) else n)
        reused.append(min(best, p.shape[1] - 1))
    return reused


def test_demo_reuses_the_system_prompt_and_the_earlier_turn_and_matches_stock(llama64: Any) -> None:
    workload = demo.synthetic_workload(llama64.config.vocab_size, system_len=40, questions=3, new_tokens=5)
    result = demo.run(llama64, workload, block_size=4)
    prompts = [turn([c.output.sequences for c in result.ours[:i]]) for i, turn in enumerate(workload.turns)]
    sequences = [c.output.sequences for c in result.ours]
    assert [c.prompt_tokens for c in result.ours] == [p.shape[1] for p in prompts]
    # the follow-up turn is the first call's prompt and answer, then the new question
    assert torch.equal(prompts[-1][:, : sequences[0].shape[1]], sequences[0])
    reused = [c.reused for c in result.ours]
    # whatever the store's policy for a part-filled last block, it reuses all whole blocks it could
    assert all(n - 4 < r <= n for r, n in zip(reused, _reusable(prompts, sequences))), (reused, prompts)
    assert reused[0] == 0 and min(reused[1:-1]) >= 40 and reused[-1] > sequences[0].shape[1] - 1 - 4
    assert all(c.reused == 0 for c in result.stock)
    for a, b in zip(result.stock, result.ours):
        assert torch.equal(a.output.sequences, b.output.sequences)
        assert max((x - y).abs().max().item() for x, y in zip(a.output.logits, b.output.logits)) < 1e-6
        assert a.output.sequences.shape[1] - a.prompt_tokens == 5

    table = demo.report(llama64, workload, result)
    assert f"{sum(reused)} of {sum(p.shape[1] for p in prompts)}" in table
    printed = re.search(r"outputs match stock generate +- +yes \(max logit diff ([\d.e+-]+), bound 1e-06\)", table)
    assert printed is not None, table
    assert float(printed.group(1)) <= 1e-6  # float64: the difference is rounding (1e-15), not 1e-4
    assert printed.group(1) == f"{demo.max_logit_diff(result):.1e}"


def test_demo_verdict_compares_logits_not_tokens(llama64: Any) -> None:
    """Same tokens but logits off by more than the float64 bound: the demo must say NO."""
    workload = demo.synthetic_workload(llama64.config.vocab_size, system_len=12, questions=1, new_tokens=2)
    result = demo.run(llama64, workload, block_size=4)
    call = result.ours[-1]
    shifted = tuple(x + 1e-3 for x in call.output.logits)  # a shift keeps every argmax: the tokens stay the same
    output = dataclasses.replace(call, output=type(call.output)(**{**call.output, "logits": shifted}))
    bad = dataclasses.replace(result, ours=[*result.ours[:-1], output])
    table = demo.report(llama64, workload, bad)
    assert re.search(r"outputs match stock generate +- +NO \(max logit diff 1\.0e-03, bound 1e-06\)", table), table


def test_demo_small_prints_the_table_and_where_the_time_went(capsys: Any) -> None:
    assert cli.main(["demo", "--small", "--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "8 questions after one 1536-token system prompt, then a follow-up turn" in out
    assert re.search(r"time to first token, warm calls \(median\) +[\d.]+ ms +[\d.]+ ms", out)
    assert re.search(r"outputs match stock generate +- +yes \(max logit diff [\d.e+-]+, bound 1e-04\)", out)
    went = re.search(
        r"where the time went: prefill \(to the first token\) ([\d.]+) s stock -> ([\d.]+) s prefixkv, \d+ prompt "
        r"tokens not recomputed; decode ([\d.]+) s stock, ([\d.]+) s prefixkv \(reuse saves prefill only",
        out,
    )
    assert went is not None, out
    prefill_stock, prefill_ours, decode_stock, decode_ours = map(float, went.groups())
    whole = re.search(r"whole workload +([\d.]+) s +([\d.]+) s", out)
    assert whole is not None, out
    # the two parts add up to the whole, to the printed precision (0.005 s each)
    assert abs(prefill_stock + decode_stock - float(whole.group(1))) <= 0.011
    assert abs(prefill_ours + decode_ours - float(whole.group(2))) <= 0.011
    reused, total = map(int, re.search(r"prompt tokens reused .* (\d+) of (\d+)", out).groups())  # type: ignore[union-attr]
    assert reused >= 8 * 1536 and total > reused


def test_demo_says_when_prefixkv_was_slower_and_why() -> None:
    """A run where prefixkv took longer in all says so, and why, instead of printing "0.8x faster"."""
    assert demo._summary(2.0, 1.0, 3.0) == ["warm time to first token 3.0x faster, whole workload 2.0x faster"]
    (slower,) = demo._summary(2.0, 2.5, 3.0)
    assert "faster, but the whole workload took 1.25x stock's time" in slower and "decode" in slower
    assert "x faster" not in slower.split("but")[1]


# a zero-hit result whose overhead (+10%) misses the full run's target (<= 3%)
_ZERO_HIT = {"prompt": 128, "new_tokens": 8, "dynamic": 10.0, "prefixkv": 11.0}


def test_bench_quick_prints_no_verdicts(monkeypatch: Any, capsys: Any) -> None:
    """At smoke sizes the targets do not apply: ``bench --quick`` prints n/a where the full run says met/MISSED, and
    says first why its numbers can show prefixkv slower (issue 33, item 4)."""
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import _common
    import run_all
    import zero_hit

    seen: list[str] = []

    def first_section(size: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(zero_hit.report(_ZERO_HIT))
        raise KeyboardInterrupt  # the rest of the run is not needed

    monkeypatch.setattr(run_all.ttft, "run", first_section)
    monkeypatch.setattr(_common, "SMOKE", False)
    with pytest.raises(KeyboardInterrupt):
        run_all.main(["--quick"])
    assert "n/a" in seen[0] and "MISSED" not in seen[0] and "met" not in seen[0], seen[0]
    assert capsys.readouterr().err.startswith("bench --quick is a smoke run"), "the note comes before any section"
    assert "prefixkv can come out slower than stock" in run_all.SMOKE_NOTE
    monkeypatch.setattr(_common, "SMOKE", False)
    assert "MISSED" in zero_hit.report(_ZERO_HIT)  # the same numbers in a full run


def test_bench_prints_progress_as_each_benchmark_starts_and_ends(monkeypatch: Any, capsys: Any) -> None:
    """``bench`` runs for about 25 minutes and prints its tables only at the end: each benchmark says on stderr when
    it starts and when it ends, with its time and the run's (issue 33, item 5)."""
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import run_all

    for module in (
        run_all.ttft,
        run_all.decode,
        run_all.memory,
        run_all.throughput,
        run_all.zero_hit,
        run_all.trie_ops,
    ):
        monkeypatch.setattr(module, "run", lambda *args, **kwargs: {"rows": []})
        monkeypatch.setattr(module, "report", lambda result: "a table")
    run_all.main(["--quick"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[bench ")]
    total = len(run_all.SECTIONS)
    assert len(err) == 2 * total, err
    for i, title in enumerate(run_all.SECTIONS):
        assert err[2 * i] == f"[bench {i + 1}/{total}] {title}: started", err
        assert re.fullmatch(
            rf"\[bench {i + 1}/{total}\] {re.escape(title)}: done in [\d.]+ s \([\d.]+ s since the start\)",
            err[2 * i + 1],
        ), err


def test_help_answers_without_torch() -> None:
    """``python -m prefixkv --help`` parses its arguments before importing torch (it took 5 s), and its text has no
    raw reStructuredText backticks; every demo option has help."""
    code = (
        "import runpy, sys\n"
        "for argv in (['--help'], ['demo', '--help']):\n"
        "    sys.argv = ['prefixkv', *argv]\n"
        "    try:\n"
        "        runpy.run_module('prefixkv', run_name='__main__')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.rstrip().endswith("no torch"), run.stdout
    assert "``" not in run.stdout and "usage: python -m prefixkv demo" in run.stdout
    options = re.findall(
        r"^  (--[\w-]+)(?: [A-Z_]+)?\s*(.*)$", run.stdout.split("usage: python -m prefixkv demo")[1], re.M
    )
    assert {o for o, _ in options} >= {"--small", "--model", "--real", "--new-tokens", "--block-size"}, options


def test_help_names_every_subcommand(capsys: Any) -> None:
    """``python -m prefixkv --help`` names each command in its description and lists it with its help: the families
    census among them (it once said "demo and bench")."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    description = " ".join(text.split("positional arguments:")[0].split("\n")[1:])
    listed = re.findall(r"^    (\w+) {2,}\S", text, re.M)
    assert listed == ["demo", "bench", "families"], text
    assert all(name in description for name in listed), description


def test_demo_prints_a_line_per_call_as_it_runs(capsys: Any) -> None:
    assert cli.main(["demo", "--small", "--new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    lines = re.findall(r"call (\d+) of 9: stock [\d.]+ s, prefixkv [\d.]+ s \((\d+) of \d+ prompt tokens reused\)", err)
    assert [int(n) for n, _ in lines] == list(range(1, 10)), err
    assert int(lines[0][1]) == 0 and all(int(r) >= 1536 for _, r in lines[1:]), lines


def test_bench_finds_the_checkouts_benchmarks(monkeypatch: Any) -> None:
    """``prefixkv bench`` runs benchmarks/run_all.py of the source checkout it is installed from: the script it
    looks for is that one (the path counts the folders from src/prefixkv/tools/cli.py up)."""
    ran: list[str] = []
    monkeypatch.setattr(cli.runpy, "run_path", lambda path, run_name: ran.append(path))
    monkeypatch.setattr(cli.sys, "argv", ["prefixkv"])
    assert cli._bench_main(cli.argparse.Namespace(quick=True)) == 0
    assert [Path(p).resolve() for p in ran] == [Path(__file__).resolve().parent.parent / "benchmarks" / "run_all.py"]
