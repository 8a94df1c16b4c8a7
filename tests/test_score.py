"""``prefixkv.score``: log-probabilities of continuations over cached contexts, against a full forward in
float64; in-batch prefix sharing for ``generate`` and ``score``; and, after each call that publishes, an
ordinary ``generate`` reusing what it published, against stock (a poisoned block shows only there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_no_leak, compare, left_pad, random_tokens, stock_twin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prefixkv


def full_forward(model: Any, context: list[int], continuation: list[int]) -> torch.Tensor:
    """Log-probabilities of ``continuation`` from one stock forward over context + continuation, on a copy of
    ``model`` that prefixkv never touched."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(stock_twin(model)(ids).logits[0, len(context) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(continuation)[:, None]).squeeze(-1)


def check_reuse_is_exact(model: Any, store: prefixkv.PrefixStore, published: list[int]) -> None:
    """An ordinary generate over ``published`` plus new tokens reuses the store and matches stock."""
    ids = torch.tensor([published + random_tokens(5, 99).tolist()])
    result = compare(model, store, ids, max_new_tokens=3)
    assert result.cache.stats.cached_tokens >= len(published) // store.block_size * store.block_size - store.block_size
    if len(published) >= 2 * store.block_size:  # a shorter score may publish no whole block
        assert result.cache.stats.cached_tokens > 0
    assert result.max_diff < 1e-6 and result.same_tokens


SYSTEM = random_tokens(23, 1).tolist()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.tuples(st.integers(0, 23), st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=6),
    batch_size=st.integers(1, 4),
    block_size=st.sampled_from([1, 4, 5]),
    warm=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_score_matches_a_full_forward(
    llama64: Any, shape: list[tuple[int, int, int]], batch_size: int, block_size: int, warm: bool, seed: int
) -> None:
    store = prefixkv.PrefixStore(llama64, block_size=block_size)
    try:
        if warm:
            store.warm([SYSTEM], progress=False)
        contexts = [
            SYSTEM[:shared] + random_tokens(own, seed + 2 * i).tolist() for i, (shared, own, _) in enumerate(shape)
        ]
        continuations = [random_tokens(n, seed + 2 * i + 1).tolist() for i, (_, _, n) in enumerate(shape)]
        scores = prefixkv.score(llama64, store, contexts, continuations, batch_size=batch_size)
        for c, k, s in zip(contexts, continuations, scores):
            want = full_forward(llama64, c, k)
            assert s.logprobs.dtype == torch.float64
            assert (s.logprobs - want).abs().max().item() < 1e-6
        store.check_invariants()
        longest = max(range(len(contexts)), key=lambda i: len(contexts[i]) + len(continuations[i]))
        check_reuse_is_exact(llama64, store, contexts[longest] + continuations[longest])
        assert_no_leak(store)
    finally:
        store.close()


@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_padded_tensors_are_read_on_either_side(llama64: Any, side: str) -> None:
    contexts = [SYSTEM + random_tokens(n, 10 + n).tolist() for n in (3, 7, 1)]
    continuations = [random_tokens(n, 20 + n).tolist() for n in (2, 1, 4)]

    def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows) + 2
        ids, mask = torch.zeros((len(rows), width), dtype=torch.long), torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            start = {"left": width - len(r), "right": 0, "both": 1}[side]
            ids[i, start : start + len(r)] = torch.tensor(r)
            mask[i, start : start + len(r)] = 1
        return ids, mask

    (cids, cmask), (kids, kmask) = padded(contexts), padded(continuations)
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        scores = prefixkv.score(llama64, store, cids, kids, context_mask=cmask, continuation_mask=kmask, batch_size=2)
        for c, k, s in zip(contexts, continuations, scores):
            assert (s.logprobs - full_forward(llama64, c, k)).abs().max().item() < 1e-6
            assert s.greedy.shape == s.logprobs.shape


def test_one_context_many_continuations_reuses_the_context(llama64: Any) -> None:
    question = SYSTEM + random_tokens(9, 5).tolist()
    answers = [random_tokens(n, 30 + n).tolist() for n in (1, 2, 3, 4)]
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        scores = prefixkv.score(llama64, store, question, answers, batch_size=1)
        for k, s in zip(answers, scores):
            assert (s.logprobs - full_forward(llama64, question, k)).abs().max().item() < 1e-6
            assert s.total == pytest.approx(float(s.logprobs.sum()))
            assert s.is_greedy == bool(s.greedy.all())
        # the longest answer, scored first, computed the question; the three others reused all of it but its
        # last token (whose logits they need), a part-block included (copied)
        assert store.stats.hit_tokens == 3 * (len(question) - 1)
        check_reuse_is_exact(llama64, store, question)


