"""Generation under ``torch.autocast`` (TRL's ``GRPOConfig()`` turns it on by default: ``bf16=True``): the store
keeps K/V in the dtypes the layers hand over, the model's own attention reads them, and K/V computed with and
without autocast are keyed apart (docs/correctness.md, "Autocast"). Every reference is stock ``generate`` on an
untouched copy of the model, under the same autocast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import cache_kw, compare, left_pad, max_logit_diff, random_tokens, stock_twin

import prefixkv
from prefixkv.base.errors import CacheMisuseError, PersistError

SYSTEM = random_tokens(24, seed=431)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def _autocast(device: str) -> Any:
    return torch.autocast(device, dtype=torch.bfloat16)


# a prefix computed in a forward of its own (in-batch sharing, another batch's call) rounds otherwise in bfloat16
# (docs/correctness.md, "Outputs that never depend on the cache"): a few bfloat16 steps of the logits, not exact
BF16_TOL = 1e-2


def _prompt(seed: int, device: str) -> torch.Tensor:
    return torch.cat([SYSTEM, random_tokens(5, seed=seed)])[None].to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_matches_stock_under_autocast_cold_and_warm_and_never_crosses_over(device: str) -> None:
    model = prefixkv.models.tiny_model("llama", dtype=torch.float32).to(device)
    store = prefixkv.PrefixStore(model, block_size=4)
    exact = 1e-6 if device == "cpu" else BF16_TOL  # the CPU's bfloat16 matmul rounds alike for any row count
    sampled = {"do_sample": True, "top_k": 20}
    for seed in (1, 2):  # cold, then warm (reusing the 24 tokens of SYSTEM)
        with _autocast(device):
            c = compare(model, store, _prompt(seed, device), seed=seed, **sampled)
        assert c.same_tokens and c.max_diff <= exact, c.max_diff
    assert c.cache.stats.cached_tokens == 24
    # a padded batch whose rows share SYSTEM and more (computed once, in-batch): within bfloat16's rounding
    rows = [torch.cat([SYSTEM, random_tokens(4, seed=5), random_tokens(n, seed=n)]) for n in (3, 6)]
    ids, mask = left_pad(rows)
    with _autocast(device):
        batch = compare(model, store, ids.to(device), mask.to(device), seed=3, **sampled)
    assert batch.same_tokens and batch.max_diff <= BF16_TOL, batch.max_diff
    # the same prompt without autocast reuses nothing of what autocast computed, and equals stock without it
    plain = compare(model, store, _prompt(2, device), seed=2, **sampled)
    assert plain.same_tokens and plain.max_diff <= 1e-5, plain.max_diff
    assert plain.cache.stats.cached_tokens == 0
    # and under autocast again, its K/V are still there, and still right
    with _autocast(device):
        again = compare(model, store, _prompt(2, device), seed=2, **sampled)
    assert again.same_tokens and again.max_diff <= exact, again.max_diff
    assert again.cache.stats.cached_tokens == 28
    store.check_invariants()


def test_a_cache_built_outside_autocast_replans_for_a_call_under_it() -> None:
    model = prefixkv.models.tiny_model("llama", dtype=torch.float32)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.cat([SYSTEM, random_tokens(5, seed=7)])[None]
    compare(model, store, ids)  # the prompt's K/V without autocast

    def run(on: Any, **cache: Any) -> Any:
        torch.manual_seed(0)
        with _autocast("cpu"):
            return on.generate(
                ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, **cache
            )

    ref = run(stock_twin(model))
    with prefixkv.PagedPrefixCache(store, ids) as cache:  # matched outside autocast: 28 tokens without it
        assert cache.get_seq_length() == 28
        out = run(model, **cache_kw(cache))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out.logits, ref.logits) <= 1e-6


def test_autocast_into_a_pool_that_cannot_hold_its_dtype_is_refused_with_the_remedy() -> None:
    model = prefixkv.models.tiny_model("llama", dtype=torch.bfloat16)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = random_tokens(9, seed=3)[None]
    remedy = r"under torch.autocast\('cpu', dtype=torch.float16\).*with dtype=torch.float32"
    with pytest.raises(CacheMisuseError, match=remedy), torch.autocast("cpu", dtype=torch.float16):
        compare(model, store, ids, max_new_tokens=2)
    # an ordinary request afterwards is stock's
    c = compare(model, store, random_tokens(9, seed=4)[None], max_new_tokens=2)
    assert c.same_tokens and c.max_diff == 0.0


def test_an_autocast_entered_inside_the_forward_alone_is_refused_and_the_same_outside_it_is_served() -> None:
    """accelerate's mixed precision (TRL's bf16=True) wraps the model's forward in an autocast, which the cache does
    not see when it is built and planned: refused with the remedy, and served with the autocast entered around
    generate too (what prefixkv.integrations.trl does)."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float32)
    store = prefixkv.PrefixStore(model, block_size=4)
    inner = model.forward
    model.forward = _autocast("cpu")(inner)  # as accelerate.prepare does
    try:
        with pytest.raises(CacheMisuseError, match=r"Enter the same autocast around the generate call"):
            compare(model, store, _prompt(1, "cpu"), max_new_tokens=2)
        for seed in (1, 2):  # cold, then warm
            with _autocast("cpu"):
                c = compare(model, store, _prompt(seed, "cpu"), max_new_tokens=4)
            assert c.same_tokens and c.max_diff <= 1e-6, c.max_diff
        assert c.cache.stats.cached_tokens == 24
    finally:
        del model.forward
    plain = compare(model, store, _prompt(2, "cpu"), max_new_tokens=4)  # an ordinary request: stock's
    assert plain.same_tokens and plain.max_diff <= 1e-5 and plain.cache.stats.cached_tokens == 0


def test_files_are_saved_and_loaded_outside_autocast_only(tmp_path: Path) -> None:
    """A prefix file keeps the model's own K/V and no mark of autocast: under it, save and load are refused, and
    outside it the file holds and serves only K/V computed without autocast."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.float32)
    store = prefixkv.PrefixStore(model, block_size=4)
    with _autocast("cpu"):
        compare(model, store, _prompt(1, "cpu"), max_new_tokens=2)
        with pytest.raises(PersistError, match="save outside the autocast block"):
            store.save(tmp_path / "a.safetensors")
    assert store.save(tmp_path / "a.safetensors").tokens == 0  # autocast's K/V are not the model's own
    compare(model, store, _prompt(1, "cpu"), max_new_tokens=2)
    assert store.save(tmp_path / "b.safetensors").tokens == 28
    with _autocast("cpu"), pytest.raises(PersistError, match="load outside the autocast block"):
        store.merge(tmp_path / "b.safetensors")
    store.close()
    with _autocast("cpu"), pytest.raises(PersistError, match="load outside the autocast block"):
        prefixkv.PrefixStore.load(tmp_path / "b.safetensors", model)
    loaded = prefixkv.PrefixStore.load(tmp_path / "b.safetensors", model)
    with _autocast("cpu"):
        c = compare(model, loaded, _prompt(1, "cpu"), max_new_tokens=4)
    assert c.same_tokens and c.max_diff <= 1e-6 and c.cache.stats.cached_tokens == 0
    c = compare(model, loaded, _prompt(1, "cpu"), max_new_tokens=4)
    assert c.same_tokens and c.max_diff <= 1e-5 and c.cache.stats.cached_tokens == 28
