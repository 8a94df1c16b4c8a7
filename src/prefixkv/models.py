"""Embedded models built from configs with random weights: what the demo, the benchmarks and the
tests run on, with no download. Real checkpoints are loaded only from a local path (``load_local``)."""

from __future__ import annotations

from typing import Any

import torch
import transformers

# family -> (config class name, overrides for a tiny 2-layer model, hidden 64)
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": 24}),
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


def families() -> list[str]:
    """The families ``tiny_model`` can build."""
    return sorted(_TINY)


def tiny_config(family: str, **overrides: Any) -> Any:
    """A 2-layer, hidden-64 config of ``family`` (see :func:`families`)."""
    if family not in _TINY:
        raise ValueError(f"unknown family {family!r}; choose one of {families()}")
    cls_name, extra = _TINY[family]
    kwargs = {**_COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def build(config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str = "sdpa") -> Any:
    """A causal LM from ``config`` with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def tiny_model(
    family: str = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> Any:
    """A tiny random-weight model of ``family``: what tests use.

    >>> tiny_model("qwen2").config.num_hidden_layers
    2
    """
    return build(tiny_config(family, **overrides), dtype=dtype, seed=seed, attn_implementation=attn_implementation)


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


def bench_model(*, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A ~100M-parameter Llama-shaped model (12 layers, hidden 768, 12 heads, 4 KV heads)."""
    config = tiny_config(
        "llama",
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    return build(config, dtype=dtype, seed=seed)


def load_local(path: str, *, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """Model and tokenizer from a local folder; never reaches a hub."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer
