"""``PrefixStore(attention="flex")`` end to end on a tiny float32 Llama: every generate mode (greedy, sampling,
``num_return_sequences``, beams, a padded batch, a mask with a hole, prompt lookup, a continued cache, blocks
brought back from a second tier), cold and then warm, matches stock ``generate`` with ``DynamicCache`` on a copy
of the model taken before any store (``conftest.stock_twin``) within 1e-4, with identical tokens, while a spy
counts that FlexAttention really read the pool, in prefill and in decode. The warm call after a flex cold one
checks that nothing unproven was published. Where flex cannot serve (float64, an invariant store, soft-capping,
CUDA block sizes, a mask it cannot express, a kernel that does not compile) the store falls back to the gather
and says why. A sliding window (Mistral) is read through flex too.

One model, one pool size and batches of 1 and 2 (padded to powers of two) keep the compiled kernels to a few."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import compare, left_pad, random_tokens

import prefixkv
from prefixkv import PagedPrefixCache, PrefixStore
from prefixkv.attention import flex, flex_kernel, interface, registry

TOL = 1e-4
BS = 16
BLOCKS = 24  # one pool size (every store of this file), so a batch size compiles once
SYSTEM = random_tokens(32, seed=201)  # two whole blocks every prompt shares


@pytest.fixture(scope="module")
def llama32() -> Any:
    """The model, after one call that lets prefixkv see every layer reach its attention (a model's first forward
    with a store only checks that, on whole rows): from then on every call reads the pool in place."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float32)
    with PrefixStore(model, block_size=BS, num_blocks=BLOCKS, attention="flex") as store:
        ids = random_tokens(5, seed=200)[None]
        model.generate(ids, cache=PagedPrefixCache(store, ids), max_new_tokens=2, do_sample=False)
    assert interface.verified(model)
    return model


