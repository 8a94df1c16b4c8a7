"""What one process of a model split over several (transformers' tensor parallelism under ``torchrun``) holds, and
what the processes agree on (docs/how-it-works.md, "Several processes").

Under tensor parallelism each process runs the same script on the same ids, its layers compute its share of the
K/V heads, and each process has its own store. The stores' decisions (trie, eviction, admission, budget) are pure
functions of the calls and the tokens, so they are the same in every process for the same calls; what could differ
is agreed here (the budget) or checked (:func:`prefixkv.parallel.check_ranks_agree`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Ranks(NamedTuple):
    """This process's place among those a model is split over: ``rank`` of ``size``, and the process ``group``
    they share."""

    rank: int
    size: int
    group: Any


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a ``DTensor``'s local shard (tensor parallelism splits a weight over the
    processes, and a ``DTensor`` refuses ``as_strided``, ``data_ptr`` and ``numpy``), else ``t`` itself. Does not
    mutate.

    >>> local_part(torch.ones(2)).shape
    torch.Size([2])
    """
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and hasattr(t, "device_mesh") else t


def model_ranks(model: Any) -> Ranks | None:
    """Where this process stands among those ``model`` is split over (the mesh of its first ``DTensor``
    parameter, the tensor-parallel dimension of a mesh of several), or ``None``: the model is whole here. Does
    not mutate."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or not hasattr(p, "to_local"):
            continue
        names: tuple[str, ...] = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh.ndim > 1 and names:
            mesh = mesh["tp" if "tp" in names else names[-1]]
        return Ranks(int(mesh.get_local_rank()), int(mesh.size()), mesh.get_group())
    return None


def agree_min(value: int, ranks: Ranks | None) -> int:
    """The least of ``value`` over the processes of ``ranks`` (an all-reduce MIN, which every process must call),
    ``value`` itself when the model is whole. Does not mutate."""
    if ranks is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=ranks.group)
    return int(t.item())


def gathered(value: Any, ranks: Ranks) -> list[Any]:
    """``value`` of every process of ``ranks``, in rank order (an all-gather, which every process must call).
    Does not mutate."""
    out: list[Any] = [None] * ranks.size
    torch.distributed.all_gather_object(out, value, group=ranks.group)
    return out
