"""What 8-bit K/V costs and saves: memory per cached token for each ``kv_dtype``, and fidelity against
the unquantized store over chat prompts with greedy decoding.

Memory: bytes per cached token of the pool tensors (codes and scales), measured on a store of each kind.
Fidelity: every prompt (a shared system prompt and its own question) is generated greedily with
``new`` tokens from an unquantized store (whose output equals stock ``generate``) and from a quantized
one. Reported: the share of the quantized store's greedy tokens that are identical, position by position,
to the reference (free running: after a first difference the two continue from different text), the
share of prompts whose whole answer is identical, the same share counted only over each answer's own
tokens (before the first step where the reference's argmax is an end-of-sequence token: ``min_new_tokens``
bans it there, and what follows is a continuation the model did not want), and, teacher-forced (the
quantized store reads the reference's own tokens, one forward), the share of positions whose argmax is
the reference's argmax (both unprocessed logits: the reference's tokens themselves differ from its argmax
where it wanted to end) and the largest logit difference. A ``bfloat16`` row (an unquantized store kept in
bfloat16 under the float32 model) is the yardstick: what storage rounded to 8 significant bits costs.
Models: the benchmark model (random weights, random-token prompts) and SmolLM2-135M-Instruct
(``prefixkv[real]``, real chat prompts) when installed.
Run: ``python benchmarks/quant.py [--prompts 50] [--new 32]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import model_for, save, table, target, tokens

import prefixkv

BS = 16
TOPICS = [
    "photosynthesis", "compound interest", "the water cycle", "binary search", "vaccines", "plate tectonics",
    "inflation", "recursion", "the French Revolution", "black holes", "composting", "unit testing",
    "the immune system", "supply and demand", "volcanoes", "public key cryptography", "sleep", "tides",
    "the printing press", "electric cars", "bread baking", "gravity", "version control", "coral reefs",
    "the stock market",
]  # fmt: skip
STYLES = ["Explain {} in two sentences.", "Give me one surprising fact about {}."]
SYSTEM = (
    "You are a concise, friendly assistant. Answer in plain language, avoid jargon, and keep every answer "
    "short enough to read in a few seconds."
)


def memory_rows(model: Any, name: str) -> list[dict[str, Any]]:
    """Bytes per cached token of each storage kind, from the pool tensors of a store over ``model``."""
    rows = []
    kinds: list[tuple[str, torch.dtype, str | None]] = [
        ("float32", torch.float32, None),
        ("bfloat16", torch.bfloat16, None),
        ("int8", torch.float32, "int8"),
        ("fp8", torch.float32, "fp8"),
    ]
    for label, dtype, kv in kinds:
        with prefixkv.PrefixStore(model, block_size=BS, dtype=dtype, kv_dtype=kv) as store:
            pool = store.pool
            held = sum(
                t.numel() * t.element_size() for t in (*pool.keys, *pool.values, *pool.key_scales, *pool.value_scales)
            )
            per_token = held / pool.capacity / BS
            assert held == pool.capacity * store.bytes_per_block
        rows.append({"model": name, "kind": label, "per_token": per_token})
    base = {r["kind"]: r["per_token"] for r in rows}
    for r in rows:
        r["vs_fp32"], r["vs_bf16"] = r["per_token"] / base["float32"], r["per_token"] / base["bfloat16"]
    return rows


def _generate(model: Any, store: prefixkv.PrefixStore, ids: torch.Tensor, new: int) -> Any:
    with prefixkv.PagedPrefixCache(store, ids) as cache:
        return model.generate(
            ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip


def _teacher_forced(model: Any, store: prefixkv.PrefixStore, prompt: torch.Tensor, sequence: torch.Tensor) -> Any:
    """Logits predicting each generated token of ``sequence`` when the store reads ``sequence`` itself (the
    prompt's cached part from the store, the rest in one forward)."""
    new = sequence.shape[1] - prompt.shape[1]
    with prefixkv.PagedPrefixCache(store, prompt) as cache, torch.no_grad():
        logits = model(sequence[:, cache.get_seq_length() : -1], cache=cache).logits
    return logits[0, -new:].double()


def _store(model: Any, kind: str) -> prefixkv.PrefixStore:
    """A store keeping K/V as ``kind``: ``"int8"``/``"fp8"`` (``kv_dtype``), or ``"bfloat16"`` (``dtype``: the
    unquantized store in half precision, a yardstick for what any 8- or 16-bit storage can reach)."""
    if kind == "bfloat16":
        return prefixkv.PrefixStore(model, block_size=BS, dtype=torch.bfloat16)
    return prefixkv.PrefixStore(model, block_size=BS, kv_dtype=kind)


def fidelity(model: Any, prompts: list[torch.Tensor], new: int, kv_dtypes: list[str]) -> dict[str, dict[str, Any]]:
    reference = prefixkv.PrefixStore(model, block_size=BS)
    stores = {kv: _store(model, kv) for kv in kv_dtypes}
    counts = {kv: {"same": 0, "whole": 0, "forced_same": 0, "max_diff": 0.0, "tokens": 0} for kv in kv_dtypes}
    for kv in kv_dtypes:
        counts[kv].update(answer_same=0, answer_tokens=0)
    eos = torch.tensor(model.generation_config.eos_token_id or []).flatten()
    for ids in prompts:
        ref = _generate(model, reference, ids, new)
        ref_new = ref.sequences[0, ids.shape[1] :]
        ref_logits = torch.cat([x.double() for x in ref.logits])
        ends = torch.isin(ref_logits.argmax(-1), eos).nonzero()
        answer = int(ends[0]) if len(ends) else new  # the reference answer's own tokens
        for kv, store in stores.items():
            c = counts[kv]
            out = _generate(model, store, ids, new)
            same = out.sequences[0, ids.shape[1] :] == ref_new
            c["same"] += int(same.sum())
            c["whole"] += int(bool(same.all()))
            c["tokens"] += len(ref_new)
            c["answer_same"] += int(same[:answer].sum())
            c["answer_tokens"] += answer
            forced = _teacher_forced(model, store, ids, ref.sequences)
            c["forced_same"] += int((forced.argmax(-1) == ref_logits.argmax(-1)).sum())
            c["max_diff"] = max(c["max_diff"], float((forced - ref_logits).abs().max()))
    for store in (reference, *stores.values()):
        store.close()
    return {
        kv: {
            "identical": c["same"] / c["tokens"],
            "whole": c["whole"] / len(prompts),
            "answer": c["answer_same"] / max(c["answer_tokens"], 1),
            "answer_tokens": c["answer_tokens"],
            "forced": c["forced_same"] / c["tokens"],
            "max_diff": c["max_diff"],
        }
        for kv, c in counts.items()
    }


def chat_prompts(tokenizer: Any, n: int) -> list[torch.Tensor]:
    questions = [style.format(t) for style in STYLES for t in TOPICS][:n]
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        for q in questions
    ]