def test_in_batch_sharing_computes_a_cold_prefix_once(llama64: Any) -> None:
    system = random_tokens(40, 3)
    questions = [torch.cat([system, random_tokens(5 + i, 40 + i)]) for i in range(8)]
    ids, mask = left_pad(questions)
    fed: list[int] = []  # rows x columns of each forward: the prefill work
    handle = llama64.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        fed.clear()  # the forwards that check the model when a store is built
        try:
            result = compare(llama64, store, ids, mask, max_new_tokens=3)
        finally:
            handle.remove()
        assert result.max_diff < 1e-6 and result.same_tokens
        # forwards (the stock reference runs on the model's pristine copy): the shared prefix (40 tokens, one
        # row), then one batch forward over the 12 columns after the prefix, then 2 steps
        assert fed == [40, 8 * 12, 8, 8], fed
        stats = result.cache.stats
        # work ~= 1 prefix + 8 tails: each row computes the 12 columns after the prefix (a shorter row, padded
        # on the left, takes the end of the prefix again: one offset per batch), and one row is charged the prefix
        assert stats.computed_tokens == 40 + 8 * 12
        assert sorted(r.computed_tokens for r in stats.per_row) == [12] * 7 + [52]
        assert stats.cached_tokens == stats.prompt_tokens - stats.computed_tokens
        assert store.stats.hit_tokens == stats.cached_tokens
        check_reuse_is_exact(llama64, store, [*system.tolist(), 7, 8, 9])
        assert_no_leak(store)


def test_in_batch_sharing_for_score_and_nested_prefixes(llama64: Any) -> None:
    system = random_tokens(16, 4).tolist()
    docs = [system + random_tokens(12, 50 + d).tolist() for d in range(2)]
    contexts = [doc + random_tokens(2, 60 + i).tolist() for doc in docs for i in range(3)]
    continuations = [random_tokens(2, 70 + i).tolist() for i in range(6)]
    fed: list[int] = []
    handle = llama64.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        fed.clear()  # the forwards that check the model when a store is built
        try:
            scores = prefixkv.score(llama64, store, contexts, continuations, batch_size=6)
        finally:
            handle.remove()
        for c, k, s in zip(contexts, continuations, scores):
            assert (s.logprobs - full_forward(llama64, c, k)).abs().max().item() < 1e-6
        # each document (system prompt + its 12 tokens, 28 = 7 whole blocks) once; the second reuses the system
        # prompt the first computed; then 6 rows of the 3 columns after the documents (2 + the 1 continuation token fed)
        assert fed == [28, 12, 6 * 3], fed
        check_reuse_is_exact(llama64, store, contexts[0] + continuations[0])
        assert_no_leak(store)


def test_rows_without_a_shared_prefix_cost_no_extra_forward(llama64: Any) -> None:
    rows = [random_tokens(10, 80 + i) for i in range(3)]
    ids, mask = left_pad(rows)
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        result = compare(llama64, store, ids, mask, max_new_tokens=2)
        assert result.fed_tokens == 10 and result.cache.stats.cached_tokens == 0
        assert result.max_diff < 1e-6


def test_score_refuses_what_it_cannot_score(llama64: Any) -> None:
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        with pytest.raises(ValueError, match="context 0 is empty"):
            prefixkv.score(llama64, store, [[]], [[1]])
        with pytest.raises(ValueError, match="continuation 1 is empty"):
            prefixkv.score(llama64, store, [[3], [4]], [[1], []])
        with pytest.raises(ValueError, match="2 contexts and 3 continuations"):
            prefixkv.score(llama64, store, [[3], [4]], [[1], [2], [3]])
        with pytest.raises(ValueError, match="one run of 1s"):
            prefixkv.score(llama64, store, torch.tensor([[3, 4, 5]]), [[1]], context_mask=torch.tensor([[1, 0, 1]]))
        with pytest.raises(ValueError, match="token ids"):
            prefixkv.score(llama64, store, ["a question"], [[1]])
        with pytest.raises(ValueError, match="built for this model"):
            prefixkv.score(prefixkv.models.tiny_model("llama"), store, [[3]], [[1]])


def test_score_refuses_ids_that_are_not_ints_rather_than_truncate_them(llama64: Any) -> None:
    """Ids are never truncated (docs/correctness.md). Floats (in a list of rows or as one row), bools, negative ids and
    rows of rows are refused with the value, before anything runs: the store stays empty."""
    cases: list[tuple[Any, Any, str]] = [
        ([[5, 6, 7.9]], [[8]], "contexts: .*7.9"),
        ([[5, 6, 7]], [[8.0, 9.0]], "continuations: .*8.0"),
        ([5.0, 6.0, 7.0], [[8]], "contexts: .*5.0"),
        ([[5, True, 7]], [[8]], "contexts: .*True"),
        ([[5, -6, 7]], [[8]], "contexts: .*-6"),
        ([[[5, 6], [7]]], [[8]], r"contexts: .*\[5, 6\]"),
        ([torch.tensor([5, 6, 7])], [torch.tensor([8.0])], "continuations: .*float"),
    ]
    with prefixkv.PrefixStore(llama64, block_size=4) as store:
        for contexts, continuations, shown in cases:
            with pytest.raises(ValueError, match=shown):
                prefixkv.score(llama64, store, contexts, continuations)
        assert store.stats.blocks_used == 0 and store.stats.prompt_tokens == 0
        numpy = pytest.importorskip("numpy")
        ints = prefixkv.score(llama64, store, [numpy.array([5, 6, 7])], [[numpy.int64(8)]])
        assert ints[0].logprobs.shape == (1,)
