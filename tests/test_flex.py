"""The FlexAttention backend (``prefixkv.flex``) against ``scaled_dot_product_attention`` over each row's K/V
gathered by logical column (in float64, from the same float32 values), and against ``blocks.blocks_attention``
on the same decode reads: random block layouts, rows sharing leading blocks, left padding, holes, sliding windows,
grouped-query heads, decode and prefill (merged by log-sum-exp). torch's eager FlexAttention runs the random
layouts (no compile per shape); the compiled kernel runs one shape bucket, which batches of 3 and 4 share."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.attention import blocks, flex, flex_kernel
from prefixkv.attention.blocks import BlocksForward
from prefixkv.attention.planner import Read
from prefixkv.base.slots import slot_view
from prefixkv.compat import releases

KV_HEADS, DIM, BS, NUM_BLOCKS = 2, 16, 16, 64  # the shapes of gpu_check --cpu-smoke: one compile serves both


def pools(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, NUM_BLOCKS, BS, DIM)  # head-major, as prefixkv's pool
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@st.composite
def layouts(draw: st.DrawFn, decode_only: bool = False) -> dict[str, Any]:
    batch = draw(st.integers(1, 3))
    prefill = False if decode_only else draw(st.booleans())
    q = draw(st.integers(1, 4)) if prefill else 1
    share = draw(st.integers(0, 3))  # leading physical blocks common to the sharing rows
    sharers = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    lengths = [draw(st.integers(0 if prefill else 1, 5 * BS)) for _ in range(batch)]
    return dict(
        batch=batch,
        prefill=prefill,
        q=q,
        share=share,
        sharers=sharers,
        lengths=lengths,
        pads=[draw(st.integers(0, 5)) for _ in range(batch)],
        holes=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 40))),
        group=draw(st.sampled_from([1, 2])),
        scale=draw(st.sampled_from([None, 0.3])),
        seed=draw(st.integers(0, 2**16)),
    )


def build(layout: dict[str, Any]) -> dict[str, Any]:
    """Tables (shared leading blocks, the rest scattered), visibility, positions, queries and new K/V."""
    g = torch.Generator().manual_seed(layout["seed"])
    batch, q = layout["batch"], layout["q"]
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    shared, free = order[: layout["share"]], order[layout["share"] :]
    tables = []
    for row in range(batch):
        need = -(-layout["lengths"][row] // BS)
        table = list(shared[:need]) if layout["sharers"][row] else []
        while len(table) < need:
            table.append(free.pop())
        tables.append(table + [0] * (5 - len(table)))  # ragged rows padded
    width = 5 * BS
    visible = torch.ones(batch, width, dtype=torch.bool)
    for row, pad in enumerate(layout["pads"]):
        visible[row, :pad] = False  # left padding
    if layout["holes"]:
        visible &= torch.rand(batch, width, generator=g) > 0.2
    lengths = torch.tensor(layout["lengths"])
    if layout["prefill"]:
        positions = lengths[:, None] + torch.arange(q)
        new_visible = torch.rand(batch, q, generator=g) > (0.3 if layout["holes"] else 0.0)
    else:
        positions, new_visible = lengths[:, None] - 1, None
    heads = KV_HEADS * layout["group"]
    return dict(
        tables=tables,
        lengths=lengths,
        positions=positions,
        visible=visible,
        new_visible=new_visible,
        query=torch.randn(batch, heads, q, DIM, generator=g),
        key=torch.randn(batch, KV_HEADS, q, DIM, generator=g),
        value=torch.randn(batch, KV_HEADS, q, DIM, generator=g),
    )


def reference(
    case: dict[str, Any], pool_k: torch.Tensor, pool_v: torch.Tensor, window: int | None, scale: float | None
) -> torch.Tensor:
    """SDPA in float64 over each row's held K/V by logical column (and the new ones for prefill); ``[B, q, Hq, D]``,
    zeros for a query that sees nothing."""
    rows = []
    prefill = case["new_visible"] is not None
    for row, table in enumerate(case["tables"]):
        n = int(case["lengths"][row])
        slots = torch.tensor([b * BS + i for b in table for i in range(BS)][:n], dtype=torch.long)
        k = pool_k.reshape(KV_HEADS, -1, DIM)[:, slots].double()
        v = pool_v.reshape(KV_HEADS, -1, DIM)[:, slots].double()
        p = case["positions"][row][:, None]
        cols = torch.arange(n)[None]
        seen = case["visible"][row, :n][None] & (cols <= p)
        if window is not None:
            seen &= p - cols < window
        if prefill:
            q = p.shape[0]
            k = torch.cat([k, case["key"][row].double()], 1)
            v = torch.cat([v, case["value"][row].double()], 1)
            new = torch.ones(q, q, dtype=torch.bool).tril() & case["new_visible"][row][None]
            if window is not None:
                new &= p - case["positions"][row][None] < window
            seen = torch.cat([seen, new], 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            case["query"][row : row + 1].double(), k[None], v[None], attn_mask=seen, scale=scale, enable_gqa=True
        )
        rows.append(torch.where(seen.any(-1)[None, None, :, None], out, 0.0))
    return torch.cat(rows).transpose(1, 2)


def run(case: dict[str, Any], pool_k: torch.Tensor, pool_v: torch.Tensor, window: int | None, **kw: Any) -> Any:
    prefill = case["new_visible"] is not None
    reads = flex.plan(
        case["tables"],
        case["lengths"],
        case["positions"],
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        device="cpu",
        visible=case["visible"],
        new_visible=case["new_visible"],
        window=window,
        prefill=prefill,
    )
    extra = dict(key=case["key"], value=case["value"]) if prefill else {}
    return flex.attend(reads, case["query"], pool_k, pool_v, **extra, **kw)


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_eager_flex_reads_what_sdpa_reads(layout: dict[str, Any]) -> None:
    pool_k, pool_v = pools(layout["seed"])
    case = build(layout)
    out = run(case, pool_k, pool_v, layout["window"], scale=layout["scale"], compiled=False)
    expected = reference(case, pool_k, pool_v, layout["window"], layout["scale"])
    assert out.dtype == torch.float32
    assert (out.double() - expected).abs().max().item() <= 1e-5


def blocks_reference(case: dict[str, Any], pool_k: torch.Tensor, pool_v: torch.Tensor) -> torch.Tensor:
    """``blocks.blocks_attention`` on the same decode: one read per row (its slots by logical column), the
    model's mask ``[B, 1, 1, columns]`` from the visibility."""
    batch = len(case["tables"])
    columns = int(case["lengths"].max())
    reads = []
    for row, table in enumerate(case["tables"]):
        n = int(case["lengths"][row])
        slots = torch.tensor([b * BS + i for b in table for i in range(BS)][:n], dtype=torch.long)
        reads.append(Read(rows=(row,), columns=(0,), length=n, slots=slots, offsets=torch.arange(n)))
    mask = torch.zeros(batch, 1, 1, columns, dtype=torch.bool)
    for row in range(batch):
        n = int(case["lengths"][row])
        mask[row, 0, 0, :n] = case["visible"][row, :n]
    pool = SimpleNamespace(
        keys=[pool_k], values=[pool_v], specs=[None], kv_slots=[(slot_view(pool_k), slot_view(pool_v))]
    )
    forward = BlocksForward(pool, reads, columns, None, lambda layer: (pool_k, pool_v))
    return blocks.blocks_attention(forward, 0, case["query"], case["key"], case["value"], mask, None)


