"""generate_many reads its arguments as ``generate`` reads them, and refuses what it cannot honour.

Promise by input (docs/generate.md, "Many prompts at once"), and the test that varies each:

- each row is ``generate`` on its prompt alone, whatever the settings come from: keywords, a
  ``generation_config=`` (its ``max_new_tokens``, ``eos_token_id``, ``num_beams``), both at once (keywords win):
  ``test_a_generation_config_is_read_as_generate_reads_it``;
- ... whatever the prompt holds: the pad token inside a prompt (``generate`` infers a mask with holes from it),
  with rows carried on by refilling and in whole batches:
  ``test_a_prompt_holding_the_pad_token_is_masked_as_generate_masks_it``;
- ... whatever the processors read of the prompt (``encoder_no_repeat_ngram_size``, ``encoder_repetition_penalty``):
  each row's own prompt, not the batch's padding nor a carried-on row's tokens so far, in whole batches and
  refilling: ``test_processors_that_read_the_prompt_read_each_rows_own``;
- ``forced_bos_token_id``, which ``generate`` applies where the prompt is one token wide: a one-token prompt beside
  longer ones is refused, prompts of one width run as their own calls:
  ``test_a_forced_first_token_is_refused_for_a_one_token_prompt_among_longer_ones``;
- a prompt ending in the pad token, whose own call numbers the new tokens from 1: never carried on by refilling
  (whole batches by default, ``refill=True`` refused): ``test_a_prompt_ending_in_the_pad_token_is_not_carried_on``;
- malformed prompts (float or bool tensors, floats, bools, strings or lists inside a list, negative ids, a
  dict) are refused before anything runs, the store untouched: ``test_malformed_prompts_are_refused_not_truncated``;
- ``use_cache=False`` and assisted decoding (an assistant model, prompt lookup), as keywords or in a
  ``generation_config``, are refused with the reason: ``test_calls_without_a_cache_or_with_an_assistant_are_refused``;
- in an invariant store with a budget, the batches (so the bits) do not depend on what the store holds, pins
  included: ``test_an_invariant_store_plans_the_same_batches_beside_a_pin_in_bfloat16``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import random_tokens, stock_twin
from transformers import DynamicCache, GenerationConfig

import prefixkv
from prefixkv.many.batches import batch_rows


def stock(model: Any, prompt: list[int], **kw: Any) -> Any:
    """``generate`` on this prompt alone, with no attention mask (as a user calls it), a fresh DynamicCache, on a
    model prefixkv never touched."""
    twin = stock_twin(model)
    return twin.generate(torch.tensor([prompt]), cache=DynamicCache(config=twin.config), **kw)


def assert_rows_equal_stock(out: list[prefixkv.Generation], model: Any, **kw: Any) -> None:
    """Every row has the tokens of ``generate`` on its prompt alone with ``kw``, and its logits within 1e-6."""
    for g in out:
        ref = stock(model, g.prompt, return_dict_in_generate=True, output_logits=True, **kw)
        new = ref.sequences[0, len(g.prompt) :].tolist()
        assert g.tokens == new, (g.index, g.tokens, new)
        assert g.logits is not None and g.logits.shape[0] == len(new)
        assert (g.logits - torch.stack(ref.logits)[:, 0]).abs().max() <= 1e-6


def prompts_on(head_len: int, count: int, seed: int = 0) -> list[list[int]]:
    head = random_tokens(head_len, seed=seed).tolist()
    return [head + random_tokens(1 + i % 4, seed=50 + i).tolist() for i in range(count)]


def test_a_generation_config_is_read_as_generate_reads_it(llama64: Any) -> None:
    """A ``generation_config=`` alone, and with keywords beside it: its max_new_tokens bounds each row, its
    eos_token_id stops rows there (none is returned with padding after its end), a keyword overrides it as in
    ``generate``, and its num_beams runs a beam search in whole batches (refill=True says why)."""
    prompts = prompts_on(20, 5)
    answers = [stock(llama64, p, max_new_tokens=9, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    eos = answers[1][2]  # a token the model says: rows that say it end there
    cfg = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=eos, output_logits=True)
    out = prefixkv.generate_many(llama64, prompts, generation_config=cfg, batch_size=2, progress=False)
    assert_rows_equal_stock(out, llama64, generation_config=cfg)
    assert min(len(g.tokens) for g in out) <= 3 and max(len(g.tokens) for g in out) == 9
    assert all(eos not in g.tokens[:-1] for g in out)
    both = prefixkv.generate_many(llama64, prompts, generation_config=cfg, max_new_tokens=4, progress=False)
    assert_rows_equal_stock(both, llama64, generation_config=cfg, max_new_tokens=4)
    assert max(len(g.tokens) for g in both) == 4
    beams = GenerationConfig(max_new_tokens=5, num_beams=2, do_sample=False, eos_token_id=eos)
    with pytest.raises(ValueError, match="cannot refill a batch with num_beams=2"):
        prefixkv.generate_many(llama64, prompts, generation_config=beams, refill=True, progress=False)
    assert prefixkv.many.arguments.refill_refusal(llama64, dict(generation_config=beams)) is not None
    searched = prefixkv.generate_many(llama64, prompts, generation_config=beams, batch_size=3, progress=False)
    for g in searched:
        ref = stock(llama64, g.prompt, generation_config=beams)
        assert g.tokens == ref[0, len(g.prompt) :].tolist()
    with pytest.raises(ValueError, match="max_new_tokens"):
        prefixkv.generate_many(llama64, prompts, generation_config=GenerationConfig(max_length=30), progress=False)
    with pytest.raises(ValueError, match="repeat the prompt"):
        cfg2 = GenerationConfig(max_new_tokens=2, num_beams=2, num_return_sequences=2)
        prefixkv.generate_many(llama64, prompts, generation_config=cfg2, progress=False)


def test_a_prompt_holding_the_pad_token_is_masked_as_generate_masks_it(llama64: Any) -> None:
    """A prompt that holds the pad token (0 in the tiny model's generation_config; SmolLM2's chat prompts hold
    theirs): ``generate`` on it alone infers an attention mask with holes there, and each row equals that call, in
    whole batches and with rows carried on by refilling (their own new tokens always attended). A later ordinary
    request on the same ids with a full mask then matches stock: the masked rows published nothing it reuses
    past the hole."""
    pad = llama64.generation_config.pad_token_id
    assert pad is not None and pad != llama64.generation_config.eos_token_id
    prompts = prompts_on(22, 6, seed=3)
    holed = [[*p[:9], pad, *p[9:]] for p in prompts[:3]] + [[*p[:17], pad, pad, *p[17:]] for p in prompts[3:5]]
    prompts = holed + prompts[5:]
    full = stock(llama64, prompts[0], max_new_tokens=6, do_sample=False, attention_mask=torch.ones(1, len(prompts[0])))
    masked = stock(llama64, prompts[0], max_new_tokens=6, do_sample=False)
    assert not torch.equal(full, masked)  # the inferred mask does change what generate says
    answers = [stock(llama64, p, max_new_tokens=12, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    kw: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, eos_token_id=[answers[0][1], answers[3][4]])
    store = prefixkv.PrefixStore(llama64, block_size=4)
    for refill in (False, None):
        out = prefixkv.generate_many(
            llama64, prompts, store=store, batch_size=3, refill=refill, output_logits=True, progress=False, **kw
        )
        assert_rows_equal_stock(out, llama64, **kw)
        assert min(len(g.tokens) for g in out) <= 2 and max(len(g.tokens) for g in out) == 12
    later = prompts[3] + [7, 8]
    with prefixkv.PagedPrefixCache(store, torch.tensor([later]), torch.ones(1, len(later))) as cache:
        mine = llama64.generate(
            torch.tensor([later]), attention_mask=torch.ones(1, len(later), dtype=torch.long), cache=cache,
            max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    ref = stock(
        llama64, later, attention_mask=torch.ones(1, len(later), dtype=torch.long), max_new_tokens=5,
        do_sample=False, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    assert 16 <= cache.stats.cached_tokens <= 17  # the 17 tokens before the hole, in whole blocks
    assert torch.equal(mine.sequences, ref.sequences)
    assert max((a - b).abs().max() for a, b in zip(mine.logits, ref.logits, strict=True)) <= 1e-6
    store.check_invariants()
    store.close()


@pytest.mark.parametrize(
    "readers",
    [{"encoder_no_repeat_ngram_size": 1}, {"encoder_no_repeat_ngram_size": 3, "encoder_repetition_penalty": 3.0}],
)
def test_processors_that_read_the_prompt_read_each_rows_own(
    llama64: Any, readers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``encoder_no_repeat_ngram_size`` and ``encoder_repetition_penalty`` read the prompt ``generate`` was given:
    in a padded batch that holds the padding, and in a refilled call a carried-on row's tokens so far. Each row
    still has the tokens, logits and processed scores of ``generate`` on its own prompt (one holding the pad token
    too), in whole batches and refilling (rows carried on, checked); a later ordinary call matches stock."""
    pad = llama64.generation_config.pad_token_id
    prompts = prompts_on(12, 6, seed=5)
    prompts = [*prompts[:5], [*prompts[5][:6], pad, *prompts[5][6:]]]
    base: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, **readers)
    answers = [stock(llama64, p, **base)[0, len(p) :].tolist() for p in prompts]
    ends = {t: [a.index(t) + 1 if t in a else 12 for a in answers] for a in answers for t in a[:2]}
    eos = max(ends, key=lambda t: (max(ends[t]) == 12, sum(n <= 3 for n in ends[t])))  # rows end far apart
    kw: dict[str, Any] = dict(base, eos_token_id=eos)
    calls: list[list[list[int]]] = []
    call = prefixkv.many.generation._Run.call
    monkeypatch.setattr(
        prefixkv.many.generation._Run,
        "call",
        lambda self, prompts, **more: calls.append(prompts) or call(self, prompts, **more),
    )
    store = prefixkv.PrefixStore(llama64, block_size=4)
    for refill in (False, True):
        calls.clear()
        out = prefixkv.generate_many(
            llama64, prompts, store=store, batch_size=3, refill=refill, output_logits=True, output_scores=True,
            progress=False, **kw,
        )  # fmt: skip
        assert min(len(g.tokens) for g in out) <= 2 and max(len(g.tokens) for g in out) == 12
        assert refill == any(p not in prompts for batch in calls for p in batch)  # refill carried rows on
        assert_rows_equal_stock(out, llama64, **kw)
        for g in out:
            ref = stock(llama64, g.prompt, return_dict_in_generate=True, output_scores=True, **kw)
            scores = torch.stack(ref.scores)[:, 0]  # the processors' output: -inf where they ban a token
            assert g.scores is not None and torch.equal(g.scores.isinf(), scores.isinf()), (refill, g.index)
            assert (g.scores - scores).nan_to_num(0.0).abs().max() <= 1e-6, (refill, g.index)
    later = prompts[1] + [7, 8]
    with prefixkv.PagedPrefixCache(store, torch.tensor([later])) as cache:
        mine = llama64.generate(
            torch.tensor([later]), cache=cache, output_logits=True, return_dict_in_generate=True, **kw
        )
    ref = stock(llama64, later, output_logits=True, return_dict_in_generate=True, **kw)
    assert cache.stats.cached_tokens >= 12 and torch.equal(mine.sequences, ref.sequences)
    assert max((a - b).abs().max() for a, b in zip(mine.logits, ref.logits, strict=True)) <= 1e-6
    store.check_invariants()
    store.close()


