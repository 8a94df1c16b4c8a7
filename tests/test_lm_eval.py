"""The lm-eval integration (``hf-prefixkv``) against lm-eval's own ``hf`` model on tiny local tasks: the same
per-sample answers and scores, for loglikelihood (multiple choice), loglikelihood_rolling and generate_until,
at batch sizes 1 and 4, with the store actually reused. No network: the tasks are JSON files written here."""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

import pytest
import torch
from conftest import compare

import prefixkv

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from prefixkv.integrations.lm_eval import PrefixKVLM
from prefixkv.lm_eval import main

SYLLABLES = [c + v for c in "bdfgk" for v in "aeiou"]


def _docs(n: int, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(SYLLABLES[int(i)] for i in torch.randint(0, len(SYLLABLES), (k,), generator=g))

    return [
        {
            "question": words(int(torch.randint(3, 8, (1,), generator=g))),
            "choices": [words(int(torch.randint(1, 4, (1,), generator=g))) for _ in range(3)],
            "answer": int(torch.randint(0, 3, (1,), generator=g)),
            "target": words(2),
            "text": words(int(torch.randint(20, 60, (1,), generator=g))),
        }
        for _ in range(n)
    ]


def write_tasks(folder: pathlib.Path, docs: int = 6, shots: int = 3) -> pathlib.Path:
    """Three local tasks over one JSON file: multiple choice and generation with a fixed ``first_n``
    few-shot prefix, and rolling log-likelihood."""
    data = folder / "docs.json"
    data.write_text(json.dumps(_docs(docs + shots, seed=0)))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n    train: {data}\n"
        "test_split: test\nfewshot_split: train\n"
    )
    fewshot = f"num_fewshot: {shots}\nfewshot_config:\n  sampler: first_n\n"
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common + fewshot + "output_type: multiple_choice\n"
        'description: "la be di ko fu ga ke bi do fa. "\n'
        'doc_to_text: "{{question}} ?"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + fewshot + "output_type: generate_until\n"
        'doc_to_text: "{{question}} ?"\ndoc_to_target: "{{target}}"\n'
        "generation_kwargs:\n  until: ['?']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\n" + common + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
    )
    return folder


def evaluate(lm: Any, folder: pathlib.Path, tasks: list[str], docs: int | None = None) -> dict[str, Any]:
    return simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=True,
        limit=docs,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def responses(result: dict[str, Any], task: str) -> list[Any]:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    os.environ.setdefault("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def _model() -> Any:
    return prefixkv.models.tiny_model("llama", dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(tasks: pathlib.Path) -> dict[int, dict[str, Any]]:
    """lm-eval's ``hf`` model on the three tasks at batch sizes 1 and 4."""
    tok = prefixkv.models.tiny_tokenizer()
    return {
        bs: evaluate(
            HFLM(pretrained=_model(), tokenizer=tok, batch_size=bs), tasks, ["tiny_mc", "tiny_gen", "tiny_ppl"]
        )
        for bs in (1, 4)
    }


@pytest.mark.parametrize("batch_size", [1, 4])
def test_hf_prefixkv_gives_the_results_of_hf(
    tasks: pathlib.Path, reference: dict[int, dict[str, Any]], batch_size: int
) -> None:
    model = _model()
    lm = PrefixKVLM(
        pretrained=model, tokenizer=prefixkv.models.tiny_tokenizer(), batch_size=batch_size, prefix_block_size=4
    )
    result = evaluate(lm, tasks, ["tiny_mc", "tiny_gen", "tiny_ppl"])
    ref = reference[batch_size]
    for task in ("tiny_mc", "tiny_ppl"):
        got, want = responses(result, task), responses(ref, task)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            for (lg, *rest_g), (lw, *rest_w) in zip(_flat(g), _flat(w)):
                assert abs(lg - lw) < 1e-6, (task, lg, lw)
                assert rest_g == rest_w
    assert responses(result, "tiny_gen") == responses(ref, "tiny_gen")
    for task in ("tiny_mc", "tiny_gen", "tiny_ppl"):
        assert result["results"][task] == pytest.approx(ref["results"][task]), task
    stats = lm.store.stats
    assert stats.hit_rate > 0.5, stats  # the few-shot prefix was reused
    lm.store.check_invariants()
    # what the run published serves an ordinary later request exactly (a poisoned block shows only here)
    (context, continuation) = result["samples"]["tiny_mc"][0]["arguments"][0]
    ids = torch.tensor([[*lm.tok_encode(context + continuation), 5, 6, 7]])
    later = compare(model, lm.store, ids, max_new_tokens=3)
    assert later.cache.stats.cached_tokens >= ids.shape[1] - 3 - 4
    assert later.max_diff < 1e-6 and later.same_tokens
    prefixkv.disable(model)
    lm.store.close()


def test_the_launcher_runs_lm_eval_with_hf_prefixkv(
    tasks: pathlib.Path, reference: dict[int, dict[str, Any]], tmp_path: pathlib.Path, capsys: Any
) -> None:
    """``python -m prefixkv.lm_eval`` with ``--log_samples``: every sample's log-likelihoods (within 1e-6) and
    generated text are those of lm-eval's ``hf`` model, and so are the aggregate metrics; at the end it prints
    the store's reuse (the few-shot examples every prompt shares are reused)."""
    model_dir = tmp_path / "model"
    _model().save_pretrained(model_dir)
    prefixkv.models.tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "out"
    main(
        [
            "--model", "hf-prefixkv",
            "--model_args", f"pretrained={model_dir},dtype=float64,prefix_block_size=4",
            "--tasks", "tiny_mc,tiny_gen",
            "--include_path", str(tasks),
            "--device", "cpu",
            "--batch_size", "4",
            "--output_path", str(out),
            "--log_samples",
        ]
    )  # fmt: skip
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    found = re.fullmatch(
        r"hf-prefixkv store: reused (\d+) of (\d+) prompt tokens \([\d.]+%\) over (\d+) looked-up rows", last
    )
    assert found, last
    reused, total, rows = map(int, found.groups())
    assert 0 < reused < total and rows > 0, last
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert results[task][metric] == pytest.approx(reference[4]["results"][task][metric])
    for task in ("tiny_mc", "tiny_gen"):
        (log,) = out.rglob(f"samples_{task}_*.jsonl")
        samples = [json.loads(line) for line in log.read_text().splitlines()]
        got = [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
        want = responses(reference[4], task)
        assert len(got) == len(want) == 9  # every doc of the file (6, and the 3 few-shot ones)
        if task == "tiny_gen":
            assert got == want
            continue
        for g, w in zip(got, want):
            assert len(g) == len(w) == 3  # one log-likelihood per choice
            for (lg, *rest_g), (lw, *rest_w) in zip(_flat(g), _flat(w)):
                assert abs(float(lg) - lw) < 1e-6, (lg, lw)
                assert [str(x) for x in rest_g] == [str(x) for x in rest_w]


def _flat(resps: list[Any]) -> list[tuple[Any, ...]]:
    """``[[(logprob, is_greedy)], ...]`` or ``[[logprob], ...]`` as tuples."""
    out = []
    for r in resps:
        item = r[0]
        out.append(tuple(item) if isinstance(item, (list, tuple)) else (item,))
    return out
