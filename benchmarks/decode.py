"""Decode speed: milliseconds per new token after a long prompt, batch 1 and 8, for prefixkv,
DynamicCache and StaticCache, and for a batch of rows on one shared prefix (``--shared``: 16 rows, each
a 2048-token prefix plus 64 tokens of its own), where prefixkv holds the prefix once and its attention reads it
once for all rows, and a warm turn (``--warm``: one row whose prompt's first part an earlier request cached, with
the tokens that request generated after it, so the row's own blocks lie apart from the cached ones; the chat-loop
and few-shot case). Run: ``python benchmarks/decode.py [--size 100m]``.

``--host`` measures the host-side overhead of a decode step instead (docs/benchmarks.md, "Decode host overhead"):
ms per step of ``DynamicCache`` on a copy of the model without a store, of the floor of paged storage
(:class:`PagedFloor`: a pool written and read as prefixkv's step does, without its bookkeeping), and of prefixkv
with the ``"blocks"`` and the ``"gather"`` backends (each on its own copy), at batch 1 and 8, on the 2-layer
embedded model and the demo's 4-layer one, where a step is bound by Python and kernel launches as a GPU's is;
every prompt is a shared prefix (cached after the first call) and tokens of its own, as in ``python -m prefixkv
demo --small``; ``--host-sizes tiny-2 tiny-8 tiny-16`` runs the 2-layer model's shape at those depths instead
(what grows with the layers and what is paid once a step), and ``--cpu-time`` times every step in the process's
CPU time (one thread with ``--host``) instead of the wall clock's."""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch
from _common import model_for, save, table, target, tokens
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

import prefixkv

CLOCK = time.perf_counter
"""What :class:`StepClock` reads: the wall clock, or ``time.process_time`` (``--cpu-time``: this process's CPU
time, which the time other processes take from it on a loaded machine does not count in)."""


