"""The prefix file, whole: its format, written (:func:`write`, :func:`convert`), read back (:func:`read`) and checked
(:func:`check_compatible`, :func:`check_model`). One safetensors file per save, so loading a file never runs code.

The file holds, per attention layer, each per-token tensor of the saved blocks only (``k.{layer}``, ``v.{layer}``
and any more a layer's kind keeps, ``[blocks, block_size, heads, size]``, renumbered ``0..blocks-1``, named by the
pool, :func:`prefixkv.kv.pool.stored_tensors`), and the trie as integer tensors, nodes listed parents first
(:class:`Saved`, :func:`trie_tensors`):

- ``trie.parent``: ``[nodes]``, the index of each node's parent, ``-1`` under the root;
- ``trie.length``, ``trie.tokens``: each node's edge length, and all edges' token ids end to end;
- ``trie.num_blocks``, ``trie.blocks``: how many blocks each node keeps (one per ``block_size`` chunk its
  edge touches), and those file block indices end to end.

The string metadata records the format and its version, the block size, the pool's and the model's
dtypes, the layer and head shapes (and where a layer's kind keeps tensors besides K and V, their names and shapes,
``layer_tensors``: a file without it is read as before), a fingerprint of the model
(:func:`prefixkv.kv.fingerprint.fingerprint`) and a sha256 over all of the above (:func:`checksum`: every tensor's
name, dtype, shape and bytes, and every other metadata entry). A file appears whole or not at all
(:func:`write_atomically`, which the disk tier's block files use too), and is fully read and checked before a store
is touched, so a refused file leaves the store as it was.
What a save takes out of a store and what a load merges into it is :mod:`prefixkv.kv.persist`'s.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..base.errors import PersistError
from ..base.family import family
from .fingerprint import fingerprint, tensor_bytes
from .pool import BlockPool, LayerSpec, StoredTensor, spec_of, spec_tensors, stored_tensors
from .quantization import KV_DTYPES, SCALE_DTYPE, check_kv_dtype, code_dtype

FORMAT = "prefixkv.prefixes"
FORMAT_VERSION = 3  # 3: codes of head vectors turned with exact sums (2: turned by a matmul; 1: a scale per block)
TRIE_KEYS = ("trie.parent", "trie.length", "trie.tokens", "trie.num_blocks", "trie.blocks")

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class PersistStats:
    """What a save wrote: cached ``prefixes`` (trie leaves), their ``tokens`` (shared parts counted
    once) and KV ``blocks``. What a merge added: prefixes the store lacked (in whole or in part), the
    token positions and the pool blocks it took for them."""

    prefixes: int
    tokens: int
    blocks: int


class PrefixFile(NamedTuple):
    """A file read and verified by :func:`read`: its metadata, each saved leaf's whole path as
    ``(tokens, table)`` with ``table`` indexing the blocks, and the ``blocks`` saved, every tensor of them (scales
    too) by the name the pool gives it (:func:`prefixkv.kv.pool.stored_tensors`)."""

    meta: dict[str, str]
    block_size: int
    dtype: torch.dtype
    model_dtype: torch.dtype
    paths: list[tuple[list[int], list[int]]]
    tensors: dict[str, torch.Tensor]
    blocks: int
    kv_dtype: str | None = None


# -- write and convert ----------------------------------------------------------------------------------


class Saved(NamedTuple):
    """A trie node as written: its edge cut to the saved length, and which of the saved nodes are
    its parent and children."""

    tokens: list[int]
    blocks: list[int]
    parent: int
    children: list[int]


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
    bs, count = file.block_size, file.blocks
    specs = [spec_of(tensors, torch.device("cpu"), file.dtype) for tensors in file_layers(file.meta, path)]
    source, target = BlockPool(specs, bs, count, file.kv_dtype), BlockPool(specs, bs, count, kv_dtype)
    everything = list(range(count))
    if count:
        source.write_blocks(everything, blocks_of(file, everything))
        table, slots = torch.arange(count)[None], torch.arange(count * bs)[None]
        for layer, spec in enumerate(specs):
            for name in spec.tensors:
                target.write_tensor(layer, name, slots, source.gather_blocks_tensor(layer, name, table, count * bs))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensors = {name: f.get_tensor(name) for name in TRIE_KEYS}
    tensors.update(target.read_blocks(everything))
    meta = {k: v for k, v in file.meta.items() if k not in ("checksum", "kv_dtype")}
    if kv_dtype is not None:
        meta["kv_dtype"] = kv_dtype
    meta["checksum"] = checksum(tensors, meta)
    write_atomically(Path(new_path), tensors, meta)
    return PersistStats(prefixes=len(file.paths), tokens=len(tensors["trie.tokens"]), blocks=count)


def blocks_of(file: PrefixFile, blocks: list[int]) -> dict[str, torch.Tensor]:
    """The file's tensors of ``blocks``, named as :meth:`BlockPool.read_blocks` names them."""
    index = torch.tensor(blocks, dtype=torch.long)
    return {name: t.index_select(0, index) for name, t in file.tensors.items()}


