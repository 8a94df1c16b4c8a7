"""The attention backend a store reads the pool through is chosen once, when the store is built
(``prefixkv.store.options.choose_attention``, carried by ``store.settings``): for every situation the other tests run
(``"auto"`` on the CPU, ``"gather"``, ``"blocks"``, ``"flex"`` where FlexAttention serves, an invariant store, 8-bit
blocks, a model on ``eager`` attention), the backend that ``store.attention_backend`` names is the one whose code
runs on every forward, spied on its read plans and its ``attend``, while the outputs match stock ``generate``
(float32, within 1e-4, tokens equal). A backend refused at construction leaves the model as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import compare, random_tokens

import prefixkv
from prefixkv import PrefixStore
from prefixkv.attention import blocks, flex, gather, planner, reader, reads

TOL = 1e-4
BS = 4

SITUATIONS = {
    "auto": ({}, "blocks"),
    "gather": ({"attention": "gather"}, "gather"),
    "blocks": ({"attention": "blocks"}, "blocks"),
    "flex": ({"attention": "flex"}, "flex"),
    "invariant": ({"invariant": True}, "gather"),
    "int8": ({"kv_dtype": "int8"}, "gather"),
    "eager": ({"attention": "blocks"}, "gather"),  # a model whose attention prefixkv does not switch to
}


@pytest.fixture(scope="module")
def model() -> Any:
    return prefixkv.models.tiny_model("llama", dtype=torch.float32)


@pytest.fixture(scope="module")
def eager() -> Any:
    return prefixkv.models.tiny_model("llama", dtype=torch.float32, attn_implementation="eager")


class Ran:
    """What runs on the forwards of a store's caches: per forward that reads the pool in place, the backend whose
    plan it is, ``"gather"`` for one that hands out whole rows (a probe, which checks a model's layers once, is
    neither; a lone row's decode step that the blocks would read in one gather, :func:`planner.lone_fold`, is
    ``"lone fold"``), and the backends whose ``attend`` ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans: set[str] = set()
        self.attended: set[str] = set()
        plan = reader.Reader.plan

        def planned(r: reader.Reader, *args: Any) -> reads.ForwardReads:
            made = plan(r, *args)
            if made.probe:
                return made
            if made.in_place and made.backend is not None:
                self.plans.add(made.backend.name)
            elif r._backend.name == "blocks" and planner.lone_fold(*args[:4], BS):
                self.plans.add("lone fold")
            else:
                self.plans.add("gather")
            return made

        monkeypatch.setattr(reader.Reader, "plan", planned)
        for backend in (blocks.BlocksBackend, flex.FlexBackend, gather.GatherBackend):
            self._spy(monkeypatch, backend)

    def _spy(self, monkeypatch: pytest.MonkeyPatch, backend: Any) -> None:
        attend = backend.attend

        def spied(b: Any, *args: Any) -> torch.Tensor:
            self.attended.add(b.name)
            return attend(b, *args)

        monkeypatch.setattr(backend, "attend", spied)


@pytest.mark.parametrize("situation", list(SITUATIONS))
def test_the_backend_the_store_names_is_the_one_that_runs(
    model: Any, eager: Any, situation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options, expected = SITUATIONS[situation]
    model = eager if situation == "eager" else model
    if situation == "flex" and not flex.can_serve("cpu", torch.float32, BS)[0]:
        pytest.skip(flex.can_serve("cpu", torch.float32, BS)[1])
    ran = Ran(monkeypatch)
    with PrefixStore(model, block_size=BS, **options) as store:
        named = store.settings.backend
        assert named == expected and store.attention_backend == store.settings.backend_reason
        assert store.attention_backend.startswith(f"{named}: ")
        ids = random_tokens(20, seed=7)[None]  # a whole chunk of an invariant store reused warm
        for warm in (False, True):
            result = compare(model, store, ids, do_sample=False)
            assert (result.cache.stats.cached_tokens > 0) == warm
            assert result.same_tokens and result.max_diff <= TOL, result.max_diff
    # a warm lone row reads its cached prefix and its own block: the blocks backend's decode steps fold
    assert ran.plans == ({named, "lone fold"} if named == "blocks" else {named})
    assert ran.attended == ({named} - {"gather"})


def test_a_backend_refused_at_construction_leaves_the_model_as_it_was(model: Any) -> None:
    """``"blocks"`` over 8-bit blocks is refused before the store switches the model's attention to prefixkv's
    (it once stayed switched, with no store to switch it back); a later store's request matches stock."""
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="the 'blocks' backend reads the pool in the dtype the model computes in"):
        PrefixStore(model, block_size=BS, kv_dtype="int8", attention="blocks")
    assert model.config._attn_implementation == before == "sdpa"
    with PrefixStore(model, block_size=BS) as store:
        result = compare(model, store, random_tokens(10, seed=8)[None], do_sample=False)
        assert result.same_tokens and result.max_diff <= TOL, result.max_diff
    assert model.config._attn_implementation == "sdpa"
