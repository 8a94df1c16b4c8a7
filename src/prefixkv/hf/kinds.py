"""What each layer of a model caches, its *kind*: one object per kind, in a registry keyed by transformers' layer
types (docs/how-it-works.md, "Layer kinds").

transformers 5.x builds a model's cache from its text config's layer types (``get_layer_types_and_kwargs``): a
``DynamicLayer`` (per-token K/V) for full, sliding and chunked attention, a ``LinearAttentionLayer`` (a conv and a
recurrent state per row, no sequence axis) for linear attention, Mamba and short convolutions, both for the
"hybrid" layers, and a ``DummyLayer`` (nothing) for layers without attention or that read another layer's K/V
(KV sharing). prefixkv reads the same list and maps each type to a :class:`LayerKind` (:func:`register`), which
says all that a layer of its kind asks of the library:

- what its layers hand the cache, measured from the tensors (:meth:`LayerKind.measure`, beside the K/V shapes the
  measuring forwards of :mod:`prefixkv.hf.shapes` record): the layers of a kind that :attr:`~LayerKind.writes_kv`
  call ``update``, those of a kind that :attr:`~LayerKind.has_state` update a state, and the forwards prove it;
- which per-token tensors the pool keeps for it, by name (:meth:`LayerKind.spec`: ``k`` and ``v``, of their own
  heads and sizes, latent attention's latent and rotary key included, and any more a kind names, such as a sparse
  attention's indexer keys); the pool (:mod:`prefixkv.kv.pool`) keeps, writes, reads, saves and tiers each by its
  name;
- its face in the cache (:meth:`LayerKind.face`, ``cache.layers[i]``), through which the model writes a step: K/V
  through ``update``, a named tensor through :meth:`prefixkv.hf.layers.PagedLayer.update_tensor`;
- for a kind with a state (:attr:`~LayerKind.has_state`), its face is transformers' ``LinearAttentionLayer``
  (:class:`prefixkv.hf.layers.StateLayer`), whose conv and recurrent states :mod:`prefixkv.hf.states` snapshots at
  token positions and restores, every state layer of a row at once.

A kind is a ``str`` too, its name (``"kv"``, ``"state"``, ``"kv+state"``, ``"none"``), so that a store's
``layer_kinds`` prints and compares as it did; what the library asks of it is its attributes, never its name. A new
kind is a subclass registered for its layer type; nothing else in the library changes for it (tests/test_kinds.py
registers one from the test file).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..base.memory import LayerShape
from ..compat import releases
from ..kv.pool import LayerSpec, layer_spec
from .layers import HybridLayer, PagedLayer, StateLayer

NO_KV = LayerShape((0, 0), (0, 0))
"""The shape of a layer that keeps no K/V (a recurrent layer): empty pool tensors."""


class LayerKind(str):
    """A kind of layer (its name is the ``str``): what its layers hand the cache and what the cache keeps for them.
    The base class is the kind of full-, sliding- or chunked-attention layers: per-token K and V, each of the heads
    and size the layer hands over. Subclass it for another kind and :func:`register` the subclass."""

    writes_kv = True
    """Whether a layer of this kind hands K/V to ``update``."""
    has_state = False
    """Whether a layer of this kind keeps a conv or recurrent state (snapshotted at token positions)."""

    def measure(self, layer: Any) -> dict[str, tuple[int, int]]:
        """The per-token tensors besides K and V that ``layer`` (transformers' own cache layer of this kind, after
        the measuring forwards of :func:`prefixkv.hf.shapes.measure`) holds, by name, each ``(heads, size)``; none
        for this kind. Does not mutate."""
        return {}

    def spec(self, shape: LayerShape, device: torch.device, dtype: torch.dtype) -> LayerSpec:
        """What the pool keeps per token for a layer of this kind that handed over ``shape`` (K, V and the named
        tensors :meth:`measure` found), on ``device`` in ``dtype``."""
        if not self.writes_kv:
            return layer_spec(NO_KV.key, NO_KV.value, device, dtype)
        return layer_spec(shape.key, shape.value, device, dtype, shape.extra)

    def face(self, cache: Any, layer_idx: int, number_of_states: int) -> Any:
        """The cache's face of a layer of this kind (``cache.layers[layer_idx]``): what the model calls."""
        return PagedLayer(cache, layer_idx)