DECODE_CASES = [
    dict(batch=3, prefill=False, q=1, share=2, sharers=[True, True, False], lengths=[70, 40, 9], pads=[0, 3, 1]),
    dict(batch=4, prefill=False, q=1, share=3, sharers=[True] * 4, lengths=[48, 48, 37, 80], pads=[0, 0, 5, 2]),
    dict(batch=3, prefill=False, q=1, share=0, sharers=[False] * 3, lengths=[1, 16, 17], pads=[0, 0, 0]),
]


@pytest.mark.parametrize("index", range(len(DECODE_CASES)))
def test_compiled_decode_matches_sdpa_and_the_blocks_reader(index: int) -> None:
    layout = dict(DECODE_CASES[index], holes=index == 1, window=None, group=2, scale=None, seed=index)
    pool_k, pool_v = pools(index)
    case = build(layout)
    out = run(case, pool_k, pool_v, None)
    assert (out.double() - reference(case, pool_k, pool_v, None, None)).abs().max().item() <= 1e-5
    assert (out - blocks_reference(case, pool_k, pool_v)).abs().max().item() <= 1e-5
    # batches of 3 and 4 are padded to one bucket: one compile serves every case here
    modes = (True, False, False)  # grad enabled, not inference mode, a query that needs no grad
    bucket = ("cpu", 4, 1, NUM_BLOCKS, BS, None, torch.float32, 4, KV_HEADS, DIM, False, modes)
    assert bucket in flex_kernel._buckets


def test_compiled_decode_where_a_sliding_windows_edge_falls_on_a_block_start() -> None:
    """The compiled kernel skips the mask of the blocks the plan marks full, so a block is full only when its
    first column is inside the window: with a window of 37, a query at position 69 sees columns 33-69, and the
    block starting at 32 (69 - 37) is partial. Each row's window edge falls on a block start (issue 32)."""
    window = 37
    layout = dict(
        batch=3, prefill=False, q=1, share=1, sharers=[True, True, False], lengths=[70, 54, 38], pads=[0, 0, 0],
        holes=False, window=window, group=2, scale=None, seed=7,
    )  # fmt: skip
    pool_k, pool_v = pools(7)
    case = build(layout)
    out = run(case, pool_k, pool_v, window)
    assert (out.double() - reference(case, pool_k, pool_v, window, None)).abs().max().item() <= 1e-5


def test_the_compiled_buckets_stay_few() -> None:
    before = flex.compiles()
    for index in range(2):
        layout = dict(DECODE_CASES[index], holes=False, window=None, group=2, scale=None, seed=10 + index)
        pool_k, pool_v = pools(index)
        run(build(layout), pool_k, pool_v, None)
    assert flex.compiles() - before <= 1  # 0 when the test above ran first in this process


def eager_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of torch's FlexAttention warnings from now on: ``"flex_attention_performance"`` says it ran the
    unfused eager version (materialising the scores of the whole pool). The kernel's frame starts fresh: no graphs,
    no buckets, as in a new process. What earlier tests in this worker left on it does not count (under the full
    suite's ``-n 2`` some worker's history left it running eagerly, not yet explained)."""
    import torch.nn.attention.flex_attention as torch_flex

    torch._dynamo.reset_code(flex_kernel._flex_frame.__code__)
    monkeypatch.setattr(flex_kernel, "_buckets", set())
    eager: list[str] = []
    monkeypatch.setattr(torch_flex, "_warn_once", lambda warning_id, **_: eager.append(warning_id))
    return eager


def sharing_case(lengths: list[int], seed: int) -> dict[str, Any]:
    """A decode step of ``len(lengths)`` rows that share their first block, no padding, no holes."""
    batch = len(lengths)
    layout = dict(
        DECODE_CASES[0], batch=batch, lengths=lengths, pads=[0] * batch, sharers=[True] * batch,
        holes=False, window=None, group=2, scale=None, seed=seed,
    )  # fmt: skip
    return build(layout)


def test_a_shape_past_dynamos_recompile_limit_still_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket compiles on the kernel's one frame; past ``recompile_limit`` dynamo would run the next shape
    eagerly unless the backend raises the limit."""
    eager = eager_calls(monkeypatch)
    pool_k, pool_v = pools(5)
    for lengths in ([70, 40, 9], [33]):  # buckets of 4 rows and of 1: two graphs
        case = sharing_case(lengths, seed=len(lengths))
        with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch's undo would delete the option)
            out = run(case, pool_k, pool_v, None)
        assert (out.double() - reference(case, pool_k, pool_v, None, None)).abs().max().item() <= 1e-5
    assert "flex_attention_performance" not in eager


def test_a_graph_compiled_under_no_grad_does_not_use_up_the_limit_of_a_pass_with_grad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """generate compiles under no_grad; a scoring pass with grad on the same shape fails that graph's guard and
    compiles its own, which must not be past the recompile limit."""
    eager = eager_calls(monkeypatch)
    pool_k, pool_v = pools(6)
    case = sharing_case([51, 23], seed=11)
    expected = reference(case, pool_k, pool_v, None, None)
    with torch._dynamo.config.patch(recompile_limit=1):
        for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
            with mode():
                out = run(case, pool_k, pool_v, None)
            assert (out.double() - expected).abs().max().item() <= 1e-5
    assert "flex_attention_performance" not in eager


