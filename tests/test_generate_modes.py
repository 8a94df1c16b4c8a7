"""Every way of calling ``generate`` with a ``PagedPrefixCache``, cold and warm, on a tiny float64 Llama:
the logits equal stock ``generate`` with ``DynamicCache`` (within 1e-6), the tokens are identical, and the
cached prefix is reused (fewer columns fed, blocks shared, not copied).

Each test runs on four kinds of store (``kind``): the plain one; ``kv_dtype="int8"`` (against a stock cache
that quantizes each token by the pool's own quantizer, within 1e-6 too); and a small pool of ``POOL`` blocks
with a second tier in host memory or on disk, into which the warm-up call's blocks are evicted before the
test, so that every warm lookup brings its prefix back from the tier (exact). Every reference runs on a copy
of the model taken before any store (``conftest.stock_twin``). ``store.check_invariants()`` runs after every
forward (every step of every ``generate``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import (
    STOCK_TAKES_NEW_TOKENS,
    FeedCounter,
    cache_kw,
    compare,
    left_pad,
    random_tokens,
    reference_cache,
    stock_twin,
)
from transformers import LogitsProcessor, LogitsProcessorList, TextIteratorStreamer

import prefixkv
from prefixkv import CacheMisuseError, PagedPrefixCache, PrefixStore

TOL = 1e-6
BS = 4
POOL = 40  # blocks of the primary pool when a second tier is under it (a padded batch of 3 needs 33)
SYSTEM = random_tokens(32, seed=101)  # the shared prefix: 8 whole blocks of 4
KINDS = ("plain", "int8", "cpu", "disk")
TIERED = ("cpu", "disk")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass(frozen=True)
class Tol:
    """What a kind of store must match: stock ``generate`` with the cache of :func:`conftest.reference_cache`
    for its ``kv_dtype``, logits within ``logits`` at every step and identical tokens."""

    logits: float
    kv_dtype: str | None = None


@pytest.fixture
def tol(kind: str) -> Tol:
    return Tol(TOL, kv_dtype="int8") if kind == "int8" else Tol(TOL)


def _agree(out: Any, ref: Any, tol: Tol, scores: str = "logits") -> bool:
    """``out`` matches ``ref`` within ``tol``: the sequences of two generate outputs, and their per-step
    ``scores`` (``"logits"`` or ``"scores"``)."""
    mine, theirs = getattr(out, scores), getattr(ref, scores)
    return _agree_steps(out.sequences[:, -len(mine) :], ref.sequences[:, -len(theirs) :], mine, theirs, tol)


def _agree_steps(new: torch.Tensor, ref_new: torch.Tensor, mine: Any, theirs: Any, tol: Tol) -> bool:
    """Generated tokens ``[B, steps]`` and per-step scores agree within ``tol`` (``-inf`` where both are)."""

    def close(steps: int) -> bool:
        return all(
            bool(torch.isclose(a.double(), b.double(), atol=tol.logits, rtol=0).all())
            for a, b in zip(mine[:steps], theirs[:steps], strict=True)
        )

    return new.shape == ref_new.shape and torch.equal(new, ref_new) and close(len(mine))


@pytest.fixture
def new_store(llama64: Any, kind: str, tmp_path: Any) -> Iterator[Any]:
    """Builds stores of this test's ``kind`` whose invariants are checked after every forward."""
    made: list[PrefixStore] = []

    def build() -> PrefixStore:
        kw: dict[str, Any] = {"kv_dtype": "int8"} if kind == "int8" else {}
        if kind in TIERED:
            kw.update(
                num_blocks=POOL, offload=kind, offload_dir=tmp_path / f"tier{len(made)}" if kind == "disk" else None
            )
        store = PrefixStore(llama64, block_size=BS, **kw)
        made.append(store)
        return store

    def check(*_: Any) -> None:
        for s in made:
            s.check_invariants()

    handle = llama64.register_forward_hook(check)
    try:
        yield build
    finally:
        handle.remove()
        for s in made:
            s.close()


