"""The differential test (issue 52): one stateful hypothesis test, run per family, over the kinds of family a store
serves and what users do with it, against rules the test states itself, never the code under test.

Families, one or two of each kind the census serves, tiny and in float64: dense (llama), sliding-window (mistral, a
window of 7), latent (deepseek_v2, MLA), KV-shared (gemma3n_text), hybrid (lfm2, qwen3_next: recurrent layers) and
vision-language (llava, qwen2_vl, gemma3). Steps: calls whose rows are built from a shared pool of segments (so prompts
part anywhere: inside a block, on its edge, where an earlier prompt ended and a recurrent model took a snapshot), cut
at any length, one to three rows left-padded or of one length, greedy, seeded sampling or beams, in one of three
namespaces; a chat's next turn on an earlier row's output; images that differ in one pixel anywhere or only in a side
tensor (Qwen2-VL's grid; the token types present or absent) or in how the call encodes them (LLaVA's
``vision_feature_layer``); ``warm``; a weight edited in place; ``store.clear()``; eviction pressure
(``num_blocks``, ``max_memory``); save and load; the CPU tier.

The rules, after every step:

- every call's logits equal stock ``generate``'s on an untouched copy (conftest :func:`stock_twin`), every step, within
  1e-6 in float64, and its tokens are the same;
- nothing published in one namespace or weight version is reused from another: the test keeps, per (namespace,
  weight version), the prompts it ran there (a token's key is the token, an image placeholder's is everything the
  stock model reads of its image) and the tokens each may have generated after it; a row's ``cached_tokens`` never
  passes the longest prefix of it so run (and its length less one);
- the store's bytes never pass its bound (``max_memory``: blocks and snapshots; ``num_blocks``: blocks), nor the CPU
  tier's its own;
- the stats add up: per row, cached + computed = the row's prompt tokens; the batch's totals are the rows' sums; the
  store's ``hit_tokens`` grow by each call's cached tokens; ``store.check_invariants()``.

A short profile runs by default (12 examples of up to 10 steps per family: about two minutes on one core);
``PREFIXKV_DIFF_PROFILE=long`` runs 15 times the examples. A failing example found becomes a named test below the
machine.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import cache_kw, max_logit_diff, random_tokens, stock_twin
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import prefixkv
from prefixkv.base.errors import CapacityError
from prefixkv.compat import releases
from prefixkv.tools import census

TOL = 1e-6
PROFILE = os.environ.get("PREFIXKV_DIFF_PROFILE", "short")
EXAMPLES = {"short": 12, "long": 180}[PROFILE]
STEPS = 10

# family -> its kind; the vision-language ones need transformers 5 (4.x feeds no images to a warm forward)
FAMILIES = {
    "llama": "dense",
    "mistral": "sliding",
    "deepseek_v2": "latent",
    "gemma3n_text": "kv-shared",
    "lfm2": "hybrid",
    "qwen3_next": "hybrid",
    **({"llava": "images", "qwen2_vl": "images", "gemma3": "images"} if releases.WARM_FORWARDS_TAKE_IMAGES else {}),
}
if releases.LINEAR_ATTENTION_LAYER is None:  # transformers 4.x refuses recurrent layers (tests/test_recurrent.py)
    FAMILIES = {f: k for f, k in FAMILIES.items() if k != "hybrid"}
NAMESPACES = (None, "alice", "bob")
IMAGE = 250  # the tiny vision families' placeholder (prefixkv.models); text tokens stay below 240
# the pool the prompts are built from: segments of lengths around the block sizes (2, 3, 4), so that two prompts part
# inside a block, on its edge, or where an earlier one ended
SEGMENTS = [random_tokens(n, seed=100 + i, vocab=240).tolist() for i, n in enumerate((3, 4, 5, 6, 7, 9, 2, 8))]
MAX_PROMPT = 48

_MODELS: dict[str, Any] = {}
_WEIGHTS: dict[str, dict[str, torch.Tensor]] = {}


def model_of(family: str) -> Any:
    """The tiny float64 model of ``family``, built once; each example starts from its first weights
    (:func:`pristine`)."""
    if family not in _MODELS:
        if family == "mistral":
            _MODELS[family] = prefixkv.models.tiny_model(family, dtype=torch.float64, sliding_window=7)
        elif family in prefixkv.models.families():
            _MODELS[family] = prefixkv.models.tiny_model(family, dtype=torch.float64)
        else:
            config = census.tiny_config(family)
            config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
            _MODELS[family] = prefixkv.models.build(config, dtype=torch.float64)
        _WEIGHTS[family] = {k: v.clone() for k, v in _MODELS[family].state_dict().items()}
    return _MODELS[family]


def pristine(family: str) -> Any:
    """:func:`model_of` with its first weights back (a step edits them in place)."""
    model = model_of(family)
    with torch.no_grad():
        model.load_state_dict(_WEIGHTS[family])
    return model


# -- images ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    """One image of a prompt: a random one of ``seed``, with element ``pixel`` of its pixel values moved (-1: none),
    in Qwen2-VL's other grid of the same patches (``grid``)."""

    seed: int
    pixel: int = -1
    grid: bool = False


