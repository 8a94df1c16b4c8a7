"""Recurrent state at token positions: a :class:`Snapshot` of one row's conv and recurrent states after its first
``p`` tokens, the store's bounded set of them (:class:`Snapshots`), and the functions that take, restore and select
the states a cache's state layers hold for its rows (docs/how-it-works.md, "Layer kinds").

A recurrent layer (linear attention, Mamba, a short convolution) keeps no K/V per token, only a state per row that
the next forward resumes from; so a prefix is reused exactly only where a snapshot of every state layer was taken
at its end. A snapshot is keyed by the key space and the whole token path to its position, the keys a row's K/V are
published under (:mod:`prefixkv.hf.rows`): it is never used for another prefix, another namespace or another
adapter. It is usable while the store holds the K/V of that path: the trie tells the snapshots of every node it
evicts, in any key space (:meth:`Snapshots.evicted`), and the snapshots on that node's stretch of path go with it,
at a cost of that stretch, never of how many snapshots are held. Past their budget the least useful go first
(docs/memory.md, "Recurrent state"): those taken once and never used (grid positions, call ends), oldest first,
before the ones used or taken where prompts part (junctions), and the newest last.

A prefill that wants snapshots at several positions takes them from inside one forward where the model's code allows
(:func:`recording`): the conv states are the inputs the layer hands ``update_conv_state``, and a recurrent kernel
that takes an initial state and hands back the final one (the gated delta rule of Qwen3-Next and Qwen3.5) is run
segment by segment between the positions; elsewhere the prefill is split into a forward per position
(docs/memory.md, "Recurrent state").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kv.nodes import Node, path_tokens

# one state of one layer: (layer index, state index, "conv" or "recurrent")
StateKey = tuple[int, int, str]
# a snapshot's key: its key space and the token path to its position
Key = tuple[Hashable, tuple[int, ...]]

MIN_STEP = 64
"""The finest grid (tokens between grid snapshots) and the grid without a snapshot budget: a prompt that parts from
an earlier one recomputes at most this many tokens of their shared prefix (docs/memory.md, "Recurrent state")."""

_NEAR = MIN_STEP // 4  # tokens: a grid position closer than this to the next stop is not one
_REMEMBERED = 4096  # dropped snapshots remembered, to tell a miss "dropped" from "never taken"


def grid_positions(done: int, stops: list[int], step: int | None) -> list[int]:
    """Where a prefill that has ``done`` tokens takes snapshots: each of ``stops`` (ascending, past ``done``) and each
    multiple of the grid's ``step`` on the way (``None``: not known yet, :data:`MIN_STEP`; ``0``: none), except a grid
    position just before a stop, left to it (a later prompt that parts in between recomputes those few tokens, where
    a forward or a kernel segment of them would cost about a whole kernel chunk). Does not mutate."""
    unit = MIN_STEP if step is None else step
    positions = []
    for stop in stops:
        while unit:
            grid = (done // unit + 1) * unit
            if stop - grid < _NEAR:
                break
            positions.append(grid)
            done = grid
        positions.append(stop)
        done = stop
    return positions


@dataclass(frozen=True)
class Cuts:
    """Where a call's own forwards take snapshots (ascending ``positions``), and which of them are ``junctions``
    (kept longest)."""

    positions: tuple[int, ...]
    junctions: frozenset[int]


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
    """A store's snapshots, keyed by key space and token path, within ``max_bytes`` (``None``: bounded only by the
    paths the store holds). ``kv_bytes_per_token`` and ``pool_bytes`` (the pool's bound, ``None``: unbounded) size
    the grid (:meth:`step`); :attr:`grid` overrides it (``0``: no grid). Counts what it took, resumed and dropped
    (``taken``, ``used``, ``dropped_budget``, ``dropped_path``). Thread-safe: one lock of its own, never held while
    calling out."""

    def __init__(self, max_bytes: int | None, *, kv_bytes_per_token: float = 0, pool_bytes: int | None = None) -> None:
        self._max_bytes = max_bytes
        self.grid: int | None = None
        """Tokens between the snapshots a long prefill takes on its way (``None``: :meth:`step` derives it; ``0``:
        none)."""
        self.block_size = 1
        self.marks: frozenset[int] = frozenset()
        """Token ids that end a message (a chat template's turn markers): a prefill takes a snapshot after each one,
        kept as long as a junction's (docs/memory.md, "Recurrent state"). None by default."""
        self.kv_bytes_per_token = kv_bytes_per_token
        self.pool_bytes = pool_bytes
        self._held: dict[Key, Snapshot] = {}
        self._once: OrderedDict[Key, None] = OrderedDict()  # taken, never used: grid positions, call ends
        self._kept: OrderedDict[Key, None] = OrderedDict()  # used, or taken where prompts part
        self._positions: dict[Hashable, dict[int, int]] = {}  # per space: position -> how many snapshots there
        self._gone: OrderedDict[tuple[Hashable, int, int], str] = OrderedDict()  # (space, position, hash) -> why
        self._lock = threading.Lock()
        self._size = 0  # the bytes of the first snapshot taken (every one of a model is alike)
        self.bytes_used = 0
        self.taken = self.used = self.dropped_budget = self.dropped_path = 0
        self.kv_hit_tokens = 0  # prompt tokens looked up whose K/V the store held (StoreStats.kv_hit_tokens)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def max_bytes(self) -> int | None:
        """The bytes the snapshots may hold (``None``: no bound): a quarter of the store's ``max_memory``, or set by
        hand, which drops the least useful at once down to the new bound (docs/memory.md, "Recurrent state")."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | None) -> None:
        with self._lock:
            self._max_bytes = value
            self._trim(None)

    def count_kv_hits(self, tokens: int) -> None:
        """Count ``tokens`` looked-up prompt tokens whose K/V the store held (``StoreStats.kv_hit_tokens``). Mutates."""
        with self._lock:
            self.kv_hit_tokens += tokens

    @property
    def dropped(self) -> int:
        """Snapshots dropped, for the budget or with their path."""
        return self.dropped_budget + self.dropped_path

    def step(self) -> int | None:
        """Tokens between grid snapshots: :attr:`grid` if set; else :data:`MIN_STEP` without a budget; else the
        step at which the grid's snapshots of a full pool's tokens fit the budget (one snapshot's bytes over the K/V
        bytes of a token, times the pool's bytes over the snapshots' budget), at least :data:`MIN_STEP`, in whole
        blocks. ``None`` while that is unknown (no snapshot taken yet). Does not mutate."""
        if self.grid is not None:
            return self.grid
        if not self.max_bytes or not self.pool_bytes or not self.kv_bytes_per_token:
            return MIN_STEP
        if not self._size:
            return None
        tokens = self._size * self.pool_bytes / (self.kv_bytes_per_token * self.max_bytes)
        bs = self.block_size
        return max(MIN_STEP, math.ceil(tokens / bs) * bs)

    def find(self, space: Hashable, keys: Sequence[int], limit: int) -> Snapshot | None:
        """The deepest snapshot of ``space`` at a position ``1 <= p <= limit`` on the path ``keys``, or ``None``.
        Does not mutate (:meth:`use` marks one used)."""
        with self._lock:
            counts = self._positions.get(space, {})
            top = min(limit, len(keys))
            # the positions held or the path's, whichever are fewer, deepest first
            fewer = len(counts) > top
            positions = range(top, 0, -1) if fewer else sorted((p for p in counts if p <= top), reverse=True)
            for p in positions:
                if p in counts:
                    found = self._held.get((space, tuple(keys[:p])))
                    if found is not None:
                        return found
        return None

    def use(self, space: Hashable, keys: Sequence[int], snapshot: Snapshot) -> None:
        """Count a resume from ``snapshot`` (of the path ``keys`` in ``space``) and keep it among the useful ones,
        as used last. Mutates."""
        key = (space, tuple(keys[: snapshot.position]))
        with self._lock:
            if self._held.get(key) is snapshot:
                self.used += 1
                self._once.pop(key, None)
                self._kept[key] = None
                self._kept.move_to_end(key)

    def why_missing(self, space: Hashable, keys: Sequence[int], position: int) -> str | None:
        """Why no snapshot is held at ``position`` of the path ``keys``: ``"budget"`` or ``"path"`` when one was
        taken there and dropped (for the snapshots' budget, or with its path's K/V), ``None`` when none was taken
        (or it was dropped too long ago to be remembered). Does not mutate."""
        with self._lock:
            return self._gone.get((space, position, hash(tuple(keys[:position]))))

    def add(self, space: Hashable, keys: Sequence[int], snapshot: Snapshot, *, junction: bool = False) -> None:
        """Keep ``snapshot`` of the path ``keys[:snapshot.position]`` in ``space`` (whose K/V the store holds), among
        the useful ones where it is a ``junction`` (where prompts part); then, past :attr:`max_bytes`, drop the least
        useful others (:class:`Snapshots`). Mutates."""
        key = (space, tuple(keys[: snapshot.position]))
        with self._lock:
            if key in self._held:
                self._drop(key, None)
            self._held[key] = snapshot
            (self._kept if junction else self._once)[key] = None
            counts = self._positions.setdefault(space, {})
            counts[snapshot.position] = counts.get(snapshot.position, 0) + 1
            self.bytes_used += snapshot.nbytes
            self._size = self._size or snapshot.nbytes
            self.taken += 1
            self._gone.pop((space, snapshot.position, hash(key[1])), None)
            self._trim(key)

    def _trim(self, key: Key | None) -> None:
        """Drop the least useful snapshots until they fit :attr:`max_bytes`, ``key`` (the newest) last. Mutates."""
        limit = self._max_bytes
        while limit is not None and self.bytes_used > limit and len(self._held) > 1:
            # the newest is last in its segment: the oldest of the segment that holds another goes first
            order = self._once if len(self._once) > (key in self._once) else self._kept
            self._drop(next(iter(order)), "budget")
        if limit is not None and self.bytes_used > limit and self._held:
            self._drop(next(iter(self._held)), "budget")  # one snapshot larger than the whole budget

    def evicted(self, space: Hashable, node: Node) -> None:
        """The trie evicted ``node`` of ``space`` (its ``parent`` chain still spells its path): drop the snapshots on
        its stretch of path, whose K/V the store no longer holds (:meth:`leave`). Mutates."""
        self.leave(space, node)

    def leave(self, space: Hashable, node: Node) -> list[Snapshot]:
        """:meth:`evicted`, returning the snapshots dropped (a second tier keeps them with the node's blocks:
        :class:`prefixkv.hf.state_files.Carrier`). Costs the node's stretch of path, not the snapshots held.
        Mutates."""
        gone: list[Snapshot] = []
        with self._lock:
            counts = self._positions.get(space)
            if not counts:
                return gone
            lo, hi = node.start, node.end
            span = range(lo + 1, hi + 1)
            hits = [p for p in span if p in counts] if len(span) < len(counts) else [p for p in counts if lo < p <= hi]
            if not hits:
                return gone
            path = path_tokens(node)
            for p in hits:
                key = (space, tuple(path[:p]))
                if key in self._held:
                    gone.append(self._held[key])
                    self._drop(key, "path")
        return gone

    def along(self, space: Hashable, keys: Sequence[int], after: int = 0) -> list[Snapshot]:
        """The snapshots of ``space`` on the path ``keys`` at positions past ``after`` (up to ``len(keys)``),
        shallowest first. Costs that stretch or the positions held, whichever is less. Does not mutate."""
        with self._lock:
            counts = self._positions.get(space, {})
            span = range(after + 1, len(keys) + 1)
            positions = (
                [p for p in span if p in counts] if len(span) < len(counts) else sorted(p for p in counts if p in span)
            )
            found = (self._held.get((space, tuple(keys[:p]))) for p in positions)
            return [s for s in found if s is not None]

    def _drop(self, key: Key, why: str | None) -> None:
        snapshot = self._held.pop(key)
        self._once.pop(key, None)
        self._kept.pop(key, None)
        self.bytes_used -= snapshot.nbytes
        counts = self._positions[key[0]]
        counts[snapshot.position] -= 1
        if not counts[snapshot.position]:
            del counts[snapshot.position]
        if not counts:
            del self._positions[key[0]]
        if why is not None:
            if why == "budget":
                self.dropped_budget += 1
            else:
                self.dropped_path += 1
            self._gone[(key[0], snapshot.position, hash(key[1]))] = why
            while len(self._gone) > _REMEMBERED:
                self._gone.popitem(last=False)

    def clear(self) -> None:
        """Drop every snapshot (not counted as dropped) and what was remembered of dropped ones. Mutates."""
        with self._lock:
            self._held.clear()
            self._once.clear()
            self._kept.clear()
            self._positions.clear()
            self._gone.clear()
            self.bytes_used = 0

    def check(self, held: Callable[[Hashable, list[int]], int] | None = None) -> None:
        """Raise ``AssertionError`` unless the byte count, the position index and the retention order agree with the
        snapshots held, and (``held(space, path)``: how many leading tokens of ``path`` the store holds in ``space``)
        every snapshot's path is held. Does not mutate."""
        with self._lock:
            items = list(self._held.items())
            assert self.bytes_used == sum(s.nbytes for _, s in items), "snapshot bytes miscounted"
            index: dict[Hashable, dict[int, int]] = {}
            for (space, path), s in items:
                assert len(path) == s.position, "a snapshot keyed by a path of another length"
                index.setdefault(space, {})
                index[space][s.position] = index[space].get(s.position, 0) + 1
            assert index == self._positions, "snapshot positions miscounted"
            assert set(self._once) | set(self._kept) == set(self._held), "a snapshot outside the retention order"
            assert not set(self._once) & set(self._kept), "a snapshot in both retention segments"
            assert self.max_bytes is None or self.bytes_used <= self.max_bytes, "snapshots over their budget"
        if held is not None:
            for (space, path), _ in items:
                assert held(space, list(path)) >= len(path), f"a snapshot at {len(path)} outlives its path's K/V"


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


# -- states inside one forward --------------------------------------------------------------------------------------

# recurrent kernels that take ``initial_state`` and hand back the final state, by their name in a modeling module:
# run segment by segment, they hand the state at each boundary (:func:`_segmented`); each with the kernel of one
# token that the same code runs for a forward of one token after a state (what a forward split there would run)
_KERNELS = {"torch_chunk_gated_delta_rule": "torch_recurrent_gated_delta_rule"}
_inside = threading.local()  # the recording forward running in this thread: its cuts, what it captured


class Recorded:
    """What a recording forward captured: per :data:`StateKey`, the layer's state after each cut (batch axis kept),
    and each conv state's kernel size."""

    def __init__(self, cuts: list[int]) -> None:
        self.cuts = cuts
        self.tensors: dict[StateKey, list[torch.Tensor]] = {}
        self.kernels: dict[tuple[int, int], int] = {}
        self.pending: list[torch.Tensor] | None = None  # a segmented kernel's states, until the layer's update


@contextlib.contextmanager
def recording(cuts: list[int]) -> Iterator[Recorded]:
    """Inside: a forward of this thread (over more tokens than the last of ``cuts``, ascending, each ``>= 1``) also
    captures every state layer's states after each cut's count of its tokens (:func:`snapshot_at`)."""
    recorded = start_recording(cuts)
    try:
        yield recorded
    finally:
        stop_recording()


def start_recording(cuts: list[int]) -> Recorded:
    """:func:`recording` from here to :func:`stop_recording` (a forward's begin and end hooks), in this thread."""
    recorded = Recorded(cuts)
    _inside.recorded = recorded
    return recorded


def stop_recording() -> None:
    """End this thread's recording (:func:`start_recording`)."""
    _inside.recorded = None


def _recorded() -> Recorded | None:
    found = getattr(_inside, "recorded", None)
    return found if found is not None and found.cuts else None


@torch.no_grad()
def note_conv(layer: Any, index: int, conv_states: torch.Tensor, state_idx: int, kernel: int | None) -> None:
    """A state layer (``index``) is handed ``conv_states`` ``[B, C, q]`` (the conv's inputs of a forward's ``q``
    tokens): while :func:`recording`, capture its conv state after each cut, the last ``kernel`` inputs before it
    (zeros before the first token), as ``update_conv_state`` keeps them after the whole forward. Does not mutate the
    layer."""
    recorded = _recorded()
    if recorded is None or getattr(layer, "record_past", False):
        return
    if kernel is None and layer.is_conv_states_initialized[state_idx]:
        kernel = int(layer.conv_kernel_size[state_idx])
    if kernel is None:
        return  # a layer that sizes its conv state by what it is handed: no snapshot inside this forward
    if layer.has_previous_state[state_idx]:
        before = layer.conv_states[state_idx]
    else:
        before = conv_states.new_zeros((*conv_states.shape[:-1], kernel))
    with torch.inference_mode(False):
        # columns c to c + kernel of [before, conv_states] (the last `kernel` inputs before cut c), each copied
        # alone: never the whole forward's inputs
        held = before.shape[-1]
        recorded.tensors[(index, state_idx, "conv")] = [
            conv_states[..., c - held : c - held + kernel].clone()
            if c >= held
            else torch.cat([before[..., c : c + kernel], conv_states[..., : max(0, c + kernel - held)]], dim=-1)
            for c in recorded.cuts
        ]
    recorded.kernels[(index, state_idx)] = kernel


def note_recurrent(index: int, state_idx: int) -> None:
    """A state layer (``index``) is handed its recurrent state after a forward: while :func:`recording`, keep the
    states a segmented kernel handed at the cuts as this layer's. Does not mutate the layer."""
    recorded = _recorded()
    if recorded is None:
        return
    pending, recorded.pending = recorded.pending, None
    if pending is not None and len(pending) == len(recorded.cuts):
        recorded.tensors[(index, state_idx, "recurrent")] = pending


def snapshot_at(layers: StateLayers, recorded: Recorded, row: int, cut: int, position: int) -> Snapshot | None:
    """Row ``row``'s states after ``recorded.cuts[cut]`` tokens of the recording forward, as the snapshot at
    ``position``; ``None`` where a state the layers hold was not captured (a model whose recurrent kernel cannot be
    segmented). Does not mutate."""
    tensors: dict[StateKey, torch.Tensor] = {}
    kernels: dict[tuple[int, int], int] = {}
    for layer, i, idx in _each(layers):
        for kind, ready in (
            ("conv", layer.is_conv_states_initialized),
            ("recurrent", layer.is_recurrent_states_initialized),
        ):
            if ready[idx]:
                captured = recorded.tensors.get((i, idx, kind))
                if captured is None:
                    return None
                tensors[(i, idx, kind)] = captured[cut][row]
        if layer.is_conv_states_initialized[idx]:
            kernels[(i, idx)] = recorded.kernels[(i, idx)]
    return Snapshot(position, tensors, kernels)


def _segmented(kernel: Callable[..., Any], one: Callable[..., Any] | None) -> Callable[..., Any]:
    """``kernel`` (``(query, key, value, g=, beta=, initial_state=, output_final_state=)`` over ``[B, L, ...]``),
    run segment by segment between the cuts while :func:`recording`, each resuming the state the one before handed
    (the same calls a forward split at the cuts makes: a segment of one token after a state by ``one``, where the
    layer's code runs that, not a whole chunk of ``kernel``); the states at the cuts go to the layer's
    ``update_recurrent_state`` (:func:`note_recurrent`). Otherwise ``kernel`` itself."""

    @functools.wraps(kernel)
    def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorded = _recorded()
        if recorded is None or args or not {"g", "beta"} <= kwargs.keys() or recorded.cuts[-1] >= query.shape[1]:
            return kernel(query, key, value, *args, **kwargs)
        final = kwargs.pop("output_final_state", False)
        state = kwargs.pop("initial_state", None)
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        outputs, states = [], []
        for a, b in itertools.pairwise([0, *recorded.cuts, query.shape[1]]):
            run_segment = one if one is not None and b - a == 1 and state is not None else kernel
            out, state = run_segment(
                query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=state,
                output_final_state=True, **kwargs,
            )  # fmt: skip
            outputs.append(out)
            states.append(state)
        recorded.pending = states[:-1]
        return torch.cat(outputs, dim=1), state if final else None

    run.prefixkv_segmented = True  # type: ignore[attr-defined]
    return run


def records_inside(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` can hand its states at positions inside it (:func:`recording`): every layer
    class whose code hands its cache a recurrent state runs it with a kernel :func:`_segmented` wraps (wrapped here, in
    the globals its code reads, once; it runs as before outside a recording). Read from the names the classes' code
    uses, not their source; never where no layer's own code hands the cache a state (RecurrentGemma's blocks and
    MiniMax's lightning layers, whose states prefixkv bridges: :mod:`prefixkv.hf.stepwise`,
    :mod:`prefixkv.hf.linear_cache`). Read once per model (its layers' classes do not change under a store, which
    read its layer kinds once too). Mutates those globals."""
    known = _RECORDS_INSIDE.get(model)
    if known is None:
        known = _RECORDS_INSIDE[model] = _records_inside(frozenset(type(m) for m in model.modules()))
    return known


_RECORDS_INSIDE: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _names(code: Any) -> set[str]:
    """The global and attribute names ``code`` and the functions defined inside it use."""
    names = set(code.co_names)
    for inner in code.co_consts:
        if hasattr(inner, "co_names"):
            names |= _names(inner)
    return names


def _all(functions: list[tuple[dict[str, Any], set[str]]]) -> set[str]:
    return set().union(*(names for _, names in functions))


@functools.lru_cache(maxsize=64)
def _records_inside(classes: frozenset[type]) -> bool:
    handed = False  # a layer's own code hands its cache a state (a model whose states prefixkv bridges does not)
    for cls in classes:
        # each method itself, under the hooks a decorator wraps it in
        methods = [inspect.unwrap(f) for c in cls.__mro__ for f in vars(c).values() if callable(f)]
        functions = [(f.__globals__, _names(f.__code__)) for f in methods if hasattr(f, "__code__")]
        handed = handed or any("update_conv_state" in names for _, names in functions)
        if not any("update_recurrent_state" in names for _, names in functions):
            continue
        handed = True
        calls = [(scope, n) for scope, names in functions for n in _KERNELS if n in names]
        if not calls or not all(callable(scope.get(n)) for scope, n in calls):
            return False
        for scope, n in calls:
            if not getattr(scope[n], "prefixkv_segmented", False):
                one = scope.get(_KERNELS[n])
                scope[n] = _segmented(scope[n], one if callable(one) and _KERNELS[n] in _all(functions) else None)
    return handed