class StepClock(BaseStreamer):
    """Timestamps of each generated step (the first ``put`` is the prompt), by :data:`CLOCK`."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(CLOCK())

    def end(self) -> None:
        return None

    def ms_per_token(self) -> float:
        steps = self.times[1:]  # drop the prompt
        return 1000 * (steps[-1] - steps[0]) / (len(steps) - 1)


def decode_ms(
    model: Any,
    ids: torch.Tensor,
    new: int,
    variant: str,
    store: prefixkv.PrefixStore | None,
    reused: list[int] | None = None,
    compileable: bool | None = None,
    **extra: Any,
) -> float:
    """Milliseconds per decoded token of one generate call with the ``variant`` cache (``extra``: more generate
    arguments; ``compileable``: prefixkv's cache option, the default unless given); prefixkv's cached tokens are
    appended to ``reused`` when given."""
    clock = StepClock()
    kwargs: dict[str, Any] = dict(extra)
    cache: Any = None
    if variant == "dynamic":
        kwargs["cache"] = DynamicCache(config=model.config)
    elif variant == "floor":
        kwargs["cache"] = PagedFloor(model.config, ids.shape[0], ids.shape[1] + new)
    elif variant == "static":
        kwargs["cache_implementation"] = "static"
    else:
        assert store is not None
        cache = kwargs["cache"] = prefixkv.PagedPrefixCache(store, ids, compileable=compileable)
    model.generate(
        ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0, **kwargs
    )
    if cache is not None:
        if reused is not None:
            reused.append(cache.stats.cached_tokens)
        cache.close()
    return clock.ms_per_token()


def batch_ids(prompt: int, batch: int, shared: int, vocab: int, seed: int) -> torch.Tensor:
    """``batch`` rows of ``prompt`` tokens; with ``shared``, they start with the same ``shared`` tokens."""
    if not shared:
        return torch.stack([tokens(prompt, vocab, seed=seed + r) for r in range(batch)])
    prefix = tokens(shared, vocab, seed=seed)
    return torch.stack([torch.cat([prefix, tokens(prompt - shared, vocab, seed=seed + 1 + r)]) for r in range(batch)])


def run(
    size: str,
    prompts: list[int],
    batches: list[int],
    new: int,
    repeat: int,
    shared: list[tuple[int, int, int]] = (),
    warm: list[int] = (),
) -> dict[str, Any]:
    """Every ``prompts`` x ``batches`` case without sharing, then each ``(prompt, batch, shared)`` case, then a
    warm turn of each ``warm`` prompt length: before prefixkv's timed call, an untimed one on the prompt's first
    ``prompt - 7`` tokens generates 32 tokens and publishes them (the next request's own blocks then lie apart
    from the ones it reuses). Each case's figure is the fastest of ``repeat`` calls per variant, the variants
    taking turns to go first (a slow spell of the machine then falls on each of them)."""
    model = model_for(size)
    store = prefixkv.PrefixStore(model, block_size=16)
    rows = []
    cases = [(p, b, 0, False) for p in prompts for b in batches] + [(*c, False) for c in shared]
    cases += [(p, 1, 0, True) for p in warm]
    for p, b, s, earlier in cases:
        samples: dict[str, list[float]] = {"dynamic": [], "static": [], "prefixkv": []}
        reused: list[int] = []
        for i in range(repeat):
            ids = batch_ids(p, b, s, model.config.vocab_size, seed=100 * i)
            if earlier:
                with prefixkv.PagedPrefixCache(store, ids[:, :-7]) as cache:
                    model.generate(ids[:, :-7], max_new_tokens=32, do_sample=False, pad_token_id=0, cache=cache)
            order = list(samples)
            for variant in order[i % len(order) :] + order[: i % len(order)]:  # each repeat starts with another variant
                samples[variant].append(decode_ms(model, ids, new, variant, store, reused))
        store.clear()
        times = {k: min(v) for k, v in samples.items()}
        rows.append({"prompt": p, "batch": b, "shared": s, "warm": earlier, "reused": min(reused), **times})
    store.close()
    return {"size": size, "new_tokens": new, "rows": rows}


def report(result: dict[str, Any]) -> str:
    out = []
    for r in result["rows"]:
        dynamic, static = r["prefixkv"] / r["dynamic"], r["prefixkv"] / r["static"]
        shared = r.get("shared", 0)
        if shared:  # issue 13: >= 2x faster than Dynamic, >= 1.5x faster than Static
            goals = f"{target(dynamic <= 0.5)} <= 0.50 / {target(static <= 1 / 1.5)} <= 0.67"
        elif r["prompt"] <= 512 or r.get("warm"):
            goals = f"{target(dynamic <= 1.03)} <= 1.03 Dynamic"
        else:
            goals = f"{target(static <= 1.0)} <= 1.00 Static"
        out.append(
            [
                r["prompt"],
                r["batch"],
                shared or ("warm turn" if r.get("warm") else "-"),
                f"{r['dynamic']:.2f}",
                f"{r['static']:.2f}",
                f"{r['prefixkv']:.2f}",
                f"{dynamic:.3f}",
                f"{static:.3f}",
                goals,
            ]
        )
    header = ["prompt", "batch", "shared prefix", "Dynamic", "Static", "prefixkv", "/ Dynamic", "/ Static", "target"]
    return "Milliseconds per new token with DynamicCache, StaticCache and prefixkv, and prefixkv's ratios:\n\n" + table(
        header,
        out,
    )


HOST_VARIANTS = ("dynamic", "floor", "blocks", "gather")


class PagedFloor(DynamicCache):
    """The floor of paged storage: each layer's K/V kept by slot in one pool tensor per layer (``[kv_heads, slots,
    head_dim]``, each row's columns in slots of its own), a step's K/V written with ``index_copy_`` and every row's
    whole K/V handed out by ``index_select``, as prefixkv's steady decode step writes and reads them, with none of
    its bookkeeping (no blocks, tables, sharing, proof or plan). What it costs over ``DynamicCache`` is what storing
    K/V in a pool costs itself; prefixkv's cost over it is its bookkeeping."""

    def __init__(self, config: Any, rows: int, capacity: int = 1024) -> None:
        super().__init__(config=config)
        self._pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._slots = torch.arange(rows * capacity).view(rows, capacity) + 16  # 16: a null block's room
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, q, dim = key_states.shape
        if layer_idx == len(self._pools):
            size = self._slots.numel() + 16
            self._pools.append((key_states.new_zeros(heads, size, dim), value_states.new_zeros(heads, size, dim)))
        if layer_idx == 0:
            self._length += q
        new = self._slots[:, self._length - q : self._length].reshape(-1)
        index = self._slots[:, : self._length]
        out = []
        for pool, states in zip(self._pools[layer_idx], (key_states, value_states)):
            pool.index_copy_(1, new, states.transpose(0, 1).reshape(heads, rows * q, dim))
            taken = pool.index_select(1, index.reshape(-1)).view(heads, rows, self._length, dim)
            out.append(taken.transpose(0, 1).contiguous())
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._length


