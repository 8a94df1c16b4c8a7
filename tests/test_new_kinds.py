"""The families refused at the start of issue 53's round, tried again (docs/architectures.md, "Refused families"):
each served exactly with reuse, compared with stock generate in float64 (cold, warm, beams, a left-padded batch, then
a later ordinary request), or refused with a reason that names what was tried."""

from __future__ import annotations

from typing import Any

import conftest
import pytest
import torch
from conftest import compare, left_pad, random_tokens, stock_twin
from transformers import DynamicCache

import prefixkv
from prefixkv.hf import stepwise
from prefixkv.tools import census

TOL = 1e-6

pytestmark = pytest.mark.skipif(
    prefixkv.compat.releases.LINEAR_ATTENTION_LAYER is None,
    reason="transformers before 5 keeps recurrent state in caches of each model's own: refused (test_families)",
)


def tiny(family: str, **fields: Any) -> Any:
    """A float64 tiny model of ``family`` from the census's config, with ``fields`` set on it."""
    config = census.tiny_config(family)
    for name, value in fields.items():
        setattr(config, name, value)
    return prefixkv.models.build(config, dtype=torch.float64)


def served_with_reuse(
    model: Any, store: prefixkv.PrefixStore, cached: int, *, tol: float = TOL, beams: bool = True
) -> list[int]:
    """Cold, warm (reusing ``cached`` prompt tokens), beams and a left-padded batch, each within ``tol`` of stock,
    then a later ordinary request; the padded batch's rows' reused tokens."""
    shared = random_tokens(13, seed=1)
    cold = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 22])])[None])
    assert cold.max_diff <= tol and cold.same_tokens
    warm = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 23, 24])])[None])
    assert warm.max_diff <= tol and warm.same_tokens
    assert warm.cache.stats.cached_tokens == cached, warm.cache.stats
    if beams:
        searched = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 22])])[None], num_beams=3)
        assert searched.max_diff <= tol and searched.cache.stats.cached_tokens > 0
    ids, mask = left_pad([torch.cat([shared, torch.tensor([30])]), torch.cat([shared, torch.tensor([31, 32, 33])])])
    padded = compare(model, store, ids, mask)
    assert padded.max_diff <= tol and padded.same_tokens
    later = compare(model, store, random_tokens(9, seed=5)[None])  # an ordinary request after all of them
    assert later.max_diff <= tol and later.same_tokens
    store.check_invariants()
    return [row.cached_tokens for row in padded.cache.stats.per_row]


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_mamba_resumes_a_prefix_one_id_at_a_time(family: str) -> None:
    """Mamba's selective scan starts a forward of several ids from a zero state (1e-2 off stock when a prefix is
    resumed); its mixers step through such a forward one id at a time with a prefixkv cache, exact."""
    model = tiny(family)
    store = prefixkv.PrefixStore(model, block_size=4)
    assert store.layer_kinds == ["state", "state"]
    # the warm prompt leaves the cold one after 15 tokens: it resumes the snapshot taken at its end (the cold call's
    # last-but-one token is the junction: the cold prompt stopped there for its next turn)
    served_with_reuse(model, store, cached=15)
    store.close()


def test_mamba_mixers_step_only_for_prefixkv_caches_while_a_store_is_open() -> None:
    """Another cache gets the mixer's own forward (a DynamicCache resumed with several ids: what stock gives, not
    corrected), and closing the store puts the mixers' forwards back."""
    model = tiny("mamba")
    twin = stock_twin(model)
    ids = random_tokens(12, seed=2)[None]

    def resumed(on: Any) -> torch.Tensor:
        cache = DynamicCache(config=on.config)
        on(input_ids=ids[:, :6], cache=cache, use_cache=True)
        return on(input_ids=ids[:, 6:], cache=cache, use_cache=True).logits

    store = prefixkv.PrefixStore(model)
    assert all("forward" in vars(m) for m, _ in stepwise.mixers(model)), "the store wraps every Mamba mixer"
    assert torch.equal(resumed(model), resumed(twin))
    store.close()
    assert not any("forward" in vars(m) for m, _ in stepwise.mixers(model))


