"""The edges of issue 25: the disk tier shared between stores, what a fingerprint and a namespace cover, in-place
weight writes, copies of a model, a failing second tier, chunked prefill, an exactly fitting budget, the display
of masked keys, scoring at the position limit, and torch.compile of a model with a store. Each test makes the
call that failed and, where the failure poisoned the store, then runs an ordinary later request and compares its
logits with stock ``generate`` in float64 on a model prefixkv never touched (a deepcopy made before the store)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import DynamicCache

import prefixkv
from prefixkv.kv.tier import OffloadTier

RUN: dict[str, Any] = dict(
    max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
)


def model64(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    return prefixkv.models.tiny_model(family, dtype=torch.float64, seed=seed, **overrides)


def stock(ref: Any, ids: torch.Tensor, **kwargs: Any) -> Any:
    """Stock generate on ``ref``, a model prefixkv never touched."""
    return ref.generate(ids, cache=DynamicCache(config=ref.config), **RUN, **kwargs)


def diff(out: Any, ref: Any) -> float:
    return max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits, strict=True))


def later_request(model: Any, ref: Any, store: prefixkv.PrefixStore, ids: torch.Tensor) -> tuple[int, float]:
    """An ordinary call that reuses what ``store`` holds for ``ids``: tokens reused, and its distance to stock."""
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        out = model.generate(ids, cache=cache, **RUN)
    return cache.stats.cached_tokens, diff(out, stock(ref, ids))


def warmed() -> tuple[Any, Any, prefixkv.PrefixStore, torch.Tensor]:
    """A float64 llama, a copy of it prefixkv never touches, a store of block size 4 that holds the K/V of a
    40-token prompt (from one generate call), and that prompt."""
    model = model64()
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.arange(10, 50)[None]
    run(model, store, ids)
    return model, ref, store, ids


def run(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, **kwargs: Any) -> tuple[Any, int]:
    """``generate`` with a cache built with ``attention_mask`` (and a call given it too); ``attention_mask_call``
    is given to the call alone."""
    mask = kwargs.pop("attention_mask", None)
    call_mask = kwargs.pop("attention_mask_call", mask)
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        out = model.generate(ids, cache=cache, attention_mask=call_mask, **RUN, **kwargs)
    return out, cache.stats.cached_tokens


# -- item 9: chunked prefill over reused K/V -------------------------------------------------------------------


def test_chunked_prefill_reuses_exactly() -> None:
    model, ref, store, ids = warmed()
    longer = torch.cat([ids, torch.arange(60, 80)[None]], dim=1)
    out, reused = run(model, store, longer, prefill_chunk_size=8)  # CacheMisuseError before the fix
    assert reused == 40
    assert diff(out, stock(ref, longer, prefill_chunk_size=8)) <= 1e-6
    mask = (torch.arange(40)[None] >= torch.tensor([[5], [0]])).long()
    batch = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), ids[0, :35]]), longer[0, :40]]) * mask
    out, reused = run(model, store, batch, attention_mask=mask, prefill_chunk_size=8)  # a raw RuntimeError before
    assert reused > 0
    assert diff(out, stock(ref, batch, attention_mask=mask, prefill_chunk_size=8)) <= 1e-6
    prefixkv.enable(model, store)
    hits = store.stats.hit_tokens
    out = model.generate(longer, prefill_chunk_size=8, **RUN)  # CacheMisuseError before the fix
    assert store.stats.hit_tokens > hits
    assert diff(out, stock(ref, longer, prefill_chunk_size=8)) <= 1e-6
    prefixkv.disable(model)
    store.check_invariants()
    reused, distance = later_request(model, ref, store, longer)
    assert reused == 59 and distance <= 1e-6


def test_chunked_prefill_replans_for_a_mask_the_cache_was_not_built_with() -> None:
    # issue 32, review finding 11: a cache built without the call's holed mask is re-planned for it, chunked (the
    # chunks are cut by the columns it holds) as unchunked; each on a store of its own, since a call publishes
    for hole, chunk in [(20, 8), (3, 8), (37, 3), (29, 64)]:
        mask = torch.ones(1, 40, dtype=torch.long)
        mask[0, hole] = 0
        model, ref, store, ids = warmed()
        plain, plain_reused = run(model, store, ids, attention_mask_call=mask)
        model, ref, store, ids = warmed()
        out, reused = run(
            model, store, ids, attention_mask_call=mask, prefill_chunk_size=chunk
        )  # CacheMisuseError before
        assert reused == plain_reused and hole - 4 < reused <= hole  # what lies before the hole, at most
        expected = stock(ref, ids, attention_mask=mask, prefill_chunk_size=chunk)
        assert diff(out, expected) <= 1e-6 and diff(plain, expected) <= 1e-6
        store.check_invariants()
        reused, distance = later_request(model, ref, store, ids)
        assert reused == 39 and distance <= 1e-6


# -- item 11: the display of keys of masked tokens -------------------------------------------------------------


def test_show_decodes_keys_of_masked_tokens() -> None:
    tok = prefixkv.models.tiny_tokenizer()
    model = prefixkv.models.tiny_model("llama")
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.tensor([tok("ba bebo, be kiko. ba bebo, be kiko.").input_ids])
    mask = torch.ones_like(ids)
    mask[0, 2] = 0  # a hole: the keys from there on are apart from the plain ids'
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    keys = [n.tokens for n in store.blocks.ledger.prefix_view()]
    assert any(k < 0 for edge in keys for k in edge)
    text = str(store.show(tok))  # OverflowError before the fix
    assert tok.decode(ids[0, :2]) in text
    assert "<span" in store.show(tok)._repr_html_()


# -- item 8: scoring at the position limit ---------------------------------------------------------------------


def test_rolling_loglikelihood_longer_than_max_length_is_that_of_hf() -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from prefixkv.integrations.lm_eval import PrefixKVLM

    def gpt2() -> Any:
        return model64("gpt2", max_position_embeddings=64)  # learned positions: feeding 65 tokens raises IndexError

    tok = prefixkv.models.tiny_tokenizer()
    text = " ".join(["ba bebo, be kiko."] * 20)  # far more than 64 tokens
    assert len(tok(text).input_ids) > 64
    request = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)]
    want = HFLM(pretrained=gpt2(), tokenizer=tok, batch_size=2).loglikelihood_rolling(request)
    model = gpt2()
    lm = PrefixKVLM(pretrained=model, tokenizer=tok, batch_size=2, prefix_block_size=4)
    assert lm.max_length == 64
    got = lm.loglikelihood_rolling(request)  # IndexError before the fix
    assert abs(got[0] - want[0]) < 1e-6
    lm.store.check_invariants()
    prefixkv.disable(model)


def test_score_at_the_position_limit_is_a_full_forward() -> None:
    model = model64("gpt2", max_position_embeddings=64)
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    context, continuation = torch.arange(3, 40).tolist(), torch.arange(40, 68).tolist()  # 65 tokens: 64 are fed
    (got,) = prefixkv.score(model, store, context, [continuation])  # IndexError before the fix
    with torch.no_grad():
        logits = ref(torch.tensor([context + continuation[:-1]])).logits[0, len(context) - 1 :]
    want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(continuation)[:, None]).squeeze(-1)
    assert (got.logprobs - want).abs().max().item() <= 1e-6
    (again,) = prefixkv.score(model, store, context, [continuation])  # reuses what the first call published
    assert store.stats.hit_tokens > 0
    assert (again.logprobs - want).abs().max().item() <= 1e-6


# -- items 1, 2 and 6, and two suspicions: the disk tier -------------------------------------------------------


def prompt(seed: int, n: int = 37) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def tier_store(model: Any, folder: Any, block_size: int = 4, **kwargs: Any) -> prefixkv.PrefixStore:
    """A pool of 48 tokens (one request of 37 + 5) over a disk tier in ``folder``."""
    return prefixkv.PrefixStore(
        model, block_size=block_size, num_blocks=48 // block_size, offload="disk", offload_dir=folder, **kwargs
    )


@pytest.mark.parametrize(
    "theirs",
    [dict(seed=1), dict(kv_dtype="int8"), dict(block_size=8)],
    ids=["other weights", "int8 vs plain", "block size 8 vs 4"],
)
def test_two_live_stores_in_one_directory_never_read_each_other(tmp_path: Any, theirs: dict[str, Any]) -> None:
    """Both stores offload the same prompt (same tokens: before the fix, the same file names), then each brings it
    back from the disk: its own K/V, exactly (an int8 store: exactly what it computes cold)."""
    ours_model, their_model = model64(), model64(seed=theirs.pop("seed", 0))
    ours_ref, their_ref = copy.deepcopy(ours_model), copy.deepcopy(their_model)
    if theirs.get("kv_dtype"):
        cold = prefixkv.PrefixStore(their_ref, block_size=4, kv_dtype="int8")
        their_want, _ = run(their_ref, cold, prompt(0))
        cold.close()
    else:
        their_want = stock(their_ref, prompt(0))
    ours, their = tier_store(ours_model, tmp_path), tier_store(their_model, tmp_path, **theirs)
    for model, store in ((ours_model, ours), (their_model, their)):
        run(model, store, prompt(0))
        run(model, store, prompt(1))  # evicts prompt 0 to the disk
    files = sorted(p.name for p in tmp_path.iterdir())
    for model, store, want in ((ours_model, ours, stock(ours_ref, prompt(0))), (their_model, their, their_want)):
        out, reused = run(model, store, prompt(0))  # each reads back its own files: 0.77 off, KeyError, RuntimeError
        tier = store.stats.offload
        assert tier is not None and tier.restored > 0 and reused == 36 // store.block_size * store.block_size
        assert diff(out, want) <= 1e-6
        store.check_invariants()
    assert set(files) <= {p.name for p in tmp_path.iterdir()}  # nobody deleted the other's files
    reused, distance = later_request(ours_model, ours_ref, ours, prompt(1))
    assert reused > 0 and distance <= 1e-6


def test_a_store_over_a_directory_of_another_model_misses_and_leaves_its_files(tmp_path: Any) -> None:
    theirs = tier_store(model64(seed=1), tmp_path)
    run(theirs.model, theirs, prompt(0))
    run(theirs.model, theirs, prompt(1))
    theirs.close()
    files = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert files
    model = model64()
    ref = copy.deepcopy(model)
    ours = tier_store(model, tmp_path)  # PersistError before: the directory held another model's files
    tier = ours.stats.offload
    assert tier is not None and tier.blocks == 0
    out, reused = run(model, ours, prompt(0))
    assert reused == 0 and diff(out, stock(ref, prompt(0))) <= 1e-6
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name in files} == files


def test_a_tier_file_of_another_namespace_is_a_miss(tmp_path: Any) -> None:
    """Every read checks the file's metadata and namespace, not only the scan at construction."""
    block = {"k.0": torch.ones(1, 4, 2, 8)}
    tier = OffloadTier("disk", directory=tmp_path, meta={"format": "prefixkv.block", "block_size": "4"})
    assert tier.put("a", block, "('lora-1',)")
    assert tier.get("a", "('lora-2',)") is None  # another adapter's K/V under the same key: a miss
    assert tier.path("a").exists() and "a" not in tier  # the file stays for its namespace
    again = OffloadTier("disk", directory=tmp_path, meta={"format": "prefixkv.block", "block_size": "4"})
    got = again.get("a", "('lora-1',)")
    assert got is not None and bool((got["k.0"] == 1).all())
    other = OffloadTier("disk", directory=tmp_path, meta={"format": "prefixkv.block", "block_size": "8"})
    assert len(other) == 0 and other.get("a", "('lora-1',)") is None  # another store's file: never listed
    again.check_invariants()