def image_tokens(family: str) -> list[int]:
    """The tokens one image takes in a prompt of the tiny ``family``: placeholders and their frame."""
    if family == "llava":
        return [IMAGE] * 16
    if family == "qwen2_vl":
        return [252, *[IMAGE] * 4, 253]
    return [251, *[IMAGE] * 4, 252]  # gemma3


def image_inputs(family: str, image: Image) -> dict[str, torch.Tensor]:
    """The processed inputs of ``image`` for ``family``."""
    g = torch.Generator().manual_seed(image.seed)
    if family == "qwen2_vl":  # 16 patches of 24 (3 KiB), in a grid of 4 x 4 or 2 x 8: 4 placeholders either way
        pixels = torch.randn(16, 24, generator=g, dtype=torch.float64)
        grid = torch.tensor([[1, 2, 8]] if image.grid else [[1, 4, 4]])
        out = {"pixel_values": pixels, "image_grid_thw": grid}
    else:  # 3 x 16 x 16 (6 KiB): the third channel lies past the first 4 KiB
        out = {"pixel_values": torch.randn(1, 3, 16, 16, generator=g, dtype=torch.float64)}
    if image.pixel >= 0:
        flat = out["pixel_values"].view(-1)
        flat[image.pixel % flat.numel()] += 0.25
    return out


def pixels_of(family: str) -> int:
    return 16 * 24 if family == "qwen2_vl" else 3 * 16 * 16


# -- prompts ---------------------------------------------------------------------------------------------------------

Piece = int | tuple[int, ...] | Image  # a segment of the pool, literal tokens (a chat's answer), an image


@dataclass(frozen=True)
class Row:
    pieces: tuple[Piece, ...]
    cut: int | None = None  # text only: the first ``cut`` tokens


def tokens_of(family: str, row: Row) -> list[int]:
    out: list[int] = []
    for p in row.pieces:
        out += SEGMENTS[p] if isinstance(p, int) else image_tokens(family) if isinstance(p, Image) else list(p)
    return out if row.cut is None else out[: row.cut]


def images_of(row: Row) -> list[Image]:
    return [p for p in row.pieces if isinstance(p, Image)]


def keys_of(family: str, row: Row, encoding: tuple[Any, ...]) -> tuple[Any, ...]:
    """The row as the oracle keys it: a token is itself, an image placeholder is everything the stock model reads of
    its image (its pixel bytes, grid, how the call encodes it: ``encoding``) and its index."""
    out: list[Any] = []
    for p in row.pieces:
        if isinstance(p, Image):
            for i, t in enumerate(image_tokens(family)):
                out.append(("image", p, encoding, i) if t == IMAGE else t)
        else:
            out += SEGMENTS[p] if isinstance(p, int) else list(p)
    return tuple(out if row.cut is None else out[: row.cut])


