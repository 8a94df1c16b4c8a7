"""The store's contract with the cache (``claim``, ``extend``, ``publish``, ``truncate``, ``fork``, ``release``):
what each mutates, and that one which raises leaves tables, refcounts and locks as they were."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import cache_kw

import prefixkv
from prefixkv.kv.holdings import Claim
from prefixkv.store import PrefixStore

PROMPT = list(range(3, 13))  # 10 tokens: two whole blocks of 4 and half of a third


class Fault(Exception):
    pass


@pytest.fixture
def store() -> Iterator[PrefixStore]:
    s = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
    s.pin(PROMPT)  # all 10 tokens cached, the part-filled third block included
    yield s
    s.close()


def state(store: PrefixStore, claims: list[Claim]) -> tuple[object, ...]:
    blocks = range(1, store.pool.capacity)
    return (
        [list(c.table) for c in claims],
        [c.node for c in claims],
        [store.blocks.refcount(b) for b in blocks],
        # the lock on each cached position (a claim may split an edge where its whole blocks end: no change)
        sorted((n.start + i, n.lock) for n in store.blocks._trie.nodes() for i in range(len(n.tokens))),
    )


def take_six(lengths: list[int]) -> list[int]:
    return [min(6, n) for n in lengths]


def test_claim_shares_whole_blocks_and_copies_a_part_block(store: PrefixStore) -> None:
    (claim,), reused = store.blocks.claim([PROMPT], None, take_six)
    match = store.blocks._trie.match(PROMPT)
    # it locks the node of the whole block it shares, split from the rest: what follows stays evictable
    assert reused == [6] and claim.node is not None and (claim.node.end, claim.node.lock) == (4, 2)
    assert claim.table[0] == match.blocks[0] and claim.table[1] != match.blocks[1]  # block 1 copied: written next
    assert store.blocks.refcount(claim.table[0]) == 2 and store.blocks.refcount(claim.table[1]) == 1
    store.check_invariants()
    store.blocks.release([claim])
    assert claim.table == [] and claim.node is None
    store.check_invariants()


def test_a_claim_that_raises_holds_nothing(store: PrefixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    before = state(store, [])
    monkeypatch.setattr(store.pool, "copy_block", lambda *a: (_ for _ in ()).throw(Fault()))
    with pytest.raises(Fault):
        store.blocks.claim([PROMPT, PROMPT], None, take_six)
    assert state(store, []) == before
    store.check_invariants()


@pytest.mark.parametrize("fail_at", [1, 2])
def test_extend_is_all_or_nothing(store: PrefixStore, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
    (claim,), _ = store.blocks.claim([PROMPT], None, take_six)
    claims = [claim, *store.blocks.fork([claim, claim])]  # three rows share the copied part-block
    before = state(store, claims)
    calls = []
    original = store.pool.copy_block

    def copy_block(*args: object) -> None:
        calls.append(args)
        if len(calls) == fail_at:
            raise Fault()
        original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store.pool, "copy_block", copy_block)
    with pytest.raises(Fault):
        store.blocks.extend(claims, [(6, 9)] * 3)
    assert state(store, claims) == before
    store.check_invariants()
    monkeypatch.setattr(store.pool, "copy_block", original)
    copied = store.blocks.extend(claims, [(6, 9)] * 3)
    # two rows copy the shared part-block, the third then holds it alone and writes in place
    assert copied == [0, 1] and len({c.table[1] for c in claims}) == 3
    assert all(len(c.table) == 3 for c in claims)
    store.check_invariants()
    store.blocks.release(claims)
    store.check_invariants()


def test_publish_continues_from_the_claims_node(store: PrefixStore) -> None:
    (claim,), _ = store.blocks.claim([PROMPT], None, lambda lengths: [8])
    store.blocks.extend([claim], [(8, 16)])
    tokens = [*PROMPT[:8], *range(50, 58)]
    store.blocks.publish(claim, tokens, known=8, end=16, space=None)
    assert claim.node is not None and claim.node.end == 16 and claim.node.lock == 1
    assert store.cached_length(tokens) == 16
    store.blocks.truncate([claim], [2])
    assert len(claim.table) == 2
    store.check_invariants()
    store.blocks.release([claim])
    store.check_invariants()


def test_the_layers_still_serve_generate(store: PrefixStore) -> None:
    ids = torch.tensor([[*PROMPT, 40, 41]])
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        store.hf_model.generate(ids, **cache_kw(cache), max_new_tokens=5, do_sample=False)
        assert cache.stats.cached_tokens == 10
        assert cache.block_tables()[0].blocks[:2] == tuple(store.blocks._trie.match(PROMPT).blocks[:2])
    store.check_invariants()
