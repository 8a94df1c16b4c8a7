"""Shared test helpers: tiny models, a stock-vs-prefixkv generate comparison, a token counter."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import DynamicCache

import prefixkv


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
    spelling: str = "cache",
    max_new_tokens: int = 8,
    **kwargs: Any,
) -> Comparison:
    """Run generate with a fresh DynamicCache and with a PagedPrefixCache from ``store``."""

    def run(cache: Any) -> Any:
        torch.manual_seed(seed)
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **{spelling: cache},
            **kwargs,
        )

    ref = run(DynamicCache(config=model.config))
    counter = FeedCounter(model)
    cache = prefixkv.PagedPrefixCache(store, ids, mask)
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