def test_two_stores_of_one_model_share_a_directory(tmp_path: Any) -> None:
    """The suspicion was real: the second store listed the first's files, the first's LRU deleted them, and the
    second then warned of unreadable files and failed check_invariants. A file gone is a plain miss now."""
    model = model64()
    ref = copy.deepcopy(model)
    first = tier_store(model, tmp_path, max_offload_memory="64KiB")
    run(model, first, prompt(0))
    run(model, first, prompt(1))
    second = tier_store(copy.deepcopy(model), tmp_path)  # lists the first's files of prompt 0
    assert second.tier is not None and len(second.tier) > 0
    for seed in range(2, 6):  # the first's tier budget drops prompt 0's files
        run(model, first, prompt(seed))
    first.check_invariants()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, reused = run(second.model, second, prompt(0))
    second.check_invariants()
    assert diff(out, stock(ref, prompt(0))) <= 1e-6
    reused, distance = later_request(model, ref, first, prompt(5))
    assert reused > 0 and distance <= 1e-6


def test_a_tier_that_cannot_write_drops_blocks_and_the_request_goes_on(tmp_path: Any) -> None:
    import shutil

    model = model64()
    ref = copy.deepcopy(model)
    folder = tmp_path / "tier"
    store = tier_store(model, folder)
    run(model, store, prompt(0))
    shutil.rmtree(folder)  # a full disk fails the same way: the write raises OSError
    with pytest.warns(UserWarning, match="cannot keep blocks") as caught:
        for seed in (1, 2, 3):  # each evicts the one before: FileNotFoundError out of generate before the fix
            out, _ = run(model, store, prompt(seed))
            assert diff(out, stock(ref, prompt(seed))) <= 1e-6
    assert sum("cannot keep blocks" in str(w.message) for w in caught) == 1  # warned once
    store.check_invariants()  # 8 blocks leaked before the fix
    assert store.stats.blocks_used <= store.max_blocks
    reused, distance = later_request(model, ref, store, prompt(3))
    assert reused == 36 and distance <= 1e-6


