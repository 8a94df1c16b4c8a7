"""What model wrote a file of K/V: a fingerprint of its weights, config and adapters, and the config's state
(the fields that change K/V). Saved files (:mod:`prefixkv.kv.prefix_file`) carry the fingerprint; the key space
(:mod:`prefixkv.kv.key_space`) keys K/V by the config's state."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from ..base.errors import PersistError
from .ranks import local_part

_SAMPLE = 16384  # values hashed per tensor: enough to tell checkpoints apart, cheap for 70B models


# -- the model -------------------------------------------------------------------------------


def fingerprint(model: Any, *, adapters: bool = True) -> str:
    """A sha256 that tells models apart by what shapes their K/V: every parameter's name, dtype,
    shape and a fixed strided sample of its values (all of them for tensors up to 16384 values), the
    config (:func:`config_state`: every field but those that cannot change K/V) and, with ``adapters``, the
    active adapters. Deterministic across processes, devices and accelerate layouts (offloaded weights are read
    from accelerate's weights map). Does not mutate.

    >>> import prefixkv
    >>> fingerprint(prefixkv.models.tiny_model(seed=0)) == fingerprint(prefixkv.models.tiny_model(seed=0))
    True
    """
    digest = hashlib.sha256()
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights may come apart under offload
    for name in sorted(params):
        tensor = params[name]
        if tensor.device.type == "meta":
            tensor = _offloaded_tensor(model, name)
        tensor = local_part(tensor)  # a split model's process: its own shard, which its K/V come from
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor_bytes(_sample(tensor.detach())))
    digest.update(config_state(model.config).encode())
    if adapters:
        digest.update(_adapter_state(model).encode())
    return digest.hexdigest()


# config fields that cannot change K/V: names, bookkeeping, token ids, output switches and generation settings
# (the weights themselves are hashed; ``_``-prefixed fields are private state, such as the attention function)
_CONFIG_NEUTRAL = frozenset(
    {
        "name_or_path",
        "architectures",
        "transformers_version",
        "model_type",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        "initializer_range",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "return_dict_in_generate",
        "tie_word_embeddings",
        "chunk_size_feed_forward",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)


def config_state(config: Any) -> str:
    """The config as JSON, every field but those in ``_CONFIG_NEUTRAL`` and private ones, sub-configs too: what
    of a config can change K/V (a sliding window, a norm's epsilon, an attention multiplier, rotary settings).
    Deterministic across processes. Does not mutate.

    >>> import prefixkv
    >>> a, b = prefixkv.models.tiny_config("llama"), prefixkv.models.tiny_config("llama", rms_norm_eps=0.1)
    >>> config_state(a) == config_state(prefixkv.models.tiny_config("llama")), config_state(a) == config_state(b)
    (True, False)
    """

    def kept(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: kept(v) for k, v in value.items() if k not in _CONFIG_NEUTRAL and not k.startswith("_")}
        return value

    return json.dumps(kept(config.to_dict()), sort_keys=True, default=str)


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """Every value of a small tensor; ``_SAMPLE`` values at a fixed stride (and the last) of a large one."""
    flat = tensor.reshape(-1)
    if flat.numel() <= _SAMPLE:
        return flat.cpu()
    stride = flat.numel() // _SAMPLE
    index = torch.cat([torch.arange(_SAMPLE) * stride, torch.tensor([flat.numel() - 1])]).to(flat.device)
    return flat.index_select(0, index).cpu()


def _offloaded_tensor(model: Any, name: str) -> torch.Tensor:
    """The value of a parameter that accelerate offloaded (to CPU or disk), from the weights map of the
    hook on its module or on an ancestor that places its submodules."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        module = model.get_submodule(".".join(parts[:cut]))
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            weights = getattr(h, "weights_map", None)
            if getattr(h, "offload", False) and weights is not None:
                try:
                    value: torch.Tensor = weights[".".join(parts[cut:])]
                except KeyError:
                    continue
                return value
    raise PersistError(
        f"parameter {name} is on the meta device and no accelerate hook holds its value; "
        "prefixkv cannot fingerprint a model whose weights are not loaded"
    )


def tuner_layers(model: Any) -> list[Any]:
    """The PEFT adapter layers inside ``model`` (LoRA and the other tuners, peft's ``BaseTunerLayer``; ``[]``
    without peft): the one way prefixkv finds them, for the fingerprint and the key space. A ``PeftModel`` itself
    is not one (its ``disable_adapters`` is transformers' method, not a state). Does not mutate."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def active_adapters(layer: Any) -> list[str]:
    """The names of the PEFT adapters active on ``layer`` (a tuner layer's ``active_adapter``: one name or a
    list; what peft's ``BaseTunerLayer.active_adapters`` reads)."""
    active = layer.active_adapter
    return [active] if isinstance(active, str) else list(active)


# the adapters' state of a model: the names of the active ones, whether they are disabled, the merged ones (a plain
# tuple: the second tier keys its files by its repr)
Adapters = tuple[tuple[str, ...], bool, tuple[str, ...]]


def adapter_space(tuners: Sequence[Any]) -> Adapters | None:
    """What the adapters of ``tuners`` (:func:`tuner_layers`) make of the K/V a model computes now
    (docs/correctness.md, "Adapters and changed weights"): ``None`` without adapters, else which adapters are
    active, whether they are disabled, and which are merged into the weights (read from the first layer). The
    key space keys K/V by it, and the fingerprint of a file records it. Does not mutate."""
    if not tuners:
        return None
    layer = tuners[0]
    return (tuple(active_adapters(layer)), bool(layer.disable_adapters), tuple(getattr(layer, "merged_adapters", ())))


def _adapter_state(model: Any) -> str:
    """The adapters' part of the fingerprint (:func:`adapter_space`), or ``""`` without any. It names ``merged``
    so that a file of a PEFT model saved when this part read the wrapper itself (always "disabled") matches no
    model and is refused (docs/persistence.md)."""
    space = adapter_space(tuner_layers(model))
    if space is None:
        return ""
    active, disabled, merged = space
    return json.dumps({"active": list(active), "disabled": disabled, "merged": list(merged)})


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s values (on the CPU, contiguous; empty for an empty tensor). Does not mutate."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
