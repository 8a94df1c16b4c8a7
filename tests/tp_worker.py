"""One process of tests/test_tensor_parallel.py, run by ``torchrun --nproc-per-node 2`` (gloo, CPU): a tiny float64
Llama (4 heads, 2 K/V heads) split with transformers' tensor parallelism (``tp_plan="auto"``), every public path of
prefixkv on it compared with stock ``generate`` on an untouched twin under the same plan (logits within 1e-6), the
stores' decisions compared across the processes after every call (:func:`prefixkv.store.parallel.check_ranks_agree`),
and an ordinary request after every odd path. Rank 0 writes what it checked as JSON to ``argv[1]/result.json``;
any failed check raises, and torchrun exits non-zero."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch._dynamo.utils import counters

import prefixkv
from prefixkv.base.errors import PersistError
from prefixkv.kv.ranks import gathered, model_ranks
from prefixkv.store.parallel import check_ranks_agree

TOLERANCE = 1e-6
PROMPT = [5 + (7 * i) % 200 for i in range(19)]  # 19 ids: 4 whole blocks of 4 and a part
OTHER = PROMPT[:10] + [201 + i for i in range(9)]  # shares 10 ids (2 whole blocks) with PROMPT
checked: dict[str, float] = {}


def generate(model: Any, ids: torch.Tensor, cache: Any = None, seed: int = 0, **kw: Any) -> Any:
    """``generate`` with logits out, the same seed in every process (transformers seeds nothing for TP)."""
    torch.manual_seed(seed)
    extra = {} if cache is None else {"past_key_values": cache}
    kw = {"max_new_tokens": 5, "do_sample": False, **kw}
    return model.generate(ids, output_logits=True, return_dict_in_generate=True, pad_token_id=0, **extra, **kw)


def same(name: str, out: Any, ref: Any, group: Any) -> float:
    """Raise unless ``out`` has ``ref``'s tokens and logits within the bound, in every process alike."""
    assert torch.equal(out.sequences, ref.sequences), (name, out.sequences, ref.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits, strict=True))
    assert diff <= TOLERANCE, (name, diff)
    sequences = gathered(out.sequences.tolist(), group)
    assert all(s == sequences[0] for s in sequences), (name, sequences)
    checked[name] = max(checked.get(name, 0.0), diff)
    return diff


def compare(
    name: str, model: Any, twin: Any, store: Any, ids: list[list[int]] | torch.Tensor, mask: Any = None, **kw: Any
) -> Any:
    """A ``PagedPrefixCache`` call against stock on the twin; then the ranks' decisions compared. The cache."""
    ids = torch.tensor(ids) if isinstance(ids, list) else ids
    ranks = model_ranks(model)
    ref = generate(twin, ids, attention_mask=mask, **kw)
    with prefixkv.PagedPrefixCache(store, ids, mask) as cache:
        out = generate(model, ids, cache, attention_mask=mask, **kw)
        same(name, out, ref, ranks)
    store.check_invariants()
    check_ranks_agree(store)
    return cache