def test_a_forced_first_token_is_refused_for_a_one_token_prompt_among_longer_ones(llama64: Any) -> None:
    """``forced_bos_token_id`` forces the first new token only where the call's prompt is one token wide:
    ``generate`` on a one-token prompt alone forces it, a padded batch of longer prompts does not. That mix is
    refused before anything runs, naming the prompt; prompts of one token only, and of more only, give what their
    own calls give."""
    store = prefixkv.PrefixStore(llama64, block_size=4)
    kw: dict[str, Any] = dict(max_new_tokens=4, do_sample=False, forced_bos_token_id=9)
    with pytest.raises(ValueError, match=r"forced_bos_token_id=9 .* prompt 1 has one token"):
        prefixkv.generate_many(llama64, [[17, 30, 31, 32], [17], [18]], store=store, progress=False, **kw)
    assert store.stats.queries == 0 and store.stats.blocks_used == 0  # nothing ran
    for prompts in ([[17], [18]], [[17, 30, 31, 32], [17, 30, 33]]):
        out = prefixkv.generate_many(
            llama64, prompts, store=store, batch_size=2, output_logits=True, progress=False, **kw
        )
        assert_rows_equal_stock(out, llama64, **kw)
    assert [g.tokens[0] for g in out] != [9, 9]  # forced for one-token prompts only
    store.check_invariants()
    store.close()


