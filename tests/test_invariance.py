"""Outputs that never depend on what the cache holds (docs/correctness.md): in an invariant store
(``PrefixStore(invariant=True)``) a call's logits are bit-identical (``torch.equal`` at every step) whatever
the store holds: nothing, a prefix cut at any offset inside or across a chunk (cached by an earlier call of
another length and batch size), blocks restored from the cpu or disk tier, a store loaded from a file, a
prefix computed by ``pin``/``warm`` or by an in-batch shared prefill; in float32, bfloat16 and float16;
greedy, seeded sampling, beams and ``num_return_sequences``; for every family tests/test_families.py builds;
and for ``prefixkv.score`` and the lm-eval model, whatever the order of their contexts or documents; under
``torch.inference_mode()`` with caches dropped by ``del``. An invariant store's cold call stays within 1e-6 of
stock ``generate`` in float64. (Whether the default store differs in bfloat16 depends on the CPU's kernels, so
no test asserts that it does.)

Every reference (the cold call) runs on a fresh store before the store under test holds anything, or on a
store of its own: a cold call computes the same K/V however the store it runs on was filled, so this is
what the guarantee claims."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compare, left_pad, random_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from test_families import FAMILIES
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import prefixkv
from prefixkv import PersistError, PrefixStore, UnsupportedModelError

BS = 4
CHUNK = 8  # two blocks: cuts fall inside and across chunks
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GREEDY: dict[str, Any] = {"do_sample": False}
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": GREEDY,
    "sampling": {"do_sample": True, "top_k": 20, "temperature": 0.9},
    "beams": {"do_sample": False, "num_beams": 3},
    "num_return_sequences": {"do_sample": True, "num_return_sequences": 2},
}
_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def model_of(dtype: torch.dtype, family: str = "llama") -> Any:
    """One tiny model per family and dtype for the whole module (tiny_model is deterministic by seed)."""
    key = (family, dtype)
    if key not in _MODELS:
        _MODELS[key] = prefixkv.models.tiny_model(family, dtype=dtype)
    return _MODELS[key]


def invariant_store(model: Any, **kw: Any) -> PrefixStore:
    return PrefixStore(model, block_size=BS, invariant=True, chunk_size=CHUNK, **kw)


def run(
    model: Any,
    store: PrefixStore,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    new: int = 5,
    gen: dict[str, Any] = GREEDY,
) -> tuple[Any, prefixkv.CacheStats]:
    """One generate call with a PagedPrefixCache of ``store``: its output (sequences, every step's logits) and
    the cache's statistics; the store's refcounts are checked after it."""
    torch.manual_seed(0)
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=new,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **gen,
        )
    store.check_invariants()
    return out, cache.stats


def cold(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None, **kw: Any) -> Any:
    """The reference: the call on a store that holds nothing."""
    store = invariant_store(model)
    try:
        out, stats = run(model, store, ids, mask, **kw)
    finally:
        store.close()
    assert stats.cached_tokens == 0
    return out


def assert_identical(out: Any, ref: Any) -> None:
    """The same tokens and, at every step, bit-identical logits."""
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        assert torch.equal(a, b), f"step {step}: logits differ by up to {(a.double() - b.double()).abs().max():.3g}"


def prime(model: Any, store: PrefixStore, rows: list[torch.Tensor]) -> None:
    """An earlier call of another length and batch size: the rows left-padded into one batch."""
    ids, mask = left_pad(rows)
    run(model, store, ids, mask, new=2)


# -- cold vs warm, every cut ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_warm_equals_cold_for_a_prefix_cut_at_every_offset(dtype: torch.dtype) -> None:
    model = model_of(dtype)
    ids = random_tokens(29, seed=1)[None]
    ref = cold(model, ids)
    for cut in range(1, 29):
        store = invariant_store(model)
        prime(model, store, [ids[0, :cut], random_tokens(cut + 7, seed=cut)])  # a batch of 2, other lengths
        out, stats = run(model, store, ids)
        assert stats.cached_tokens == (cut - 1) // CHUNK * CHUNK  # whole chunks before its last token
        assert_identical(out, ref)
        store.close()


@settings(max_examples=12, deadline=None)
@given(
    length=st.integers(2, 40),
    cuts=st.lists(st.integers(1, 48), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    earlier_batch=st.integers(1, 3),
)
def test_warm_equals_cold_after_any_earlier_calls(
    length: int, cuts: list[int], dtype: torch.dtype, earlier_batch: int
) -> None:
    model = model_of(dtype)
    ids = random_tokens(length + 8, seed=length)[None, :length]
    ref = cold(model, ids)
    store = invariant_store(model)
    for n, cut in enumerate(cuts):  # earlier prompts that share a prefix of any length with this one
        longer = random_tokens(length + 8, seed=length)[:cut]
        prime(model, store, [longer] + [random_tokens(cut + 3, seed=100 + n + k) for k in range(earlier_batch - 1)])
    out, _ = run(model, store, ids)
    assert_identical(out, ref)
    again, stats = run(model, store, ids)  # and once more, after everything this store has seen
    assert_identical(again, ref)
    assert stats.cached_tokens == (length - 1) // CHUNK * CHUNK
    store.close()


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_warm_equals_cold_in_every_generation_mode(setting: str, dtype: torch.dtype) -> None:
    model = model_of(dtype)
    ids = random_tokens(27, seed=2)[None]
    ref = cold(model, ids, gen=SETTINGS[setting], new=6)
    store = invariant_store(model)
    prime(model, store, [ids[0, :21]])
    out, stats = run(model, store, ids, gen=SETTINGS[setting], new=6)
    assert stats.cached_tokens == 16
    assert_identical(out, ref)
    store.close()


def test_a_padded_batch_is_identical_warm_and_cold() -> None:
    """A row's pads are part of the call's shape: the same padded batch gives the same logits, whatever the
    store holds for each of its rows."""
    model = model_of(torch.bfloat16)
    rows = [random_tokens(30, seed=3), random_tokens(19, seed=4), random_tokens(25, seed=5)]
    ids, mask = left_pad(rows)
    ref = cold(model, ids, mask)
    store = invariant_store(model)
    prime(model, store, [rows[0][:26]])
    prime(model, store, [rows[2], rows[1][:10]])
    out, stats = run(model, store, ids, mask)
    assert stats.cached_tokens > 0
    assert_identical(out, ref)
    store.close()


def test_matches_ending_inside_chunks_under_other_batches_read_one_grouped_kernel(monkeypatch: Any) -> None:
    """Each row of a padded batch finds a match that ends inside a chunk, cached by earlier calls of other batch
    compositions; warm equals cold, and every attention call of both ran the canonical read's grouped-head kernel
    on whole rows (never the model's own attention, which repeats the K/V heads: the tiny llama has 4 query heads
    over 2)."""
    calls: list[tuple[int, ...]] = []
    canonical = prefixkv.attention.kernels.whole_rows_attention

    def counted(query: torch.Tensor, key: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(tuple(key.shape))
        return canonical(query, key, *args)

    monkeypatch.setattr(prefixkv.attention.kernels, "whole_rows_attention", counted)
    own = ALL_ATTENTION_FUNCTIONS["sdpa"]
    owns: list[int] = []

    def own_counted(*args: Any, **kwargs: Any) -> Any:
        owns.append(1)
        return own(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", own_counted)
    model = model_of(torch.bfloat16)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    rows = [random_tokens(31, seed=6), random_tokens(22, seed=7), random_tokens(37, seed=8)]
    ids, mask = left_pad(rows)
    empty = invariant_store(model)
    owns.clear()  # the forwards that check the model when a store is built run its own attention, without a cache
    ref, _ = run(model, empty, ids, mask)
    empty.close()
    assert calls and not owns and all(shape[1] == model.config.num_key_value_heads for shape in calls)
    store = invariant_store(model)
    owns.clear()
    prime(model, store, [rows[0][:13], random_tokens(9, seed=9)])  # 13: inside the second chunk
    prime(model, store, [rows[2][:27]])
    prime(model, store, [rows[1][:19], random_tokens(30, seed=10), rows[0][:21], random_tokens(4, seed=11)])
    calls.clear()
    out, stats = run(model, store, ids, mask)
    assert stats.cached_tokens > 0
    assert calls and not owns
    assert_identical(out, ref)
    store.close()


def test_inference_mode_and_del_keep_the_guarantee() -> None:
    """Scripts run generate under ``torch.inference_mode()`` and drop caches with ``del``: the canonical chunks
    are computed, published and reused there too, and every block comes back without the cyclic collector."""
    model = model_of(torch.bfloat16)
    ids = random_tokens(30, seed=12)[None]
    ref = cold(model, ids)
    store = invariant_store(model)
    gc.disable()  # the blocks must come back by reference counting alone
    try:
        with torch.inference_mode():
            for n in range(2):  # cold, then warm
                cache = prefixkv.PagedPrefixCache(store, ids)
                torch.manual_seed(0)
                out = model.generate(
                    ids, cache=cache, max_new_tokens=5, output_logits=True, return_dict_in_generate=True, **GREEDY
                )
                assert cache.stats.cached_tokens == (0, 24)[n]
                assert_identical(out, ref)
                del cache, out  # the output holds the cache too (out.past_key_values)
                assert store.stats.blocks_used == store.stats.blocks_evictable  # no live cache holds a block
    finally:
        gc.enable()
    store.check_invariants()
    store.close()


# -- every way K/V come back ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_blocks_restored_from_the_second_tier_give_identical_logits(kind: str, tmp_path: Any) -> None:
    model = model_of(torch.bfloat16)
    ids = random_tokens(37, seed=6)[None]
    ref = cold(model, ids)
    store = invariant_store(model, num_blocks=12, offload=kind, offload_dir=tmp_path if kind == "disk" else None)
    prime(model, store, [ids[0, :33]])  # 32 tokens: 8 blocks
    for seed in range(3):  # other prompts evict them into the tier
        prime(model, store, [random_tokens(40, seed=200 + seed)])
    assert store.stats.offload is not None and store.stats.offload.blocks >= 8
    out, stats = run(model, store, ids)
    assert stats.cached_tokens == 32
    assert store.stats.offload.restored > 0
    assert_identical(out, ref)
    store.close()


def test_a_store_loaded_from_a_file_gives_identical_logits(tmp_path: Any) -> None:
    model = model_of(torch.bfloat16)
    ids = random_tokens(35, seed=7)[None]
    ref = cold(model, ids)
    store = invariant_store(model)
    prime(model, store, [ids[0, :34], random_tokens(20, seed=8)])
    store.save(tmp_path / "p.safetensors")
    store.close()
    loaded = PrefixStore.load(tmp_path / "p.safetensors", model)
    assert loaded.invariant and loaded.chunk_size == CHUNK
    out, stats = run(model, loaded, ids)
    assert stats.cached_tokens == 32
    assert_identical(out, ref)
    loaded.close()


def test_files_of_another_schedule_are_refused(tmp_path: Any) -> None:
    model = model_of(torch.bfloat16)
    ids = random_tokens(20, seed=9)[None]
    default, invariant = PrefixStore(model, block_size=BS), invariant_store(model)
    for store, name in ((default, "default"), (invariant, "invariant")):
        run(model, store, ids, new=1)
        store.save(tmp_path / f"{name}.safetensors")
    with pytest.raises(PersistError, match="default schedule"):
        PrefixStore.load(tmp_path / "default.safetensors", model, invariant=True, chunk_size=CHUNK)
    with pytest.raises(PersistError, match="default schedule"):
        invariant.merge(tmp_path / "default.safetensors")
    with pytest.raises(PersistError, match="chunk_size=8"):
        default.merge(tmp_path / "invariant.safetensors")
    with pytest.raises(PersistError, match="chunk_size=8"):
        PrefixStore.load(tmp_path / "invariant.safetensors", model, invariant=True, chunk_size=16)
    default.close()
    invariant.close()


def test_pinned_and_warmed_prefixes_give_identical_logits() -> None:
    model = model_of(torch.bfloat16)
    system = random_tokens(21, seed=10)
    ids = torch.cat([system, random_tokens(6, seed=11)])[None]
    ref = cold(model, ids)
    pinned = invariant_store(model)
    assert pinned.pin(system) == 16  # its whole chunks
    out, stats = run(model, pinned, ids)
    assert stats.cached_tokens == 16
    assert_identical(out, ref)
    pinned.unpin(system)
    pinned.close()
    warmed = invariant_store(model)
    row = warmed.warm([system], progress=False).per_row[0]
    assert (row.cached_tokens, row.computed_tokens) == (0, 16)
    out, stats = run(model, warmed, ids)
    assert stats.cached_tokens == 16
    assert_identical(out, ref)
    with pytest.raises(ValueError, match="hold none"):
        warmed.pin(system[:7])
    warmed.close()


def test_an_in_batch_shared_prefill_gives_identical_logits() -> None:
    """Rows that share a prefix compute it once in the call (cold), or reuse it from an earlier call (warm):
    the same batch's logits either way, and the cold call reports nothing as cached."""
    model = model_of(torch.bfloat16)
    system = random_tokens(24, seed=12)
    rows = [torch.cat([system, random_tokens(n, seed=13 + n)]) for n in (3, 9, 5)]
    ids, mask = left_pad(rows)
    store = invariant_store(model)
    ref, stats = run(model, store, ids, mask)
    assert stats.cached_tokens == 0 and stats.computed_tokens == sum(len(r) for r in rows)
    store.close()
    store = invariant_store(model)
    prime(model, store, [torch.cat([system, random_tokens(4, seed=99)])])
    out, stats = run(model, store, ids, mask)
    assert stats.cached_tokens > 0
    assert_identical(out, ref)
    store.close()


def test_an_8_bit_store_gives_identical_logits() -> None:
    model = model_of(torch.bfloat16)
    ids = random_tokens(30, seed=14)[None]
    store = invariant_store(model, kv_dtype="int8")
    ref, _ = run(model, store, ids)
    store.close()
    store = invariant_store(model, kv_dtype="int8")
    prime(model, store, [ids[0, :19], random_tokens(12, seed=15)])
    out, stats = run(model, store, ids)
    assert stats.cached_tokens == 16
    assert_identical(out, ref)
    store.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_invariant_in_bfloat16(family: str) -> None:
    """Every family tests/test_families.py builds: warm (the prefix cut one token past a chunk, and inside the
    third) equals cold, and the warm call reuses the whole chunks before the cut."""
    model = model_of(torch.bfloat16, family)
    ids = random_tokens(26, seed=16)[None]
    try:
        ref = cold(model, ids)
    except UnsupportedModelError as exc:
        pytest.skip(f"the store refuses {family}: {exc}")
    for cut in (9, 20):
        store = invariant_store(model)
        prime(model, store, [ids[0, :cut], random_tokens(cut + 5, seed=17)])
        out, stats = run(model, store, ids)
        assert stats.cached_tokens == (cut - 1) // CHUNK * CHUNK, (family, cut, stats)
        assert_identical(out, ref)
        store.close()


def test_score_is_identical_warm_and_cold() -> None:
    model = model_of(torch.bfloat16)
    context = random_tokens(30, seed=18).tolist()
    answers = [random_tokens(3, seed=19).tolist(), random_tokens(5, seed=20).tolist()]
    store = invariant_store(model)
    ref = prefixkv.score(model, store, context, answers)
    store.close()
    store = invariant_store(model)
    prime(model, store, [torch.tensor(context[:23])])
    warm = prefixkv.score(model, store, context, answers)
    assert store.stats.hit_tokens > 0
    for a, b in zip(warm, ref):
        assert torch.equal(a.logprobs, b.logprobs)
    store.close()


def score_contexts() -> tuple[list[list[int]], list[list[int]]]:
    """Six contexts of 13 to 33 tokens sharing a 17-token prefix, each with two continuations of 1 to 4 tokens."""
    system = random_tokens(17, seed=25).tolist()
    contexts = [system + random_tokens(n, seed=26 + n).tolist() for n in (0, 4, 9, 12, 16, 16) for _ in range(2)]
    contexts[0] = contexts[1] = system[:13]
    continuations = [random_tokens(1 + k % 4, seed=40 + k).tolist() for k in range(len(contexts))]
    return contexts, continuations


def test_score_is_identical_whatever_order_the_contexts_come_in() -> None:
    """The same scores (``torch.equal``) for the contexts in one order on an empty store, and in the reverse
    order on the store the first call filled (score batches its rows longest first, so the batches are the
    same; what the store holds for each batch is not)."""
    model = model_of(torch.bfloat16)
    contexts, continuations = score_contexts()
    store = invariant_store(model)
    first = prefixkv.score(model, store, contexts, continuations, batch_size=3)
    hits = store.stats.hit_tokens
    backwards = prefixkv.score(model, store, contexts[::-1], continuations[::-1], batch_size=3)[::-1]
    assert store.stats.hit_tokens - hits > hits  # the second call reused more than the first
    for n, (a, b) in enumerate(zip(backwards, first)):
        assert torch.equal(a.logprobs, b.logprobs), (n, a.logprobs, b.logprobs)
    store.close()


def lm_eval_tasks(folder: Path, docs: list[dict[str, Any]], name: str) -> list[str]:
    """Two local tasks over ``docs``: ``{name}_mc``, multiple choice after the same two few-shot examples
    (``first_n``) and description, and ``{name}_ppl``, the rolling log-likelihood of each question."""
    import json

    (folder / f"{name}.json").write_text(json.dumps(docs))
    (folder / "shots.json").write_text(json.dumps(docs[:2]))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    train: {folder / 'shots.json'}\n"
    data += f"    test: {folder / name}.json\ntest_split: test\nfewshot_split: train\n"
    (folder / f"{name}_mc.yaml").write_text(
        f"task: {name}_mc\n{data}num_fewshot: 2\nfewshot_config:\n  sampler: first_n\n"
        'description: "da de di do du fa fe fi fo fu ga ge gi go gu. "\noutput_type: multiple_choice\n'
        'doc_to_text: "{{q}} ?"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / f"{name}_ppl.yaml").write_text(
        f"task: {name}_ppl\n{data}output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{q}}"\nmetric_list:\n  - metric: word_perplexity\n'
    )
    return [f"{name}_mc", f"{name}_ppl"]


def test_lm_eval_log_likelihoods_do_not_depend_on_the_order_of_the_documents(tmp_path: Path) -> None:
    """``hf-prefixkv`` with ``invariant=True`` (its model_args string, as the command line passes it), bfloat16:
    a local task run on an empty store, then the same documents in the reverse order on the store the first run
    filled, give every sample the same log-likelihoods, bit for bit."""
    pytest.importorskip("lm_eval")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import prefixkv.integrations.lm_eval  # registers hf-prefixkv

    model_dir = tmp_path / "model"
    model_of(torch.bfloat16).save_pretrained(model_dir)
    prefixkv.models.tiny_tokenizer().save_pretrained(model_dir)
    words = ["ko ku", "la le", "mo mu", "pa pe", "ru ro", "su si", "ta to", "vu va", "wo we", "za zi ze"]
    docs = [
        {"q": " ".join(words[n:] + words[:n]), "choices": ["ba", "be bo", "bi"], "answer": n % 3}
        for n in range(len(words))
    ]
    tasks = {
        "forwards": lm_eval_tasks(tmp_path, docs, "forwards"),
        "backwards": lm_eval_tasks(tmp_path, docs[:2] + docs[2:][::-1], "backwards"),  # the same few-shot examples
    }
    # softmax_dtype=float32: lm-eval sums a sample's log-probabilities in the softmax's dtype, and a bfloat16 sum
    # near -128 moves in steps of 1, which would hide the differences this test is for
    args = f"pretrained={model_dir},dtype=bfloat16,softmax_dtype=float32,invariant=True,prefix_block_size={BS},"
    args += f"prefix_chunk_size={CHUNK}"
    lm = get_model("hf-prefixkv").create_from_arg_string(args, {"batch_size": 1, "device": "cpu"})
    assert lm.store.invariant and lm.store.chunk_size == CHUNK and lm.store.dtype == torch.bfloat16
    runs: dict[str, list[Any]] = {}
    for order, names in tasks.items():
        result = simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
        samples = [s for name in names for s in sorted(result["samples"][name], key=lambda s: s["doc"]["q"])]
        runs[order] = [(s["doc"]["q"], s["resps"]) for s in samples]
        assert lm.store.stats.hit_tokens > 0, order
    assert len(runs["forwards"]) == 2 * len(docs)
    for (q, got), (_, want) in zip(runs["backwards"], runs["forwards"]):
        assert got == want, (q, got, want)
    prefixkv.disable(lm.model)
    lm.store.close()


# -- fidelity to stock, statistics, options --------------------------------------------------------------


def test_cold_and_warm_stay_within_1e_6_of_stock_in_float64(llama64: Any) -> None:
    store = PrefixStore(llama64, block_size=BS, invariant=True, chunk_size=CHUNK)
    rows = [random_tokens(33, seed=21), random_tokens(18, seed=22)]
    ids, mask = left_pad(rows)
    first = compare(llama64, store, ids, mask)
    assert first.cache.stats.cached_tokens == 0
    second = compare(llama64, store, ids, mask)
    assert second.cache.stats.cached_tokens > 0
    for c in (first, second):
        assert c.max_diff < 1e-6 and c.same_tokens
    store.close()


def test_only_canonical_chunks_are_published() -> None:
    """generate's own forward (the last, partial chunk) and its decode steps publish nothing: a later call
    reuses the whole chunks before the earlier prompt's last token, not the earlier answer."""
    model = model_of(torch.float32)
    ids = random_tokens(21, seed=23)[None]
    store = invariant_store(model)
    out, _ = run(model, store, ids, new=12)
    assert store.cached_length(out.sequences[0].tolist()) == 16
    store.close()


def test_the_options_are_checked() -> None:
    model = model_of(torch.float32)
    with pytest.raises(ValueError, match="pass invariant=True"):
        PrefixStore(model, chunk_size=32)
    with pytest.raises(ValueError, match="multiple of block_size=16"):
        PrefixStore(model, invariant=True, chunk_size=24)
    with pytest.raises(TypeError, match="True or False"):
        PrefixStore(model, invariant=1)
    with PrefixStore(model, invariant=True) as store, PrefixStore(model) as default:
        assert store.invariant and store.chunk_size == 64
        assert not default.invariant and default.chunk_size is None


def test_enable_takes_the_invariant_schedule() -> None:
    model = prefixkv.models.tiny_model("llama", dtype=torch.bfloat16)
    ids = random_tokens(40, seed=24)[None]
    kw: dict[str, Any] = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "pad_token_id": 0}
    ref = cold(model, ids, new=4)
    store = prefixkv.enable(model, invariant=True, chunk_size=CHUNK, block_size=BS)
    try:
        model.generate(ids[:, :30], **kw)
        out = model.generate(ids, return_dict_in_generate=True, **kw)
        assert store.stats.hit_tokens == 24
    finally:
        prefixkv.disable(model)
    assert_identical(out, ref)


