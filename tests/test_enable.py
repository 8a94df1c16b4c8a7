"""Zero-code-change mode: ``prefixkv.enable(model)`` gives every cache-less ``generate`` call (and so
``pipeline("text-generation")``) prefix reuse with the logits of stock ``generate``; ``disable`` puts the
model back exactly as it was."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
from conftest import cache_kw, compare, max_logit_diff, random_tokens, returned_cache, spelled, stock_twin
from transformers import DynamicCache, pipeline

import prefixkv

TOL = 1e-6
SYSTEM = random_tokens(32, seed=201)


def _prompt(seed: int, n: int = 5) -> torch.Tensor:
    return torch.cat([SYSTEM, random_tokens(n, seed=seed)])[None]


@pytest.fixture
def model() -> Any:
    """A fresh model per test: enable mutates it."""
    return prefixkv.models.tiny_model("llama", dtype=torch.float64)


def _generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> Any:
    torch.manual_seed(0)
    return model.generate(
        ids, max_new_tokens=8, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs
    )


MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, top_p=0.9),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_enabled_generate_reuses_prefixes_and_matches_stock(model: Any, mode: str) -> None:
    first, second = _prompt(seed=1), _prompt(seed=2)
    refs = [
        _generate(model, ids, **cache_kw(DynamicCache(config=model.config)), **MODES[mode]) for ids in (first, second)
    ]
    store = prefixkv.enable(model, block_size=4)
    outs = [_generate(model, ids, **MODES[mode]) for ids in (first, second)]
    for out, ref in zip(outs, refs):
        assert torch.equal(out.sequences, ref.sequences)
        assert max_logit_diff(out.logits, ref.logits) <= TOL
    assert store.stats.queries == 2 and store.stats.hit_tokens == 32
    # return_dict_in_generate hands each call's cache back, open, so a follow-up call can continue from it;
    # dropping the outputs gives its blocks back, with no garbage collector needed
    assert not any(returned_cache(out).closed for out in outs)
    gc.disable()
    try:
        del outs, out
    finally:
        gc.enable()
    s = store.stats
    assert s.blocks_used == s.blocks_evictable > 0  # what the calls computed stays cached, held by no call
    store.check_invariants()
    prefixkv.disable(model)


def test_assistant_models_keep_their_own_cache(model: Any) -> None:
    assistant = prefixkv.models.tiny_model("llama", dtype=torch.float64, seed=1)
    ids = _prompt(seed=3)
    ref = _generate(
        model, ids, assistant_model=assistant, do_sample=False, **cache_kw(DynamicCache(config=model.config))
    )
    store, assistant_store = prefixkv.enable(model, block_size=4), prefixkv.enable(assistant, block_size=4)
    _generate(model, _prompt(seed=4), do_sample=False)
    out = _generate(model, ids, assistant_model=assistant, do_sample=False)
    assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out.logits, ref.logits) <= TOL
    assert store.stats.hit_tokens == 32
    assert assistant_store.stats.queries == 0  # its draft calls thread their own DynamicCache
    prefixkv.disable(assistant)
    prefixkv.disable(model)


def test_calls_that_bring_or_refuse_a_cache_are_left_alone(model: Any) -> None:
    store = prefixkv.enable(model, block_size=4)
    ids = _prompt(seed=5)
    own = DynamicCache(config=model.config)
    out = _generate(model, ids, **cache_kw(own), do_sample=False)
    assert returned_cache(out) is own and store.stats.queries == 0
    _generate(model, ids, use_cache=False, do_sample=False)
    assert store.stats.queries == 0
    paged = prefixkv.PagedPrefixCache(store, ids)
    with spelled("past_key_values"):  # enable() recognises either keyword as the caller's cache
        out = _generate(model, ids, past_key_values=paged, do_sample=False)
    assert returned_cache(out) is paged and not paged.closed  # the caller's cache stays the caller's
    assert store.stats.queries == 1  # that cache's own lookup, no second one
    paged.close()
    prefixkv.disable(model)


def test_disable_restores_the_model_exactly(model: Any) -> None:
    ids = _prompt(seed=6)
    before = (dict(vars(model)), model.config._attn_implementation, len(model._forward_pre_hooks))
    plain = _generate(model, ids, do_sample=False)
    store = prefixkv.enable(model, block_size=4)
    assert prefixkv.enable(model) is store  # enabling again (a re-run notebook cell) keeps the store
    with pytest.raises(ValueError, match="already enabled"):
        prefixkv.enable(model, block_size=8)
    assert model.config._attn_implementation == "prefixkv" and "generate" in vars(model)
    _generate(model, ids, do_sample=False)
    prefixkv.disable(model)
    assert (dict(vars(model)), model.config._attn_implementation, len(model._forward_pre_hooks)) == before
    assert model.generate.__func__ is type(model).generate
    with pytest.raises(RuntimeError, match="closed"):
        prefixkv.PagedPrefixCache(store, ids)  # the store enable built is closed with it
    again = _generate(model, ids, do_sample=False)
    assert torch.equal(again.sequences, plain.sequences) and max_logit_diff(again.logits, plain.logits) == 0
    prefixkv.disable(model)  # a second disable does nothing


def test_a_store_passed_to_enable_stays_open(model: Any) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    assert prefixkv.enable(model, store) is store
    _generate(model, _prompt(seed=7), do_sample=False)
    prefixkv.disable(model)
    assert "generate" not in vars(model)
    assert prefixkv.PagedPrefixCache(store, _prompt(seed=8)).stats.cached_tokens == 32
    with pytest.raises(ValueError, match="another model"):
        prefixkv.enable(prefixkv.models.tiny_model("llama"), store)
    with pytest.raises(TypeError, match="not both"):
        prefixkv.enable(model, store, block_size=4)
    store.close()


def test_pipeline_reuses_prefixes_across_calls(model: Any) -> None:
    tok = prefixkv.models.tiny_tokenizer()
    system = " ".join(tok.convert_ids_to_tokens(list(range(100, 140))))  # 40 words
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
        for question in ("ba be bi ?", "ko ku ka ?")
    ]
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    kw = dict(max_new_tokens=6, do_sample=False, return_full_text=False)
    stock = [pipe(chat, **kw)[0]["generated_text"] for chat in chats]
    store = prefixkv.enable(model, block_size=4)
    reused = [pipe(chat, **kw)[0]["generated_text"] for chat in chats]
    assert reused == stock and all(stock)
    # the second call shares 43 tokens with the first: the system turn (role, 40 words, EOS) and "<|user|>"
    assert store.stats.queries == 2 and store.stats.hit_tokens == 43
    prefixkv.disable(model)


def test_a_soft_prompt_call_neither_reuses_nor_publishes_the_ids_prefix(model: Any) -> None:
    ids = _prompt(seed=7)
    gen = torch.Generator().manual_seed(8)
    soft = torch.randn(1, ids.shape[1], model.config.hidden_size, dtype=torch.float64, generator=gen)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref_soft = model.generate(input_ids=ids, inputs_embeds=soft, **cache_kw(DynamicCache(config=model.config)), **kw)
    ref_ids = model.generate(input_ids=ids, **cache_kw(DynamicCache(config=model.config)), **kw)
    store = prefixkv.enable(model, block_size=4)
    for _ in range(2):  # plain after soft and soft after plain: neither may read the other's K/V
        assert max_logit_diff(model.generate(input_ids=ids, **kw).logits, ref_ids.logits) <= TOL
        soft_out = model.generate(input_ids=ids, inputs_embeds=soft, **kw)
        assert max_logit_diff(soft_out.logits, ref_soft.logits) <= TOL
    assert store.stats.hit_tokens > 0  # the plain calls still reuse each other's prefix
    store.check_invariants()
    prefixkv.disable(model)


def test_a_model_in_training_mode_generates_as_stock_seed_for_seed_and_says_why_once() -> None:
    """In training mode (dropout on) nothing is reused or published, and no forward of prefixkv's own (the
    in-batch prefill of a prefix the rows share) may draw from the random stream before generate's: the
    enabled model runs stock, with a warning once; in eval mode again it reuses, with stock's logits."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64, attention_dropout=0.3).train()
    store = prefixkv.enable(model, block_size=4)
    ids = torch.cat([_prompt(seed=5), _prompt(seed=5)])  # rows that share their whole prompt
    twin = stock_twin(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [_generate(model, ids, do_sample=True) for _ in range(2)]
    ref = _generate(twin, ids, do_sample=True)
    for out in outs:
        assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out.logits, ref.logits) == 0.0
    said = [str(w.message) for w in caught if "training mode" in str(w.message)]
    assert len(said) == 1 and "run stock" in said[0], said
    assert store.stats.queries == 0
    model.eval()
    twin.eval()
    for _ in range(2):  # an ordinary request, cold then warm: stock's logits
        out, ref = _generate(model, ids, do_sample=True), _generate(twin, ids, do_sample=True)
        assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out.logits, ref.logits) <= TOL
    assert store.stats.hit_tokens > 0
    prefixkv.disable(model)


def test_a_cache_in_training_mode_runs_no_forward_of_its_own() -> None:
    """A PagedPrefixCache built on a model in training mode prefills no shared prefix first (its K/V could not
    be published, and its dropout would draw from the random stream): seed for seed, stock's logits."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float64, attention_dropout=0.3).train()
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.cat([_prompt(seed=6), _prompt(seed=6)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the cache says of training mode
        c = compare(model, store, ids, do_sample=True)
    assert c.same_tokens and c.max_diff == 0.0, c.max_diff
    assert c.fed_tokens == ids.shape[1] and store.stats.hit_tokens == 0
