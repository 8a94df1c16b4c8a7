"""PrefixStore and PagedPrefixCache under random sequences of requests, forks, decode steps, releases,
pins, unpins, evictions and clears, against a reference that only remembers which token sequences were
computed and which must still be cached. ``check_invariants()`` runs after every step.

The model's forward is simulated: each step calls the cache's forward protocol (``cache.forward.begin``,
``update`` per layer, ``cache.forward.end``) with K set to a hash of the row's tokens up to that position
and V to the position, so every block read back can be checked against the tokens it claims to hold:
a block shared wrongly, freed while read, or overwritten without copy-on-write shows up as a wrong hash.
"""

from __future__ import annotations

import gc
import re
import tempfile
import threading
import weakref

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import prefixkv
from prefixkv import CapacityError
from prefixkv.hf.proof import ForwardInputs
from prefixkv.kv.tier import chunk_keys

BLOCK = 2
BUDGET = 8
MAX_LIVE = 3
MAX_ROWS = 4
MAX_LEN = 18
PRIME = 2**31 - 1

MODEL = prefixkv.models.tiny_model(
    "llama", dtype=torch.float64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32
)


pytestmark = pytest.mark.usefixtures("fast_gc")  # drop() collects garbage often


tokens = st.lists(st.integers(3, 6), min_size=1, max_size=8)  # a small alphabet: shared prefixes are common


ADAPTERS = ("a", "b", "disabled")  # the namespaces AdapterTierStoreMachine switches between


def salt(space: object) -> int:
    """What starts the hashes of K written under a namespace: 0 for none, else the adapter's place + 1."""
    return 0 if space is None else ADAPTERS.index(str(space)) + 1


def prefix_hashes(seq: list[int], start: int = 0) -> list[int]:
    """K written for position p of a row: a hash of the row's tokens ``[0, p]``, started at ``start``
    (:func:`salt`: the same tokens have other K/V under another adapter)."""
    out, h = [], start
    for t in seq:
        h = (h * 1000003 + t + 1) % PRIME
        out.append(h)
    return out


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def assert_blocks_hold(store: prefixkv.PrefixStore, seq: list[int], blocks: list[int], n: int) -> None:
    """The first ``n`` positions of ``seq``, read from ``blocks``, hold its hashes (K) under the store's current
    namespace and its positions (V)."""
    if n == 0:
        return
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    want_k = torch.tensor(prefix_hashes(seq[:n], salt(store.blocks.space())), dtype=torch.float64)
    for layer, (k, v) in enumerate(zip(store.pool.keys, store.pool.values)):
        got_k = k.view(k.shape[0], -1, k.shape[3]).index_select(1, slots).transpose(0, 1)  # [n, kv_heads, head_dim]
        got_v = v.view(v.shape[0], -1, v.shape[3]).index_select(1, slots).transpose(0, 1)
        assert (got_k == want_k[:, None, None]).all(), f"layer {layer}: blocks {blocks} do not hold {seq[:n]}"
        want_v = torch.arange(n, dtype=torch.float64) + 1000 * layer
        assert (got_v == want_v[:, None, None]).all(), f"layer {layer}: positions of {seq[:n]} are wrong"


