"""Throughput on a realistic workload: 4 system prompts x 16 questions, 32 new tokens each.

A loop of plain ``generate``; the deepcopy recipe (each system prompt prefilled once, copied per
request); prefixkv one request per call; prefixkv with the 16 questions of a system prompt in one
left-padded batch; ``prefixkv.generate_many`` on the 64 prompts as they come; and transformers' continuous
batching (``generate_batch``, block-hash prefix sharing). Every variant's tokens are compared with the plain
loop's, which runs untimed when ``--variants`` leaves it out. With ``--repeat N`` the variants take turns N
times (each round starting one later in the list) and each reports its median. Run:
``python benchmarks/throughput.py [--size 100m] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import time
from typing import Any

import torch
from _common import model_for, save, table, target, tokens
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

import prefixkv


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def first_stop(row: list[int], eos: set[int]) -> list[int]:
    """A row's new tokens up to and with its first end-of-sequence token (after it a batch feeds padding)."""
    return next((row[: t + 1] for t, token in enumerate(row) if token in eos), row)


def run(
    size: str,
    systems: int,
    questions: int,
    system_len: int,
    new: int,
    variants: list[str],
    repeat: int = 1,
    stops: str = "none",
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Time ``variants`` on the workload. ``stops="none"``: every request gets ``new`` tokens (``min_new_tokens``);
    ``"varied"``: each request ends at its first end-of-sequence token, the tokens set as such chosen from what
    the model says, so that requests end anywhere from the first token to the last (half as long as they may be,
    on average), as a real model's answers do."""
    model = model_for(size)
    vocab = model.config.vocab_size
    prompts = [tokens(system_len, vocab, seed=s) for s in range(systems)]
    lengths = tokens(systems * questions, 48, seed=99).clamp(min=16)
    work = [
        (s, torch.cat([prompts[s], tokens(int(lengths[s * questions + q]), vocab, seed=1000 + s * questions + q)]))
        for s in range(systems)
        for q in range(questions)
    ]
    batch_size = batch_size or inspect.signature(prefixkv.generate_many).parameters["batch_size"].default
    gen: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    outputs: dict[str, list[list[int]]] = {}
    eos: set[int] = set()

    def plain() -> None:
        outputs["plain"] = [
            model.generate(ids[None], cache=DynamicCache(config=model.config), **gen)[0, len(ids) :].tolist()
            for _, ids in work
        ]

    if stops == "varied":
        # untimed, before any store touches the model: each request's whole answer; then the rarest tokens of the
        # answers, one by one while the answers stay half as long as they may be on average, end every answer
        # they appear in (a random model repeats itself, so a common token would end almost every answer at once)
        gen.update(min_new_tokens=None, eos_token_id=None)
        plain()
        answers = outputs["plain"]
        seen = {t for a in answers for t in a}
        for t in sorted(seen, key=lambda t: (sum(t in a for a in answers), t)):
            if statistics.mean(len(first_stop(a, eos | {t})) for a in answers) < new / 2:
                break
            eos.add(t)
        outputs["plain"] = [first_stop(answer, eos) for answer in answers]
        gen["eos_token_id"] = sorted(eos)
    elif stops != "none":
        raise ValueError(f"stops must be 'none' or 'varied', got {stops!r}")

    def rows(out: torch.Tensor, width: int) -> list[list[int]]:
        return [first_stop(row, eos) for row in out[:, width:].tolist()]

    def deepcopy_recipe() -> None:
        filled = []
        with torch.no_grad():
            for p in prompts:
                c = DynamicCache(config=model.config)
                model(p[None], cache=c)
                filled.append(c)
        outputs["deepcopy"] = [
            model.generate(ids[None], cache=copy.deepcopy(filled[s]), **gen)[0, len(ids) :].tolist() for s, ids in work
        ]

    def prefixkv_loop() -> None:
        store = prefixkv.PrefixStore(model, block_size=16)
        out = []
        for _, ids in work:
            with prefixkv.PagedPrefixCache(store, ids[None]) as cache:
                out.append(model.generate(ids[None], cache=cache, **gen)[0, len(ids) :].tolist())
        store.close()
        outputs["prefixkv"] = out

    def prefixkv_batched() -> None:
        store = prefixkv.PrefixStore(model, block_size=16)
        out = []
        for s in range(systems):
            # prefill the system prompt once (one row), then the 16 questions share it in one batch
            with prefixkv.PagedPrefixCache(store, prompts[s][None]) as warm:
                model.generate(prompts[s][None], cache=warm, max_new_tokens=1, pad_token_id=0)
            ids, mask = left_pad([ids for t, ids in work if t == s])
            with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
                out.extend(rows(model.generate(ids, attention_mask=mask, cache=cache, **gen), ids.shape[1]))
        store.close()
        outputs["prefixkv_batched"] = out

    def many(name: str, refill: bool | None) -> None:
        store = prefixkv.PrefixStore(model, block_size=16)
        results = prefixkv.generate_many(
            model, [ids for _, ids in work], store=store, progress=False, refill=refill, batch_size=batch_size, **gen
        )
        store.close()
        outputs[name] = [g.tokens for g in results]

    def continuous_batching() -> None:
        config = GenerationConfig(
            max_new_tokens=new, do_sample=False, eos_token_id=gen.get("eos_token_id") or -1, pad_token_id=0
        )
        # a cache sized for the workload (the default sizes itself from free accelerator memory)
        tokens_needed = sum(len(ids) + new for _, ids in work)
        cb = ContinuousBatchingConfig(page_size=16, num_blocks=tokens_needed // 16 + len(work), max_batch_tokens=2048)
        result = model.generate_batch(
            [ids.tolist() for _, ids in work],
            generation_config=config,
            continuous_batching_config=cb,
            progress_bar=False,
        )
        outputs["generate_batch"] = [first_stop(r.generated_tokens[:new], eos) for r in result.values()]

    table_ = {
        "plain": plain,
        "deepcopy": deepcopy_recipe,
        "prefixkv": prefixkv_loop,
        "prefixkv_batched": prefixkv_batched,
        "generate_many": lambda: many("generate_many", None),
        "generate_many_batches": lambda: many("generate_many_batches", False),
        "generate_batch": continuous_batching,
    }
    if "plain" not in variants and "plain" not in outputs:
        plain()  # untimed, first (before any store touches the model): the tokens every variant must give
    runs: dict[str, list[float]] = {name: [] for name in variants}
    same = dict.fromkeys(variants, True)
    for r in range(repeat):
        for name in variants[r % len(variants) :] + variants[: r % len(variants)]:
            start = time.perf_counter()
            table_[name]()
            runs[name].append(time.perf_counter() - start)
            same[name] &= outputs[name] == outputs["plain"]
    seconds = {name: statistics.median(runs[name]) for name in variants}
    said = [len(a) for a in outputs["plain"]]
    # the share of generate_many's batches' decode steps (refill=False: each to its longest row's end) that feed a
    # row which has ended: what refilling can save
    store = prefixkv.PrefixStore(model, block_size=16)
    batches = prefixkv.many.batches.batch_rows([ids.tolist() for _, ids in work], store, batch_size, new)
    store.close()
    steps = sum(len(b) * max(said[i] for i in b) for b in batches)
    return {
        "padded_steps": 1 - sum(said) / steps,
        "batch_size": batch_size,
        "size": size,
        "requests": len(work),
        "system_len": system_len,
        "new_tokens": new,
        "stops": stops,
        "answer_tokens": {"mean": statistics.mean(said), "min": min(said), "max": max(said)},
        "seconds": seconds,
        "runs": runs,
        "same_as_plain": same,
    }


def report(r: dict[str, Any]) -> str:
    base = r["seconds"].get("plain")
    cb = r["seconds"].get("generate_batch")
    batched = r["seconds"].get("prefixkv_batched")
    rows = []
    for name, s in r["seconds"].items():
        speedup = f"{base / s:.2f}x" if base else "-"
        goal = ""
        if name == "generate_many" and base:
            ok = base / s >= 6 and (batched is None or batched / s >= 1.3) and (cb is None or cb / s >= 2)
            goal = target(ok) + " (>= 6x plain, 1.3x prefixkv_batched, 2x generate_batch)"
        elif name.startswith("prefixkv") and base:
            goal = target(base / s >= 3 and (cb is None or s < cb))
        rows.append(
            [name, f"{s:.1f}", f"{r['requests'] / s:.2f}", speedup, "yes" if r["same_as_plain"][name] else "no", goal]
        )
    note = (
        f"\n\nIn whole batches of {r['batch_size']}, {r['padded_steps']:.0%} of the rows' decode steps feed a row "
        "that has ended."
    )
    return table(
        [
            f"{r['requests']} requests, {r['system_len']}-token system prompts, "
            + (
                f"{r['new_tokens']} new tokens each"
                if r["stops"] == "none"
                else "answers of {min}-{max} tokens (mean {mean:.1f})".format(**r["answer_tokens"])
            ),
            "seconds",
            "requests/s",
            "vs plain loop",
            "same tokens as plain",
            "target: >= 3x plain, ahead of generate_batch",
        ],
        rows,
    ) + (note if r["stops"] == "varied" else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=[
            "plain",
            "deepcopy",
            "prefixkv",
            "prefixkv_batched",
            "generate_many",
            "generate_many_batches",
            "generate_batch",
        ],
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--stops",
        choices=["none", "varied"],
        default="none",
        help="none: every request gets --new-tokens tokens; varied: requests end at end-of-sequence tokens, anywhere",
    )
    ap.add_argument("--batch-size", type=int, default=None, help="generate_many's batch_size (default: its own)")
    args = ap.parse_args()
    result = run(
        args.size,
        args.systems,
        args.questions,
        args.system_len,
        args.new_tokens,
        args.variants,
        args.repeat,
        args.stops,
        args.batch_size,
    )
    save("throughput", result)
    print(report(result))


if __name__ == "__main__":
    main()
