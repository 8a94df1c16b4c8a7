"""What a model's layers hand its cache, read from the tensors themselves (docs/how-it-works.md, "Shapes come from
the tensors").

A config names heads and sizes in many ways (``num_key_value_heads``, ``multi_query``, ``dim_head``, a decoder's own
head count), and a model may use another field than the one a reader guesses: CPM-Ant's heads are ``dim_head`` wide,
not ``hidden_size / heads``; ProphetNet's decoder has ``num_decoder_attention_heads``. So a store does not size its
pool from the config: :func:`measure` runs the model on one token, then on two more that resume that cache, with a
cache that records every ``update``, and the pool takes the shapes the layers handed over. The same two forwards
prove what prefixkv's cache assumes of a model: each forward adds to each layer once, one column per id it is fed,
and a forward of several ids resumes a cache. A model that does otherwise (learned prompt tokens ahead of the ids,
the whole sequence fed every step, recurrent loops that write a layer twice) is refused with what it did, and so
is a decoder with cross-attention layers (Mllama), whose cache holds an image's K/V.

Each layer's K and V are measured apart (docs/architectures.md, "Latent attention and mixed shapes"): multi-head
latent attention hands ``update`` a latent and a rotary key of other sizes, one head each; MiMo's V heads are
narrower than its K heads; Gemma 4's full-attention layers are wider than its sliding ones. A layer that reads
another's K/V (Gemma 3n and 4's KV-shared layers, ``kv_sharing_modes`` ``"reuse"``) hands ``update`` nothing and
keeps no K/V of its own: it reads what its producer layer's ``update`` returned.

The config (:func:`prefixkv.base.memory.attention_shape`) is only an estimate, for ``kv_bytes_per_token`` before a model
exists and for a model that cannot run on ids alone (then the first forward's ``update`` checks the estimate and
names any difference).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from ..base.errors import UnsupportedModelError
from ..base.family import family
from ..base.memory import LayerShape
from ..compat.releases import forward_cache_kwarg
from . import kinds, vision
from .support import eval_mode


class _Update(NamedTuple):
    """One ``update`` call: the layer, the columns it adds, and the K and V shapes (heads, head size)."""

    layer: int
    columns: int
    key: tuple[int, int]
    value: tuple[int, int]


class _Recording(DynamicCache):
    """A ``DynamicCache`` that notes every ``update`` call (:class:`_Update`), per forward, and the layers that
    update a conv or recurrent state (built from ``config``: transformers' layers of each kind)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(**({} if config is None else {"config": config}))
        self.forwards: list[list[_Update]] = []
        self.stated: list[set[int]] = []

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.stated[-1].add(layer_idx)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        self.stated[-1].add(layer_idx)
        return super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = key_states.shape, value_states.shape
        self.forwards[-1].append(_Update(layer_idx, int(k[-2]), (int(k[1]), int(k[-1])), (int(v[1]), int(v[-1]))))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def measure(
    model: Any, estimate: list[LayerShape], device: torch.device, layer_kinds: list[str] | None = None
) -> list[LayerShape]:
    """Per layer that keeps K/V, its K and V shapes as the layer hands them over, from two forwards (one id, then two
    more that resume the cache) on ``device`` without gradients and with the random state restored (dropout draws
    nothing a later call would see); ``estimate`` (from the config) where the model does not run on ids alone. Raises
    :class:`UnsupportedModelError` when the layers do what prefixkv's cache cannot follow (the module's docstring).
    Does not mutate the model. With ``layer_kinds`` (:func:`prefixkv.hf.kinds.layer_kinds`, a model with recurrent
    layers) the forwards prove them: the layers that write K/V and those that update a state are the kinds'; a layer
    without K/V has :data:`NO_KV`."""
    _check_cross_attention(model)
    text = model.config.get_text_config(decoder=True) if layer_kinds is not None else None
    cache = _Recording(text)
    name = forward_cache_kwarg(model.forward)
    devices = [device] if device.type == "cuda" else []
    fed = (1, 2)
    with eval_mode(model), vision.rope_deltas_aside(model), torch.random.fork_rng(devices=devices), torch.no_grad():
        for n in fed:
            cache.forwards.append([])
            cache.stated.append(set())
            ids = torch.ones((1, n), dtype=torch.long, device=device)
            try:
                model(input_ids=ids, use_cache=True, **{name: cache})
            except Exception as e:
                if n == fed[0]:  # needs other inputs, or has no weights yet: the first forward checks the estimate
                    return estimate
                raise UnsupportedModelError(
                    f"{family(model)} fails on a forward of {n} ids that resumes its cache ({type(e).__name__}: "
                    f"{e}), which every reuse of a prefix does; generate without prefixkv (with a DynamicCache) for "
                    "this model"
                ) from e
    if layer_kinds is not None:
        for n, updates, stated in zip(fed, cache.forwards, cache.stated, strict=True):
            _check_kinds(model, layer_kinds, n, updates, stated)
        with eval_mode(model), vision.rope_deltas_aside(model), torch.random.fork_rng(devices=devices), torch.no_grad():
            _check_resumes(model, text, name, device)
            _PADDED[model] = _padded_states(model, text, name, device)
        written = {u.layer: LayerShape(u.key, u.value) for u in cache.forwards[0]}
        _check_steady(model, written, cache.forwards[1])
        return [written.get(i, NO_KV) for i in range(len(layer_kinds))]
    own = _own_kv_layers(model, len(estimate))
    for n, updates in zip(fed, cache.forwards, strict=True):
        _check_forward(model, own, n, updates)
    shapes = [LayerShape(u.key, u.value) for u in sorted(cache.forwards[0])]
    _check_steady(model, dict(enumerate(shapes)), cache.forwards[1])
    with eval_mode(model), vision.rope_deltas_aside(model), torch.random.fork_rng(devices=devices), torch.no_grad():
        _PADDED[model] = _padded_resumption(model, name, device)
    return shapes


NO_KV = LayerShape((0, 0), (0, 0))
"""The shape of a layer that keeps no K/V (a recurrent layer): an empty pool tensor."""


def _check_steady(model: Any, shapes: dict[int, LayerShape], resumed: list[_Update]) -> None:
    """Raise :class:`UnsupportedModelError` unless each layer hands the forward that resumes its cache K and V of the
    shapes it handed the first. Does not mutate."""
    for u in resumed:
        if shapes.get(u.layer) != (u.key, u.value):
            raise UnsupportedModelError(
                f"{family(model)}'s layer {u.layer} hands K {u.key} and V {u.value} (heads, head size) in a forward "
                f"that resumes its cache, {shapes.get(u.layer)} in the first; prefixkv keeps one K/V shape per layer; "
                "generate without prefixkv (with a DynamicCache) for this model"
            )


def _own_kv_layers(model: Any, estimated: int) -> int:
    """How many layers keep K/V of their own: the layers up to the first that reuses another's K/V (transformers'
    ``kv_sharing_modes``, ``"reuse"``: Gemma 3n and 4 share from a point on), ``estimated`` (the config's count of
    such layers) where none does. Raises :class:`UnsupportedModelError` where a layer that keeps K/V comes after one
    that reuses, since a cache's layers are the model's first ones. Does not mutate."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    modes = list(getattr(text, "kv_sharing_modes", None) or [])
    if "reuse" not in modes:
        return estimated
    first = modes.index("reuse")
    if any(mode != "reuse" for mode in modes[first:]):
        raise UnsupportedModelError(
            f"{family(model)} has layers that keep K/V after layers that reuse another's (kv_sharing_modes={modes}); "
            "prefixkv keeps the K/V of the model's first layers; generate without prefixkv (with a DynamicCache) "
            "for this model"
        )
    return first


# per model measured: why a left-padded row's reuse is not what stock computes (None: it is)
_PADDED: weakref.WeakKeyDictionary[Any, tuple[str, bool] | None] = weakref.WeakKeyDictionary()
# how far a resumed forward may be from the whole one in a dtype's rounding: the fidelity bounds of
# docs/architectures.md (transformers 4.57's chunked attention gives 3e-8 in float64 by another order of sums, where a
# position counted in columns gives 1e-3); other dtypes are not checked
_RESUME_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def padded_refusal(model: Any) -> tuple[str, bool] | None:
    """Why ``model`` (measured by :func:`measure`) cannot reuse a prefix for a left-padded row, and whether it cannot
    be served a padded batch at all; ``None``: it can. Does not mutate."""
    return _PADDED.get(model)


def _padded_resumption(model: Any, name: str, device: torch.device) -> tuple[str, bool] | None:
    """Whether a left-padded row that reuses K/V computed without pads (prefixkv's warm first forward: a pad column
    of zeros, the prefix's columns as an unpadded call computed them, the rest fed with the whole mask) gives what
    one forward of the whole padded row gives (stock's first forward), with the ``position_ids`` generate derives
    from the mask where the model takes them. A model that counts positions in columns, pads included (TrOCR's
    learned positions), or derives its mask from the cache's length (GIT widens it over image tokens it assumes a
    non-empty cache holds) does not. Only where the model's dtype rounds little enough to tell
    (:data:`_RESUME_TOLERANCE`), and beyond this model's own rounding in that dtype (:func:`_rounding`): a real
    checkpoint in float32 (SmolLM2, logits of 20) moves 1.3e-4 when a padded row's prefill is split, stock included,
    which is no position counted in columns (TrOCR's tiny model moves 5.5e-3, 4.6e4 times its rounding). Also
    whether the model attends a padded row's pad columns once they are cached (GIT), where prefixkv keeps zeros:
    then no padded batch is served (``True`` beside the reason). Does not mutate the model."""
    params = next(model.parameters(), None)
    tolerance = None if params is None else _RESUME_TOLERANCE.get(params.dtype)
    if tolerance is None:
        return None
    pad = getattr(model.config, "pad_token_id", None)
    ids = torch.tensor([[pad if isinstance(pad, int) else 0, 3, 4, 5]], device=device)
    mask = torch.tensor([[0, 1, 1, 1]], device=device)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)

    def run(cache: DynamicCache, start: int, stop: int, row_mask: torch.Tensor) -> torch.Tensor:
        extra = {"position_ids": positions[:, start:stop] - positions[:, 1]} if takes_positions else {}
        out = model(input_ids=ids[:, start:stop], attention_mask=row_mask, use_cache=True, **{name: cache}, **extra)
        return torch.as_tensor(out.logits[:, -1]).float()

    try:
        bound = max(tolerance, _ROUNDING_FACTOR * _rounding(model, name, ids[:, 1:]))
        seen = _zeroed_pad_gap(run, mask)
    except Exception as e:
        return f"a left-padded row cannot resume a cache of this model ({type(e).__name__}: {e})", True
    if seen > bound:
        return (
            f"attends the pad columns of a left-padded row once its cache holds them ({seen:.1e} off when they hold "
            "zeros; GIT widens its mask over image tokens it assumes a non-empty cache holds), and prefixkv keeps no "
            "K/V for pads"
        ), True
    try:
        whole = run(DynamicCache(), 0, 4, mask)
        reused = _unpadded_prefix_reused(run, mask)
    except Exception as e:
        return f"a left-padded row cannot reuse a cache of this model ({type(e).__name__}: {e})", False
    if not bool(whole.isfinite().all()):
        return None  # stock's whole padded row is NaN here (a pad query's softmax over no key, Bloom, Gemma 2)
    diff = float((whole - reused).abs().max())
    if diff <= bound:
        return None
    return (
        f"a left-padded row that reuses K/V computed without pads gives other logits ({diff:.1e} off, over "
        f"{bound:.1e}: the dtype's bound or {_ROUNDING_FACTOR} times the model's own rounding) than the whole row "
        "(the model counts positions in columns, or derives its mask from the cache's length, pads included), so a "
        "padded row cannot reuse cached K/V"
    ), False


# a forward of the probe's row from column ``start`` to ``stop`` with a cache and mask: its last token's logits
_Run = Callable[[DynamicCache, int, int, torch.Tensor], torch.Tensor]


def _zeroed_pad_gap(run: _Run, mask: torch.Tensor) -> float:
    """How far the last token's logits move when the padded prefix's cached pad column holds zeros (the pool's null
    block) rather than its K/V, the rest fed with the whole ``mask``. Does not mutate the model."""
    real, zeros = DynamicCache(), DynamicCache()
    for cache in (real, zeros):  # the padded prefix, then its pad column as it is and as the null block
        run(cache, 0, 3, mask[:, :3])
    for layer in zeros.layers:
        for field in ("keys", "values"):
            torch.as_tensor(getattr(layer, field))[..., :1, :] = 0
    return float((run(real, 3, 4, mask) - run(zeros, 3, 4, mask)).abs().max())


def _unpadded_prefix_reused(run: _Run, mask: torch.Tensor) -> torch.Tensor:
    """The last token's logits where the padded row resumes the prefix as an unpadded call computes it, behind a pad
    column of zeros (prefixkv's warm first forward). Does not mutate the model."""
    cache = DynamicCache()
    run(cache, 1, 3, mask[:, 1:3])  # the prefix as an unpadded call computes it
    for layer in cache.layers:  # and a pad column of zeros ahead, as the pool's null block
        for field in ("keys", "values"):
            held = torch.as_tensor(getattr(layer, field))
            setattr(layer, field, torch.cat([torch.zeros_like(held[..., :1, :]), held], dim=-2))
    return run(cache, 3, 4, mask)


# how many times a model's own rounding (:func:`_rounding`) a padded row's reuse may move its logits: rounding
# differs between the probes by a small factor (SmolLM2 in float32: 8), a position counted in columns by thousands
_ROUNDING_FACTOR = 64


def _rounding(model: Any, name: str, ids: torch.Tensor) -> float:
    """How far the last logits of ``ids`` (no pads) move when their prefill is split, at each cut: the rounding of
    the model's dtype on this model, which a padded row's reuse may show too. Does not mutate the model."""
    whole = torch.as_tensor(model(input_ids=ids, use_cache=True, **{name: DynamicCache()}).logits[:, -1]).float()
    moved = 0.0
    for cut in range(1, ids.shape[1]):
        cache = DynamicCache()
        model(input_ids=ids[:, :cut], use_cache=True, **{name: cache})
        resumed = torch.as_tensor(model(input_ids=ids[:, cut:], use_cache=True, **{name: cache}).logits[:, -1])
        moved = max(moved, float((whole - resumed.float()).abs().max()))
    return moved


def _check_cross_attention(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` for a decoder with cross-attention layers (Mllama's
    ``cross_attention_layers``, read from its modules): their cache holds an image's K/V, not one K/V per token,
    and the model reads it from the cache's layers directly. Does not mutate."""
    for module in model.modules():
        layers = getattr(module, "cross_attention_layers", None)
        if layers:
            raise UnsupportedModelError(
                f"{family(model)} has cross-attention layers (cross_attention_layers={list(layers)}), whose cache "
                "holds an image's K/V rather than one K/V per token and which the model reads from the cache's "
                "layers directly; prefixkv caches per-token K/V only; generate without prefixkv (with a "
                "DynamicCache) for this model"
            )


def _check_forward(model: Any, num_layers: int, fed: int, updates: list[_Update]) -> None:
    """Raise :class:`UnsupportedModelError` unless a forward fed ``fed`` ids added ``fed`` columns to each of the
    ``num_layers`` layers, once each. Does not mutate."""
    layers = [u.layer for u in updates]
    if not layers:
        raise UnsupportedModelError(
            f"{family(model)} writes nothing to a cache it is handed (its forward keeps no K/V cache), so prefixkv "
            "has nothing to reuse; generate without prefixkv for this model"
        )
    if sorted(layers) != list(range(num_layers)):
        raise UnsupportedModelError(
            f"{family(model)} writes its cache layers {layers} in one forward of its {num_layers} layers (a layer "
            "written twice, or beyond its layers: recurrent loops, or layers without a cache); prefixkv keeps one "
            "K/V per token in each layer; generate without prefixkv (with a DynamicCache) for this model"
        )
    columns = sorted({u.columns for u in updates})
    if columns != [fed]:
        raise UnsupportedModelError(
            f"{family(model)} adds {columns[0] if len(columns) == 1 else columns} columns to its cache for {fed} "
            f"id{'s' if fed > 1 else ''} fed (tokens of its own ahead of the ids, or ids it slices by the cache's "
            "length), so its cache columns are not the ids' and prefixkv cannot key them by the ids; generate "
            "without prefixkv (with a DynamicCache) for this model"
        )


def _check_kinds(model: Any, layer_kinds: list[str], fed: int, updates: list[_Update], stated: set[int]) -> None:
    """Raise :class:`UnsupportedModelError` unless a forward fed ``fed`` ids wrote K/V, once each and ``fed`` columns,
    to exactly the layers whose kind writes K/V, and updated a state in exactly those whose kind has one. Does not
    mutate."""
    kv = [i for i, k in enumerate(layer_kinds) if kinds.writes_kv(k)]
    with_state = {i for i, k in enumerate(layer_kinds) if kinds.has_state(k)}
    layers = [u.layer for u in updates]
    if sorted(layers) != kv or stated != with_state:
        raise UnsupportedModelError(
            f"{family(model)} names its layers {layer_kinds} (transformers' layer types), but a forward wrote K/V to "
            f"layers {sorted(layers)} and a state to layers {sorted(stated)}; prefixkv caches each layer as its kind "
            "says; generate without prefixkv (with a DynamicCache) for this model"
        )
    columns = sorted({u.columns for u in updates})
    if columns and columns != [fed]:
        raise UnsupportedModelError(
            f"{family(model)} adds {columns} columns to its cache for {fed} ids fed, so its cache columns are not the "
            "ids' and prefixkv cannot key them by the ids; generate without prefixkv (with a DynamicCache) for this "
            "model"
        )


def _check_resumes(model: Any, text_config: Any, name: str, device: torch.device) -> None:
    """Raise :class:`UnsupportedModelError` unless a forward of several ids that resumes a recurrent model's cache
    gives what one forward of the whole sequence gives, within the rounding of the model's dtype
    (:data:`_RESUME_TOLERANCE`; other dtypes are not checked): prefixkv resumes a prompt from a snapshot of the states
    with such forwards. Mamba's selective scan starts every multi-token forward from a zero state; some Mamba-2 mixers
    scan in float32 whatever the model's dtype. Does not mutate the model."""
    params = next(model.parameters(), None)
    tolerance = None if params is None else _RESUME_TOLERANCE.get(params.dtype)
    if tolerance is None:
        return
    ids = torch.arange(3, 27, device=device).remainder(model.config.get_text_config(decoder=True).vocab_size)[None]
    whole = torch.as_tensor(model(input_ids=ids, use_cache=False).logits[:, -1])
    cache = DynamicCache(config=text_config)
    model(input_ids=ids[:, :16], use_cache=True, **{name: cache})
    resumed = torch.as_tensor(model(input_ids=ids[:, 16:], use_cache=True, **{name: cache}).logits[:, -1])
    diff = float((whole - resumed).abs().max())
    if not diff <= tolerance:
        raise UnsupportedModelError(
            f"{family(model)} does not resume a forward of several ids from its recurrent layers' state as one forward "
            f"of the whole sequence computes it ({diff:.1e} off in {params.dtype if params is not None else ''}, over "
            f"{tolerance:.0e}: Mamba's selective scan starts each such forward from a zero state, and some Mamba-2 "
            "mixers scan in float32 whatever the model's dtype); prefixkv resumes cached prefixes with such forwards; "
            "generate without prefixkv (with a DynamicCache) for this model"
        )


def _padded_states(model: Any, text_config: Any, name: str, device: torch.device) -> tuple[str, bool] | None:
    """For a model with recurrent layers: whether a left-padded row that resumes what an unpadded call computed (a
    pad column of zeros ahead of the K/V, the recurrent states as they are: a snapshot) gives what one forward of the
    whole padded row gives, where the model's dtype rounds little enough to tell (:data:`_RESUME_TOLERANCE`). A model
    that masks its pads out of the state (``apply_mask_to_padding_states`` before any bias) does; ``(why, False)``
    where it does not: its padded rows then reuse nothing. Does not mutate the model."""
    params = next(model.parameters(), None)
    tolerance = None if params is None else _RESUME_TOLERANCE.get(params.dtype)
    if tolerance is None:
        return None
    pad = getattr(model.config, "pad_token_id", None)
    ids = torch.tensor([[pad if isinstance(pad, int) else 0, 3, 4, 5, 6]], device=device)
    mask = torch.tensor([[0, 1, 1, 1, 1]], device=device)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    try:
        whole = torch.as_tensor(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1])
        cache = DynamicCache(config=text_config)
        model(input_ids=ids[:, 1:4], use_cache=True, **{name: cache})
        for layer in cache.layers:  # a pad column of zeros ahead of the K/V, as the pool's null block
            for field in ("keys", "values"):
                held = getattr(layer, field, None)
                if isinstance(held, torch.Tensor) and held.dim() == 4:
                    setattr(layer, field, torch.cat([torch.zeros_like(held[..., :1, :]), held], dim=-2))
        extra = {"position_ids": torch.tensor([[3]], device=device)} if takes_positions else {}
        out = model(input_ids=ids[:, 4:], attention_mask=mask, use_cache=True, **{name: cache}, **extra)
        resumed = torch.as_tensor(out.logits[:, -1])
    except Exception as e:
        return f"a left-padded row cannot resume this model's recurrent state ({type(e).__name__}: {e})", False
    diff = float((whole - resumed).abs().max())
    if diff <= tolerance:
        return None
    return (
        f"a left-padded row that resumes the recurrent state of its unpadded prefix gives other logits ({diff:.1e} "
        "off) than the whole padded row (the model does not keep its pads out of the state), so padded rows reuse "
        "nothing"
    ), False
