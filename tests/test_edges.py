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
