"""Isolation between users (``namespace=``): a cache of one user neither reuses nor publishes K/V of another, so
that its time to first token tells nothing of another user's prompts; the same user reuses its own. Through
``PagedPrefixCache``, ``enable``, ``score``, ``generate_many``, ``save``/``load`` and both tiers; every output
against stock (float64, 1e-6)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, random_tokens, stock_twin

import prefixkv
from prefixkv import PrefixStore

BS = 4


def _prompt(seed: int, shared: torch.Tensor) -> torch.Tensor:
    """``shared`` (the prefix another user may have cached) and 3 tokens of its own, as one row."""
    return torch.cat([shared, random_tokens(3, seed=seed)])[None]


def _exact(out: Any) -> None:
    assert out.same_tokens and out.max_diff <= 1e-6, out.max_diff


def test_another_namespace_computes_the_whole_prompt_and_the_same_one_reuses(llama64: Any) -> None:
    system = random_tokens(24, seed=1)
    with PrefixStore(llama64, block_size=BS) as store:
        alice = compare(llama64, store, _prompt(2, system), namespace="alice", do_sample=False)
        _exact(alice)
        assert alice.cache.stats.cached_tokens == 0
        for other in (None, "bob"):  # the shared namespace and another user: no hit, the whole prompt computed
            out = compare(llama64, store, _prompt(3, system), namespace=other, do_sample=False)
            _exact(out)
            assert out.cache.stats.cached_tokens == 0 and out.fed_tokens == 27
        again = compare(llama64, store, _prompt(4, system), namespace="alice", do_sample=False)
        _exact(again)
        assert again.cache.stats.cached_tokens == 24 and again.fed_tokens == 3
        shared = compare(llama64, store, _prompt(5, system), do_sample=False)  # what the None call published
        _exact(shared)
        assert shared.cache.stats.cached_tokens == 24
        assert store.cached_length(system.tolist()) == 24
        assert store.cached_length(system.tolist(), namespace="alice") == 24
        assert store.cached_length(system.tolist(), namespace="carol") == 0


def test_a_copied_cache_keeps_its_namespace(llama64: Any) -> None:
    system = random_tokens(24, seed=6)
    ids = _prompt(7, system)
    with PrefixStore(llama64, block_size=BS) as store:
        with prefixkv.PagedPrefixCache(store, ids, namespace="alice") as cache:
            llama64.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
            with copy.deepcopy(cache) as other:
                assert other.namespace == "alice"
        assert store.cached_length(system.tolist(), namespace="alice") == 24
        assert store.cached_length(system.tolist()) == 0


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [(7, TypeError, "a str"), ("", ValueError, "cannot be empty"), (("a",), TypeError, "a str")],
)
def test_a_wrong_namespace_is_refused(llama64: Any, name: Any, error: type[Exception], match: str) -> None:
    with PrefixStore(llama64, block_size=BS) as store:
        with pytest.raises(error, match=match):
            prefixkv.PagedPrefixCache(store, random_tokens(8, seed=0)[None], namespace=name)
        with pytest.raises(error, match=match):
            prefixkv.enable(llama64, store=store, namespace=name)
        assert not hasattr(llama64, "_prefixkv_enabled")
        assert store.stats.blocks_used == 0


def test_enable_keeps_its_users_apart(llama64: Any) -> None:
    system = random_tokens(24, seed=8)
    twin = stock_twin(llama64)
    first, second = _prompt(9, system), _prompt(10, system)
    refs = [twin.generate(p, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
            for p in (first, second)]  # fmt: skip
    with PrefixStore(llama64, block_size=BS) as store:
        compare(llama64, store, first, namespace="bob", do_sample=False)  # bob's prefix: not alice's
        prefixkv.enable(llama64, store=store, namespace="alice")
        try:
            for ids, ref, hits in ((first, refs[0], 0), (second, refs[1], 24)):
                before = store.stats.hit_tokens
                out = llama64.generate(
                    ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
                )
                assert store.stats.hit_tokens - before == hits
                assert torch.equal(out.sequences, ref.sequences)
                assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) <= 1e-6
        finally:
            prefixkv.disable(llama64)
        assert store.cached_length(system.tolist(), namespace="alice") == 24
        assert store.cached_length(system.tolist()) == 0


def test_score_keeps_its_users_apart(llama64: Any) -> None:
    context = random_tokens(24, seed=11).tolist()
    answers = [[5, 6], [7]]
    twin = stock_twin(llama64)
    with torch.no_grad():
        logits = [twin(torch.tensor([context + a])).logits[0].log_softmax(-1) for a in answers]
    want = [
        lp[len(context) - 1 : -1].gather(-1, torch.tensor(a)[:, None]).squeeze(-1) for lp, a in zip(logits, answers)
    ]
    with PrefixStore(llama64, block_size=BS) as store:
        for name, hits in (("alice", 0), ("bob", 0), ("alice", 23)):
            before = store.stats.hit_tokens
            got = prefixkv.score(llama64, store, [context], [answers[0]], namespace=name)
            assert store.stats.hit_tokens - before == hits, name
            assert (got[0].logprobs - want[0]).abs().max().item() <= 1e-6
        got = prefixkv.score(llama64, store, [context], [answers[1]])  # the shared namespace holds nothing yet
        assert (got[0].logprobs - want[1]).abs().max().item() <= 1e-6
        assert store.cached_length(context, namespace="carol") == 0


def test_generate_many_keeps_its_users_apart(llama64: Any) -> None:
    system = random_tokens(24, seed=12)
    prompts = [_prompt(s, system)[0] for s in (13, 14)]
    twin = stock_twin(llama64)
    refs = [twin.generate(p[None], max_new_tokens=4, do_sample=False)[0, p.shape[0] :].tolist() for p in prompts]
    with PrefixStore(llama64, block_size=BS) as store:
        for name, hits in (("alice", [0, 24]), ("bob", [0, 24]), ("alice", [26, 26])):
            out = prefixkv.generate_many(
                llama64, prompts, store=store, max_new_tokens=4, do_sample=False, progress=False, namespace=name
            )
            assert [g.tokens for g in out] == refs
            # a new namespace: the shared prefix computed once (row 1 reuses it); alice's second run reuses hers
            assert [g.cached_tokens for g in out] == hits, name
        assert store.cached_length(system.tolist(), namespace="carol") == 0
        assert store.cached_length(system.tolist()) == 0


def test_pin_and_warm_serve_only_their_namespace(llama64: Any) -> None:
    system = random_tokens(24, seed=15)
    with PrefixStore(llama64, block_size=BS, num_blocks=24) as store:
        assert store.pin(system, namespace="alice") == 24
        assert store.stats.blocks_pinned == 6
        with pytest.raises(ValueError, match="not pinned"):
            store.unpin(system)  # the shared namespace has no such pin
        warmed = store.warm([random_tokens(9, seed=16)], progress=False, namespace="bob")
        assert warmed.computed_tokens == 9
        assert store.cached_length(random_tokens(9, seed=16).tolist(), namespace="bob") == 8
        assert store.cached_length(random_tokens(9, seed=16).tolist()) == 0
        for name, hits in (("carol", 0), ("alice", 24)):
            out = compare(llama64, store, _prompt(17, system), namespace=name, do_sample=False)
            _exact(out)
            assert out.cache.stats.cached_tokens == hits, name
        store.unpin(system, namespace="alice")
        assert store.stats.blocks_pinned == 0


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_offloaded_blocks_come_back_only_in_their_namespace(llama64: Any, kind: str, tmp_path: Path) -> None:
    """Alice's prompt is evicted into the tier by two others; bob's request for it restores nothing and computes
    it all, alice's restores her 9 blocks; both get stock's logits."""
    directory = tmp_path if kind == "disk" else None
    first, *rest = [random_tokens(37, seed=s)[None] for s in range(3)]
    with PrefixStore(llama64, block_size=BS, num_blocks=16, offload=kind, offload_dir=directory) as store:
        for ids in (first, *rest):
            _exact(compare(llama64, store, ids, namespace="alice", do_sample=False))
        assert store.cached_length(first[0].tolist(), namespace="alice") < 36  # evicted from the pool
        o = store.stats.offload
        assert o is not None and o.blocks >= 9
        for name, hits in (("bob", 0), (None, 0), ("alice", 36)):
            restored = o.restored
            out = compare(llama64, store, first, namespace=name, do_sample=False)
            _exact(out)
            o = store.stats.offload
            assert o is not None
            assert out.cache.stats.cached_tokens == hits, name
            assert (o.restored > restored) == (name == "alice"), name


def test_save_keeps_the_shared_namespace_only(llama64: Any, tmp_path: Path) -> None:
    shared, private = random_tokens(24, seed=18), random_tokens(24, seed=19)
    path = tmp_path / "prefixes.safetensors"
    with PrefixStore(llama64, block_size=BS) as store:
        _exact(compare(llama64, store, _prompt(20, shared), do_sample=False))
        _exact(compare(llama64, store, _prompt(21, private), namespace="alice", do_sample=False))
        saved = store.save(path)
    assert saved.prefixes == 1  # the shared prompt, none of alice's
    with PrefixStore.load(path, llama64) as store:
        assert store.cached_length(shared.tolist()) == 24
        assert store.cached_length(private.tolist()) == 0
        assert store.cached_length(shared.tolist(), namespace="alice") == 0
        for name, hits in (("alice", 0), (None, 24)):
            out = compare(llama64, store, _prompt(22, shared), namespace=name, do_sample=False)
            _exact(out)
            assert out.cache.stats.cached_tokens == hits, name


def test_after_a_weight_change_a_namespace_offloads_nothing(llama64: Any) -> None:
    """K/V computed after the weights changed stay out of the second tier in a user's namespace too (only this
    process can tell such weights apart): evicted, they are gone, and the request after recomputes them."""
    prompts = [random_tokens(37, seed=s)[None] for s in range(3)]
    weight = next(llama64.parameters())
    before = weight.detach().clone()
    try:
        with PrefixStore(llama64, block_size=BS, num_blocks=16, offload="cpu") as store:
            with torch.no_grad():
                weight.mul_(1.5)  # a training step, as far as the store can tell
            for ids in prompts:
                _exact(compare(llama64, store, ids, namespace="alice", do_sample=False))
            assert store.stats.evictions > 0
            o = store.stats.offload
            assert o is not None and o.blocks == 0
            again = compare(llama64, store, prompts[0], namespace="alice", do_sample=False)
            _exact(again)
            assert again.cache.stats.cached_tokens == 0
    finally:
        with torch.no_grad():
            weight.copy_(before)  # the module's model, for the tests after this one


def test_an_invariant_store_computes_its_chunks_in_the_namespace(llama64: Any) -> None:
    """The canonical chunk prefill of an invariant store runs in the caller's namespace: another user gets no hit
    and the shared namespace holds nothing, the same user reuses the chunks."""
    system = random_tokens(24, seed=23)
    with PrefixStore(llama64, block_size=BS, invariant=True, chunk_size=8) as store:
        for name, hits in (("alice", 0), ("bob", 0), ("alice", 24)):
            out = compare(llama64, store, _prompt(24, system), namespace=name, do_sample=False)
            _exact(out)
            assert out.cache.stats.cached_tokens == hits, name
        assert store.cached_length(system.tolist(), namespace="alice") == 24
        assert store.cached_length(system.tolist()) == 0


def test_a_namespace_per_request_costs_no_memory_once_its_prefixes_are_gone(llama64: Any) -> None:
    """Issue 32, review #5: a namespace per user (or per request) kept its trie root forever, also after
    eviction and ``clear()``. A namespace without nodes or locks is dropped; isolation holds throughout."""
    system = random_tokens(24, seed=1)
    with PrefixStore(llama64, block_size=BS, num_blocks=24) as store:
        trie = store.blocks._trie
        for i in range(40):  # each request in a namespace of its own, through a budget that evicts
            out = compare(llama64, store, _prompt(10 + i, system), namespace=f"request-{i}", do_sample=False)
            _exact(out)
            assert out.cache.stats.cached_tokens == 0  # no other request's K/V
        assert store.stats.evictions > 0
        # roots: the default one, those that hold prefixes, at most one emptied since the last new root
        holding = {n.space for n in trie.view() if n.parent < 0}
        assert len(trie._roots) <= len(holding | {None}) + 1 < 12, len(trie._roots)  # 41 before the fix
        live = compare(llama64, store, _prompt(60, system), namespace="request-39", do_sample=False)
        _exact(live)
        assert live.cache.stats.cached_tokens == 24  # the latest one kept its prefix and still reuses it
        store.clear()
        assert list(trie._roots) == [None] and len(trie._roots._spaces) == 1  # 42 before the fix
        again = compare(llama64, store, _prompt(61, system), namespace="request-39", do_sample=False)
        _exact(again)
        assert again.cache.stats.cached_tokens == 0
        later = compare(llama64, store, _prompt(62, system), do_sample=False)  # an ordinary request, against stock
        _exact(later)
        assert later.cache.stats.cached_tokens == 0
        store.check_invariants()


def test_looking_up_a_namespace_leaves_no_trace(llama64: Any) -> None:
    """Issue 43, review #5: ``cached_length`` (a query) and a cache whose namespace holds nothing made that
    namespace's root, kept forever; an ordinary request afterwards is served as stock serves it."""
    system = random_tokens(24, seed=30)
    with PrefixStore(llama64, block_size=BS) as store:
        trie = store.blocks._trie
        for i in range(1000):
            assert store.cached_length(system.tolist(), namespace=f"request-{i}") == 0
        prefixkv.PagedPrefixCache(store, _prompt(31, system), namespace="looked-up").close()
        assert trie.spaces() == [None]  # 1002 before the fix
        out = compare(llama64, store, _prompt(32, system), do_sample=False)
        _exact(out)
        store.clear()
        assert trie.spaces() == [None] and trie.policy.queued() == 0
        store.check_invariants()