# -- items 3 and 4: what the namespace and the fingerprint cover -----------------------------------------------


def seen_as_new_weights(model: Any, ref: Any, store: prefixkv.PrefixStore, ids: torch.Tensor) -> None:
    """The call after a weight was written reuses nothing and gives stock's logits (float64, 1e-6); a later request
    reuses the new weights' own K/V."""
    out, reused = run(model, store, ids)
    assert reused == 0
    assert diff(out, stock(ref, ids)) <= 1e-6
    reused, distance = later_request(model, ref, store, ids)
    assert reused == 39 and distance <= 1e-6


@pytest.mark.parametrize(
    "write",
    [
        lambda p, other: p.data.mul_(1.5),  # an EMA-style update: 1.5e-3 off with 39 tokens reused before the fix
        lambda p, other: p.data.copy_(other),  # a hand-written optimizer loop: 0.86 off before the fix
    ],
    ids=["data.mul_", "data.copy_"],
)
def test_weights_written_through_data_start_a_new_namespace(write: Any) -> None:
    model, ref, store, ids = warmed()
    other = model64(seed=1)
    for target in (model, ref):
        for p, q in zip(target.model.layers[0].self_attn.k_proj.parameters(), other.model.layers[0].parameters()):
            write(p, q.data[: p.shape[0], : p.shape[1]] if p.dim() == 2 else q.data[: p.shape[0]])
    seen_as_new_weights(model, ref, store, ids)


