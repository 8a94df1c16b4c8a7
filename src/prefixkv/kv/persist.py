"""Cached prefixes on disk: one safetensors file per save, so loading a file never runs code. Its format,
reading and checks are :mod:`prefixkv.kv.prefix_file`'s; this module writes files (:func:`write`, of the nodes
:func:`select_nodes` picks), converts them (:func:`convert`) and plans what a read file adds to a trie
(:func:`plan`).

Loading inserts each saved leaf's whole path into the trie with its block table: positions the store
already holds keep their blocks, and only the blocks of new positions are copied in.

This module sits below the store and its block manager: it writes files and plans over a trie; the store's
``save``, ``load`` and ``merge`` call the block manager (:class:`prefixkv.kv.room.Room`), which takes its lock,
calls these, and inserts through its one insert.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..family import family
from .pool import BlockPool, LayerSpec
from .prefix_file import FORMAT, FORMAT_VERSION, TRIE_KEYS, PathLike, PrefixFile, checksum, read
from .quantization import check_kv_dtype
from .trie import Node, RadixTrie


@dataclass(frozen=True)
class PersistStats:
    """What a save wrote: cached ``prefixes`` (trie leaves), their ``tokens`` (shared parts counted
    once) and KV ``blocks``. What a merge added: prefixes the store lacked (in whole or in part), the
    token positions and the pool blocks it took for them."""

    prefixes: int
    tokens: int
    blocks: int


# -- save ----------------------------------------------------------------------------------------------


def write(
    path: PathLike, tensors: dict[str, torch.Tensor], meta: dict[str, str], nodes: list[Saved], blocks: list[int]
) -> PersistStats:
    """Write a save's tensors (:func:`trie_tensors` and the pool's blocks) with ``meta`` and its checksum to
    ``path``; the file appears whole or not at all."""
    meta["checksum"] = checksum(tensors, meta)
    write_atomically(Path(path), tensors, meta)
    return PersistStats(
        prefixes=sum(1 for n in nodes if not n.children),
        tokens=sum(len(n.tokens) for n in nodes),
        blocks=len(blocks),
    )


class StoreFacts(Protocol):
    """What :func:`store_meta` reads of a store's settings (:class:`prefixkv.hf.parts.StoreSettings`)."""

    @property
    def block_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def model_dtype(self) -> torch.dtype: ...

    @property
    def kv_dtype(self) -> str | None: ...


def store_meta(
    settings: StoreFacts, specs: list[LayerSpec], model: Any, model_print: str, format: str = FORMAT
) -> dict[str, str]:
    """The metadata that ties K/V to the store that computed them (format, shapes, dtypes, quantization,
    model fingerprint): its ``settings``, the ``specs`` of its pool's layers and its ``model``, without the
    checksum. Does not mutate."""
    spec = specs[0]
    meta = {
        "format": format,
        "format_version": str(FORMAT_VERSION),
        "block_size": str(settings.block_size),
        "dtype": _dtype_name(settings.dtype),
        "model_dtype": _dtype_name(settings.model_dtype),
        "num_layers": str(len(specs)),
        "kv_heads": str(spec.kv_heads),
        "head_dim": str(spec.head_dim),
        "model_type": family(model),
        "model_fingerprint": model_print,
    }
    if settings.kv_dtype is not None:  # absent in unquantized files, as in those written before quantization
        meta["kv_dtype"] = settings.kv_dtype
    return meta


class Saved(NamedTuple):
    """A trie node as written: its edge cut to the saved length, and which of the saved nodes are
    its parent and children."""

    tokens: list[int]
    blocks: list[int]
    parent: int
    children: list[int]


def select_nodes(trie: RadixTrie, wanted: list[list[int]] | None, space: Hashable) -> list[Saved]:
    """The saved part of namespace ``space`` of the trie, parents first: every node, or the paths of the cached
    part of each wanted prefix (a path may end inside an edge). Does not mutate."""
    keep: dict[int, int] = {}  # id(node) -> tokens of its edge kept
    order: list[Node] = []
    if wanted is None:
        order = trie.nodes(space)
        keep = {id(n): len(n.tokens) for n in order}
    else:
        for i, tokens in enumerate(wanted):
            m = trie.match(tokens, space)
            if m.length == 0:
                raise ValueError(
                    f"prefix {i} ({len(tokens)} tokens) is not cached in this store, so there is nothing to save "
                    "for it; generate with it first (pin it to keep it from eviction) or leave it out"
                )
            path: list[Node] = []
            n: Node | None = m.node
            while n is not None and n.parent is not None:
                path.append(n)
                n = n.parent
            for n in reversed(path):
                if id(n) not in keep:
                    order.append(n)
                    keep[id(n)] = 0
            for n in path[1:]:
                keep[id(n)] = len(n.tokens)
            keep[id(m.node)] = max(keep[id(m.node)], m.length - m.node.start)
    index = {id(n): i for i, n in enumerate(order)}
    bs = trie.block_size
    saved = []
    for n in order:
        k = keep[id(n)]
        chunks = (n.start + k - 1) // bs - n.start // bs + 1
        parent = -1 if n.parent is None or n.parent.parent is None else index[id(n.parent)]
        saved.append(Saved(n.tokens[:k], n.blocks[:chunks], parent, []))
    for i, s in enumerate(saved):
        if s.parent >= 0:
            saved[s.parent].children.append(i)
    return saved


