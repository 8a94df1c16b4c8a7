"""What a new user meets first: store.warm refusing text and chat messages with what to do, generate_many's progress
bar (finished rows as they finish, the reuse of this call), ``tiny_model`` building the hybrid and latent families by
name, and a model kernel's refusal of float64 reported as the model's (docs/faq.md)."""

from __future__ import annotations

import copy
import os
import traceback
from typing import ClassVar

import pytest
import torch
from conftest import compare

import prefixkv


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return prefixkv.models.tiny_model("llama")


@pytest.mark.parametrize(
    ("prompts", "says"),
    [
        (["You are the help desk."], "tokenize it first"),
        ("You are the help desk.", "tokenize it first"),
        ([{"role": "system", "content": "You are the help desk."}], "apply the chat template first"),
        ([[{"role": "system", "content": "You are the help desk."}]], "apply the chat template first"),
    ],
)
def test_warm_refuses_text_and_messages_saying_what_to_do(model: torch.nn.Module, prompts: object, says: str) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    with pytest.raises(ValueError, match=says):
        store.warm([list(range(3, 20)), *prompts] if isinstance(prompts, list) else prompts, progress=False)  # type: ignore[arg-type]
    assert store.stats.cached_tokens == 0, "a bad prompt after a good one: nothing may be computed"
    store.close()


