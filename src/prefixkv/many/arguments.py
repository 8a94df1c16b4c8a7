"""What ``generate_many`` (:mod:`prefixkv.many`) takes: the prompts as token ids (:func:`prompt_ids`), the
``generate`` settings they run with (:func:`generation_settings`) and those a padded batch of several prompts
cannot keep (:func:`check_generate_kwargs`; with the prompts, :func:`prompts_refusal`), and those with which a row
cannot be carried on into a refilled call (:func:`refill_refusal`). Every check runs before anything is computed;
none mutates.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode

from ..base.family import family
from ..base.tokens import as_token_list
from ..hf.vision import ENCODING, IMAGE_INPUTS, TOKEN_TYPES
from ..kv.key_space import transformers_model
from ..store.prefix_store import PrefixStore

Prompt = Sequence[int] | torch.Tensor | str | Sequence[Mapping[str, Any]]

# keywords that describe one call's inputs or its stopping in a way a padded batch of several prompts cannot keep
_REFUSED = {
    "input_ids": "pass the prompts as the second argument",
    "inputs": "pass the prompts as the second argument",
    "attention_mask": "each prompt is padded by generate_many",
    "inputs_embeds": "generate_many takes token ids, text or chat messages",
    "cache": "generate_many makes one PagedPrefixCache per batch; pass store= instead",
    "past_key_values": "generate_many makes one PagedPrefixCache per batch; pass store= instead",
    "max_length": "it counts the padded prompt; use max_new_tokens",
    "stopping_criteria": "a row's stopping point could not be told from the batch; use eos_token_id or stop_strings",
    "streamer": "a streamer gets the tokens of the whole batch; use stream=True for results as batches finish",
    "assistant_model": "transformers runs assisted decoding on one prompt a call; call model.generate per prompt",
}


def check_generate_kwargs(model: Any, generate_kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` with the reason where ``generate_kwargs`` (read as :func:`generation_settings` reads
    them) ask for what a padded batch of several prompts cannot honour (``_REFUSED`` keywords,
    :func:`_refused_setting`, logits or scores per beam). Does not mutate."""
    for key, why in _REFUSED.items():
        if key in generate_kwargs:
            raise ValueError(f"generate_many() does not take {key}=: {why}")
    given = sorted(k for k in IMAGE_INPUTS if generate_kwargs.get(k) is not None)
    images = [k for k in given if k not in TOKEN_TYPES and k not in ENCODING]
    if not images and given:
        raise ValueError(_image_keyword_refusal(model, given[0]))
    if images:
        raise ValueError(
            f"generate_many() does not take {', '.join(images)}: it pads, batches and refills prompts of ids, and a "
            "batch's images would not follow its rows; call generate with the processor's outputs and a "
            'PagedPrefixCache built from them (docs/generate.md, "Images")'
        )
    settings = generation_settings(model, generate_kwargs)
    refused = _refused_setting(settings)
    if refused is not None:
        raise ValueError(f"generate_many() does not take {refused}")
    beams = settings.num_beams or 1
    if beams > 1 and (settings.output_logits or settings.output_scores):
        raise ValueError(f"with num_beams={beams}, logits and scores are per beam, not per prompt; call generate")


def _image_keyword_refusal(model: Any, key: str) -> str:
    """Why ``generate_many`` does not take ``key``, a token-type tensor or a keyword of how images are encoded
    (:data:`prefixkv.hf.vision.TOKEN_TYPES`, :data:`prefixkv.hf.vision.ENCODING`), said for ``model``: a text
    model has no images to encode. Does not mutate."""
    if key in TOKEN_TYPES:
        return (
            f"generate_many() does not take {key}=: a tensor of one prompt's tokens, which would not follow the rows "
            "it pads, batches and refills; call generate with a PagedPrefixCache built with it"
        )
    takes_images = "pixel_values" in inspect.signature(transformers_model(model).forward).parameters
    if not takes_images:
        return (
            f"generate_many() does not take {key}=: it sets how a vision-language model encodes images, and "
            f"{family(model)} takes no images (generate would refuse it as a keyword the model does not use); "
            "leave it out"
        )
    return (
        f"generate_many() does not take {key}=: it sets how the images are encoded, and generate_many takes "
        "prompts of ids without images; call generate with the processor's outputs, this keyword and a "
        'PagedPrefixCache built from them (docs/generate.md, "Images")'
    )


def generation_settings(model: Any, generate_kwargs: dict[str, Any]) -> GenerationConfig:
    """The settings a ``model.generate(ids, **generate_kwargs)`` call runs with: its ``generation_config=`` (or
    none), the model's ``generation_config`` and the keywords, merged by transformers' own
    ``_prepare_generation_config`` (keywords first, then the passed config, then the model's). Does not mutate."""
    kwargs = dict(generate_kwargs)
    passed = kwargs.pop("generation_config", None)
    config: GenerationConfig = transformers_model(model)._prepare_generation_config(passed, **kwargs)[0]
    return config