def common(a: tuple[Any, ...], b: tuple[Any, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Ran:
    """What ran in one (namespace, weight version): each prompt, and how many tokens it may have generated after."""

    prompts: list[tuple[tuple[Any, ...], int]]

    def bound(self, keys: tuple[Any, ...]) -> int:
        """The longest prefix of ``keys`` that ran: a prompt's shared part, or a whole prompt and as many of the
        tokens after it as it may have generated (any tokens: beams that were dropped, samples)."""
        best = 0
        for prompt, generated in self.prompts:
            n = common(keys, prompt)
            best = max(best, min(len(keys), n + generated) if n == len(prompt) else n)
        return best


def inputs_for(family: str, rows: list[Row], types: bool) -> dict[str, Any]:
    """A processor's outputs for ``rows``: ids left-padded with 0, the mask, the images of every row in order, and the
    token types where the family takes them (``types``)."""
    ids = [tokens_of(family, r) for r in rows]
    width = max(len(t) for t in ids)
    out: dict[str, Any] = {
        "input_ids": torch.tensor([[0] * (width - len(t)) + t for t in ids]),
        "attention_mask": torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in ids]),
    }
    images = [image_inputs(family, i) for r in rows for i in images_of(r)]
    for name in images[0] if images else ():
        out[name] = torch.cat([one[name] for one in images])
    if images and types and family in ("qwen2_vl", "gemma3"):
        name = "mm_token_type_ids" if family == "qwen2_vl" else "token_type_ids"
        out[name] = (out["input_ids"] == IMAGE).long()
    return out


def answer_of(sequence: list[int]) -> tuple[int, ...]:
    """The generated tokens a next turn can repeat: up to the first pad, special or image token."""
    out = []
    for t in sequence:
        if t < 3 or t >= 240:
            break
        out.append(t)
    return tuple(out)


def check_row(row: Any, prompt: int, allowed: int, namespace: str | None, version: int) -> None:
    """The stats of one row add up, and it reused no more than its namespace and weight version ran of it."""
    assert row.prompt_tokens == prompt, row
    assert row.cached_tokens + row.computed_tokens == row.prompt_tokens, row
    assert row.cached_tokens <= allowed, (
        f"{row.cached_tokens} tokens reused where namespace {namespace!r}, weight version {version} ran only "
        f"{allowed} of this prompt"
    )


