"""Latent attention and mixed shapes (docs/architectures.md, "Latent attention and mixed shapes") against stock
``generate`` with ``DynamicCache``.

Per family, on a tiny float64 model from the census's config (:func:`prefixkv.tools.census.tiny_config`): a cold call, a
warm call reusing 45 cached tokens, beam search and a left-padded batch, each within 1e-6 in the logits. The
families: multi-head latent attention (DeepSeek V2/V3 and the models built on them: ``update`` gets a latent and a
rotary key of other sizes, one head each), MiMo (V heads narrower than K's), Gemma 4 (full-attention layers wider
than sliding ones) and Gemma 3n and 4's layers that read an earlier layer's K/V. Then: each layer's pool shaped as its
own K and V, a file saved and loaded with per-layer shapes (and one of other shapes refused), 8-bit blocks, and
the compiled step's refusal where K and V differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from conftest import cache_kw, compare, left_pad, max_logit_diff, random_tokens, stock_twin
from transformers import DynamicCache

import prefixkv
from prefixkv.attention import static
from prefixkv.base.errors import PersistError
from prefixkv.tools import census

LATENT = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu"]
MIXED = ["mimo_v2_flash", "gemma4_text", "gemma4_unified_text", "gemma3n_text"]
TOL = 1e-6
SHARED = 45  # tokens every prompt starts with; blocks of 4 -> 44 shared, 1 copied


def tiny(family: str, **overrides: Any) -> Any:
    """The census's tiny ``family`` model in float64 (experts run eagerly: grouped_mm has no float64 kernel), its
    weights seeded; ``overrides`` rebuild its config (a per-layer config is derived from them)."""
    config = census.tiny_config(family)
    if overrides:
        fields = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
        config = type(config)(**{**fields, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module", params=LATENT + MIXED)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(family: str) -> Any:
    return tiny(family)


@pytest.fixture
def store(model: Any) -> Any:
    s = prefixkv.PrefixStore(model, block_size=4)
    yield s
    s.check_invariants()
    s.close()


def _prime(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor) -> None:
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        model.generate(ids, **cache_kw(cache), max_new_tokens=1, do_sample=False, pad_token_id=0)


def test_cold_then_warm(model: Any, store: prefixkv.PrefixStore) -> None:
    system = random_tokens(SHARED, seed=1)
    first = torch.cat([system, random_tokens(6, seed=2)])[None]
    second = torch.cat([system, random_tokens(9, seed=3)])[None]
    cold = compare(model, store, first, max_new_tokens=4, do_sample=False)
    assert cold.max_diff <= TOL and cold.same_tokens
    assert cold.cache.stats.cached_tokens == 0
    warm = compare(model, store, second, max_new_tokens=4, do_sample=False)
    assert warm.max_diff <= TOL and warm.same_tokens
    assert warm.cache.stats.cached_tokens == SHARED and warm.fed_tokens == second.shape[1] - SHARED
    # a prompt of nothing cached, once the first forward proved the layers: Gemma's KV-shared layers attend only the
    # last position of a prompt to the K/V their producer layer's update returned
    other = compare(model, store, random_tokens(20, seed=7)[None], max_new_tokens=4, do_sample=False)
    assert other.max_diff <= TOL and other.same_tokens and other.cache.stats.cached_tokens == 0


def test_beam_search(model: Any, store: prefixkv.PrefixStore) -> None:
    system = random_tokens(SHARED, seed=1)
    _prime(model, store, torch.cat([system, random_tokens(6, seed=2)])[None])
    ids = torch.cat([system, random_tokens(5, seed=4)])[None]
    result = compare(model, store, ids, max_new_tokens=4, num_beams=3, do_sample=False)
    assert result.max_diff <= TOL and result.same_tokens
    assert result.cache.stats.cached_tokens == SHARED


def test_left_padded_batch(model: Any, store: prefixkv.PrefixStore) -> None:
    system = random_tokens(SHARED, seed=1)
    _prime(model, store, torch.cat([system, random_tokens(6, seed=2)])[None])
    rows = [torch.cat([system, random_tokens(4, seed=11)]), torch.cat([system, random_tokens(7, seed=12)])]
    ids, mask = left_pad(rows)
    result = compare(model, store, ids, mask, max_new_tokens=4, do_sample=False)
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [SHARED - 3, SHARED]
    assert result.max_diff <= TOL and result.same_tokens


def test_each_layer_keeps_the_shapes_it_hands_over(family: str, model: Any, store: prefixkv.PrefixStore) -> None:
    config = model.config.get_text_config(decoder=True)
    pool = store.blocks.pool
    shapes = [((k.shape[0], k.shape[3]), (v.shape[0], v.shape[3])) for k, v in zip(pool.keys, pool.values)]
    if family in LATENT:  # a latent of kv_lora_rank as "K", the rotary key as "V", one head each
        assert set(shapes) == {((1, config.kv_lora_rank), (1, config.qk_rope_head_dim))}
    elif family == "mimo_v2_flash":  # V heads narrower than K's; its sliding layer has twice the KV heads (its code)
        assert shapes == [((2, 192), (2, 16)), ((4, 192), (4, 16))]
    elif family == "gemma3n_text":  # the last 2 of 4 layers read the K/V of the 2 before them
        assert shapes == [((2, 16), (2, 16))] * 2
    elif family == "gemma4_text":  # sliding layers of head_dim, full-attention ones of global_head_dim; 2 of 4 share
        assert shapes == [((2, 16), (2, 16)), ((2, 32), (2, 32))]
    else:  # Gemma 4 unified: sliding layers of 256, full-attention ones of 512 (its defaults)
        assert [k[1] for k, _ in shapes] == [256, 512]
    expected = sum(k[0] * k[1] + v[0] * v[1] for k, v in shapes) * 8 * store.block_size
    assert store.bytes_per_block == expected
    assert prefixkv.kv_bytes_per_token(model.config, torch.float64) * store.block_size == expected  # the estimate


def test_a_file_keeps_each_layers_shapes(tmp_path: Any) -> None:
    model = tiny("gemma4_text")
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.cat([random_tokens(SHARED, seed=1), random_tokens(6, seed=2)])[None]
    _prime(model, store, ids)
    path = tmp_path / "mixed.safetensors"
    store.save(path)
    store.close()
    loaded = prefixkv.PrefixStore.load(path, model, block_size=4)
    assert [tuple(k.shape[::3]) for k in loaded.blocks.pool.keys] == [(2, 16), (2, 32)]
    second = torch.cat([random_tokens(SHARED, seed=1), random_tokens(9, seed=3)])[None]
    warm = compare(model, loaded, second, max_new_tokens=4, do_sample=False)
    assert warm.cache.stats.cached_tokens == SHARED and warm.max_diff <= TOL and warm.same_tokens
    loaded.close()
    # a model whose full-attention layers are of another size has another fingerprint, but the shapes are
    # checked first and named
    other = tiny("gemma4_text", global_head_dim=24)
    with pytest.raises(PersistError, match=r"2 layers of K/V K 2 x 16, V 2 x 16; K 2 x 32.*K 2 x 24.*another model"):
        prefixkv.PrefixStore.load(path, other, block_size=4)


def test_int8_blocks_of_latent_attention() -> None:
    """8-bit blocks of a latent and a rotary key of other sizes, each token's codes from its own values: as a
    DynamicCache that quantizes as the pool does (conftest's reference)."""
    model = tiny("deepseek_v3")
    store = prefixkv.PrefixStore(model, block_size=4, kv_dtype="int8")
    assert [(k.shape[3], v.shape[3]) for k, v in zip(store.blocks.pool.keys, store.blocks.pool.values)] == [(16, 8)] * 2
    system = random_tokens(SHARED, seed=1)
    _prime(model, store, torch.cat([system, random_tokens(6, seed=2)])[None])
    warm = compare(model, store, torch.cat([system, random_tokens(9, seed=3)])[None], max_new_tokens=4)
    assert warm.cache.stats.cached_tokens == SHARED and warm.max_diff <= TOL and warm.same_tokens
    store.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_compiled_step_refused_where_k_and_v_differ(family: str) -> None:
    model = tiny(family)
    store = prefixkv.PrefixStore(model, block_size=4)
    cache = prefixkv.PagedPrefixCache(store, compileable=True)
    assert cache.forward.refusal is not None and "K and V of other shapes" in cache.forward.refusal
    assert not cache.is_compileable
    cache.close()
    # an ordinary request after it is stock's
    ids = torch.cat([random_tokens(SHARED, seed=1), random_tokens(6, seed=2)])[None]
    after = compare(model, store, ids, max_new_tokens=4, do_sample=False)
    assert after.max_diff <= TOL and after.same_tokens
    store.close()


def test_invariant_store_of_latent_attention() -> None:
    """An invariant store reads whole rows in their canonical order: latent attention's rows as stock's."""
    model = tiny("deepseek_v3")
    store = prefixkv.PrefixStore(model, block_size=4, invariant=True)
    system = random_tokens(SHARED, seed=1)
    _prime(model, store, torch.cat([system, random_tokens(6, seed=2)])[None])
    warm = compare(model, store, torch.cat([system, random_tokens(9, seed=3)])[None], max_new_tokens=4)
    assert warm.max_diff <= TOL and warm.same_tokens
    assert warm.cache.stats.cached_tokens == SHARED // store.chunk_size * store.chunk_size > 0  # whole chunks
    store.close()


def test_towers_on_other_attention_are_switched_back() -> None:
    """Gemma 4's audio tower runs ``eager`` (it has no ``sdpa``) under a text model on ``sdpa``: a store switches the
    model to prefixkv attention and its close gives each part its own implementation back."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(census.tiny_config("gemma4"), dtype=torch.float64).eval()
    before = {
        type(m).__name__: m.config._attn_implementation
        for m in model.modules()
        if hasattr(m, "_can_set_attn_implementation")
    }
    assert before["Gemma4AudioModel"] == "eager" and before["Gemma4TextModel"] == "sdpa"
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.cat([random_tokens(SHARED, seed=1), random_tokens(6, seed=2)])[None]
    result = compare(model, store, ids, max_new_tokens=4, do_sample=False)
    assert result.max_diff <= TOL and result.same_tokens
    store.close()
    after = {
        type(m).__name__: m.config._attn_implementation
        for m in model.modules()
        if hasattr(m, "_can_set_attn_implementation")
    }
    assert after == before


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4_text"])
def test_tier_generate_many_and_score_carry_per_layer_shapes(family: str, tmp_path: Any) -> None:
    """A disk tier's blocks of per-layer shapes come back exactly after eviction; generate_many and score over them
    give stock's logits and log-probabilities."""
    model = tiny(family)
    with prefixkv.PrefixStore(model, block_size=4, num_blocks=16, offload="disk", offload_dir=tmp_path) as store:
        prompts = [random_tokens(37, seed=s)[None] for s in range(3)]  # 9 blocks each: the first is evicted
        for ids in prompts:
            assert compare(model, store, ids, max_new_tokens=4, do_sample=False).max_diff <= TOL
        assert store.stats.evictions > 0 and store.stats.offload is not None
        again = compare(model, store, prompts[0], max_new_tokens=4, do_sample=False)
        assert again.cache.stats.cached_tokens == 36 and again.max_diff <= TOL and again.same_tokens
        system = random_tokens(SHARED, seed=1)
        rows = [torch.cat([system, random_tokens(n, seed=20 + n)]) for n in (3, 6)]
        many = prefixkv.generate_many(
            model, rows, store=store, progress=False, max_new_tokens=3, do_sample=False, output_logits=True
        )
        for row, got in zip(rows, many):
            alone = model.generate(
                row[None], max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
            assert got.tokens == alone.sequences[0, len(row) :].tolist()
            assert float((got.logits - torch.cat(alone.logits).to(got.logits.dtype)).abs().max()) <= TOL
        continuation = random_tokens(5, seed=30)
        (scored,) = prefixkv.score(model, store, [system], [continuation])
        full = torch.cat([system, continuation])[None]
        logits = model(full, use_cache=False).logits.log_softmax(-1)[0, SHARED - 1 : -1]
        expected = logits.gather(-1, continuation[:, None])[:, 0]
        assert float((torch.as_tensor(scored.logprobs) - expected).abs().max()) <= TOL


@pytest.mark.parametrize("family", ["gemma4_text", "gemma3n_text"])
def test_steps_of_layers_of_two_sizes_and_shared_layers(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled step (run eagerly: its tensors, as in tests/test_compiled.py) writes and reads each layer's pool
    at that layer's own size, and a KV-shared layer attends its producer's rows: stock's tokens and logits, cold, then
    warm in a left-padded batch."""
    model = tiny(family)
    steps: list[int] = []
    update = static.StaticStep.update
    monkeypatch.setattr(static.StaticStep, "update", lambda self, *a: steps.append(1) or update(self, *a))
    system = random_tokens(SHARED, seed=1)
    rows = [torch.cat([system, random_tokens(4, seed=11)]), torch.cat([system, random_tokens(7, seed=12)])]
    twin = stock_twin(model)
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with prefixkv.PrefixStore(model, block_size=4) as store:
        for ids, mask in [(torch.cat([system, random_tokens(6, seed=2)])[None], None), left_pad(rows)]:
            ref = twin.generate(ids, attention_mask=mask, **cache_kw(DynamicCache(config=twin.config)), **kw)
            with prefixkv.PagedPrefixCache(store, ids, mask, compileable=True) as cache:
                assert cache.is_compileable, cache.compile_reason
                out = model.generate(ids, attention_mask=mask, **cache_kw(cache), **kw)
            assert torch.equal(out.sequences, ref.sequences) and max_logit_diff(out.logits, ref.logits) <= TOL
        assert [r.cached_tokens for r in cache.stats.per_row] == [SHARED - 3, SHARED]
    assert steps