def layer_inputs(
    cache: prefixkv.PagedPrefixCache, rows: list[list[int]], start: int, q: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K and V each layer's ``update`` gets for ``q`` new columns after ``start``."""
    spec = cache.store.pool.specs[0]
    h0 = salt(cache.store.blocks.space())
    k = torch.tensor([prefix_hashes(r, h0)[start : start + q] for r in rows], dtype=torch.float64)  # [B, q]
    k = k[:, None, :, None].expand(-1, spec.kv_heads, -1, spec.head_dim)  # [B, H, q, D]
    pos = torch.arange(start, start + q, dtype=torch.float64)[None, None, :, None].expand_as(k)
    return [(k.contiguous(), (pos + 1000 * layer).contiguous()) for layer in range(len(cache.store.pool.specs))]


def feed(cache: prefixkv.PagedPrefixCache, rows: list[list[int]], new: list[list[int]]) -> None:
    """One simulated forward of ``new[i]`` after ``rows[i]`` (which already holds them at the end)."""
    start = cache.get_seq_length()
    q = len(new[0])
    cache.forward.begin(ForwardInputs(torch.tensor(new)))
    for layer, (k, v) in enumerate(layer_inputs(cache, rows, start, q)):
        cache.update(k, v, layer)
    cache.forward.end(True)


class Fault(Exception):
    """The failure the machine injects."""


class inject:
    """Make ``obj.name`` raise :class:`Fault` on its ``nth`` call (0: the first) while the block runs."""

    def __init__(self, obj: object, name: str, nth: int) -> None:
        self.obj, self.name, self.nth, self.calls = obj, name, nth, 0

    def __enter__(self) -> inject:
        original = getattr(self.obj, self.name)

        def faulty(*args: object, **kwargs: object) -> object:
            self.calls += 1
            if self.calls - 1 == self.nth:
                raise Fault(self.name)
            return original(*args, **kwargs)

        setattr(self.obj, self.name, faulty)
        return self

    def __exit__(self, *exc: object) -> None:
        delattr(self.obj, self.name)


class Live:
    """A live cache and the reference's view of its rows."""

    def __init__(self, cache: prefixkv.PagedPrefixCache, rows: list[list[int]]) -> None:
        self.cache = cache
        self.rows = rows


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = self.make_store()
        self.live: list[Live] = []
        self.ever: set[tuple[int, ...]] = set()  # every sequence whose KV was ever published
        self.recent: set[tuple[int, ...]] = set()  # published since the last eviction or clear
        self.pins: list[tuple[int, ...]] = []
        self.evictions = 0

    def make_store(self) -> prefixkv.PrefixStore:
        return prefixkv.PrefixStore(MODEL, block_size=BLOCK, num_blocks=BUDGET)

    @initialize()
    def start(self) -> None:
        self.store.check_invariants()

    # -- reference bookkeeping -------------------------------------------------------------------

    def published(self, row: list[int]) -> tuple[int, ...]:
        return tuple(row[: len(row) // BLOCK * BLOCK])

    def record(self, live: Live) -> None:
        for row in live.rows:
            seq = self.published(row)
            if seq:
                self.ever.add(seq)
                self.recent.add(seq)

    def must_hold(self) -> set[tuple[int, ...]]:
        """Sequences the store cannot have dropped: pinned, read by a live cache, or published since
        the last eviction."""
        held = {self.published(r) for live in self.live for r in live.rows}
        return {s for s in held | set(self.pins) | self.recent if s}

    def after_capacity_error(self, err: CapacityError, rolled_back: bool = False) -> None:
        found = re.search(r"(\d+) more KV blocks are needed, (\d+) are free", str(err))
        assert found is not None, str(err)
        needed, free = (int(x) for x in found.groups())
        event("capacity error")
        assert needed > free
        if not rolled_back:  # a cache that failed to build gave back what it had locked meanwhile
            assert self.store.stats.blocks_evictable == 0, "the store gave up while it could still evict"

    def drop(self, live: Live, collect: bool) -> None:
        self.live.remove(live)
        if collect:
            ref = weakref.ref(live.cache)
            live.cache = None  # type: ignore[assignment]
            gc.collect()
            assert ref() is None, "the test still holds the cache it means to drop"
        else:
            live.cache.close()

    def run(self, live: Live, rows: list[list[int]], new: list[list[int]]) -> bool:
        """Feed ``live``; on a CapacityError check it and say so (outside the ``except``, whose
        traceback would keep the cache alive)."""
        try:
            feed(live.cache, rows, new)
        except CapacityError as err:
            self.after_capacity_error(err)
            return False
        return True

    # -- rules -----------------------------------------------------------------------------------

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data(), tail=tokens)
    def request(self, data: st.DataObject, tail: list[int]) -> None:
        """A new one-row cache: match and attach its prompt, then compute the rest."""
        bases = sorted(self.ever)
        base = list(data.draw(st.sampled_from(bases))) if bases and data.draw(st.booleans()) else []
        prompt = (base + tail)[:MAX_LEN]
        queries = self.store.stats.queries
        try:
            cache = prefixkv.PagedPrefixCache(self.store, torch.tensor([prompt]))
        except CapacityError as err:  # the copy of a part-matched block found no room
            self.after_capacity_error(err, rolled_back=True)
            return
        assert self.store.stats.queries == queries + 1
        reused = cache.stats.cached_tokens
        best = max((lcp(tuple(prompt), s) for s in self.ever), default=0)
        surely = max((lcp(tuple(prompt), s) for s in self.must_hold()), default=0)
        assert min(surely, len(prompt) - 1) <= reused <= min(best, len(prompt) - 1)
        assert_blocks_hold(self.store, prompt, cache._rowset.rows[0].table, reused)
        live = Live(cache, [prompt])
        del cache
        self.live.append(live)
        if self.run(live, [prompt], [prompt[reused:]]):
            self.record(live)
        else:
            self.drop(live, collect=data.draw(st.booleans()))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), q=st.integers(1, 3))
    def decode(self, data: st.DataObject, q: int) -> None:
        """Feed ``q`` more tokens to every row of a live cache (its rows may share part-filled blocks)."""
        live = data.draw(st.sampled_from(self.live))
        if len(live.rows[0]) + q > MAX_LEN:
            return
        new = [data.draw(st.lists(st.integers(3, 6), min_size=q, max_size=q)) for _ in live.rows]
        rows = [r + n for r, n in zip(live.rows, new)]
        if self.run(live, rows, new):
            live.rows = rows
            self.record(live)
        else:
            self.drop(live, collect=data.draw(st.booleans()))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Beam-style reorder or expansion: rows share blocks by refcount."""
        live = data.draw(st.sampled_from(self.live))
        n = data.draw(st.integers(1, MAX_ROWS))
        picks = data.draw(st.lists(st.integers(0, len(live.rows) - 1), min_size=n, max_size=n))
        live.cache.reorder_cache(torch.tensor(picks))
        live.rows = [list(live.rows[i]) for i in picks]

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        data=st.data(),
        tail=tokens,
        where=st.sampled_from(["copy_block", "allocate", "match", "insert"]),
        nth=st.integers(0, 2),
    )
    def faulty_request(self, data: st.DataObject, tail: list[int], where: str, nth: int) -> None:
        """A request whose construction, allocation, copy-on-write or publish raises midway: refcounts stay
        exact (the invariants after this step) and the cache is either usable or gone."""
        bases = sorted(self.ever)
        base = list(data.draw(st.sampled_from(bases))) if bases and data.draw(st.booleans()) else []
        prompt = (base + tail)[:MAX_LEN]
        target = {"copy_block": self.store.pool, "allocate": self.store.blocks._allocator}.get(
            where, self.store.blocks._trie
        )
        cache = None
        with inject(target, where, nth) as fault:
            try:
                cache = prefixkv.PagedPrefixCache(self.store, torch.tensor([prompt]))
                reused = cache.stats.cached_tokens
                feed(cache, [prompt], [prompt[reused:]])
            except (Fault, CapacityError):
                event(f"fault in {where}" if fault.calls > nth else "capacity error")
                if cache is not None:
                    cache.close()
                return
        live = Live(cache, [prompt])
        del cache
        self.live.append(live)
        self.record(live)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), q=st.integers(1, 2))
    def cancel(self, data: st.DataObject, q: int) -> None:
        """close() from another thread while a forward of that cache runs: nothing is freed until the forward
        ends, and the forward writes nothing after the close."""
        live = data.draw(st.sampled_from(self.live))
        if len(live.rows[0]) + q > MAX_LEN:
            return
        cache = live.cache
        new = [data.draw(st.lists(st.integers(3, 6), min_size=q, max_size=q)) for _ in live.rows]
        rows = [r + n for r, n in zip(live.rows, new)]
        inside, resume = threading.Event(), threading.Event()
        outcome: list[BaseException] = []
        paused: list[bool] = []

        def forward() -> None:
            start = cache.get_seq_length()
            try:
                cache.forward.begin(ForwardInputs(torch.tensor(new)))
                inputs = layer_inputs(cache, rows, start, q)
                cache.update(*inputs[0], 0)
                paused.append(True)
                inside.set()
                resume.wait(10)
                for layer, (k, v) in enumerate(inputs[1:], start=1):
                    cache.update(k, v, layer)
            except BaseException as e:
                outcome.append(e)
            finally:
                inside.set()
                cache.forward.end(False)  # what the always-called forward hook does after a raise

        thread = threading.Thread(target=forward)
        thread.start()
        inside.wait(10)
        held = list(cache._rowset.held_blocks())
        cache.close()
        if paused:  # else the forward had already failed (no room) and ended
            event("cancelled mid-forward")
            assert all(self.store.blocks.refcount(b) > 0 for b in held), "close() freed blocks a running forward holds"
            self.store.check_invariants()
        resume.set()
        thread.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], prefixkv.CacheMisuseError if paused else CapacityError)
        assert cache._rowset.rows == [], "the forward's end did not give the blocks back"
        self.live.remove(live)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), collect=st.booleans())
    def release(self, data: st.DataObject, collect: bool) -> None:
        """Close a cache, or drop it and let the garbage collector give its blocks back."""
        self.drop(data.draw(st.sampled_from(self.live)), collect)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        query = data.draw(tokens)
        if self.ever and data.draw(st.booleans()):
            query = list(data.draw(st.sampled_from(sorted(self.ever)))) + query
        (m,) = self.store.blocks.lookup([query], self.store.blocks.space())
        best = max((lcp(tuple(query), s) for s in self.ever), default=0)
        surely = max((lcp(tuple(query), s) for s in self.must_hold()), default=0)
        assert surely <= m.length <= best
        assert_blocks_hold(self.store, query, m.blocks, m.length)

    @precondition(lambda self: self.must_hold())
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        """Pin a prefix the store must hold (so no forward is needed)."""
        seq = data.draw(st.sampled_from(sorted(self.must_hold())))
        seq = seq[: data.draw(st.integers(1, len(seq)))]
        queries, pinned = self.store.stats.queries, self.store.stats.blocks_pinned
        try:
            assert self.store.pin(list(seq)) == len(seq)
        except CapacityError as err:
            assert f"over the budget of {BUDGET} blocks" in str(err)
            assert self.store.stats.blocks_pinned == pinned
            return
        assert self.store.stats.queries == queries, "pinning a cached prefix ran a forward"
        self.pins.append(seq)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.pins))
        self.store.unpin(list(seq))
        self.pins.remove(seq)

    @rule(n=st.integers(1, BUDGET))
    def evict(self, n: int) -> None:
        """Make room for ``n`` blocks, as an allocation would."""
        try:
            with self.store.blocks.lock:
                self.store.blocks.room.ensure_free(n)
        except CapacityError as err:
            self.after_capacity_error(err)
            return
        assert self.store.blocks._allocator.num_free >= n

    @rule()
    def clear(self) -> None:
        before = self.store.stats
        freed = self.store.clear()
        after = self.store.stats
        assert freed == before.blocks_evictable == before.blocks_used - after.blocks_used
        assert after.blocks_evictable == 0
        if self.store.tier is not None:
            assert len(self.store.tier) == 0, "clear() left blocks in the second tier"
        self.recent.clear()

    # -- checks after every step -----------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        store = self.store
        store.check_invariants()
        s = store.stats
        if s.evictions != self.evictions:
            event("eviction")
            self.evictions = s.evictions
            self.recent.clear()
        assert store.pool.capacity <= BUDGET + 1
        assert s.blocks_used + s.blocks_free == BUDGET
        assert s.blocks_pinned <= BUDGET
        assert store.blocks._trie.policy.queued() <= 2 * s.nodes + 65
        for seq in self.must_hold():
            m = store.blocks._trie.match(seq, store.blocks.space())
            assert m.length == len(seq), f"{seq} was dropped while it had to stay"
            assert_blocks_hold(store, list(seq), m.blocks, m.length)
        for live in self.live:
            for seq, row in zip(live.rows, live.cache._rowset.rows):
                assert row.proven and row.keys == seq
                assert_blocks_hold(store, seq, row.table, len(seq))

    def teardown(self) -> None:
        gc.collect()  # caches that failed to build
        for live in list(self.live):
            self.drop(live, collect=False)
        for seq in self.pins:
            self.store.unpin(list(seq))
        self.store.check_invariants()
        self.store.clear()
        s = self.store.stats
        assert s.blocks_used == 0 and s.nodes == 0, "blocks leaked"
        self.store.close()


StoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_store_machine = StoreMachine.TestCase


def whole(n: int) -> int:
    return n // BLOCK * BLOCK


class TieredStoreMachine(StoreMachine):
    """The same moves over a pool with an unbounded second tier in host memory, plus the tier's own moves:
    everything evicted at once into the tier, and lookups that must bring back every whole block ever
    published since the last ``clear()`` (which drops the pool's prefixes without offloading them, and empties
    the tier)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: set[tuple[int, ...]] = set()  # published since the last clear: in the pool or the tier

    def make_store(self) -> prefixkv.PrefixStore:
        return prefixkv.PrefixStore(MODEL, block_size=BLOCK, num_blocks=BUDGET, offload="cpu")

    def record(self, live: Live) -> None:
        super().record(live)
        self.kept.update(self.published(row) for row in live.rows if len(row) >= BLOCK)

    @rule()
    def clear(self) -> None:
        super().clear()
        self.kept.clear()

    @precondition(lambda self: not self.live and not self.pins)
    @rule()
    def offload_everything(self) -> None:
        """Evict every cached prefix: each one's whole blocks are then in the tier."""
        with self.store.blocks.lock:
            self.store.blocks.room.ensure_free(BUDGET)
        assert self.store.stats.blocks_used == 0
        tier = self.store.tier
        assert tier is not None
        for seq in self.kept:
            keys = chunk_keys(list(seq), BLOCK, len(seq) // BLOCK, self.store.blocks.space())
            assert all(k in tier for k in keys), f"{seq} left no blocks"
        self.recent.clear()

    @precondition(lambda self: self.kept and not self.live and not self.pins)
    @rule(data=st.data(), tail=tokens)
    def restore(self, data: st.DataObject, tail: list[int]) -> None:
        """A lookup extends its match through the tier by every whole block published since the last clear
        (as far as the pool holds them all)."""
        base = list(data.draw(st.sampled_from(sorted(self.kept))))
        query = base[: data.draw(st.integers(1, len(base)))] + tail
        tier = self.store.tier
        assert tier is not None
        restored = tier.stats.restored
        (m,) = self.store.blocks.lookup([query], self.store.blocks.space())
        floor = max(whole(lcp(tuple(query), s)) for s in self.kept)
        assert min(floor, BUDGET * BLOCK) <= m.length <= max(lcp(tuple(query), s) for s in self.ever)
        assert_blocks_hold(self.store, query, m.blocks, m.length)
        event("restored from the tier" if tier.stats.restored > restored else "nothing to restore")


class DiskTierStoreMachine(StoreMachine):
    """The same moves over a pool with a disk tier smaller than the pool (its own LRU drops blocks)."""

    def make_store(self) -> prefixkv.PrefixStore:
        self.directory = tempfile.TemporaryDirectory()
        per_block = prefixkv.PrefixStore(MODEL, block_size=BLOCK).bytes_per_block
        return prefixkv.PrefixStore(
            MODEL,
            block_size=BLOCK,
            num_blocks=BUDGET,
            offload="disk",
            offload_dir=self.directory.name,
            max_offload_memory=4 * (per_block + 1024),  # a few blocks, safetensors headers included
        )

    def teardown(self) -> None:
        super().teardown()
        self.directory.cleanup()


class AdapterTierStoreMachine(TieredStoreMachine):
    """The tiered moves under a namespace that switches, as a LoRA model's does when an adapter is set or
    disabled (``store.blocks.space()``, which every lookup, publication and tier key takes): K written under one
    namespace carry its :func:`salt`, and the reference keeps what was published per namespace, so a block
    published or offloaded under one adapter and served under another shows up as a wrong hash or a match
    longer than anything published under the active one."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = ADAPTERS[0]
        self.store.blocks.space = lambda: self.adapter  # type: ignore[method-assign]
        self.elsewhere: dict[str, tuple[set[tuple[int, ...]], set[tuple[int, ...]]]] = {}  # adapter -> ever, kept

    @precondition(lambda self: not self.live and not self.pins)
    @rule(adapter=st.sampled_from(ADAPTERS))
    def switch_adapter(self, adapter: str) -> None:
        """Set another adapter (or disable them): what was published under the others is not there to reuse."""
        self.elsewhere[self.adapter] = (self.ever, self.kept)
        self.ever, self.kept = self.elsewhere.pop(adapter, (set(), set()))
        self.recent = set()  # what this namespace published may have been evicted meanwhile
        self.adapter = adapter
        event(f"adapter {adapter}")

    @rule()
    def clear(self) -> None:
        super().clear()
        for _, kept in self.elsewhere.values():
            kept.clear()


TieredStoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tiered_store_machine = TieredStoreMachine.TestCase
DiskTierStoreMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_disk_tier_store_machine = DiskTierStoreMachine.TestCase
AdapterTierStoreMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_adapter_tier_store_machine = AdapterTierStoreMachine.TestCase


def test_unpin_of_unpinned_ids_is_a_clear_error() -> None:
    store = prefixkv.PrefixStore(MODEL, block_size=BLOCK, num_blocks=BUDGET)
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin([3, 4, 5])
    with pytest.raises(ValueError, match="at least one token"):
        store.pin([])
    store.close()
