"""A quick smoke run of every benchmark on the tiny model (benchmarks are not timed tests): each runs,
prints its table, and the properties that do not depend on timing hold."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import DynamicCache

import prefixkv
from prefixkv import kv_bytes_per_token
from prefixkv.base.memory import format_bytes
from prefixkv.models import tiny_model

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import compiled
import decode
import gpu_check
import hybrid
import memory
import quant
import store_ops
import throughput
import tiers
import trie_ops
import ttft
import zero_hit


def _cells(report: str) -> list[list[str]]:
    """The bodies of the Markdown tables in ``report``, row by row, cell by cell (header and rule rows left out)."""
    rows = [line.strip() for line in report.splitlines() if line.strip().startswith("|")]
    body = [
        r
        for i, r in enumerate(rows)
        if not set(r) <= set("|-: ") and not (i + 1 < len(rows) and set(rows[i + 1]) <= set("|-: "))
    ]
    return [[c.strip() for c in line.strip("|").split("|")] for line in body]


def test_ttft_smoke() -> None:
    r = ttft.run("tiny", [48], repeat=1)
    row = r["rows"][0]
    assert all(row[k] > 0 for k in ("none", "deepcopy", "prefixkv", "bare", "lookup")), row
    assert row["lookup"] < row["prefixkv"]  # the lookup is a small part of a warm call
    times, ratios = _cells(ttft.report(r))  # milliseconds, then the ratios computed from them
    assert times == ["48", *(f"{row[k]:.1f}" for k in ("none", "deepcopy", "prefixkv", "bare"))]
    assert ratios[:4] == ["48", f"{row['none'] / row['deepcopy']:.1f}x", f"{row['none'] / row['prefixkv']:.1f}x", "2x"]
    assert ratios[4].startswith(f"{row['prefixkv'] / row['bare']:.2f} (")


def test_hybrid_smoke() -> None:
    """Both models timed and their hit rates measured on one stream; prefixkv's reuse on the attention model is
    token-granular (all that any earlier prompt shares), which the block grid of 528 tokens never reaches here; the
    hybrid reuses the whole prefix of the timed calls."""
    r = hybrid.run(True, 48, 1, 6, 4, 20, 60, 528)
    s = r["stream"]
    assert s["prompt_tokens"] == sum(len(p) for p in hybrid.stream(512, 6, 4, 20, 60))
    assert r["attention"]["hits"]["cached"] == s["token_granular"] > s["block_grid"] == 0
    assert r["attention"]["ttft"]["reused"] == 48 and r["attention"]["ttft"]["prefixkv"] > 0
    # the hybrid resumes only where a state snapshot was taken (where an earlier prompt parted or ended): some of it
    assert r["hybrid"]["hits"]["refused"] is None and 0 < r["hybrid"]["hits"]["cached"] <= s["token_granular"]
    assert r["hybrid"]["ttft"]["reused"] == 48
    times, hits = _cells(hybrid.report(r))[:2], _cells(hybrid.report(r))[2:]
    assert [row[0].split(",")[0] for row in times] == ["hybrid (Qwen3-Next-shaped)", "attention (Llama-shaped)"]
    assert hits[1][1] == f"{100 * s['token_granular'] / s['prompt_tokens']:.1f}%" == hits[2][1]


def test_hybrid_reachable_counts_the_block_grid() -> None:
    """A prompt sharing 600 tokens with an earlier one: 600 reachable token by token, 528 on a grid of 528; one
    sharing all of an earlier prompt but its last token: all but its own last token, never all of it."""
    doc = torch.arange(3, 1203)
    first, second = torch.cat([doc[:600], torch.tensor([1])]), torch.cat([doc[:1100], torch.tensor([2])])
    assert hybrid.reachable([first, second]) == [0, 600]
    assert hybrid.reachable([first, second], 528) == [0, 528]
    assert hybrid.reachable([second, doc[:1100]]) == [0, 1099]
    assert hybrid.reachable([second, doc[:1100]], 528) == [0, 1056]


def test_hybrid_parting_smoke() -> None:
    """Issue 56's measures at hidden size 64: B resumes at the grid position before S, C at S, the attention model's
    B at S; the trace's hybrid reuses at most the ceiling, the grids computed from the same prompts; every miss has
    the right reason; the budget's drops are counted."""
    r = hybrid.run_parting("tiny", 1, [0.5], per_document=3)
    for row, attention in zip(r["abc"], r["abc_attention"]):
        s = row["shared"]
        assert row["reused"]["B"] == s - s % 64 and row["reused"]["C"] == s and attention["B"] == s
    t = r["trace"]
    assert t["attention"]["hit_tokens"] == t["ceiling"] >= t["hybrid"]["hit_tokens"] > 0
    assert t["ceiling"] >= t["grid_256"] >= t["grid_528"]
    assert t["grid_256_states"] > 0 and t["grid_528_states"] >= 0  # a 256-grid state in every prompt over 256 tokens
    for h in (t["hybrid"], *t["budgets"].values()):
        assert h["reasons_right"] == h["misses"]
    assert t["budgets"]["0.5"]["dropped_budget"] > 0
    # each turn resumes where the last call ended: before the answer (40 tokens) and the new user turn (30)
    assert [c["reused"] for c in r["chat"]][1:] == [c["prompt"] - 70 for c in r["chat"]][1:]
    assert "B reuses (hybrid)" in hybrid.report_parting(r)


