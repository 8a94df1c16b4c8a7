"""Which models prefixkv can cache exactly, decided when a ``PrefixStore`` is built.

prefixkv keeps, per attention layer, one K and one V vector per token, each of the shape that layer hands its
cache (``[kv_heads, num_blocks, block_size, head_dim]``, K and V apart: multi-head latent attention, value heads of
another size, layers of different sizes; docs/architectures.md, "Latent attention and mixed shapes"), and reuses a
prefix by handing those back. A model is supported when that is all its cache holds: every layer attends with full,
sliding-window or chunked attention over per-token K/V, or reads the K/V of an earlier layer (KV sharing).
Everything else is refused with the family and the reason (docs/architectures.md, "Refused families"), never served
with wrong output; that page lists the families.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from ..base.errors import UnsupportedModelError
from ..base.family import family
from ..compat.releases import CACHE_KWARGS
from ..kv.key_space import transformers_model
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
    own = _cache_of_its_own(model, text)
    if own is not None:
        return own
    supports_cache = getattr(model, "_supports_default_dynamic_cache", None)
    own_cache = supports_cache is not None and not supports_cache()
    found = kinds.layer_kinds(text)
    if found is not None and not own_cache and (not kinds.stateful(found) or _calls_state_layers(model)):
        return _common_refusal(model, text)  # registered kinds (recurrent layers: transformers' cache layers hold them)
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
    attention to later tokens; ``None`` if none does. Does not mutate."""
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
    if _sees_later_tokens(model):
        return (
            "attends to later tokens (its attention over a prompt is not causal, as in an encoder family's model built "
            "without `is_decoder=True`), so a prefix's K/V depend on what follows it and cannot be reused"
        )
    return None


# -- families whose cache is neither per-token K/V nor a transformers state layer: what each keeps instead ---------

_COMPRESSED_LAYER_TYPES = frozenset({"compressed_sparse_attention", "heavily_compressed_attention"})
# what a model's forward argument of its own carries from step to step, in place of a cache
_OWN_STATE_ARGUMENTS = {
    "state": "its recurrent state (per-layer tensors that generate passes from step to step)",
    "mems": "its memory (each layer's hidden states of earlier tokens, from which it attends)",
    "past_buckets_states": "each layer's hash buckets and hidden states of earlier tokens",
}


def _cache_of_its_own(model: Any, text: Any) -> str | None:
    """Why a family whose cache holds something prefixkv's cannot (it says what) is refused, or ``None``: RWKV's
    ``state``, XLNet's ``mems`` and Reformer's ``past_buckets_states`` arguments, MiniMax's own cache class,
    DeepSeek-V4's compressors, DeepSeek Sparse Attention's indexer. Does not mutate."""
    forward = inspect.signature(transformers_model(model).forward).parameters
    own = [name for name in _OWN_STATE_ARGUMENTS if name in forward]
    if own and not set(CACHE_KWARGS) & set(forward):
        return (
            f"carries {_OWN_STATE_ARGUMENTS[own[0]]} in a `{own[0]}` argument of its own, not in a transformers Cache, "
            "so there is no cache that prefixkv's could stand in for"
        )
    if getattr(text, "model_type", None) == "minimax":
        return (
            "accepts no cache but its own MiniMaxCache (its forward raises ValueError for any other): its "
            "lightning-attention layers keep a running key-value product per layer there, which prefixkv's cache "
            "does not hold"
        )
    layer_types = set(getattr(text, "layer_types", None) or [])
    compressed = sorted(layer_types & _COMPRESSED_LAYER_TYPES)
    if compressed:
        rates = getattr(text, "compress_rates", None) or {}
        every = ", ".join(f"{rates[kind]} ({kind})" for kind in compressed if kind in rates)
        return (
            f"has compressed-attention layers {compressed} whose cache holds, besides a sliding window of K/V, a "
            f"compressor's running entries (one per {every or 'several'} tokens) and the tokens not yet compressed: "
            "not one K/V vector per token, so prefixkv cannot share or resume a prefix of it"
        )
    if "indexed_attention" in layer_types:
        return (
            "has DeepSeek Sparse Attention layers ('indexed_attention'): a lightning indexer keeps keys of its own per "
            f"token in the cache (`update_indexer`) to pick the {getattr(text, 'index_topk', 'top-k')} earlier tokens "
            "each query attends to; prefixkv's cache keeps K/V only, with no indexer keys"
        )
    return None


def _sees_later_tokens(model: Any) -> bool:
    """Whether ``model``'s outputs at a position change with a later token: two forwards that differ only in the last
    of 4 tokens, compared at the first 3 (in eval mode, without a cache, the random stream untouched). Proven on the
    model itself, whatever its config says: the models of encoder families (BERT, RoBERTa, ...) built as causal LMs
    attend both ways unless ``is_decoder=True``. A change counts when it passes :data:`_LATER_TOKEN_SHARE` of the
    change at the last position itself: a mixture of experts groups the batch's tokens by expert, so rounding moves
    a causal model's earlier rows (DBRX: 4e-16 of 0.7 in float64; Mixtral, Qwen3-MoE: ~1e-7 in float32 when each
    input runs alone), where an encoder's earlier rows move by 0.5% to 30% of it. ``False`` for a model without
    weights (the ``meta`` device) or whose forward cannot run on bare ids. Does not mutate."""
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
    share = _LATER_TOKEN_SHARE.get(logits.dtype, _LATER_TOKEN_SHARE[None])
    earlier, last = (logits[0] - logits[1]).double().abs().amax(dim=-1).split([3, 1])  # [3], [1]
    return bool(earlier.max() > share * last.max())


# how much of the change at the changed position an earlier position must show to count as attention to later
# tokens, by the logits' dtype (causal models' rounding: 4e-16 of it in float64, at most 3e-7 in float32; encoders: at
# least 5e-3, in float64, float32 and bfloat16): in float64 a leak far under the fidelity bound of 1e-6 still counts
_LATER_TOKEN_SHARE: dict[torch.dtype | None, float] = {torch.float64: 1e-9, None: 1e-4}


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
    if text is None or not kinds.stateful(kinds.layer_kinds(text)):
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