def test_a_weight_edited_in_part_in_place_starts_a_new_namespace() -> None:
    """Issue 43: one entry of a weight changed in place (``w[1, 1] += 0.5``, as an optimizer step on a sparse
    gradient or a hand edit does) keeps the storage and every sampled value; only the tensor's version counter
    tells. Left out of the weights' state, 29 stale tokens were reused, 1.6e-3 off stock."""
    model, ref, store, ids = warmed()
    weight = model.model.layers[0].self_attn.k_proj.weight
    sampled = prefixkv.kv.key_space._few_values(weight).clone()
    for target in (model, ref):
        with torch.no_grad():
            target.model.layers[0].self_attn.k_proj.weight[1, 1] += 0.5
    assert torch.equal(prefixkv.kv.key_space._few_values(weight), sampled)  # the sampled values do not see it
    out, reused = run(model, store, ids)
    distance = diff(out, stock(ref, ids))
    assert distance <= 1e-6 and reused == 0, (distance, reused)
    reused, distance = later_request(model, ref, store, ids)
    assert reused == 39 and distance <= 1e-6  # the new weights' own K/V, reused


def _load_scaled(model: Any, name: str) -> None:
    state = model.state_dict()
    model.load_state_dict({**state, name: state[name] * 1.5})  # copied into the same tensors


