"""What a new user meets first: store.warm refusing text and chat messages with what to do, and
generate_many's progress bar (finished rows as they finish, the reuse of this call)."""

from __future__ import annotations

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
