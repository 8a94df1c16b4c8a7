"""A store's files (docs/persistence.md): what ``PrefixStore.save`` writes and what the files of a disk tier carry
(:func:`file_meta`: the store's settings and model, and an invariant store's chunk length), and what
``PrefixStore.load`` and ``PrefixStore.merge`` check before a file's blocks join a store. The file format itself
(writing, reading, its checksum and its checks against a model) is :mod:`prefixkv.kv.prefix_file`'s; the export
and merge of a store's prefixes are its block manager's archive's (:class:`prefixkv.kv.persist.Archive`)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..base.errors import PersistError
from ..base.memory import parse_bytes
from ..base.settings import StoreSettings
from ..hf.state_files import Carrier, file_section
from ..hf.states import Snapshot, Snapshots
from ..kv import persist, prefix_file
from ..kv.fingerprint import fingerprint
from ..kv.key_space import autocast_in
from ..kv.manager import BlockManager
from ..kv.pool import LayerSpec
from ..kv.ranks import model_ranks
from ..kv.tier import BLOCK_FORMAT, OffloadTier


def file_meta(
    settings: StoreSettings, specs: list[LayerSpec], model: Any, model_print: str, format: str = prefix_file.FORMAT
) -> dict[str, str]:
    """The metadata of a file of a store's K/V (:func:`prefixkv.kv.persist.store_meta`) and, for an invariant
    store, its chunk length: K/V computed in another schedule are other K/V (docs/correctness.md, "Files and
    tiers carry the schedule")."""
    meta = persist.store_meta(settings, specs, model, model_print, format)
    if settings.chunk_size is not None:
        meta["chunk_size"] = str(settings.chunk_size)
    ranks = model_ranks(model)
    if ranks is not None:  # a split model's process holds its share of the heads: its K/V are its own
        meta["tensor_parallel"] = f"{ranks.rank}/{ranks.size}"
    return meta


def offload_tier(
    offload: str | None,
    max_offload_memory: int | str | None,
    offload_dir: str | os.PathLike[str] | None,
    settings: StoreSettings,
    specs: list[LayerSpec],
    model: Any,
    carrier: Carrier | None = None,
) -> OffloadTier | None:
    """The second tier ``PrefixStore(offload=...)`` asks for (``None`` without): blocks in host memory or in files
    of ``offload_dir`` (created if missing) whose metadata ties them to the store's K/V (:func:`file_meta`), with
    the recurrent-state snapshots inside each block for a model with recurrent layers (``carrier``)."""
    if offload is None:
        return None
    limit = None if max_offload_memory is None else parse_bytes(max_offload_memory)
    # the adapters are left out: a tier's keys carry the namespace (active adapters) already, so one
    # directory serves a model under each of its adapters
    model_print = fingerprint(model, adapters=False)
    if offload != "disk":
        tier = OffloadTier(offload, max_bytes=limit, directory=offload_dir)
    else:
        meta = file_meta(settings, specs, model, model_print, BLOCK_FORMAT)
        # a file's tensors are checked as a saved file's: a right checksum proves only that they were written so
        check = functools.partial(_entry_problem, meta=meta, carrier=carrier)
        tier = OffloadTier(offload, max_bytes=limit, directory=offload_dir, meta=meta, check=check)
    tier.payload = carrier
    return tier


def _entry_problem(tensors: dict[str, torch.Tensor], meta: dict[str, str], carrier: Carrier | None) -> str | None:
    """What is wrong with a disk tier entry's K/V (:func:`prefixkv.kv.prefix_file.block_problem`) or its snapshots
    (:meth:`prefixkv.hf.state_files.Carrier.problem`), or ``None``. Does not mutate."""
    return prefix_file.block_problem(tensors, meta) or (None if carrier is None else carrier.problem(tensors))


def save(
    path: str | os.PathLike[str],
    wanted: list[list[int]] | None,
    blocks: BlockManager,
    settings: StoreSettings,
    model: Any,
    snapshots: Snapshots | None = None,
) -> prefix_file.PersistStats:
    """Write the prefixes ``blocks`` hold (all, or the cached part of each of ``wanted``) to ``path``, with
    ``model``'s fingerprint (:meth:`prefixkv.PrefixStore.save`) and, for a model with recurrent layers, the
    ``snapshots`` on the saved paths (:func:`prefixkv.hf.state_files.file_section`; ``states`` in the metadata
    counts them). Does not mutate the store."""
    now = getattr(model, "dtype", settings.model_dtype)
    if now != settings.model_dtype:
        raise PersistError(
            f"the model now computes in {now} but the store's K/V were computed in "
            f"{settings.model_dtype}: the model was cast after the PrefixStore was built; cast it back to save"
        )
    _outside_autocast(blocks, "save")
    model_print = fingerprint(model)
    space = blocks.space()
    nodes, tensors, saved = blocks.archive.export(wanted, space)
    meta = file_meta(settings, blocks.pool.specs, model, model_print)
    if snapshots is not None:
        section, count = file_section(snapshots, space, leaf_paths(nodes))
        tensors.update(section)
        meta["states"] = str(count)
    return prefix_file.write(path, tensors, meta, nodes, saved)


def leaf_paths(nodes: list[prefix_file.Saved]) -> list[list[int]]:
    """The whole path of each leaf of saved ``nodes`` (parents first), in file order: the order of a read file's
    ``paths``. Does not mutate."""
    paths: list[list[int]] = []
    for n in nodes:
        paths.append((paths[n.parent] if n.parent >= 0 else []) + n.tokens)
    return [p for p, n in zip(paths, nodes) if not n.children]


def load_options(
    file: prefix_file.PrefixFile, path: str | os.PathLike[str], model: Any, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The options of a store that loads ``file`` for ``model`` (:meth:`prefixkv.PrefixStore.load`): ``kwargs``
    with block size, dtype, quantization and an invariant store's chunk length defaulting to the file's, after
    checking that the file fits them (:func:`prefixkv.kv.prefix_file.check_compatible`). Mutates
    ``kwargs``."""
    kwargs.setdefault("block_size", file.block_size)
    kwargs["dtype"] = kwargs.get("dtype") or file.dtype
    kwargs.setdefault("kv_dtype", file.kv_dtype)
    if "chunk_size" in file.meta and "invariant" not in kwargs:
        kwargs.setdefault("invariant", True)
        kwargs.setdefault("chunk_size", int(file.meta["chunk_size"]))
    model_dtype = getattr(model, "dtype", torch.float32)
    prefix_file.check_compatible(file, path, kwargs["block_size"], kwargs["dtype"], model_dtype, kwargs["kv_dtype"])
    return kwargs


def add_file(
    blocks: BlockManager,
    chunk_size: int | None,
    file: prefix_file.PrefixFile,
    path: str | os.PathLike[str],
    model: Any,
    carrier: Carrier | None = None,
) -> prefix_file.PersistStats:
    """Add the prefixes of ``file`` to ``blocks``, within their budget, after refusing a file computed in another
    prefill schedule than ``chunk_size``'s, with other shapes than the pool's or by another model than ``model``
    (:func:`prefixkv.kv.prefix_file.check_model`), or, for a model with recurrent layers (``carrier``), with
    snapshots missing or malformed; then its snapshots on the paths the store holds. Mutates ``blocks``
    only once the file is known to fit (:meth:`prefixkv.kv.persist.Archive.merge`)."""
    _check_schedule(chunk_size, file, path)
    _check_ranks(file, path, model)
    _outside_autocast(blocks, "load")
    prefix_file.check_model(file, path, model, blocks.pool.specs)
    found = [] if carrier is None else _file_snapshots(carrier, file, path)
    space = blocks.space()
    stats = blocks.archive.merge(file, space)
    if carrier is not None:
        carrier.keep(space, found, lambda tokens: blocks.cached_length(tokens, space))
    return stats


def _file_snapshots(
    carrier: Carrier, file: prefix_file.PrefixFile, path: str | os.PathLike[str]
) -> list[tuple[list[int], Snapshot]]:
    """The recurrent-state snapshots of ``file`` with their paths, checked against the store's model
    (:meth:`prefixkv.hf.state_files.Carrier.from_file`); :class:`PersistError` for missing or malformed ones, as for
    a bad block. Does not mutate."""
    count = file.meta.get("states")
    if count is None or not count.isdigit():
        raise PersistError(
            f"{path} names no count of recurrent-state snapshots ('states' in its metadata), which every file of a "
            "model with recurrent layers has: without them it could resume no prefix. It was not written by "
            "PrefixStore.save for this model; save the prefixes again"
        )
    try:
        return carrier.from_file(file.section, [tokens for tokens, _ in file.paths], int(count))
    except ValueError as e:
        raise PersistError(
            f"{path} holds malformed recurrent-state snapshots: {e}. Reused, they would give wrong output; the file "
            "was damaged or edited after it was written: save the prefixes again"
        ) from None


def _outside_autocast(blocks: BlockManager, what: str) -> None:
    """Raise :class:`PersistError` under ``torch.autocast``: a file holds K/V of the model's own dtype and says
    nothing of autocast, whose K/V are others (docs/correctness.md, "Autocast")."""
    dtype = autocast_in(blocks.space())
    if dtype is not None:
        raise PersistError(
            f"{what} runs under torch.autocast(dtype={dtype}), but a prefix file holds the K/V of the model's own "
            f"dtype, which autocast does not compute: {what} outside the autocast block"
        )


def _check_schedule(chunk_size: int | None, file: prefix_file.PrefixFile, path: str | os.PathLike[str]) -> None:
    """Refuse a file whose K/V were computed in another prefill schedule than ``chunk_size``'s. Does not mutate."""
    theirs = file.meta.get("chunk_size")
    if theirs != (None if chunk_size is None else str(chunk_size)):
        kept = "the default schedule" if theirs is None else f"the invariant schedule (chunk_size={theirs})"
        ours = "the default schedule" if chunk_size is None else f"chunk_size={chunk_size}"
        raise PersistError(
            f"{path} holds K/V computed in {kept}, this store uses {ours}: they are other K/V, whose reuse "
            "would change outputs. Load it into a store with the file's schedule, or compute the prefixes again"
        )


def _check_ranks(file: prefix_file.PrefixFile, path: str | os.PathLike[str], model: Any) -> None:
    """Refuse a file written by another process of a split model, or by a model split otherwise (or whole): it
    holds another share of the K/V heads. Does not mutate."""
    ranks = model_ranks(model)
    ours = None if ranks is None else f"{ranks.rank}/{ranks.size}"
    theirs = file.meta.get("tensor_parallel")
    if theirs != ours:
        raise PersistError(
            f"{path} holds the K/V of {_split(theirs)}, this store's model is {_split(ours)}: each process holds "
            "its own share of the K/V heads. Save from every process to its own path (one per rank) and load each in "
            "the process of the same rank, at the same number of processes"
        )


def _split(split: str | None) -> str:
    """A file's ``tensor_parallel`` metadata (``rank/size``, ``None``: absent) in words."""
    if split is None:
        return "a whole model (one process)"
    rank, size = split.split("/")
    return f"rank {rank} of {size} processes of a tensor-parallel model"
