"""The ``prefixkv`` attention implementation, registered with transformers' ``AttentionInterface``
and, for its masks, ``AttentionMaskInterface``, and the checks of what reading the pool serves.

The store switches a model whose implementation is ``sdpa`` to it and back (``PrefixStore.close``). In a
forward with a ``PagedPrefixCache`` whose pool is on a device of :data:`READ_DEVICES` (the CPU), ``update``
writes only the new K/V and this attention reads every row's held K/V where they sit in the pool, from the
forward's read plan (:class:`prefixkv.attention.reads.ForwardReads`) that arrives on the K tensor ``update`` hands out
(the ``"blocks"`` backend, :func:`prefixkv.attention.blocks.blocks_attention`: views of runs of blocks, one gather of
scattered ones, blocks shared by several rows read once for all of them), merging the parts by their log-sum-exp;
the model's own mask decides what each query sees. Everything else (calls without such a cache, a first forward that
checks every layer reaches this attention, dropout, position bias, CUDA pools, quantized pools: the ``"gather"``
backend) runs the original ``sdpa`` on whole rows, which ``update`` gathers. ``PrefixStore(attention="flex")`` reads
the pool in place through torch's FlexAttention instead (:class:`~prefixkv.attention.flex.FlexBackend`,
registered with :func:`prefixkv.attention.registry.provide` by that module), on the CPU and CUDA alike. A model on
``eager`` (whose eager code may be its own, e.g. soft-capping), or whose attention does not go through
``AttentionInterface`` (Falcon, Bloom), keeps its implementation and is served through ``update`` alone.
docs/architectures.md lists the path of each family.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..compat.patching import SharedPatch, register
from . import kernels, reads
from .reads import AttentionCall, ForwardReads
from .static import STEP_KWARG

NAME = "prefixkv"
_BASE = "_prefixkv_base_attn"
# the switch to this attention, shared by every store on a model; a deep copy of the model carries the switch, not
# its users
_SWITCH = SharedPatch("_prefixkv_attention_users")


_F = TypeVar("_F", bound=Callable[..., Any])


def outside_compile(function: _F) -> _F:
    """``function`` run eagerly inside a ``torch.compile``d model: prefixkv's bookkeeping (a thread id, a lock, block
    tables, ints that change every step) would break graphs and recompile there (docs/faq.md, torch.compile)."""
    return cast(_F, torch.compiler.disable(function))


def _base(config: Any) -> str:
    return getattr(config, _BASE, None) or "sdpa"


def prefixkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``prefixkv`` attention: :func:`paged_attention`, outside any graph, for a ``key`` that a
    ``PagedPrefixCache``'s ``update`` handed out with its forward's read plan (:data:`prefixkv.attention.reads.TAG`);
    otherwise the model's own implementation, traced into the graph of a compile: in a compiled decode step (the
    store's hook passed :data:`STEP_KWARG`; ``key`` and ``value`` are every row's K/V over the step's bucket,
    :mod:`prefixkv.attention.static`), and in every call without such a cache, which then compiles as it does
    without a store (no graph break: dynamo reads the tensor's attribute and guards on it)."""
    if kwargs.pop(STEP_KWARG, False) or getattr(key, reads.TAG, None) is None:
        fn = ALL_ATTENTION_FUNCTIONS[_base(module.config)]
        own: tuple[torch.Tensor, torch.Tensor | None] = fn(module, query, key, value, attention_mask, **kwargs)
        return own
    # eagerly, the call itself: torch.compiler.disable's wrapper costs a few microseconds in every layer of a step
    attend = paged_attention if torch.compiler.is_compiling() else eager_paged_attention
    return attend(module, query, key, value, attention_mask, **kwargs)


def eager_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over the blocks of the ``PagedPrefixCache`` of this forward, when ``key`` is what the cache's
    ``update`` handed out for this layer (it carries the forward's read plan,
    :data:`prefixkv.attention.reads.TAG`) and the
    plan's backend serves the call; otherwise, or for what reading the blocks does not implement (soft-capping,
    attention sinks, dropout), the implementation the model had before the store switched it, on every row's
    whole K/V."""
    found: tuple[ForwardReads, int] | None = getattr(key, reads.TAG, None)
    if found is not None:
        forward, layer = found
        forward.served.add(layer)
        if forward.probe:  # only a probe forward hands out watched K/V
            key, value = reads.unwatched(key), reads.unwatched(value)
        backend = forward.backend
        if forward.in_place and backend is not None:
            call = AttentionCall(module, query, key, value, attention_mask, kwargs)
            # a query per new column, as the plan is made; a layer that reads another's K/V may attend fewer
            # (Gemma 4's KV-shared layers attend only a prompt's last position): whole rows
            if query.shape[-2] == key.shape[-2] and backend.servable(forward, call):
                return backend.attend(forward, layer, call), None
            key, value = forward.gather(layer)
        elif forward.canonical:
            if canonical_servable(module, query, attention_mask, kwargs, forward):
                return kernels.whole_rows_attention(
                    query, key, value, attention_mask, kwargs.get("scaling"), forward
                ), None
            if key.shape[0] == 1:  # a lone row's view of the pool (Reader._gather) as the copy it stands for
                key, value = key.contiguous(), value.contiguous()
    fn = ALL_ATTENTION_FUNCTIONS[_base(module.config)]
    out: tuple[torch.Tensor, torch.Tensor | None] = fn(module, query, key, value, attention_mask, **kwargs)
    return out


paged_attention = outside_compile(eager_paged_attention)
"""What a compiled model's call of this attention runs (:func:`eager_paged_attention`), outside the graph."""


