"""``generate_many``: a list of prompts in as few ``generate`` calls as their shared prefixes allow.

The prompts are sorted by their token ids, so that prompts sharing a prefix (a system prompt, few-shot
examples) lie next to each other; a group whose prefix the store holds already goes first, before other work can
evict it. Consecutive prompts then fill left-padded batches of at most ``batch_size`` rows and, in a store with a
budget, of at most half the blocks it can hold; each batch is one ``generate`` call with a ``PagedPrefixCache``,
which computes a prefix that several rows share once and reads it once for all of them (docs/how-it-works.md).
What a batch computes stays in the store for the batches after it. Each row's result is that of ``generate`` on
its prompt alone (docs/generate.md, "Many prompts at once"): rows that stop early (an end-of-sequence token, a
stop string) are cut where that call would have stopped.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from transformers import StopStringCriteria

from ._compat import GENERATE_CACHE_KWARG
from .cache import PagedPrefixCache
from .namespace import user_space
from .store import PrefixStore

if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:  # tqdm.auto without ipywidgets warns in a notebook ("IProgress not found"): the text bar works everywhere
    from tqdm import tqdm

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
    "min_length": "it counts the padded prompt; use min_new_tokens",
    "stopping_criteria": "a row's stopping point could not be told from the batch; use eos_token_id or stop_strings",
    "streamer": "a streamer gets the tokens of the whole batch; use stream=True for results as batches finish",
}


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
    stream: Literal[True],
    **generate_kwargs: Any,
) -> Iterator[Generation]: ...


def generate_many(
    model: Any,
    prompts: Sequence[Prompt],
    *,
    store: PrefixStore | None = None,
    batch_size: int = 32,
    tokenizer: Any = None,
    progress: bool = True,
    namespace: str | None = None,
    stream: bool = False,
    **generate_kwargs: Any,
) -> list[Generation] | Iterator[Generation]:
    """``model.generate(prompt, **generate_kwargs)`` for every prompt, batched by shared prefixes over ``store``.

    ``prompts`` holds token ids (lists or 1-D tensors), strings (with ``tokenizer``, encoded as
    ``tokenizer(text)`` encodes them) or chat conversations (lists of ``{"role": ..., "content": ...}``, through
    the tokenizer's chat template with the generation prompt). ``store=None`` builds a store for this call and
    closes it after; pass one to keep the prefixes for later calls. At most ``batch_size`` rows go in one
    ``generate`` call. Returns one :class:`Generation` per prompt, in input order; with ``stream=True``, an
    iterator that yields them batch by batch as each finishes (``index`` says which prompt). A ``tqdm`` progress
    bar counts the prompts unless ``progress=False``. ``namespace`` is the user's (:class:`PagedPrefixCache`): rows
    reuse and publish only its K/V. Mutates the store.

    Every row equals ``generate`` on its prompt alone: in float64 the same tokens and logits within 1e-6, for
    greedy and beam search. Sampling draws from the same distributions but not with the same random numbers (a
    batch draws all its rows at once). In low precision a batch's kernels may round differently from a one-row
    call (docs/correctness.md, "Outputs that never depend on the cache").

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> system = list(range(10, 42))
    >>> out = prefixkv.generate_many(model, [system + [50], system + [60, 61]], max_new_tokens=4,
    ...                              do_sample=False, progress=False)
    >>> [len(g.tokens) for g in out], [g.cached_tokens for g in out]  # the prefix computed once, for row 1
    ([4, 4], [31, 0])
    """
    for key, why in _REFUSED.items():
        if key in generate_kwargs:
            raise ValueError(f"generate_many() does not take {key}=: {why}")
    if generate_kwargs.get("num_return_sequences", 1) != 1:
        raise ValueError(
            f"generate_many() returns one sequence per prompt, got num_return_sequences="
            f"{generate_kwargs['num_return_sequences']}; repeat the prompt in the list instead"
        )
    beams = generate_kwargs.get("num_beams", model.generation_config.num_beams or 1)
    if beams > 1 and (generate_kwargs.get("output_logits") or generate_kwargs.get("output_scores")):
        raise ValueError(f"with num_beams={beams}, logits and scores are per beam, not per prompt; call generate")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if store is not None and (not isinstance(store, PrefixStore) or store.model is not model):
        raise ValueError("generate_many() needs the PrefixStore built for this model: PrefixStore(model)")
    rows = [_prompt_ids(p, tokenizer, i) for i, p in enumerate(prompts)]
    user_space(namespace, None)  # a wrong name fails before anything runs
    results = _generate(model, rows, store, batch_size, tokenizer, progress, generate_kwargs, namespace)
    if stream:
        return results
    return sorted(results, key=lambda g: g.index)


def _prompt_ids(prompt: Prompt, tokenizer: Any, index: int) -> list[int]:
    """The token ids of one prompt. Does not mutate."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"prompt {index} is a tensor of shape {tuple(prompt.shape)}; pass 1-D token ids")
        ids = prompt.tolist()
    elif isinstance(prompt, str) or (prompt and isinstance(prompt[0], Mapping)):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is text or chat messages: pass tokenizer= to encode it")
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)["input_ids"]
    else:
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
    if not ids:
        raise ValueError(f"prompt {index} has no tokens; every prompt needs at least one")
    return list(ids)


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def plan(
    rows: list[list[int]], store: PrefixStore, batch_size: int, new_tokens: int, namespace: str | None = None
) -> list[list[int]]:
    """The batches (lists of row indices) in the order to run them. Rows are sorted by their tokens, so that rows
    sharing a prefix are consecutive; runs of rows sharing a whole block go together, the run whose prefix the
    store holds most of first (before other work can evict it; what it holds for user ``namespace``); then
    consecutive rows fill batches of at most ``batch_size`` rows and, in a store with a budget, of at most half
    the blocks it holds beside its pins (each row needs its prompt and new tokens, less the whole blocks it
    reuses from the store or the row before it): the
    other half keeps what was cached before, so that a long job cannot flush a hot prefix by its batches' size
    alone. A row larger than that goes in a batch of its own. Does not mutate.

    >>> import prefixkv
    >>> store = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
    >>> plan([[5, 6, 7, 8, 1], [9, 9], [5, 6, 7, 8, 2]], store, batch_size=2, new_tokens=4)
    [[0, 2], [1]]
    """
    bs = store.block_size
    cached = [store.cached_length(r, store.blocks.space(), namespace=namespace) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    runs: list[list[int]] = []
    shared = [0] * len(rows)  # tokens, in whole blocks, that row i shares with the row before it in `order`
    for prev, i in zip([None, *order], order):
        shared[i] = 0 if prev is None else _common_length(rows[prev], rows[i]) // bs * bs
        if shared[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    runs.sort(key=lambda run: -cached[run[0]])  # stable: sorted order among equal hits
    room = None if store.max_blocks is None else (store.max_blocks - store.stats.blocks_pinned) // 2
    batches: list[list[int]] = []
    need = 0
    for i in (i for run in runs for i in run):
        blocks = -(-(len(rows[i]) + new_tokens) // bs) - max(cached[i], shared[i]) // bs
        if not batches or len(batches[-1]) >= batch_size or (room is not None and need + blocks > room):
            batches.append([])
            need = 0
        batches[-1].append(i)
        need += blocks
    return batches


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as one left-padded ``[batch, width]`` id tensor and its attention mask. Does not mutate."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _stop_length(prompt: list[int], new: list[int], eos: set[int], stop: StopStringCriteria | None) -> int:
    """How many of a row's ``new`` tokens ``generate`` on that row alone returns: up to and with its first
    end-of-sequence token or the token that completes a stop string (after it the batch fed the row padding).
    Does not mutate."""
    n = next((t + 1 for t, token in enumerate(new) if token in eos), len(new))
    if stop is not None:
        seq = torch.tensor([prompt + new[:n]])
        n = next((t for t in range(1, n + 1) if bool(stop(seq[:, : len(prompt) + t], None)[0])), n)
    return n


def _generate(
    model: Any,
    rows: list[list[int]],
    store: PrefixStore | None,
    batch_size: int,
    tokenizer: Any,
    progress: bool,
    generate_kwargs: dict[str, Any],
    namespace: str | None,
) -> Iterator[Generation]:
    """Run the batches of :func:`plan` and yield each row's :class:`Generation` as its batch finishes. Mutates the
    store (closing it if it builds it)."""
    config = model.generation_config
    new_tokens = generate_kwargs.get("max_new_tokens", config.max_new_tokens)
    if new_tokens is None:
        raise ValueError(
            "generate_many() needs max_new_tokens= (or the model's generation_config.max_new_tokens): max_length "
            "would count the padding of a batch"
        )
    pad = generate_kwargs.get("pad_token_id", config.pad_token_id)
    eos_ids = generate_kwargs.get("eos_token_id", config.eos_token_id)
    eos = set() if eos_ids is None else {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
    if pad is None:
        pad = min(eos, default=0)
    stop_strings = generate_kwargs.get("stop_strings", config.stop_strings)
    kwargs = {**generate_kwargs, "pad_token_id": pad, "return_dict_in_generate": True}
    stop = None
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= (generate needs it to find the strings)")
        kwargs["tokenizer"] = tokenizer
        stop = StopStringCriteria(tokenizer, [stop_strings] if isinstance(stop_strings, str) else stop_strings)
    own = store is None
    store = PrefixStore(model) if store is None else store
    try:
        with tqdm(total=len(rows), desc="prefixkv generate_many", unit="prompt", disable=not progress) as bar:
            for batch in plan(rows, store, batch_size, new_tokens, namespace):
                prompts = [rows[i] for i in batch]
                ids, mask = _left_pad(prompts, pad)
                with PagedPrefixCache(store, ids, mask, namespace=namespace) as cache:
                    out = model.generate(ids, attention_mask=mask, **{GENERATE_CACHE_KWARG: cache}, **kwargs)
                width = ids.shape[1]
                for j, (i, prompt) in enumerate(zip(batch, prompts)):
                    new = out.sequences[j, width:].tolist()
                    n = _stop_length(prompt, new, eos, stop)
                    logits, scores = (
                        None if steps is None else torch.stack([step[j] for step in steps[:n]])
                        for steps in (out.get("logits"), out.get("scores"))
                    )
                    text = None if tokenizer is None else tokenizer.decode(new[:n], skip_special_tokens=True)
                    yield Generation(i, prompt, new[:n], text, cache.stats.per_row[j].cached_tokens, logits, scores)
                bar.update(len(batch))
                bar.set_postfix(reused=store.stats.hit_tokens)
    finally:
        if own:
            store.close()
