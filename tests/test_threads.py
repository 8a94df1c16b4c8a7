"""Several threads run ``generate`` on one model and one store at once, each with its own cache, through
a pool small enough to evict: every output is stock generate's and the store stays consistent, checked
by another thread while they run."""

from __future__ import annotations

import random
import threading
from typing import Any

import torch
from conftest import assert_no_leak, max_logit_diff, random_tokens
from transformers import DynamicCache

import prefixkv

THREADS = 4
PER_THREAD = 6


def run(model: Any, ids: torch.Tensor, cache: Any) -> Any:
    return model.generate(
        ids,
        cache=cache,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )


def test_threads_share_one_model_and_one_store(llama64: Any) -> None:
    rng = random.Random(0)
    system = random_tokens(24, seed=1)
    prompts = [
        torch.cat([system[: rng.randrange(8, 25)], random_tokens(rng.randrange(2, 12), seed=10 + i)])[None]
        for i in range(THREADS * PER_THREAD)
    ]
    refs = [run(llama64, ids, DynamicCache(config=llama64.config)) for ids in prompts]
    store = prefixkv.PrefixStore(llama64, block_size=4, num_blocks=40)
    store.pin(system[:8])
    failures: list[str] = []
    reused: list[int] = []
    done = threading.Event()
    start = threading.Barrier(THREADS + 1)

    def worker(k: int) -> None:
        start.wait()
        try:
            for i in range(k, len(prompts), THREADS):
                with prefixkv.PagedPrefixCache(store, prompts[i]) as cache:
                    out = run(llama64, prompts[i], cache)
                reused.append(cache.stats.cached_tokens)
                diff = max_logit_diff(out.logits, refs[i].logits)
                if diff > 1e-6 or not torch.equal(out.sequences, refs[i].sequences):
                    failures.append(f"prompt {i}: max logit diff {diff}")
        except BaseException as err:
            failures.append(f"thread {k}: {err!r}")

    checks = 0

    def monitor() -> None:
        nonlocal checks
        start.wait()
        while not done.is_set():
            try:
                store.check_invariants()
            except BaseException as err:
                failures.append(f"check_invariants while running: {err}")
                return
            checks += 1

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    watcher = threading.Thread(target=monitor)
    for t in [*workers, watcher]:
        t.start()
    for t in workers:
        t.join()
    done.set()
    watcher.join()
    assert not failures, failures
    assert checks > 0 and len(reused) == len(prompts) and sum(reused) > 0
    assert store.stats.evictions > 0
    assert_no_leak(store, pinned=2)
    store.close()