def test_a_prompt_ending_in_the_pad_token_is_not_carried_on(llama64: Any) -> None:
    """A prompt that ends in the pad token (not an end-of-sequence token here): ``generate`` on it alone masks that
    last token and numbers the tokens after it from 1 (its positions continue from the masked token's 0), which a
    later call carrying the row on would number from its length. By default such a job runs in whole batches, each
    row equal to its own call; ``refill=True`` says why it cannot refill, before anything runs."""
    pad = llama64.generation_config.pad_token_id
    prompts = prompts_on(12, 6, seed=5)
    prompts[4] = [*prompts[4], pad]
    answers = [stock(llama64, p, max_new_tokens=12, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    ends = {t: [a.index(t) + 1 if t in a else 12 for a in answers] for a in answers for t in a[:2]}
    eos = max(ends, key=lambda t: (ends[t][4] == 12, sum(n <= 3 for n in ends[t])))  # rows end early, not row 4
    kw: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos)
    store = prefixkv.PrefixStore(llama64, block_size=4)
    with pytest.raises(ValueError, match="prompt 4: it ends in the pad token"):
        prefixkv.generate_many(llama64, prompts, store=store, refill=True, progress=False, **kw)
    assert store.stats.queries == 0  # nothing ran
    out = prefixkv.generate_many(llama64, prompts, store=store, batch_size=3, output_logits=True, progress=False, **kw)
    assert min(len(g.tokens) for g in out) <= 3 and len(out[4].tokens) == 12
    assert_rows_equal_stock(out, llama64, **kw)
    store.check_invariants()
    store.close()


def test_malformed_prompts_are_refused_not_truncated(llama64: Any) -> None:
    """Token ids that are not non-negative ints are refused with the prompt's place and the value, before
    anything runs: the store stays empty."""
    store = prefixkv.PrefixStore(llama64, block_size=4)
    good = list(range(5, 15))
    cases: list[tuple[Any, str]] = [
        (torch.tensor([5.0, 6.7, 7.0]), "float"),
        (torch.tensor([5.0, 6.0, 7.0]), "float"),
        (torch.tensor([True, False]), "bool"),
        ([5, 6.7, 7], "6.7"),
        ([5.0, 6.0], "5.0"),
        ([5, True, 7], "True"),
        (["5", "6"], "'5'"),
        ([[5, 6], [7, 8]], r"\[5, 6\]"),
        ([5, -3, 7], "-3"),
        ({"role": "user", "content": "hi"}, "dict"),
        (7, "int"),
    ]
    for bad, shown in cases:
        with pytest.raises(ValueError, match=f"prompt 1.*{shown}"):
            prefixkv.generate_many(llama64, [good, bad], store=store, max_new_tokens=2, progress=False)
    assert store.stats.blocks_used == 0 and store.stats.prompt_tokens == 0 and store.stats.hit_tokens == 0
    ok = prefixkv.generate_many(llama64, [torch.tensor(good), tuple(good)], store=store, max_new_tokens=2)
    assert ok[0].tokens == ok[1].tokens
    store.close()


def test_calls_without_a_cache_or_with_an_assistant_are_refused(llama64: Any) -> None:
    """``use_cache=False`` would compute every step without the store's cache, and assisted decoding runs one
    prompt a call in transformers: refused up front with the reason, as keywords or in a generation_config."""
    prompts = prompts_on(12, 3)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(use_cache=False), "use_cache=False"),
        (dict(generation_config=GenerationConfig(max_new_tokens=3, use_cache=False)), "use_cache=False"),
        (dict(assistant_model=stock_twin(llama64)), "assisted"),
        (dict(prompt_lookup_num_tokens=3), "assisted"),
        (dict(generation_config=GenerationConfig(max_new_tokens=3, prompt_lookup_num_tokens=2)), "assisted"),
    ]
    store = prefixkv.PrefixStore(llama64, block_size=4)
    for kw, why in cases:
        with pytest.raises(ValueError, match=f"generate_many\\(\\) .*{why}"):
            prefixkv.generate_many(
                llama64, prompts, store=store, **{"max_new_tokens": 3, **kw}, do_sample=False, progress=False
            )
    assert store.stats.blocks_used == 0 and store.stats.prompt_tokens == 0
    store.close()


