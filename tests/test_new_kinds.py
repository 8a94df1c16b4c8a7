"""The families refused at the start of issue 53's round, tried again (docs/architectures.md, "Refused families"):
each served exactly with reuse, compared with stock generate in float64 (cold, warm, beams, a left-padded batch, then
a later ordinary request), or refused with a reason that names what was tried."""

from __future__ import annotations

from typing import Any

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


def served_with_reuse(model: Any, store: prefixkv.PrefixStore, cached: int) -> None:
    """Cold, warm (reusing ``cached`` prompt tokens), beams and a left-padded batch, each within :data:`TOL` of
    stock, then a later ordinary request."""
    shared = random_tokens(13, seed=1)
    cold = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 22])])[None])
    assert cold.max_diff <= TOL and cold.same_tokens
    warm = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 23, 24])])[None])
    assert warm.max_diff <= TOL and warm.same_tokens
    assert warm.cache.stats.cached_tokens == cached, warm.cache.stats
    beams = compare(model, store, torch.cat([shared, torch.tensor([20, 21, 22])])[None], num_beams=3)
    assert beams.max_diff <= TOL and beams.cache.stats.cached_tokens > 0
    ids, mask = left_pad([torch.cat([shared, torch.tensor([30])]), torch.cat([shared, torch.tensor([31, 32, 33])])])
    padded = compare(model, store, ids, mask)
    assert padded.max_diff <= TOL and padded.same_tokens
    later = compare(model, store, random_tokens(9, seed=5)[None])  # an ordinary request after all of them
    assert later.max_diff <= TOL and later.same_tokens
    store.check_invariants()


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
    assert all("forward" in vars(m) for m in stepwise.mixers(model)), "the store wraps every Mamba mixer"
    assert torch.equal(resumed(model), resumed(twin))
    store.close()
    assert not any("forward" in vars(m) for m in stepwise.mixers(model))