def _copy_scaled(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.copy_(p * 1.5)


# every way a weight is written that the key space must see, whether or not it walked the weights earlier in the call
WRITES = {
    "data.add_": lambda model, attn: attn.k_proj.weight.data.add_(0.25),
    "load_state_dict": lambda model, attn: _load_scaled(model, "model.layers.0.self_attn.k_proj.weight"),
    "copy_ under no_grad": lambda model, attn: _copy_scaled(attn.k_proj.weight),
    "a new Parameter": lambda model, attn: setattr(
        attn.k_proj, "weight", torch.nn.Parameter(attn.k_proj.weight.detach() * 1.5)
    ),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_every_way_of_writing_a_weight_starts_a_new_namespace(write: str) -> None:
    """The weights are walked once per cache's construction and once at the first step of its generate call (the
    step's forward takes the space read then): a write between two calls is seen by the next one."""
    model, ref, store, ids = warmed()
    for target in (model, ref):
        WRITES[write](target, target.model.layers[0].self_attn)
    seen_as_new_weights(model, ref, store, ids)


def test_a_weight_written_between_building_the_cache_and_generate_is_seen() -> None:
    """The cache's construction reused K/V of the weights then; a write through ``.data`` (no version) before its
    generate call is seen at the call's first step, which looks the prompt up again under the new weights' key."""
    model, ref, store, ids = warmed()
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        assert cache.stats.cached_tokens == 39
        for target in (model, ref):
            target.model.layers[0].self_attn.k_proj.weight.data.mul_(1.5)
        out = model.generate(ids, cache=cache, **RUN)
    assert cache.stats.cached_tokens == 0
    assert diff(out, stock(ref, ids)) <= 1e-6
    reused, distance = later_request(model, ref, store, ids)
    assert reused == 39 and distance <= 1e-6


def test_the_space_read_at_a_calls_first_step_serves_its_first_forward_only() -> None:
    """A second generate call on one cache after a write through ``.data`` walks the weights again: its K/V (the new
    weights' over the old ones') are not published under the old weights' key, which the weights get back after
    (``.data`` writes bump no version). Had its forward taken the first call's space, the later request reused them:
    1.2e-3 off stock."""
    model, ref, store, ids = warmed()
    weights = [m.model.layers[0].self_attn.k_proj.weight for m in (model, ref)]
    own = DynamicCache(config=ref.config)
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        first = model.generate(ids, cache=cache, **RUN)
        expected = ref.generate(ids, cache=own, **RUN)
        assert diff(first, expected) <= 1e-6
        for w in weights:
            w.data.mul_(2.0)
        longer = torch.cat([first.sequences, torch.arange(60, 70)[None]], dim=1)
        second = model.generate(longer, cache=cache, **RUN)
    assert diff(second, ref.generate(longer, cache=own, **RUN)) <= 1e-6
    for w in weights:
        w.data.div_(2.0)  # exactly the first weights again, under their key
    reused, distance = later_request(model, ref, store, torch.cat([second.sequences, torch.arange(80, 84)[None]], 1))
    assert reused >= first.sequences.shape[1] - 1 and distance <= 1e-6


@pytest.mark.parametrize(
    ("family", "field", "before", "after"),
    [
        ("mistral", "sliding_window", 24, None),  # 3.3e-2 off before the fix
        ("llama", "rms_norm_eps", 1e-6, 0.1),  # 6.3e-2 off
        ("granite", "attention_multiplier", 0.5, 2.0),  # 1.6e-3 off
    ],
)
def test_a_file_saved_under_another_config_is_refused(
    tmp_path: Any, family: str, field: str, before: Any, after: Any
) -> None:
    model = model64(family, **{field: before})
    store = prefixkv.PrefixStore(model, block_size=4)
    run(model, store, torch.arange(10, 50)[None])
    path = tmp_path / "prefixes.safetensors"
    store.save(path)
    edited = model64(family, **{field: after})  # the same weights (same seed and shapes), another config
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), edited.parameters()))
    with pytest.raises(prefixkv.PersistError, match="config"):
        prefixkv.PrefixStore.load(path, edited)
    assert prefixkv.PrefixStore.load(path, model64(family, **{field: before})).stats.cached_tokens == 44


def test_a_config_edited_at_run_time_starts_a_new_namespace() -> None:
    model = model64("mistral", sliding_window=24)
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.arange(10, 50)[None]
    run(model, store, ids)
    model.config.sliding_window = ref.config.sliding_window = None  # the masks read it at each forward
    assert diff(stock(ref, ids), stock(model64("mistral", sliding_window=24), ids)) > 1e-3  # it changes K/V
    out, reused = run(model, store, ids)
    assert reused == 0
    assert diff(out, stock(ref, ids)) <= 1e-6
    reused, distance = later_request(model, ref, store, ids)
    assert reused == 39 and distance <= 1e-6


# -- item 10: a repeated request at a budget that exactly fits -------------------------------------------------


