"""``generate_many``: a list of prompts in as few ``generate`` calls as their shared prefixes allow.

The prompts are sorted by their token ids, so that prompts sharing a prefix (a system prompt, few-shot examples) lie
next to each other; a group whose prefix the store holds already goes first, before other work can evict it.
Consecutive prompts then fill left-padded batches of at most ``batch_size`` rows and, in a store with a budget, of
at most half the blocks it can hold (the planner: :mod:`prefixkv.many.batches`); each batch is one ``generate``
call with a ``PagedPrefixCache``, which computes a prefix that several rows share once and reads it once for all of them
(docs/how-it-works.md). What a batch computes stays in the store for the batches after it. Each row's result is that
of ``generate`` on its prompt alone (docs/generate.md, "Many prompts at once"): rows that stop early (an
end-of-sequence token, a stop string) are cut where that call would have stopped.

Refilling: once half a call's rows have ended and prompts wait, the call ends there; the next call carries the
rows still going on, each with its tokens so far as its prompt (whose K/V its call published, so only a partial
last block is computed again), and waiting prompts take the free places. Greedy decoding and sampling compute the
same thing so; beam search and processors that count from a call's start do not, and run in whole batches. The
refill is :class:`prefixkv.many.scheduler.Scheduler`: waiting prompts, running rows; admit, step, retire.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StopStringCriteria,
)
from transformers.generation.streamers import BaseStreamer

from ..base.tokens import inferred_mask
from ..compat.releases import GENERATE_CACHE_KWARG
from ..hf.cache import PagedPrefixCache
from ..kv.key_space import user_space
from ..store.prefix_store import PrefixStore
from .arguments import (
    Prompt,
    check_generate_kwargs,
    generation_settings,
    prompt_ids,
    prompts_refusal,
    refill_refusal,
)
from .batches import batch_rows, room, row_order
from .scheduler import Row, Scheduler

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:  # tqdm.auto without ipywidgets warns in a notebook ("IProgress not found"): the text bar works everywhere
    from tqdm import tqdm


@dataclass(frozen=True)
class Generation:
    """One prompt's result: its place in the input (``index``), its token ids (``prompt``), the new tokens
    (``tokens``, where ``generate`` on this prompt alone stops), their text (``text``, with a tokenizer), how many
    prompt tokens came from the store (``cached_tokens``), and with ``output_logits=True`` / ``output_scores=True``
    one ``[len(tokens), vocab]`` tensor of the logits / processed scores of each new token."""

    index: int
    prompt: list[int]
    tokens: list[int]
    text: str | None
    cached_tokens: int
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None


@overload
def generate_many(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    store: PrefixStore | None = ...,
    batch_size: int = ...,
    tokenizer: Any = ...,
    progress: bool = ...,
    namespace: str | None = ...,
    refill: bool | None = ...,
    stream: Literal[False] = ...,
    **generate_kwargs: Any,
) -> list[Generation]: ...


@overload
def generate_many(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    store: PrefixStore | None = ...,
    batch_size: int = ...,
    tokenizer: Any = ...,
    progress: bool = ...,
    namespace: str | None = ...,
    refill: bool | None = ...,
    stream: Literal[True],
    **generate_kwargs: Any,
) -> Iterator[Generation]: ...


def generate_many(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    store: PrefixStore | None = None,
    batch_size: int = 64,
    tokenizer: Any = None,
    progress: bool = True,
    namespace: str | None = None,
    refill: bool | None = None,
    stream: bool = False,
    **generate_kwargs: Any,
) -> list[Generation] | Iterator[Generation]:
    """``model.generate(prompt, **generate_kwargs)`` for every prompt, batched by shared prefixes over ``store``.

    ``prompts`` holds token ids (lists or 1-D tensors), strings (with ``tokenizer``, encoded as
    ``tokenizer(text)`` encodes them) or chat conversations (lists of ``{"role": ..., "content": ...}``, through
    the tokenizer's chat template with the generation prompt). ``store=None`` builds a store for this call and
    closes it after; pass one to keep the prefixes for later calls. At most ``batch_size`` rows go in one
    ``generate`` call, and with a store that has a budget (``max_memory=``) at most half its blocks: on a large
    model, give the store a budget or lower ``batch_size`` (each row holds its own tokens' K/V beside the shared
    prefix). ``refill`` (``None``: wherever the arguments allow) ends a call once half its rows are done and refills
    it with waiting prompts, the other rows carrying on from the store (:func:`prefixkv.many.arguments.refill_refusal`
    says which arguments do not allow it; ``refill=True`` with them raises ``ValueError``); ``refill=False`` runs
    each batch to its longest row's end. Returns one :class:`Generation` per prompt, in input order; with
    ``stream=True``, an iterator that yields them as each ends (``index`` says which prompt). A ``tqdm`` progress
    bar counts the prompts unless ``progress=False``. ``namespace`` is the user's (:class:`PagedPrefixCache`): rows
    reuse and publish only its K/V. ``generate_kwargs`` (a ``generation_config=`` too) are read as ``generate``
    reads them (:func:`prefixkv.many.arguments.generation_settings`); what a padded batch cannot honour
    (``use_cache=False``, assisted decoding, ``max_length``, ...) raises ``ValueError`` with the reason, before
    anything runs. Mutates the store.

    Every row equals ``generate`` on its prompt alone (with the attention mask ``generate`` infers from a pad
    token inside it): in float64 the same tokens and logits within 1e-6, for greedy and beam search. Sampling
    draws from the same distributions but not with the same random numbers (a batch draws all its rows at once).
    In low precision a batch's kernels may round differently from a one-row call (docs/correctness.md, "Outputs
    that never depend on the cache").

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> system = list(range(10, 42))
    >>> out = prefixkv.generate_many(model, [system + [50], system + [60, 61]], max_new_tokens=4,
    ...                              do_sample=False, progress=False)
    >>> [len(g.tokens) for g in out], [g.cached_tokens for g in out]  # the prefix computed once, for row 1
    ([4, 4], [31, 0])
    """
    check_generate_kwargs(model, generate_kwargs)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if store is not None and (not isinstance(store, PrefixStore) or store.model is not model):
        raise ValueError("generate_many() needs the PrefixStore built for this model: PrefixStore(model)")
    rows = [prompt_ids(p, tokenizer, i) for i, p in enumerate(prompts)]
    refused = prompts_refusal(model, generate_kwargs, rows)
    if refused is not None:
        raise ValueError(f"generate_many() cannot run {refused}")
    refusal = refill_refusal(model, generate_kwargs, store) or _carry_refusal(
        rows, generation_settings(model, generate_kwargs)
    )
    if refill and refusal is not None:
        raise ValueError(f"generate_many(refill=True) cannot refill a batch with {refusal}; pass refill=False")
    user_space(namespace, None)  # a wrong name fails before anything runs
    results = _generate(
        model,
        rows,
        store,
        batch_size,
        tokenizer,
        progress,
        generate_kwargs,
        namespace,
        refusal is None and refill is not False,
    )
    if stream:
        return results
    return sorted(results, key=lambda g: g.index)


def _attended(prompt: list[int], settings: GenerationConfig) -> list[int]:
    """The attention mask ``generate`` gives ``prompt`` alone when passed none: 0 where it infers padding from
    the pad token inside the prompt (:func:`prefixkv.enabling.enable` infers the same), else 1. Does not
    mutate."""
    inferred = inferred_mask(torch.tensor([prompt]), lambda name: getattr(settings, name, None))
    return [1] * len(prompt) if inferred is None else inferred[0].long().tolist()


def _carry_refusal(rows: list[list[int]], settings: GenerationConfig) -> str | None:
    """Why a row of these prompts could not be carried on into a later call as its own call goes on, or ``None``:
    ``generate`` numbers the positions of a prompt's tokens by its attention mask and those of the new tokens on
    from the last one, which for a prompt that ends in a masked pad token is that token's 0: its own call numbers
    the new tokens from 1, where a call given its tokens so far as its prompt would number them from its length.
    Does not mutate."""
    ended = next((i for i, r in enumerate(rows) if _attended(r, settings)[-1] == 0), None)
    if ended is None:
        return None
    return (
        f"prompt {ended}: it ends in the pad token, which generate masks, and numbers the new tokens after it from "
        "1 (on from the masked token's position), where a later call carrying the row on would not"
    )


def _left_pad(rows: list[list[int]], masks: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as one left-padded ``[batch, width]`` id tensor and its attention mask, each row's own ``masks``
    beside the padding. Does not mutate."""
    ids = pad_sequence(
        [torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True, padding_value=pad, padding_side="left"
    )
    mask = pad_sequence(
        [torch.tensor(m, dtype=torch.long) for m in masks], batch_first=True, padding_value=0, padding_side="left"
    )
    return ids, mask


def _stop_length(prompt: list[int], new: list[int], eos: set[int], stop: StopStringCriteria | None) -> tuple[int, bool]:
    """How many of a row's ``new`` tokens ``generate`` on that row alone returns: up to and with its first
    end-of-sequence token or the token that completes a stop string (after it the batch fed the row padding);
    and whether one of those ended it. Does not mutate."""
    n = next((t + 1 for t, token in enumerate(new) if token in eos), None)
    stopped, n = n is not None, len(new) if n is None else n
    if stop is not None:
        seq = torch.tensor([prompt + new[:n]])
        hit = next((t for t in range(1, n + 1) if bool(stop(seq[:, : len(prompt) + t], None)[0])), None)
        stopped, n = (True, hit) if hit is not None else (stopped, n)
    return n, stopped


def _generate(
    model: Any,
    rows: list[list[int]],
    store: PrefixStore | None,
    batch_size: int,
    tokenizer: Any,
    progress: bool,
    generate_kwargs: dict[str, Any],
    namespace: str | None,
    refill: bool,
) -> Iterator[Generation]:
    """Run the prompts, in batches of :func:`batch_rows` or refilling them (:class:`prefixkv.many.scheduler.Scheduler`),
    and yield each row's :class:`Generation` as it finishes. Mutates the store (closing it if it builds it)."""
    settings = generation_settings(model, generate_kwargs)
    new_tokens = settings.max_new_tokens
    if new_tokens is None:
        raise ValueError(
            "generate_many() needs max_new_tokens= (or the generation_config's max_new_tokens): max_length "
            "would count the padding of a batch"
        )
    pad = settings.pad_token_id
    eos_ids = settings.eos_token_id
    eos = set() if eos_ids is None else {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
    if pad is None:
        pad = min(eos, default=0)
    stop_strings = settings.stop_strings
    kwargs = dict(generate_kwargs)
    stop = None
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= (generate needs it to find the strings)")
        kwargs["tokenizer"] = tokenizer
        stop = StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else stop_strings)
    built = PrefixStore(model) if store is None else store
    masks = [_attended(r, settings) for r in rows]
    run = _Run(model, rows, built, kwargs, eos, stop, tokenizer, namespace, pad, masks, settings)
    try:
        with tqdm(total=len(rows), desc="prefixkv generate_many", unit="prompt", disable=not progress) as bar:
            ended = _EndedRows(bar, eos)
            if progress and "streamer" not in kwargs and (settings.num_beams or 1) == 1:
                kwargs["streamer"] = ended  # the bar moves as rows end inside a call, not only when it returns
            work: Iterator[Generation]
            if refill:
                waiting = row_order(rows, built, new_tokens, namespace)[::-1]
                scheduler = Scheduler(
                    run.call, run.take, rows, masks, built, namespace, batch_size, new_tokens, room(built), eos, stop,
                    waiting,
                )  # fmt: skip
                work = map(run.result, scheduler.rows())
            else:
                work = run.batches(batch_rows(rows, run.store, batch_size, new_tokens, namespace))
            reused = 0
            for g in work:
                yield g
                reused += g.cached_tokens  # this call's reuse, not the store's running total
                ended.done += 1
                bar.n = max(bar.n, ended.done)
                bar.set_postfix(reused=reused)
    finally:
        if store is None:
            run.store.close()


def _prompt_readers(
    settings: GenerationConfig, sources: list[list[int]], device: torch.device
) -> list[LogitsProcessor]:
    """The logits processors of ``settings`` that read the prompt (``encoder_repetition_penalty``,
    ``encoder_no_repeat_ngram_size``), built from each row's own prompt ``sources``, on ``device``. Passed to
    ``generate`` as ``logits_processor``, each takes the place of the one ``generate`` builds of the same type (the
    same place in the order) from the ids it is given, in which the padding of a batch and, in a refilled call, a
    row's tokens so far would count as its prompt. Does not mutate."""
    readers: list[LogitsProcessor] = []
    penalty = settings.encoder_repetition_penalty
    if penalty is not None and penalty != 1.0:
        width = max(len(s) for s in sources)
        # the penalty goes to each token id of the prompt once: a row's own first token as padding adds none
        ids = torch.tensor([s + s[:1] * (width - len(s)) for s in sources], device=device)
        readers.append(EncoderRepetitionPenaltyLogitsProcessor(penalty, cast(torch.LongTensor, ids)))
    size = settings.encoder_no_repeat_ngram_size
    if size is not None and size > 0:
        # the n-grams of each row's own prompt, as the processor collects them from a batch of that row alone
        rows = [EncoderNoRepeatNGramLogitsProcessor(size, cast(torch.LongTensor, torch.tensor([s]))) for s in sources]
        reader = rows[0]
        reader.batch_size, reader.generated_ngrams = len(rows), [r.generated_ngrams[0] for r in rows]
        readers.append(reader)
    return readers


class _OwnReaders(logging.Filter):
    """Drops transformers' warning that a custom logits processor takes the place of the one ``generate`` builds,
    for the processors that read the prompt, which ``generate_many`` passes itself (:func:`_prompt_readers`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        readers = (EncoderNoRepeatNGramLogitsProcessor.__name__, EncoderRepetitionPenaltyLogitsProcessor.__name__)
        return "has been passed to `.generate()`" not in message or not any(r in message for r in readers)


@contextlib.contextmanager
def _quiet_readers(readers: list[LogitsProcessor]) -> Iterator[None]:
    """Around a ``generate`` call given ``readers``: transformers' warning that they replace its own is not the
    user's doing, and is dropped (:class:`_OwnReaders`)."""
    if not readers:
        yield
        return
    logger, own = logging.getLogger("transformers.generation.utils"), _OwnReaders()
    logger.addFilter(own)
    try:
        yield
    finally:
        logger.removeFilter(own)


def _setting(generate_kwargs: dict[str, Any], **values: Any) -> dict[str, Any]:
    """``generate_kwargs`` with ``values`` set where the caller's settings are: in (a copy of) the
    ``generation_config=`` it passes, if any (so ``generate`` is passed no keywords beside a config but the
    caller's own), else as keywords. Does not mutate."""
    passed = generate_kwargs.get("generation_config")
    rest = {k: v for k, v in generate_kwargs.items() if k not in values}
    if passed is None:
        return {**rest, **values}
    config = copy.deepcopy(passed)
    return {**rest, "generation_config": config, **config.update(**values)}


class _EndedRows(BaseStreamer):
    """``generate_many``'s progress bar during a ``generate`` call: the rows done before it (``done``) and those of
    the call that have emitted an end token since it began (``generate`` streams each step's tokens here)."""

    def __init__(self, bar: Any, eos: set[int]) -> None:
        self.bar, self.eos, self.done, self.ended = bar, eos, 0, set[int]()

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:  # the prompts: a new call begins
            self.ended = set()
            return
        self.ended |= {j for j, token in enumerate(value.tolist()) if token in self.eos}
        if self.done + len(self.ended) > self.bar.n:
            self.bar.n = self.done + len(self.ended)
            self.bar.refresh()

    def end(self) -> None:
        return None


@dataclass
class _Run:
    """One ``generate_many`` call's model, prompts, store and ``generate`` arguments."""

    model: Any
    rows: list[list[int]]
    store: PrefixStore
    kwargs: dict[str, Any]
    eos: set[int]
    stop: StopStringCriteria | None
    tokenizer: Any
    namespace: str | None
    pad: int
    masks: list[list[int]]  # each prompt's attention mask as generate infers it (:func:`_attended`)
    settings: GenerationConfig  # what generate reads of kwargs (:func:`prefixkv.many.arguments.generation_settings`)

    def call(
        self, prompts: list[list[int]], masks: list[list[int]], sources: list[list[int]], **more: Any
    ) -> tuple[Any, int, list[int]]:
        """One left-padded ``generate`` call on ``prompts`` (with their ``masks``; ``sources``, each row's prompt
        in the input, for the processors that read it: :func:`_prompt_readers`): its output, the padded width and
        each row's cached prompt tokens. Mutates the store."""
        ids, mask = _left_pad(prompts, masks, self.pad)
        given = list(self.kwargs.get("logits_processor") or [])
        readers = _prompt_readers(self.settings, sources, self.model.device)
        readers = [r for r in readers if not any(type(p) is type(r) for p in given)]  # generate uses the user's
        if readers:
            more["logits_processor"] = LogitsProcessorList([*given, *readers])
        with PagedPrefixCache(self.store, ids, mask, namespace=self.namespace) as cache, _quiet_readers(readers):
            out = self.model.generate(
                ids,
                attention_mask=mask,
                **{GENERATE_CACHE_KWARG: cache},
                **_setting(self.kwargs, pad_token_id=self.pad, return_dict_in_generate=True, **more),
            )
        return out, ids.shape[1], [row.cached_tokens for row in cache.stats.per_row]

    def result(self, row: Row) -> Generation:
        logits, scores = (torch.stack(steps) if steps else None for steps in (row.logits, row.scores))
        text = None if self.tokenizer is None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return Generation(row.index, row.prompt, row.tokens, text, row.cached or 0, logits, scores)

    def take(self, row: Row, out: Any, j: int, width: int, budget: int) -> bool:
        """Add batch row ``j``'s new tokens of ``out`` to ``row``, cut where ``generate`` on its prompt alone
        stops; whether it stopped there. Mutates ``row``."""
        new = out.sequences[j, width:].tolist()[:budget]
        n, stopped = _stop_length(row.prompt + row.tokens, new, self.eos, self.stop)
        row.tokens += new[:n]
        for steps, mine in ((out.get("logits"), row.logits), (out.get("scores"), row.scores)):
            if steps is not None:
                mine.extend(step[j] for step in steps[:n])
        return stopped or n == budget

    def batches(self, order: list[list[int]]) -> Iterator[Generation]:
        """Each batch of ``order`` in one ``generate`` call, to its longest row's end."""
        for batch in order:
            running = [Row(i, self.rows[i]) for i in batch]
            prompts = [r.prompt for r in running]
            out, width, cached = self.call(prompts, masks=[self.masks[i] for i in batch], sources=prompts)
            for j, row in enumerate(running):
                row.cached = cached[j]
                self.take(row, out, j, width, len(out.sequences[j]) - width)
                yield self.result(row)
