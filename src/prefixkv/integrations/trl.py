"""TRL integration: GRPO's and RLOO's generation without vLLM reuses each prompt's K/V across its
``num_generations`` completions (docs/integrations.md, "TRL").

Without vLLM, TRL generates with ``unwrapped_model.generate(input_ids, attention_mask, generation_config=...)``,
every prompt repeated ``num_generations`` times in one left-padded batch, under ``torch.no_grad()`` with gradient
checkpointing switched off, but with the model still in training mode. prefixkv prefills a prompt repeated in a
batch once; what stops plain :func:`prefixkv.enable` here is training mode, in which prefixkv neither reuses nor
publishes K/V (dropout makes them random). :func:`enable` runs each of those ``generate`` calls in eval mode when
nothing in the model is random in training mode (every dropout probability is 0, no LayerDrop, no router jitter),
which computes exactly what training mode computes, and otherwise as TRL runs it; with the trainer's mixed precision
(``bf16=True``, GRPOConfig's default) entered around the call, so the cache is keyed by the autocast that
computes its K/V (docs/correctness.md, "Autocast"). The weights change at every optimizer step, and the store keys
K/V by the weights (docs/correctness.md, "Adapters and changed weights"), so a step never reuses K/V of the weights
before.
Needs ``pip install -e '.[trl]'`` in the clone.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..compat.patching import MethodPatch, bound_to_copies
from ..enabling import disable as _disable_model
from ..enabling import enable as _enable_model
from ..store.prefix_store import PrefixStore

_PATCH = "_prefixkv_trl_patch"
# float attributes of a module that make training mode random: dropout probabilities (``attention_dropout``,
# ``hidden_dropout``), LayerDrop (``layerdrop``), stochastic depth (``drop_path``), MoE router jitter (``jitter_noise``)
_RANDOM_WORDS = ("drop", "jitter")


class Random(NamedTuple):
    """What is random in training mode (``what``: where, and its value) and what makes it not (``remedy``)."""

    what: str
    remedy: str


def random_in_training(model: torch.nn.Module) -> str | None:
    """What in ``model`` is random in training mode, or ``None``: a dropout module with ``p > 0`` (LoRA's
    ``lora_dropout`` included), or a module's own float attribute that makes it random there (a dropout
    probability such as ``attention_dropout``, ``layerdrop``, ``drop_path``, MoE router jitter such as
    ``jitter_noise``). Does not mutate."""
    found = _randomness(model)
    return None if found is None else found.what


def _randomness(model: torch.nn.Module) -> Random | None:
    """:func:`random_in_training`, with what makes it not random. Does not mutate."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            if module.p > 0:
                what = f"{name or type(module).__name__} (dropout p={module.p})"
                return Random(what, "build the trainer with disable_dropout=True in its config (GRPOConfig)")
            continue
        for attribute, value in vars(module).items():
            if any(w in attribute for w in _RANDOM_WORDS) and isinstance(value, float) and value > 0:
                return Random(f"{name or type(module).__name__}.{attribute}={value}", _remedy(model, attribute, value))
    return None


def _remedy(model: torch.nn.Module, attribute: str, value: float) -> str:
    """How to set a module's float ``attribute`` (of ``value``) to 0: by the config field it was built from, the
    one whose name ends with it (``router_jitter_noise`` for ``jitter_noise``) or contains its last word, of the
    same value; else on the modules themselves. Does not mutate."""
    config = getattr(model, "config", None)
    fields = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    last = attribute.rsplit("_", 1)[-1]
    named = [k for k, v in fields.items() if v == value and (k.endswith(attribute) or last in k)]
    field = min(named, key=lambda k: (not k.endswith(attribute), len(k)), default=None)
    done = "TRL's disable_dropout=True leaves it as it is (it zeroes torch.nn.Dropout modules only)"
    if field is not None:
        return f"{done}: load the model with {field}=0.0 (from_pretrained(..., {field}=0.0))"
    return f"{done}: set {attribute} = 0.0 on every module that has it before building the trainer"


def enable(trainer: Any, store: PrefixStore | None = None, **store_kwargs: Any) -> PrefixStore:
    """Prefix reuse for the completions a TRL ``GRPOTrainer`` or ``RLOOTrainer`` generates without vLLM: call it
    after building the trainer, before ``trainer.train()``. Patches the policy model's ``generate``
    (:func:`prefixkv.enable`, with ``store`` or one built with ``store_kwargs``), and runs each call in eval mode
    when :func:`random_in_training` finds nothing random (else in training mode, stock, as TRL alone runs it, with
    a warning once that says what is random and how to make it not), under the trainer's mixed precision. Raises
    ``ValueError`` where TRL's generation does not go through ``model.generate`` (vLLM, continuous batching) or
    turns the cache off (``use_cache=False``, a ``cache_implementation``). Returns the store; :func:`disable`
    undoes it. Mutates the model."""
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
    accelerator = getattr(trainer, "accelerator", None)
    held = None if accelerator is None else weakref.ref(accelerator)
    setattr(model, _PATCH, _Adapter(MethodPatch(model, "generate", generate), set(), held))
    return target


class _Adapter(NamedTuple):
    """What :func:`enable` put on the policy model: the patch of its ``generate``, the warnings said once, and the
    trainer's accelerator (a weak reference: a copy of the model must not copy it), whose mixed precision
    (``bf16=True``, GRPOConfig's default) is an autocast that accelerate enters inside the model's forward."""

    patch: MethodPatch
    warned: set[str]
    accelerator: weakref.ref[Any] | None


def _mixed_precision(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The trainer's autocast (``accelerator.autocast()``), or none: entered around the whole ``generate`` call,
    so that the cache is planned and keyed under the autocast its K/V are computed in (docs/correctness.md,
    "Autocast"); inside the forward accelerate's own is then the same one, nested."""
    adapter: _Adapter | None = model.__dict__.get(_PATCH)
    accelerator = None if adapter is None or adapter.accelerator is None else adapter.accelerator()
    autocast = getattr(accelerator, "autocast", None)
    return autocast() if callable(autocast) else contextlib.nullcontext()


def _generate_untrained(model: torch.nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``original`` (the enabled ``generate``) in eval mode if ``model`` is in training mode and nothing in it
    is random there, under the trainer's mixed precision (:func:`_mixed_precision`); every module's mode is
    restored afterwards, whatever the call raises. Otherwise ``original`` as TRL calls it: in training mode it runs
    stock (:func:`prefixkv.enable`), after a warning, once per :func:`enable`, that says what is random and how to
    make it not. Mutates the modes during the call."""
    if not model.training:
        with _mixed_precision(model):
            return original(*args, **kwargs)
    random = _randomness(model)
    if random is not None:
        adapter: _Adapter | None = model.__dict__.get(_PATCH)
        if adapter is not None and random.what not in adapter.warned:
            adapter.warned.add(random.what)
            warnings.warn(
                f"prefixkv: {random.what} is random in training mode, so TRL's generate calls run stock, with no "
                f"prefix reuse; {random.remedy} to reuse prefixes",
                stacklevel=2,
            )
        return original(*args, **kwargs)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with _mixed_precision(model):
            return original(*args, **kwargs)
    finally:
        for module, mode in modes:
            module.training = mode


def disable(trainer: Any) -> None:
    """Undo :func:`enable`: the policy model's ``generate`` is TRL's again, and a store that :func:`enable` built
    is closed. Does nothing if it is not enabled. Mutates."""
    model = trainer.model
    adapter: _Adapter | None = model.__dict__.pop(_PATCH, None)
    if adapter is None:
        return
    adapter.patch.remove()
    _disable_model(model)
