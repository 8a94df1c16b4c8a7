"""The second tier: blocks evicted from a store's pool, kept in host memory or on disk instead of dropped.

An entry is one whole block (every layer's K and V as the pool stores them, scales included when
quantized), keyed by a chained sha256 over the tokens from position 0 to the block's end: the key of
chunk ``c`` hashes the key of chunk ``c - 1`` and the ``block_size`` tokens of chunk ``c``. A prefix is
thus found block by block where the trie's match stops, and two prefixes that share their first blocks
share those entries. No trie and no allocator here: the store decides what to offload and what to bring
back (when it makes room, and in :meth:`prefixkv.kv.manager.BlockManager.claim`); the tier keeps entries within its own
budget, least recently used first out.

Kinds: ``"cpu"`` keeps tensors in host memory (pinned when CUDA is present, so a copy back to the GPU
runs asynchronously with compute); ``"disk"`` writes one safetensors file per block into a directory and
reads it back memory-mapped. A disk file is written under a temporary name and renamed when whole, and
carries the metadata and checksum of :mod:`prefixkv.kv.prefix_file`: a write cut short by a crash leaves only a
temporary file, which is never read; a file whose checksum fails is dropped with a warning.

An entry may carry a section of its own beside the block's K/V (tensors named under
:data:`prefixkv.kv.prefix_file.SECTION`: a model's recurrent-state snapshots inside the block), which the tier's
:class:`Payload` hands it when the block leaves the pool and takes back when it returns; the tier keeps and checks
it as the rest of the entry (``check``), and knows nothing else of it.

A directory may be shared (two workers, two models of one shape, a plain and an int8 store): a file's name
starts with the store's *identity*, a hash of what its K/V depend on besides the tokens (model fingerprint,
dtype, quantization, block size), and every read checks the file's metadata and key space against the reader's,
so a store never reads another's blocks and leaves their files alone. Stores of one identity share their files:
one may drop a file another still lists, which is then a miss for that other.

A file read back is also checked as a saved file is (``check``: :func:`prefixkv.kv.prefix_file.block_problem`),
so that a file with a right checksum and metadata but other tensors is dropped, not served. The checksum is not
keyed: whoever can write to the directory can plant K/V that pass every check, so a directory must be private to
stores that trust each other (docs/memory.md, "Who may write to ``offload_dir``").

The tier is best-effort (docs/correctness.md, "The second tier"): a write that fails (a full disk, a removed
directory) warns once and keeps nothing, so the request that evicted the block goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from ..base.stats import TierStats
from . import prefix_file
from .nodes import Node

KINDS = ("cpu", "disk")
BLOCK_FORMAT = "prefixkv.block"
_SUFFIX = ".safetensors"


class Payload(Protocol):
    """What rides with a tier's blocks, handed down from above this floor (for a model with recurrent layers, the
    snapshots of :class:`prefixkv.hf.state_files.Carrier`)."""

    def leaving(self, space: Hashable, node: Node, block_size: int) -> dict[int, dict[str, torch.Tensor]]:
        """Per whole chunk of the evicted ``node`` (key space ``space``), the section its tier entry carries.
        Mutates (hands it over)."""
        ...

    def arrived(
        self, space: Hashable, tokens: Sequence[int], chunk: int, block_size: int, tensors: dict[str, torch.Tensor]
    ) -> None:
        """Chunk ``chunk`` of ``tokens`` came back into the trie (key space ``space``) with the section ``tensors``.
        Mutates."""
        ...

    def cleared(self) -> None:
        """The tier was cleared: forget whatever was handed over for an offload not made. Mutates."""
        ...


def chunk_keys(tokens: Sequence[int], block_size: int, chunks: int, space: Hashable = None) -> list[str]:
    """The keys of the first ``chunks`` whole blocks of ``tokens`` in the store's key space ``space`` (active
    adapters, weights version: the same tokens have other K/V there). Does not mutate.

    >>> a = chunk_keys([1, 2, 3, 4, 5, 6], 2, 3)
    >>> b = chunk_keys([1, 2, 3, 4, 9, 9], 2, 3)
    >>> a[:2] == b[:2], a[2] == b[2]
    (True, False)
    """
    keys: list[str] = []
    digest = hashlib.sha256()
    if space is not None:
        digest.update(repr(space).encode())  # repr, not hash(): stable across processes for the disk tier
    for c in range(chunks):
        digest.update(torch.tensor(tokens[c * block_size : (c + 1) * block_size], dtype=torch.int64).numpy().tobytes())
        keys.append(digest.copy().hexdigest())
    return keys


class OffloadTier:
    """Blocks keyed by :func:`chunk_keys`, in host memory (``kind="cpu"``) or files (``kind="disk"``),
    within ``max_bytes`` (``None``: unbounded), least recently used first out.

    ``meta`` is the metadata (:func:`prefixkv.store.files.file_meta`) every disk file carries; files already in
    ``directory`` with the same metadata are taken as this tier's, the others are left alone. ``check`` says what
    is wrong with the tensors of a file read back (``None``: nothing), for files whose checksum and metadata are
    right but whose tensors are not what the metadata names (:func:`prefixkv.kv.prefix_file.block_problem`).

    >>> tier = OffloadTier("cpu", max_bytes=1000)
    >>> tier.put("a", {"k.0": torch.zeros(1, 4, 2, 8)})
    True
    >>> "a" in tier, tier.stats.bytes
    (True, 256)
    """

    def __init__(
        self,
        kind: str,
        *,
        max_bytes: int | None = None,
        directory: str | os.PathLike[str] | None = None,
        meta: dict[str, str] | None = None,
        check: Callable[[dict[str, torch.Tensor]], str | None] | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"offload must be None, 'cpu' or 'disk', got {kind!r}")
        if kind == "disk" and directory is None:
            raise ValueError("offload='disk' needs offload_dir, the directory to keep the offloaded blocks in")
        if kind == "cpu" and directory is not None:
            raise ValueError("offload_dir is for offload='disk'; offload='cpu' keeps blocks in host memory")
        self.kind = kind
        self.max_bytes = max_bytes
        self.meta = dict(meta or {})
        self._check = check
        self.payload: Payload | None = None
        """What rides with the blocks (set by the store; ``None``: nothing)."""
        self.directory = None if directory is None else Path(directory)
        # file names start with a hash of the metadata: stores of another model, dtype, quantization or block size
        # sharing the directory never write or list each other's files (the same tokens give the same key)
        self._prefix = hashlib.sha256(json.dumps(self.meta, sort_keys=True).encode()).hexdigest()[:16] + "-"
        self._warned = False
        self._pin = kind == "cpu" and torch.cuda.is_available()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._held: dict[str, dict[str, torch.Tensor]] = {}  # kind "cpu" only
        self._bytes = 0
        self._offloaded = self._restored = self._hit_tokens = self._evictions = 0
        if self.directory is not None:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # its writers choose what is served
            self._scan()

    # -- queries ---------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def stats(self) -> TierStats:
        """The counters. Does not mutate."""
        return TierStats(
            self.kind,
            len(self._sizes),
            self._bytes,
            self.max_bytes,
            self._offloaded,
            self._restored,
            self._hit_tokens,
            self._evictions,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the byte count, the budget or the files disagree with the entries.
        Does not mutate."""
        if self._bytes != sum(self._sizes.values()):
            raise AssertionError(f"the tier counts {self._bytes} bytes, its entries {sum(self._sizes.values())}")
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            raise AssertionError(f"the tier holds {self._bytes} bytes, over its budget of {self.max_bytes}")
        if self.kind == "cpu" and set(self._held) != set(self._sizes):
            raise AssertionError("the tier's tensors and its LRU disagree")
        if self.directory is not None:
            # another store of this identity may add or remove files: only the files an entry names are checked
            for key, size in self._sizes.items():
                path = self.path(key)
                if path.exists() and path.stat().st_size != size:
                    raise AssertionError(f"{path} has {path.stat().st_size} bytes, its entry {size}")

    def path(self, key: str) -> Path:
        """The file of the block under ``key`` (``kind="disk"``). Does not mutate."""
        assert self.directory is not None, "a cpu tier keeps no files"
        return self.directory / f"{self._prefix}{key}{_SUFFIX}"

    # -- mutations -------------------------------------------------------------------------------

    def touch(self, key: str) -> bool:
        """Mark ``key`` used now; return whether it is held. Mutates the LRU order."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def put(self, key: str, tensors: dict[str, torch.Tensor], space: str = "", *, replace: bool = False) -> bool:
        """Keep a block (one ``[1, ...]`` tensor per name) of key space ``space`` (its ``repr``) under ``key``,
        dropping least recently used entries for room; an entry already held is only marked used (with ``replace``,
        written again: it carries another section). Returns whether it is held: a write that fails (a full disk, a
        removed directory) keeps nothing, with one warning per tier. Mutates.

        A disk entry's size is its file's, header included."""
        if replace and key in self._sizes:
            self._drop(key)
        if self.touch(key):
            return True
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        try:
            if self.directory is not None:
                meta = {**self.meta, "key": key, "namespace": space}
                meta["checksum"] = prefix_file.checksum(tensors, meta)
                prefix_file.write_atomically(self.path(key), tensors, meta)
                size = self.path(key).stat().st_size
            else:
                self._held[key] = {n: t.pin_memory() if self._pin else t for n, t in tensors.items()}
        except Exception as e:  # OSError for a full disk or a removed directory; a pinning failure; any writer's own
            self._failed(e)
            return False
        self._sizes[key] = size
        self._bytes += size
        self._offloaded += 1
        self._fit()
        return key in self._sizes

    def _fit(self) -> None:
        """Drop least recently used entries until the budget holds. Mutates."""
        while self.max_bytes is not None and self._bytes > self.max_bytes:
            self._drop(next(iter(self._sizes)))
            self._evictions += 1

    def get(self, key: str, space: str = "") -> dict[str, torch.Tensor] | None:
        """The block of key space ``space`` under ``key`` (marked used), or ``None`` if it is not held, its file is
        gone (another store of this identity dropped it), was written for another store or key space (then it is
        left alone), or fails its checksum or ``check`` (then it is dropped, with a warning). Mutates the LRU order."""
        if key not in self._sizes:
            return None
        self._sizes.move_to_end(key)
        if self.directory is None:
            return self._held[key]
        path = self.path(key)
        if not path.exists():
            self._bytes -= self._sizes.pop(key)
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        except Exception as e:  # safetensors raises its own error type for every malformed file
            self._refuse(key, f"is unreadable ({e})")
            return None
        if meta.get("checksum") != prefix_file.checksum(tensors, meta) or meta.get("key") != key:
            self._refuse(key, "fails its checksum")
            return None
        if _identity(meta) != self.meta or meta.get("namespace", "") != space:
            self._bytes -= self._sizes.pop(key)  # not this store's K/V: a miss, and the file stays its writer's
            return None
        why = None if self._check is None else self._check(tensors)
        if why is not None:  # this store's name and metadata, other tensors: no store would read them
            self._refuse(key, why)
            return None
        return tensors

    def count_restored(self, blocks: int, tokens: int) -> None:
        """Record ``blocks`` brought back, giving ``tokens`` prompt tokens of reuse. Mutates."""
        self._restored += blocks
        self._hit_tokens += tokens

    def clear(self) -> int:
        """Drop every entry (and its file), and what the payload kept for an offload (:meth:`Payload.cleared`).
        Returns how many. Mutates."""
        n = len(self._sizes)
        for key in list(self._sizes):
            self._drop(key)
        if self.payload is not None:
            self.payload.cleared()
        return n

    # -- internals -------------------------------------------------------------------------------

    def _drop(self, key: str) -> None:
        self._bytes -= self._sizes.pop(key)
        self._held.pop(key, None)
        if self.directory is not None:
            self.path(key).unlink(missing_ok=True)

    def _refuse(self, key: str, why: str) -> None:
        warnings.warn(f"prefixkv: offloaded block {self.path(key)} {why}; it is dropped and recomputed", stacklevel=3)
        self._drop(key)

    def _failed(self, error: Exception) -> None:
        """A write failed: warn the first time (every later failure is the same story). Mutates."""
        if self._warned:
            return
        self._warned = True
        where = "host memory" if self.directory is None else str(self.directory)
        warnings.warn(
            f"prefixkv: the {self.kind} tier cannot keep blocks in {where} ({type(error).__name__}: {error}); blocks "
            "evicted from the pool are dropped instead, and generate goes on (recomputing them when needed). Free "
            "room there or give the store another offload_dir",
            stacklevel=4,
        )

    def _scan(self) -> None:
        """Index the block files of this store's identity already in the directory (its earlier life, or another
        live store of the same model, dtype, quantization and block size), oldest first, after checking their
        metadata. Files of other stores, and temporary files of unfinished writes, are left alone."""
        assert self.directory is not None
        files = sorted(self.directory.glob(f"{self._prefix}*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            key = path.name[len(self._prefix) : -len(_SUFFIX)]
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    meta = dict(f.metadata() or {})
            except Exception as e:  # safetensors raises its own error type for every malformed file
                warnings.warn(f"prefixkv: {path} in offload_dir is unreadable ({e}); it is removed", stacklevel=3)
                path.unlink(missing_ok=True)
                continue
            if _identity(meta) != self.meta or meta.get("key") != key:
                continue  # not this store's (a hash that collides, or a file renamed by hand): never read
            size = path.stat().st_size
            self._sizes[key] = size
            self._bytes += size
        self._fit()


def _identity(meta: dict[str, str]) -> dict[str, str]:
    """What a block file's metadata says about the store that wrote it: all but its own key, key space and
    checksum."""
    return {k: v for k, v in meta.items() if k not in ("key", "namespace", "checksum")}