class StateKind(LayerKind):
    """A conv and/or recurrent state per row, no K/V: linear attention, Mamba, short convolutions."""

    writes_kv = False
    has_state = True

    def face(self, cache: Any, layer_idx: int, number_of_states: int) -> Any:
        return StateLayer(cache, layer_idx, number_of_states)


class HybridKind(LayerKind):
    """A hybrid layer: K/V and a state."""

    has_state = True

    def face(self, cache: Any, layer_idx: int, number_of_states: int) -> Any:
        return HybridLayer(cache, layer_idx, number_of_states)


class NoCacheKind(LayerKind):
    """Nothing cached: an MLP or MoE layer without attention, or a layer that reads another's K/V (KV sharing)."""

    writes_kv = False


KV = LayerKind("kv")
"""Per-token K/V: full, sliding-window or chunked attention; multi-head latent attention's latent and rotary key."""
STATE = StateKind("state")
"""A conv and/or recurrent state per row: linear attention, Mamba, short convolutions."""
BOTH = HybridKind("kv+state")
"""A hybrid layer: both."""
NONE = NoCacheKind("none")
"""Nothing cached (an MLP or MoE layer without attention, a KV-shared layer)."""

_KIND_OF_TYPE: dict[str, LayerKind] = {
    "full_attention": KV,
    "sliding_attention": KV,
    "chunked_attention": KV,
    "linear_attention": STATE,
    "conv": STATE,
    "hybrid": BOTH,
    "hybrid_sliding": BOTH,
    "dummy": NONE,
}


def register(layer_type: str, kind: LayerKind) -> None:
    """Serve the layers transformers names ``layer_type`` (``get_layer_types_and_kwargs``) as ``kind``. Mutates the
    registry."""
    if not isinstance(kind, LayerKind):
        raise TypeError(f"register takes a LayerKind for {layer_type!r}, got {type(kind).__name__}")
    _KIND_OF_TYPE[layer_type] = kind


def unregister(layer_type: str) -> None:
    """Forget the kind of ``layer_type`` (a kind registered for a while, as a test does). Mutates the registry."""
    _KIND_OF_TYPE.pop(layer_type, None)


def layer_kinds(text_config: Any) -> list[LayerKind] | None:
    """Each layer's kind when some layer is of another kind than :data:`KV` or :data:`NONE` and transformers'
    reading of its config names only registered types; ``None`` for a model whose layers are all K/V or none (served
    as K/V alone), on a release that does not read layer kinds, or where a type is not registered (the refusals of
    :mod:`prefixkv.hf.support` then say why). Does not mutate."""
    types = releases.cache_layer_types(text_config)
    if types is None or any(t not in _KIND_OF_TYPE for t in types):
        return None
    found = [_KIND_OF_TYPE[t] for t in types]
    # K/V and none alone (KV sharing, layers without attention) are the K/V path's, which counts the layers that keep
    # K/V of their own (prefixkv.hf.shapes)
    return found if any(k is not KV and k is not NONE for k in found) else None


def of(layer_kinds: Sequence[LayerKind] | None, layer: int) -> LayerKind:
    """The kind of ``layer`` (:data:`KV` for a model whose kinds are ``None``)."""
    return KV if layer_kinds is None else layer_kinds[layer]


def stateful(layer_kinds: Sequence[LayerKind] | None) -> bool:
    """Whether some layer keeps a state (a model with recurrent layers)."""
    return layer_kinds is not None and any(k.has_state for k in layer_kinds)


def number_of_states(config: Any) -> int:
    """How many conv/recurrent states each state layer of a model of ``config`` keeps (transformers'
    ``number_of_conv_states``; 1 for most)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(getattr(text, "number_of_conv_states", 1) or 1)


def silent_layers(layer_kinds: Sequence[LayerKind] | None) -> list[int]:
    """The layers that never hand K/V to ``update`` (their count of columns moves at each forward's end)."""
    return [] if layer_kinds is None else [i for i, k in enumerate(layer_kinds) if not k.writes_kv]


def faces(cache: Any, layer_kinds: Sequence[LayerKind] | None, num_layers: int, number_of_states: int) -> list[Any]:
    """The cache's face of each of its ``num_layers`` layers (``cache.layers``), each its kind's."""
    return [of(layer_kinds, i).face(cache, i, number_of_states) for i in range(num_layers)]