def _offload_all(store: PrefixStore) -> None:
    """Evict every cached prefix of a tiered store into its second tier (no-op for other kinds)."""
    if store.tier is not None:
        with store.blocks.lock:
            store.blocks.room.ensure_free(POOL)
        assert store.stats.blocks_used == 0 and store.stats.offload is not None and store.stats.offload.blocks


def _prompt(seed: int, n: int = 5) -> torch.Tensor:
    return torch.cat([SYSTEM, random_tokens(n, seed=seed)])[None]


@pytest.fixture
def store(llama64: Any, new_store: Any) -> Iterator[PrefixStore]:
    """A store whose trie already holds SYSTEM (and the reply of one earlier call); for the tiered kinds,
    those blocks were evicted to the second tier and brought back from it."""
    s = new_store()
    first = compare(llama64, s, _prompt(seed=100, n=4))  # 36 prompt + 7 fed generated tokens: 10 blocks cached
    if s.tier is not None:
        _offload_all(s)
        s.blocks.lookup([first.out.sequences[0].tolist()])  # brings the 10 blocks back from the tier
        assert s.stats.blocks_used == 10 and s.stats.offload is not None and s.stats.offload.restored == 10
    yield s
    s.check_invariants()


def _stock(model: Any, tol: Tol, ids: torch.Tensor, seed: int = 0, **kwargs: Any) -> Any:
    """Stock ``generate`` on a copy of ``model`` prefixkv never touched, with the cache this kind of store must
    match (for int8, a ``DynamicCache`` that quantizes each token as the pool does)."""
    torch.manual_seed(seed)
    kwargs.setdefault("pad_token_id", 0)
    twin = stock_twin(model)
    cache = reference_cache(twin, tol.kv_dtype)
    return twin.generate(ids, **cache_kw(cache), output_logits=True, return_dict_in_generate=True, **kwargs)


def _paged(model: Any, cache: PagedPrefixCache, ids: torch.Tensor, seed: int = 0, **kwargs: Any) -> Any:
    torch.manual_seed(seed)
    kwargs.setdefault("pad_token_id", 0)
    return model.generate(ids, **cache_kw(cache), output_logits=True, return_dict_in_generate=True, **kwargs)


def _assert_same(out: Any, ref: Any, tol: Tol) -> None:
    assert _agree(out, ref, tol)


# -- decoding strategies, cold and warm --------------------------------------------------------------

