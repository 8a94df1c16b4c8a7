"""Where a hybrid's prompts part (issue 56): the snapshots a long prefill takes on its grid let the first *other*
prompt through a shared prefix resume at most one grid step before the point where it parts, the junction snapshot
it takes lets the next one resume there, and the budget, namespaces and weight versions decide what survives; every
miss is explained and every drop counted. Each call compared with stock generate in float64 (docs/memory.md,
"Recurrent state")."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import compare, random_tokens

import prefixkv
from prefixkv.base.tokens import common_length, message_ends
from prefixkv.hf.states import MIN_STEP
from prefixkv.tools import census

pytestmark = pytest.mark.skipif(
    prefixkv.compat.releases.LINEAR_ATTENTION_LAYER is None,
    reason="transformers before 5 keeps recurrent state in caches of each model's own: refused (test_families)",
)

TOL = 1e-6
FAMILIES = ("qwen3_next", "qwen3_5", "lfm2", "nemotron_h")
_MODELS: dict[str, Any] = {}


def tiny(family: str) -> Any:
    """A float64 tiny model of ``family`` from its census config (mixtures of experts by the eager experts), one per
    family for the module."""
    if family not in _MODELS:
        config = census.tiny_config(family)
        config._experts_implementation = "eager"
        _MODELS[family] = prefixkv.models.build(config, dtype=torch.float64)
    return _MODELS[family]


def tokens(n: int, seed: int) -> torch.Tensor:
    """Random ids below 200: a vision-language family's image and video placeholders (250-253 in Qwen3.5's tiny
    config) never among them."""
    return random_tokens(n, seed=seed, vocab=200)


def joined(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts)[None]


def exact(result: Any) -> Any:
    assert result.max_diff <= TOL and result.same_tokens, result.max_diff
    return result.cache.stats


def below(position: int, step: int = MIN_STEP) -> int:
    """The deepest grid position at or before ``position``."""
    return position // step * step


# the sizes: S shared tokens and each prompt's own; 1500 + 700 on Nemotron-H takes minutes on a CPU
SIZES = [
    pytest.param(f, s, o, marks=[pytest.mark.slow] if (f, s) == ("nemotron_h", 1500) else [])
    for f in FAMILIES
    for s, o in ((100, 40), (527, 40), (1500, 40), (1500, 700))
]


@pytest.mark.parametrize(("family", "shared", "own"), SIZES)
def test_the_first_other_prompt_resumes_within_one_grid_step(family: str, shared: int, own: int) -> None:
    model = tiny(family)
    store = prefixkv.PrefixStore(model)
    prefix = tokens(shared, seed=1)
    a = joined(prefix, tokens(own, seed=2))
    exact(compare(model, store, a, max_new_tokens=2))
    b = exact(compare(model, store, joined(prefix, tokens(own, seed=3)), max_new_tokens=2))
    assert b.cached_tokens == below(shared) >= shared - MIN_STEP, b
    assert "ends at token" in (b.not_cached or "") and "no recurrent-state snapshot was taken yet" in b.not_cached
    c = exact(compare(model, store, joined(prefix, tokens(own, seed=4)), max_new_tokens=2))
    assert c.cached_tokens == shared and c.not_cached is None, c
    later = exact(compare(model, store, a, max_new_tokens=2))  # an ordinary request after them: A asked again
    assert later.cached_tokens == a.shape[1] - 1
    stats = store.stats
    assert stats.kv_hit_tokens - stats.hit_tokens == shared - below(shared)  # B's one grid step, explained
    assert stats.snapshots_used >= 3 and stats.snapshots_dropped_budget == stats.snapshots_dropped_path == 0


@pytest.mark.parametrize(
    "shared",
    [
        2 * MIN_STEP,  # on the grid
        2 * MIN_STEP + 5,  # off the grid, inside a block
        2 * MIN_STEP + 16,  # off the grid, at a block edge
    ],
)
@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_where_the_prefix_parts(family: str, shared: int) -> None:
    model = tiny(family)
    store = prefixkv.PrefixStore(model)
    prefix = tokens(shared, seed=5)
    exact(compare(model, store, joined(prefix, tokens(30, seed=6))))
    b = exact(compare(model, store, joined(prefix, tokens(30, seed=7))))
    assert b.cached_tokens == below(shared)
    assert (b.not_cached is None) == (shared % MIN_STEP == 0), b  # a miss, and only a miss, is explained
    c = exact(compare(model, store, joined(prefix, tokens(30, seed=8))))
    assert c.cached_tokens == shared
    later = exact(compare(model, store, tokens(90, seed=9)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0 and later.not_cached is None
    store.check_invariants()


def test_a_tight_budget_keeps_the_junction_and_says_what_it_dropped() -> None:
    model = tiny("lfm2")
    store = prefixkv.PrefixStore(model)
    prefix = tokens(300, seed=10)
    exact(compare(model, store, joined(prefix, tokens(40, seed=11)), max_new_tokens=2))
    size = next(iter(store.snapshots._held.values())).nbytes
    store.snapshots.max_bytes = 4 * size  # A's four newest kept: grid positions 256 and 320, its last token, its end
    assert sorted(len(path) for _, path in store.snapshots._held) == [256, 320, 339, 341]
    b = exact(compare(model, store, joined(prefix, tokens(40, seed=12)), max_new_tokens=2))
    stats = store.stats
    assert stats.snapshots_dropped_budget > 0 and stats.snapshot_bytes <= 4 * size
    c = exact(compare(model, store, joined(prefix, tokens(40, seed=13)), max_new_tokens=2))
    assert b.cached_tokens == below(300) and c.cached_tokens == 300  # B's junction is kept over one-off ends
    later = exact(compare(model, store, tokens(50, seed=14)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0
    store.check_invariants()


def test_a_zero_budget_resumes_nothing_and_says_why() -> None:
    model = tiny("lfm2")
    store = prefixkv.PrefixStore(model)
    store.snapshots.max_bytes = 0
    prefix = tokens(150, seed=15)
    exact(compare(model, store, joined(prefix, tokens(20, seed=16)), max_new_tokens=2))
    b = exact(compare(model, store, joined(prefix, tokens(20, seed=17)), max_new_tokens=2))
    assert b.cached_tokens == 0 and "no recurrent-state snapshot was taken yet" in (b.not_cached or "")
    c = exact(compare(model, store, joined(prefix, tokens(20, seed=18)), max_new_tokens=2))
    # B took a snapshot at the junction (150), and the budget dropped it: never "not taken yet"
    assert c.cached_tokens == 0 and "taken and then dropped for the snapshots' budget" in (c.not_cached or ""), c
    stats = store.stats
    assert stats.snapshots == 0 and stats.snapshots_taken == stats.snapshots_dropped_budget > 0
    assert stats.hit_tokens == 0 and stats.kv_hit_tokens > 0
    later = exact(compare(model, store, tokens(30, seed=19)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0


def test_namespaces_and_a_weight_change_keep_their_grids_apart() -> None:
    config = census.tiny_config("lfm2")
    model = prefixkv.models.build(config, dtype=torch.float64)
    store = prefixkv.PrefixStore(model)
    prefix = tokens(200, seed=20)
    exact(compare(model, store, joined(prefix, tokens(20, seed=21)), namespace="alice"))
    bob = exact(compare(model, store, joined(prefix, tokens(20, seed=22)), namespace="bob"))
    assert bob.cached_tokens == 0 and bob.not_cached is None  # nothing of alice's, and nothing to explain
    alice = exact(compare(model, store, joined(prefix, tokens(20, seed=23)), namespace="alice"))
    assert alice.cached_tokens == below(200)
    with torch.no_grad():  # a weight edited in place: another weight version, nothing of the earlier one reused
        model.model.embed_tokens.weight[1, 0] += 0.25
    changed = exact(compare(model, store, joined(prefix, tokens(20, seed=24)), namespace="alice"))
    assert changed.cached_tokens == 0
    after = exact(compare(model, store, joined(prefix, tokens(20, seed=25)), namespace="alice"))
    assert after.cached_tokens == below(200)  # the new version's own grid
    store.check_invariants()


def test_the_grid_step_is_derived_from_the_budget_and_overridable() -> None:
    model = tiny("lfm2")
    roomy = prefixkv.PrefixStore(model)
    assert roomy.snapshots.step() == MIN_STEP  # no budget: the finest grid
    bounded = prefixkv.PrefixStore(model, max_memory="4MiB")
    assert bounded.snapshots.step() is None  # unknown until a snapshot's size is
    exact(compare(model, bounded, tokens(100, seed=26)[None], max_new_tokens=2))
    size = next(iter(bounded.snapshots._held.values())).nbytes
    per_token = bounded.bytes_per_block / bounded.block_size
    pool = (bounded.max_blocks + 1) * bounded.bytes_per_block  # type: ignore[operator]
    assert size * pool / (per_token * bounded.snapshots.max_bytes) < MIN_STEP  # type: ignore[operator]
    assert bounded.snapshots.step() == MIN_STEP  # a roomy budget: the finest grid
    bounded.snapshots.max_bytes = pool // 40  # the grid's snapshots of a full pool's tokens fit 1/40 of its bytes
    wanted = size * pool / (per_token * bounded.snapshots.max_bytes)  # 120 tokens for this model
    assert bounded.snapshots.step() == -(-wanted // 16) * 16 == 128
    bounded.snapshots.max_bytes = None
    bounded.snapshots.grid = 32  # overridden: the first other prompt resumes at a multiple of 32
    prefix = tokens(150, seed=27)
    exact(compare(model, bounded, joined(prefix, tokens(20, seed=28)), max_new_tokens=2))
    b = exact(compare(model, bounded, joined(prefix, tokens(20, seed=29)), max_new_tokens=2))
    assert b.cached_tokens == below(150, 32)
    bounded.snapshots.grid = 0  # no grid: the first other prompt resumes nothing
    other = tokens(150, seed=30)
    exact(compare(model, bounded, joined(other, tokens(20, seed=31)), max_new_tokens=2))
    none = exact(compare(model, bounded, joined(other, tokens(20, seed=32)), max_new_tokens=2))
    assert none.cached_tokens == 0


def attention_ceiling(prompts: list[list[int]]) -> int:
    """The prompt tokens an attention-only cache reuses over ``prompts`` in turn (a token-granular trie that keeps
    every prompt: each reuses its longest common prefix with any earlier one, one token short of itself)."""
    total = 0
    for i, p in enumerate(prompts):
        best = max((common_length(p, q) for q in prompts[:i]), default=0)
        total += min(best, len(p) - 1)
    return total


def test_an_agent_like_trace_reuses_nine_tenths_of_what_attention_would() -> None:
    model = tiny("qwen3_next")
    store = prefixkv.PrefixStore(model)
    generator = torch.Generator().manual_seed(56)
    documents = [tokens(300, seed=60 + d).tolist() for d in range(2)]
    prompts = []
    for d, doc in enumerate(documents):
        for k in range(30):  # the trace at half the document and three quarters of the prompts
            x = int(torch.randint(50, 301, (1,), generator=generator))
            prompts.append(doc[:x] + tokens(15, seed=1000 * d + k).tolist())
    order = torch.randperm(len(prompts), generator=generator).tolist()
    prompts = [prompts[i] for i in order]
    for p in prompts:
        with prefixkv.PagedPrefixCache(store, torch.tensor([p])) as cache:
            model.generate(torch.tensor([p]), cache=cache, max_new_tokens=1, do_sample=False)
    ceiling = attention_ceiling(prompts)
    assert store.stats.kv_hit_tokens == ceiling  # the K/V held are what attention would reuse
    assert store.stats.hit_tokens >= 0.9 * ceiling, (store.stats.hit_tokens, ceiling)
    later = exact(compare(model, store, torch.tensor([prompts[0]])))  # an ordinary request after them
    assert later.cached_tokens == len(prompts[0]) - 1


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_the_first_prompt_takes_its_grid_inside_one_forward(family: str) -> None:
    model = tiny(family)
    store = prefixkv.PrefixStore(model)
    forwards: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        prefix = tokens(260, seed=40)
        a = joined(prefix, tokens(40, seed=41))
        exact(compare(model, store, a, max_new_tokens=1))
        prefilled = list(forwards)
        # B parts 4 tokens past the grid position it resumes at, and its logits come 3 tokens later: a state taken
        # at the wrong place inside A's forward shows (Qwen3.5's tiny states fade within some tens of tokens)
        b = exact(compare(model, store, joined(prefix, tokens(3, seed=42)), max_new_tokens=1))
    finally:
        hook.remove()
    # the grid's four snapshots and the last-but-one token's, from the one forward stock runs too
    assert prefilled == [300], prefilled
    assert {64, 128, 192, 256, 299} <= {len(path) for _, path in store.snapshots._held}
    assert b.cached_tokens == below(260) and b.split_tokens == 0
    later = exact(compare(model, store, tokens(50, seed=43)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5"])
def test_a_message_end_is_a_snapshot_the_next_prompt_resumes(family: str) -> None:
    model = tiny(family)
    store = prefixkv.PrefixStore(model)
    end_of_turn = 201  # a token id no random prompt here holds (they are under 200)
    store.snapshots.marks = frozenset({end_of_turn})
    system = torch.cat([tokens(99, seed=50), torch.tensor([end_of_turn])])  # a 100-token message, its marker last
    a = exact(compare(model, store, joined(system, tokens(20, seed=51)), max_new_tokens=2))
    assert a.split_tokens == 0  # taken inside the call's own forward
    # B shares A's message and 5 more tokens: it resumes after the message's end, not at the grid's 64
    b = exact(compare(model, store, joined(system, tokens(5, seed=51), tokens(20, seed=52)), max_new_tokens=2))
    assert b.cached_tokens == 100, b
    store.snapshots.marks = frozenset()  # without marks: the grid position before the message's end
    other = torch.cat([tokens(99, seed=53), torch.tensor([end_of_turn])])
    exact(compare(model, store, joined(other, tokens(20, seed=54)), max_new_tokens=2))
    c = exact(compare(model, store, joined(other, tokens(5, seed=54), tokens(20, seed=55)), max_new_tokens=2))
    assert c.cached_tokens == below(100)
    later = exact(compare(model, store, tokens(50, seed=56)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer() -> Any:
    """A ChatML tokenizer built here, no hub: ids 0-199 the words ``w0``-``w199``, then the roles, then its special
    tokens (ids 203-206, under the tiny vocabularies' 256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(200)] + ["system", "user", "assistant"]
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words + specials)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML
    return tok


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_enable_with_a_tokenizer_resumes_the_next_prompt_at_a_message_end(family: str) -> None:
    """``enable(model, tokenizer=...)``: the chat template's end of a message (``<|im_end|>``) and the end-of-sequence
    token become the store's marks, with nothing spelled by hand; a second conversation with the same system message
    resumes right after it, not at the grid position before it."""
    model = tiny(family)
    tok = chat_tokenizer()
    im_end, eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    store = prefixkv.enable(model, tokenizer=tok)
    try:
        assert store.snapshots.marks == {im_end, eos}
        system = " ".join(f"w{t}" for t in tokens(99, seed=60).tolist())

        def chat(seed: int) -> torch.Tensor:
            question = " ".join(f"w{t}" for t in tokens(20, seed=seed).tolist())
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            ids: torch.Tensor = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")[
                "input_ids"
            ]
            return ids

        a, b = chat(61), chat(62)
        end = a[0].tolist().index(im_end) + 1  # <|im_start|> system, 99 words, <|im_end|>: 102 tokens
        assert end == 102 and common_length(a[0].tolist(), b[0].tolist()) == end + 2  # then <|im_start|> user
        exact(compare(model, store, a, max_new_tokens=2))
        resumed = exact(compare(model, store, b, max_new_tokens=2))
        assert resumed.cached_tokens == end > below(end), resumed
        later = exact(compare(model, store, tokens(50, seed=63)[None]))  # an ordinary request after them
        assert later.cached_tokens == 0
    finally:
        prefixkv.disable(model)


