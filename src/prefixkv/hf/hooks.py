"""The model hooks of a store: how a ``PagedPrefixCache`` learns what a forward feeds.

The forward pre-hook builds each forward's record (:class:`prefixkv.hf.proof.ForwardInputs`: the cache itself only
ever sees K and V, docs/how-it-works.md, "Reuse, step by step") and begins the cache's forward
(:class:`prefixkv.hf.forward.Forward`, ``cache.forward``); the forward hook ends it (publishing what the forward
computed); a wrapper of ``prepare_inputs_for_generation`` shows the cache the whole sequence at the first step of
each ``generate`` call, the only place where that sequence is visible, and tells the pre-hook which forwards are
decode steps. Two wrappers of ``generate``'s own methods, which no release makes unneeded
(:func:`install_generation_wrappers`), tell a cache whether ``generate`` compiles its call
(:func:`note_generate_compile`) and run its forwards that are not compiled steps outside ``generate``'s compiled
call (:func:`runs_eagerly`)."""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import modeling_utils as _modeling
from transformers.generation import utils as _generation

from ..attention.interface import outside_compile, serves
from ..attention.static import STEP_KWARG, mark_width
from ..base.errors import CacheMisuseError
from ..compat import generation, patching
from ..compat.patching import MethodPatch, SharedPatch, bound_to_copies
from ..compat.releases import CACHE_KWARGS
from . import linear_cache, stepwise, vision
from .cache import PagedPrefixCache
from .parts import Handle, StoreParts
from .proof import ForwardInputs
from .rows import RowSet


def paged_cache(kwargs: dict[str, Any]) -> PagedPrefixCache | None:
    """The ``PagedPrefixCache`` that a forward's or a call's arguments carry, if any."""
    for name in CACHE_KWARGS:
        cache = kwargs.get(name)
        if isinstance(cache, PagedPrefixCache):
            return cache
    return None


def _store_cache(store: StoreParts, kwargs: dict[str, Any]) -> PagedPrefixCache | None:
    """The ``PagedPrefixCache`` of ``store`` that a forward carries, if any."""
    cache = paged_cache(kwargs)
    return cache if cache is not None and cache.store is store else None


def _copied_model() -> CacheMisuseError:
    """The error of a forward of a copy of the store's model: ``copy.deepcopy(model)`` copies the store's hooks, but
    the copy's weights are not the store's model's."""
    return CacheMisuseError(
        "this PagedPrefixCache's PrefixStore was built for another model (this one is a copy.deepcopy of "
        "it, which carries the store's hooks, not the store): build a PrefixStore for this model"
    )