STRATEGIES = {
    "greedy": dict(do_sample=False),
    "top_k": dict(do_sample=True, top_k=20, temperature=0.7),
    "top_p": dict(do_sample=True, top_p=0.8, temperature=1.3),
    "min_new_tokens": dict(do_sample=False, min_new_tokens=6, max_new_tokens=8),
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_decoding_strategies_cold_and_warm(llama64: Any, strategy: str, tol: Tol, new_store: Any) -> None:
    kwargs = STRATEGIES[strategy]
    store = new_store()
    cold = compare(llama64, store, _prompt(seed=1), seed=3, **kwargs)
    _offload_all(store)
    warm = compare(llama64, store, _prompt(seed=2), seed=3, **kwargs)
    for result in (cold, warm):
        assert _agree(result.out, result.ref, tol)
    assert cold.cache.stats.cached_tokens == 0 and cold.fed_tokens == 37
    assert warm.cache.stats.cached_tokens == 32 and warm.fed_tokens == 5


def test_min_new_tokens_holds_back_eos(llama64: Any, tol: Tol, new_store: Any) -> None:
    ids = _prompt(seed=4)
    free = _stock(llama64, tol, ids, do_sample=False, max_new_tokens=8)
    eos = int(free.sequences[0, ids.shape[1] + 1])  # the second generated token becomes EOS
    store = new_store()
    compare(llama64, store, _prompt(seed=5))
    _offload_all(store)
    early = compare(llama64, store, ids, eos_token_id=eos, do_sample=False)
    _offload_all(store)
    held = compare(llama64, store, ids, eos_token_id=eos, min_new_tokens=6, do_sample=False)
    assert _agree(early.out, early.ref, tol) and early.out.sequences.shape[1] == ids.shape[1] + 2
    assert _agree(held.out, held.ref, tol) and held.out.sequences.shape[1] > ids.shape[1] + 2
    assert early.cache.stats.cached_tokens == 32
    assert held.cache.stats.cached_tokens == 36  # the early call cached this prompt's 9 whole blocks


def test_eos_finishes_some_rows_of_a_padded_batch_early(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    warm, cold = _prompt(seed=6)[0], random_tokens(29, seed=7)
    ids, mask = left_pad([warm, cold])
    free = _stock(llama64, tol, ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    new = free.sequences[:, ids.shape[1] :]
    # an EOS that row 0 generates at step 2 and row 1 never does
    eos = next(int(t) for t in new[0, 1:] if int(t) not in new[1].tolist())
    result = compare(llama64, store, ids, mask, eos_token_id=eos, do_sample=False)
    assert _agree(result.out, result.ref, tol)
    rows = result.out.sequences[:, ids.shape[1] :]
    assert eos in rows[0].tolist() and eos not in rows[1].tolist()
    assert rows[0, -1] == 0  # padded after its EOS while row 1 went on
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [8, 0]  # the cold row's 8 pads allow 8


def test_stop_strings(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    tok = prefixkv.models.tiny_tokenizer()
    ids = _prompt(seed=8)
    free = _stock(llama64, tol, ids, do_sample=False, max_new_tokens=8)
    words = tok.convert_ids_to_tokens(free.sequences[0, ids.shape[1] + 2 : -1].tolist())
    word = next(w for w in words if w.isalpha())  # a whole word the model says before its last step
    result = compare(llama64, store, ids, stop_strings=[word], tokenizer=tok, do_sample=False)
    assert _agree(result.out, result.ref, tol)
    assert result.out.sequences.shape[1] < free.sequences.shape[1]  # stopped before max_new_tokens
    assert tok.decode(result.out.sequences[0, ids.shape[1] :]).endswith(word)
    assert result.cache.stats.cached_tokens == 32


# -- several sequences per prompt: blocks shared, copied only where written ---------------------------


class _Probe(LogitsProcessor):
    """Records ``store.stats`` at every step and leaves the scores alone (so stock runs are unchanged)."""

    def __init__(self, store: PrefixStore) -> None:
        self.store = store
        self.blocks_used: list[int] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.blocks_used.append(self.store.stats.blocks_used)
        return scores


def test_num_return_sequences_share_the_prompt_blocks(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    # shares SYSTEM and 2 more tokens with the earlier call: 8 whole blocks and a copied part-block
    ids = torch.cat([_prompt(seed=100, n=4)[:, :34], random_tokens(3, seed=9)[None]], dim=1)
    kw = dict(do_sample=True, top_k=50, num_return_sequences=3, max_new_tokens=8)
    ref = _stock(llama64, tol, ids, seed=11, **kw)
    before = store.stats.blocks_used  # 10 blocks cached by the earlier call
    probe = _Probe(store)
    with PagedPrefixCache(store, ids) as cache:
        out = _paged(llama64, cache, ids, seed=11, logits_processor=LogitsProcessorList([probe]), **kw)
        _assert_same(out, ref, tol)
        assert cache.stats.cached_tokens == 34
        shared = cache._rowset.rows[0].table[:8]
        assert all(row.table[:8] == shared for row in cache._rowset.rows)
        assert all(store.blocks.refcount(b) == 1 + 3 for b in shared)  # the trie and the 3 sequences
        # each sequence wrote into the shared part-block (copy-on-write), then published it whole with the same
        # keys: all three read the first one's copy and gave theirs back
        assert len({row.table[8] for row in cache._rowset.rows}) == 1
    # per sequence: 37 prompt + 7 fed tokens = 11 blocks, of which 8 are shared and 1 the first's: 2 of its own
    assert probe.blocks_used[-1] == before + 1 + 3 * 2
    assert probe.blocks_used[-1] < before + 3 * 11  # what a copy of the prefix per sequence would take
    assert out.sequences.shape[0] == 3 and len({tuple(s.tolist()) for s in out.sequences}) > 1


@pytest.mark.parametrize(
    "beams",
    [dict(num_beams=3), dict(num_beams=3, num_return_sequences=2), dict(num_beams=3, early_stopping=True)],
    ids=["beams", "beams+num_return_sequences", "beams+early_stopping"],
)
def test_beam_search_shares_blocks_through_reorder(
    llama64: Any, store: PrefixStore, beams: dict[str, Any], tol: Tol
) -> None:
    ids = _prompt(seed=12)
    kw = dict(do_sample=False, max_new_tokens=8, output_scores=True, **beams)
    ref = _stock(llama64, tol, ids, **kw)
    before = store.stats.blocks_used
    probe = _Probe(store)
    with PagedPrefixCache(store, ids) as cache:
        out = _paged(llama64, cache, ids, logits_processor=LogitsProcessorList([probe]), **kw)
        _assert_same(out, ref, tol)
        if torch.equal(out.sequences, ref.sequences):
            assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=tol.logits, rtol=0)
        assert cache.stats.cached_tokens == 32
        assert all(store.blocks.refcount(b) == 1 + 3 for b in cache._rowset.rows[0].table[:8])
    # each beam holds at most its 3 blocks past the shared prefix (37 + 7 tokens = 11 blocks);
    # reorder shares the beams' common blocks, so the pool never holds a prefix copy per beam
    assert max(probe.blocks_used) <= before + 3 * 3
    assert max(probe.blocks_used) < before + 3 * 11


# -- padded batches: one offset per batch (DESIGN.md rule 3) -------------------------------------------


def test_padded_batch_reuses_what_the_one_offset_allows(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    long_warm = _prompt(seed=13, n=8)[0]  # 40 tokens, 32 cached
    short_warm = _prompt(seed=14, n=4)[0]  # 36 tokens, 32 cached, 4 pads
    cold = random_tokens(30, seed=15)  # 30 tokens, nothing cached, 10 pads
    ids, mask = left_pad([long_warm, short_warm, cold])
    result = compare(llama64, store, ids, mask, do_sample=False)
    assert _agree(result.out, result.ref, tol)
    # the offset is min(pad + cached) over rows = min(0 + 32, 4 + 32, 10 + 0) = 10 columns
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [10, 6, 0]
    assert result.fed_tokens == ids.shape[1] - 10

    # the same shapes, without the cold row (new tails: the call above cached the old ones)
    long_warm, short_warm = _prompt(seed=29, n=8)[0], _prompt(seed=30, n=4)[0]
    both_warm, both_mask = left_pad([long_warm, short_warm])
    result = compare(llama64, store, both_warm, both_mask, do_sample=False)
    assert _agree(result.out, result.ref, tol)
    # without the cold row: min(0 + 32, 4 + 32) = 32 columns, 28 of them real tokens for the padded row
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [32, 28]
    assert result.fed_tokens == both_warm.shape[1] - 32


# -- assisted and prompt-lookup decoding ----------------------------------------------------------------


def _repetitive_prompt() -> torch.Tensor:
    """SYSTEM, then a phrase said twice, so prompt lookup finds candidates."""
    phrase = random_tokens(6, seed=16)
    return torch.cat([SYSTEM, phrase, random_tokens(2, seed=17), phrase])[None]


@pytest.fixture(scope="module")
def assistant() -> Any:
    return prefixkv.models.tiny_model("llama", dtype=torch.float64, seed=1)


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_assisted_decoding_reuses_the_prefix(
    llama64: Any, store: PrefixStore, assistant: Any, mode: str, tol: Tol
) -> None:
    ids = _repetitive_prompt()
    extra = dict(prompt_lookup_num_tokens=3) if mode == "prompt_lookup" else dict(assistant_model=assistant)
    kw = dict(do_sample=False, max_new_tokens=10, output_scores=True, **extra)
    ref = _stock(llama64, tol, ids, **kw)
    counter = FeedCounter(llama64)
    try:
        with PagedPrefixCache(store, ids) as cache:
            out = _paged(llama64, cache, ids, **kw)
    finally:
        counter.remove()
    _assert_same(out, ref, tol)
    assert cache.stats.cached_tokens == 32
    # the first forward re-feeds the prompt plus candidates, minus the 32 cached columns
    assert ids.shape[1] - 32 < counter.calls[0] < ids.shape[1]
    assert any(n > 1 for n in counter.calls[1:])  # later steps verified candidates too (and cropped the rejected)


def test_assisted_decoding_with_hidden_states_recomputes_with_a_warning(
    llama64: Any, store: PrefixStore, tol: Tol
) -> None:
    ids = _repetitive_prompt()
    kw = dict(do_sample=False, max_new_tokens=6, prompt_lookup_num_tokens=3, output_hidden_states=True)
    ref = _stock(llama64, tol, ids, **kw)
    with PagedPrefixCache(store, ids) as cache, pytest.warns(UserWarning, match="prefix reuse is off"):
        out = _paged(llama64, cache, ids, **kw)
    _assert_same(out, ref, tol)
    assert cache.stats.cached_tokens == 0
    for mine, theirs in zip(out.hidden_states, ref.hidden_states):  # hidden states within 1e-6 of their scale
        assert all(
            a.shape == b.shape and (a - b).abs().max() <= TOL * max(1.0, b.abs().max()) for a, b in zip(mine, theirs)
        )


# -- multi-turn chat ----------------------------------------------------------------------------------


def test_second_chat_turn_reuses_the_first_turns_prompt_and_reply(llama64: Any, tol: Tol, new_store: Any) -> None:
    tok = prefixkv.models.tiny_tokenizer()
    words = torch.randint(63, 256, (30,), generator=torch.Generator().manual_seed(18))  # whole words only
    system = " ".join(tok.convert_ids_to_tokens(words.tolist()))
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "ba be bi ?"}]
    # the reply must survive decoding and re-encoding: no specials (but EOS), punctuation or letter pieces
    kw = dict(do_sample=False, max_new_tokens=8, suppress_tokens=[t for t in range(63) if t != 2])
    store = new_store()
    turn1 = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    first = compare(llama64, store, turn1, **kw)
    reply = first.out.sequences[0, turn1.shape[1] :]
    chat += [
        {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)},
        {"role": "user", "content": "ko ku ?"},
    ]
    turn2 = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    known = turn1.shape[1] + len(reply) - 1  # the last generated token was never fed
    assert torch.equal(turn2[0, :known], first.out.sequences[0, :known])
    _offload_all(store)
    second = compare(llama64, store, turn2, **kw)
    assert _agree(second.out, second.ref, tol)
    assert second.cache.stats.cached_tokens == known // BS * BS > turn1.shape[1]


# -- outputs: streaming, scores and logits, embeddings ----------------------------------------------


def test_streaming_with_text_iterator_streamer(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    tok = prefixkv.models.tiny_tokenizer()
    ids = _prompt(seed=19)

    def stream(model: Any, cache: Any) -> tuple[str, Any]:
        streamer = TextIteratorStreamer(tok, skip_prompt=True)
        result: dict[str, Any] = {}
        kw = dict(**cache_kw(cache), streamer=streamer, max_new_tokens=8, do_sample=False, pad_token_id=0)
        kw.update(output_logits=True, return_dict_in_generate=True)
        worker = threading.Thread(target=lambda: result.update(out=model.generate(ids, **kw)))
        worker.start()
        text = "".join(streamer)
        worker.join()
        return text, result["out"]

    twin = stock_twin(llama64)
    ref_text, ref = stream(twin, reference_cache(twin, tol.kv_dtype))
    with PagedPrefixCache(store, ids) as cache:
        text, out = stream(llama64, cache)
    _assert_same(out, ref, tol)
    assert text == tok.decode(out.sequences[0, ids.shape[1] :]) and text.strip()
    assert text == ref_text
    assert cache.stats.cached_tokens == 32


def test_return_dict_with_scores_and_logits(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    kw = dict(do_sample=True, top_k=10, temperature=0.5, output_scores=True)
    result = compare(llama64, store, _prompt(seed=20), seed=21, **kw)
    assert _agree(result.out, result.ref, tol)
    assert _agree(result.out, result.ref, tol, "scores")  # -inf where top_k masked, in both
    assert any(torch.isinf(s).any() for s in result.out.scores)  # top_k masked some: the processed scores
    assert result.cache.stats.cached_tokens == 32


def test_inputs_embeds_only_stores_but_never_matches(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    ids = _prompt(seed=22)
    embeds = llama64.get_input_embeddings()(ids).detach()
    torch.manual_seed(0)
    twin = stock_twin(llama64)
    ref = twin.generate(
        inputs_embeds=embeds, **cache_kw(reference_cache(twin, tol.kv_dtype)), max_new_tokens=8, do_sample=False,
        pad_token_id=0, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    cached_before = store.stats.cached_tokens
    with PagedPrefixCache(store) as cache:
        torch.manual_seed(0)
        out = llama64.generate(
            inputs_embeds=embeds, **cache_kw(cache), max_new_tokens=8, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        assert sum(cache._rowset.held_blocks().values()) == 11  # 37 + 7 columns stored
    _assert_same(out, ref, tol)
    assert store.stats.cached_tokens == cached_before  # nothing published: the ids were never seen
    assert PagedPrefixCache(store, torch.cat([ids, out.sequences], dim=1)).stats.cached_tokens == 32


def test_soft_prompt_embeddings_are_never_published_under_their_ids(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    # generate(input_ids=..., inputs_embeds=...) computes the prompt from the embeddings, which need not be
    # those of the ids: their K/V must not be reused by a later call with the ids alone
    ids = _prompt(seed=33)
    gen = torch.Generator().manual_seed(34)
    soft = torch.randn(1, ids.shape[1], llama64.config.hidden_size, dtype=torch.float64, generator=gen)
    cached_before = store.stats.cached_tokens
    with pytest.warns(UserWarning, match="inputs_embeds"), PagedPrefixCache(store, ids) as cache:
        llama64.generate(input_ids=ids, inputs_embeds=soft, **cache_kw(cache), max_new_tokens=3, do_sample=False)
    assert store.stats.cached_tokens == cached_before
    result = compare(llama64, store, ids, do_sample=False)
    assert _agree(result.out, result.ref, tol)


# -- one cache, several calls --------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["whole_sequence", "new_tokens_and_full_mask"])
def test_cache_continues_a_second_call(llama64: Any, store: PrefixStore, style: str, tol: Tol) -> None:
    if style == "new_tokens_and_full_mask" and not STOCK_TAKES_NEW_TOKENS:
        pytest.skip("this transformers' generate cannot continue a cache from only the new tokens (before 5.3)")
    ids = _prompt(seed=23)
    counter = FeedCounter(llama64)
    try:
        with PagedPrefixCache(store, ids) as cache:
            first = _paged(llama64, cache, ids, do_sample=False, max_new_tokens=6)
            follow_up = torch.cat([first.sequences, random_tokens(5, seed=24)[None]], dim=1)
            counter.reset()
            if style == "whole_sequence":
                second = _paged(llama64, cache, follow_up, do_sample=False, max_new_tokens=6)
            else:  # transformers' other spelling: the tokens not yet fed, with a mask of the whole sequence
                new = follow_up[:, cache.get_seq_length() :]
                mask = torch.ones_like(follow_up)
                second = _paged(llama64, cache, new, attention_mask=mask, do_sample=False, max_new_tokens=6)
    finally:
        counter.remove()
    ref = _stock(llama64, tol, follow_up, do_sample=False, max_new_tokens=6)
    steps = len(second.logits)
    assert _agree_steps(second.sequences[:, -steps:], ref.sequences[:, -steps:], second.logits, ref.logits, tol)
    assert counter.calls[0] == 6  # the last token of the first call and the 5 new ones


def test_cache_refuses_new_tokens_placed_elsewhere(llama64: Any, store: PrefixStore) -> None:
    ids = _prompt(seed=31)
    with PagedPrefixCache(store, ids) as cache:
        _paged(llama64, cache, ids, do_sample=False, max_new_tokens=4)
        new = random_tokens(3, seed=32)[None]
        # a mask of 10 columns where the cache holds 40: all ones (generate drops it, the positions tell)
        # and with a pad (generate keeps it, its width tells)
        for mask in (
            torch.ones(1, 10, dtype=torch.long),
            torch.ones(1, 10, dtype=torch.long).index_fill(1, torch.tensor([0]), 0),
        ):
            with pytest.raises(CacheMisuseError, match="new tokens"):
                llama64.generate(
                    new, attention_mask=mask, **cache_kw(cache), max_new_tokens=2, do_sample=False, pad_token_id=0
                )


@pytest.mark.parametrize("other", ["different", "same", "shorter"])
def test_cache_refuses_a_call_that_does_not_continue_it(llama64: Any, store: PrefixStore, other: str, tol: Tol) -> None:
    ids = _prompt(seed=25)
    with PagedPrefixCache(store, ids) as cache:
        first = _paged(llama64, cache, ids, do_sample=False, max_new_tokens=6)
        wrong = {
            "different": torch.cat([random_tokens(45, seed=26)[None], first.sequences], dim=1),
            "same": ids,
            "shorter": ids[:, :20],
        }[other]
        with pytest.raises(CacheMisuseError, match=r"continues? "):
            llama64.generate(wrong, **cache_kw(cache), do_sample=False, max_new_tokens=3, pad_token_id=0)
        # the refused call changed nothing: the cache still continues its own sequence
        follow_up = torch.cat([first.sequences, random_tokens(3, seed=27)[None]], dim=1)
        second = _paged(llama64, cache, follow_up, do_sample=False, max_new_tokens=4)
    _assert_same(second, tol=tol, ref=_stock(llama64, tol, follow_up, do_sample=False, max_new_tokens=4))


class _Pause(LogitsProcessor):
    """Blocks the generate call at step ``at`` until released."""

    def __init__(self, at: int) -> None:
        self.at, self.step = at, 0
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.step += 1
        if self.step == self.at:
            self.reached.set()
            assert self.release.wait(timeout=30)
        return scores


def test_cache_refuses_a_call_while_another_thread_holds_it(llama64: Any, store: PrefixStore, tol: Tol) -> None:
    ids = _prompt(seed=28)
    kw = dict(do_sample=False, max_new_tokens=8)
    ref = _stock(llama64, tol, ids, **kw)
    pause = _Pause(at=3)
    result: dict[str, Any] = {}
    with PagedPrefixCache(store, ids) as cache:
        processors = LogitsProcessorList([pause])
        worker = threading.Thread(
            target=lambda: result.update(out=_paged(llama64, cache, ids, logits_processor=processors, **kw))
        )
        worker.start()
        try:
            assert pause.reached.wait(timeout=30)
            with pytest.raises(CacheMisuseError):
                llama64.generate(ids, **cache_kw(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
        finally:
            pause.release.set()
            worker.join()
    _assert_same(result["out"], ref, tol)
