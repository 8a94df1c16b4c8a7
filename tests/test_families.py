"""Every decoder-only family of docs/architectures.md against stock ``generate`` with ``DynamicCache``.

Per family, on a tiny float64 model: a cold call, a warm call reusing at least 40 cached tokens, beam
search and a left-padded batch, each within 1e-6 in the logits; the attention path the docs state for it.
Then: sliding-window and chunked layers reused from inside a prefix longer than the window, bfloat16 and
float16 models with the pool in their dtype, and the families prefixkv refuses, each with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import cache_kw, compare, left_pad, max_logit_diff, random_tokens
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import prefixkv
from prefixkv.attention import blocks, interface
from prefixkv.compat import releases

FAMILIES = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "olmo",
    "olmo2",
    "smollm3",
    "starcoder2",
    "cohere",
    "granite",
    "gpt2",
    "gpt_neox",
    "gpt_bigcode",
    "gptj",
    "opt",
    "falcon",
    "falcon_old",
    "falcon_alibi",
    "bloom",
    "llama4_text",
]
TOL = 1e-6
STOCK = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
SHARED = 45  # tokens every prompt of a family test starts with; blocks of 4 -> 44 shared, 1 copied
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"


def _window(config: Any) -> int | None:
    """The sliding window or attention chunk of the model's limited layers, if it has any."""
    types = set(getattr(config, "layer_types", None) or [])
    if getattr(config, "attention_chunk_size", None) and "chunked_attention" in types:
        return int(config.attention_chunk_size)
    window = getattr(config, "sliding_window", None)
    if window and (not types or "sliding_attention" in types):
        return int(window)
    return None


def _prime(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor) -> None:
    """Put ``ids`` into the store (one prefill through a PagedPrefixCache)."""
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        model.generate(ids, **cache_kw(cache), max_new_tokens=1, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(family: str) -> Any:
    try:
        return prefixkv.models.tiny_model(family, dtype=torch.float64)
    except Exception as e:  # transformers 5.4 types OlmoConfig's tie_word_embeddings as int: stock cannot build it
        if "tie_word_embeddings" not in str(e) or "expected int, got bool" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} cannot build a {family} config: {e}")


@pytest.fixture
def store(model: Any) -> Any:
    s = prefixkv.PrefixStore(model, block_size=4)
    yield s
    s.check_invariants()
    s.close()


def test_cold_then_warm(model: Any, store: prefixkv.PrefixStore) -> None:
    system = random_tokens(SHARED, seed=1)
    first = torch.cat([system, random_tokens(6, seed=2)])[None]
    second = torch.cat([system, random_tokens(9, seed=3)])[None]

    cold = compare(model, store, first, max_new_tokens=4, do_sample=False)
    assert cold.max_diff <= TOL and cold.same_tokens
    assert cold.cache.stats.cached_tokens == 0 and cold.fed_tokens == first.shape[1]

    warm = compare(model, store, second, max_new_tokens=4, do_sample=False)
    assert warm.max_diff <= TOL and warm.same_tokens
    assert warm.cache.stats.cached_tokens == SHARED
    assert warm.fed_tokens == second.shape[1] - SHARED
    window = _window(model.config)
    assert window is None or window < SHARED  # windowed layers: the reused prefix is longer than the window


def test_beam_search(model: Any, store: prefixkv.PrefixStore) -> None:
    system = random_tokens(SHARED, seed=1)
    _prime(model, store, torch.cat([system, random_tokens(6, seed=2)])[None])
    ids = torch.cat([system, random_tokens(5, seed=4)])[None]
    result = compare(model, store, ids, max_new_tokens=4, num_beams=3, do_sample=False)
    assert result.max_diff <= TOL and result.same_tokens
    assert result.cache.stats.cached_tokens == SHARED


# Stock generate (transformers 5.24; not 5.14) gives NaN for a left-padded row of these families in float64:
# their eager attention takes the softmax in float32, where float64's mask minimum becomes -inf, so a pad query
# (all keys masked) gets NaN, which reaches the row's tokens through 0 * NaN in the next layer. prefixkv skips
# the cached pad columns and reads finite K/V for them; its rows are then compared with each row generated alone.
NAN_WHEN_PADDED_IN_FLOAT64 = {"gemma2", "bloom"}


def test_left_padded_batch(family: str, model: Any, store: prefixkv.PrefixStore) -> None:
    system = random_tokens(SHARED, seed=1)
    _prime(model, store, torch.cat([system, random_tokens(6, seed=2)])[None])
    rows = [torch.cat([system, random_tokens(4, seed=11)]), torch.cat([system, random_tokens(7, seed=12)])]
    ids, mask = left_pad(rows)
    result = compare(model, store, ids, mask, max_new_tokens=4, do_sample=False)
    # one offset per batch: the shorter row has 3 pads, so 45 columns are skipped, 42 of its tokens
    assert [r.cached_tokens for r in result.cache.stats.per_row] == [SHARED - 3, SHARED]
    assert result.fed_tokens == ids.shape[1] - SHARED
    if not result.ref.logits[0][0].isnan().any():
        assert result.max_diff <= TOL and result.same_tokens
        return
    assert family in NAN_WHEN_PADDED_IN_FLOAT64, f"stock generate gives NaN for a padded {family} batch"
    assert result.ref.logits[0][0].isnan().all()
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **STOCK)
        assert max_logit_diff([step[i : i + 1] for step in result.out.logits], alone.logits) <= TOL
        assert result.out.sequences[i, ids.shape[1] :].tolist() == alone.sequences[0, len(row) :].tolist()


