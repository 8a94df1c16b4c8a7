"""What a new user meets first: store.warm refusing text and chat messages with what to do, and
generate_many's progress bar (finished rows as they finish, the reuse of this call)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import prefixkv


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return prefixkv.models.tiny_model("llama")


@pytest.mark.parametrize(
    ("prompts", "says"),
    [
        (["You are the help desk."], "tokenize it first"),
        ("You are the help desk.", "tokenize it first"),
        ([{"role": "system", "content": "You are the help desk."}], "apply the chat template first"),
        ([[{"role": "system", "content": "You are the help desk."}]], "apply the chat template first"),
    ],
)
def test_warm_refuses_text_and_messages_saying_what_to_do(model: torch.nn.Module, prompts: object, says: str) -> None:
    store = prefixkv.PrefixStore(model, block_size=4)
    with pytest.raises(ValueError, match=says):
        store.warm([list(range(3, 20)), *prompts] if isinstance(prompts, list) else prompts, progress=False)  # type: ignore[arg-type]
    assert store.stats.cached_tokens == 0, "a bad prompt after a good one: nothing may be computed"
    store.close()


class _Recorder:
    """A stand-in for tqdm that records what the bar shows: (event, rows counted, postfix)."""

    events: ClassVar[list[tuple[str, float, dict[str, object]]]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.n: float = 0
        self.postfix: dict[str, object] = {}

    def __enter__(self) -> _Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def refresh(self) -> None:
        _Recorder.events.append(("refresh", self.n, dict(self.postfix)))

    def set_postfix(self, **kw: object) -> None:
        self.postfix = kw
        _Recorder.events.append(("yield", self.n, dict(kw)))


def test_generate_many_bar_counts_rows_as_they_end_and_this_calls_reuse(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[*range(3, 35), 40 + i] for i in range(4)]
    store = prefixkv.PrefixStore(model, block_size=8)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    first = prefixkv.generate_many(model, prompts, store=store, progress=False, **kw)
    eos = first[0].tokens[1]  # row 0 emits it at its second step: it ends there, the others run on
    assert eos not in first[0].tokens[:1]
    monkeypatch.setattr(prefixkv.many, "tqdm", _Recorder)
    _Recorder.events = []
    again = prefixkv.generate_many(model, prompts, store=store, progress=True, eos_token_id=eos, **kw)
    kinds = [kind for kind, _, _ in _Recorder.events]
    assert "refresh" in kinds and kinds.index("refresh") < kinds.index("yield"), _Recorder.events
    assert _Recorder.events[kinds.index("refresh")][1] >= 1, "a row that ended mid-call is counted before it returns"
    assert _Recorder.events[-1][2] == {"reused": sum(g.cached_tokens for g in again)}
    assert sum(g.cached_tokens for g in again) < store.stats.hit_tokens, "per call, not the store's running total"
    store.close()


def test_cache_display_says_a_fresh_cache_holds_only_the_reused_prefix(model: torch.nn.Module) -> None:
    store = prefixkv.PrefixStore(model, block_size=16)
    system = torch.arange(3, 99)
    store.warm([system], progress=False)
    with prefixkv.PagedPrefixCache(store, torch.cat([system, torch.arange(100, 110)])[None]) as cache:
        html = prefixkv.display.cache_html(cache)
    assert "1 row &#215; 96 columns held (the reused prefix of 106 prompt tokens" in html, html
    store.close()
