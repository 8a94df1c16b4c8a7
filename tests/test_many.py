"""generate_many on a tiny float64 model: every row equals ``generate`` on its prompt alone (tokens, and logits
within 1e-6, with rows stopping early), results in input order or streamed, prompts as ids, text and chat, the
planner's batches, and eviction that a long batch job of one-off prompts cannot wreck."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import random_tokens, stock_twin
from transformers import DynamicCache

import prefixkv
from prefixkv.many.batches import batch_rows, row_order


def stock(model: Any, prompt: list[int], **kw: Any) -> Any:
    """The reference: generate on this prompt alone with a fresh DynamicCache, on a model prefixkv never touched."""
    twin = stock_twin(model)
    ids = torch.tensor([prompt])
    return twin.generate(
        ids, cache=DynamicCache(config=twin.config), return_dict_in_generate=True, pad_token_id=0, **kw
    )


def assert_same(g: prefixkv.Generation, ref: Any) -> None:
    new = ref.sequences[0, len(g.prompt) :].tolist()
    assert g.tokens == new, (g.index, g.tokens, new)
    assert g.logits is not None and g.logits.shape[0] == len(new)
    assert (g.logits - torch.stack(ref.logits)[:, 0]).abs().max() <= 1e-6


def assert_later_request_matches_stock(model: Any, store: prefixkv.PrefixStore, later: list[int], reused: int) -> None:
    """An ordinary request after the job, reusing at least ``reused`` tokens of what it published: stock's tokens
    and logits."""
    with prefixkv.PagedPrefixCache(store, torch.tensor([later])) as cache:
        mine = model.generate(
            torch.tensor([later]), cache=cache, max_new_tokens=5, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    ref = stock(model, later, max_new_tokens=5, do_sample=False, output_logits=True)
    assert cache.stats.cached_tokens >= reused and torch.equal(mine.sequences, ref.sequences)
    assert max((a - b).abs().max() for a, b in zip(mine.logits, ref.logits, strict=True)) <= 1e-6


def workload(systems: int, per_system: int, system_len: int = 40) -> list[list[int]]:
    """Prompts over a few shared system prompts, tails of 1 to 5 tokens (batches need padding), interleaved."""
    heads = [random_tokens(system_len, seed=s).tolist() for s in range(systems)]
    return [heads[i % systems] + random_tokens(1 + i % 5, seed=100 + i).tolist() for i in range(systems * per_system)]


def test_each_row_equals_generate_on_its_prompt_alone(llama64: Any) -> None:
    """Several batches over two system prompts, rows of different lengths, and an end-of-sequence token that
    stops some rows early: every row has the tokens and logits of its own call, in input order; then an ordinary
    request reusing what the batches published matches stock too."""
    prompts = workload(2, 4)
    first = [stock(llama64, p, max_new_tokens=10, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    eos = first[0][3]  # a token the model says: rows that say it stop there
    kw: dict[str, Any] = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos)
    refs = [stock(llama64, p, output_logits=True, **kw) for p in prompts]
    store = prefixkv.PrefixStore(llama64, block_size=8)
    out = prefixkv.generate_many(llama64, prompts, store=store, batch_size=3, progress=False, output_logits=True, **kw)
    assert [g.index for g in out] == list(range(len(prompts)))
    assert any(len(g.tokens) < 10 for g in out) and any(len(g.tokens) == 10 for g in out)
    for g, ref in zip(out, refs, strict=True):
        assert g.prompt == prompts[g.index]
        assert_same(g, ref)
    assert sum(g.cached_tokens > 0 for g in out) >= len(prompts) - 2  # one row per system prompt may compute it
    assert_later_request_matches_stock(llama64, store, prompts[1] + [7, 8, 9], reused=40)
    store.check_invariants()
    store.close()


def test_beam_search_rows_equal_their_own_calls(llama64: Any) -> None:
    prompts = workload(2, 2)
    kw: dict[str, Any] = dict(max_new_tokens=6, num_beams=3, do_sample=False, eos_token_id=None)
    refs = [stock(llama64, p, **kw).sequences[0, len(p) :].tolist() for p in prompts]
    out = prefixkv.generate_many(llama64, prompts, batch_size=3, progress=False, **kw)
    assert [g.tokens for g in out] == refs


def test_a_shared_prefix_is_computed_once_across_batches(llama64: Any) -> None:
    """Eight prompts on one 64-token system prompt in batches of three: the first batch computes it once (its
    stats charge that to one row), and every other row of every batch reuses it, computing only its tail and the
    columns by which it is shorter than its batch's longest row (one offset per batch, docs/how-it-works.md)."""
    store = prefixkv.PrefixStore(llama64, block_size=16)
    prompts = workload(1, 8, system_len=64)  # tails of 1-5 tokens
    out = prefixkv.generate_many(llama64, prompts, store=store, batch_size=3, max_new_tokens=2, progress=False)
    assert sorted(g.cached_tokens for g in out)[:2] == [0, 60]
    assert (
        all(g.cached_tokens >= 60 for g in out[1:] if g.cached_tokens) and sum(g.cached_tokens == 0 for g in out) == 1
    )
    store.close()