REAL = pytest.mark.skipif(
    os.environ.get("PREFIXKV_REAL_TESTS") != "1", reason="set PREFIXKV_REAL_TESTS=1 (loads SmolLM2)"
)
SLOW = pytest.mark.skipif(
    os.environ.get("PREFIXKV_SLOW_TESTS") != "1",
    reason="set PREFIXKV_SLOW_TESTS=1 too (1 minute on 2 idle cores, 18 on busy ones)",
)


def smollm2_chat_is_identical_warm_and_cold(questions: int, new: int) -> None:
    """The chat experiment of docs/correctness.md (benchmarks/invariance.py's chat) on its first ``questions``
    questions, after one system prompt of about 200 tokens, ``new`` greedy tokens each, bfloat16. Cold: each
    question on a fresh store; warm: all on one store, in order, every question after the first reusing the
    system prompt's whole chunks."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import invariance

    model, tok = prefixkv.models.smollm2(dtype=torch.bfloat16)
    prompts = invariance.chat_prompts(tok)[:questions]
    shared = invariance.common_length(invariance.chat_prompts(tok))
    assert 180 <= shared <= 230
    warm_store = PrefixStore(model, invariant=True)
    chunks = shared // warm_store.chunk_size * warm_store.chunk_size
    for n, ids in enumerate(prompts):
        fresh = PrefixStore(model, invariant=True)
        ref, _ = run(model, fresh, ids, new=new)
        fresh.close()
        out, stats = run(model, warm_store, ids, new=new)
        assert stats.cached_tokens == (chunks if n else 0), (n, stats)
        assert_identical(out, ref)
    warm_store.close()


@REAL
def test_smollm2_chat_answers_are_identical_warm_and_cold_in_bfloat16() -> None:
    """CI-sized: three questions, eight new tokens."""
    smollm2_chat_is_identical_warm_and_cold(questions=3, new=8)


@pytest.mark.slow
@REAL
@SLOW
def test_smollm2_the_whole_chat_experiment_is_identical_warm_and_cold_in_bfloat16() -> None:
    """Issue 21's experiment: all 12 questions, 32 new tokens each."""
    smollm2_chat_is_identical_warm_and_cold(questions=12, new=32)


