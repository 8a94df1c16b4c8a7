"""Recurrent state at token positions: a :class:`Snapshot` of one row's conv and recurrent states after its first
``p`` tokens, the store's bounded set of them (:class:`Snapshots`), and the functions that take, restore and select
the states a cache's state layers hold for its rows (docs/how-it-works.md, "Layer kinds").

A recurrent layer (linear attention, Mamba, a short convolution) keeps no K/V per token, only a state per row that
the next forward resumes from; so a prefix is reused exactly only where a snapshot of every state layer was taken
at its end. A snapshot is keyed by the key space and the whole token path to its position, the keys a row's K/V are
published under (:mod:`prefixkv.hf.rows`): it is never used for another prefix, another namespace or another
adapter. It is usable while the store holds the K/V of that path (the trie's match reaches its position); a snapshot
whose path the trie no longer holds is dropped at the next :meth:`Snapshots.add`, and the oldest go first when the
snapshots' bytes pass their budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# one state of one layer: (layer index, state index, "conv" or "recurrent")
StateKey = tuple[int, int, str]


@dataclass(frozen=True)
class Snapshot:
    """One row's states after its first ``position`` tokens: per :data:`StateKey`, the row's tensor (no batch
    axis), and each conv state's kernel size."""

    position: int
    tensors: dict[StateKey, torch.Tensor]
    kernels: dict[tuple[int, int], int]

    @property
    def nbytes(self) -> int:
        """The bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Snapshots:
    """A store's snapshots, keyed by key space and token path, least recently used first, within ``max_bytes``
    (``None``: bounded only by the paths the store holds). Thread-safe: one lock of its own, never held while
    calling out."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[tuple[Hashable, tuple[int, ...]], Snapshot] = OrderedDict()
        self._positions: dict[Hashable, dict[int, int]] = {}  # per space: position -> how many snapshots there
        self._lock = threading.Lock()
        self.bytes_used = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._held)

    def find(self, space: Hashable, keys: Sequence[int], limit: int) -> Snapshot | None:
        """The deepest snapshot of ``space`` at a position ``1 <= p <= limit`` on the path ``keys``, or ``None``.
        Marks it used (LRU). Mutates the order only."""
        with self._lock:
            positions = sorted((p for p in self._positions.get(space, {}) if p <= min(limit, len(keys))), reverse=True)
            for p in positions:
                key = (space, tuple(keys[:p]))
                found = self._held.get(key)
                if found is not None:
                    self._held.move_to_end(key)
                    return found
        return None

    def add(self, space: Hashable, keys: Sequence[int], snapshot: Snapshot, held: Callable[[list[int]], int]) -> None:
        """Keep ``snapshot`` of the path ``keys[:snapshot.position]`` in ``space``; first drop every snapshot of
        ``space`` whose path the store no longer holds (``held(path)``: how many leading tokens of ``path`` the
        store's trie holds), then the least recently used ones beyond :attr:`max_bytes`. Mutates."""
        path = tuple(keys[: snapshot.position])
        with self._lock:
            stale = [k for k in self._held if k[0] == space]
        gone = [k for k in stale if held(list(k[1])) < len(k[1])]
        with self._lock:
            for k in gone:
                self._drop(k)
            key = (space, path)
            if key in self._held:
                self._drop(key)
            self._held[key] = snapshot
            counts = self._positions.setdefault(space, {})
            counts[snapshot.position] = counts.get(snapshot.position, 0) + 1
            self.bytes_used += snapshot.nbytes
            while self.max_bytes is not None and self.bytes_used > self.max_bytes and self._held:
                self._drop(next(iter(self._held)))

    def _drop(self, key: tuple[Hashable, tuple[int, ...]]) -> None:
        snapshot = self._held.pop(key)
        self.bytes_used -= snapshot.nbytes
        self.dropped += 1
        counts = self._positions[key[0]]
        counts[snapshot.position] -= 1
        if not counts[snapshot.position]:
            del counts[snapshot.position]

    def clear(self) -> None:
        """Drop every snapshot. Mutates."""
        with self._lock:
            self._held.clear()
            self._positions.clear()
            self.bytes_used = 0

    def check(self) -> None:
        """Raise ``AssertionError`` unless the byte count and the position index agree with the snapshots held.
        Does not mutate."""
        with self._lock:
            assert self.bytes_used == sum(s.nbytes for s in self._held.values()), "snapshot bytes miscounted"
            index: dict[Hashable, dict[int, int]] = {}
            for (space, path), s in self._held.items():
                assert len(path) == s.position, "a snapshot keyed by a path of another length"
                index.setdefault(space, {})
                index[space][s.position] = index[space].get(s.position, 0) + 1
            assert index == {k: v for k, v in self._positions.items() if v}, "snapshot positions miscounted"