def test_compiled_smoke() -> None:
    """The compiled-decoding benchmark at smoke size, compiled by dynamo alone (inductor takes minutes here)."""
    r = compiled.run("tiny", [1], prefix=24, new=4, repeat=1, backend="eager")
    assert set(r["rows"][0]["ms"]) == {"pkv_compiled", "pkv_eager", "static", "dynamic"}
    graphs, breaks = r["rows"][0]["compiled_first_call"]["pkv_compiled"]
    assert graphs >= 1 and breaks == 0  # the first call compiles its steps, with no graph break
    assert r["rows"][0]["compiled_per_warm_call"]["pkv_compiled"] == (0, 0)  # warm: nothing compiled
    assert "StaticCache compiled" in compiled.report(r)


def test_decode_smoke() -> None:
    r = decode.run("tiny", [24], [1, 2], new=4, repeat=1, shared=[(40, 3, 32)], warm=[40])
    assert [(row["shared"], row["warm"]) for row in r["rows"]] == [(0, False), (0, False), (32, False), (0, True)]
    assert all(row["prefixkv"] > 0 for row in r["rows"])
    assert r["rows"][-1]["reused"] == 40 - 7  # the warm turn reused all of the earlier request's prompt
    assert "StaticCache" in decode.report(r) and "warm turn" in decode.report(r)


def test_decode_host_smoke_at_another_depth() -> None:
    """``--host-sizes tiny-3``: the 2-layer model's shape with 3 layers, every cache of the host table timed."""
    r = decode.host_overhead(["tiny-3"], [1], prompt=24, new=4, repeat=1)
    assert decode.model_for("tiny-3").config.num_hidden_layers == 3
    assert [row["size"] for row in r["rows"]] == ["tiny-3"]
    assert all(r["rows"][0][name] > 0 for name in decode.HOST_VARIANTS)
    assert "tiny-3" in decode.host_report(r)


def test_memory_smoke_shares_the_prefix() -> None:
    r = memory.run("tiny", 64, 4, 8, 4)
    # four requests over one 64-token prefix: shared blocks hold far less than four deep copies
    assert r["prefixkv_blocks"] < 0.5 * r["deepcopy"]
    assert r["prefixkv_blocks"] <= 1.5 * r["ideal"]
    assert "ideal shared layout" in memory.report(r)


@pytest.mark.parametrize("stops", ["none", "varied"])
def test_throughput_smoke_gives_the_same_tokens_everywhere(stops: str) -> None:
    """Every variant, with answers of one length and answers that end anywhere (where generate_many refills its
    batches): the same tokens as the plain loop."""
    every = ["plain", "deepcopy", "prefixkv", "prefixkv_batched", "generate_many", "generate_many_batches"]
    r = throughput.run("tiny", 2, 3, 40, 12, [*every, "generate_batch"], stops=stops)
    assert all(r["same_as_plain"].values()), r["same_as_plain"]
    if stops == "varied":
        assert r["answer_tokens"]["min"] < r["answer_tokens"]["max"]  # the answers do end apart
    assert "requests/s" in throughput.report(r)


