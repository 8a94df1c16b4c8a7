"""Exceptions in the middle of ``generate`` (a stopping criterion, a streamer, a layer of the model;
ordinary errors and KeyboardInterrupt) leak no block once the cache is closed or collected, publish
nothing half-computed, and leave the store usable."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from conftest import assert_no_leak, compare, random_tokens
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import prefixkv

TOL = 1e-6

pytestmark = pytest.mark.usefixtures("fast_gc")


class Boom(Exception):
    pass


class Countdown:
    """Raises ``exc`` on its ``n``-th call."""

    def __init__(self, n: int, exc: type[BaseException]) -> None:
        self.n, self.exc, self.calls = n, exc, 0

    def tick(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise self.exc(f"injected on call {self.n}")


class RaisingCriterion(StoppingCriteria):
    def __init__(self, countdown: Countdown) -> None:
        self.countdown = countdown

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.countdown.tick()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class RaisingStreamer(BaseStreamer):
    def __init__(self, countdown: Countdown) -> None:
        self.countdown = countdown

    def put(self, value: torch.Tensor) -> None:
        self.countdown.tick()

    def end(self) -> None:
        return None


def generate_with_fault(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, fault: str, exc: type) -> Any:
    """Run generate with a fault injected; return the cache it used."""
    kwargs: dict[str, Any] = {}
    handle = None
    if fault == "stopping criterion":  # called after each new token: fails on the third
        kwargs["stopping_criteria"] = StoppingCriteriaList([RaisingCriterion(Countdown(3, exc))])
    elif fault == "streamer":  # called with the prompt, then per token: fails on the second token
        kwargs["streamer"] = RaisingStreamer(Countdown(3, exc))
    else:  # the last decoder layer fails in the prefill or in the second decode step, after the first wrote K/V
        countdown = Countdown(1 if fault == "layer in prefill" else 3, exc)
        handle = model.model.layers[-1].register_forward_pre_hook(lambda *a: countdown.tick())
    cache = prefixkv.PagedPrefixCache(store, ids)
    try:
        with pytest.raises(exc, match="injected"):
            model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    return cache


FAULTS = ["stopping criterion", "streamer", "layer in prefill", "layer in decode"]


@pytest.mark.parametrize(("exc", "release"), [(Boom, "close"), (KeyboardInterrupt, "collect")])
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_mid_generate_leaks_nothing(llama64: Any, fault: str, exc: type, release: str) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=16)
    system = random_tokens(19, seed=1)
    store.pin(system[:8])
    warm = torch.cat([system, random_tokens(5, seed=2)])[None]
    cache = generate_with_fault(llama64, store, warm, fault, exc)
    ref = weakref.ref(cache)
    assert cache.stats.cached_tokens == 8
    if release == "close":
        cache.close()
    gc.disable()  # the failed call left no reference cycle: dropping the cache frees it at once
    try:
        del cache
        assert ref() is None, "the cache outlived the failed generate call"
    finally:
        gc.enable()
    store.check_invariants()
    # what was published before the fault is correct: a new request reusing it matches stock generate
    again = torch.cat([system, random_tokens(7, seed=3)])[None]
    result = compare(llama64, store, again)
    assert result.same_tokens and result.max_diff <= TOL
    assert result.cache.stats.cached_tokens == (8 if fault == "layer in prefill" else 19)
    assert_no_leak(store, pinned=2)
    store.close()


def test_a_forward_that_fails_half_way_publishes_nothing(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=4)
    ids = random_tokens(16, seed=4)[None]
    generate_with_fault(llama64, store, ids, "layer in prefill", Boom)
    gc.collect()
    assert store.stats.blocks_used == 0  # layer 0 wrote 16 tokens of K/V; none of it reached the trie
    assert_no_leak(store)
    store.close()