def _refused_setting(settings: GenerationConfig) -> str | None:
    """Why ``generate_many`` cannot run these settings (from keywords or a ``generation_config``), or ``None``.
    Does not mutate."""
    if (settings.num_return_sequences or 1) != 1:
        return (
            f"num_return_sequences={settings.num_return_sequences}: it returns one sequence per prompt; repeat the "
            "prompt in the list instead"
        )
    if settings.min_length:
        return f"min_length={settings.min_length}: it counts the padded prompt; use min_new_tokens"
    if settings.use_cache is False:
        return (
            "use_cache=False: every batch computes with a PagedPrefixCache of the store, and without a cache "
            "generate would recompute each step otherwise; drop it, or call model.generate per prompt"
        )
    if settings.get_generation_mode() == GenerationMode.ASSISTED_GENERATION:
        return (
            "assisted decoding (prompt_lookup_num_tokens=, assistant_early_exit=, ...): transformers runs it on one "
            "prompt a call; call model.generate per prompt"
        )
    return None


def prompts_refusal(model: Any, generate_kwargs: dict[str, Any], prompts: list[list[int]]) -> str | None:
    """Why ``prompts`` cannot share padded batches under these ``generate`` arguments, or ``None``.
    ``forced_bos_token_id`` forces the first new token only where the call's prompt is one token wide (transformers'
    ``ForcedBOSTokenLogitsProcessor`` reads the width of its inputs, as ``begin_suppress_tokens`` does with it): a
    one-token prompt's own call forces it, a batch padded to a longer prompt's width would not. Does not
    mutate."""
    forced = generation_settings(model, generate_kwargs).forced_bos_token_id
    one = next((i for i, p in enumerate(prompts) if len(p) == 1), None)
    if forced is None or one is None or all(len(p) == 1 for p in prompts):
        return None
    return (
        f"forced_bos_token_id={forced} beside prompts of other lengths: prompt {one} has one token, and generate "
        "forces the first new token only where the call's prompt is one token wide (a padded batch's is not); run "
        "the one-token prompts in a generate_many call of their own"
    )


def prompt_ids(prompt: Prompt, tokenizer: Any, index: int) -> list[int]:
    """The token ids of one prompt; ``ValueError`` for anything that is not token ids, text or chat messages
    (ids are never truncated: a float or a bool is refused). Does not mutate."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:
        raise ValueError(f"prompt {index} is a tensor of shape {tuple(prompt.shape)}; pass 1-D token ids")
    if isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt)
    ):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is text or chat messages: pass tokenizer= to encode it")
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            chat = tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True
            )
            ids = chat["input_ids"]
    elif isinstance(prompt, (Mapping, bytes)) or not isinstance(prompt, Iterable):
        raise ValueError(
            f"prompt {index} is a {type(prompt).__name__}: pass token ids, text or a list of chat messages"
        )
    else:
        try:
            ids = as_token_list(prompt if isinstance(prompt, torch.Tensor) else list[Any](prompt))
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from None
    if not ids:
        raise ValueError(f"prompt {index} has no tokens; every prompt needs at least one")
    return list(ids)


# the keywords with which a row cannot go on in a later call as if it were one call: their logits processors
# count from the start of the call (or to max_length), keep state across steps, or run other models: refused when
# set at all (_SET) or when not empty or zero (_COUNTING); guidance_scale when not 1
_SET = ("forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty", "watermarking_config")
_COUNTING = (
    "min_length",
    "min_new_tokens",
    "begin_suppress_tokens",
    "logits_processor",
    "constraints",
    "force_words_ids",
)


def refill_refusal(model: Any, generate_kwargs: dict[str, Any], store: PrefixStore | None = None) -> str | None:
    """Why the rows of these ``generate`` arguments (over ``store``) cannot be refilled
    (``generate_many(refill=...)``), or ``None``. A row goes on in a later call with its tokens so far as its
    prompt: that is the same computation for greedy decoding and sampling with processors that only look at the
    tokens, not for beam search or processors that count from the start of the call. An invariant store refills
    too: which prompts join a call then follows the prompts alone (``Scheduler.uncached``). Does not mutate."""
    settings = generation_settings(model, generate_kwargs)
    beams = settings.num_beams or 1
    if beams > 1:
        return f"num_beams={beams}: a beam search keeps its beams within one call"
    for key in (*_SET, *_COUNTING, "guidance_scale"):
        value = getattr(settings, key) if hasattr(settings, key) else generate_kwargs.get(key)
        if (
            (key in _SET and value is not None)
            or (key in _COUNTING and value)
            or (key == "guidance_scale" and value not in (None, 1))
        ):
            return f"{key}={value!r}: it counts from the start of one call"
    return None
