"""Shared test helpers: tiny models, a stock-vs-prefixkv generate comparison, a token counter; and which tests run.

Which tests run: ``python -m pytest`` runs the suite a contributor runs before a commit (every fidelity and never-wrong
test, the census's quick form, the benchmark smoke tests that check a claim of the docs); ``PREFIXKV_FULL=1`` runs
everything, as ``.ci/run`` does: the tests marked ``slow`` and those of :data:`FULL_ONLY` (the whole census, the
notebooks, the other benchmark smoke tests, the longest profiles), and it turns on the real-checkpoint tests
(``PREFIXKV_REAL_TESTS=1``, SmolLM2 from ``PREFIXKV_REAL=1 bash scripts/setup.sh``) and the slow experiments
(``PREFIXKV_SLOW_TESTS=1``), unless those are set otherwise (``PREFIXKV_REAL_TESTS=0`` where SmolLM2 is not
installed, as in CI's oldest-release job). tests/README.md has the measured times.

Every fidelity reference runs on a model prefixkv has never touched (its attention, hooks and wrapped methods
would otherwise run in the reference too, and a bug there would cancel out): the first time a store is built on
a model, :func:`stock_twin` keeps a deep copy of it taken before the store exists, and :func:`compare` runs stock
``generate`` on that copy, with the model's current weights and adapter state copied over.

Tests pass a cache by the keyword the installed transformers prefers (:func:`cache_kw`, ``cache=`` from 5.24,
``past_key_values=`` before); the few that pass it by another accepted keyword on purpose run it under
:func:`spelled`, which expects transformers' deprecation warning."""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import DynamicCache, GenerationMixin

import prefixkv
from prefixkv.compat.releases import GENERATE_CACHE_KWARG
from prefixkv.kv.pool import BlockPool, LayerSpec

FULL = os.environ.get("PREFIXKV_FULL") == "1"
"""Whether this run is the full suite (``PREFIXKV_FULL=1``), which ``.ci/run`` runs; else the quick one."""
if FULL:  # the one switch turns these on too, where they are not set otherwise (tests read them at import)
    os.environ.setdefault("PREFIXKV_REAL_TESTS", "1")
    os.environ.setdefault("PREFIXKV_SLOW_TESTS", "1")

_COMPILE = "torch.compile's compile time dominates it (the compiled step's own fidelity runs in the quick suite)"
_FLEX = "FlexAttention, opt-in on the CPU, compiles its kernels (its eager reads run in the quick suite)"
_BENCH = "a benchmark's smoke run (the ones that check a claim of the docs run in the quick suite)"
FULL_ONLY: dict[str, str] = {
    # a test id, or the start of one (a file, a test without its parameters) -> why only the full suite runs it;
    # tests/README.md has the seconds each took, at what load
    "tests/test_census.py::test_no_family_is_served_wrong_crashes_or_misses_silently": "the whole census (6+ minutes;"
    " test_the_quick_census_serves_one_family_of_each_kind_as_the_table_says runs one family of each kind)",
    "tests/test_census.py::test_architectures_md_shows_this_census": "the whole census's table",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom": "a Jupyter kernel per notebook (1-5 minutes each)",
    "tests/test_docs.py::test_code_blocks_run[evaluation.md]": "lm-evaluation-harness's own runs",
    "tests/test_lm_eval.py::test_the_launcher_runs_lm_eval_with_hf_prefixkv": "lm-eval's launcher, in a process",
    **dict.fromkeys(
        [
            "tests/test_compiled.py::test_every_family_compiled_by_generate_gives_stock_or_says_why",
            "tests/test_compiled.py::test_a_forward_compiled_by_its_user_takes_compiled_steps_with_a_default_cache",
            "tests/test_compiled.py::test_a_warm_step_is_one_graph_and_the_buckets_stay_warm",
            "tests/test_compiled.py::test_an_exception_in_a_compiled_step_leaves_the_store_open_to_every_thread",
            "tests/test_compiled.py::test_a_step_with_gradients_on_keeps_the_pool_out_of_autograd",
            "tests/test_compiled.py::test_generates_fullgraph_compile_runs_only_the_steps_compiled",
            "tests/test_compiled.py::test_a_store_leaves_stock_compiled_calls_alone",
            "tests/test_compiled.py::test_a_compiled_model_call_compiles_only_the_steps",
            "tests/test_edges.py::test_a_compiled_model_with_a_store_compiles_once_and_stays_exact",
        ],
        _COMPILE,
    ),
    **dict.fromkeys(
        [
            "tests/test_flex_generate.py",
            "tests/test_flex.py::test_compiled_decode_matches_sdpa_and_the_blocks_reader",
            "tests/test_flex.py::test_compiled_decode_where_a_sliding_windows_edge_falls_on_a_block_start",
            "tests/test_flex.py::test_a_shape_past_dynamos_recompile_limit_still_compiles",
            "tests/test_backend_choice.py::test_the_backend_the_store_names_is_the_one_that_runs[flex]",
        ],
        _FLEX,
    ),
    **dict.fromkeys(
        [
            f"tests/test_benchmarks_smoke.py::test_{name}"
            for name in (
                "ttft_smoke",
                "hybrid_smoke",
                "compiled_smoke",
                "decode_smoke",
                "throughput_smoke_gives_the_same_tokens_everywhere",
                "trie_ops_smoke",
                "store_ops_smoke_times_every_operation",
                "quant_smoke_counts_the_scales_in_the_memory",
                "tiers_smoke_brings_the_prefix_back",
                "lm_eval_smoke_gives_the_answers_of_hf",
                "gpu_check_cpu_smoke_runs_every_measurement",
                "invariance_smoke",
                "invariance_chunk_sweep_smoke",
                "invariance_padded_smoke",
                "invariance_rows_smoke",
            )
        ],
        _BENCH,
    ),
}