def test_stream_yields_every_prompt_once_as_its_batch_finishes(llama64: Any) -> None:
    prompts = workload(2, 3)
    kw: dict[str, Any] = dict(max_new_tokens=4, do_sample=False, batch_size=2, progress=False)
    listed = prefixkv.generate_many(llama64, prompts, **kw)
    store = prefixkv.PrefixStore(llama64, block_size=8)
    batches = batch_rows(prompts, store, 2, 4)
    streamed = list(prefixkv.generate_many(llama64, prompts, store=store, stream=True, **kw))
    assert [g.index for g in streamed] == [i for b in batches for i in b] != list(range(len(prompts)))
    assert [(g.index, g.tokens) for g in sorted(streamed, key=lambda g: g.index)] == [
        (g.index, g.tokens) for g in listed
    ]
    store.close()


def test_text_and_chat_prompts_with_a_tokenizer_and_stop_strings(llama64: Any) -> None:
    tok = prefixkv.models.tiny_tokenizer()
    system = {"role": "system", "content": "You answer in one short line, kindly and exactly."}
    chats = [[system, {"role": "user", "content": q}] for q in ("hello there", "what is two", "tell me more")]
    texts = ["You answer in one short line. hello", "You answer in one short line. bye"]
    kw: dict[str, Any] = dict(max_new_tokens=8, do_sample=False)
    out = prefixkv.generate_many(llama64, [*chats, *texts], tokenizer=tok, progress=False, **kw)
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats]
    ids += [tok(t)["input_ids"] for t in texts]
    for g, p in zip(out, ids, strict=True):
        new = stock(llama64, p, **kw).sequences[0, len(p) :].tolist()
        assert g.prompt == p and g.tokens == new and g.text == tok.decode(new, skip_special_tokens=True)
    word = tok.decode(out[0].tokens[2:4])  # a string the first row says: it stops there, as alone
    stopped = prefixkv.generate_many(llama64, ids, tokenizer=tok, stop_strings=[word], progress=False, **kw)
    for g, p in zip(stopped, ids, strict=True):
        ref = stock(llama64, p, stop_strings=[word], tokenizer=tok, **kw).sequences[0, len(p) :].tolist()
        assert g.tokens == ref
    assert len(stopped[0].tokens) < len(out[0].tokens)


def test_plan_sorts_by_prefix_puts_cached_work_first_and_keeps_the_budget(llama64: Any) -> None:
    a, b = list(range(10, 26)), list(range(30, 46))  # two 16-token prefixes: 4 blocks of 4
    rows = [[*a, 1], [*b, 1], [*a, 2], [*b, 2], [*a, 3]]
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=24)
    # a row needs ceil((17 + 4) / 4) = 6 blocks, less the 4 it shares with the row before it; a batch takes at most
    # half the 24 blocks
    assert batch_rows(rows, store, 8, 4) == [[0, 2, 4], [1, 3]]
    assert batch_rows(rows, store, 2, 4) == [[0, 2], [4, 1], [3]]
    store.pin(b)  # cached now, its rows go first; 4 blocks are pinned, so a batch takes at most 10
    assert batch_rows(rows, store, 8, 4) == [[1, 3, 0], [2, 4]]
    out = prefixkv.generate_many(llama64, rows, store=store, max_new_tokens=4, do_sample=False, progress=False)
    for g in out:
        assert g.tokens == stock(llama64, g.prompt, max_new_tokens=4, do_sample=False).sequences[0, 17:].tolist()
    store.unpin(b)
    store.close()