def test_throughput_without_plain_still_compares_with_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left out of ``--variants``, the plain loop still runs (untimed) as the reference: a variant that gives
    other tokens is reported as such, not compared with itself."""
    r = throughput.run("tiny", 1, 2, 40, 4, ["deepcopy"])
    assert set(r["seconds"]) == set(r["same_as_plain"]) == {"deepcopy"} and r["same_as_plain"]["deepcopy"]
    original = throughput.copy.deepcopy

    def wrong_cache(x: Any, *memo: Any) -> Any:  # the recipe's copied caches hold noise for V
        copied = original(x, *memo)
        if isinstance(copied, DynamicCache):
            for layer in copied.layers:
                layer.values.copy_(torch.randn(layer.values.shape, generator=torch.Generator().manual_seed(0)) * 100)
        return copied

    monkeypatch.setattr(throughput.copy, "deepcopy", wrong_cache)
    assert throughput.run("tiny", 1, 2, 40, 4, ["deepcopy"])["same_as_plain"] == {"deepcopy": False}


def test_zero_hit_smoke_never_hits() -> None:
    r = zero_hit.run("tiny", 32, 4, repeat=1)
    assert r["hit_tokens"] == 0
    assert "overhead" in zero_hit.report(r)


@pytest.mark.parametrize("sequences", [300])
def test_trie_ops_smoke(sequences: int) -> None:
    r = trie_ops.run(sequences, 10, 64, 16, 100, 20, 16)
    assert r["nodes"] >= 10 and r["median_ms"] > 0
    assert "sequences" in trie_ops.report(r)


def test_store_ops_smoke_times_every_operation() -> None:
    """Every operation it times is a method that runs (a renamed one fails here, not in a later full run)."""
    r = store_ops.run(requests=12, prefixes=3, num_blocks=16)
    assert r["evictions"] > 0 and 0 < r["hit_rate"] < 1
    assert all(us > 0 for us in r["us_per_request"].values()), r["us_per_request"]
    assert [row[0] for row in _cells(store_ops.report(r))][: len(store_ops.OPERATIONS)] == list(store_ops.OPERATIONS)
    s = store_ops.sequence(64)
    assert s["tokens"] == 64 and s["publish_ms_per_sequence"] > 0 and s["begin_us_per_step"] > 0


def test_quant_smoke_counts_the_scales_in_the_memory() -> None:
    r = quant.run("tiny", 2, 3, ["int8"], real=False)
    int8 = next(row for row in r["memory"] if row["kind"] == "int8")
    head_dim = 16  # the tiny model's: one byte per channel plus a 2-byte scale per token and head
    assert int8["vs_fp32"] == pytest.approx((head_dim + 2) / (4 * head_dim))
    assert int8["vs_bf16"] == pytest.approx((head_dim + 2) / (2 * head_dim))
    assert r["fidelity"][0]["max_diff"] > 0 and "identical greedy tokens" in quant.report(r)


def test_quant_memory_targets_hold_at_the_head_size_of_real_models() -> None:
    # the targets (<= 0.27 of fp32, <= 0.53 of bf16) are for head_dim 64, that of the benchmark model
    # and SmolLM2; a 2-layer model with that head size has the same bytes per token and head
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    rows = {row["kind"]: row for row in quant.memory_rows(model, "head_dim 64")}
    for kind in ("int8", "fp8"):
        assert rows[kind]["vs_fp32"] <= 0.27 and rows[kind]["vs_bf16"] <= 0.53


def test_tiers_smoke_brings_the_prefix_back() -> None:
    r = tiers.run("tiny", [48], repeat=1)  # measure() asserts each timed call reused the whole prefix
    row = r["rows"][0]
    assert all(row[k] > 0 for k in ("none", "pool", "cpu", "disk", "restore_cpu", "restore_disk")), row
    config = tiny_model("llama", vocab_size=512).config  # the benchmarks' "tiny" model, float32
    assert row["bytes"] == 48 * kv_bytes_per_token(config, torch.float32)  # the prefix's 3 blocks of 16 tokens
    (shown,) = _cells(tiers.report(r))
    assert shown[0] == "48" and shown[1] == format_bytes(row["bytes"])
    assert shown[4] == f"{row['cpu']:.1f} ({row['restore_cpu']:.1f})"
    assert shown[6:8] == [f"{row['none'] / row['pool']:.1f}x", f"{row['none'] / row['cpu']:.1f}x"]
    assert shown[8].startswith(f"{row['none'] / row['disk']:.1f}x (")


def test_lm_eval_smoke_gives_the_answers_of_hf() -> None:
    pytest.importorskip("lm_eval")
    import lm_eval_bench

    r = lm_eval_bench.run("tiny", docs=3, shots=2, batch_sizes=[1, 2])
    assert len(r["rows"]) == 4 and all(row["same_answers"] for row in r["rows"]), r["rows"]
    assert all(row["hit_rate"] > 0.5 for row in r["rows"]), r["rows"]
    assert "hf-prefixkv s" in lm_eval_bench.report(r)


def test_gpu_check_cpu_smoke_runs_every_measurement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gpu_check.py --device cpu --quick``: every section's table, none failed, the kernel exact in float32."""
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = out.read_text()
    assert "FAILED" not in report
    for _, title, header, _ in gpu_check.SECTIONS:  # every section printed its table, with rows
        assert f"## {title}" in report
        body = report.split(f"## {title}")[1].split("\n## ")[0]
        assert header[0] in body and len(_cells(body)) >= 1, body
    kernel = _cells(report.split("## ")[1])
    assert {row[2] for row in kernel} == {"decode", "prefill (merged)"} and all(row[-1] == "met" for row in kernel)
    assert all(float(row[3]) <= 1e-4 for row in kernel)  # float32 against the float64 reference
    attention = next(title for key, title, *_ in gpu_check.SECTIONS if key == "attention")
    timed = _cells(report.split(f"## {attention}")[1].split("\n## ")[0])  # what was timed computed the gather's
    assert timed and all(float(row[-1]) <= 1e-4 for row in timed)
    assert report.splitlines()[-1] in capsys.readouterr().out  # printed as well as written