def test_an_invariant_store_plans_the_same_batches_beside_a_pin_in_bfloat16() -> None:
    """An invariant store with a budget: a batch takes at most half its blocks whatever it holds, so the same
    prompts go in the same batches cold and with a prefix pinned (which took blocks of the budget), and their
    tokens and bfloat16 logits are bit-identical."""
    model = prefixkv.models.tiny_model("llama", dtype=torch.bfloat16)
    prompts = prompts_on(40, 8) + prompts_on(40, 4, seed=9)
    kw: dict[str, Any] = dict(max_new_tokens=8, do_sample=False, output_logits=True)
    runs, plans = [], []
    for pinned in (False, True):
        with prefixkv.PrefixStore(model, block_size=4, invariant=True, chunk_size=8, num_blocks=64) as store:
            if pinned:
                store.pin(random_tokens(40, seed=77).tolist())  # another system prompt: 10 of the 64 blocks
                assert store.stats.blocks_pinned == 10
            plans.append(batch_rows(prompts, store, 64, 8))
            runs.append(prefixkv.generate_many(model, prompts, store=store, progress=False, **kw))
    assert plans[0] == plans[1] and len(plans[0]) > 1  # the budget does split the prompts
    for a, b in zip(*runs, strict=True):
        assert a.tokens == b.tokens and a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits), a.index