def test_calls_a_padded_batch_cannot_honour_are_refused(llama64: Any) -> None:
    store = prefixkv.PrefixStore(llama64)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(max_length=30), "use max_new_tokens"),
        (dict(max_new_tokens=2, num_beams=2, num_return_sequences=2), "repeat the prompt"),
        (dict(max_new_tokens=2, attention_mask=None), "padded by generate_many"),
        (dict(max_new_tokens=2, batch_size=0), "positive int"),
        (dict(max_new_tokens=2, num_beams=2, output_logits=True), "per beam"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            prefixkv.generate_many(llama64, [[5, 6, 7]], store=store, **kw)
    with pytest.raises(ValueError, match="pass tokenizer="):
        prefixkv.generate_many(llama64, ["some text"], max_new_tokens=2)
    with pytest.raises(ValueError, match="built for this model"):
        prefixkv.generate_many(prefixkv.models.tiny_model("llama"), [[5, 6]], store=store, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        prefixkv.generate_many(llama64, [[5], []], store=store, max_new_tokens=2)
    store.close()


def test_a_refused_image_keyword_says_why_for_the_model(llama64: Any) -> None:
    """The keywords of how images are encoded and the token types are refused for what they are: on a text model
    (no images to encode), on a vision-language one (no images in generate_many), never as "a batch's images"."""
    store = prefixkv.PrefixStore(llama64)
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (llama64, {"vision_feature_layer": -2}, "llama takes no images"),
        (llama64, {"token_type_ids": torch.zeros(1, 3, dtype=torch.long)}, "a tensor of one prompt's tokens"),
        (llama64, {"pixel_values": torch.zeros(1, 3, 4, 4)}, "a batch's images would not follow its rows"),
    ]
    for model, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            prefixkv.generate_many(model, [[5, 6, 7]], store=store, max_new_tokens=2, **kw)
    store.close()
    llava = prefixkv.models.tiny_model("llava", dtype=torch.float64)
    with pytest.raises(ValueError, match="sets how the images are encoded, and generate_many takes prompts of ids"):
        prefixkv.generate_many(llava, [[5, 6, 7]], max_new_tokens=2, vision_feature_layer=-2)


@pytest.mark.parametrize("protected", [True, False])
def test_a_scan_of_one_off_prompts_keeps_the_hot_ones(llama64: Any, protected: bool) -> None:
    """Four hot prompts used three times each, then a batch job of 1,000 one-off prompts through a store that
    holds a fraction of them: the hot ones still hit afterwards, and give stock's output. With the protection
    switched off (plain LRU) the scan evicts them: the test can fail."""
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=64)
    if not protected:
        store.blocks._trie.policy.protect_after = 10**9
    hot = [[*random_tokens(16, seed=500 + h).tolist(), 3] for h in range(4)]
    for _ in range(3):
        prefixkv.generate_many(llama64, hot, store=store, max_new_tokens=1, progress=False)
    scan = [random_tokens(8, seed=1000 + i).tolist() for i in range(1000)]
    prefixkv.generate_many(llama64, scan, store=store, batch_size=64, max_new_tokens=1, progress=False)
    assert store.stats.evictions > 500
    cached = [store.cached_length(p) for p in hot]
    if not protected:
        assert cached != [16] * 4
        store.close()
        return
    assert cached == [16] * 4  # the whole blocks
    out = prefixkv.generate_many(llama64, hot, store=store, max_new_tokens=4, output_logits=True, progress=False)
    for g in out:
        assert g.cached_tokens == 16  # all but the one token each call computes
        assert_same(g, stock(llama64, g.prompt, max_new_tokens=4, output_logits=True))
    store.check_invariants()
    store.close()