def _books(store: PrefixStore) -> tuple[Any, ...]:
    """The entries of a store's own bookkeeping: the pool's and the allocator's blocks, the free list, the trie's
    roots and nodes, the eviction queues, the snapshots."""
    alloc, trie = store.blocks.holdings.allocator, store.blocks._trie
    return (
        store.pool.capacity,
        alloc.capacity,
        len(alloc._free),
        alloc.num_free,
        trie.spaces(),
        len(trie._roots._spaces),
        trie.policy.queued(),
        trie.policy.nodes,
        len(store.snapshots),
    )


def test_clear_brings_the_books_back_to_a_fresh_stores(llama64: Any) -> None:
    """Issue 52: a request in a namespace of its own left 173 B behind after ``clear()`` (a million namespaces: 165
    MiB): without a budget the pool grows to hold every namespace's prefixes, and the pool and the allocator's
    free list and refcounts kept that size. ``clear()`` gives them back, down to the last block still held (a
    pinned prefix keeps its blocks, served exactly after the clear)."""
    system = random_tokens(24, seed=70)
    with PrefixStore(llama64, block_size=BS) as store:
        fresh = _books(store)
        store.pin(system.tolist(), namespace="kept")
        for i in range(60):  # each request in a namespace of its own: 2 whole blocks each, nothing evicted
            ids = random_tokens(9, seed=100 + i)[None]
            with prefixkv.PagedPrefixCache(store, ids, namespace=f"request-{i}") as cache, torch.no_grad():
                llama64(input_ids=ids[:, cache.get_seq_length() :], cache=cache)
        assert store.pool.capacity > 4 * fresh[0]
        store.clear()
        assert store.stats.blocks_used == store.stats.blocks_pinned == 6
        assert _books(store)[:4] == (fresh[0], fresh[1], fresh[2] - 6, fresh[3] - 6)  # 127 blocks before the fix
        store.check_invariants()
        kept = compare(llama64, store, _prompt(71, system), namespace="kept", do_sample=False)
        _exact(kept)
        assert kept.cache.stats.cached_tokens == 24
        store.unpin(system.tolist(), namespace="kept")
        store.clear()
        assert _books(store) == fresh
        later = compare(llama64, store, _prompt(72, system), do_sample=False)  # an ordinary request, against stock
        _exact(later)
        assert later.cache.stats.cached_tokens == 0
        store.check_invariants()
