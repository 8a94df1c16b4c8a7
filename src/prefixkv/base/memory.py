"""KV footprint arithmetic: bytes per token with grouped-query heads, and budget strings."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str) -> int:
    """``"2GiB"`` -> 2147483648; ints pass through.

    >>> parse_bytes("1.5 MiB")
    1572864
    """
    if isinstance(value, bool):
        raise TypeError("a memory size must be a number of bytes or a string such as '2GiB'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"a memory size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size; write e.g. '512MiB', '2GiB' or a number of bytes")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


class AttentionShape(NamedTuple):
    """What the KV of one model occupies: attention layers, KV heads and head size (K and V alike)."""

    num_layers: int
    kv_heads: int
    head_dim: int


_HEADS = ("num_attention_heads", "n_head", "num_heads")


def attention_shape(config: Any) -> AttentionShape:
    """Layers, KV heads and head size as a transformers config names them (text part for multimodal ones): an
    estimate, which a store replaces with what the layers hand over (docs/how-it-works.md, "Shapes come from the
    tensors")."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    if all(getattr(config, name, None) is None for name in _HEADS) and getattr(config, "state_size", None):
        return AttentionShape(int(layers), 0, 0)  # a Mamba model: no attention, a state per layer
    heads = _first(config, *_HEADS)
    kv_heads = _read(config, "num_key_value_heads")
    if getattr(config, "new_decoder_architecture", False):
        kv_heads = heads  # Falcon's new decoder architecture caches its KV heads broadcast to every query head
    elif kv_heads is None:
        kv_heads = 1 if getattr(config, "multi_query", False) else heads
    head_dim = _read(config, "head_dim")
    if head_dim is None:
        hidden = _first(config, "hidden_size", "n_embd", "d_model")
        head_dim = hidden // heads
    return AttentionShape(int(layers), int(kv_heads), int(head_dim))


class LayerShape(NamedTuple):
    """What one layer that keeps K/V hands its cache per token: K's and V's (heads, head size), and any more
    per-token tensors its kind keeps, by name (``extra``, :meth:`prefixkv.hf.kinds.LayerKind.measure`)."""

    key: tuple[int, int]
    value: tuple[int, int]
    extra: tuple[tuple[str, tuple[int, int]], ...] = ()


class CachesKV(Protocol):
    """A layer's kind as the estimate asks it (:class:`prefixkv.hf.kinds.LayerKind`): whether it keeps K/V, and a
    state."""

    @property
    def writes_kv(self) -> bool: ...

    @property
    def has_state(self) -> bool: ...


def layer_shapes(config: Any) -> list[LayerShape]:
    """Per layer that keeps K/V of its own, its K and V shapes as a transformers config names them: an estimate, as
    :func:`attention_shape` is (docs/memory.md). Multi-head latent attention (``kv_lora_rank``) keeps a latent of
    ``kv_lora_rank`` and a rotary key of ``qk_rope_head_dim``, one head each; ``v_head_dim`` sizes V's heads; a
    per-layer config (``per_layer_config``) sizes each layer; a layer that reuses another's K/V
    (``kv_sharing_modes``) keeps none; MiMo-V2-Flash's sliding layers have twice the config's KV heads (its
    attention's code, :data:`_SLIDING_HEADS`).

    >>> from transformers import DeepseekV3Config
    >>> layer_shapes(DeepseekV3Config(num_hidden_layers=1, kv_lora_rank=16, qk_rope_head_dim=8))
    [LayerShape(key=(1, 16), value=(1, 8), extra=())]
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    uniform = attention_shape(config)
    rank = getattr(text, "kv_lora_rank", None)
    if rank is not None:
        return [LayerShape((1, int(rank)), (1, int(text.qk_rope_head_dim)))] * uniform.num_layers
    per_layer = list(getattr(text, "per_layer_config", None) or []) if getattr(text, "is_heterogeneous", False) else []
    modes = list(getattr(text, "kv_sharing_modes", None) or [None] * uniform.num_layers)
    types = list(getattr(text, "layer_types", None) or [])
    sliding = _SLIDING_HEADS.get(getattr(text, "model_type", ""), 1)
    shapes = []
    for i in range(uniform.num_layers):
        layer = per_layer[i] if i < len(per_layer) else text
        heads = int(_read(layer, "num_key_value_heads") or uniform.kv_heads)
        if i < len(types) and types[i] == "sliding_attention":
            heads *= sliding
        dim = int(_read(layer, "head_dim") or uniform.head_dim)
        value = int(_read(text, "v_head_dim") or dim)
        if i >= len(modes) or modes[i] != "reuse":
            shapes.append(LayerShape((heads, dim), (heads, value)))
    return shapes


# families whose sliding-window layers have a multiple of the config's KV heads, set in their attention's code
_SLIDING_HEADS = {"mimo_v2_flash": 2}


def _read(config: Any, name: str) -> Any:
    """``config.name`` (``None`` where absent); of a per-layer config, a field that differs between layers is the
    first layer's (transformers 5.x raises on reading it from the whole config)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError: a field of each layer's own config
        return getattr(config.per_layer_config[0], name, None)


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = _read(config, name)
        if value is not None:
            return value
    raise ValueError(f"{type(config).__name__} has none of {names}; prefixkv cannot size its KV cache")


def kv_bytes_per_token(config: Any, dtype: torch.dtype = torch.float32) -> int:
    """KV bytes one token occupies: over the layers that keep K/V, K's heads x head size plus V's, x bytes per
    element (2 x layers x kv_heads x head_dim where every layer is alike), as the config names them
    (:func:`layer_shapes`; an estimate: a store measures the shapes from its model's tensors,
    ``store.bytes_per_block``).

    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    >>> kv_bytes_per_token(cfg, torch.float16)
    256
    """
    elements = sum(s.key[0] * s.key[1] + s.value[0] * s.value[1] for s in layer_shapes(config))
    return elements * torch.empty((), dtype=dtype).element_size()


def estimate(config: Any, tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """KV bytes that ``tokens`` tokens occupy (``tokens * kv_bytes_per_token``)."""
    return tokens * kv_bytes_per_token(config, dtype)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def snapshot_budget(layer_kinds: Sequence[CachesKV] | None, max_memory: int | str | None) -> int | None:
    """The bytes a store's recurrent-state snapshots may hold (docs/memory.md, "Recurrent state"): for a model with
    recurrent layers (``layer_kinds``, :mod:`prefixkv.hf.kinds`) a quarter of ``max_memory``, the K/V pool getting the
    rest, or all of it for a model with no K/V layers; ``None`` without a ``max_memory`` (snapshots then live as long
    as the store holds their paths) or recurrent layers.

    >>> from prefixkv.hf.kinds import KV, STATE
    >>> snapshot_budget([STATE, KV], "4MiB"), snapshot_budget([STATE], 1000), snapshot_budget(None, 1000)
    (1048576, 1000, None)
    """
    if layer_kinds is None or max_memory is None or not any(k.has_state for k in layer_kinds):
        return None
    budget = parse_bytes(max_memory)
    return budget if not any(k.writes_kv for k in layer_kinds) else budget // 4