def generate_both(
    model: Any,
    store: prefixkv.PrefixStore,
    inputs: dict[str, Any],
    gen: dict[str, Any],
    *,
    seed: int = 0,
    namespace: str | None = None,
) -> tuple[Any, Any]:
    """``generate`` on the stock twin and with a cache of ``store`` in ``namespace``, each after
    ``torch.manual_seed(seed)``; asserts the same tokens and every step's logits within :data:`TOL`. Returns
    prefixkv's output and its cache's stats."""
    gen = {"pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True, **gen}
    twin = stock_twin(model)
    torch.manual_seed(seed)
    ref = twin.generate(**inputs, **gen)
    with prefixkv.PagedPrefixCache(store, **inputs, namespace=namespace) as cache:
        torch.manual_seed(seed)
        out = model.generate(**inputs, **cache_kw(cache), **gen)
    store.check_invariants()
    assert out.sequences.tolist() == ref.sequences.tolist(), "other tokens than stock generate"
    diff = max_logit_diff(out.logits, ref.logits)
    assert diff <= TOL, f"logits {diff:.3g} off stock generate"
    return out, cache.stats


# -- the machine -----------------------------------------------------------------------------------------------------

BUDGETS = ("none", "num_blocks", "max_memory", "cpu_tier")


def row_strategy(family: str) -> st.SearchStrategy[Row]:
    segment = st.integers(0, len(SEGMENTS) - 1)
    if FAMILIES[family] == "images":
        image = st.builds(
            Image,
            st.integers(0, 1),
            st.one_of(st.just(-1), st.integers(0, pixels_of(family) - 1)),
            st.booleans() if family == "qwen2_vl" else st.just(False),
        )
        pieces = st.lists(st.one_of(segment, segment, image), min_size=1, max_size=4)
        return st.builds(Row, pieces.map(tuple))
    pieces = st.lists(segment, min_size=1, max_size=5).map(tuple)
    return st.builds(Row, pieces, st.one_of(st.none(), st.integers(2, 30)))


class Differential(RuleBasedStateMachine):
    """One family, one store; the steps of users against the rules of the module docstring."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family, self.model = family, pristine(family)
        self.recurrent = FAMILIES[family] == "hybrid"
        self.store: prefixkv.PrefixStore | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="prefixkv-differential-")
        self.version = 0
        self.ran: dict[tuple[str | None, int], Ran] = {}
        self.histories: list[tuple[Row, str | None]] = []  # earlier rows, each with its namespace

    @initialize(block_size=st.sampled_from([2, 3, 4]), budget=st.sampled_from(BUDGETS), blocks=st.integers(12, 48))
    def build(self, block_size: int, budget: str, blocks: int) -> None:
        probe = prefixkv.PrefixStore(self.model, block_size=block_size)
        per_block = probe.bytes_per_block
        probe.close()
        self.options: dict[str, Any] = {"block_size": block_size}
        self.max_bytes: int | None = None
        self.tier_bytes: int | None = None
        if budget == "num_blocks":
            self.options["num_blocks"] = blocks
            self.max_bytes = blocks * per_block
        elif budget == "max_memory":  # a recurrent model's snapshots take a quarter of it
            self.max_bytes = blocks * per_block * 4 // 3 if self.recurrent else blocks * per_block
            self.options["max_memory"] = self.max_bytes
        elif budget == "cpu_tier":
            self.tier_bytes = blocks // 2 * per_block
            self.options |= {"num_blocks": blocks, "offload": "cpu", "max_offload_memory": self.tier_bytes}
            self.max_bytes = blocks * per_block
        self.store = prefixkv.PrefixStore(self.model, **self.options)
        event(f"budget {budget}")

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        self.tmp.cleanup()

    # -- steps

    @rule(data=st.data())
    def call(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(row_strategy(self.family), min_size=1, max_size=3), label="rows")
        rows = self.within_bounds(rows, same_length=data.draw(st.booleans(), label="same length"))
        if rows:
            self.run(data, rows)

    @precondition(lambda self: bool(self.histories))
    @rule(data=st.data())
    def again(self, data: st.DataObject) -> None:
        """A recent prompt again, or a chat's next turn (a recent prompt with its answer), with or without a new
        segment, one row or two, mostly in the first one's namespace."""
        earlier = data.draw(st.lists(st.sampled_from(self.histories[-6:]), min_size=1, max_size=2), label="earlier")
        more = data.draw(st.lists(st.integers(0, len(SEGMENTS) - 1), max_size=1), label="more")
        rows = self.within_bounds([Row((*e.pieces, *more)) for e, _ in earlier], same_length=False)
        if rows:
            self.run(data, rows, earlier[0][1])

    @rule(
        row=st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=1, max_size=4), namespace=st.sampled_from(NAMESPACES)
    )
    def warm(self, row: list[int], namespace: str | None) -> None:
        assert self.store is not None
        tokens = [t for p in row for t in SEGMENTS[p]]
        ran = self.ran.setdefault((namespace, self.version), Ran([]))
        allowed = min(len(tokens) - 1, ran.bound(tuple(tokens)))
        ran.prompts.append((tuple(tokens), 0))
        before = self.store.stats.hit_tokens
        try:
            stats = self.store.warm([tokens], progress=False, namespace=namespace)
        except CapacityError:
            assert self.need([len(tokens)], 0, 1) > self.capacity(), "a warm-up that fits was refused"
            return
        check_row(stats.per_row[0], len(tokens), allowed, namespace, self.version)
        assert self.store.stats.hit_tokens - before == stats.cached_tokens, "hit_tokens do not add up"

    @rule(data=st.data(), what=st.sampled_from(["edit a weight", "clear", "save and load"]))
    def disturb(self, data: st.DataObject, what: str) -> None:
        """What happens between calls: a weight edited, the store cleared, saved and loaded again."""
        if what == "edit a weight":
            self.edit_a_weight(data)
        elif what == "clear":
            self.clear()
        else:
            self.save_and_load()

    def edit_a_weight(self, data: st.DataObject) -> None:
        """``w[i] += 0.25`` in place: only the version counter sees it."""
        params = dict(self.model.named_parameters())
        name = data.draw(st.sampled_from(sorted(params)), label="parameter")
        p = params[name]
        i = data.draw(st.integers(0, p.numel() - 1), label="entry")
        with torch.no_grad():
            p.view(-1)[i] += 0.25
        self.version += 1

    def clear(self) -> None:
        assert self.store is not None
        self.store.clear()
        stats = self.store.stats
        assert (stats.blocks_used, stats.bytes_used, stats.snapshots, stats.snapshot_bytes) == (0, 0, 0, 0), stats
        assert stats.offload is None or stats.offload.blocks == stats.offload.bytes == 0, stats.offload

    def save_and_load(self) -> None:
        assert self.store is not None
        path = Path(self.tmp.name) / "prefixes.safetensors"
        self.store.save(path)
        self.store.close()
        self.store = None
        self.store = prefixkv.PrefixStore.load(path, self.model, **self.options)

    # -- the rules after every step

    @invariant()
    def store_is_sound(self) -> None:
        if self.store is None:
            return
        self.store.check_invariants()
        self.store.snapshots.check()
        stats = self.store.stats
        assert stats.bytes_used == stats.blocks_used * self.store.bytes_per_block, stats
        if self.max_bytes is not None:  # max_memory bounds the snapshots too; num_blocks bounds the blocks only
            held = stats.bytes_used + (stats.snapshot_bytes if "max_memory" in self.options else 0)
            assert held <= self.max_bytes, (stats, self.max_bytes)
        if self.tier_bytes is not None:
            assert stats.offload is not None and stats.offload.bytes <= self.tier_bytes, stats.offload

    # -- helpers

    def within_bounds(self, rows: list[Row], *, same_length: bool) -> list[Row]:
        """``rows`` with each text row cut to at most :data:`MAX_PROMPT` tokens (all to the shortest one's length
        where ``same_length``), and rows that would still be longer (images) left out."""
        if same_length and all(not images_of(r) for r in rows):
            n = min(len(tokens_of(self.family, r)) for r in rows)
            rows = [Row(r.pieces, n) for r in rows]
        rows = [
            Row(r.pieces, min(r.cut or MAX_PROMPT, MAX_PROMPT)) if not images_of(r) else r
            for r in rows
            if images_of(r) == [] or len(tokens_of(self.family, r)) <= MAX_PROMPT
        ]
        return [r for r in rows if len(tokens_of(self.family, r)) >= 2]

    def capacity(self) -> int:
        assert self.store is not None
        return self.store.max_blocks if self.store.max_blocks is not None else math.inf  # type: ignore[return-value]

    def need(self, lengths: list[int], new: int, beams: int) -> int:
        """More blocks than a call can hold at once: every row and beam its own blocks, twice (a recurrent model's
        runner holds its prefill's while the call claims)."""
        bs = self.options["block_size"]
        return 2 * sum(beams * (-(-(n + new) // bs) + 1) for n in lengths)

    def run(self, data: st.DataObject, rows: list[Row], usual: str | None = None) -> None:
        """Generate for ``rows`` with what users vary drawn (namespace, ``usual`` twice as often: a chat's own;
        decoding; images' encoding), against the rules. Mutates the store and the test's records."""
        assert self.store is not None
        namespace = data.draw(st.sampled_from((usual, *NAMESPACES)), label="namespace")
        images = any(images_of(r) for r in rows)
        mode = data.draw(st.sampled_from(["greedy", "sample", "beams"]), label="mode")
        new = data.draw(st.integers(1, 4), label="max_new_tokens")
        seed = data.draw(st.integers(0, 3), label="seed")
        gen: dict[str, Any] = {"max_new_tokens": new}
        beams = 1
        if mode == "greedy":
            gen["do_sample"] = False
        elif mode == "sample":
            gen["do_sample"] = True
        else:
            beams = data.draw(st.integers(2, 3), label="beams")
            returned = data.draw(st.integers(1, beams), label="num_return_sequences")
            gen |= {"do_sample": False, "num_beams": beams, "num_return_sequences": returned}
        types, layer = True, -1
        if images and self.family in ("qwen2_vl", "gemma3"):
            types = data.draw(st.booleans(), label="token types")
        if images and self.family == "llava":
            layer = data.draw(st.sampled_from([-1, -2]), label="vision_feature_layer")
        encoding = (types, layer)
        inputs = inputs_for(self.family, rows, types)
        if layer != -1:  # a keyword of the call that the cache is built with too, as its images are
            inputs["vision_feature_layer"] = layer
        lengths = [len(tokens_of(self.family, r)) for r in rows]

        # what each row may reuse: what ran before in its namespace and weight version, and the other rows of the
        # call (the batch shares their common prefixes); recorded before the call runs (a call that raises may have
        # published part of it)
        ran = self.ran.setdefault((namespace, self.version), Ran([]))
        keys = [keys_of(self.family, r, encoding) for r in rows]
        allowed = [
            min(len(k) - 1, max([ran.bound(k), *(common(k, o) for j, o in enumerate(keys) if j != i)]))
            for i, k in enumerate(keys)
        ]
        ran.prompts += [(k, new) for k in keys]

        before = self.store.stats.hit_tokens
        try:
            out, stats = generate_both(self.model, self.store, inputs, gen, seed=seed, namespace=namespace)
        except CapacityError:
            assert self.need(lengths, new, beams) > self.capacity(), "a call that fits was refused"
            return
        event(f"call {'cached' if stats.cached_tokens else 'cold'} {'images' if images else 'text'} rows={len(rows)}")
        assert len(stats.per_row) == len(rows), stats
        for i, (row, n) in enumerate(zip(stats.per_row, lengths)):
            check_row(row, n, allowed[i], namespace, self.version)
        assert stats.prompt_tokens == sum(r.prompt_tokens for r in stats.per_row), stats
        assert stats.cached_tokens == sum(r.cached_tokens for r in stats.per_row), stats
        assert stats.computed_tokens == sum(r.computed_tokens for r in stats.per_row), stats
        assert self.store.stats.hit_tokens - before == stats.cached_tokens, "hit_tokens do not add up"

        width, per = inputs["input_ids"].shape[1], out.sequences.shape[0] // len(rows)
        for i, spec in enumerate(rows):
            self.histories.append((Row(self.pieces(spec)), namespace))
            answer = answer_of(out.sequences[i * per, width:].tolist())
            if answer:
                self.histories.append((Row((*self.pieces(spec), answer)), namespace))

    def pieces(self, spec: Row) -> tuple[Piece, ...]:
        """``spec``'s pieces with its cut applied (a literal piece for the tokens it keeps)."""
        if spec.cut is None:
            return spec.pieces
        return (tuple(tokens_of(self.family, spec)),)


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    # PREFIXKV_DIFF_SHRINK=0 reports the first failing example as found (a mutation run wants the verdict only)
    phases=[p for p in Phase if p != Phase.shrink or os.environ.get("PREFIXKV_DIFF_SHRINK") != "0"],
)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_differential(family: str) -> None:
    run_state_machine_as_test(lambda: Differential(family), settings=SETTINGS)


# -- failing examples found, each a named test -----------------------------------------------------------------------


needs_recurrent = pytest.mark.skipif(
    releases.LINEAR_ATTENTION_LAYER is None,
    reason="transformers 4.x refuses recurrent layers (tests/test_recurrent.py)",
)


def ids(*rows: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(rows)}


@needs_recurrent
def test_a_private_prefix_of_a_hybrid_is_never_reused_outside_its_namespace() -> None:
    """The runner's split prefill publishes in the request's namespace: the shared one reuses none of it."""
    model = model_of("lfm2")
    store = prefixkv.PrefixStore(model, block_size=4)
    prompt = random_tokens(14, seed=31).tolist()
    _, private = generate_both(model, store, ids(prompt), {"max_new_tokens": 2}, namespace="alice")
    assert private.cached_tokens == 0
    _, shared = generate_both(model, store, ids(prompt), {"max_new_tokens": 2})
    assert shared.cached_tokens == 0, shared
    _, again = generate_both(model, store, ids(prompt), {"max_new_tokens": 2}, namespace="alice")
    assert again.cached_tokens <= len(prompt) - 1


@needs_recurrent
def test_each_row_of_a_batch_resumes_from_its_own_state() -> None:
    """The end-of-call snapshots of a batch are each row's own: the second row's next turn is stock's."""
    model = model_of("lfm2")
    store = prefixkv.PrefixStore(model, block_size=4)
    rows = [random_tokens(10, seed=32).tolist(), random_tokens(10, seed=33).tolist()]
    out, _ = generate_both(model, store, ids(*rows), {"max_new_tokens": 3})
    for row in out.sequences.tolist():
        _, turn = generate_both(model, store, ids([*row, 40, 41, 42]), {"max_new_tokens": 3})
        assert turn.cached_tokens <= len(row) - 1, turn


@pytest.mark.skipif(
    not releases.WARM_FORWARDS_TAKE_IMAGES, reason="transformers 4.x: a call with images reuses nothing"
)
def test_an_image_that_differs_past_its_first_4_kib_is_another_image() -> None:
    """Two LLaVA images that differ in one value of their third colour channel (past the first 4 KiB of their 6 KiB of
    pixels) are two images: the second reuses the text before it, never the first one's K/V."""
    model = model_of("llava")
    store = prefixkv.PrefixStore(model, block_size=4)
    system = SEGMENTS[5]
    for pixel in (-1, 2 * 16 * 16 + 5):
        row = Row((5, Image(0, pixel), 1))
        _, stats = generate_both(model, store, inputs_for("llava", [row], True), {"max_new_tokens": 3})
    assert stats.cached_tokens <= len(system), stats


@needs_recurrent
def test_the_snapshot_budget_drops_the_least_recently_used_first() -> None:
    """Past the snapshots' share of ``max_memory`` the oldest go: the last prompt asked again resumes before its last
    token."""
    model = model_of("lfm2")
    probe = prefixkv.PrefixStore(model, block_size=4)
    per_block = probe.bytes_per_block
    probe.close()
    # 18 blocks (9 prompts' K/V) and 6 blocks' bytes of snapshots (4 prompts' two each): the budget drops them
    store = prefixkv.PrefixStore(model, block_size=4, max_memory=24 * per_block)
    prompts = [random_tokens(5, seed=40 + i).tolist() for i in range(7)]
    for prompt in prompts:
        generate_both(model, store, ids(prompt), {"max_new_tokens": 2})
    assert store.stats.evictions == 0 and store.snapshots.dropped > 0  # the budget, not the paths, dropped them
    _, again = generate_both(model, store, ids(prompts[-1]), {"max_new_tokens": 2})
    assert again.cached_tokens == len(prompts[-1]) - 1, again


@needs_recurrent
def test_a_hybrids_blocks_and_snapshots_stay_within_max_memory() -> None:
    """A model with recurrent layers: the K/V pool gets three quarters of ``max_memory``, the snapshots the rest, and
    together they never pass it, the pool full or not."""
    model = model_of("lfm2")
    probe = prefixkv.PrefixStore(model, block_size=4)
    per_block = probe.bytes_per_block
    probe.close()
    bound = 12 * per_block
    store = prefixkv.PrefixStore(model, block_size=4, max_memory=bound)
    for i in range(8):
        generate_both(model, store, ids(random_tokens(14, seed=50 + i).tolist()), {"max_new_tokens": 3})
        stats = store.stats
        assert stats.bytes_used + stats.snapshot_bytes <= bound, stats
    assert store.stats.evictions > 0 and store.stats.snapshots > 0  # the bound was pressed: the pool was full


def test_the_estimate_sizes_v_at_its_own_head_size() -> None:
    """MiMo-V2-Flash's V heads are narrower than K's: the estimate per token is, per layer, its KV heads x
    (``head_dim`` + ``v_head_dim``), in bytes of float64 (the rule written out from the config's fields; a sliding
    layer has twice the config's KV heads, its attention's code: tests/test_memory.py measures it)."""
    if "mimo_v2_flash" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no MiMo-V2-Flash")
    config = census.tiny_config("mimo_v2_flash")
    assert config.v_head_dim != config.head_dim
    heads = [config.num_key_value_heads * (2 if t == "sliding_attention" else 1) for t in config.layer_types]
    per_token = sum(h * (config.head_dim + config.v_head_dim) for h in heads[: config.num_hidden_layers])
    assert prefixkv.kv_bytes_per_token(config, torch.float64) == per_token * 8


needs_warm_images = pytest.mark.skipif(
    not releases.WARM_FORWARDS_TAKE_IMAGES, reason="transformers 4.x: a call with images reuses nothing"
)


@needs_warm_images
def test_a_store_built_after_a_batch_of_qwen2_vl_serves_it() -> None:
    """The store's measuring forwards set aside the rotary offsets Qwen2-VL kept from a call of another batch size (a
    call with an empty cache starts afresh), and put them back: the store serves the batch, then a text request."""
    model = prefixkv.models.tiny_model("qwen2_vl", dtype=torch.float64)
    inputs = inputs_for("qwen2_vl", [Row((Image(0), 1)), Row((2, 3))], True)
    model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=0)  # a batch of 2, before any store
    held = model.model.rope_deltas
    store = prefixkv.PrefixStore(model, block_size=4)
    assert model.model.rope_deltas is held  # measuring left the model as it found it
    for _ in range(2):
        _, stats = generate_both(model, store, inputs, {"max_new_tokens": 2})
    assert stats.cached_tokens > 0, stats
    generate_both(model, store, ids(SEGMENTS[2] + SEGMENTS[4]), {"max_new_tokens": 2})


@needs_warm_images
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
@pytest.mark.parametrize("gen", [{"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}])
def test_beams_over_a_cached_image_and_a_new_one(family: str, gen: dict[str, Any]) -> None:
    """A call that repeats its rows (beams, ``num_return_sequences``) over a cached image and a new one: ``generate``
    splits the encoded images among the repeated rows by the prompt's placeholders, so every image is encoded and the
    new one's features fed; the first image's K/V are reused, and a later greedy request is stock's too."""
    model = pristine(family)
    store = prefixkv.PrefixStore(model, block_size=4)
    generate_both(model, store, inputs_for(family, [Row((5, Image(1), 0))], True), {"max_new_tokens": 2})
    both = inputs_for(family, [Row((5, Image(1), 0, Image(0), 7))], True)
    _, stats = generate_both(model, store, both, {"max_new_tokens": 2, **gen}, seed=1)
    first = len(SEGMENTS[5]) + len(image_tokens(family))
    assert first <= stats.cached_tokens <= first + len(SEGMENTS[0]), stats
    generate_both(model, store, both, {"max_new_tokens": 2, "do_sample": False})
