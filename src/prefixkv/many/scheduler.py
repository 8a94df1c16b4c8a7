"""The refill of ``generate_many`` as a scheduler: prompts ``waiting``, rows ``running``, and a loop of three
steps. ``admit`` moves waiting prompts into the free places; ``step`` is one ``generate`` call on the running
rows, ended early once half of them are done while a waiting prompt could join; ``retire`` takes each row's new
tokens, and the rows done leave. A row not done goes on in the next call with its tokens so far as its prompt,
whose K/V its call published (docs/generate.md, "Many prompts at once").

Which prompts join carried-on rows is the one choice that makes: a call feeds every row the same number of last
columns (``generate`` slices one width for the batch), so a joining prompt's uncomputed part makes every
carried-on row compute as many columns again. A prompt joins them only when at most :data:`JOIN` blocks of it
are left to compute; a prefix that the next waiting prompts share and that neither the store nor a running row
holds is computed once, alone, before the call (the work it needs anyway), so that those prompts can join. In an
invariant store what is left to compute is counted against the prompts and prefixes this run computed, never
against what the store holds: which prompts join, and so every row's results, follow the prompts alone
(docs/correctness.md, "Outputs that never depend on the cache").
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..base.tokens import common_length
from ..store.prefix_store import PrefixStore

# how many blocks of a prompt may be left to compute when it joins running rows
JOIN = 4
# how many of the prompts and prefixes it computed last an invariant store's refilling compares a prompt with
RECENT = 64


@dataclass
class Row:
    """A prompt being generated: its place in the input, its tokens, its cached prompt tokens (once its first
    call has run) and its new tokens so far (with their logits and scores)."""

    index: int
    prompt: list[int]
    cached: int | None = None
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)


class EndEarly(StoppingCriteria):
    """Ends a ``generate`` call of the scheduler early, once ``enough`` of its rows are done and other prompts
    wait for their places: a row is done at an end-of-sequence token, a stop string, or when it has its ``budget``
    of new tokens (as ``generate`` on it alone would end). Rows done go on being fed padding until then, as in any
    batched call. ``enough=None`` never ends the call early."""

    def __init__(
        self, width: int, budgets: list[int], eos: set[int], stop: StoppingCriteria | None, enough: int | None
    ):
        self.width, self.enough, self.stop = width, enough, stop
        self.budgets = torch.tensor(budgets)
        self.eos = torch.tensor(sorted(eos), dtype=torch.long)
        self.done = torch.zeros(len(budgets), dtype=torch.bool)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        last = input_ids[:, -1].cpu()
        now = (input_ids.shape[1] - self.width >= self.budgets) | torch.isin(last, self.eos)
        if self.stop is not None:
            now |= self.stop(input_ids, scores).cpu()
        self.done |= now
        if self.enough is not None and int(self.done.sum()) >= self.enough:
            return torch.ones_like(self.done, device=input_ids.device)  # type: ignore[return-value]
        return self.done.to(input_ids.device)  # type: ignore[return-value]


@dataclass
class Scheduler:
    """The prompts of one ``generate_many`` call refilled as they end: ``waiting`` (prompt index and blocks
    needed, the next one last) and ``running`` (rows with the blocks they need), at most ``batch_size`` rows and
    ``room`` blocks at a time (``None``: no budget). :meth:`rows` runs them all."""

    # one left-padded generate call (generate_many's run): its output, padded width and each row's cached prompt
    # tokens (sources: each row's prompt in the input, for the processors that read it); and the taking of batch row
    # j's new tokens from an output, whether the row is done
    call: Callable[..., tuple[Any, int, list[int]]]
    take: Callable[[Row, Any, int, int, int], bool]
    prompts: list[list[int]]
    masks: list[list[int]]  # each prompt's attention mask as generate infers it
    store: PrefixStore
    namespace: str | None
    batch_size: int
    new_tokens: int
    room: int | None
    eos: set[int]
    stop: StoppingCriteria | None
    waiting: list[tuple[int, int]]
    running: list[tuple[Row, int]] = field(default_factory=list)
    # in an invariant store, the last prompts and prefixes this run computed (:meth:`uncached`)
    computed: collections.deque[list[int]] = field(default_factory=lambda: collections.deque(maxlen=RECENT))
    limit: int = field(init=False)

    def __post_init__(self) -> None:
        # at most this many tokens of a prompt left to compute when it joins running rows; in an invariant store a
        # prompt's last part-filled chunk is computed by every call it is in
        self.limit = max(JOIN * self.store.block_size, self.store.chunk_size or 0)

    def rows(self) -> Iterator[Row]:
        """Every prompt's row, as it is done. Mutates the store, ``waiting`` and ``running``."""
        while self.running or self.waiting:
            end_early = self.admit()
            yield from self.retire(*self.step(end_early))

    def admit(self) -> bool:
        """Move waiting prompts into running rows while one has a place (:meth:`has_place`) and, where rows carry
        on from the call before, may join them (:meth:`next_may_join`; a call of new rows only takes the next
        prompts as they come, as a batch of ``batches.batch_rows`` does). Whether a prompt still waiting may join the
        next call: it then ends once half its rows are done. Mutates ``waiting``, ``running``, ``computed`` and the
        store (:meth:`next_may_join`)."""
        fresh, need = not self.running, sum(blocks for _, blocks in self.running)
        while self.waiting and self.has_place(need) and (fresh or self.next_may_join()):
            i, blocks = self.waiting.pop()
            self.running.append((Row(i, self.prompts[i]), blocks))
            self.computed.append(self.prompts[i])
            need += blocks
        return bool(self.waiting) and self.next_may_join()

    def has_place(self, need: int) -> bool:
        """Whether the next waiting prompt has a place beside the running rows, which need ``need`` blocks: the
        first row always; then fewer than ``batch_size`` rows, within ``room``. Does not mutate."""
        if not self.running:
            return True
        return len(self.running) < self.batch_size and (self.room is None or need + self.waiting[-1][1] <= self.room)

    def next_may_join(self) -> bool:
        """Whether the next waiting prompt may join running rows: at most ``limit`` of its tokens left to compute
        (:meth:`uncached`), after computing alone the prefix it shares with the prompt after it
        (:meth:`compute_shared_prefix`). Mutates the store and ``computed`` then."""
        self.compute_shared_prefix()
        return self.uncached(self.waiting[-1][0]) <= self.limit

    def compute_shared_prefix(self) -> None:
        """Compute alone the prefix (whole blocks) the next waiting prompt shares with the prompt after it, where
        neither the store nor a running row holds more than :data:`JOIN` blocks short of it (for user
        ``namespace``). Mutates the store and ``computed``."""
        i = self.waiting[-1][0]
        prompt, bs = self.prompts[i], self.store.block_size
        shared = 0 if len(self.waiting) < 2 else common_length(prompt, self.prompts[self.waiting[-2][0]]) // bs * bs
        missing = self.uncached(i) - (len(prompt) - shared)
        if missing > JOIN * bs:
            self.store.warm([prompt[:shared]], progress=False, namespace=self.namespace)
            self.computed.append(prompt[:shared])

    def uncached(self, i: int) -> int:
        """How many of prompt ``i``'s tokens neither the store nor (in whole blocks) a running row holds. In an
        invariant store, the tokens that none of the last :data:`RECENT` prompts and prefixes this run computed
        holds in whole chunks (``computed``), whatever the store holds. Does not mutate."""
        prompt, bs, chunk = self.prompts[i], self.store.block_size, self.store.chunk_size
        if chunk is not None:
            return len(prompt) - max((common_length(prompt, p) // chunk * chunk for p in self.computed), default=0)
        held = max((common_length(prompt, row.prompt) // bs * bs for row, _ in self.running), default=0)
        return len(prompt) - max(
            held, self.store.cached_length(prompt, self.store.blocks.space(), namespace=self.namespace)
        )

    def step(self, end_early: bool) -> tuple[Any, int, list[int], list[int]]:
        """One ``generate`` call on the running rows, each with its tokens so far as its prompt and its new tokens
        attended (as in one call that goes on: generate appends 1s), ended once half the rows are done if
        ``end_early``: its output, padded width, each row's cached prompt tokens and new-token budget. Mutates the
        store."""
        rows = [row for row, _ in self.running]
        budgets = [self.new_tokens - len(r.tokens) for r in rows]
        prompts = [r.prompt + r.tokens for r in rows]
        width = max(len(p) for p in prompts)
        end = EndEarly(width, budgets, self.eos, self.stop, -(-len(rows) // 2) if end_early else None)
        out, width, cached = self.call(
            prompts,
            masks=[self.masks[r.index] + [1] * len(r.tokens) for r in rows],
            sources=[r.prompt for r in rows],
            max_new_tokens=max(budgets),
            stopping_criteria=StoppingCriteriaList([end]),
        )
        return out, width, cached, budgets

    def retire(self, out: Any, width: int, cached: list[int], budgets: list[int]) -> list[Row]:
        """Take each running row's new tokens of the call's ``out`` (its cached prompt tokens from its first
        call); the rows done leave ``running`` and are returned, in batch order. Mutates ``running`` and its
        rows."""
        done: list[tuple[Row, int]] = []
        still: list[tuple[Row, int]] = []
        for j, ((row, blocks), budget) in enumerate(zip(self.running, budgets)):
            if row.cached is None:
                row.cached = cached[j]
            (done if self.take(row, out, j, width, budget) else still).append((row, blocks))
        self.running = still
        return [row for row, _ in done]