def test_gpu_check_quick_corridor_on_the_cpu(tmp_path: Path) -> None:
    """``gpu_check.py --device cpu --quick --sections corridor`` (what a lent GPU runs, issue 54): the hybrid model and
    the compiled default give the tokens they are compared with, the pool kept its addresses across the compiled
    calls, every path timed; the quick suite runs it, so the script is known to run before a GPU is lent."""
    out = tmp_path / "corridor.md"
    assert gpu_check.main(["--device", "cpu", "--quick", "--sections", "corridor", "--out", str(out)]) == 0
    rows = _cells(out.read_text())
    compared = [row for row in rows if row[4] != "-"]
    assert [row[:2] for row in compared] == [["hybrid", "cold"], ["hybrid", "warm"], ["compiled default", "cold"],
                                             ["compiled default", "warm"]]  # fmt: skip
    assert all(row[5] == "True" and float(row[4]) <= 1e-4 for row in compared)
    assert all(row[6].startswith("kept") for row in compared if row[0] == "compiled default")
    timed = {row[1]: float(row[2]) for row in rows if row[2] != "-"}
    assert set(timed) == {"eager decode", "dynamic", "prefixkv eager", "static compiled", "prefixkv compiled"}
    assert all(ms > 0 for ms in timed.values())


def test_gpu_check_on_a_budget_writes_each_section_and_skips_what_would_start_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--budget``: a section that would start in the budget's last quarter is skipped and reported so; the tables
    so far are written after every section (a run cut short keeps them). A clock the sections move stands in."""
    out, now = tmp_path / "gpu.md", [0.0]
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def section(seconds: float, before: str | None) -> Any:
        def run(device: str, sizes: Any) -> list[list[Any]]:
            if before is not None:  # the sections that ended are on disk already
                assert f"## {before}" in out.read_text()
            now[0] += seconds
            return [[seconds]]

        return run

    titles = {key: title for key, title, *_ in gpu_check.SECTIONS}
    timings = {"kernel": section(100, None), "generate exactness": section(700, titles["kernel"])}
    monkeypatch.setattr(gpu_check, "SECTIONS", [(k, t, ["s"], timings.get(k, section(1, None)))
                                                for k, t, *_ in gpu_check.SECTIONS])  # fmt: skip
    argv = ["--device", "cpu", "--quick", "--budget", "1000", "--out", str(out)]
    assert gpu_check.main([*argv, "--sections", "kernel", "generate exactness", "corridor", "ttft"]) == 0
    report = out.read_text()
    assert all(f"## {titles[k]}" in report for k in ("kernel", "generate exactness", "corridor", "ttft"))
    assert report.count("skipped: 800 s of the 1000 s budget had passed") == 2  # the corridor and ttft
    assert report.splitlines()[-1].endswith("skipped for the budget: corridor, ttft")


def test_gpu_check_times_the_other_reads_where_flex_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 3 where FlexAttention does not compile: the row says so, and the gather, ``DynamicCache``,
    ``StaticCache`` and the plan are timed all the same."""

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise gpu_check.flex.FlexUnavailable("FlexAttention did not compile on cpu for torch.float32: (test)")

    monkeypatch.setattr(gpu_check.flex, "attend", unavailable)
    rows = gpu_check.attention_step("cpu", gpu_check.SMOKE)
    assert rows and all(str(row[5]).startswith("unavailable: FlexAttention did not compile") for row in rows)
    assert all(float(cell) > 0 for row in rows for cell in row[6:9])  # gather, Dynamic, Static
    assert all(float(row[11]) > 0 for row in rows)  # the plan


