"""Which models prefixkv can cache exactly, decided when a ``PrefixStore`` is built.

prefixkv keeps, per attention layer, one K and one V vector per token, all layers alike
(``[num_blocks, block_size, kv_heads, head_dim]``), and reuses a prefix by handing those back. A model
is supported when that is all its cache holds: every layer attends with full, sliding-window or chunked
attention over per-token K/V of one shape. Everything else is refused with the family and the reason
(docs/architectures.md, "Refused families"), never served with wrong output; that page lists the families.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from .._compat import CACHE_KWARGS
from ..errors import UnsupportedModelError
from ..family import family
from ..kv.key_space import transformers_model
from ..memory import attention_shape
from . import kinds

# layer kinds whose cache is per-token K/V; sliding and chunked layers differ only in their mask,
# which transformers builds from the positions and ``get_mask_sizes``
KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# layer kinds that carry a recurrent (state-space, linear-attention or convolution) state
_STATE_LAYER_TYPES = frozenset(
    {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent", "attention_and_mamba"}
)
# layer kinds with no attention of their own (they would never call ``update``)
_NO_KV_LAYER_TYPES = frozenset({"moe", "mlp", "dummy"})
_STATE_FIELDS = ("ssm_state_size", "state_size", "mamba_d_state")
# rotary embeddings whose frequencies depend on the length of the whole call (transformers'
# ``dynamic_rope_update``): the same prefix gets other K/V in a longer call
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


REFUSAL_ADVICE = "; generate without prefixkv (with a DynamicCache) for this model"


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedModelError`, naming the family and the reason, unless prefixkv can cache
    ``model`` exactly. Does not mutate."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no `config`; pass a transformers causal LM")
    name = family(model)
    reason = _refusal(model, config)
    if reason is not None:
        raise UnsupportedModelError(f"{name} {reason}{REFUSAL_ADVICE}")


def _length_dependent_rope(config: Any) -> str | None:
    """The config's length-dependent rope type, if any (``rope_parameters`` may hold one dict per layer kind)."""
    found: list[Any] = []
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        if isinstance(params, dict):
            nested = [v for v in params.values() if isinstance(v, dict)]
            for p in [params, *nested]:
                found += [p.get("rope_type"), p.get("type")]
    return next((t for t in found if t in _LENGTH_DEPENDENT_ROPE), None)