def host_overhead(sizes: list[str], batches: list[int], prompt: int, new: int, repeat: int) -> dict[str, Any]:
    """ms per decode step of each of :data:`HOST_VARIANTS` for every size and batch, the variants taking turns
    (each repeat starts with another), the fastest of ``repeat`` calls each; the prompts share their first
    ``prompt - 16`` tokens, which prefixkv reuses from the second call on."""
    rows = []
    for size in sizes:
        model = model_for(size)
        copies = {name: copy.deepcopy(model) for name in HOST_VARIANTS}  # before any store: no hooks on them
        stores = {name: prefixkv.PrefixStore(copies[name], block_size=16, attention=name) for name in HOST_VARIANTS[2:]}
        vocab = model.config.vocab_size
        for b in batches:
            prefix = tokens(prompt - 16, vocab, seed=1)
            samples: dict[str, list[float]] = {name: [] for name in HOST_VARIANTS}
            for i in range(repeat + 1):  # the first round warms the stores and the allocator
                ids = torch.stack([torch.cat([prefix, tokens(16, vocab, seed=1000 * i + r)]) for r in range(b)])
                turn = i % len(HOST_VARIANTS)
                for name in HOST_VARIANTS[turn:] + HOST_VARIANTS[:turn]:
                    variant = name if name in ("dynamic", "floor") else "prefixkv"
                    ms = decode_ms(copies[name], ids, new, variant, stores.get(name))
                    if i:
                        samples[name].append(ms)
            rows.append({"size": size, "batch": b, **{k: min(v) for k, v in samples.items()}})
        for store in stores.values():
            store.close()
    return {"prompt": prompt, "new_tokens": new, "rows": rows}


def host_report(result: dict[str, Any]) -> str:
    names = ("floor", "blocks", "gather")
    out = [
        [r["size"], r["batch"], f"{r['dynamic']:.3f}", *(f"{r[n]:.3f}" for n in names),
         *(f"{r[n] / r['dynamic']:.2f}x" for n in names)]
        for r in result["rows"]
    ]  # fmt: skip
    header = ["model", "batch", "Dynamic", "floor", "blocks", "gather", "floor / Dynamic", "blocks / Dynamic",
              "gather / Dynamic"]  # fmt: skip
    return (
        f"Decode milliseconds per step, {result['prompt']}-token prompts on a shared prefix, "
        f"{result['new_tokens']} new tokens:\n\n" + table(header, out)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="100m")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--shared",
        type=int,
        nargs=3,
        action="append",
        metavar=("PROMPT", "BATCH", "SHARED"),
        help="a shared-prefix case (default: 2112 16 2048); --shared 0 0 0 for none",
    )
    ap.add_argument(
        "--warm", type=int, nargs="*", default=[512], help="prompt lengths of warm-turn cases (none: no such case)"
    )
    ap.add_argument("--host", action="store_true", help="the host overhead of a decode step on the small models")
    ap.add_argument(
        "--host-sizes", nargs="+", default=["tiny", "small"], help="with --host: the models (tiny-N: N layers)"
    )
    ap.add_argument("--cpu-time", action="store_true", help="time steps in this process's CPU time, not wall time")
    args = ap.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if args.host:
        torch.set_num_threads(1)
        host = host_overhead(args.host_sizes, args.batches, 256, 64, args.repeat + 3)
        save("decode_host", host)
        print(host_report(host))
        return
    shared = [tuple(s) for s in (args.shared or [[2112, 16, 2048]]) if s[0]]
    result = run(args.size, args.prompts, args.batches, args.new_tokens, args.repeat, shared, args.warm)
    save("decode", result)
    print(report(result))


if __name__ == "__main__":
    main()
