"""Recurrent layers (linear attention, Mamba-2, short convolutions) served exactly (docs/how-it-works.md, "Layer
kinds"): each compared with stock generate in float64, cold, warm, beams and a left-padded batch; a chat's next turn
resumes where the last one ended; a prefix that two prompts share up to a point inside a block is reused by the
third; a snapshot is never used for another prefix or namespace; eviction drops snapshots; the modes not carried
refuse with their reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import compare, left_pad, random_tokens, stock_twin

import prefixkv
from prefixkv.base.errors import CacheMisuseError, UnsupportedModelError
from prefixkv.tools import census

pytestmark = pytest.mark.skipif(
    prefixkv.compat.releases.LINEAR_ATTENTION_LAYER is None,
    reason="transformers before 5 keeps recurrent state in caches of each model's own: refused (test_families)",
)

# three kinds of state: a gated delta rule and a conv (qwen3_next), a short conv alone (lfm2), Mamba-2 (mamba2)
FAMILIES = ("qwen3_next", "lfm2", "mamba2")
TOL = 1e-6


def tiny(family: str) -> Any:
    """A float64 tiny model of ``family`` (hidden 64, 2 layers: one of each kind; mixtures of experts computed by
    the eager experts, which have a float64 kernel)."""
    config = census.tiny_config(family)
    config._experts_implementation = "eager"
    return prefixkv.models.build(config, dtype=torch.float64)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny(request.param)


@pytest.fixture(scope="module")
def lfm2() -> Any:
    return tiny("lfm2")


def prompt(shared: torch.Tensor, tail: list[int]) -> torch.Tensor:
    return torch.cat([shared, torch.tensor(tail)])[None]


def test_cold_warm_beams_and_a_padded_batch_match_stock(model: Any) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    assert store.layer_kinds is not None and "state" in store.layer_kinds
    shared = random_tokens(13, seed=1)
    cold = compare(model, store, prompt(shared, [20, 21, 22]))
    assert cold.max_diff <= TOL and cold.same_tokens
    # the cold call stopped at its last-but-one token: the same prompt resumes there
    warm = compare(model, store, prompt(shared, [20, 21, 22]))
    assert warm.max_diff <= TOL and warm.same_tokens
    assert warm.cache.stats.cached_tokens == 15, warm.cache.stats
    assert warm.fed_tokens == 1
    beams = compare(model, store, prompt(shared, [20, 21, 22]), num_beams=3, num_return_sequences=2)
    assert beams.max_diff <= TOL and beams.cache.stats.cached_tokens == 15
    ids, mask = left_pad([prompt(shared, [30])[0], prompt(shared, [31, 32, 33])[0]])
    padded = compare(model, store, ids, mask)
    assert padded.max_diff <= TOL and padded.same_tokens
    # each row resumes before its last token from a snapshot of its unpadded prefix (the model masks its pads): the
    # first row computes up to its junction with the store (13), where the second one resumes
    assert [r.cached_tokens for r in padded.cache.stats.per_row] == [0, 13], padded.cache.stats
    assert padded.cache.stats.split_tokens == 13 + 2
    sampled = compare(model, store, prompt(shared, [20, 21, 22]), do_sample=True, seed=3)
    assert sampled.max_diff <= TOL and sampled.same_tokens
    later = compare(model, store, prompt(shared, [20, 21, 22, 23]))  # an ordinary request after all of them
    assert later.max_diff <= TOL and later.same_tokens
    store.check_invariants()
    store.snapshots.check()


def test_padded_rows_reuse_nothing_where_pads_reach_the_state() -> None:
    config = census.tiny_config("lfm2")
    config.conv_bias = True  # a pad's hidden state masked to zeros still gets the projection's bias into the conv
    model = prefixkv.models.build(config, dtype=torch.float64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(generator=torch.Generator().manual_seed(0))
    store = prefixkv.PrefixStore(model, block_size=4)
    shared = random_tokens(13, seed=13)
    assert compare(model, store, prompt(shared, [20, 21])).max_diff <= TOL
    ids, mask = left_pad([prompt(shared, [30])[0], prompt(shared, [31, 32, 33])[0]])
    padded = compare(model, store, ids, mask)
    assert padded.max_diff <= TOL and padded.same_tokens
    assert padded.cache.stats.cached_tokens == 0
    assert "does not keep its pads out of the state" in (padded.cache.stats.not_cached or "")
    unpadded = compare(model, store, prompt(shared, [20, 21]))  # an ordinary request after it
    assert unpadded.max_diff <= TOL and unpadded.cache.stats.cached_tokens == 14


def test_a_chat_resumes_at_the_end_of_its_last_turn(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    turn = prompt(random_tokens(9, seed=2), [40, 41])
    first = compare(lfm2, store, turn, max_new_tokens=5)
    assert first.max_diff <= TOL
    # the next turn repeats the conversation so far: the prompt, the answer, new tokens
    history = first.out.sequences
    second = compare(lfm2, store, torch.cat([history, torch.tensor([[50, 51, 52]])], dim=1))
    assert second.max_diff <= TOL and second.same_tokens
    # the last call fed every token of the history but the last one it generated
    assert second.cache.stats.cached_tokens == history.shape[1] - 1, second.cache.stats
    # the new tokens, snapshotted before the last one inside generate's own forward: no forward of their own
    assert second.cache.stats.split_tokens == 0 and second.fed_tokens == 4


def test_a_prefix_shared_inside_a_block_is_reused_by_the_third_prompt(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    shared = random_tokens(10, seed=3)  # 2 whole blocks and 2 tokens of the third
    first = compare(lfm2, store, prompt(shared, [60, 61, 62]))
    assert first.max_diff <= TOL
    second = compare(lfm2, store, prompt(shared, [70, 71]))
    assert second.max_diff <= TOL and second.same_tokens
    stats = second.cache.stats
    # snapshotted at the junction (10) and before the last token (11) inside generate's one forward
    assert stats.cached_tokens == 0 and stats.split_tokens == 0 and second.fed_tokens == 12
    assert "ends at token 10" in (stats.not_cached or "")
    third = compare(lfm2, store, prompt(shared, [80, 81, 82]))
    assert third.max_diff <= TOL and third.same_tokens
    assert third.cache.stats.cached_tokens == 10, third.cache.stats
    store.snapshots.check()


def test_rows_that_part_inside_a_block_are_computed_once_up_to_there(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    shared = random_tokens(6, seed=4)
    ids = torch.cat([prompt(shared, [90, 91, 92]), prompt(shared, [93, 94, 95])])
    both = compare(lfm2, store, ids)
    assert both.max_diff <= TOL and both.same_tokens
    # the first row stopped where the rows part (6), so the second resumed there
    assert both.cache.stats.per_row[1].cached_tokens == 6, both.cache.stats


def test_a_snapshot_is_never_used_for_another_prefix_or_namespace(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    a = random_tokens(12, seed=5)
    b = a.clone()
    b[9] += 1  # the same length, another prefix: it parts inside the short conv's window before position 11
    assert compare(lfm2, store, a[None]).max_diff <= TOL
    other = compare(lfm2, store, b[None])
    assert other.max_diff <= TOL and other.same_tokens
    assert other.cache.stats.cached_tokens == 0
    again = compare(lfm2, store, b[None])  # a snapshot at the same position exists on each path
    assert again.max_diff <= TOL and again.same_tokens and again.cache.stats.cached_tokens == 11
    alice = compare(lfm2, store, a[None], namespace="alice")
    assert alice.max_diff <= TOL and alice.cache.stats.cached_tokens == 0
    later = compare(lfm2, store, a[None])
    assert later.max_diff <= TOL and later.same_tokens and later.cache.stats.cached_tokens == 11


def test_eviction_drops_snapshots_with_their_prefixes(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4, num_blocks=12)
    for seed in range(6):
        result = compare(lfm2, store, random_tokens(14, seed=10 + seed)[None], max_new_tokens=4)
        assert result.max_diff <= TOL
        store.snapshots.check()
    assert store.stats.evictions > 0
    space = store.blocks.space()
    held = list(store.snapshots._held)
    assert held and all(store.cached_length(list(path), space) >= len(path) for _, path in held)
    assert store.snapshots.dropped > 0
    assert store.snapshots.bytes_used == sum(s.nbytes for s in store.snapshots._held.values())
    assert (store.stats.snapshots, store.stats.snapshot_bytes) == (len(held), store.snapshots.bytes_used)
    store.clear()
    assert len(store.snapshots) == 0 and store.snapshots.bytes_used == 0
    later = compare(lfm2, store, random_tokens(14, seed=10)[None])
    assert later.max_diff <= TOL and later.same_tokens


def test_snapshots_stay_within_their_share_of_max_memory(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4, max_memory="64KiB")
    assert store.snapshots.max_bytes == 16 * 1024
    for seed in range(8):
        assert compare(lfm2, store, random_tokens(14, seed=20 + seed)[None], max_new_tokens=2).max_diff <= TOL
    assert 0 < store.snapshots.bytes_used <= 16 * 1024
    store.snapshots.check()


def test_pin_and_warm_snapshot_their_prefixes(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    system = random_tokens(10, seed=6)
    assert store.pin(system) == 10
    pinned = compare(lfm2, store, prompt(system, [100, 101]))
    assert pinned.max_diff <= TOL and pinned.cache.stats.cached_tokens == 10
    store.warm([random_tokens(9, seed=7)], progress=False)
    warmed = compare(lfm2, store, prompt(random_tokens(9, seed=7), [102, 103]))
    assert warmed.max_diff <= TOL and warmed.cache.stats.cached_tokens == 9


def test_generate_many_and_score_carry_recurrent_layers(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    shared = random_tokens(9, seed=8)
    prompts = [prompt(shared, [110 + i, 111])[0].tolist() for i in range(3)]
    twin = stock_twin(lfm2)
    outs = prefixkv.generate_many(
        lfm2, prompts, store=store, max_new_tokens=4, do_sample=False, output_logits=True, progress=False
    )
    for ids, out in zip(prompts, outs):
        ref = twin.generate(
            torch.tensor([ids]), max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert out.tokens == ref.sequences[0, len(ids) :].tolist()
        assert out.logits is not None
        assert float((out.logits - torch.cat(ref.logits)).abs().max()) <= TOL
    assert sum(out.cached_tokens for out in outs) > 0
    (scored,) = prefixkv.score(lfm2, store, [prompts[0]], [[5, 6, 7]])
    with torch.no_grad():
        logits = twin(torch.tensor([prompts[0] + [5, 6, 7]])).logits.log_softmax(-1)[0]
    expected = torch.stack([logits[len(prompts[0]) - 1 + i, t] for i, t in enumerate([5, 6, 7])])
    assert float((scored.logprobs - expected).abs().max()) <= TOL


def test_enable_serves_recurrent_layers_as_stock(lfm2: Any) -> None:
    store = prefixkv.enable(lfm2, block_size=4)
    twin = stock_twin(lfm2)
    ids = prompt(random_tokens(11, seed=12), [120, 121])
    try:
        for _ in range(2):
            kw = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
            out, ref = lfm2.generate(ids, **kw), twin.generate(ids, **kw)
            assert torch.equal(out.sequences, ref.sequences)
            assert max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)) <= TOL
            del out
    finally:
        prefixkv.disable(lfm2)
    assert store.stats.hit_tokens == ids.shape[1] - 1  # the second call resumed before its last token


def test_crops_and_drafts_are_refused(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    ids = random_tokens(9, seed=9)[None]
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        lfm2.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
        with pytest.raises(CacheMisuseError, match="state cannot be cropped"):
            cache.crop(-1)
    with prefixkv.PagedPrefixCache(store, ids) as cache, pytest.raises(CacheMisuseError, match="assisted"):
        lfm2.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=2)
    later = compare(lfm2, store, ids)  # an ordinary request after the refusals
    assert later.max_diff <= TOL and later.same_tokens


def test_state_kernels_that_do_not_resume_exactly_are_refused() -> None:
    # Mamba's mixers, which resume one id at a time, are served (tests/test_new_kinds.py); Bamba's scans in float32
    with pytest.raises(UnsupportedModelError, match=r"^bamba does not resume a forward of several ids.*off in"):
        prefixkv.PrefixStore(tiny("bamba"), block_size=4)


# -- the snapshots' defects of issue 52: each test failed on the code before its fix -----------------------------------


def held_paths(store: prefixkv.PrefixStore) -> list[tuple[int, int]]:
    """Per snapshot held, its position and how many tokens of its path the store's trie holds in its key space."""
    return [(len(path), store.blocks.cached_length(list(path), space)) for space, path in store.snapshots._held]