def test_a_cache_hit_needs_no_more_blocks_than_the_cold_call() -> None:
    ids = torch.arange(10, 20)[None]  # 10 tokens + 5 fed generated ones: 15 columns, 4 blocks of 4
    small = model64()
    with pytest.raises(prefixkv.CapacityError):
        run(small, prefixkv.PrefixStore(small, block_size=4, num_blocks=3), ids)  # 3 blocks do not fit
    model = model64()
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4, num_blocks=4)
    cold, reused = run(model, store, ids)
    assert reused == 0 and diff(cold, stock(ref, ids)) <= 1e-6
    for _ in range(2):
        warm, reused = run(model, store, ids)  # CapacityError before the fix: the matched part-block stayed locked
        assert reused == 9 and diff(warm, stock(ref, ids)) <= 1e-6
        store.check_invariants()
    longer = torch.arange(10, 22)[None]  # a reuse that ends mid-block, then more blocks than the pool holds
    with pytest.raises(prefixkv.CapacityError):
        run(model, store, torch.arange(10, 40)[None])
    store.check_invariants()
    reused, distance = later_request(model, ref, store, longer)
    assert reused > 0 and distance <= 1e-6


# (issue 32, review #2) a request under a longer cached prefix, at a budget it fits on a fresh store: its lock
# covers the whole blocks it reuses, not the node where its match ends, nor a block of a split it does not read
LONGER_PREFIX = {
    # one row whose 9-token prompt the store holds 12 tokens of (reuse capped at 8: the lock stayed on 12, then
    # publishing split the trie's block after the 9th token, and the split's half kept the trie's block locked)
    "default": ({}, 4, torch.arange(10, 20)[None], torch.arange(10, 19)[None]),
    # two rows reusing 8 (one offset per batch) though one matches 12: both locked before the first publish
    "batch": (
        {},
        10,
        torch.arange(10, 34)[None],
        torch.tensor([[*range(10, 22), *range(60, 68)], [*range(10, 18), *range(70, 82)]]),
    ),
    # the canonical chunks of 16 tokens held inside a node of 24: the whole node stayed locked
    "invariant": (dict(invariant=True, chunk_size=8), 8, torch.arange(10, 36)[None], torch.arange(10, 32)[None]),
}


@pytest.mark.parametrize("kind", list(LONGER_PREFIX))
def test_a_request_under_a_longer_cached_prefix_fits_where_it_fits_fresh(kind: str) -> None:
    options, budget, primer, ids = LONGER_PREFIX[kind]
    model = model64()
    ref = copy.deepcopy(model)
    fresh = prefixkv.PrefixStore(model, block_size=4, num_blocks=budget, **options)
    out, _ = run(model, fresh, ids)  # the request fits this budget
    assert diff(out, stock(ref, ids)) <= 1e-6
    fresh.close()
    store = prefixkv.PrefixStore(model, block_size=4, num_blocks=budget, **options)
    run(model, store, primer)
    assert store.stats.blocks_evictable == store.stats.blocks_used  # all the store holds may go
    warm, reused = run(model, store, ids)  # CapacityError before the fix
    assert reused == {"default": 8, "batch": 2 * 8, "invariant": 16}[kind] and store.stats.evictions > 0
    assert diff(warm, stock(ref, ids)) <= 1e-6
    store.check_invariants()
    reused, distance = later_request(model, ref, store, ids)
    assert reused > 0 and distance <= 1e-6


# -- items 5 and 7: copies of a model --------------------------------------------------------------------------


def test_a_deep_copy_refuses_the_original_stores_cache_and_publishes_nothing() -> None:
    model, ref, store, ids = warmed()
    twin = copy.deepcopy(model)  # carries the store's hooks
    with torch.no_grad():
        twin.model.layers[0].self_attn.k_proj.weight.mul_(2.0)  # the copy's weights change, not the store's model's
    longer = torch.cat([ids, torch.arange(60, 70)[None]], dim=1)
    with prefixkv.PagedPrefixCache(store, longer) as cache, pytest.raises(prefixkv.CacheMisuseError, match="copy"):
        twin.generate(longer, cache=cache, **RUN)  # accepted before, and published the copy's K/V (7.7e-2 off)
    store.check_invariants()
    out = twin.generate(longer, cache=DynamicCache(config=twin.config), **RUN)  # the copy works stock
    assert out.sequences.shape[1] == longer.shape[1] + 5
    reused, distance = later_request(model, ref, store, longer)
    assert reused == 40 and distance <= 1e-6