def ordinary(name: str, model: Any, twin: Any, store: Any) -> None:
    """The later ordinary request after an odd path: a warm greedy call, as stock."""
    compare(f"{name}, then an ordinary request", model, twin, store, [PROMPT])


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = out_dir / "model"
    if rank == 0:
        prefixkv.models.tiny_model("llama", dtype=torch.float64).save_pretrained(path)
    dist.barrier()

    def load() -> Any:
        return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float64).eval()

    model, twin = load(), load()
    ranks = model_ranks(model)
    assert ranks is not None and ranks.size == 2, "the model is not split: transformers' tp_plan did not apply"
    info: dict[str, Any] = {"world_size": ranks.size, "heads": model.config.num_attention_heads}
    info["kv_heads"] = model.config.num_key_value_heads

    with prefixkv.PrefixStore(model, block_size=4) as store:
        info["pool_kv_heads"] = gathered(store.pool.specs[0].kv_heads, ranks)
        compare("greedy, cold", model, twin, store, [PROMPT])
        warm = compare("greedy, warm", model, twin, store, [PROMPT])
        assert warm.stats.cached_tokens == len(PROMPT) - 1, warm.stats
        compare("greedy, partly warm", model, twin, store, [OTHER])
        compare("sampling", model, twin, store, [PROMPT], do_sample=True, seed=3, top_k=0)
        compare("beams", model, twin, store, [PROMPT], num_beams=2, num_return_sequences=2)
        padded = torch.tensor([PROMPT, [0, 0, 0, *OTHER[:16]]])
        mask = (padded != 0).long()
        mask[0] = 1
        compare("padded batch", model, twin, store, padded, mask)
        ordinary("beams and a padded batch", model, twin, store)

        store.pin(PROMPT[:12])
        assert store.stats.blocks_pinned >= 3, store.stats
        check_ranks_agree(store)
        compare("pinned prefix", model, twin, store, [[*PROMPT[:12], 77, 78, 79]])
        store.unpin(PROMPT[:12])
        check_ranks_agree(store)
        ordinary("pin and unpin", model, twin, store)

        # enable: generate without a cache reuses the store
        prefixkv.enable(model, store)
        try:
            ref = generate(twin, torch.tensor([PROMPT]))
            same("enable", generate(model, torch.tensor([PROMPT])), ref, ranks)
            check_ranks_agree(store)
        finally:
            prefixkv.disable(model)
        ordinary("enable and disable", model, twin, store)

        prompts = [PROMPT, OTHER, [*PROMPT[:9], 3, 4]]
        many = prefixkv.generate_many(
            model, prompts, store=store, batch_size=2, progress=False, max_new_tokens=4, output_logits=True
        )
        for g in many:
            ref = generate(twin, torch.tensor([g.prompt]), max_new_tokens=4)
            assert g.tokens == ref.sequences[0, len(g.prompt) :].tolist(), ("generate_many", g.index)
            assert g.logits is not None
            diff = (g.logits - torch.stack(ref.logits)[:, 0]).abs().max().item()
            assert diff <= TOLERANCE, ("generate_many", diff)
            checked["generate_many"] = max(checked.get("generate_many", 0.0), diff)
        check_ranks_agree(store)
        ordinary("generate_many", model, twin, store)

        continuations = [[9, 8, 7], [6, 5]]
        scores = prefixkv.score(model, store, [PROMPT, OTHER], continuations)
        for context, continuation, s in zip([PROMPT, OTHER], continuations, scores, strict=True):
            with torch.no_grad():
                logits = twin(torch.tensor([context + continuation])).logits[0, len(context) - 1 : -1]
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(continuation)[:, None])[:, 0]
            diff = (s.logprobs - want).abs().max().item()
            assert diff <= TOLERANCE, ("score", diff)
            checked["score"] = max(checked.get("score", 0.0), diff)
        check_ranks_agree(store)
        ordinary("score", model, twin, store)

        mine, theirs = out_dir / f"prefixes-rank{rank}.safetensors", out_dir / f"prefixes-rank{1 - rank}.safetensors"
        store.save(mine)
    dist.barrier()

    with prefixkv.PrefixStore.load(mine, model) as loaded:
        check_ranks_agree(loaded)
        cache = compare("loaded from this rank's file", model, twin, loaded, [PROMPT])
        assert cache.stats.cached_tokens == len(PROMPT) - 1, cache.stats
    try:
        prefixkv.PrefixStore.load(theirs, model).close()
        raise AssertionError("the other rank's file was loaded")
    except PersistError as e:
        assert f"rank {1 - rank} of 2" in str(e), e
        info["refusal"] = str(e)
    with prefixkv.PrefixStore(model, block_size=4) as store:
        compare("cold", model, twin, store, [PROMPT])
        ordinary("the other rank's file refused", model, twin, store)

    # the disk tier: both processes share one directory, each reads back its own files
    with prefixkv.PrefixStore(model, block_size=4, num_blocks=6, offload="disk", offload_dir=out_dir / "tier") as store:
        compare("disk tier, cold", model, twin, store, [PROMPT])
        compare("disk tier, another prompt", model, twin, store, [[100 + i for i in range(19)]])
        cache = compare("disk tier, restored", model, twin, store, [PROMPT])
        assert store.tier is not None and store.tier.stats.restored > 0, store.tier and store.tier.stats
        assert cache.stats.cached_tokens > 0, cache.stats
        ordinary("the disk tier", model, twin, store)

    # invariant mode: warm bit-identical to cold at a fixed world size
    with prefixkv.PrefixStore(model, block_size=4, invariant=True, chunk_size=8) as store:
        ids = torch.tensor([PROMPT])
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            cold = generate(model, ids, cache)
        with prefixkv.PagedPrefixCache(store, ids) as cache:
            hot = generate(model, ids, cache)
            assert cache.stats.cached_tokens == 16, cache.stats  # whole chunks of 8
        assert all(torch.equal(a, b) for a, b in zip(cold.logits, hot.logits, strict=True)), "warm is not cold"
        same("invariant, cold", cold, generate(twin, ids), ranks)
        check_ranks_agree(store)
        ordinary("invariant mode", model, twin, store)

    # the compiled step: generate compiles a split model's decode steps (dynamo alone; on the CPU when asked)
    config = transformers.CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    ids = torch.tensor([PROMPT])
    ref = generate(twin, ids, cache_implementation="static", compile_config=config)
    same("compiled stock against eager stock", ref, generate(twin, ids), ranks)
    with prefixkv.PrefixStore(model, block_size=4) as store:
        for name in ("compiled step, cold", "compiled step, warm"):
            graphs = counters["stats"]["unique_graphs"]
            with prefixkv.PagedPrefixCache(store, ids, compileable=True) as cache:
                same(name, generate(model, ids, cache, compile_config=config), ref, ranks)
            assert name.endswith("warm") or counters["stats"]["unique_graphs"] > graphs, "no step was compiled"
            check_ranks_agree(store)
        assert cache.stats.cached_tokens == len(PROMPT) - 1, cache.stats
        ordinary("the compiled step", model, twin, store)

    # the budget: the processes keep the least of what each was given
    budget = store.bytes_per_block * (8 + rank)  # 7 blocks and the padding block in rank 0, 8 in rank 1
    with prefixkv.PrefixStore(model, block_size=4, max_memory=budget) as store:
        info["max_blocks"] = gathered(store.max_blocks, ranks)
        compare("budget agreed", model, twin, store, [PROMPT])
        compare("budget agreed, evicting", model, twin, store, [OTHER])
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps({"checked": checked, **info}, indent=1))
    dist.barrier()
    # no destroy_process_group(): on torch 2.6 it waits forever once dynamo has compiled the split model's steps


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