def random_prompts(vocab: int, n: int) -> list[torch.Tensor]:
    system = tokens(64, vocab, seed=0)
    return [torch.cat([system, tokens(24, vocab, seed=1 + i)])[None] for i in range(n)]


def run(size: str, n: int, new: int, kv_dtypes: list[str], real: bool) -> dict[str, Any]:
    models: list[tuple[str, Any, list[torch.Tensor]]] = []
    bench = model_for(size)
    models.append((f"{size} (random weights)", bench, random_prompts(bench.config.vocab_size, n)))
    if real:
        model, tokenizer = prefixkv.models.smollm2(dtype=torch.float32)
        models.append(("SmolLM2-135M-Instruct", model, chat_prompts(tokenizer, n)))
    memory, quality = [], []
    for name, model, prompts in models:
        memory += memory_rows(model, name)
        with torch.no_grad():
            for kv, r in fidelity(model, prompts, new, kv_dtypes).items():
                quality.append({"model": name, "kind": kv, "prompts": len(prompts), "new": new, **r})
    return {"memory": memory, "fidelity": quality}


def report(result: dict[str, Any]) -> str:
    mem = table(
        ["model", "K/V kept as", "bytes per cached token", "vs float32 (target int8 <=0.27)", "vs bfloat16 (<=0.53)"],
        [
            [r["model"], r["kind"], f"{r['per_token']:.0f}", f"{r['vs_fp32']:.3f}", f"{r['vs_bf16']:.3f}"]
            for r in result["memory"]
        ],
    )
    fid = table(
        [
            "model",
            "kv_dtype",
            "prompts x new tokens",
            "identical greedy tokens (target >=98%)",
            "identical answers",
            "identical tokens within the answers",
            "teacher-forced argmax agreement",
            "max logit difference (teacher-forced)",
        ],
        [
            [
                r["model"],
                r["kind"],
                f"{r['prompts']} x {r['new']}",
                f"{100 * r['identical']:.1f}%"
                + (f" ({target(r['identical'] >= 0.98)})" if r["kind"] in ("int8", "fp8") else " (yardstick)"),
                f"{100 * r['whole']:.0f}%",
                f"{100 * r['answer']:.1f}% of {r['answer_tokens']}",
                f"{100 * r['forced']:.1f}%",
                f"{r['max_diff']:.3g}",
            ]
            for r in result["fidelity"]
        ],
    )
    return mem + "\n\n" + fid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument(
        "--kv-dtypes", nargs="+", default=["int8", "fp8", "bfloat16"], help="bfloat16: an unquantized store in bf16"
    )
    ap.add_argument("--no-real", action="store_true", help="skip SmolLM2 even if installed")
    args = ap.parse_args()
    real = not args.no_real
    if real:
        try:
            prefixkv.models.smollm2_path()
        except ImportError:
            real = False
    result = run(args.size, args.prompts, args.new, args.kv_dtypes, real)
    save("quant", result)
    print(report(result))


if __name__ == "__main__":
    main()
