"""Scoring over cached prefixes: the log-probabilities of continuations given their contexts, computed with a
``PagedPrefixCache`` so that the cached part of each context is read from the store instead of recomputed.

What an evaluation harness, a reranker or a classifier needs (``loglikelihood`` of an answer after a
few-shot prompt), with the same store that ``generate`` uses: a warm system prompt or few-shot prefix
serves both. The numbers are those of one full forward over context + continuation: the forward goes
through the model's normal code with the cache (so the model hooks check and publish what it computes),
and only the uncached part of each context, plus the continuation, is fed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from .base.tokens import as_token_list
from .hf.cache import PagedPrefixCache
from .hf.runner import forward_kwargs
from .store.prefix_store import PrefixStore

TokenRows = torch.Tensor | Sequence[Sequence[int] | torch.Tensor] | Sequence[int]


class Score(NamedTuple):
    """The log-probability of each token of one continuation given its context and everything before it
    (``logprobs``, 1-D, in the dtype of the model's logits or ``softmax_dtype``), and whether each token is
    the model's most likely next token (``greedy``, 1-D bool)."""

    logprobs: torch.Tensor
    greedy: torch.Tensor

    @property
    def total(self) -> float:
        """The continuation's log-likelihood: the sum of ``logprobs``."""
        return float(self.logprobs.sum())

    @property
    def is_greedy(self) -> bool:
        """Whether greedy decoding from the context would produce exactly this continuation."""
        return bool(self.greedy.all())


def score(
    model: Any,
    store: PrefixStore,
    contexts: TokenRows,
    continuations: TokenRows,
    *,
    context_mask: torch.Tensor | None = None,
    continuation_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    softmax_dtype: torch.dtype | None = None,
    namespace: str | None = None,
) -> list[Score]:
    """Log-probabilities of each continuation's tokens given its context, reusing the context's cached K/V.

    ``contexts`` and ``continuations`` are token ids: a list of sequences (lists or 1-D tensors), one sequence,
    or a 2-D tensor with an optional mask (``context_mask``/``continuation_mask``) whose padding may be on
    either side. One context with several continuations is scored against each (a multiple-choice question).
    Rows are scored ``batch_size`` at a time, longest first; in each batch the part of each context the store
    holds is read from it, only the rest and the continuation are computed, and what is computed is cached
    for later calls (``generate`` or ``score``) in user ``namespace`` (:class:`PagedPrefixCache`). The result
    is, per continuation and in the order given, what a full forward over context + continuation gives
    (float64: within 1e-6). Mutates the store.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> question = torch.arange(3, 30).tolist()
    >>> scores = prefixkv.score(model, store, question, [[7], [8, 9]])
    >>> [s.logprobs.shape[0] for s in scores]
    [1, 2]
    >>> store.stats.hit_tokens > 0  # the second answer reused the question's blocks
    True
    """
    if not isinstance(store, PrefixStore) or store.model is not model:
        raise ValueError("score() needs the PrefixStore built for this model: PrefixStore(model)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    ctx = _token_rows(contexts, context_mask, "contexts")
    cont = _token_rows(continuations, continuation_mask, "continuations")
    if len(ctx) == 1 and len(cont) > 1:
        ctx = ctx * len(cont)
    if len(ctx) != len(cont):
        raise ValueError(f"got {len(ctx)} contexts and {len(cont)} continuations; give one of each per row")
    for i, (c, k) in enumerate(zip(ctx, cont)):
        if not c:
            raise ValueError(f"context {i} is empty: start it with a token (the tokenizer's BOS, as lm-eval does)")
        if not k:
            raise ValueError(f"continuation {i} is empty: there is nothing to score")
    order = sorted(range(len(ctx)), key=lambda i: (-len(ctx[i]) - len(cont[i]), ctx[i] + cont[i]))
    results: list[Score | None] = [None] * len(ctx)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        contexts_now, continuations_now = [ctx[i] for i in batch], [cont[i] for i in batch]
        rows = logprob_rows(store, contexts_now, continuations_now, softmax_dtype=softmax_dtype, namespace=namespace)
        for i, lp in zip(batch, rows):
            target = torch.tensor(cont[i], device=lp.device)
            results[i] = Score(lp.gather(-1, target[:, None]).squeeze(-1), lp.argmax(dim=-1) == target)
    return [r for r in results if r is not None]


def logprob_rows(
    store: PrefixStore,
    contexts: list[list[int]],
    continuations: list[list[int]],
    *,
    softmax_dtype: torch.dtype | None = None,
    namespace: str | None = None,
) -> list[torch.Tensor]:
    """One batched forward: for row ``i``, the log-softmax over the vocabulary at the positions that predict
    ``continuations[i]`` (``[len(continuations[i]), vocab]``). Rows are left-padded to one width; each reuses
    the cached part of its context (never of its continuation: the logits of the last context token are
    needed), in user ``namespace`` (:class:`PagedPrefixCache`). Mutates the store (publishes what the forward
    computed)."""
    model = store.model
    # the last continuation token predicts nothing that is scored: it is not fed, so a row of n + 1 tokens runs at
    # most n positions (a model's position limit, as lm-eval's ``hf`` feeds it)
    full = [c + k[:-1] for c, k in zip(contexts, continuations)]
    ids = pad_sequence(
        [torch.tensor(f, dtype=torch.long) for f in full], batch_first=True, padding_value=0, padding_side="left"
    )  # [B, W]
    mask = pad_sequence(
        [torch.ones(len(f), dtype=torch.long) for f in full], batch_first=True, padding_value=0, padding_side="left"
    )
    pads = [ids.shape[1] - len(f) for f in full]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # as generate places left-padded rows
    keep = max(len(k) for k in continuations)  # the logits needed: the last context token onwards
    device = store.blocks.pool.specs[0].device  # the first layer's (model.device is `meta` under offloading)
    with PagedPrefixCache(store, namespace=namespace) as cache:
        # the cache knows each row's context only: it matches (and reuses) at most all but its last token,
        # and checks the fed ids against it; the continuation is recorded as it is fed
        cache.forward.rows.attach(store, pads, [list(c) for c in contexts])  # its rows grow as tokens are fed
        start = cache.get_seq_length()
        kwargs = forward_kwargs(model, cache, logits_to_keep=keep)
        with torch.no_grad():
            out = model(
                input_ids=ids[:, start:].to(device),
                attention_mask=mask.to(device),
                position_ids=positions[:, start:].to(device),
                **kwargs,
            )
    logits = out.logits[:, -keep:]  # [B, keep, vocab]
    return [
        torch.log_softmax(logits[i, keep - len(k) :], dim=-1, dtype=softmax_dtype) for i, k in enumerate(continuations)
    ]


def _token_rows(x: TokenRows, mask: torch.Tensor | None, name: str) -> list[list[int]]:
    """Rows of token ids from a list of sequences, one sequence, or a 2-D tensor whose ``mask`` marks one
    contiguous run of tokens per row (padding on the left, the right, or both)."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 1:
            x = x[None]
        if x.dim() != 2 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got a {x.dtype} tensor of shape {tuple(x.shape)}")
        rows: list[list[int]] = x.cpu().tolist()
        if mask is None:
            return rows
        if not isinstance(mask, torch.Tensor) or mask.shape != x.shape:
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"the mask of {name} must have the shape {tuple(x.shape)}, got {got}")
        out = []
        for i, (row, m) in enumerate(zip(rows, mask.to(torch.long).cpu().tolist())):
            ones = [j for j, v in enumerate(m) if v]
            if ones and (ones[-1] - ones[0] + 1 != len(ones) or any(v not in (0, 1) for v in m)):
                raise ValueError(
                    f"row {i} of the mask of {name} must be one run of 1s (tokens) with 0s (padding) on either side"
                )
            out.append(row[ones[0] : ones[-1] + 1] if ones else [])
        return out
    if mask is not None:
        raise ValueError(f"a mask applies to a 2-D tensor of {name}, not to a list of sequences")
    seq = list(x)
    if seq and not any(hasattr(t, "__len__") for t in seq):  # no element is a row (a list, tensor or text)
        return [_ids(seq, name)]
    return [_ids(s, name) for s in seq]


def _ids(s: Any, name: str) -> list[int]:
    """One row of token ids; ``ValueError`` for anything else (ids are never truncated: floats are refused)."""
    if isinstance(s, torch.Tensor) and s.dim() != 1:
        raise ValueError(f"each of {name} must be a 1-D sequence of token ids, got shape {tuple(s.shape)}")
    if isinstance(s, (str, bytes)):
        raise ValueError(f"{name} must be token ids (tokenize the text first), got a {type(s).__name__}")
    if not isinstance(s, Iterable):
        raise ValueError(f"each of {name} must be a sequence of token ids, got a {type(s).__name__}")
    try:
        return as_token_list(s if isinstance(s, torch.Tensor) else list[Any](s))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