def _refusal(model: Any, config: Any) -> str | None:
    """Why ``model`` cannot be cached, or ``None``. Checks run from the broadest reason to the narrowest."""
    if getattr(config, "is_encoder_decoder", False):
        return (
            "is an encoder-decoder model, whose decoder also attends to the encoder's output; "
            "prefixkv caches decoder-only causal LMs only"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    supports_cache = getattr(model, "_supports_default_dynamic_cache", None)
    own_cache = supports_cache is not None and not supports_cache()
    if kinds.layer_kinds(text) is not None and not own_cache and _calls_state_layers(model):
        return _common_refusal(model, text)  # recurrent layers that transformers' own cache layers hold
    layer_types = list(getattr(text, "layer_types", None) or [])
    stateful = getattr(model, "_is_stateful", False) or any(getattr(text, f, None) is not None for f in _STATE_FIELDS)
    if stateful or set(layer_types) & _STATE_LAYER_TYPES or own_cache:
        return (
            "has state-space, linear-attention or recurrent layers whose state it keeps its own way (a cache of its "
            "own, or state held in its modules) rather than in transformers' cache layers (LinearAttentionLayer, which "
            "prefixkv serves from transformers 5 on), so prefixkv cannot share or resume a prefix of it"
        )
    no_kv = sorted(set(layer_types) & _NO_KV_LAYER_TYPES)
    if no_kv:
        return f"has layers of kind {no_kv} without attention of their own; prefixkv needs K/V in every layer"
    unknown = sorted(set(layer_types) - KV_LAYER_TYPES)
    if unknown:
        return (
            f"has layers of kind {unknown}; prefixkv caches only {sorted(KV_LAYER_TYPES)} layers "
            "(attention over per-token K/V)"
        )
    if "reuse" in (getattr(text, "kv_sharing_modes", None) or []) or getattr(text, "num_kv_shared_layers", None):
        return "has layers that reuse the K/V of other layers; prefixkv keeps K/V for every layer itself"
    if getattr(text, "kv_lora_rank", None) is not None:
        return (
            "uses multi-head latent attention (MLA), whose cache is a compressed latent, "
            "not K/V heads; not supported yet"
        )
    if getattr(text, "is_heterogeneous", False):
        return "has layers of different shapes (a per-layer config); prefixkv needs one KV shape for all layers"
    return _common_refusal(model, text)


def _calls_state_layers(model: Any) -> bool:
    """Whether ``model``'s modeling code hands its recurrent state to the cache (``update_conv_state``,
    ``update_recurrent_state``); a model whose config names recurrent layers but whose code keeps their state in its
    own modules (RecurrentGemma) does not. Read from the module's source: a model without weights is refused before
    any forward could show it. Does not mutate."""
    module = inspect.getmodule(type(transformers_model(model)))
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return "update_conv_state" in source or "update_recurrent_state" in source


def _common_refusal(model: Any, text: Any) -> str | None:
    """The refusals that hold for every layer kind, K/V or recurrent: a length-dependent rope, no cache at all,
    value heads of another size, attention to later tokens; ``None`` if none does. Does not mutate."""
    rope = _length_dependent_rope(text)
    if rope is not None:
        return (
            f"uses rope_type={rope!r}, whose rotary frequencies change with the length of each call, so a prefix "
            "gets other K/V in a call of another length and cannot be reused exactly"
        )
    if not set(CACHE_KWARGS) & set(inspect.signature(transformers_model(model).forward).parameters):
        return (
            "has no KV cache (its forward takes neither `cache` nor `past_key_values`: generate recomputes the whole "
            "sequence at every step), so there is nothing for prefixkv to keep"
        )
    head_dim = attention_shape(text).head_dim or None  # None: no attention heads (a Mamba model)
    for field, kind in (("v_head_dim", "value"), ("global_head_dim", "full-attention")):
        other = getattr(text, field, None)
        if other is not None and head_dim is not None and other != head_dim:
            return (
                f"has {kind} heads of size {other} ({field}) and key heads of size {head_dim}; "
                "prefixkv keeps K and V of one head size in every layer"
            )
    if _sees_later_tokens(model):
        return (
            "attends to later tokens (its attention over a prompt is not causal, as in an encoder family's model built "
            "without `is_decoder=True`), so a prefix's K/V depend on what follows it and cannot be reused"
        )
    return None


def _sees_later_tokens(model: Any) -> bool:
    """Whether ``model``'s outputs at a position change with a later token: two forwards that differ only in the last
    of 4 tokens, compared at the first 3 (in eval mode, without a cache, the random stream untouched). Proven on the
    model itself, whatever its config says: the models of encoder families (BERT, RoBERTa, ...) built as causal LMs
    attend both ways unless ``is_decoder=True``. ``False`` for a model without weights (the ``meta`` device) or
    whose forward cannot run on bare ids. Does not mutate."""
    model = transformers_model(model)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type == "meta" or weight.shape[0] < 8:
        return False
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 7]], device=weight.device)
    try:
        with eval_mode(model), torch.random.fork_rng(devices=[]), torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    except Exception:
        return False
    return not torch.equal(logits[0, :3], logits[1, :3])


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """``model`` in eval mode inside the block (dropout would make two forwards differ, LayerDrop would skip layers),
    each module's own mode given back after (a frozen part stays in eval mode). Mutates the modes only inside the
    block."""
    modes = {module: module.training for module in model.modules()}
    try:
        for module in modes:
            module.training = False
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def state_option_refusal(model: Any, *, invariant: bool, offload: bool, kv_dtype: str | None) -> str | None:
    """Why a store of ``model`` cannot take these options when the model has recurrent layers
    (:func:`prefixkv.hf.kinds.layer_kinds`), or ``None``. Their state snapshots live in memory at token positions:
    an invariant store's canonical chunks, the second tier and 8-bit K/V are not carried for them yet. Does not
    mutate."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if text is None or kinds.layer_kinds(text) is None:
        return None
    options = (("invariant=True/chunk_size", invariant), ("offload/offload_dir", offload), ("kv_dtype", kv_dtype))
    asked = [name for name, on in options if on]
    if not asked:
        return None
    return (
        f"{family(model)} has recurrent layers (linear attention, Mamba or short convolutions), whose state snapshots "
        f"prefixkv keeps in memory only; {', '.join(asked)} {'is' if len(asked) == 1 else 'are'} not supported for "
        "such models yet: build the PrefixStore without " + " and ".join(asked)
    )