def test_another_compile_of_flex_attention_past_its_limit_leaves_prefixkvs_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another compile of ``flex_attention`` in the process (transformers' flex models, a user's) that passes
    dynamo's recompile limit leaves that function's frame eager for good; prefixkv's kernel compiles on a frame of
    its own, so its buckets still compile (the full suite ran this file after such a compile and failed so)."""
    import torch.nn.attention.flex_attention as torch_flex

    # what dynamo does to a frame past its limit: run it eagerly from now on (said directly, as an earlier test's
    # compile of it may have left entries whose recompile reasons torch's own explainer fails to evaluate)
    torch._dynamo.eval_frame.skip_code(torch_flex.flex_attention.__code__)
    eager = eager_calls(monkeypatch)
    torch.compile(torch_flex.flex_attention, dynamic=False)(*torch.randn(3, 1, 2, 16, DIM))
    assert "flex_attention_performance" in eager  # the shared frame runs eagerly now
    eager.clear()
    pool_k, pool_v = pools(8)
    case = sharing_case([44, 61], seed=13)
    with torch.no_grad():
        out = run(case, pool_k, pool_v, None)
    assert (out.double() - reference(case, pool_k, pool_v, None, None)).abs().max().item() <= 1e-5
    assert "flex_attention_performance" not in eager


def test_a_query_that_sees_no_held_column_takes_only_the_new_ones() -> None:
    layout = dict(DECODE_CASES[0], prefill=True, q=3, holes=False, window=None, group=1, scale=None, seed=3)
    case = build(layout)
    case["visible"][0] = False  # row 0 sees none of its held columns: its held part's log-sum-exp is -inf
    pool_k, pool_v = pools(3)
    out = run(case, pool_k, pool_v, None)
    assert torch.isfinite(out).all()
    assert (out.double() - reference(case, pool_k, pool_v, None, None)).abs().max().item() <= 1e-5


def test_can_serve_gives_the_reason_it_cannot() -> None:
    assert flex.can_serve("cpu", torch.float32, 16) == (True, "FlexAttention serves it")
    ok, reason = flex.can_serve("cpu", torch.float64, 16)
    assert not ok and reason.startswith("float64:")
    ok, reason = flex.can_serve("cuda", torch.bfloat16, 24)
    assert not ok and "block size 24" in reason and "power of two" in reason
    assert flex.can_serve("cuda", torch.bfloat16, 64)[0]
    assert not flex.can_serve("cuda", torch.bfloat16, 8)[0]
    ok, reason = flex.can_serve("cpu", torch.float32, 16, softcap=50.0)
    assert not ok and "soft-capping" in reason
    assert not flex.can_serve("cpu", torch.float32, 16, custom_mask=True)[0]
    assert not flex.can_serve("cpu", torch.int8, 16)[0]
    assert not flex.can_serve("meta", torch.float32, 16)[0]


def test_a_torch_without_the_log_sum_exp_request_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch release has FlexAttention's ``AuxRequest`` is ``releases``'s to know; the backend asks it."""
    monkeypatch.setattr(releases, "flex_aux_request", lambda: None)
    ok, reason = flex.can_serve("cpu", torch.float32, 16)
    assert not ok and reason == releases.flex_refusal() and f"torch {torch.__version__}" in reason


def test_a_compile_failure_raises_and_is_then_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise torch._dynamo.exc.BackendCompilerFailed("inductor", RuntimeError("no C++ compiler"), None)

    monkeypatch.setattr(flex_kernel, "_compiled", failing)
    monkeypatch.setattr(flex_kernel, "_failed", {})
    layout = dict(DECODE_CASES[2], holes=False, window=None, group=1, scale=None, seed=0)
    pool_k, pool_v = pools(0)
    with pytest.raises(flex.FlexUnavailable, match=r"did not compile on cpu for torch\.float32 in blocks of 16"):
        run(build(layout), pool_k, pool_v, None)
    ok, reason = flex.can_serve("cpu", torch.float32, 16)
    assert not ok and "did not compile" in reason
    # only what failed is refused: another dtype, and another block size (a kernel's tiles may fit one and not another)
    assert flex.can_serve("cpu", torch.bfloat16, 16)[0] and flex.can_serve("cpu", torch.float32, 64)[0]


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_on_cuda_the_kernels_key_tiles_divide_the_pools_blocks(block_size: int) -> None:
    """inductor's CUDA kernel refuses a block mask whose key blocks its key tile (``BLOCK_N``, by default 64 or 128
    on recent GPUs) does not divide; the compiled call asks for tiles of at most the pool's block, and at least 16
    (a tensor core's least), on CUDA only (the CPU's kernel tiles by itself)."""
    options = flex_kernel._kernel_options(torch.device("cuda"), block_size)["kernel_options"]
    assert block_size % options["BLOCK_N"] == 0 and 16 <= options["BLOCK_N"] <= 64
    assert flex_kernel._kernel_options(torch.device("cpu"), block_size) == {}


def test_plan_refuses_tables_that_miss_blocks() -> None:
    with pytest.raises(ValueError, match="33 tokens, 3 blocks of 16, but the tables list only 2"):
        flex.plan([[1, 2]], [33], torch.tensor([[32]]), block_size=16, num_blocks=8, device="cpu")
