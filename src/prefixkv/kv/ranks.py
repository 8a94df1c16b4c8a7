"""What one process of a model split over several (transformers' tensor parallelism under ``torchrun``) holds, and
what the processes agree on (docs/how-it-works.md, "Several processes").

Under tensor parallelism each process runs the same script on the same ids, its layers compute its share of the
K/V heads, and each process has its own store. The stores' decisions (trie, eviction, admission, budget) are pure
functions of the calls and the tokens, so they are the same in every process for the same calls; what could differ
is agreed here (the budget) or checked (:func:`prefixkv.store.parallel.check_ranks_agree`)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, cast

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
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(t, dtensor):
        return t
    shard: torch.Tensor = cast(Any, t).to_local()
    return shard


def model_ranks(model: Any) -> Ranks | None:
    """Where this process stands among those ``model`` is split over (the mesh of its first ``DTensor``
    parameter, the tensor-parallel dimension of a mesh of several), or ``None``: the model is whole here. Does
    not mutate."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return None
    for p in model.parameters():
        if not isinstance(p, dtensor):
            continue
        mesh = cast(Any, p).device_mesh
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


def _dtensor_class() -> type | None:
    """torch's ``DTensor`` where something imported it (transformers does, to split a model), else ``None``: no
    tensor can be one then, and prefixkv does not pay the import (nor need a torch built with torch.distributed)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