# -- read and verify -------------------------------------------------------------------------------------


def read(path: PathLike) -> PrefixFile:
    """Read a prefix file and verify its format version, checksum and structure. Raises
    :class:`PersistError` saying what is wrong; ``FileNotFoundError`` if there is no file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prefix file at {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as e:  # safetensors raises its own error type for every malformed file
        raise PersistError(
            f"{path} is not a readable safetensors file (truncated or corrupted?): {e}. Save the prefixes again"
        ) from e
    if meta.get("format") != FORMAT:
        raise PersistError(f"{path} is a safetensors file but not a prefixkv prefix file (no format={FORMAT!r})")
    version = _int(meta, "format_version", path)
    if version > FORMAT_VERSION:
        raise PersistError(
            f"{path} has format version {version}, written by a newer prefixkv; this one reads versions up to "
            f"{FORMAT_VERSION}. Upgrade prefixkv to load it"
        )
    if version < 1:
        raise PersistError(f"{path} has format version {version}, which no prefixkv writes; the file is corrupted")
    if meta.get("checksum") != checksum(tensors, meta):
        raise PersistError(
            f"{path} fails its checksum: its tensors or metadata changed after it was written "
            "(a damaged copy or an edited file). Save the prefixes again"
        )
    return _parse(path, meta, tensors)


def _parse(path: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> PrefixFile:
    """Rebuild the leaf paths from the trie tensors, checking that they describe a well-formed trie
    (a file with a valid checksum could still be made by hand)."""

    def bad(what: str) -> PersistError:
        return PersistError(f"{path} is malformed: {what}; it was not written by prefixkv.save")

    bs = _int(meta, "block_size", path)
    for name in TRIE_KEYS:
        if name not in tensors:
            raise bad(f"tensor {name} is missing")
    parent, length, tokens, num_blocks, blocks = (_long_list(tensors[k], k, bad) for k in TRIE_KEYS)
    version = _int(meta, "format_version", path)
    if meta.get("kv_dtype") is not None and version < FORMAT_VERSION:  # before the scales, whose shape it changed
        layout = "one scale per block" if version == 1 else "codes of head vectors turned by another transform"
        raise PersistError(
            f"{path} holds {meta['kv_dtype']} K/V with {layout} (format version {version}, an older prefixkv); this "
            f"prefixkv (format version {FORMAT_VERSION}) cannot read them. Save the prefixes again from an "
            "unquantized store or with this prefixkv"
        )
    kv = kv_tensors(tensors, meta, path, bad)
    nodes = len(parent)
    if not (len(length) == len(num_blocks) == nodes and sum(length) == len(tokens) and sum(num_blocks) == len(blocks)):
        raise bad("the trie tensors disagree in length")
    if any(not 0 <= b < kv.blocks for b in blocks):
        raise bad("a block index is out of range")  # token keys may be negative: tokens a mask hid
    why = non_finite(kv)
    if why is not None:
        raise PersistError(
            f"{path} holds {why}: every later request reusing them would compute NaN logits. The file was not "
            "written from a sane store; save the prefixes again"
        )
    starts: list[int] = []  # position of each node's first token
    token_at: list[int] = []  # where each node's edge starts in ``tokens``, its blocks in ``blocks``
    block_at: list[int] = []
    has_child = [False] * nodes
    for i in range(nodes):
        p = parent[i]
        if not -1 <= p < i or length[i] < 1:
            raise bad(f"node {i} has parent {p} and length {length[i]}")
        start = starts[p] + length[p] if p >= 0 else 0
        chunks = (start + length[i] - 1) // bs - start // bs + 1
        if num_blocks[i] != chunks:
            raise bad(f"node {i} touches {chunks} chunks but lists {num_blocks[i]} blocks")
        starts.append(start)
        token_at.append(token_at[-1] + length[i - 1] if i else 0)
        block_at.append(block_at[-1] + num_blocks[i - 1] if i else 0)
        if p >= 0:
            has_child[p] = True

    def whole_path(leaf: int) -> tuple[list[int], list[int]]:
        """The leaf's tokens from position 0, and the block of each chunk along its path (a node's
        first block replaces its parent's last one when they share a chunk)."""
        chain = []
        while leaf >= 0:
            chain.append(leaf)
            leaf = parent[leaf]
        path_tokens: list[int] = []
        table: list[int] = []
        for i in reversed(chain):
            path_tokens += tokens[token_at[i] : token_at[i] + length[i]]
            del table[starts[i] // bs :]
            table += blocks[block_at[i] : block_at[i] + num_blocks[i]]
        return path_tokens, table

    paths = [whole_path(i) for i in range(nodes) if not has_child[i]]
    return PrefixFile(
        meta,
        bs,
        kv.dtype,
        _dtype(meta, "model_dtype", path),
        paths,
        {s.stored: t for s, t in kv.tensors},
        kv.blocks,
        kv.kv_dtype,
    )


class KV(NamedTuple):
    """The block tensors of a file, as :func:`kv_tensors` checked them: each (what the pool names it,
    :class:`~prefixkv.kv.pool.StoredTensor`; the tensor), per layer ``[blocks, block_size, heads, size]`` (codes
    when quantized) and the scales, the dtype they are read back in."""

    tensors: list[tuple[StoredTensor, torch.Tensor]]
    blocks: int
    dtype: torch.dtype
    kv_dtype: str | None


def kv_tensors(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], path: PathLike, bad: Callable[[str], Exception]
) -> KV:
    """The block tensors (and scales) of a file of saved prefixes or of a tier's block, checked against the layers'
    tensors and dtypes its metadata ``meta`` names (:func:`file_layers`): each present, of its dtype and shape, as
    many blocks in each. Raises ``bad(what is wrong)``, or :class:`PersistError` for metadata that names no valid
    shape. Does not mutate."""
    bs = _int(meta, "block_size", path)
    num_layers = _int(meta, "num_layers", path)
    if bs < 1 or num_layers < 1:
        raise bad(f"block_size {bs}, num_layers {num_layers}")
    layers = file_layers(meta, path)
    if len(layers) != num_layers:
        raise PersistError(f"{path} names {len(layers)} layers' shapes for its {num_layers} layers; it is corrupted")
    dtype = _dtype(meta, "dtype", path)
    kv_dtype = meta.get("kv_dtype")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise bad(f"kv_dtype {kv_dtype!r} is none of {KV_DTYPES}")
    named = stored_tensors(layers, kv_dtype is not None)
    for s in named:
        if not s.scale and s.stored not in tensors:
            raise bad(f"tensor {s.stored} is missing")
    stored = dtype if kv_dtype is None else code_dtype(kv_dtype)
    first = tensors[named[0].stored]
    count = first.shape[0] if first.dim() == 4 else -1
    out = []
    for s in named:
        t = tensors.get(s.stored)
        heads, dim = s.shape
        if s.scale:
            if t is None or t.dtype != SCALE_DTYPE or tuple(t.shape) != (count, bs, heads):
                raise bad(f"scale tensor {s.stored} is missing or not {SCALE_DTYPE} of shape [{count}, {bs}, {heads}]")
        elif t is None or t.dim() != 4 or tuple(t.shape) != (count, bs, heads, dim) or t.dtype != stored:
            what = "a K/V tensor" if s.name in ("k", "v") else f"tensor {s.stored}"
            shape = None if t is None else tuple(t.shape)
            raise bad(
                f"{what} is {None if t is None else t.dtype} of shape {shape}, "
                f"expected {stored} of shape [{count}, {bs}, {heads}, {dim}]"
            )
        out.append((s, t))
    return KV(out, count, dtype, kv_dtype)