class _Recorder:
    """A stand-in for tqdm that records what the bar shows: (event, rows counted, postfix)."""

    events: ClassVar[list[tuple[str, float, dict[str, object]]]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.n: float = 0
        self.postfix: dict[str, object] = {}

    def __enter__(self) -> _Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def refresh(self) -> None:
        _Recorder.events.append(("refresh", self.n, dict(self.postfix)))

    def set_postfix(self, **kw: object) -> None:
        self.postfix = kw
        _Recorder.events.append(("yield", self.n, dict(kw)))


def test_generate_many_bar_counts_rows_as_they_end_and_this_calls_reuse(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[*range(3, 35), 40 + i] for i in range(4)]
    store = prefixkv.PrefixStore(model, block_size=8)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    first = prefixkv.generate_many(model, prompts, store=store, progress=False, **kw)
    eos = first[0].tokens[1]  # row 0 emits it at its second step: it ends there, the others run on
    assert eos not in first[0].tokens[:1]
    monkeypatch.setattr(prefixkv.many.generation, "tqdm", _Recorder)
    _Recorder.events = []
    again = prefixkv.generate_many(model, prompts, store=store, progress=True, eos_token_id=eos, **kw)
    kinds = [kind for kind, _, _ in _Recorder.events]
    assert "refresh" in kinds and kinds.index("refresh") < kinds.index("yield"), _Recorder.events
    assert _Recorder.events[kinds.index("refresh")][1] >= 1, "a row that ended mid-call is counted before it returns"
    assert _Recorder.events[-1][2] == {"reused": sum(g.cached_tokens for g in again)}
    assert sum(g.cached_tokens for g in again) < store.stats.hit_tokens, "per call, not the store's running total"
    store.close()


def test_cache_display_says_a_fresh_cache_holds_only_the_reused_prefix(model: torch.nn.Module) -> None:
    store = prefixkv.PrefixStore(model, block_size=16)
    system = torch.arange(3, 99)
    store.warm([system], progress=False)
    with prefixkv.PagedPrefixCache(store, torch.cat([system, torch.arange(100, 110)])[None]) as cache:
        html = prefixkv.display.cache_html(cache)
    assert "1 row &#215; 96 columns held (the reused prefix of 106 prompt tokens" in html, html
    store.close()


# the hybrid and latent families a user asks tiny_model for by name, in the dtype the census checks each in
# (docs/architectures.md: float32 where a kernel of the family refuses float64)
NAMED = {
    "qwen3_next": torch.float32,
    "qwen3_5": torch.float64,
    "lfm2": torch.float64,
    "nemotron_h": torch.float32,
    "falcon_h1": torch.float64,
    "jamba": torch.float32,
    "deepseek_v3": torch.float64,
}


@pytest.mark.parametrize("family", sorted(NAMED))
def test_tiny_model_builds_hybrid_and_latent_families_by_name_exact_with_reuse(family: str) -> None:
    dtype = NAMED[family]
    bound = 1e-6 if dtype == torch.float64 else 1e-4
    model = prefixkv.models.tiny_model(family, dtype=dtype)
    assert model.config.model_type == family and next(model.parameters()).dtype == dtype
    assert sum(p.numel() for p in model.parameters()) < 5_000_000, "a tiny model"
    store = prefixkv.PrefixStore(model, block_size=4)
    system = torch.arange(3, 23)
    # the second prompt through the shared prefix takes the recurrent layers' snapshot there, the third resumes at it
    prompts = [torch.cat([system, torch.arange(30 + 10 * i, 36 + 10 * i)])[None] for i in range(3)]
    reused = []
    for ids in [*prompts, torch.arange(100, 117)[None]]:  # then an ordinary request
        result = compare(model, store, ids, max_new_tokens=4)
        assert result.same_tokens and result.max_diff <= bound, (family, result.max_diff)
        reused.append(result.cache.stats.cached_tokens)
    assert reused[0] == 0 and reused[2] == 20 and reused[3] == 0, reused
    store.close()


def test_tiny_model_names_what_it_builds_when_it_does_not_know_a_family() -> None:
    with pytest.raises(ValueError, match=r"unknown family 'qwen9'.*causal-LM model_type of transformers"):
        prefixkv.models.tiny_config("qwen9")
    assert {"qwen3_next", "lfm2", "nemotron_h", "falcon_h1", "jamba", "deepseek_v3"} <= set(
        prefixkv.models.causal_lm_families()
    )
    with pytest.raises(ValueError, match=r"blt has 193M parameters at the tiny config's sizes \(at most 20M\)"):
        prefixkv.models.tiny_model("blt")  # a config class whose defaults stay large is refused, not built


def test_a_kernel_that_refuses_float64_is_reported_as_the_models_with_the_dtype_it_needs() -> None:
    """Qwen3-Next's MoE kernel (grouped_mm) has no float64: stock generate raises inside the model, and so does the
    cache's prefill of the prompt; prefixkv says it is the model's, names the kernel and float32, and keeps the
    model's exception with only the model's frames. In float32 the same family is exact."""
    model = prefixkv.models.tiny_model("qwen3_next", dtype=torch.float64)
    twin = copy.deepcopy(model)
    ids = torch.arange(3, 20)[None]
    with pytest.raises(RuntimeError, match="got Double") as stock:
        twin.generate(ids, max_new_tokens=2, do_sample=False)
    store = prefixkv.PrefixStore(model, block_size=4)
    with pytest.raises(prefixkv.ModelCodeError) as ours:
        # two rows: the runner computes their prompts first (one row's is computed by generate's own forward)
        prefixkv.PagedPrefixCache(store, ids.repeat(2, 1))
    message = str(ours.value)
    assert "qwen3_next's own code raised RuntimeError in float64" in message, message
    assert "moe.py" in message and "dtype=torch.float32" in message and "families qwen3_next" in message, message
    cause = ours.value.__cause__
    assert type(cause) is type(stock.value) and str(cause) == str(stock.value)
    frames = [frame.filename for frame in traceback.extract_tb(cause.__traceback__)]
    assert frames and not any(f"prefixkv{os.sep}" in f for f in frames), frames
    with pytest.raises(prefixkv.ModelCodeError, match="float32"):
        store.pin(ids[0])
    store.close()
    model = prefixkv.models.tiny_model("qwen3_next", dtype=torch.float32)
    store = prefixkv.PrefixStore(model, block_size=4)
    result = compare(model, store, ids)
    assert result.same_tokens and result.max_diff <= 1e-4
    store.close()


def test_an_error_of_prefixkvs_own_code_is_not_called_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the model's own code is attributed to it: a float64 error raised under prefixkv's runner, not in the
    model's code, and an error of the model that is not a dtype refusal pass unchanged."""
    model = prefixkv.models.tiny_model("lfm2", dtype=torch.float64)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.arange(3, 20)[None]

    def not_the_model(cache: object, tokens: list[int]) -> None:
        raise RuntimeError("expected a Float32 matrix, got Double")

    monkeypatch.setattr(prefixkv.hf.runner, "_forward", not_the_model)
    with pytest.raises(RuntimeError, match="got Double") as raised:
        store.pin(ids[0])
    assert not isinstance(raised.value, prefixkv.ModelCodeError)
    monkeypatch.undo()

    def shape_error(module: object, args: object) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    handle = model.model.layers[0].register_forward_pre_hook(shape_error)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as raised:
        prefixkv.PagedPrefixCache(store, ids.repeat(2, 1))  # two rows: computed by the runner first
    assert not isinstance(raised.value, prefixkv.ModelCodeError)
    handle.remove()
    result = compare(model, store, ids)
    assert result.same_tokens and result.max_diff <= 1e-6
    store.close()
