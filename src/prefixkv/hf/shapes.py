"""What a model's layers hand its cache, read from the tensors themselves (docs/how-it-works.md, "Shapes come from
the tensors").

A config names heads and sizes in many ways (``num_key_value_heads``, ``multi_query``, ``dim_head``, a decoder's own
head count), and a model may use another field than the one a reader guesses: CPM-Ant's heads are ``dim_head`` wide,
not ``hidden_size / heads``; ProphetNet's decoder has ``num_decoder_attention_heads``. So a store does not size its
pool from the config: :func:`measure` runs the model on one token, then on two more that resume that cache, with a
cache that records every ``update``, and the pool takes the shapes the layers handed over. The same two forwards
prove what prefixkv's cache assumes of a model: each forward adds to each layer once, one column per id it is fed,
and a forward of several ids resumes a cache. A model that does otherwise (learned prompt tokens ahead of the ids,
the whole sequence fed every step, recurrent loops that write a layer twice) is refused with what it did.

The config (:func:`prefixkv.memory.attention_shape`) is only an estimate, for ``kv_bytes_per_token`` before a model
exists and for a model that cannot run on ids alone (then the first forward's ``update`` checks the estimate and
names any difference).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from ..errors import UnsupportedModelError
from ..memory import AttentionShape
from .support import family


class _Update(NamedTuple):
    """One ``update`` call: the layer, the columns it adds, and the K and V shapes (heads, head size)."""

    layer: int
    columns: int
    key: tuple[int, int]
    value: tuple[int, int]


class _Recording(DynamicCache):
    """A ``DynamicCache`` that notes every ``update`` call (:class:`_Update`), per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards: list[list[_Update]] = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = key_states.shape, value_states.shape
        self.forwards[-1].append(_Update(layer_idx, int(k[-2]), (int(k[1]), int(k[-1])), (int(v[1]), int(v[-1]))))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def measure(model: Any, estimate: AttentionShape, device: torch.device) -> AttentionShape:
    """The model's KV shape as its layers hand K/V over, from two forwards (one id, then two more that resume the
    cache) on ``device`` without gradients and with the random state restored (dropout draws nothing a later call
    would see); ``estimate`` (from the config) where the model does not run on ids alone. Raises
    :class:`UnsupportedModelError` when the layers do what prefixkv's cache cannot follow (the module's docstring).
    Does not mutate the model."""
    cache = _Recording()
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    devices = [device] if device.type == "cuda" else []
    fed = (1, 2)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for n in fed:
            cache.forwards.append([])
            ids = torch.ones((1, n), dtype=torch.long, device=device)
            try:
                model(input_ids=ids, use_cache=True, **{name: cache})
            except Exception as e:
                if n == fed[0]:  # needs other inputs, or has no weights yet: the first forward checks the estimate
                    return estimate
                raise UnsupportedModelError(
                    f"{family(model)} fails on a forward of {n} ids that resumes its cache ({type(e).__name__}: "
                    f"{e}), which every reuse of a prefix does; generate without prefixkv (with a DynamicCache) for "
                    "this model"
                ) from e
    for n, updates in zip(fed, cache.forwards, strict=True):
        _check_forward(model, estimate.num_layers, n, updates)
    shapes = {(u.key, u.value) for forward in cache.forwards for u in forward}
    if len(shapes) > 1 or any(key != value for key, value in shapes):
        per_layer = ", ".join(f"layer {u.layer}: K {u.key}, V {u.value}" for u in cache.forwards[0])
        raise UnsupportedModelError(
            f"{family(model)} has layers whose K/V differ in shape ({per_layer}; heads, head size); prefixkv keeps "
            "K and V of one shape in every layer; generate without prefixkv (with a DynamicCache) for this model"
        )
    (heads, dim), _ = shapes.pop()
    return AttentionShape(estimate.num_layers, heads, dim)


def _check_forward(model: Any, num_layers: int, fed: int, updates: list[_Update]) -> None:
    """Raise :class:`UnsupportedModelError` unless a forward fed ``fed`` ids added ``fed`` columns to each of the
    ``num_layers`` layers, once each. Does not mutate."""
    layers = [u.layer for u in updates]
    if sorted(layers) != list(range(num_layers)):
        raise UnsupportedModelError(
            f"{family(model)} writes its cache layers {layers} in one forward of its {num_layers} layers (a layer "
            "written twice, or beyond its layers: recurrent loops, or layers without a cache); prefixkv keeps one "
            "K/V per token in each layer; generate without prefixkv (with a DynamicCache) for this model"
        )
    columns = sorted({u.columns for u in updates})
    if columns != [fed]:
        raise UnsupportedModelError(
            f"{family(model)} adds {columns[0] if len(columns) == 1 else columns} columns to its cache for {fed} "
            f"id{'s' if fed > 1 else ''} fed (tokens of its own ahead of the ids, or ids it slices by the cache's "
            "length), so its cache columns are not the ids' and prefixkv cannot key them by the ids; generate "
            "without prefixkv (with a DynamicCache) for this model"
        )
