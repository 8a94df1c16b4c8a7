"""The families of issue 45 outside the hybrid, latent and mixed-shape work: each served exactly or refused with what
its cache holds that prefixkv's cannot (never "for being hybrid"), and the reason checked against the model itself.

Each family is a tiny float64 model of its own config class (``census.tiny_config``); a served one is compared with
stock ``generate`` in the logits within 1e-6, and after a refusal the model still generates as stock.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import transformers
from conftest import compare, random_tokens
from transformers import DynamicCache

import prefixkv
from prefixkv.hf import support
from prefixkv.tools import census

TOL = 1e-6
SHARED = 45


def _tiny(family: str, dtype: torch.dtype = torch.float64) -> Any:
    config = census.tiny_config(family)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _refused(model: Any) -> str:
    with pytest.raises(prefixkv.UnsupportedModelError) as refusal:
        prefixkv.PrefixStore(model)
    return str(refusal.value)


def _still_stock(model: Any) -> None:
    """After a refusal, the model generates as an untouched copy of it does."""
    ids = random_tokens(12, seed=3, vocab=200)[None]
    twin = _tiny(model.config.model_type, model.dtype)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    out, ref = model.generate(ids, **kw), twin.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


@pytest.mark.parametrize(
    ("family", "argument", "what", "dtype"),
    [
        ("rwkv", "state", "its recurrent state", torch.float64),
        ("xlnet", "mems", "its memory", torch.float32),  # its relative positions are float32
        ("reformer", "past_buckets_states", "each layer's hash buckets", torch.float64),
    ],
)
def test_a_state_argument_of_its_own_is_refused(family: str, argument: str, what: str, dtype: torch.dtype) -> None:
    model = _tiny(family, dtype)
    reason = _refused(model)
    assert reason.startswith(f"{family} carries {what}") and f"in a `{argument}` argument of its own" in reason
    forward = inspect.signature(model.forward).parameters  # what the reason says, read off the model
    assert argument in forward and "cache" not in forward and "past_key_values" not in forward
    _still_stock(model)


def test_deepseek_v4_is_refused_for_its_compressors() -> None:
    model = _tiny("deepseek_v4", torch.float32)
    reason = _refused(model)
    assert reason.startswith("deepseek_v4 has compressed-attention layers ['heavily_compressed_attention']")
    assert "one per 128 (heavily_compressed_attention) tokens" in reason
    layers = DynamicCache(config=model.config).layers  # stock's cache holds a compressor's entries, as said
    assert any(hasattr(layer, "compressed_kv") for layer in layers)


def test_dbrx_is_served_exactly() -> None:
    """DBRX's experts group a batch's tokens by expert, so in the check for attention to later tokens its first rows
    move by 4e-16 with the last token (of 0.7 at the last row): rounding, not attention; DBRX is served exactly."""
    model = _tiny("dbrx")
    store = prefixkv.PrefixStore(model, block_size=4)
    system = random_tokens(SHARED, seed=1, vocab=200)
    for n, seed in ((6, 2), (9, 3)):
        ids = torch.cat([system, random_tokens(n, seed=seed, vocab=200)])[None]
        result = compare(model, store, ids, max_new_tokens=4, do_sample=False)
        assert result.max_diff <= TOL and result.same_tokens
    assert result.cache.stats.cached_tokens == SHARED  # the second prompt reused the shared tokens


def _earlier_and_last(model: Any, alone: bool) -> tuple[float, float]:
    """How far the first 3 rows' and the last row's logits move when the last of 4 tokens changes."""
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 7]])
    with torch.no_grad():
        if alone:
            logits = torch.cat([model(input_ids=row[None], use_cache=False).logits for row in ids]).double()
        else:
            logits = model(input_ids=ids, use_cache=False).logits.double()
    moved = (logits[0] - logits[1]).abs().amax(dim=-1)
    return float(moved[:3].max()), float(moved[3])


@pytest.mark.parametrize(
    ("family", "dtype", "encoder"),
    [
        ("bert", torch.float32, True),
        ("roberta", torch.bfloat16, True),
        ("qwen3_moe", torch.float32, False),
        ("mixtral", torch.float32, False),
        ("dbrx", torch.float64, False),
    ],
)
def test_encoders_and_experts_are_told_apart(family: str, dtype: torch.dtype, encoder: bool) -> None:
    """An encoder's earlier rows move with a later token by far more than the check's share of the last row's move;
    a mixture of experts' rows move by rounding only (its tokens grouped by expert), far less, run alone or batched."""
    model = _tiny(family, dtype)
    assert support._sees_later_tokens(model) is encoder
    share = support._LATER_TOKEN_SHARE.get(dtype, support._LATER_TOKEN_SHARE[None])
    for alone in (False, True):
        earlier, last = _earlier_and_last(model, alone)
        if encoder:
            assert earlier > 10 * share * last
        else:
            assert earlier < share * last / 100
    if not encoder:
        prefixkv.PrefixStore(model).close()


def test_a_small_leak_of_later_tokens_counts_in_float64() -> None:
    """In float64 a causal model's earlier rows move with a later token by rounding only (DBRX: 4e-16 of the last
    row's move), so a leak of 1e-5 of it is attention to later tokens, which would put warm logits 1e-5 off stock,
    past the fidelity bound of 1e-6: refused. (A share of 1e-4, fit for float32's rounding, let it through.)"""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64)
    assert not support._sees_later_tokens(model)

    def leak(module: Any, args: Any, out: Any) -> Any:
        hidden = out[0] if isinstance(out, tuple) else out
        hidden = torch.cat([hidden[:, :-1] + 1e-5 * hidden[:, -1:], hidden[:, -1:]], dim=1)
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    handle = model.model.layers[0].register_forward_hook(leak)
    try:
        earlier, last = _earlier_and_last(model, alone=False)
        assert 1e-9 * last < earlier < 1e-4 * last, (earlier, last)
        assert support._sees_later_tokens(model)
    finally:
        handle.remove()