def non_finite(kv: KV) -> str | None:
    """Where ``kv`` holds a NaN or an infinity ("non-finite V values (NaN or inf) in layer 1"), or ``None``.
    Does not mutate."""
    for s, t in kv.tensors:
        if not torch.isfinite(t).all():
            if s.scale:
                return f"non-finite scales (NaN or inf) in {s.stored}"
            name = s.name.upper() if s.name in ("k", "v") else s.name
            return f"non-finite {name} values (NaN or inf) in layer {s.layer}"
    return None


def block_problem(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str | None:
    """What is wrong with the tensors of one block of a second tier whose files carry ``meta``
    (:mod:`prefixkv.kv.tier`: a file with a right checksum and metadata may still hold other tensors, written by
    another writer of a shared directory), checked as a saved file's (:func:`kv_tensors`, :func:`non_finite`), or
    ``None``. Does not mutate."""
    try:
        kv = kv_tensors(tensors, meta, "", ValueError)
    except (ValueError, PersistError) as e:
        return f"does not hold the K/V its metadata names ({e})"
    if kv.blocks != 1:
        return f"holds {kv.blocks} blocks, not one"
    why = non_finite(kv)
    return None if why is None else f"holds {why}"


# -- compatibility ----------------------------------------------------------------------------------------


def check_compatible(
    file: PrefixFile,
    path: PathLike,
    block_size: int,
    dtype: torch.dtype,
    model_dtype: torch.dtype,
    kv_dtype: str | None = None,
) -> None:
    """Refuse a file made for another block size, dtype or quantization (its model: :func:`check_model`, once the
    store that reads it has measured its model). Does not mutate."""
    if file.kv_dtype != kv_dtype:
        kept, wanted = file.kv_dtype or "unquantized", kv_dtype or "unquantized"
        raise PersistError(
            f"{path} keeps K/V {kept}, the store {wanted}: quantized and unquantized prefixes are kept apart. "
            f"Load it into a store with kv_dtype={file.kv_dtype!r}, or convert it explicitly with "
            f"PrefixStore.convert(path, new_path, kv_dtype={kv_dtype!r})"
        )
    if file.block_size != block_size:
        raise PersistError(
            f"{path} holds blocks of {file.block_size} tokens but the store uses block_size={block_size}; "
            f"load it into a store with block_size={file.block_size}"
        )
    if file.model_dtype != model_dtype:
        raise PersistError(
            f"{path} was computed by a model in {file.model_dtype}, this model runs in {model_dtype}: its K/V "
            f"would not be what this model computes; cast the model to {file.model_dtype} or save the prefixes again"
        )
    if file.dtype != dtype:
        raise PersistError(
            f"{path} keeps K/V in {file.dtype}, the store in {dtype}; build the store with dtype={file.dtype}"
        )


def check_model(file: PrefixFile, path: PathLike, model: Any, specs: Sequence[LayerSpec]) -> None:
    """Refuse a file whose K/V have another shape than ``specs`` (a store's pool's, measured from the tensors its
    model's layers hand over, :mod:`prefixkv.hf.shapes`, not read from its config) or that another model computed.
    Does not mutate."""
    meta = file.meta
    where = Path(path)
    theirs = file_shapes(meta, where)
    shapes = [(s.key_shape, s.value_shape) for s in specs]
    if theirs != shapes:
        raise PersistError(
            f"{path} was saved from a model with {len(theirs)} layers of K/V {_shapes_text(theirs)}, this model has "
            f"{len(shapes)} of {_shapes_text(shapes)}: it belongs to another model"
        )
    kept, keeps = file_layers(meta, where), [s.tensors for s in specs]
    if kept != keeps:
        raise PersistError(
            f"{path} was saved from a model whose layers keep the per-token tensors {kept}, this model's keep "
            f"{keeps}: it belongs to another model"
        )
    ours = fingerprint(model)
    if meta["model_fingerprint"] != ours:
        raise PersistError(
            f"{path} was saved from a model with other weights or a config that changes K/V: its K/V would give "
            f"wrong output with this one (fingerprint {meta['model_fingerprint'][:12]} in the file, saved from a "
            f"{meta.get('model_type', '?')} model; {ours[:12]} for this "
            f"{family(model)} model). Load it with the model (weights, "
            "config and adapter) it was saved from"
        )


LayerShapes = list[tuple[tuple[int, int], tuple[int, int]]]


def shapes_meta(specs: Sequence[LayerSpec]) -> dict[str, str]:
    """The metadata naming each layer's K and V shapes: ``kv_heads`` and ``head_dim`` (of every layer, as files
    written before per-layer shapes name them), and where layers or K and V differ, ``layer_shapes``: per layer
    ``"K heads,K size,V heads,V size"``, joined by ``;``. Does not mutate."""
    first = specs[0]
    meta = {"kv_heads": str(first.kv_heads), "head_dim": str(first.head_dim)}
    if any(s.key_shape != first.key_shape or s.value_shape != first.key_shape for s in specs):
        meta["layer_shapes"] = ";".join(",".join(map(str, (*s.key_shape, *s.value_shape))) for s in specs)
    if any(s.extra for s in specs):  # per layer "name=heads,size" of each tensor its kind keeps besides K and V
        meta["layer_tensors"] = ";".join(" ".join(f"{n}={h},{d}" for n, (h, d) in s.extra) for s in specs)
    return meta


def file_layers(meta: dict[str, str], path: PathLike) -> list[dict[str, tuple[int, int]]]:
    """Each layer's per-token tensors by name (:attr:`prefixkv.kv.pool.LayerSpec.tensors`), K and V as
    :func:`file_shapes` reads them and any more as :func:`shapes_meta` wrote them (``layer_tensors``; none in a file
    without it). Raises :class:`PersistError` for metadata that names none. Does not mutate."""
    layers = file_shapes(meta, path)
    text = meta.get("layer_tensors")
    extras: list[list[tuple[str, tuple[int, int]]]] = [[] for _ in layers]
    if text is not None:
        try:
            parsed = [[_named_shape(item) for item in layer.split()] for layer in text.split(";")]
        except ValueError:
            parsed = []
        if len(parsed) != len(layers):
            raise PersistError(f"{path} has no valid 'layer_tensors' in its metadata ({text!r}); it is corrupted")
        extras = parsed
    return [spec_tensors(k, v, extra) for (k, v), extra in zip(layers, extras)]


def _named_shape(item: str) -> tuple[str, tuple[int, int]]:
    """``"index_k=1,8"`` as ``("index_k", (1, 8))``; raises ``ValueError`` for anything else."""
    name, _, numbers = item.partition("=")
    heads, dim = (int(n) for n in numbers.split(","))
    if not name:
        raise ValueError(item)
    return name, (heads, dim)


def file_shapes(meta: dict[str, str], path: PathLike) -> LayerShapes:
    """Each layer's K and V shapes (heads, head size) as :func:`shapes_meta` wrote them. Raises
    :class:`PersistError` for metadata that names none. Does not mutate."""
    text = meta.get("layer_shapes")
    if text is None:
        shape = (_int(meta, "kv_heads", path), _int(meta, "head_dim", path))
        return [(shape, shape)] * _int(meta, "num_layers", path)
    try:
        numbers = [tuple(int(n) for n in layer.split(",")) for layer in text.split(";")]
    except ValueError:
        numbers = []
    if not numbers or any(len(n) != 4 for n in numbers):
        raise PersistError(f"{path} has no valid 'layer_shapes' in its metadata ({text!r}); the file is corrupted")
    return [((n[0], n[1]), (n[2], n[3])) for n in numbers]


def _shapes_text(shapes: LayerShapes) -> str:
    """``shapes`` as a reader follows them: "2 x 16" for every layer alike, else per layer "K 2 x 16, V 2 x 8"."""
    if len(set(shapes)) == 1 and shapes[0][0] == shapes[0][1]:
        return "{} heads x {}".format(*shapes[0][0])
    return "; ".join(f"K {k[0]} x {k[1]}, V {v[0]} x {v[1]}" for k, v in shapes)


# -- helpers ------------------------------------------------------------------------------------------------


def checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(tensor_bytes(t))
    for key in sorted(meta):
        if key != "checksum":
            digest.update(f"{key}={meta[key]}\n".encode())
    return "sha256:" + digest.hexdigest()


def _long_list(t: torch.Tensor, name: str, bad: Any) -> list[int]:
    if t.dtype != torch.int64 or t.dim() != 1:
        raise bad(f"{name} is {t.dtype} of shape {tuple(t.shape)}, expected 1-D int64")
    values: list[int] = t.tolist()
    return values


def _int(meta: dict[str, str], key: str, path: PathLike) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        raise PersistError(f"{path} has no valid {key!r} in its metadata; the file is corrupted") from None


def _dtype(meta: dict[str, str], key: str, path: PathLike) -> torch.dtype:
    value = getattr(torch, meta.get(key, ""), None)
    if not isinstance(value, torch.dtype):
        raise PersistError(f"{path} names no valid {key!r} in its metadata ({meta.get(key)!r}); it is corrupted")
    return value


def _longs(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