class Spy:
    """Counts the prefill and decode calls of :func:`prefixkv.flex.attend` (FlexAttention reading the pool)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.prefill = self.decode = 0
        real = flex.attend

        def counted(reads: flex.FlexPlan, *args: Any, **kwargs: Any) -> torch.Tensor:
            if reads.new_mask is None:
                self.decode += 1
            else:
                self.prefill += 1
            return real(reads, *args, **kwargs)

        monkeypatch.setattr(flex, "attend", counted)

    def reset(self) -> None:
        self.prefill = self.decode = 0


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    return Spy(monkeypatch)


@pytest.fixture
def store(llama32: Any) -> Iterator[PrefixStore]:
    s = PrefixStore(llama32, block_size=BS, num_blocks=BLOCKS, attention="flex")
    assert s.attention == "flex" and s.attention_backend.startswith("flex: ")
    yield s
    s.check_invariants()
    s.close()


def _prompt(seed: int, n: int = 6) -> torch.Tensor:
    return torch.cat([SYSTEM, random_tokens(n, seed=seed)])[None]


def _exact(result: Any) -> None:
    assert result.same_tokens, (result.out.sequences, result.ref.sequences)
    assert result.max_diff < TOL, result.max_diff


MODES: dict[str, dict[str, Any]] = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.8),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2),
    "beams": dict(do_sample=False, num_beams=2),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_generate_modes_cold_then_warm_match_stock(llama32: Any, store: PrefixStore, spy: Spy, mode: str) -> None:
    kwargs = MODES[mode]
    cold = compare(llama32, store, _prompt(seed=1), seed=3, **kwargs)
    _exact(cold)
    assert spy.prefill and spy.decode, (spy.prefill, spy.decode)
    spy.reset()
    # a new question under the cached system prompt: reuses what the cold call published
    warm = compare(llama32, store, _prompt(seed=2), seed=4, **kwargs)
    _exact(warm)
    assert warm.cache.stats.cached_tokens == len(SYSTEM)
    assert spy.prefill and spy.decode


@pytest.mark.parametrize("extra", ["assistant_model", "embeddings"])
def test_an_assistant_model_and_embeddings_match_stock(llama32: Any, store: PrefixStore, spy: Spy, extra: str) -> None:
    """Assisted decoding with a draft model of its own (its candidates verified through the flex reads), and a
    call that also returns the hidden states, cold then warm."""
    kwargs: dict[str, Any] = (
        {"assistant_model": prefixkv.models.tiny_model("llama", dtype=torch.float32, seed=7), "do_sample": False}
        if extra == "assistant_model"
        else {"output_hidden_states": True, "do_sample": False}
    )
    for seed in (5, 6):
        result = compare(llama32, store, _prompt(seed=seed), **kwargs)
        _exact(result)
        assert spy.prefill and spy.decode, (spy.prefill, spy.decode)
        spy.reset()
    assert result.cache.stats.cached_tokens >= len(SYSTEM)


def test_padded_batch_and_a_mask_with_a_hole(llama32: Any, store: PrefixStore, spy: Spy) -> None:
    _exact(compare(llama32, store, _prompt(seed=5, n=10)))  # caches SYSTEM and the first question
    ids, mask = left_pad([_prompt(seed=5, n=10)[0], _prompt(seed=6, n=3)[0]])
    padded = compare(llama32, store, ids, mask, do_sample=False)
    _exact(padded)
    assert [r.cached_tokens for r in padded.cache.stats.per_row] == [39, 32]
    holed = torch.ones_like(ids)
    holed[:, -4] = 0  # a token the mask hides: its K/V differ, so what follows is keyed apart
    spy.reset()
    _exact(compare(llama32, store, ids, holed, do_sample=False))
    assert spy.prefill and spy.decode
    _exact(compare(llama32, store, ids, holed, do_sample=False))  # warm over what the holed call published


def test_a_cache_continued_by_a_second_call(llama32: Any, store: PrefixStore, spy: Spy) -> None:
    ids = _prompt(seed=7)
    with PagedPrefixCache(store, ids) as cache:
        first = llama32.generate(ids, cache=cache, max_new_tokens=5, do_sample=False)
        follow_up = torch.cat([first, random_tokens(4, seed=8)[None]], dim=1)
        second = llama32.generate(
            follow_up, cache=cache, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert spy.prefill and spy.decode
    # the whole conversation from scratch: stock, and flex warm over what both calls published
    result = compare(llama32, store, follow_up, do_sample=False, max_new_tokens=5)
    _exact(result)
    assert result.cache.stats.cached_tokens == follow_up.shape[1] - 1
    assert torch.equal(second.sequences, result.ref.sequences)
    ref_logits = torch.stack(result.ref.logits)
    assert (torch.stack(second.logits) - ref_logits).abs().max() < TOL


def test_blocks_brought_back_from_a_second_tier(llama32: Any, spy: Spy) -> None:
    store = PrefixStore(llama32, block_size=BS, num_blocks=BLOCKS, attention="flex", offload="cpu")
    try:
        _exact(compare(llama32, store, _prompt(seed=9)))
        with store.blocks.lock:
            store.blocks.room.ensure_free(BLOCKS)
        assert store.stats.blocks_used == 0 and store.stats.offload is not None and store.stats.offload.blocks
        spy.reset()
        warm = compare(llama32, store, _prompt(seed=10))
        _exact(warm)
        assert warm.cache.stats.cached_tokens == len(SYSTEM) and store.stats.offload.restored
        assert spy.prefill and spy.decode
    finally:
        store.close()


@pytest.mark.parametrize("window_known", [True, False])
def test_a_sliding_window_is_read_through_flex(spy: Spy, monkeypatch: pytest.MonkeyPatch, window_known: bool) -> None:
    # Mistral's window of 24 tokens hides the oldest columns of these 44-token prompts in prefill and decode.
    # A plan made without the window implies another mask than the model's in prefill: the gather serves those
    # calls, with a warning, and decode (where the pads-and-holes visibility alone expresses the window) stays on flex
    model = prefixkv.models.tiny_model("mistral", dtype=torch.float32)
    assert model.config.sliding_window == 24
    if not window_known:
        monkeypatch.setattr(flex, "_window", lambda call: None)
    store = PrefixStore(model, block_size=BS, num_blocks=BLOCKS, attention="flex")
    try:
        _exact(compare(model, store, _prompt(seed=16, n=12)))  # the first forward only checks the layers (probe)
        spy.reset()
        for seed in (17, 18):  # the cold tail after the cached system prompt, twice
            if window_known:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)  # no call falls back
                    _exact(compare(model, store, _prompt(seed=seed, n=12)))
            else:
                with pytest.warns(UserWarning, match="mask is not padding, holes, causal or a sliding window"):
                    _exact(compare(model, store, _prompt(seed=seed, n=12)))
        assert spy.decode and bool(spy.prefill) == window_known
    finally:
        store.close()


# -- where flex cannot serve: the gather, and the reason ---------------------------------------------------------


def test_float64_falls_back_to_the_gather_with_the_reason(spy: Spy) -> None:
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"attention='flex'\) falls back to the gather: float64: FlexAttention"):
        store = PrefixStore(model, block_size=BS, attention="flex")
    try:
        assert store.attention_backend.startswith("gather: float64")
        for seed in (11, 12):  # cold, then warm
            result = compare(model, store, _prompt(seed=seed), do_sample=False)
            assert result.same_tokens and result.max_diff < 1e-6
        assert spy.prefill == spy.decode == 0
    finally:
        store.close()


def test_an_invariant_store_reads_whole_rows(llama32: Any, spy: Spy) -> None:
    with pytest.warns(UserWarning, match="an invariant store reads each row whole"):
        store = PrefixStore(llama32, block_size=BS, attention="flex", invariant=True)
    try:
        _exact(compare(llama32, store, _prompt(seed=13), do_sample=False))
        assert spy.prefill == spy.decode == 0
    finally:
        store.close()


def test_an_unknown_backend_is_refused(llama32: Any) -> None:
    with pytest.raises(ValueError, match="attention backend must be one of 'auto', 'blocks', 'flex', 'gather'"):
        PrefixStore(llama32, attention="flash")


@pytest.mark.parametrize(
    "device, block_size, softcap, reason",
    [
        ("cpu", 16, 50.0, "gather: soft-capping (50.0)"),
        ("cuda", 8, None, "gather: block size 8: FlexAttention's CUDA kernel needs a power of two >= 16"),
        ("cuda", 48, None, "gather: block size 48"),
        ("cuda", 64, None, "flex: "),
    ],
)
def test_flex_is_chosen_only_where_it_serves(device: str, block_size: int, softcap: float | None, reason: str) -> None:
    backend, why = registry.choose_backend(
        "flex", torch.device(device), torch.float32, model_dtype=torch.float32, block_size=block_size, softcap=softcap
    )
    assert why.startswith(reason) and backend.name == reason.split(":")[0]


def test_auto_keeps_the_gather_on_cuda_and_the_blocks_on_the_cpu() -> None:
    for device, expected in (("cuda", "gather"), ("cpu", "blocks")):
        backend, _ = registry.choose_backend("auto", torch.device(device), torch.float32, model_dtype=torch.float32)
        assert backend.name == expected


def test_a_kernel_that_does_not_compile_falls_back_with_a_warning(
    llama32: Any, store: PrefixStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise torch._dynamo.exc.BackendCompilerFailed(broken, RuntimeError("no C++ compiler"), None)

    monkeypatch.setattr(flex_kernel, "_compiled", broken)
    monkeypatch.setattr(flex_kernel, "_failed", {})  # what this test records is forgotten after it
    with pytest.warns(UserWarning, match="attention='flex' reads whole rows .*did not compile on cpu"):
        cold = compare(llama32, store, _prompt(seed=14), do_sample=False)
    _exact(cold)
    assert not flex.can_serve("cpu", torch.float32, BS)[0]
    _exact(compare(llama32, store, _prompt(seed=15), do_sample=False))  # warm, on the gather from the start