@pytest.mark.parametrize("shared", [4, 9, 12, 13, 20])
def test_a_match_that_ends_inside_a_chunk_reuses_only_whole_chunks(shared: int) -> None:
    """An earlier prompt that shares ``shared`` tokens with this one and then goes on: the store's match ends
    where they part, inside a chunk or on a block boundary of it, and only the whole chunks before it are reused."""
    model = model_of(torch.bfloat16)
    ids = random_tokens(30, seed=40)[None]
    ref = cold(model, ids)
    store = invariant_store(model)
    prime(model, store, [torch.cat([ids[0, :shared], random_tokens(30 - shared, seed=41)])])
    assert store.cached_length(ids[0].tolist()) >= shared // BS * BS  # the match reaches past the last whole chunk
    out, stats = run(model, store, ids)
    assert stats.cached_tokens == shared // CHUNK * CHUNK
    assert_identical(out, ref)
    store.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_grouped_kernel_gives_the_same_bits_on_a_view_of_the_pool_and_on_a_copy(dtype: torch.dtype) -> None:
    """A lone row whose blocks lie one after the other in the pool reads a view of them (``Reader._gather``),
    any other row a copy: the kernel's result for the same values is bit-identical either way, at every length
    and query length a call feeds (a decode step, a partial chunk, a whole chunk), on grouped heads."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    pool = torch.randn(kv_heads, 700, bs, dim, generator=g).to(dtype)  # [kv_heads, blocks, block_size, dim]
    for q, columns, first in ((1, 37, 3), (7, 300, 120), (32, 1056, 400), (64, 2048, 40), (1, 2048, 0)):
        count = -(-columns // bs)
        view = pool[:, first : first + count].reshape(kv_heads, count * bs, dim)[None, :, :columns]
        copy = pool.index_select(1, torch.arange(first, first + count)).reshape(kv_heads, -1, dim)[None, :, :columns]
        assert view.data_ptr() == pool[:, first].data_ptr() and copy.is_contiguous() is (count * bs == columns)
        query = torch.randn(1, heads, q, dim, generator=g).to(dtype)
        mask = torch.ones(q, columns, dtype=torch.bool).tril(columns - q)[None, None]
        a = prefixkv.attention.kernels.whole_rows_attention(query, view, view, mask, None)
        b = prefixkv.attention.kernels.whole_rows_attention(query, copy.contiguous(), copy.contiguous(), mask, None)
        assert torch.equal(a, b), (q, columns)


def test_a_lone_row_reads_a_view_cold_and_a_copy_warm_with_the_same_bits() -> None:
    """Cold, a lone row's blocks lie one after the other and every forward reads a view of the pool; warm, its
    prefix sits in blocks an earlier call left apart, so it reads copies: the logits are bit-identical."""
    model = model_of(torch.bfloat16)
    prompt = random_tokens(45, seed=21)[None]
    views: list[bool] = []
    original = prefixkv.attention.reader.Reader._gather

    def spy(self: Any, layer: int) -> Any:
        views.append(self._run is not None)
        return original(self, layer)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(prefixkv.attention.reader.Reader, "_gather", spy)
        ref = cold(model, prompt, new=6)
        assert views and all(views)  # cold: views only
        views.clear()
        store = invariant_store(model)
        # an earlier batch: the prefix's chunks interleaved with another row's in the pool
        prime(model, store, [prompt[0, :33], random_tokens(33, seed=22)])
        views.clear()
        out, stats = run(model, store, prompt, new=6)
        store.close()
    assert stats.cached_tokens == 32 and not any(views)
    assert_identical(out, ref)