def test_message_ends_of_templates_with_and_without_end_tokens() -> None:
    """The token a template writes right after a message's content ends it; a start token that follows only after
    other text does not, and a tokenizer without a template has its end-of-sequence token alone."""
    tok = chat_tokenizer()
    im_start, im_end, eos = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert message_ends(tok) == {im_end, eos}
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} said\n{% endfor %}"
    assert message_ends(tok) == {eos}  # <|im_start|> comes after " said": it starts the next message
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}\n{% endfor %}"
    assert message_ends(tok) == {im_start, eos}  # right after the content: the next message's start ends this one
    tok.chat_template = None
    assert message_ends(tok) == {eos}


def test_a_tokenizer_not_loaded_is_refused_before_the_store_is_built() -> None:
    """``tokenizer=`` given a path (the checkpoint's, not yet loaded) is refused with what to pass instead."""
    model = tiny("lfm2")
    attention = model.config._attn_implementation
    with pytest.raises(TypeError, match=r"got a str: load it first"):
        prefixkv.PrefixStore(model, tokenizer="path/to/checkpoint")
    with pytest.raises(TypeError, match=r"got a str: load it first"):
        prefixkv.enable(model, tokenizer="path/to/checkpoint")
    # nothing left behind: generate is the class's own, the attention the model's
    assert "generate" not in vars(model) and model.config._attn_implementation == attention


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_pin_and_warm_leave_a_snapshot_where_they_end(family: str) -> None:
    """A pinned or warmed prefix off the grid: the next prompt that starts with it resumes at its end."""
    model = tiny(family)
    store = prefixkv.PrefixStore(model)
    pinned, warmed = tokens(90, seed=64), tokens(150, seed=65)
    assert store.pin(pinned) == 90
    store.warm([warmed], progress=False)
    for prefix, seed in ((pinned, 66), (warmed, 67)):
        stats = exact(compare(model, store, joined(prefix, tokens(20, seed=seed)), max_new_tokens=2))
        assert stats.cached_tokens == len(prefix) > below(len(prefix)), stats
    later = exact(compare(model, store, tokens(50, seed=68)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0


def test_under_a_tight_budget_every_miss_says_what_was_dropped() -> None:
    model = tiny("lfm2")
    store = prefixkv.PrefixStore(model)
    snapshots = store.snapshots
    taken: set[tuple[Any, tuple[int, ...]]] = set()  # every snapshot ever taken, by key space and path
    add = snapshots.add

    def noting(space: Any, keys: Any, snapshot: Any, **kw: Any) -> None:
        taken.add((space, tuple(keys[: snapshot.position])))
        add(space, keys, snapshot, **kw)

    snapshots.add = noting  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(57)
    documents = [tokens(200, seed=70 + d).tolist() for d in range(2)]
    budget = None
    misses = dropped = 0
    for k in range(24):
        x = int(torch.randint(40, 201, (1,), generator=generator))
        p = documents[k % 2][:x] + tokens(10, seed=700 + k).tolist()
        held = store.cached_length(p[:-1])
        was_taken = (store.blocks.space(), tuple(p[:held])) in taken  # before this call takes one there
        with prefixkv.PagedPrefixCache(store, torch.tensor([p])) as cache:
            model.generate(torch.tensor([p]), cache=cache, max_new_tokens=1, do_sample=False)
        if budget is None:  # the tightest budget: three snapshots
            budget = snapshots.max_bytes = 3 * next(iter(snapshots._held.values())).nbytes
        if cache.stats.cached_tokens < held:
            misses += 1
            why = cache.stats.not_cached or ""
            if was_taken:
                dropped += 1
                assert "taken and then dropped for the snapshots' budget" in why, why
            else:
                assert "no recurrent-state snapshot was taken yet" in why, why
        assert snapshots.bytes_used <= budget
    stats = store.stats
    assert misses > dropped > 0 and stats.snapshots_dropped_budget > 0 and stats.snapshots_dropped_path == 0
    assert stats.snapshots_taken - stats.snapshots_dropped_budget == stats.snapshots == len(snapshots)
    later = exact(compare(model, store, tokens(30, seed=71)[None]))  # an ordinary request after them
    assert later.cached_tokens == 0
    store.check_invariants()