def test_recurrent_gemma_keeps_its_block_states_in_the_cache() -> None:
    """RecurrentGemma's recurrent blocks keep their conv and LRU states as attributes of their own and restart the
    conv state in a forward of several ids (2e-2 off stock when a prefix is resumed): bridged to the cache's layers,
    stepped one id at a time where they resume, exact. Stock's beams keep one batch's states in the blocks, not
    reordered with the beams (not those of generate without a cache): beams are compared with the latter."""
    model = tiny("recurrent_gemma")
    store = prefixkv.PrefixStore(model, block_size=4)
    assert store.layer_kinds == ["state", "kv"]
    served_with_reuse(model, store, cached=15, beams=False)
    prompt = torch.cat([random_tokens(13, seed=1), torch.tensor([20, 21, 22])])[None]
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=3, output_logits=True, return_dict_in_generate=True)
    recomputed = stock_twin(model).generate(prompt, use_cache=False, **kw)
    with prefixkv.PagedPrefixCache(store, prompt) as cache:
        out = model.generate(prompt, cache=cache, **kw)
    assert cache.stats.cached_tokens == 15 and torch.equal(out.sequences, recomputed.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, recomputed.logits)) <= TOL
    later = compare(model, store, random_tokens(9, seed=6)[None])
    assert later.max_diff <= TOL and later.same_tokens
    store.close()


def test_minimax_keeps_its_running_product_as_a_recurrent_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """MiniMax's lightning layers keep a running key-value product, which its forward resumes token by token: held
    as the recurrent state of transformers' cache layer, snapshotted as any other; its forward, which refuses every
    cache but a MiniMaxCache (stock raises), takes prefixkv's while a store is open. Stock generates with its own
    MiniMaxCache (it takes no DynamicCache)."""
    monkeypatch.setattr(conftest, "reference_cache", lambda model, kv_dtype: None)
    model = prefixkv.models.build(census.tiny_config("minimax"), dtype=torch.float32)  # its experts refuse float64
    ids = random_tokens(5, seed=1)[None]
    with pytest.raises(ValueError, match="cache of its own"):
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)
    store = prefixkv.PrefixStore(model, block_size=4)
    assert store.layer_kinds == ["kv", "state"]
    # stock's MiniMaxCache does not reorder its lightning layers' state for beam search (its beams are not those of
    # generate without a cache): beams are compared with generate without a cache below
    served_with_reuse(model, store, cached=15, tol=1e-4, beams=False)
    prompt = torch.cat([random_tokens(13, seed=1), torch.tensor([20, 21, 22])])[None]
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=3, output_logits=True, return_dict_in_generate=True)
    recomputed = stock_twin(model).generate(prompt, use_cache=False, **kw)
    with prefixkv.PagedPrefixCache(store, prompt) as cache:
        out = model.generate(prompt, cache=cache, **kw)
    assert cache.stats.cached_tokens == 15 and torch.equal(out.sequences, recomputed.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, recomputed.logits)) <= 1e-4
    later = compare(model, store, random_tokens(9, seed=6)[None])
    assert later.max_diff <= 1e-4 and later.same_tokens
    store.close()
    with pytest.raises(ValueError, match="cache of its own"):  # the store closed: the model as it was
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)


# the store's modes on the newly served stateful families (docs/architectures.md's kind x feature table): an invariant
# store, 8-bit attention blocks and a saved file, each against stock generate (for int8, with a cache that quantizes
# as the pool does), the second prompt reusing the shared prefix, then a later ordinary request
STATEFUL = {"mamba": torch.float64, "falcon_mamba": torch.float64, "recurrent_gemma": torch.float64}
STATEFUL["minimax"] = torch.float32  # its experts refuse float64
MODES: dict[str, dict[str, Any]] = {"invariant": {"invariant": True, "chunk_size": 4}, "int8": {"kv_dtype": "int8"}}