# -- the states a cache's layers hold for its rows ------------------------------------------------------------------

# the state layers of a cache: (layer index, transformers' LinearAttentionLayer of prefixkv's, hf/layers.py)
StateLayers = Sequence[tuple[int, Any]]


def _each(layers: StateLayers) -> list[tuple[Any, int, int]]:
    return [(layer, i, idx) for i, layer in layers for idx in range(layer.number_of_states)]


@torch.no_grad()
def take(layers: StateLayers, row: int, position: int) -> Snapshot:
    """Row ``row``'s states in ``layers`` now, as the snapshot at ``position`` (copies). Does not mutate."""
    tensors: dict[StateKey, torch.Tensor] = {}
    kernels: dict[tuple[int, int], int] = {}
    with torch.inference_mode(False):
        for layer, i, idx in _each(layers):
            if layer.is_conv_states_initialized[idx]:
                tensors[(i, idx, "conv")] = layer.conv_states[idx][row].clone()
                kernels[(i, idx)] = int(layer.conv_kernel_size[idx])
            if layer.is_recurrent_states_initialized[idx]:
                tensors[(i, idx, "recurrent")] = layer.recurrent_states[idx][row].clone()
    return Snapshot(position, tensors, kernels)


@torch.no_grad()
def restore(layers: StateLayers, snapshots: Sequence[Snapshot]) -> None:
    """Make ``layers`` hold one row per snapshot, each resuming from it (``has_previous_state``: the next forward
    continues them). Mutates the layers."""
    with torch.inference_mode(False):
        for layer, i, idx in _each(layers):
            conv = [s.tensors.get((i, idx, "conv")) for s in snapshots]
            recurrent = [s.tensors.get((i, idx, "recurrent")) for s in snapshots]
            if all(t is not None for t in conv):
                layer.conv_states[idx] = torch.stack(conv)  # type: ignore[arg-type]
                layer.conv_kernel_size[idx] = snapshots[0].kernels[(i, idx)]
                layer.is_conv_states_initialized[idx] = True
                layer.device, layer.dtype = layer.conv_states[idx].device, layer.conv_states[idx].dtype
            if all(t is not None for t in recurrent):
                layer.recurrent_states[idx] = torch.stack(recurrent)  # type: ignore[arg-type]
                layer.is_recurrent_states_initialized[idx] = True
            layer.has_previous_state[idx] = layer.is_conv_states_initialized[idx] or bool(
                layer.is_recurrent_states_initialized[idx]
            )


@torch.no_grad()
def select(layers: StateLayers, indices: list[int]) -> None:
    """Row ``j`` of every state becomes old row ``indices[j]`` (beams, ``num_return_sequences``). Mutates."""
    for layer, _, idx in _each(layers):
        for held, ready in ((layer.conv_states, layer.is_conv_states_initialized),
                            (layer.recurrent_states, layer.is_recurrent_states_initialized)):  # fmt: skip
            if ready[idx]:
                t = held[idx]
                held[idx] = t.index_select(0, torch.tensor(indices, device=t.device))


@torch.no_grad()
def copy(source: StateLayers, target: StateLayers) -> None:
    """``target``'s layers hold copies of ``source``'s states (a forked cache). Mutates ``target``."""
    for (_, s_layer), (_, t_layer) in zip(source, target, strict=True):
        for idx in range(s_layer.number_of_states):
            for field in ("conv_states", "recurrent_states"):
                t = getattr(s_layer, field)[idx]
                getattr(t_layer, field)[idx] = None if t is None else t.clone()
            for field in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                          "conv_kernel_size"):  # fmt: skip
                getattr(t_layer, field)[idx] = getattr(s_layer, field)[idx]
        t_layer.device, t_layer.dtype = s_layer.device, s_layer.dtype


def clear(layers: StateLayers) -> None:
    """Forget every row's state: the next forward starts from none. Mutates."""
    for layer, _, idx in _each(layers):
        layer.conv_states[idx] = layer.recurrent_states[idx] = None
        layer.is_conv_states_initialized[idx] = layer.is_recurrent_states_initialized[idx] = False
        layer.has_previous_state[idx] = False