def full_only(nodeid: str) -> str | None:
    """Why the test ``nodeid`` runs only with ``PREFIXKV_FULL=1`` (:data:`FULL_ONLY`), or ``None``."""
    for start, why in FULL_ONLY.items():
        if nodeid == start or nodeid.startswith((start + "::", start + "[")):
            return why
    return None


def worker_threads(environ: Mapping[str, str], cores: int) -> int | None:
    """The intra-op threads each pytest-xdist worker takes: the machine's ``cores`` shared among the workers
    (``PYTEST_XDIST_WORKER_COUNT``), at least 1; ``None`` outside xdist, or where ``OMP_NUM_THREADS`` says already.
    Without it every worker takes every core, and ``-n 2`` on 2 cores runs four threads at once, slower than one
    process."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, cores // int(workers))


def available_cores() -> int:
    """The cores this process may run on (its affinity where the platform says it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_configure(config: pytest.Config) -> None:
    threads = worker_threads(os.environ, available_cores())
    if threads is not None:
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``PREFIXKV_FULL=1``, leave out the tests marked ``slow`` and those of :data:`FULL_ONLY`."""
    if FULL:
        return
    left = [item for item in items if item.get_closest_marker("slow") or full_only(item.nodeid)]
    if left:
        kept = set(map(id, left))
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if id(item) not in kept]
    config.stash[_LEFT_OUT] = len(left)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker (``-n``), which collects and leaves tests out in place of the process that prints the
    summary: hand that process the count."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["prefixkv_left_out"] = session.config.stash.get(_LEFT_OUT, 0)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node: Any, error: object) -> None:
    """The count a worker left out (each collects the whole run, so each leaves out the same tests)."""
    left = getattr(node, "workeroutput", {}).get("prefixkv_left_out", 0)
    node.config.stash[_LEFT_OUT] = max(left, node.config.stash.get(_LEFT_OUT, 0))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    left = config.stash.get(_LEFT_OUT, 0)
    if left:
        terminalreporter.write_line(
            f"prefixkv: the quick suite; {left} slower tests left out (the whole census, the notebooks, the benchmark "
            "smoke runs, the longest profiles): PREFIXKV_FULL=1 runs them too, as .ci/run does"
        )


SPELLINGS = ("cache", "past_key_values") if GENERATE_CACHE_KWARG == "cache" else ("past_key_values",)
"""Every keyword by which the installed transformers' ``generate`` and models take a cache, the preferred one
first."""


def cache_kw(cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword argument the installed transformers prefers: ``model.generate(ids, **cache_kw(c))``."""
    return {GENERATE_CACHE_KWARG: cache}


def returned_cache(out: Any) -> Any:
    """The cache a ``generate`` output hands back, by the name the installed transformers gives it (``out.cache``
    from 5.24, ``out.past_key_values`` before)."""
    return getattr(out, GENERATE_CACHE_KWARG)


STOCK_TAKES_NEW_TOKENS = (
    "next_sequence_length" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
)
"""Whether the installed transformers' ``generate`` continues a cache from only the new tokens (with an attention mask
of the whole sequence), read from transformers itself: from 5.3 ``generate`` tells ``prepare_inputs_for_generation``
the ``next_sequence_length`` to feed; 4.57-5.2 slice the inputs by a ``cache_position`` counted from the cache's length,
which is empty there, and stock ``generate`` with a ``DynamicCache`` fails with an IndexError."""


@contextlib.contextmanager
def spelled(spelling: str) -> Iterator[None]:
    """Around a call that passes the cache as ``spelling``: expects the FutureWarning by which transformers
    deprecates a keyword it no longer prefers (``past_key_values`` from 5.24), and nothing for the preferred one."""
    if spelling == GENERATE_CACHE_KWARG:
        yield
        return
    with pytest.warns(FutureWarning, match=f"`{spelling}` is deprecated"):
        yield


@dataclass
class Comparison:
    """Stock and prefixkv outputs of one generate call, and the largest logit difference."""

    ref: Any
    out: Any
    max_diff: float
    same_tokens: bool
    cache: prefixkv.PagedPrefixCache
    fed_tokens: int


class FeedCounter:
    """Counts the token columns fed to a model's forward (the prefill work actually done)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[int] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs["inputs_embeds"]
        self.calls.append(int(x.shape[1]))

    def reset(self) -> None:
        self.calls.clear()

    def remove(self) -> None:
        self._handle.remove()


_TWINS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()
_BUILT: weakref.WeakSet[prefixkv.PrefixStore] = weakref.WeakSet()  # every store built, for _stores_closed
_store_init = prefixkv.PrefixStore.__init__


def _init_keeping_a_twin(self: prefixkv.PrefixStore, model: Any, **kwargs: Any) -> None:
    if isinstance(model, torch.nn.Module) and model not in _TWINS:
        twin = copy.deepcopy(model)
        for m in twin.modules():  # a test's own hooks (feed counters, invariant checks) stay with the original
            m._forward_pre_hooks.clear()
            m._forward_hooks.clear()
        _TWINS[model] = twin
    _store_init(self, model, **kwargs)
    _BUILT.add(self)


prefixkv.PrefixStore.__init__ = _init_keeping_a_twin  # type: ignore[method-assign]


def stock_twin(model: Any) -> Any:
    """The copy of ``model`` taken before the first store on it was built, brought to ``model``'s current
    weights, buffers and adapter state (PEFT's active and disabled adapters); a model that never had a store
    is its own twin. Raises if the copy carries anything of prefixkv (then it would be no reference)."""
    twin = _TWINS.get(model)
    if twin is None:
        twin = model
    else:
        twin.load_state_dict(model.state_dict())
        with torch.no_grad():
            for name, buffer in model.named_buffers():  # non-persistent ones too (rotary inv_freq)
                twin.get_buffer(name).copy_(buffer)
        mine = dict(model.named_modules())
        for name, module in twin.named_modules():
            if hasattr(module, "_disable_adapters"):  # a PEFT tuner layer
                module._active_adapter = mine[name]._active_adapter
                module._disable_adapters = mine[name]._disable_adapters
    untouched(twin)
    return twin


def untouched(model: Any) -> None:
    """Raise ``AssertionError`` if ``model`` runs prefixkv's attention or carries a hook or wrapper of it."""
    inner = getattr(model, "base_model", model)
    inner = getattr(inner, "model", inner) if hasattr(model, "peft_config") else inner
    for m in (model, inner):
        assert getattr(m.config, "_attn_implementation", None) != prefixkv.attention.interface.NAME, (
            "prefixkv attention"
        )
        assert not m._forward_pre_hooks and not m._forward_hooks, "a forward hook on the reference model"
        assert not any(k.startswith("_prefixkv") for k in vars(m)), "a prefixkv attribute on the reference model"
        assert "prepare_inputs_for_generation" not in vars(m) and "generate" not in vars(m), "a wrapped method"


def quantized(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """``[B, heads, q, head_dim]`` K or V as an 8-bit pool reads them back: each token quantized by the pool's
    own quantizer (from its values alone) and dequantized into ``x``'s dtype."""
    pool = BlockPool([LayerSpec(x.shape[1], x.shape[3], x.device, x.dtype)], 1, 1, kv_dtype)
    codes, scale = pool._quantize(x.transpose(1, 2).to(torch.float32))
    return pool._dequantize(codes, scale, x.dtype).transpose(1, 2)


class QuantizingCache(DynamicCache):
    """A ``DynamicCache`` that keeps K/V as an ``int8``/``fp8`` store does (:func:`quantized`): the reference an
    8-bit store must match exactly, as an unquantized one matches ``DynamicCache``."""

    def __init__(self, config: Any, kv_dtype: str) -> None:
        super().__init__(config=config)
        self.kv_dtype = kv_dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        key, value = (quantized(t, self.kv_dtype) for t in (key_states, value_states))
        return super().update(key, value, layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """DeepSeek sparse attention's indexer keys ``[B, q, size]``, quantized as an 8-bit store keeps every
        per-token tensor of a layer (docs/architectures.md, "Latent attention and mixed shapes")."""
        keys = quantized(indexer_key_states[:, None], self.kv_dtype)[:, 0]
        return super().update_indexer(keys, layer_idx)


def reference_cache(model: Any, kv_dtype: str | None) -> DynamicCache:
    """The stock cache a store keeping K/V as ``kv_dtype`` must match: ``DynamicCache``, or for 8-bit K/V a
    :class:`QuantizingCache`."""
    return DynamicCache(config=model.config) if kv_dtype is None else QuantizingCache(model.config, kv_dtype)


def max_logit_diff(a: Any, b: Any) -> float:
    assert len(a) == len(b), f"{len(a)} steps vs {len(b)}"
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def compare(
    model: Any,
    store: prefixkv.PrefixStore,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    seed: int = 0,
    spelling: str = GENERATE_CACHE_KWARG,
    max_new_tokens: int = 8,
    namespace: str | None = None,
    **kwargs: Any,
) -> Comparison:
    """Run generate with a fresh :func:`reference_cache` (``DynamicCache``; for an 8-bit store, one that quantizes
    as it does) on :func:`stock_twin` ``(model)`` and with a PagedPrefixCache from ``store`` on ``model``, both
    passing the cache as ``spelling`` (under :func:`spelled`); the cache is user ``namespace``'s."""

    def run(cache: Any, on: Any = model) -> Any:
        torch.manual_seed(seed)
        with spelled(spelling):
            return on.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                **{spelling: cache},
                **kwargs,
            )

    twin = stock_twin(model)
    ref = run(reference_cache(twin, store.kv_dtype), twin)
    counter = FeedCounter(model)
    cache = prefixkv.PagedPrefixCache(store, ids, mask, namespace=namespace)
    try:
        out = run(cache)
    finally:
        counter.remove()
        cache.close()
    store.check_invariants()
    same = out.sequences.shape == ref.sequences.shape and bool((out.sequences == ref.sequences).all())
    return Comparison(
        ref,
        out,
        max_logit_diff(out.logits, ref.logits),
        same,
        cache,
        counter.calls[0] if counter.calls else 0,
    )


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask for rows of different lengths."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def assert_no_leak(store: prefixkv.PrefixStore, pinned: int = 0) -> None:
    """With every cache closed or collected, each used block is pinned or evictable, and ``clear()``
    frees all but the ``pinned`` ones."""
    store.check_invariants()
    s = store.stats
    assert s.blocks_used == s.blocks_evictable + s.blocks_pinned, s
    assert s.blocks_pinned == pinned, s
    assert store.clear() == s.blocks_evictable
    assert store.stats.blocks_used == pinned


def random_tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


@pytest.fixture(autouse=True)
def _stores_closed() -> Iterator[None]:
    """After each test, failed or not, close the stores it built and left open (and undo the ``enable`` of
    one): the model fixtures are module-wide, and a store left attached would run in the tests after it."""
    before = set(_BUILT)
    yield
    for store in [s for s in _BUILT if s not in before and not s.closed]:
        enabled = vars(store.model).get(prefixkv.enabling._ENABLED)
        if enabled is not None and enabled.store is store:
            prefixkv.disable(store.model)
        store.close()


@pytest.fixture(scope="module")
def fast_gc() -> Iterator[None]:
    """Freeze what the imports allocated, so that the ``gc.collect()`` calls of a module's tests (which
    check what happens to a cache nobody closed) take microseconds instead of half a second."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def llama64() -> Any:
    return prefixkv.models.tiny_model("llama", dtype=torch.float64)