def trie_tensors(nodes: list[Saved], block_size: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The integer tensors of the trie, and the pool blocks they reference in file order."""
    renumber: dict[int, int] = {}
    file_blocks = [renumber.setdefault(b, len(renumber)) for n in nodes for b in n.blocks]
    tensors = {
        "trie.parent": _longs([n.parent for n in nodes]),
        "trie.length": _longs([len(n.tokens) for n in nodes]),
        "trie.tokens": _longs([t for n in nodes for t in n.tokens]),
        "trie.num_blocks": _longs([len(n.blocks) for n in nodes]),
        "trie.blocks": _longs(file_blocks),
    }
    return tensors, list(renumber)


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -- convert, load and merge ------------------------------------------------------------------------------


def convert(path: PathLike, new_path: PathLike, kv_dtype: str | None) -> PersistStats:
    """Write the prefixes saved at ``path`` to ``new_path`` with K/V kept as ``kv_dtype`` (``"int8"``,
    ``"fp8"``, or ``None`` for unquantized in the file's dtype): the explicit step that lets a quantized
    store load a file saved from an unquantized one, and back. Quantizing costs what a quantized store costs
    (``docs/memory.md``); dequantizing gives back the quantized values, not the originals. Raises
    :class:`PersistError` for a file :func:`read` refuses; ``path`` is left as it is.

    >>> import prefixkv, torch, tempfile, os
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> _ = store.warm([torch.arange(3, 20)], progress=False)
    >>> folder = tempfile.mkdtemp()
    >>> _ = store.save(os.path.join(folder, "full.safetensors"))
    >>> src, dst = os.path.join(folder, "full.safetensors"), os.path.join(folder, "int8.safetensors")
    >>> prefixkv.PrefixStore.convert(src, dst, "int8").blocks
    4
    >>> prefixkv.PrefixStore.load(dst, model).kv_dtype
    'int8'
    """
    check_kv_dtype(kv_dtype)
    file = read(path)
    bs, count = file.block_size, file.keys[0].shape[0]
    spec = LayerSpec(int(file.meta["kv_heads"]), int(file.meta["head_dim"]), torch.device("cpu"), file.dtype)
    specs = [spec] * len(file.keys)
    source, target = BlockPool(specs, bs, count, file.kv_dtype), BlockPool(specs, bs, count, kv_dtype)
    everything = list(range(count))
    if count:
        source.write_blocks(everything, blocks_of(file, everything))
        table, slots = torch.arange(count)[None], torch.arange(count * bs)[None]
        for layer in range(len(specs)):
            target.write(layer, slots, *source.gather_blocks(layer, table, count * bs))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in TRIE_KEYS}
    tensors.update(target.read_blocks(everything))
    meta = {k: v for k, v in file.meta.items() if k not in ("checksum", "kv_dtype")}
    if kv_dtype is not None:
        meta["kv_dtype"] = kv_dtype
    meta["checksum"] = checksum(tensors, meta)
    write_atomically(Path(new_path), tensors, meta)
    return PersistStats(prefixes=len(file.paths), tokens=len(tensors["trie.tokens"]), blocks=count)


class Plan(NamedTuple):
    """A saved path to insert, and how many of its tokens the store will already hold by then."""

    tokens: list[int]
    table: list[int]
    present: int


def plan(trie: RadixTrie, paths: list[tuple[list[int], list[int]]], space: Hashable) -> tuple[list[Plan], list[Node]]:
    """For each path, in order, how much of it namespace ``space`` of the trie (with the paths before it) will
    hold; and the nodes it already matches in the trie. Does not mutate ``trie``."""
    earlier = RadixTrie(trie.block_size)
    plans: list[Plan] = []
    anchors: list[Node] = []
    for tokens, table in paths:
        live = trie.match(tokens, space)
        if live.length:
            anchors.append(live.node)
        present = max(live.length, earlier.match(tokens).length)
        if present < len(tokens):
            plans.append(Plan(tokens, table, present))
            earlier.insert(tokens, table)
    return plans, anchors


def blocks_of(file: PrefixFile, blocks: list[int]) -> dict[str, torch.Tensor]:
    """The file's tensors of ``blocks``, named as :meth:`BlockPool.read_blocks` names them."""
    index = torch.tensor(blocks, dtype=torch.long)
    out = {f"k.{i}": k.index_select(0, index) for i, k in enumerate(file.keys)}
    out.update({f"v.{i}": v.index_select(0, index) for i, v in enumerate(file.values)})
    out.update({name: t.index_select(0, index) for name, t in file.scales.items()})
    return out


# -- helpers ------------------------------------------------------------------------------------------------


def _longs(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