def test_snapshots_go_with_their_paths_in_every_namespace_and_weight_version() -> None:
    model = tiny("lfm2")
    store = prefixkv.PrefixStore(model, block_size=4, num_blocks=12)
    for seed in range(8):
        namespace = f"user{seed % 4}"
        if seed % 3 == 2:
            with torch.no_grad():  # a weight edited in place: a new weight version, a new key space
                model.model.embed_tokens.weight[0, 0] += 0.5
        result = compare(model, store, random_tokens(14, seed=40 + seed)[None], max_new_tokens=3, namespace=namespace)
        assert result.max_diff <= TOL and result.same_tokens
        # every snapshot's path's K/V is held in its own key space (the old drop check looked at the adder's only)
        assert all(held >= position for position, held in held_paths(store)), held_paths(store)
    assert store.stats.evictions > 0 and store.stats.snapshots_dropped_path > 0
    later = compare(model, store, random_tokens(14, seed=47)[None], namespace="user3")  # an ordinary request after
    assert later.max_diff <= TOL and later.same_tokens and later.cache.stats.cached_tokens == 13


@pytest.fixture(params=[False, True], ids=["inside", "runner"])
def runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Who takes the snapshots: the call's own forward (``False``), or the runner's forwards (``True``), as for a
    model whose scan runs inside the layer (Mamba-2)."""
    if request.param:
        monkeypatch.setattr(prefixkv.hf.states, "records_inside", lambda model: False)
    return bool(request.param)


def test_adding_a_snapshot_costs_the_same_however_many_are_held(
    lfm2: Any, monkeypatch: pytest.MonkeyPatch, runner: bool
) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    trie = store.blocks.holdings.trie
    walked = [0]  # tokens of path the trie's lookups walked
    match = trie.match

    def counting(seq: Any, space: Any = None) -> Any:
        walked[0] += len(seq)
        return match(seq, space)

    monkeypatch.setattr(trie, "match", counting)
    check = store.snapshots.check
    monkeypatch.setattr(store.snapshots, "check", lambda held=None: None)  # compare's check walks every path itself
    per_call = []
    for seed in range(24):
        walked[0] = 0
        result = compare(lfm2, store, random_tokens(14, seed=100 + seed)[None], max_new_tokens=2)
        assert result.max_diff <= TOL and result.same_tokens
        per_call.append(walked[0])
    assert len(store.snapshots) >= 24
    # the old drop check walked every snapshot's path at each snapshot added: it grew with their number
    assert max(per_call[12:]) <= max(per_call[2:6]), per_call
    check(lambda space, path: store.blocks.cached_length(path, space))


def test_a_tight_snapshot_budget_drops_the_oldest_never_the_newest(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    store.snapshots.max_bytes = 5 * 1536  # five of this model's float64 snapshots; each call takes two
    prompts = [random_tokens(14, seed=200 + seed)[None] for seed in range(10)]
    for ids in prompts:
        assert compare(lfm2, store, ids, max_new_tokens=2).max_diff <= TOL
    assert store.stats.snapshots_dropped_budget > 0
    assert 0 < store.snapshots.bytes_used <= store.snapshots.max_bytes  # type: ignore[operator]
    again = compare(lfm2, store, prompts[-1], max_new_tokens=2)  # the last prompt asked again
    assert again.max_diff <= TOL and again.same_tokens and again.cache.stats.cached_tokens == 13
    later = compare(lfm2, store, random_tokens(14, seed=299)[None])  # an ordinary request after it
    assert later.max_diff <= TOL and later.same_tokens


def test_the_pool_and_the_snapshots_together_stay_within_max_memory(lfm2: Any) -> None:
    budget = 64 * 1024
    store = prefixkv.PrefixStore(lfm2, block_size=4, max_memory=budget)
    for seed in range(12):
        result = compare(lfm2, store, random_tokens(18, seed=300 + seed)[None], max_new_tokens=3)
        assert result.max_diff <= TOL and result.same_tokens
        pool = store.pool.capacity * store.bytes_per_block  # the pool's tensors, its padding block included
        assert pool + store.snapshots.bytes_used <= budget, (pool, store.snapshots.bytes_used)
    assert store.stats.evictions > 0  # the pool was full


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_snapshot_bytes_are_counted_in_bytes(dtype: torch.dtype) -> None:
    model = prefixkv.models.build(census.tiny_config("lfm2"), dtype=dtype)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = random_tokens(11, seed=400)[None]
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    held = list(store.snapshots._held.values())
    tensors = [t for s in held for t in s.tensors.values()]
    assert held and all(t.dtype == dtype for t in tensors)
    assert store.stats.snapshot_bytes == store.snapshots.bytes_used == sum(t.nbytes for t in tensors)


def test_a_private_namespaces_split_prefill_stays_private(lfm2: Any, runner: bool) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    ids = prompt(random_tokens(12, seed=500), [130, 131])
    alice = compare(lfm2, store, ids, namespace="alice")  # snapshotted before its last token
    assert alice.max_diff <= TOL and alice.cache.stats.split_tokens == (13 if runner else 0)
    assert store.cached_length(ids[0].tolist()) == 0  # nothing of it in the shared namespace
    shared = compare(lfm2, store, ids)
    assert shared.max_diff <= TOL and shared.same_tokens and shared.cache.stats.cached_tokens == 0
    again = compare(lfm2, store, ids, namespace="alice")  # an ordinary request after it, alice's own reuse
    assert again.max_diff <= TOL and again.same_tokens and again.cache.stats.cached_tokens == 13


def test_each_row_of_a_batch_keeps_its_own_state_for_its_next_turn(lfm2: Any) -> None:
    store = prefixkv.PrefixStore(lfm2, block_size=4)
    ids = torch.cat([prompt(random_tokens(9, seed=600), [140]), prompt(random_tokens(9, seed=601), [141])])
    first = compare(lfm2, store, ids, max_new_tokens=4)
    assert first.max_diff <= TOL and first.same_tokens
    history = first.out.sequences[1:2]  # row 1's conversation so far, then its next turn
    second = compare(lfm2, store, torch.cat([history, torch.tensor([[150, 151]])], dim=1))
    assert second.max_diff <= TOL and second.same_tokens
    assert second.cache.stats.cached_tokens == history.shape[1] - 1, second.cache.stats