def test_gpu_check_compares_each_backend_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 2 reads each backend as it is (``disable_compile``): on CUDA ``generate`` would otherwise compile the
    default cache's decode steps, which read whole rows in the graph, and compare that against eager stock."""
    model = tiny_model("llama", dtype=torch.float64)
    stock = copy.deepcopy(model)
    seen: list[Any] = []
    for m in (model, stock):
        generate = m.generate
        monkeypatch.setattr(m, "generate", lambda *a, _g=generate, **k: (seen.append(k.get("disable_compile")),
                                                                         _g(*a, **k))[1])  # fmt: skip
    with prefixkv.PrefixStore(model, block_size=4) as store:
        diff, same, _, _ = gpu_check.logits_diff(model, stock, store, torch.arange(1, 9)[None], None)
    assert seen == [True, True] and same and diff <= 1e-10


def test_gpu_check_without_cuda_says_so_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("gpu_check: no CUDA device here")


def test_invariance_smoke() -> None:
    import invariance

    r = invariance.run("tiny", [40, 72], 24, [1, 2], system=48, repeat=2)
    ratios = invariance.ratios(r)
    assert list(ratios) == [
        "warm 40+32", "warm 72+32", "demo 48", "decode batch 1", "decode batch 2", "cold 72", "memory"
    ]  # fmt: skip
    assert all(v > 0 for v in ratios.values()), ratios
    memory = r["warm"][-1]["memory"]
    # the invariant store holds the 72-token prefix's whole chunk, the default one every prompt's whole blocks
    assert memory["invariant"]["blocks_used"] == 64 // 16
    assert memory["default"]["blocks_used"] > memory["invariant"]["blocks_used"]
    assert ratios["memory"] == memory["invariant"]["bytes_used"] / memory["default"]["bytes_used"] < 1
    cells = _cells(invariance.report(r))
    assert [row[0] for row in cells][:3] == [
        "warm TTFT, 40 + 32 tokens, ms",
        "warm TTFT, 72 + 32 tokens, ms",
        "warm TTFT, demo workload (48-token system prompt), ms",
    ]
    assert cells[-1][3].startswith(f"{ratios['memory']:.2f}x (")


def test_invariance_chunk_sweep_smoke() -> None:
    """The chunk-size sweep: per chunk size, both modes' cold, warm and mid-chunk warm times, and their ratios."""
    import invariance

    model = invariance.model_for("tiny")
    sweep = invariance.chunk_sweep(model, [16, 32], 2, prefix=40, inside=37)
    assert [row["chunk_size"] for row in sweep] == [16, 32]
    for row in sweep:
        assert list(row["ratios"]) == ["cold 72", "warm 40+32", "warm 37+40"]
        assert all(v > 0 for v in row["ratios"].values()), row


