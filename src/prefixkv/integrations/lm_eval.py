"""lm-evaluation-harness integration: the ``hf-prefixkv`` model, lm-eval's ``hf`` model with prefix caching.

Importing this module registers ``hf-prefixkv`` with lm-eval's model registry (``python -m prefixkv.lm_eval``
does it for command-line users). It takes the same ``model_args`` as ``hf``, plus ``prefix_block_size``,
``prefix_max_memory``, ``invariant`` and ``prefix_chunk_size`` for its :class:`~prefixkv.PrefixStore`.
``loglikelihood`` and ``loglikelihood_rolling`` score through :func:`prefixkv.score.logprob_rows`, so a
few-shot prefix that every request shares is computed once; ``generate_until`` calls ``generate`` on the
model that :func:`prefixkv.enable` patched, with the same store. Needs ``pip install -e '.[eval]'`` from a clone of
prefixkv (or ``bash scripts/setup.sh``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import Collator
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "prefixkv.integrations.lm_eval needs lm-evaluation-harness: run `pip install -e '.[eval]'` in a "
        "clone of prefixkv (or `bash scripts/setup.sh`)"
    ) from exc
from tqdm import tqdm

from ..enabling import enable
from ..score import logprob_rows
from ..store.prefix_store import PrefixStore

Request = tuple[tuple[str, str], list[int], list[int]]

# the lists that stores_made() hands out: every PrefixKVLM built inside it adds its store
_watching: list[list[PrefixStore]] = []


@contextlib.contextmanager
def stores_made() -> Iterator[list[PrefixStore]]:
    """The stores of the ``hf-prefixkv`` models that lm-eval builds inside the ``with`` block, in order: lm-eval
    builds its model from the command line's arguments, so this is how ``python -m prefixkv.lm_eval`` finds the
    store whose reuse it prints at the end."""
    stores: list[PrefixStore] = []
    _watching.append(stores)
    try:
        yield stores
    finally:
        _watching.remove(stores)


@register_model("hf-prefixkv")
class PrefixKVLM(HFLM):
    """lm-eval's ``HFLM`` whose requests reuse cached prefixes: the same arguments as ``hf`` (``pretrained`` is
    a name, a local folder or a model instance), plus ``prefix_block_size`` (tokens per cached block),
    ``prefix_max_memory`` (the store's budget, e.g. ``"2GiB"``; unbounded by default), ``invariant`` (the
    store's invariant schedule: every sample's log-likelihoods bit-identical whatever the store holds, so in
    any dtype they do not depend on the order of the documents or on what an earlier run cached) and
    ``prefix_chunk_size`` (its chunk length). The store is :attr:`store`. Results are those of ``hf``: the same
    log-likelihoods (to float rounding) and generations.
    """

    def __init__(
        self,
        pretrained: Any,
        prefix_block_size: int = 16,
        prefix_max_memory: int | str | None = None,
        invariant: bool = False,
        prefix_chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("mixed_precision_dtype") is not None:
            raise ValueError(
                "hf-prefixkv does not support mixed_precision_dtype (K/V computed under autocast would not be "
                "in the dtype the store holds); load the model in that dtype instead (dtype=...)"
            )
        super().__init__(pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"hf-prefixkv caches decoder-only (causal) models; this one is {self.backend}")
        self.store = PrefixStore(
            self.model,
            block_size=prefix_block_size,
            max_memory=prefix_max_memory,
            invariant=invariant,
            chunk_size=prefix_chunk_size,
        )
        enable(self.model, self.store)  # generate_until: HFLM calls model.generate
        for stores in _watching:
            stores.append(self.store)

    def _loglikelihood_tokens(
        self,
        requests: list[Request],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """``HFLM._loglikelihood_tokens`` (same order, batching, truncation, one-token-continuation grouping and
        answers) with each batch scored over the store instead of a full forward."""

        def collate(req: Request) -> tuple[int, tuple[int, ...]]:
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        def one_token_group(req: Request) -> list[int]:
            return req[-2] + req[-1][:-1]

        re_ord = Collator(
            requests, sort_fn=collate, group_by="contexts" if self.logits_cache else None, group_fn=one_token_group
        )
        auto = self.batch_size == "auto"
        batch_size = self.batch_size if not auto else override_bs if override_bs is not None else 0
        batch_fn = self._batch_scheduler if auto and len(re_ord) > 0 and not override_bs else None
        if batch_fn is not None:
            self.batch_sizes: dict[int, int] = {}  # as HFLM: detect again for these requests
        res: list[tuple[float, bool]] = []
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for chunk in re_ord.get_batched(n=batch_size, batch_fn=batch_fn):
            contexts, continuations = [], []
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc or len(continuation_enc) > self.max_length:
                    raise ValueError(
                        f"a loglikelihood request needs a context and a continuation of 1..{self.max_length} tokens, "
                        f"got {len(context_enc)} and {len(continuation_enc)}"
                    )
                # as HFLM: too long a request keeps its last max_length + 1 tokens, of which max_length are fed
                # (logprob_rows never feeds a continuation's last token)
                whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
                contexts.append(whole[: len(whole) - len(continuation_enc)])
                continuations.append(continuation_enc)
            rows = logprob_rows(self.store, contexts, continuations, softmax_dtype=self.softmax_dtype)
            for (request_str, ctx_tokens, _), lp, cont in zip(chunk, rows, continuations):
                logits = lp.unsqueeze(0)  # [1, len(cont), vocab]
                greedy_tokens = logits.argmax(dim=-1)
                for req_str, cont_toks, req_logits in re_ord.get_cache(
                    req_str=request_str, cxt_toks=ctx_tokens, cont_toks=cont, logits=logits
                ):
                    target = torch.tensor(cont_toks, dtype=torch.long, device=req_logits.device).unsqueeze(0)
                    is_greedy = bool((greedy_tokens[:, -target.shape[1] :] == target).all())
                    picked = torch.gather(req_logits, 2, target.unsqueeze(-1)).squeeze(-1)  # [1, len]
                    answer = (float(picked.sum()), is_greedy)
                    res.append(answer)
                    if req_str is not None:
                        self.cache_hook.add_partial("loglikelihood", req_str, answer)
                    pbar.update(1)
        pbar.close()
        result: list[tuple[float, bool]] = re_ord.get_original(res)
        return result
