"""Recurrent-state snapshots outside memory: as named tensors beside the blocks of a saved file and of a second
tier's entry (docs/how-it-works.md, "Layer kinds"; docs/persistence.md, "Models with recurrent layers").

A snapshot goes where the K/V of its path go. A saved file holds, beside its blocks and trie, a *snapshot section*
(:func:`pack`, names under :data:`prefixkv.kv.prefix_file.SECTION`): ``state.position`` (``[n]`` int64, each
snapshot's position), per state of the model one stacked tensor ``state.{layer}.{index}.conv`` or
``.recurrent`` (``[n, ...]``, a row's state as the cache's layer holds it), ``state.kernel`` (``[m, 3]`` int64:
layer, index and kernel size of each conv state) and, in a file, ``state.leaf`` (``[n]`` int64: a saved path that
runs through the snapshot's position, by its index among the file's leaf paths). A second tier's entry holds the
snapshots at positions inside its block (``(p - 1) // block_size`` is the block's chunk) the same way, without
``state.leaf``: the entry's key is the path. :class:`Carrier` moves them: the trie tells it the snapshots of a
node it evicts (:meth:`Carrier.evicted`), the tier's room asks for them when it offloads the node's blocks and
hands them back when it restores a block (:class:`prefixkv.kv.tier.Payload`).

What is read back is checked before it is used (:func:`unpack`): the tensors the section names present, of one count,
finite, and of the names, shapes, dtypes and kernel sizes of the *reference* snapshot (the store's model's own
states, measured by :func:`prefixkv.hf.shapes.measure`); a file that fails is refused (``PersistError``), a disk
tier's entry dropped with a warning and recomputed, as a bad block is. A snapshot that is missing is never a wrong
answer: the row resumes from an earlier one and computes the rest."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

import torch

from ..kv.nodes import Node, path_tokens
from ..kv.prefix_file import SECTION
from .states import Snapshot, Snapshots, StateKey

POSITION = SECTION + "position"
KERNEL = SECTION + "kernel"
LEAF = SECTION + "leaf"
_KINDS = ("conv", "recurrent")


def _name(key: StateKey) -> str:
    return f"{SECTION}{key[0]}.{key[1]}.{key[2]}"


def _key(name: str) -> StateKey | None:
    """The state a section's tensor name names, or ``None`` for the section's own tensors and names of none."""
    parts = name.removeprefix(SECTION).split(".")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in _KINDS:
        return None
    return int(parts[0]), int(parts[1]), parts[2]


def pack(snapshots: Sequence[Snapshot]) -> dict[str, torch.Tensor]:
    """The section of ``snapshots`` (all alike: the snapshots of one model), on the CPU; ``{}`` for none. Does not
    mutate."""
    if not snapshots:
        return {}
    first = snapshots[0]
    out = {_name(key): torch.stack([s.tensors[key] for s in snapshots]).cpu() for key in first.tensors}
    out[POSITION] = torch.tensor([s.position for s in snapshots], dtype=torch.int64)
    kernels = [[layer, index, size] for (layer, index), size in sorted(first.kernels.items())]
    out[KERNEL] = torch.tensor(kernels, dtype=torch.int64).reshape(-1, 3)
    return out


def unpack(
    tensors: dict[str, torch.Tensor], reference: Snapshot | None, devices: Sequence[torch.device] = ()
) -> list[Snapshot]:
    """The snapshots of a section (the ``state.`` tensors of ``tensors``; ``[]`` without ``state.position``), each
    state on its layer's device (``devices[layer]``; the CPU without), checked against ``reference`` (the model's
    own states; ``None``: only against each other). Raises ``ValueError`` saying what is wrong. Does not mutate."""
    positions = tensors.get(POSITION)
    if positions is None:
        if any(name.startswith(SECTION) and name != LEAF for name in tensors):
            raise ValueError(f"its snapshot tensors lack {POSITION}")
        return []
    if positions.dtype != torch.int64 or positions.dim() != 1 or not len(positions):
        raise ValueError(f"{POSITION} is {positions.dtype} of shape {tuple(positions.shape)}, expected [n] int64")
    n = len(positions)
    if int(positions.min()) < 1:
        raise ValueError(f"{POSITION} holds position {int(positions.min())}, below 1")
    kernel = tensors.get(KERNEL)
    if kernel is None or kernel.dtype != torch.int64 or kernel.dim() != 2 or kernel.shape[1] != 3:
        raise ValueError(f"{KERNEL} is missing or not [m, 3] int64")
    kernels = {(int(a), int(b)): int(c) for a, b, c in kernel.tolist()}
    states = {key: t for name, t in tensors.items() if (key := _key(name)) is not None}
    expected = reference.tensors if reference is not None else states
    if set(states) != set(expected) or not states:
        missing = sorted(_name(k) for k in set(expected) - set(states)) or ["every state"]
        extra = sorted(_name(k) for k in set(states) - set(expected))
        raise ValueError(f"its snapshots lack {', '.join(missing)}" if not extra else f"it names {extra[0]}")
    if reference is not None and kernels != reference.kernels:
        raise ValueError(f"its conv kernel sizes {kernels} are not the model's {reference.kernels}")
    for key, t in states.items():
        shape, dtype = tuple(expected[key].shape[1 if reference is None else 0 :]), expected[key].dtype
        if t.dim() < 1 or t.shape[0] != n or tuple(t.shape[1:]) != shape or t.dtype != dtype:
            raise ValueError(
                f"{_name(key)} is {t.dtype} of shape {tuple(t.shape)}, expected {dtype} of shape [{n}, "
                f"{', '.join(map(str, shape))}] (the model's states)"
            )
        if not torch.isfinite(t).all():
            raise ValueError(f"{_name(key)} holds non-finite values (NaN or inf)")

    def device(layer: int) -> torch.device:
        return devices[layer] if layer < len(devices) else torch.device("cpu")

    return [
        Snapshot(int(p), {k: t[j].to(device(k[0]), copy=True) for k, t in states.items()}, dict(kernels))
        for j, p in enumerate(positions.tolist())
    ]


def file_section(
    snapshots: Snapshots, space: Hashable, leaves: Sequence[Sequence[int]]
) -> tuple[dict[str, torch.Tensor], int]:
    """A saved file's section: the snapshots ``snapshots`` holds in ``space`` on the ``leaves`` (the saved paths,
    in file order), each once with the first leaf that runs through it; and how many. Does not mutate."""
    found: dict[int, tuple[Snapshot, int]] = {}
    for i, leaf in enumerate(leaves):
        for snapshot in snapshots.along(space, leaf):
            found.setdefault(id(snapshot), (snapshot, i))
    chosen = list(found.values())
    if chosen:  # every snapshot of a model is alike; one unlike the first (none seen) is left out
        first = chosen[0][0]
        chosen = [(s, i) for s, i in chosen if _alike(s, first)]
    section = pack([s for s, _ in chosen])
    if chosen:
        section[LEAF] = torch.tensor([i for _, i in chosen], dtype=torch.int64)
    return section, len(chosen)


def file_snapshots(
    tensors: dict[str, torch.Tensor],
    leaves: Sequence[Sequence[int]],
    count: int,
    reference: Snapshot | None,
    devices: Sequence[torch.device] = (),
) -> list[tuple[list[int], Snapshot]]:
    """The snapshots of a read file's section (``tensors``) with their paths, checked: ``count`` of them (what the
    file's metadata says it holds), each on a saved path (``leaves``) no shorter than its position. Raises
    ``ValueError`` saying what is wrong. Does not mutate."""
    found = unpack(tensors, reference, devices)
    if len(found) != count:
        raise ValueError(f"its metadata names {count} recurrent-state snapshots, its tensors hold {len(found)}")
    if not found:
        return []
    leaf = tensors.get(LEAF)
    if leaf is None or leaf.dtype != torch.int64 or tuple(leaf.shape) != (count,):
        raise ValueError(f"{LEAF} is missing or not [{count}] int64")
    out = []
    for snapshot, i in zip(found, leaf.tolist(), strict=True):
        if not 0 <= i < len(leaves) or len(leaves[i]) < snapshot.position:
            raise ValueError(f"a snapshot at position {snapshot.position} lies on no saved path (leaf {i})")
        out.append((list(leaves[i][: snapshot.position]), snapshot))
    return out


def _alike(a: Snapshot, b: Snapshot) -> bool:
    return a.kernels == b.kernels and {k: (t.shape, t.dtype) for k, t in a.tensors.items()} == {
        k: (t.shape, t.dtype) for k, t in b.tensors.items()
    }


class Carrier:
    """A store's snapshots as they leave memory and come back: read from a saved file (:meth:`from_file`), and sent
    to a second tier with their blocks and brought back with them (a :class:`prefixkv.kv.tier.Payload`; its
    :meth:`evicted` is then the trie's watcher in place of :meth:`Snapshots.evicted`). ``reference`` is the model's
    own states (:func:`unpack`), ``devices`` each layer's device."""

    def __init__(self, snapshots: Snapshots, reference: Snapshot | None, devices: Sequence[torch.device]) -> None:
        self.snapshots = snapshots
        self.reference = reference
        self.devices = list(devices)
        # the snapshots of the node evicted last, until its room offloads it (under the store's lock)
        self._leaving: tuple[Node, list[Snapshot]] | None = None

    def evicted(self, space: Hashable, node: Node) -> None:
        """The trie evicted ``node``: its snapshots leave memory with it (:meth:`Snapshots.evicted`), kept here
        until the room offloads the node's blocks (:meth:`leaving`). Mutates."""
        gone = self.snapshots.leave(space, node)
        self._leaving = (node, gone) if gone else None

    def cleared(self) -> None:
        """The tier was cleared (``store.clear()``): the snapshots of the node evicted last go too. Mutates."""
        self._leaving = None

    def leaving(self, space: Hashable, node: Node, block_size: int) -> dict[int, dict[str, torch.Tensor]]:
        """Per whole chunk of the evicted ``node`` (those its tier entries hold), the section of the snapshots inside
        that chunk: those evicted with it, and copies of those its ancestors hold inside its first chunk (they stay in
        memory with the ancestors' K/V; a snapshot where a node ends inside a chunk goes so with the descendant that
        holds the chunk whole, evicted first). Mutates (forgets what was evicted)."""
        own = self._leaving[1] if self._leaving is not None and self._leaving[0] is node else []
        self._leaving = None
        bs = block_size
        first, end = node.start // bs, node.end // bs
        if end <= first:
            return {}
        above = self.snapshots.along(space, path_tokens(node)[: node.start], first * bs)
        by_chunk: defaultdict[int, list[Snapshot]] = defaultdict(list)
        for snapshot in [*above, *own]:
            c = (snapshot.position - 1) // bs
            if first <= c < end:
                by_chunk[c].append(snapshot)
        return {c: pack(group) for c, group in by_chunk.items()}

    def from_file(
        self, tensors: dict[str, torch.Tensor], leaves: Sequence[Sequence[int]], count: int
    ) -> list[tuple[list[int], Snapshot]]:
        """The snapshots of a read file's section, with their paths, checked (:func:`file_snapshots`). Raises
        ``ValueError`` saying what is wrong. Does not mutate."""
        return file_snapshots(tensors, leaves, count, self.reference, self.devices)

    def keep(
        self, space: Hashable, found: Sequence[tuple[list[int], Snapshot]], held: Callable[[list[int]], int]
    ) -> None:
        """Keep the snapshots ``found`` (a merged file's) whose path the store now holds (``held(path)``: how many of
        its tokens it holds in ``space``) and where none is held yet. Mutates."""
        for path, snapshot in found:
            if held(path) >= len(path):
                self._add(space, path, snapshot)

    def _add(self, space: Hashable, path: Sequence[int], snapshot: Snapshot) -> None:
        """Keep ``snapshot`` of ``path`` unless one is held there already (the same state). Mutates."""
        there = self.snapshots.find(space, path, snapshot.position)
        if there is None or there.position < snapshot.position:
            self.snapshots.add(space, path, snapshot)

    def problem(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """What is wrong with the snapshots of a tier entry's tensors (:func:`unpack`), or ``None``. Does not
        mutate."""
        try:
            unpack(tensors, self.reference)
        except ValueError as e:
            return f"does not hold the recurrent-state snapshots its section names ({e})"
        return None

    def arrived(
        self, space: Hashable, tokens: Sequence[int], chunk: int, block_size: int, tensors: dict[str, torch.Tensor]
    ) -> None:
        """Chunk ``chunk`` of ``tokens`` came back from the tier into the trie with the section ``tensors``: keep
        its snapshots (each at a position inside that chunk) again. One that fails its checks is left out, with a
        warning (the row resumes from an earlier one). Mutates."""
        try:
            found = unpack(tensors, self.reference, self.devices)
        except ValueError as e:
            warnings.warn(f"prefixkv: an offloaded block's recurrent-state snapshots are malformed ({e}); they "
                          "are dropped and recomputed", stacklevel=4)  # fmt: skip
            return
        for snapshot in found:
            if chunk * block_size < snapshot.position <= (chunk + 1) * block_size <= len(tokens):
                self._add(space, tokens, snapshot)