def test_invariance_plans() -> None:
    """The forwards each schedule runs: the default store after the match's whole blocks, the unpadded chunked one
    after the cached tokens' whole chunks, the padded one in whole chunks from the match's chunk boundary."""
    import invariance

    assert invariance.plan(1000, 40) == (992, [48])
    assert invariance.plan(1000, 40, 256) == (768, [256, 16])
    assert invariance.plan(1000, 40, 256, padded=True) == (768, [256, 256])
    assert invariance.plan(1000, 40, 16, padded=True) == (992, [16, 16, 16])
    assert invariance.plan(1024, 32, 64) == invariance.plan(1024, 32) == (1024, [32])
    assert invariance.plan(1024, 32, 64, padded=True) == (1024, [64])
    assert invariance.plan(0, 1056, 64) == (0, [64] * 16 + [32])
    assert invariance.plan(0, 1056, 64, padded=True) == (0, [64] * 17)


def test_invariance_padded_smoke() -> None:
    """--padded: every schedule's forwards timed over a DynamicCache, warm and cold, and the table of their ratios."""
    import invariance

    model = invariance.model_for("tiny")
    r = invariance.padded_costs(model, [16, 32], 2, calls=((32, 8), (40, 20), (0, 40)))
    assert [(c["cached"], c["new"]) for c in r["calls"]] == [(32, 8), (40, 20), (0, 40)]
    for call in r["calls"]:
        assert list(call["ms"]) == ["default", "unpadded 16", "padded 16", "unpadded 32", "padded 32"]
        assert all(v > 0 for v in call["ms"].values()), call
    cells = _cells(invariance.padded_report(r))
    assert [row[0] for row in cells] == ["default store", "unpadded 16", "padded 16", "unpadded 32", "padded 32"]
    assert cells[2][2].endswith("x), 2 x 16 from 32") and cells[3][3].endswith("x), 1 x 32 + 8 from 0")


def test_invariance_rows_smoke() -> None:
    """--rows: per dtype, the row counts grouped by the linear layer's bits, per chunk size the fixed-shape checks
    of the linear layer and both attention kernels, and the model's end to end."""
    import invariance

    r = invariance.row_independence(invariance.model_for("tiny"), [16, 32], positions=range(40, 48), length=80)
    for dtype in ("float32", "bfloat16"):
        linear, attention = r[dtype]["linear"], r[dtype]["attention"]
        assert sorted(m for group in linear["classes"] for m in group) == sorted(invariance.ROW_COUNTS)
        assert list(linear["fixed"]) == [16, 32]
        for kernel in ("attend", "sdpa"):
            assert list(attention[kernel]["fixed"]) == [16, 32]
            assert all(0 <= f["moved"] <= f["rows"] == 8 for f in attention[kernel]["fixed"].values())
            assert 1 <= attention[kernel]["distinct"] <= attention[kernel]["calls"]
        model = r[dtype]["model"]
        assert model[16]["tried"] == []  # every block boundary is a chunk boundary
        assert model[32]["tried"] == [16, 48] and set(model[32]["moved"]) <= {16, 48}
    assert [row[0] for row in _cells(invariance.rows_report(r))] == [
        "linear, float32",
        "the store's attend, float32",
        "SDPA, boolean causal mask, float32",
        "linear, bfloat16",
        "the store's attend, bfloat16",
        "SDPA, boolean causal mask, bfloat16",
        *(f"model, {dtype}, C = {c}" for dtype in ("float32", "bfloat16") for c in (16, 32)),
    ]


def test_shared_decode_smoke() -> None:
    """``shared_decode.py``: a row per case and cache, the issue's case judged."""
    import shared_decode

    r = shared_decode.run("tiny", [2, 8], [64], new=3, repeat=1)
    assert [(row["prefix"], row["rows"]) for row in r["rows"]] == [(64, 2), (64, 8)]
    assert all(row["dynamic"] > 0 and row["prefixkv"] > 0 for row in r["rows"])
    assert "Dynamic / prefixkv" in shared_decode.report(r)