def sdpa_servable(
    module: torch.nn.Module,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    forward: ForwardReads,
) -> bool:
    """Whether :func:`prefixkv.attention.blocks.blocks_attention` computes what transformers' ``sdpa`` attention
    (the only implementation the store switches from) would for this call: no dropout, no position bias, causal,
    and a mask that is ``None`` or boolean over the forward's columns. Other arguments ``sdpa`` ignores, and so
    does this."""
    if kwargs.get("dropout") or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    causal = kwargs.get("is_causal")
    if not (causal if causal is not None else getattr(module, "is_causal", True)):
        return False
    if mask is None:
        return True
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] in (1, query.shape[0])
        and mask.shape[1] == 1
        and mask.shape[2] == query.shape[2]
        and mask.shape[3] == forward.columns
    )


def canonical_servable(
    module: torch.nn.Module,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    forward: ForwardReads,
) -> bool:
    """Whether :func:`prefixkv.attention.kernels.whole_rows_attention` serves a call of an invariant store's
    canonical read (whole rows, in logical order): what :func:`sdpa_servable` admits, on a device whose pools
    attention reads in place (the CPU's flash kernel reads grouped heads; elsewhere the model's own attention runs,
    as it always did)."""
    return query.device.type in READ_DEVICES and sdpa_servable(module, query, mask, kwargs, forward)


def prefixkv_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask of the original implementation (a mask for every registered attention name, rule 5)."""
    config = kwargs.get("config")
    return ALL_MASK_ATTENTION_FUNCTIONS[_base(config)](*args, **kwargs)


register(AttentionInterface, NAME, prefixkv_attention_forward)
register(AttentionMaskInterface, NAME, prefixkv_mask)


def install(model: Any) -> bool:
    """Switch ``model`` to ``prefixkv`` attention if it uses ``sdpa`` through ``AttentionInterface``; count
    the stores using it (one :class:`prefixkv.compat.patching.SharedPatch`, as every change prefixkv shares on a model).
    Mutates the model's config. Returns whether the model runs ``prefixkv`` attention.

    Models whose attention code does not look its function up by name (Falcon, Bloom: transformers'
    ``is_backend_compatible()`` is false) keep their implementation and are served through ``update``."""
    if not can_install(model):
        return False
    _SWITCH.join(model, lambda: _switch(model))
    return True


def can_install(model: Any) -> bool:
    """Whether :func:`install` switches ``model`` to ``prefixkv`` attention (or finds it there): a model on ``sdpa``
    through ``AttentionInterface``. What a store's choice of backend reads before it installs anything. Does not
    mutate."""
    current = model.config._attn_implementation
    if _INDEXED in (getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()):
        return False
    return bool(current == NAME or (current == "sdpa" and model.is_backend_compatible()))


# DeepSeek sparse attention's layers: they fold their indexer's choice of tokens into the mask only under "eager" and
# "sdpa" and hand any other implementation the raw indices (a sparse kernel's), which prefixkv's attention does not
# read; such a model keeps its implementation, served through ``update``
_INDEXED = "indexed_attention"


def _switch(model: Any) -> Callable[[], None]:
    """Switch ``model`` to ``prefixkv`` attention, unless it runs it already (a deep copy of a model with a store
    carries the switch), and return what switches it back. Mutates the model's config."""
    config = model.config
    before = _implementations(config)
    if config._attn_implementation != NAME:
        setattr(config, _BASE, config._attn_implementation)
        model.set_attn_implementation(NAME)
    return functools.partial(_switch_back, model, before)  # a partial: a deep copy's switches the copy back


def _switch_back(model: Any, before: str | dict[str, Any]) -> None:
    model.set_attn_implementation(before if isinstance(before, dict) else _base(model.config))


def _implementations(config: Any) -> str | dict[str, Any]:
    """``config``'s attention implementation and its sub-configs', as ``set_attn_implementation`` takes them: the name
    where every sub-config has it (or none), else by sub-config name (``""``: the config's own). A multimodal model's
    tower may run another (Gemma 4's audio tower: ``eager``, which has no ``sdpa``), and the switch back gives each
    its own. Does not mutate."""
    own: str = config._attn_implementation
    subs = {key: _implementations(sub) for key in config.sub_configs if (sub := getattr(config, key, None)) is not None}
    subs = {key: own if sub is None else sub for key, sub in subs.items()}  # unset: it takes the model's, as before
    if all(sub == own for sub in subs.values()):
        return own
    return {"": own, **subs}


def uninstall(model: Any) -> None:
    """Undo one :func:`install`; the last store to leave restores the original implementation and leaves no
    trace on the model (prefixkv.disable restores it exactly). Mutates the model's config."""
    if _SWITCH.held(model):
        _SWITCH.leave(model)


# device types whose pools attention reads in place. On CUDA, reading row by row costs a kernel launch per part
# and row, which an H200 showed 4-6x slower than one gather and one batched kernel at batch 8 (docs/benchmarks.md);
# a paged kernel is what reads blocks in place there
READ_DEVICES = frozenset({"cpu"})

# models whose every attention layer was seen to hand the K/V from ``update`` to this attention unchanged
_VERIFIED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def serves(model: Any) -> bool:
    """Whether ``model`` runs ``prefixkv`` attention (so a cache may hand it only the new K/V)."""
    return getattr(model.config, "_attn_implementation", None) == NAME


def verified(model: Any) -> bool:
    """Whether a forward of ``model`` was seen to pass every layer's K/V from the cache to this attention."""
    return _VERIFIED.get(model, False)


def mark_verified(model: Any) -> None:
    """Note that a forward of ``model`` passed every layer's K/V from the cache to this attention. Mutates."""
    _VERIFIED[model] = True