def documented_paths() -> dict[str, str]:
    """family -> "prefixkv" or "update", from the table in docs/architectures.md."""
    paths = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        name = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
        path = re.search(r"`(prefixkv|update)`", cells[2])
        if name and path:
            paths[name.group(1)] = path.group(1)
    return paths


def test_attention_path_is_the_documented_one(family: str, model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    documented = documented_paths().get(family)
    assert documented is not None, f"{family} has no row in {DOCS}"
    calls = []

    def counting(module: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(module)
        return interface.prefixkv_attention_forward(module, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, interface.NAME, counting)
    reads = []
    blocks_attention = blocks.blocks_attention

    def reading(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[1])
        return blocks_attention(*args, **kwargs)

    monkeypatch.setattr(blocks, "blocks_attention", reading)
    before = model.config._attn_implementation
    store = prefixkv.PrefixStore(model, block_size=4)
    ids = random_tokens(10, seed=5)[None]
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        model.generate(ids, **cache_kw(cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    observed = "prefixkv" if model.config._attn_implementation == interface.NAME else "update"
    store.close()
    assert model.config._attn_implementation == before
    assert observed == documented, f"{family} takes the {observed} path, docs say {documented}"
    layers = prefixkv.base.memory.attention_shape(model.config).num_layers
    assert len(calls) == (2 * layers if observed == "prefixkv" else 0)
    # the first forward of a model checks that every layer reaches this attention; the decode step reads the blocks
    expected = range(layers, 2 * layers + 1) if observed == "prefixkv" else range(1)
    assert len(reads) in expected, f"{family}: {len(reads)} attention calls read the blocks"


# -- windows --------------------------------------------------------------------------------------

WINDOWED = ["mistral", "gemma2", "gemma3_text", "starcoder2", "llama4_text"]


def test_compare_catches_a_shim_that_drops_an_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """The instrument itself: prefixkv's attention dropping the ``scaling`` it forwards (Granite's
    ``attention_multiplier`` 0.5, not ``1 / sqrt(head_dim)``) must make :func:`compare` report a difference, which
    it can only because its reference runs on a copy of the model taken before the store. Without the bug it
    reports none; a reference taken on the model the store is attached to shares the bug and sees nothing."""
    ids = torch.cat([random_tokens(SHARED, seed=1), random_tokens(6, seed=2)])[None]
    model = prefixkv.models.tiny_model("granite", dtype=torch.float64)
    with prefixkv.PrefixStore(model, block_size=4) as store:
        assert compare(model, store, ids, max_new_tokens=4, do_sample=False).max_diff <= TOL
        shim = ALL_ATTENTION_FUNCTIONS[interface.NAME]

        def dropping_scaling(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("scaling", None)
            return shim(*args, **kwargs)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, interface.NAME, dropping_scaling)
        cold = random_tokens(20, seed=3)[None]  # nothing cached: the whole call runs the broken shim
        broken = compare(model, store, cold, max_new_tokens=4, do_sample=False)
        assert broken.max_diff > 100 * TOL, broken.max_diff  # measured 2.6e-3
        blind = model.generate(cold, **cache_kw(transformers.DynamicCache()), **STOCK)  # the old, attached reference
        assert max_logit_diff(blind.logits, broken.out.logits) <= TOL


@pytest.mark.parametrize("family", WINDOWED)
def test_window_layers_reuse_from_inside_a_long_prefix(family: str) -> None:
    """All blocks of windowed layers are kept: a later prompt may leave a cached prefix at any point,
    and its windowed layers then need the window of tokens before that point."""
    model = prefixkv.models.tiny_model(family, dtype=torch.float64)
    window = _window(model.config)
    assert window is not None and window < 30
    store = prefixkv.PrefixStore(model, block_size=4)
    long = random_tokens(70, seed=20)
    _prime(model, store, long[None])
    assert store.stats.blocks_used == 70 // 4  # every full block, also those outside the last window
    split = 2 * window - 3  # divergence well past one window, mid-block
    ids = torch.cat([long[:split], random_tokens(6, seed=21)])[None]
    result = compare(model, store, ids, max_new_tokens=4, do_sample=False)
    assert result.max_diff <= TOL and result.same_tokens
    assert result.cache.stats.cached_tokens == split
    store.close()


# -- lower precision ----------------------------------------------------------------------------------

# One family per path and kind of layer: prefixkv attention, eager with soft-capping, sliding and hybrid
# layers, a model outside AttentionInterface (Falcon), ALiBi (Bloom).
LOW_PRECISION = ["llama", "gemma2", "mistral", "gemma3_text", "falcon", "bloom"]


def low_precision_tolerance(dtype: torch.dtype, logits: Any) -> float:
    """Two units in the last place of ``dtype`` at the logits' magnitude (at least 1); 1e-4 in float32."""
    if dtype == torch.float32:
        return 1e-4
    scale = max(1.0, max(step.abs().max().item() for step in logits))
    return 2 * torch.finfo(dtype).eps * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("family", LOW_PRECISION)
def test_lower_precision_models(family: str, dtype: torch.dtype) -> None:
    model = prefixkv.models.tiny_model(family, dtype=dtype)
    with prefixkv.PrefixStore(model, block_size=4) as store:
        _check_lower_precision(model, store, dtype)


def _check_lower_precision(model: Any, store: prefixkv.PrefixStore, dtype: torch.dtype) -> None:
    assert store.dtype == dtype and all(k.dtype == dtype for k in store.pool.keys)
    system = random_tokens(SHARED, seed=1)
    compare(model, store, torch.cat([system, random_tokens(6, seed=2)])[None], max_new_tokens=4, do_sample=False)
    ids, mask = left_pad([torch.cat([system, random_tokens(n, seed=11 + n)]) for n in (4, 7)])
    warm = compare(model, store, ids, mask, max_new_tokens=4, do_sample=False)
    assert warm.cache.stats.cached_tokens == 2 * SHARED - 3
    tolerance = low_precision_tolerance(dtype, warm.ref.logits)
    steps = diverged_at(warm)
    # the attention that reads the blocks merges parts (log-sum-exp), rounding in another order than sdpa: the
    # logits agree within the tolerance, and a token may differ only where stock's top two are that close
    assert max_logit_diff(warm.ref.logits[:steps], warm.out.logits[:steps]) <= tolerance
    if steps < len(warm.ref.logits):
        step = warm.ref.logits[steps - 1].double()
        row = int(
            (warm.ref.sequences[:, -len(warm.ref.logits) :] != warm.out.sequences[:, -len(warm.ref.logits) :])
            .any(dim=1)
            .nonzero()[0]
        )
        chosen = warm.out.sequences[row, -len(warm.ref.logits) + steps - 1]
        assert step[row].max() - step[row, chosen] <= 2 * tolerance, "a token differs where stock had no near-tie"


def diverged_at(result: Any) -> int:
    """How many generated steps to compare: all of them, or up to the first where a token differs."""
    n = len(result.ref.logits)
    ref, out = result.ref.sequences[:, -n:], result.out.sequences[:, -n:]
    differ = (ref != out).any(dim=0).nonzero()
    return n if len(differ) == 0 else int(differ[0]) + 1


# -- refusals -----------------------------------------------------------------------------------------

_STATE = "state-space, linear-attention or recurrent layers"
# family -> (config overrides, model class, what the refusal must say)
REFUSED: dict[str, tuple[dict[str, Any], Any, str]] = {
    "rwkv": ({}, transformers.AutoModelForCausalLM, "carries its recurrent state .* in a `state` argument of its own"),
    "xlstm": ({}, transformers.AutoModelForCausalLM, _STATE),
    # served from transformers 5 (tests/test_recurrent.py, the census); transformers 4.57 keeps its state in a cache
    # of its own
    **(
        {}
        if releases.LINEAR_ATTENTION_LAYER is not None
        else {"kimi_linear": ({}, transformers.AutoModelForCausalLM, _STATE)}
    ),
    "t5": ({}, transformers.AutoModelForSeq2SeqLM, "is an encoder-decoder model"),
    "bart": ({}, transformers.AutoModelForSeq2SeqLM, "is an encoder-decoder model"),
}
_SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_families_are_refused_with_the_reason(family: str) -> None:
    overrides, auto, reason = REFUSED[family]
    config = transformers.AutoConfig.for_model(family, **{**_SMALL, **overrides})
    with torch.device("meta"):  # the refusal reads the config and the model class, never the weights
        model = auto.from_config(config)
    with pytest.raises(prefixkv.UnsupportedModelError, match=rf"^{family} .*{reason}.*generate without prefixkv"):
        prefixkv.PrefixStore(model)
    # refused before anything was changed: no hooks, the attention implementation untouched
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert model.config._attn_implementation != interface.NAME


def test_every_family_is_documented() -> None:
    documented = documented_paths()
    assert set(FAMILIES) <= set(documented), f"missing from {DOCS}: {set(FAMILIES) - set(documented)}"
    text = DOCS.read_text()
    missing = [f for f in REFUSED if f"`{f}`" not in text]
    assert not missing, f"refused families missing from {DOCS}: {missing}"
