"""The edges of issue 25: the disk tier shared between stores, what a fingerprint and a namespace cover, in-place
weight writes, copies of a model, a failing second tier, chunked prefill, an exactly fitting budget, the display
of masked keys, and scoring at the position limit. Each test makes the call that failed and, where the failure
poisoned the store, then runs an ordinary later request and compares its logits with stock ``generate`` in
float64 on a model prefixkv never touched (a deepcopy made before the store)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import DynamicCache

import prefixkv

RUN: dict[str, Any] = dict(
    max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
)


def model64(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    return prefixkv.models.tiny_model(family, dtype=torch.float64, seed=seed, **overrides)


def stock(ref: Any, ids: torch.Tensor, **kwargs: Any) -> Any:
    """Stock generate on ``ref``, a model prefixkv never touched."""
    return ref.generate(ids, cache=DynamicCache(config=ref.config), **RUN, **kwargs)


def diff(out: Any, ref: Any) -> float:
    return max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits, strict=True))


def later_request(model: Any, ref: Any, store: prefixkv.PrefixStore, ids: torch.Tensor) -> tuple[int, float]:
    """An ordinary call that reuses what ``store`` holds for ``ids``: tokens reused, and its distance to stock."""
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        out = model.generate(ids, cache=cache, **RUN)
    return cache.stats.cached_tokens, diff(out, stock(ref, ids))


def run(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, **kwargs: Any) -> tuple[Any, int]:
    with prefixkv.PagedPrefixCache(store, ids, kwargs.pop("attention_mask", None)) as cache:
        out = model.generate(ids, cache=cache, **RUN, **kwargs)
    return out, cache.stats.cached_tokens


# -- item 9: chunked prefill over reused K/V -------------------------------------------------------------------


def test_chunked_prefill_reuses_exactly() -> None:
    model = model64()
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.arange(10, 50)[None]
    run(model, store, ids)
    longer = torch.cat([ids, torch.arange(60, 80)[None]], dim=1)
    out, reused = run(model, store, longer, prefill_chunk_size=8)  # CacheMisuseError before the fix
    assert reused == 40
    assert diff(out, stock(ref, longer, prefill_chunk_size=8)) <= 1e-6
    mask = (torch.arange(40)[None] >= torch.tensor([[5], [0]])).long()
    batch = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), ids[0, :35]]), longer[0, :40]]) * mask
    out, reused = run(model, store, batch, attention_mask=mask, prefill_chunk_size=8)  # a raw RuntimeError before
    assert reused > 0
    assert diff(out, stock(ref, batch, attention_mask=mask, prefill_chunk_size=8)) <= 1e-6
    prefixkv.enable(model, store)
    hits = store.stats.hit_tokens
    out = model.generate(longer, prefill_chunk_size=8, **RUN)  # CacheMisuseError before the fix
    assert store.stats.hit_tokens > hits
    assert diff(out, stock(ref, longer, prefill_chunk_size=8)) <= 1e-6
    prefixkv.disable(model)
    store.check_invariants()
    reused, distance = later_request(model, ref, store, longer)
    assert reused == 59 and distance <= 1e-6


# -- item 11: the display of keys of masked tokens -------------------------------------------------------------


def test_show_decodes_keys_of_masked_tokens() -> None:
    tok = prefixkv.models.tiny_tokenizer()
    model = prefixkv.models.tiny_model("llama")
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.tensor([tok("ba bebo, be kiko. ba bebo, be kiko.").input_ids])
    mask = torch.ones_like(ids)
    mask[0, 2] = 0  # a hole: the keys from there on are apart from the plain ids'
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    keys = [n.tokens for n in store.prefix_view()]
    assert any(k < 0 for edge in keys for k in edge)
    text = str(store.show(tok))  # OverflowError before the fix
    assert tok.decode(ids[0, :2]) in text
    assert "<span" in store.show(tok)._repr_html_()


# -- item 8: scoring at the position limit ---------------------------------------------------------------------


def test_rolling_loglikelihood_longer_than_max_length_is_that_of_hf() -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from prefixkv.integrations.lm_eval import PrefixKVLM

    def gpt2() -> Any:
        return model64("gpt2", max_position_embeddings=64)  # learned positions: feeding 65 tokens raises IndexError

    tok = prefixkv.models.tiny_tokenizer()
    text = " ".join(["ba bebo, be kiko."] * 20)  # far more than 64 tokens
    assert len(tok(text).input_ids) > 64
    request = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)]
    want = HFLM(pretrained=gpt2(), tokenizer=tok, batch_size=2).loglikelihood_rolling(request)
    model = gpt2()
    lm = PrefixKVLM(pretrained=model, tokenizer=tok, batch_size=2, prefix_block_size=4)
    assert lm.max_length == 64
    got = lm.loglikelihood_rolling(request)  # IndexError before the fix
    assert abs(got[0] - want[0]) < 1e-6
    lm.store.check_invariants()
    prefixkv.disable(model)


def test_score_at_the_position_limit_is_a_full_forward() -> None:
    model = model64("gpt2", max_position_embeddings=64)
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    context, continuation = torch.arange(3, 40).tolist(), torch.arange(40, 68).tolist()  # 65 tokens: 64 are fed
    (got,) = prefixkv.score(model, store, context, [continuation])  # IndexError before the fix
    with torch.no_grad():
        logits = ref(torch.tensor([context + continuation[:-1]])).logits[0, len(context) - 1 :]
    want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(continuation)[:, None]).squeeze(-1)
    assert (got.logprobs - want).abs().max().item() <= 1e-6
    (again,) = prefixkv.score(model, store, context, [continuation])  # reuses what the first call published
    assert store.stats.hit_tokens > 0
    assert (again.logprobs - want).abs().max().item() <= 1e-6
