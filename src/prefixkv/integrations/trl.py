"""TRL integration: GRPO's and RLOO's generation without vLLM reuses each prompt's K/V across its
``num_generations`` completions (docs/integrations.md, "TRL").

Without vLLM, TRL generates with ``unwrapped_model.generate(input_ids, attention_mask, generation_config=...)``,
every prompt repeated ``num_generations`` times in one left-padded batch, under ``torch.no_grad()`` with gradient
checkpointing switched off, but with the model still in training mode. prefixkv prefills a prompt repeated in a
batch once; what stops plain :func:`prefixkv.enable` here is training mode, in which prefixkv neither reuses nor
publishes K/V (dropout makes them random). :func:`enable` runs each of those ``generate`` calls in eval mode when
nothing in the model is random in training mode (every dropout probability is 0, no router jitter), which computes
exactly what training mode computes; the weights change at every optimizer step, and the store keys K/V by the
weights (docs/correctness.md, "Adapters and changed weights"), so a step never reuses K/V of the weights before.
Needs ``pip install -e '.[trl]'`` in the clone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..enabling import disable as _disable_model
from ..enabling import enable as _enable_model
from ..patching import MethodPatch, bound_to_copies
from ..store import PrefixStore

_PATCH = "_prefixkv_trl_patch"


def random_in_training(model: torch.nn.Module) -> str | None:
    """What in ``model`` is random in training mode, or ``None``: a dropout module with ``p > 0`` (LoRA's
    ``lora_dropout`` included), a module's own dropout probability (attention modules keep it as a float:
    ``attention_dropout``), or MoE router jitter (``router_jitter_noise``). Does not mutate."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                return f"{name or type(module).__name__} (dropout p={module.p})"
            continue
        for attribute, value in vars(module).items():
            if "dropout" in attribute and isinstance(value, float) and value > 0:
                return f"{name or type(module).__name__}.{attribute}={value}"
    jitter = getattr(getattr(model, "config", None), "router_jitter_noise", None)
    if isinstance(jitter, float) and jitter > 0:
        return f"router_jitter_noise={jitter}"
    return None


def enable(trainer: Any, store: PrefixStore | None = None, **store_kwargs: Any) -> PrefixStore:
    """Prefix reuse for the completions a TRL ``GRPOTrainer`` or ``RLOOTrainer`` generates without vLLM: call it
    after building the trainer, before ``trainer.train()``. Patches the policy model's ``generate``
    (:func:`prefixkv.enable`, with ``store`` or one built with ``store_kwargs``), and runs each call in eval mode
    when :func:`random_in_training` finds nothing random (else in training mode, stock, with a warning: pass
    ``disable_dropout=True`` to the trainer's config). Raises ``ValueError`` where TRL's generation does not go
    through ``model.generate`` (vLLM, continuous batching) or turns the cache off (``use_cache=False``, a
    ``cache_implementation``). Returns the store; :func:`disable` undoes it. Mutates the model."""
    args = trainer.args
    if getattr(args, "use_vllm", False):
        raise ValueError(
            "this trainer generates with vLLM (use_vllm=True), not model.generate: prefixkv has nothing to serve; "
            "set use_vllm=False to generate with transformers, or do not enable prefixkv"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(
            "this trainer generates with transformers' continuous batching (generate_batch), which keeps its own "
            "paged cache and not prefixkv's: set use_transformers_continuous_batching=False to use prefixkv"
        )
    config = trainer.generation_config
    if config.use_cache is False or config.cache_implementation is not None:
        raise ValueError(
            f"this trainer's generation runs with use_cache={config.use_cache}, "
            f"cache_implementation={config.cache_implementation!r}: generate then takes no prefixkv cache; "
            "drop both from the trainer's config (generation_kwargs, cache_implementation) to reuse prefixes"
        )
    model = trainer.model
    target = _enable_model(model, store, **store_kwargs)
    generate = bound_to_copies(_generate_untrained, model, model.generate)
    setattr(model, _PATCH, MethodPatch(model, "generate", generate))
    return target


def _generate_untrained(model: torch.nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``original`` (the enabled ``generate``) in eval mode if ``model`` is in training mode and nothing in it
    is random there; every module's mode is restored afterwards. Mutates the modes during the call."""
    if not model.training:
        return original(*args, **kwargs)
    random = random_in_training(model)
    if random is not None:
        warnings.warn(
            f"prefixkv: {random} is random in training mode, so this generate call reuses no cached prefix; "
            "build the trainer with disable_dropout=True in its config to reuse them",
            stacklevel=2,
        )
        return original(*args, **kwargs)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        return original(*args, **kwargs)
    finally:
        for module, mode in modes:
            module.training = mode


def disable(trainer: Any) -> None:
    """Undo :func:`enable`: the policy model's ``generate`` is TRL's again, and a store that :func:`enable` built
    is closed. Does nothing if it is not enabled. Mutates."""
    model = trainer.model
    patch: MethodPatch | None = model.__dict__.pop(_PATCH, None)
    if patch is None:
        return
    patch.remove()
    _disable_model(model)