def test_a_soft_pin_outlasts_lower_priorities_but_never_blocks_the_store(llama64: Any) -> None:
    """``store.pin(ids, priority=p)``: under a plain LRU (protection off) a scan of one-off prompts evicts every
    unpinned prefix but leaves the soft-pinned one; the pin holds no budget (a store whose every block it fills
    still serves a new prompt, evicting it), ``unpin`` needs the same priority, and what it kept matches stock."""
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=16)
    store.blocks._trie.policy.protect_after = 10**9
    kept, other = random_tokens(16, seed=700).tolist(), random_tokens(16, seed=701).tolist()
    assert store.pin(kept, priority=90) == 16
    assert store.stats.blocks_pinned == 0  # a soft pin counts against no budget
    prefixkv.generate_many(llama64, [other], store=store, max_new_tokens=1, progress=False)
    scan = [random_tokens(8, seed=2000 + i).tolist() for i in range(40)]
    prefixkv.generate_many(llama64, scan, store=store, batch_size=4, max_new_tokens=1, progress=False)
    assert store.cached_length(other) < 16 and store.cached_length(kept) == 16
    (g,) = prefixkv.generate_many(
        llama64, [[*kept, 3]], store=store, max_new_tokens=3, output_logits=True, progress=False
    )
    assert g.cached_tokens == 16
    assert_same(g, stock(llama64, g.prompt, max_new_tokens=3, output_logits=True))
    refused = random_tokens(16, seed=703).tolist()
    before = store.cached_length(refused), store.stats
    for bad in (101, -1, 2.5, True):  # refused before any prefill: nothing computed, nothing pinned
        with pytest.raises(ValueError, match="an int from 0 to 100"):
            store.pin(refused, priority=bad)  # type: ignore[arg-type]
    assert (store.cached_length(refused), store.stats) == before
    with pytest.raises(ValueError, match="not pinned at priority 50"):
        store.unpin(kept, priority=50)
    big = random_tokens(60, seed=702).tolist()  # 15 blocks of 16: only room if the soft pin gives way
    (g,) = prefixkv.generate_many(llama64, [big], store=store, max_new_tokens=1, output_logits=True, progress=False)
    assert_same(g, stock(llama64, g.prompt, max_new_tokens=1, output_logits=True))
    store.unpin(kept, priority=90)
    store.check_invariants()
    store.close()


def _spy_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[list[int]], list[int]]]:
    """Record every ``generate`` call of generate_many: its prompts and each row's cached prompt tokens."""
    calls: list[tuple[list[list[int]], list[int]]] = []
    original = prefixkv.many.generation._Run.call

    def call(self: Any, prompts: list[list[int]], **more: Any) -> Any:
        out = original(self, prompts, **more)
        calls.append(([list(p) for p in prompts], out[2]))
        return out

    monkeypatch.setattr(prefixkv.many.generation._Run, "call", call)
    return calls


def test_refilling_rows_equal_their_own_calls(llama64: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that end at very different lengths, three places: as half a call's rows end, the call ends and the
    next carries on with the others (their tokens so far as prompts, read back from the store) and new prompts in
    the free places. Every row still has the tokens, logits and scores of its own call, as with refill=False; a
    later ordinary request matches stock."""
    prompts = workload(2, 5)
    answers = [stock(llama64, p, max_new_tokens=14, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    eos = sorted({answers[0][1], answers[3][6], answers[6][11]})  # tokens the model says: rows end at them
    kw: dict[str, Any] = dict(max_new_tokens=14, do_sample=False, eos_token_id=eos, output_logits=True)
    refs = [stock(llama64, p, output_scores=True, **kw) for p in prompts]
    lengths = [ref.sequences.shape[1] - len(p) for ref, p in zip(refs, prompts, strict=True)]
    assert min(lengths) <= 3 and max(lengths) == 14  # the rows do end far apart
    calls = _spy_calls(monkeypatch)
    store = prefixkv.PrefixStore(llama64, block_size=4)
    warmed: list[list[int]] = []
    warm = store.warm
    monkeypatch.setattr(store, "warm", lambda prompts, **kw: warmed.extend(map(list, prompts)) or warm(prompts, **kw))
    out = prefixkv.generate_many(llama64, prompts, store=store, batch_size=3, progress=False, output_scores=True, **kw)
    # the second system prompt is computed once, alone, while rows of the first run, so that its rows can join them
    assert len(warmed) == 1 and warmed[0] in (prompts[0][:40], prompts[1][:40])
    assert [g.index for g in out] == list(range(len(prompts)))
    for g, ref in zip(out, refs, strict=True):
        assert_same(g, ref)
        assert g.scores is not None and (g.scores - torch.stack(ref.scores)[:, 0]).abs().max() <= 1e-6
    continued = [
        (p, c) for prompts_, cached in calls for p, c in zip(prompts_, cached, strict=True) if p not in prompts
    ]
    assert continued, "no row was carried on into a later call"
    # a row's cached tokens are those of its own prompt, reused in its first call, also for a row carried on into
    # later calls (which reuse its own new tokens too: not the prompt's)
    first_call = {tuple(p): c for prompts_, cached in reversed(calls) for p, c in zip(prompts_, cached, strict=True)}
    for g in out:
        assert g.cached_tokens == first_call[tuple(g.prompt)] < len(g.prompt), (g.index, g.cached_tokens)
    assert all(c >= (len(p) - 1) // 4 * 4 - 4 for p, c in continued)  # what it said before came from the store
    # a prompt joins carried-on rows only with at most 4 blocks left to compute (every row computes that many)
    for prompts_, cached in calls:
        if any(p not in prompts for p in prompts_):
            assert max(len(p) - c for p, c in zip(prompts_, cached, strict=True)) <= 16
    assert len(calls) > len(batch_rows(prompts, prefixkv.PrefixStore(llama64, block_size=4), 3, 14))
    calls.clear()
    batches = prefixkv.generate_many(llama64, prompts, batch_size=3, progress=False, refill=False, **kw)
    assert [g.tokens for g in batches] == [g.tokens for g in out]
    assert all(p in prompts for prompts_, _ in calls for p in prompts_)  # refill=False never carries a row on
    assert_later_request_matches_stock(llama64, store, prompts[4] + [7, 8, 9], reused=40)
    store.check_invariants()
    store.close()


def test_refilling_keeps_a_users_prefixes_in_its_namespace(llama64: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refilled job of more prompts than one call holds, under ``namespace="alice"``: the system prompt that
    refill computes alone, before a call, is published for alice only; the shared namespace (and bob's) hold
    none of it, and a shared request after the job reuses nothing."""
    prompts = workload(2, 5)
    answers = [stock(llama64, p, max_new_tokens=14, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    eos = sorted({answers[0][1], answers[3][6], answers[6][11]})  # as in the test above: refill computes one alone
    kw: dict[str, Any] = dict(max_new_tokens=14, do_sample=False, eos_token_id=eos)
    store = prefixkv.PrefixStore(llama64, block_size=4)
    warmed: list[str | None] = []
    warm = store.warm
    monkeypatch.setattr(
        store, "warm", lambda prompts, **kw: warmed.append(kw.get("namespace", "(none given)")) or warm(prompts, **kw)
    )
    out = prefixkv.generate_many(
        llama64, prompts, store=store, batch_size=3, progress=False, namespace="alice", refill=True, **kw
    )
    assert warmed == ["alice"]  # the lone prefill ran, for alice
    for g in out:
        assert g.tokens == stock(llama64, g.prompt, **kw).sequences[0, len(g.prompt) :].tolist()
    for p in prompts:
        assert store.cached_length(p, namespace="alice") >= 40
        assert store.cached_length(p) == 0 and store.cached_length(p, namespace="bob") == 0
    with prefixkv.PagedPrefixCache(store, torch.tensor([prompts[1] + [7, 8]])) as cache:
        assert cache.stats.cached_tokens == 0
    store.check_invariants()
    store.close()


def test_refilling_within_a_store_budget_and_streaming(llama64: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a store of 40 blocks the rows running at once never need more than half of them (what the planner
    counts for each: prompt and new tokens, less the blocks it shares), where an unbounded store runs four at once;
    streamed results come as rows end, not in the planner's order, and equal the listed ones."""
    prompts = workload(3, 3)
    answers = [stock(llama64, p, max_new_tokens=12, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    kw: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, eos_token_id=[answers[0][2], answers[2][3]])
    listed = prefixkv.generate_many(llama64, prompts, batch_size=4, progress=False, **kw)
    for g in listed:
        assert g.tokens == stock(llama64, g.prompt, **kw).sequences[0, len(g.prompt) :].tolist()
    assert min(len(g.tokens) for g in listed) <= 3 and max(len(g.tokens) for g in listed) == 12
    calls = _spy_calls(monkeypatch)
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=40)
    order = row_order(prompts, store, 12, None)
    need = dict(order)
    streamed = list(
        prefixkv.generate_many(llama64, prompts, store=store, batch_size=4, stream=True, progress=False, **kw)
    )
    of = [[next(i for i, q in enumerate(prompts) if p[: len(q)] == q) for p in prompts_] for prompts_, _ in calls]
    assert all(sum(need[i] for i in rows) <= 20 for rows in of if len(rows) > 1)
    assert max(len(rows) for rows in of) < 4
    calls.clear()
    prefixkv.generate_many(llama64, prompts, batch_size=4, progress=False, **kw)
    assert max(len(prompts_) for prompts_, _ in calls) == 4
    assert sorted(g.index for g in streamed) == list(range(len(prompts)))
    assert [g.index for g in streamed] != [i for i, _ in order]  # rows come as they end
    assert [(g.index, g.tokens) for g in sorted(streamed, key=lambda g: g.index)] == [
        (g.index, g.tokens) for g in listed
    ]
    store.check_invariants()
    store.close()


def test_an_invariant_store_refills_with_the_same_bits_cold_and_warm_in_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refilling in an invariant store: rows end far apart, calls end early, rows carry on and waiting prompts
    join, and which prompts join a call follows the prompts alone, never what the store holds; so the same job,
    cold and after earlier calls cached other prompts whole (one that cold waits for a call of its own, as its
    30 tokens after the system prompt are not cached), makes the same calls and gives bit-identical tokens and
    logits in bfloat16."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.bfloat16)
    prompts = workload(2, 5, system_len=40)
    prompts[4] = prompts[4] + random_tokens(30, seed=7).tolist()
    kw: dict[str, Any] = dict(max_new_tokens=14, do_sample=False)
    answers = [stock(model, p, min_new_tokens=14, **kw).sequences[0, len(p) :].tolist() for p in prompts]
    eos = sorted({answers[0][1], answers[3][6], answers[6][11]})
    kw.update(eos_token_id=eos, output_logits=True)
    runs, made = [], []
    for warm in (False, True):
        calls = _spy_calls(monkeypatch)
        with prefixkv.PrefixStore(model, block_size=4, invariant=True, chunk_size=8) as store:
            if warm:  # earlier work: every prompt but the first two, whole, and the other system prompt
                store.warm([prompts[1][:40], *prompts[2:]], progress=False)
            runs.append(
                prefixkv.generate_many(model, prompts, store=store, batch_size=3, progress=False, refill=True, **kw)
            )
        made.append([prompts_ for prompts_, _ in calls])
    cold, warm_ = runs
    assert any(p not in prompts for prompts_ in made[0] for p in prompts_), "no row was carried on"
    assert made[0] == made[1]  # the same calls, on the same rows
    assert sum(g.cached_tokens for g in warm_) > sum(g.cached_tokens for g in cold)
    for a, b in zip(cold, warm_, strict=True):
        assert a.tokens == b.tokens and a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits), a.index


def test_refill_is_refused_where_a_row_cannot_go_on_in_a_later_call(
    llama64: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beam search and processors that count from the start of a call (min_new_tokens, ...) cannot carry a row
    on: refill=True says why, and the default runs such calls in whole batches (each row still as alone)."""
    prompts = workload(1, 3)
    refusal = prefixkv.many.arguments.refill_refusal
    assert refusal(llama64, dict(do_sample=True, repetition_penalty=1.2, guidance_scale=1, eos_token_id=0)) is None
    for key, value in (("forced_eos_token_id", 0), ("forced_bos_token_id", 1), ("guidance_scale", 1.5)):
        assert refusal(llama64, {key: value}) == f"{key}={value!r}: it counts from the start of one call"
    for kw, why in ((dict(num_beams=2), "num_beams=2"), (dict(min_new_tokens=3), "min_new_tokens=3")):
        with pytest.raises(ValueError, match=f"cannot refill a batch with {why}"):
            prefixkv.generate_many(llama64, prompts, max_new_tokens=4, refill=True, progress=False, **kw)
    calls = _spy_calls(monkeypatch)
    answers = [stock(llama64, p, max_new_tokens=8, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    kw2: dict[str, Any] = dict(max_new_tokens=8, min_new_tokens=2, do_sample=False, eos_token_id=answers[0][3])
    out = prefixkv.generate_many(llama64, prompts, batch_size=2, progress=False, **kw2)
    assert all(p in prompts for prompts_, _ in calls for p in prompts_)
    for g in out:
        assert g.tokens == stock(llama64, g.prompt, **kw2).sequences[0, len(g.prompt) :].tolist()


def test_an_invariant_store_gives_the_same_bits_cold_and_warm_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """In an invariant store a job's results never depend on what the store holds: the same prompts, cold and
    after earlier calls cached some of them at other lengths (and pinned none), give bit-identical tokens and
    logits in bfloat16. The batches must not follow the store's contents (refill=False: no row carried on)."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.bfloat16)
    prompts = workload(2, 5, system_len=40)
    answers = [stock(model, p, max_new_tokens=10, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    kw: dict[str, Any] = dict(
        max_new_tokens=10, do_sample=False, eos_token_id=[answers[0][2], answers[3][5]], output_logits=True
    )
    calls = _spy_calls(monkeypatch)
    runs = []
    for warm in (False, True):
        with prefixkv.PrefixStore(model, block_size=4, invariant=True, chunk_size=8) as store:
            if warm:  # earlier work: a prefix of one system prompt, one whole prompt and a longer one
                store.warm([prompts[1][:16], prompts[2], prompts[4] + [9, 9, 9, 9, 9, 9, 9, 9]], progress=False)
            runs.append(
                prefixkv.generate_many(model, prompts, store=store, batch_size=3, progress=False, refill=False, **kw)
            )
    cold, warm_ = runs
    assert all(p in prompts for prompts_, _ in calls for p in prompts_)  # no row carried on
    assert any(g.cached_tokens for g in warm_)  # the warm run did reuse what the store held
    for a, b in zip(cold, warm_, strict=True):
        assert a.tokens == b.tokens and a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits), a.index


@pytest.mark.parametrize("invariant", [False, True])
def test_refilling_makes_the_same_calls_on_the_same_rows_in_the_same_order(
    llama64: Any, monkeypatch: pytest.MonkeyPatch, invariant: bool
) -> None:
    """The exact sequence of a 10-prompt, batch-3 refilling run (recorded before the refill became a scheduler
    of waiting and running rows): each ``generate`` call's rows (which prompt, how many tokens so far), their
    cached tokens, its ``max_new_tokens`` and how many done rows end it early, and each prefix computed alone."""
    prompts = workload(2, 5)
    answers = [stock(llama64, p, max_new_tokens=14, do_sample=False).sequences[0, len(p) :].tolist() for p in prompts]
    eos = sorted({answers[0][1], answers[3][6], answers[6][11]})
    events: list[tuple[Any, ...]] = []
    original = prefixkv.many.generation._Run.call

    def call(self: Any, prompts_: list[list[int]], **more: Any) -> Any:
        out = original(self, prompts_, **more)
        rows = [(next(i for i, q in enumerate(prompts) if p[: len(q)] == q), len(p)) for p in prompts_]
        enough = more["stopping_criteria"][0].enough if "stopping_criteria" in more else None
        events.append(("call", rows, out[2], more.get("max_new_tokens"), enough))
        return out

    monkeypatch.setattr(prefixkv.many.generation._Run, "call", call)
    store = prefixkv.PrefixStore(llama64, block_size=4, **(dict(invariant=True, chunk_size=8) if invariant else {}))
    warm = store.warm
    monkeypatch.setattr(store, "warm", lambda ps, **kw: events.extend(("warm", len(p)) for p in ps) or warm(ps, **kw))
    prefixkv.generate_many(
        llama64, prompts, store=store, batch_size=3, progress=False, max_new_tokens=14, do_sample=False,
        eos_token_id=eos,
    )  # fmt: skip
    # an invariant store computes a call's rows apart (cached counts differ), the same rows in the same calls
    first, second, fourth, last = (
        ([0, 0, 0], [40, 37, 40], [40, 38, 34], [40, 37])
        if invariant
        else ([37, 0, 38], [45, 37, 40], [42, 40, 36], [51, 40])
    )
    assert events == [
        ("call", [(1, 42), (9, 45), (7, 43)], first, 14, 2),
        ("warm", 40),  # prompt 9's system prompt, alone, so that prompts 5 and 3 can join
        ("call", [(9, 49), (5, 41), (3, 44)], second, 14, 2),
        ("call", [(5, 42), (6, 42), (2, 43)], [39, 39, 40], 14, 2),
        ("call", [(2, 47), (4, 45), (0, 41)], fourth, 14, 2),
        ("call", [(4, 55), (8, 44)], last, 14, None),  # no prompt waits: the call runs to its end
    ]
    store.close()