def test_a_deep_copy_of_an_enabled_model_generates_stock() -> None:
    model = model64()
    ref = copy.deepcopy(model)
    store = prefixkv.enable(model, block_size=4)
    ids = torch.arange(10, 50)[None]
    model.generate(ids, **RUN)
    twin = copy.deepcopy(model)  # TypeError: cannot pickle '_thread.RLock' before the fix
    hits = store.stats.hit_tokens
    assert diff(twin.generate(ids, **RUN), stock(ref, ids)) <= 1e-6
    assert store.stats.hit_tokens == hits  # the copy ran stock: the store is the original's
    assert diff(model.generate(ids, **RUN), stock(ref, ids)) <= 1e-6
    assert store.stats.hit_tokens == hits + 39
    prefixkv.disable(twin)  # the copy's patch only: the original stays enabled
    assert "generate" not in twin.__dict__ and not store.closed
    own = prefixkv.enable(twin, block_size=4)  # a copy can have a store of its own
    assert own is not store and diff(twin.generate(ids, **RUN), stock(ref, ids)) <= 1e-6
    prefixkv.disable(twin)
    # the copy's own store was the last user of the copy's attention switch: it leaves no trace there (it kept the
    # copied count, and the copy on prefixkv attention, before the switch was a SharedPatch)
    assert twin.config._attn_implementation == "sdpa" and not any(k.startswith("_prefixkv") for k in vars(twin))
    prefixkv.disable(model)
    assert store.closed


# -- suspicion: a prepare_inputs_for_generation call of one's own ----------------------------------------------


def test_a_manual_prepare_call_does_not_skip_the_next_forwards_checks() -> None:
    """The suspicion was real: without is_first_iteration, the wrapper took the call for a decode step, so the next
    forward checked only its new mask columns and published K/V computed under a hole as the plain ids'."""
    model = model64()
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = torch.arange(10, 50)[None]
    mask = torch.ones_like(ids)
    mask[0, 5] = 0  # a hole in the columns the first forward computed without it
    cache = prefixkv.PagedPrefixCache(store)
    with torch.no_grad():
        for start, stop, m in ((0, 20, torch.ones_like(ids)), (20, 40, mask)):
            model.prepare_inputs_for_generation(ids[:, :stop], cache=cache, attention_mask=m[:, :stop])
            model(input_ids=ids[:, start:stop], attention_mask=m[:, :stop], cache=cache, use_cache=True)
    cache.close()
    store.check_invariants()
    reused, distance = later_request(model, ref, store, ids)
    assert distance <= 1e-6  # 0.64 off before the fix: 39 tokens reused from the second forward
    assert reused == 20


# -- suspicion: torch.compile of a model with a store ----------------------------------------------------------


def test_a_compiled_model_with_a_store_compiles_once_and_stays_exact() -> None:
    """The suspicion was real: dynamo traced the store's hooks and the cache's bookkeeping, broke its graphs there
    (a thread id, a lock, ``.item()``) and recompiled on ints that change every step. prefixkv's Python now runs
    outside dynamo, and a compiled model's forwards with the cache other than its one-token steps run uncompiled
    (issue 43): no call breaks a graph, later calls compile nothing."""
    from torch._dynamo.utils import counters

    model = model64()
    ref = copy.deepcopy(model)
    store = prefixkv.PrefixStore(model, block_size=4)
    torch._dynamo.reset()
    model.compile(backend="eager")
    ids = torch.arange(10, 50)[None]
    calls = [ids, ids, torch.arange(10, 63)[None], torch.stack([torch.arange(10, 40), torch.arange(100, 130)])]
    try:
        for n, prompt in enumerate(calls):
            want = stock(ref, prompt)
            counters.clear()
            out, reused = run(model, store, prompt)
            assert reused == (0, 39, 40, 0)[n]
            assert diff(out, want) <= 1e-6
            if n == 0:  # the cache's forwards other than its one-token steps run the plain call: no graph break
                assert not counters["graph_break"], dict(counters["graph_break"])
            else:  # 9, 8 and 7 frames compiled before the fix, 6, 8 and 3 of them recompiles; now the first call of
                # a batch of 2 compiles its step's one graph (dynamo specializes a batch of 1), and nothing else does
                assert counters["frames"]["total"] == (1 if n == 3 else 0), (n, dict(counters["frames"]))
                assert not counters["graph_break"], dict(counters["graph_break"])
        store.check_invariants()
        with torch.compiler.set_stance("force_eager"):
            reused, distance = later_request(model, ref, store, calls[2])
        assert reused == 52 and distance <= 1e-6
    finally:
        torch._dynamo.reset()