@pytest.mark.parametrize("mode", [*MODES, "file"])
@pytest.mark.parametrize("family", list(STATEFUL))
def test_the_newly_served_families_take_the_stores_modes(
    family: str, mode: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtype = STATEFUL[family]
    tol = TOL if dtype == torch.float64 else 1e-4
    if family == "minimax":  # stock takes its own MiniMaxCache only; its int8 blocks move the logits 1.9e-5 from it
        monkeypatch.setattr(conftest, "reference_cache", lambda model, kv_dtype: None)
    model = prefixkv.models.build(census.tiny_config(family), dtype=dtype)
    store = prefixkv.PrefixStore(model, block_size=4, **MODES.get(mode, {}))
    shared = random_tokens(13, seed=1)
    first = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 22])])[None])
    if mode == "file":
        store.save(tmp_path / "x.safetensors")
        store.close()
        store = prefixkv.PrefixStore.load(tmp_path / "x.safetensors", model)
    second = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 23, 24])])[None])
    later = compare(model, store, random_tokens(9, seed=7)[None])
    # the invariant store resumes at its last whole chunk before the last token; the others after the shared 15
    assert second.cache.stats.cached_tokens == (12 if mode == "invariant" else 15), second.cache.stats
    for run in (first, second, later):
        assert run.max_diff <= tol and run.same_tokens, (mode, run.max_diff)
    store.close()


def test_rwkv_is_refused_with_what_was_tried() -> None:
    """RWKV's state resumes a forward of several ids (what the refusal says was tried, checked here), but it travels in
    generate's `state` argument, where no cache of prefixkv's is ever handed."""
    model = tiny("rwkv").eval()
    with pytest.raises(prefixkv.UnsupportedModelError, match=r"^rwkv carries .*; tried: the state resumes") as refusal:
        prefixkv.PrefixStore(model)
    assert "1e-8 off in float64" in str(refusal.value)
    ids = random_tokens(24, seed=4)[None]
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits[:, -1]
        state = model(input_ids=ids[:, :16], use_cache=True).state
        resumed = model(input_ids=ids[:, 16:], state=state, use_cache=True).logits[:, -1]
    assert (whole - resumed).abs().max().item() <= 1e-7


def test_deepseek_v4_is_refused_with_what_was_tried() -> None:
    model = prefixkv.models.build(census.tiny_config("deepseek_v4"), dtype=torch.float32)
    with pytest.raises(prefixkv.UnsupportedModelError, match=r"compressor's running entries.*; tried: .*window ends"):
        prefixkv.PrefixStore(model)
    layer = DynamicCache(config=model.config).layers[0]  # the methods of its own the refusal names, on stock's layer
    assert hasattr(layer, "store_compression_weights") and hasattr(layer, "update_compressor_states")


# DeepSeek sparse attention: each family with the dtype its kernels take (hy_v4's and axk2's refuse float64)
SPARSE = [
    ("deepseek_v32", torch.float64, TOL),
    ("glm_moe_dsa", torch.float64, TOL),
    ("hy_v4", torch.float32, 1e-4),
    ("axk2", torch.float32, 1e-4),
]


@pytest.mark.parametrize(("family", "dtype", "tol"), SPARSE)
def test_sparse_attention_keeps_its_indexer_keys(family: str, dtype: torch.dtype, tol: float) -> None:
    """The lightning indexer's key per token is a third tensor of each layer that runs an indexer (``index_k``, kept
    by the pool beside the latent K/V; a ``"shared"`` layer, which reuses the layer before's pick, keeps none); its
    pick of 8 earlier tokens (the census's tiny config) is stock's, cold, warm, with beams and a padded batch."""
    model = prefixkv.models.build(census.tiny_config(family), dtype=dtype)
    store = prefixkv.PrefixStore(model, block_size=4)
    assert store.layer_kinds == ["kv+index"] * 2
    indexers = getattr(model.config, "indexer_types", None) or ["full", "full"]
    assert [s.tensors.get("index_k") for s in store.blocks.pool.specs] == [
        (1, model.config.index_head_dim) if t == "full" else None for t in indexers
    ]
    # a padded row reuses its prefix too: its pad columns' indexer keys are zeros, which the indexer's mask hides
    assert all(n > 0 for n in served_with_reuse(model, store, cached=15, tol=tol))
    assert bool(store.blocks.pool.layer(0)["index_k"].abs().sum() > 0)
    store.close()