def _feed_images(
    held: RowSet, plan: vision.ImagePlan, inputs: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A forward's ``inputs`` (by name) and ``kwargs`` with the inputs of the images of ``plan`` it feeds only
    (:meth:`prefixkv.hf.vision.ImagePlan.feed`), each row of ``held`` from its next token. Raises
    :class:`CacheMisuseError` where the forward's images are not the prompt's. Does not mutate."""
    fed = inputs.get("input_ids")
    batch = fed.shape[0] if isinstance(fed, torch.Tensor) else len(held.rows)
    per = max(1, batch // max(1, len(held.rows)))
    starts = [held.length - held.rows[b // per].pad for b in range(batch)] if held.rows else []
    try:
        sliced = plan.feed(starts, kwargs) if starts else kwargs
    except ValueError as e:
        raise CacheMisuseError(str(e)) from None
    if sliced is kwargs:
        return inputs, kwargs
    return {**inputs, **{k: v for k, v in sliced.items() if k in vision.KEYED}}, sliced


def attach_hooks(model: torch.nn.Module, store: StoreParts) -> list[Handle]:
    """Register the pre/post forward hooks of ``store`` on ``model`` and share the wrapper of its
    ``prepare_inputs_for_generation``; return what undoes them. Mutates."""

    params = inspect.signature(model.forward).parameters
    positional = [name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # a model that takes no position_ids (Bloom's ALiBi) has K/V that do not depend on them
    positions_matter = "position_ids" in params

    def named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The forward's inputs by name, positional ones too (their order differs by family)."""
        return {**dict(zip(positional, args)), **kwargs} if args else kwargs

    @outside_compile
    def before(
        module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        inputs = named(args, kwargs)
        cache = _store_cache(store, inputs)
        if cache is None:
            return None
        if module is not model:
            raise _copied_model()
        forward = cache.forward  # what generate's prepare noted for this forward, taken
        decode_step, forward.next_decode_step = forward.next_decode_step, False
        source, built = forward.built_masks or (None, None)
        forward.built_masks = None
        if inputs.get("use_cache") is False and any(v is cache for v in kwargs.values()):
            # use_cache=False re-feeds the whole sequence at every step: stock generate then runs without a cache
            # (a cache passed along would hold every step's columns twice), and so does this forward
            return args, {k: None if v is cache else v for k, v in kwargs.items()}
        if built is not None and inputs.get("attention_mask") is built:
            inputs = {**inputs, "attention_mask": source}
        keyed: frozenset[str] = frozenset()
        plan = forward.rows.images
        if plan is not None:  # a prompt's images, keyed by what they are: this forward gets those it feeds only
            keyed = vision.KEYED
            inputs, kwargs = _feed_images(forward.rows, plan, inputs, kwargs)
        forward.begin(ForwardInputs.of(inputs, positions_matter=positions_matter, decode_step=decode_step, keyed=keyed))
        if forward.step is not None:
            return args, _step_kwargs(model, kwargs)
        return (args, kwargs) if plan is not None else None

    @outside_compile
    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = _store_cache(store, named(args, kwargs))
        if cache is not None and module is model:
            cache.forward.end(output is not None)  # torch passes None when the forward raised

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        # always_call: a forward that raises (or is cancelled by close() from another thread) still ends
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
        _PrepareUser(model),
        _StepsOnly(model),
        stepwise.Stepping(model, _is_paged),
        linear_cache.Admitting(model),
    ]


def _step_kwargs(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A compiled step's keyword inputs: its masks are as wide as the step's slot table, a size of the graph as the
    table's width is; prefixkv attention hands the call to the model's own, in the graph (prefixkv.attention.static),
    and a hybrid's own sdpa takes the step's K/V as they are. Marks the mask's width for the compiler."""
    mark_width(kwargs.get("attention_mask"))
    return {**kwargs, STEP_KWARG: True} if serves(model) else kwargs


def _is_paged(cache: Any) -> bool:
    """Whether ``cache`` is a ``PagedPrefixCache`` (whose rows resume Mamba's mixers one id at a time)."""
    return isinstance(cache, PagedPrefixCache)


def _checking_prepare(original: Callable[..., Any], input_ids: Any, *args: Any, **kwargs: Any) -> Any:
    """``prepare_inputs_for_generation`` that, at the first step of a call, lets a ``PagedPrefixCache``
    check the call's whole ``input_ids`` against what it holds and choose how many columns to feed."""
    cache = paged_cache(kwargs)
    if cache is None or args or not isinstance(input_ids, torch.Tensor):
        return original(input_ids, *args, **kwargs)
    model = cache.store.hf_model
    if patching.compiled_call(model) is not None and has_open_store(model):
        _StepsOnly.wrap(model)
    step = generation.generate_step(kwargs, cache, input_ids)
    length = cache.forward.fit_call(input_ids, step.columns, kwargs) if step.first else step.columns
    generation.ask_columns(kwargs, cache, input_ids, length, first=bool(step.first))
    mask = kwargs.get("attention_mask")
    inputs = original(input_ids, *args, **kwargs)
    if isinstance(inputs, dict) and all(inputs.get(name) is not cache for name in CACHE_KWARGS):
        raise CacheMisuseError(
            "this model's prepare_inputs_for_generation replaced the PagedPrefixCache (Phi-3 does so with "
            "rope scaling on long inputs), so prefixkv cannot serve this model: generate without it"
        )
    # a decode step of generate, whose mask is the one checked at the first step grown by ones: generate's decode
    # loops pass one new column and no is_first_iteration, assisted decoding is_first_iteration=False; a call of
    # one's own without either is checked in full
    cache.forward.next_decode_step = step.first is False or (step.first is None and step.columns == 1)
    # for a compileable cache generate replaces the 2-D mask by the 4-D masks it builds from it (one per kind of
    # layer); those show the same columns, and the proof reads the 2-D one
    cache.forward.built_masks = None
    if cache.is_compileable:  # an eager call's step builds none: asked first
        built = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        two_d = mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2)
        if built is not mask and two_d and _four_d(built):
            cache.forward.built_masks = (mask, built)
    return inputs


def _four_d(masks: Any) -> bool:
    """Whether ``masks`` is a 4-D mask tensor, or a dict of them by kind of layer (``None`` for a kind whose mask
    transformers skips: causal over every column)."""
    if isinstance(masks, dict):
        return bool(masks) and all(m is None or _four_d(m) for m in masks.values())
    return isinstance(masks, torch.Tensor) and masks.dim() == 4


def fit_chunked_prompt(model: torch.nn.Module, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Before ``generate`` on ``model`` cuts ``input_ids`` into the chunks of a chunked prefill (by the columns the
    cache holds, read before any ``prepare_inputs_for_generation``): let a ``PagedPrefixCache`` of a store on
    ``model`` fit its reuse to the whole prompt and mask, which no chunk shows (the ``_prefill`` wrapper of
    :func:`prefixkv.compat.generation.install_generation_patches` calls this). Mutates the cache."""
    cache = paged_cache(kwargs)
    if cache is not None and has_open_store(model) and cache.store.hf_model is model:
        cache.forward.fit_prompt(input_ids, kwargs)


def note_generate_compile(model: torch.nn.Module, model_kwargs: dict[str, Any], compiled: bool | None) -> None:
    """``generate`` on ``model`` chose whether to compile the forwards of the call whose arguments are
    ``model_kwargs`` (``None``: it is about to choose; the ``_valid_auto_compile_criteria`` wrapper,
    :func:`_noting_compile`, calls this): a ``PagedPrefixCache`` of a store on
    ``model`` takes its one-token forwards as compiled steps if so (docs/generate.md, "Compiled decoding"). Mutates
    the cache."""
    cache = paged_cache(model_kwargs)
    if cache is not None and has_open_store(model) and cache.store.hf_model is model:
        cache.forward.note_compile(compiled)


def runs_eagerly(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a forward of ``model`` with the keywords ``kwargs`` must run outside ``generate``'s compiled call
    (the ``get_compiled_call`` wrapper, :func:`_stepping_compiled_call`, asks): one with a ``PagedPrefixCache`` of a
    store on ``model`` that is not a compiled step (a step feeds one token,
    :meth:`prefixkv.hf.forward.Forward.takes_steps`). Does not mutate."""
    cache = paged_cache(kwargs)
    if cache is None or not has_open_store(model) or cache.store.hf_model is not model:
        return False
    fed = kwargs.get("input_ids")
    if not isinstance(fed, torch.Tensor):
        fed = kwargs.get("inputs_embeds")
    return not (isinstance(fed, torch.Tensor) and fed.dim() >= 2 and fed.shape[1] == 1 and cache.forward.takes_steps())


def _noting_compile(criteria: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin._valid_auto_compile_criteria``, generate's choice to compile a decoding loop's forwards
    (made before the loop's first forward, on every release prefixkv supports), that tells the call's cache it is
    about to choose (``None``), then what it chose (:func:`note_generate_compile`): a ``PagedPrefixCache`` takes its
    one-token forwards as steps of fixed shapes when, and only when, they are compiled, and in a call that is not it
    says it is not compileable, so that the call's masks are built as for any cache (docs/generate.md, "Compiled
    decoding"). Not a shim: no release tells a cache whether it is compiled; the wrapper goes when one does."""

    @functools.wraps(criteria)
    def noting(self: Any, model_kwargs: dict[str, Any], generation_config: Any) -> Any:
        note_generate_compile(self, model_kwargs, None)
        compiled = criteria(self, model_kwargs, generation_config)
        note_generate_compile(self, model_kwargs, bool(compiled))
        return compiled

    return noting


def _stepping_compiled_call(get_compiled_call: Callable[..., Any]) -> Callable[..., Any]:
    """``PreTrainedModel.get_compiled_call``, the ``torch.compile``d call that ``generate`` runs a compiled call's
    forwards with (its decoding loop's, and on 5.x the chunks of a chunked prefill and assisted decoding's
    verifications, which feed several tokens): a forward that :func:`runs_eagerly` runs the model's plain call
    instead, as ``generate`` runs its prefill. A ``PagedPrefixCache`` compiles its one-token steps only
    (docs/generate.md, "Compiled decoding"): its other forwards decide in Python at every layer, which a compile with
    ``fullgraph=True`` refuses and one without breaks into many graphs. Other caches' forwards run compiled as
    before. Not a shim: no release lets a cache say which forwards compile."""

    @functools.wraps(get_compiled_call)
    def getting(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = get_compiled_call(self, *args, **kwargs)
        plain = self.__call__
        if compiled == plain:  # a model generate does not compile (Llama 4)
            return compiled

        def call(*a: Any, **k: Any) -> Any:
            return (plain if runs_eagerly(self, k) else compiled)(*a, **k)

        return call

    return getting


_ENCODE = "_maybe_prepare_encoder_kwargs_for_generation"


def _encoding_fed_images(encode: Callable[..., Any]) -> Callable[..., Any]:
    """``GenerationMixin._maybe_prepare_encoder_kwargs_for_generation``, where ``generate`` encodes a prompt's images
    before its prefill (transformers 5), that first checks they are those a ``PagedPrefixCache`` of the call keyed the
    prompt by (docs/generate.md, "Images": other images under its keys would reuse and publish K/V that are not
    theirs), fits the cache's reuse to the call (:meth:`prefixkv.hf.forward.Forward.fit_prompt`, as the call's first
    step would) and hands the encoder the images of the uncached tail only: a cached image is not encoded again. Not a
    shim: no release tells a cache what images a call has."""

    @functools.wraps(encode)
    def encoding(self: Any, inputs_tensor: Any, model_kwargs: dict[str, Any], *rest: Any) -> Any:
        cache = paged_cache(model_kwargs)
        plan = None if cache is None or cache.store.hf_model is not self else cache.forward.rows.images
        if plan is None or not has_open_store(self) or cache is None or cache.closed:
            return encode(self, inputs_tensor, model_kwargs, *rest)
        try:
            plan.check(model_kwargs)
        except ValueError as e:
            raise CacheMisuseError(str(e)) from None
        # generate's own test of a model whose images it encodes before the prefill (else its forward gets them all)
        supports = getattr(self, "_supports_mm_encoder_outputs", None)
        encodes = callable(supports) and supports() and "image" in getattr(self, "input_modalities", ())
        if not encodes or not isinstance(inputs_tensor, torch.Tensor) or inputs_tensor.dim() != 2 or self.training:
            return encode(self, inputs_tensor, model_kwargs, *rest)
        cache.forward.fit_prompt(inputs_tensor, model_kwargs)
        held = cache.forward.rows
        config = next((r for r in rest if hasattr(r, "num_beams")), None)
        expand = max(getattr(config, "num_beams", 1) or 1, getattr(config, "num_return_sequences", 1) or 1)
        fed = plan.encode_only([held.length - row.pad for row in held.rows], model_kwargs, expand)
        return encode(self, inputs_tensor, fed, *rest)

    return encoding


_installed = False


def install_generation_wrappers() -> None:
    """Wrap ``generate``'s methods for ``PagedPrefixCache`` calls: those this transformers release needs
    (:func:`prefixkv.compat.generation.install_generation_patches`, with :func:`fit_chunked_prompt`), and generate's
    choice to compile a call (:func:`_noting_compile`) and the compiled call it gets (:func:`_stepping_compiled_call`),
    which every release needs; each wrapper changes nothing for other caches. Called by every ``PrefixStore`` when it
    is built (no ``PagedPrefixCache`` exists before one), once per process. Mutates
    ``transformers.generation.utils.GenerationMixin`` and ``transformers.modeling_utils.PreTrainedModel``, through
    :func:`prefixkv.compat.patching.install`."""
    global _installed
    if _installed:
        return
    _installed = True
    generation.install_generation_patches(fit_chunked_prompt)
    mixin = _generation.GenerationMixin
    patching.install(mixin, "_valid_auto_compile_criteria", _noting_compile(mixin._valid_auto_compile_criteria))
    encode = getattr(mixin, _ENCODE, None)
    if encode is not None:  # transformers 5 encodes a prompt's images before its prefill
        patching.install(mixin, _ENCODE, _encoding_fed_images(encode))
    pretrained = _modeling.PreTrainedModel
    if hasattr(pretrained, "get_compiled_call"):  # every supported release has it; a later one may not
        patching.install(pretrained, "get_compiled_call", _stepping_compiled_call(pretrained.get_compiled_call))


class _CompiledCall:
    """What ``model.compile()`` made of a model's call, but for a forward that :func:`runs_eagerly`, which runs the
    plain call instead: a forward with a ``PagedPrefixCache`` that is not a compiled step decides in Python at every
    layer, and traced, its graph breaks would compile the frames of the decorators every model's forward shares
    (transformers' ``deprecate_kwarg`` wrapper) until they reach dynamo's recompile limit, after which another
    model's compile of them fails. Holds the model by a weak reference."""

    def __init__(self, model: torch.nn.Module, compiled: Any) -> None:
        self.compiled = compiled
        self._model = weakref.ref(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        if model is not None and runs_eagerly(model, kwargs):
            return patching.plain_call(model)(*args, **kwargs)
        return self.compiled(*args, **kwargs)


class _StepsOnly:
    """A store's share of the model's compiled call (``model.compile()``): :meth:`wrap` makes it a
    :class:`_CompiledCall`, at the store's construction and before each forward of ``generate`` with its cache (a
    ``model.compile()`` may come later); the last store to leave gives the model its compiled call back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model: torch.nn.Module | None = model
        self.wrap(model)

    @staticmethod
    def wrap(model: torch.nn.Module) -> None:
        """Make ``model``'s compiled call, if it has one, a :class:`_CompiledCall`. Mutates the model."""
        compiled = patching.compiled_call(model)
        if compiled is not None and not isinstance(compiled, _CompiledCall):
            patching.set_compiled_call(model, _CompiledCall(model, compiled))

    def remove(self) -> None:
        model, self._model = self._model, None
        if model is None or has_open_store(model):  # the prepare wrapper leaves first: held while another store is
            return
        compiled = patching.compiled_call(model)
        if isinstance(compiled, _CompiledCall):
            patching.set_compiled_call(model, compiled.compiled)


_PREPARE = "prepare_inputs_for_generation"
# the wrapper of ``prepare_inputs_for_generation`` that every store on a model shares
_PREPARE_WRAPPER = SharedPatch("_prefixkv_prepare_users")


class _PrepareUser:
    """One store's share of the ``prepare_inputs_for_generation`` wrapper; the last to leave removes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model: torch.nn.Module | None = model

        def wrap() -> Callable[[], None]:
            wrapper = bound_to_copies(_checking_prepare, getattr(model, _PREPARE))
            return MethodPatch(model, _PREPARE, wrapper).remove

        _PREPARE_WRAPPER.join(model, wrap)

    def remove(self) -> None:
        model, self._model = self._model, None
        if model is not None:
            _PREPARE_WRAPPER.leave(model)


def has_open_store(model: torch.nn.Module) -> bool:
    """Whether a store is attached to ``model`` itself (a deep copy carries the original's record, not a store)."""
    return _PREPARE_WRAPPER.held(model)
