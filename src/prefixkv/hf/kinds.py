"""What each layer of a model caches, its *kind*, read as transformers reads it (docs/how-it-works.md, "Layer kinds").

transformers 5.x builds a model's cache from its text config's layer types (``get_layer_types_and_kwargs``): a
``DynamicLayer`` (per-token K/V) for full, sliding and chunked attention, a ``LinearAttentionLayer`` (a conv and a
recurrent state per row, no sequence axis) for linear attention, Mamba and short convolutions, both for the
"hybrid" layers, and a ``DummyLayer`` (nothing) for layers without attention. prefixkv reads the same list, so a
model whose kinds are these is served: K/V in the pool for the layers that write K/V, and for the layers with a
state, snapshots of that state at token positions (:mod:`prefixkv.hf.states`). The measuring forwards of
:mod:`prefixkv.hf.shapes` then prove the kinds: the layers that call ``update`` are those of kind :data:`KV` or
:data:`BOTH`, those that update a state are those of kind :data:`STATE` or :data:`BOTH`.
"""

from __future__ import annotations

from typing import Any

from ..compat import releases

KV = "kv"
"""Per-token K/V: full, sliding-window or chunked attention."""
STATE = "state"
"""A conv and/or recurrent state per row: linear attention, Mamba, short convolutions."""
BOTH = "kv+state"
"""A hybrid layer: both."""
NONE = "none"
"""Nothing cached (an MLP or MoE layer without attention)."""

_KIND_OF_TYPE = {
    "full_attention": KV,
    "sliding_attention": KV,
    "chunked_attention": KV,
    "linear_attention": STATE,
    "conv": STATE,
    "hybrid": BOTH,
    "hybrid_sliding": BOTH,
    "dummy": NONE,
}


def layer_kinds(text_config: Any) -> list[str] | None:
    """Each layer's kind (:data:`KV`, :data:`STATE`, :data:`BOTH`, :data:`NONE`) when the model has state layers
    and transformers' reading of its config names only the kinds above; ``None`` for a model without state layers
    (served as K/V alone), on a release that does not read layer kinds, or where a kind is not one of these (the
    refusals of :mod:`prefixkv.hf.support` then say why). Does not mutate."""
    types = releases.cache_layer_types(text_config)
    if types is None or any(t not in _KIND_OF_TYPE for t in types):
        return None
    kinds = [_KIND_OF_TYPE[t] for t in types]
    return kinds if STATE in kinds or BOTH in kinds else None


def writes_kv(kind: str) -> bool:
    """Whether a layer of ``kind`` hands K/V to ``update``."""
    return kind in (KV, BOTH)


def has_state(kind: str) -> bool:
    """Whether a layer of ``kind`` keeps a conv or recurrent state."""
    return kind in (STATE, BOTH)


def number_of_states(config: Any) -> int:
    """How many conv/recurrent states each state layer of a model of ``config`` keeps (transformers'
    ``number_of_conv_states``; 1 for most)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(getattr(text, "number_of_conv_states", 1) or 1)


def silent_layers(layer_kinds: list[str] | None) -> list[int]:
    """The layers that never hand K/V to ``update`` (their count of columns moves at each forward's end)."""
    return [] if layer_kinds is None else [i for i, k in enumerate(layer_kinds) if not writes_kv(k)]