def test_sparse_attention_indexer_keys_travel_through_files_and_the_cpu_tier(tmp_path: Any) -> None:
    model = prefixkv.models.build(census.tiny_config("deepseek_v32"), dtype=torch.float64)
    head = random_tokens(16, seed=10)
    first, second = (torch.cat([head, random_tokens(5, seed=s)])[None] for s in (11, 12))
    path = tmp_path / "sparse.safetensors"
    with prefixkv.PrefixStore(model, block_size=4) as store:
        assert compare(model, store, first).max_diff <= TOL
        store.save(path)
    with prefixkv.PrefixStore.load(path, model) as loaded:
        warm = compare(model, loaded, second)  # the indexer keys came back from the file
        assert warm.max_diff <= TOL and warm.same_tokens and warm.cache.stats.cached_tokens == 16
        later = compare(model, loaded, random_tokens(9, seed=13)[None])
        assert later.max_diff <= TOL and later.same_tokens
    # a small pool evicts the first prompts' blocks to the CPU tier, and they come back
    with prefixkv.PrefixStore(model, block_size=4, num_blocks=12, offload="cpu") as store:
        prompts = [random_tokens(20, seed=20 + i)[None] for i in range(3)]
        for ids in prompts:
            assert compare(model, store, ids).max_diff <= TOL
        back = compare(model, store, prompts[0])
        assert back.max_diff <= TOL and back.same_tokens and back.cache.stats.cached_tokens == 19
        assert store.stats.offload is not None and store.stats.offload.restored > 0
        later = compare(model, store, random_tokens(9, seed=40)[None])
        assert later.max_diff <= TOL and later.same_tokens


def test_sparse_attention_in_an_8bit_store_quantizes_its_indexer_keys_too() -> None:
    """An 8-bit store keeps every per-token tensor of a layer in 8 bits, the indexer keys too (each token from its own
    values): exact against stock with a cache that quantizes K, V and the indexer keys alike."""
    model = prefixkv.models.build(census.tiny_config("deepseek_v32"), dtype=torch.float64)
    head = random_tokens(16, seed=10)
    with prefixkv.PrefixStore(model, block_size=4, kv_dtype="int8") as store:
        for tail, cached in ((11, 0), (12, 16)):
            result = compare(model, store, torch.cat([head, random_tokens(5, seed=tail)])[None])
            assert result.max_diff <= TOL and result.same_tokens and result.cache.stats.cached_tokens == cached
        later = compare(model, store, random_tokens(9, seed=13)[None])
        assert later.max_diff <= TOL and later.same_tokens


def test_sparse_attention_in_an_invariant_store() -> None:
    model = prefixkv.models.build(census.tiny_config("deepseek_v32"), dtype=torch.float64)
    ids = random_tokens(20, seed=1)[None]
    with prefixkv.PrefixStore(model, block_size=4, invariant=True) as store:
        cold, warm = compare(model, store, ids), compare(model, store, ids)
        assert cold.max_diff <= TOL and warm.max_diff <= TOL and warm.cache.stats.cached_tokens > 0
        assert torch.equal(torch.stack(cold.out.logits), torch.stack(warm.out.logits))  # warm = cold, bit for bit
        later = compare(model, store, random_tokens(9, seed=13)[None])
        assert later.max_diff <= TOL and later.same_tokens
        with prefixkv.PagedPrefixCache(store) as cache:  # the compiled step carries K and V only
            assert not cache.is_compileable and "index_k" in cache.compile_reason
