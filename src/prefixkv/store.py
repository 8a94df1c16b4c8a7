"""``PrefixStore``: one per model. Ties the allocator, the trie and the pool together and owns the
budget, eviction, pins, statistics and the lock that lets several threads share one store.

Caches use it through a small contract (:meth:`PrefixStore.claim`, ``extend``, ``publish``, ``truncate``,
``fork``, ``release`` over :class:`Claim` objects, and a few queries): each method takes the lock itself, says
what it mutates and leaves refcounts exact if it raises. This module imports neither the cache nor the model
hooks; the layer above installs what runs the model (:func:`set_runner`)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import operator
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from tqdm.auto import tqdm

from . import attention, display, persist
from .allocator import BlockAllocator
from .errors import CacheMisuseError, CapacityError, PersistError
from .memory import attention_shape, format_bytes, parse_bytes
from .pool import BlockPool, LayerSpec, block_bytes, check_kv_dtype
from .stats import CacheStats, RowStats, StoreStats
from .support import check_supported
from .tier import BLOCK_FORMAT, OffloadTier, chunk_keys
from .trie import Insert, Match, Node, NodeView, RadixTrie

_INITIAL_BLOCKS = 16
# tokens of room kept free after each row of a batch's prefill, for the blocks its decode steps add
_RESERVE_TOKENS = 128
_DTYPE_NAMES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


class Claim:
    """What one sequence holds in a store: ``table[c]`` is the block of its chunk ``c`` (each entry one count
    in the block's refcount), ``node`` the trie node it keeps locked (``None``: none). Made and changed only by
    the store's methods (:meth:`PrefixStore.claim` and the ones after it), which keep refcounts equal to the
    holders: the trie's occurrences plus every live claim's table."""

    __slots__ = ("__weakref__", "node", "table")

    def __init__(self, table: list[int], node: Node | None) -> None:
        self.table = table
        self.node = node


class Claimed(NamedTuple):
    """Result of :meth:`PrefixStore.claim`: a claim per row, and how many of its tokens each reuses."""

    claims: list[Claim]
    reused: list[int]


class TableView(NamedTuple):
    """A claim's block table, and for each block whether something else holds it too."""

    blocks: tuple[int, ...]
    shared: tuple[bool, ...]


class Handle(Protocol):
    """What undoes one hook or patch."""

    def remove(self) -> None: ...


class ModelRunner(Protocol):
    """What runs a store's model: the layer above the cache (:mod:`prefixkv.patch`) installs one with
    :func:`set_runner` when prefixkv is imported, so this module never imports the cache or the hooks."""

    def attach(self, store: PrefixStore) -> list[Handle]:
        """Hook the store's model so that its forwards feed the store's caches; return what undoes it."""
        ...

    def prefill(
        self, store: PrefixStore, tokens: list[int], *, keep_partial: bool, count: bool
    ) -> AbstractContextManager[RowStats]:
        """Compute and publish the uncached rest of ``tokens`` with one forward; the published tokens stay
        locked until the context exits."""
        ...

    def prefill_shared(self, store: PrefixStore, rows: list[list[int]]) -> list[tuple[int, list[int]]]:
        """In-batch sharing: compute once each whole-block prefix that several ``rows`` share; return, per
        prefix computed, the tokens computed and the rows sharing it."""
        ...

    def prefill_chunks(self, store: PrefixStore, prefixes: list[list[int]]) -> AbstractContextManager[list[int]]:
        """An invariant store's canonical prefill: compute and publish the chunks of ``prefixes`` the store lacks,
        each with a forward of its own; yield how many tokens of each the store held before. What the prefixes
        hold stays locked until the context exits."""
        ...


_runner: ModelRunner | None = None


def set_runner(runner: ModelRunner) -> None:
    """Install what runs the model for every store (called once, by :mod:`prefixkv.patch` on import): the
    store needs the model run for :meth:`PrefixStore.pin`, :meth:`PrefixStore.warm` and in-batch sharing, and
    its model hooked at construction, but both live in the layer above the cache. Mutates module state."""
    global _runner
    _runner = runner


def _the_runner() -> ModelRunner:
    if _runner is None:
        # `from prefixkv.store import PrefixStore` loads no public name of the package (they load lazily, see
        # prefixkv/__init__.py): load them now, which installs the runner; by name, as this layer imports no layer above
        importlib.import_module("prefixkv._api")
    if _runner is None:
        raise RuntimeError("prefixkv.patch did not install the model runner: prefixkv is not installed whole")
    return _runner


def _execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where ``module`` computes: the execution device of the first accelerate hook on it or inside it
    (``dispatch_model`` hooks whole layers, ``cpu_offload``/``disk_offload`` each linear layer, leaving
    the weights on ``meta``), else the device of its first parameter not on ``meta``."""
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or [hook]:
            device = getattr(h, "execution_device", None)
            if device is not None:
                return _with_index(torch.device(device))
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return None


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` as the tensors computed there report it (``cuda:0``), so device checks compare equal."""
    if device.type != "cpu" and device.index is None and device.type != "meta":
        module = getattr(torch, device.type, None)
        current = getattr(module, "current_device", None)
        if current is not None:
            return torch.device(device.type, current())
    return device


def transformers_model(model: Any) -> Any:
    """The transformers model that computes: ``model`` itself, or the one inside a PEFT wrapper (whose
    ``generate`` calls that model's ``generate``, so hooks on the wrapper would never run)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def _tuner_layers(model: Any) -> list[Any]:
    """The PEFT adapter layers inside ``model`` (LoRA and the other tuners; ``[]`` without peft)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def adapter_space(tuners: Sequence[Any]) -> Hashable:
    """The namespace of the K/V a model computes now (DESIGN.md rule 9): ``None`` without adapters, else
    which adapters are active, whether they are disabled, and which are merged into the weights."""
    if not tuners:
        return None
    layer = tuners[0]
    return (
        tuple(layer.active_adapters),
        bool(layer.disable_adapters),
        tuple(getattr(layer, "merged_adapters", ())),
    )


# values of each parameter and buffer compared per call, at fixed evenly spaced places (docs/correctness.md)
_SAMPLED = 4


def _weights_state(model: Any) -> int:
    """A number that changes when any parameter or buffer of ``model`` is written in place (an optimizer step,
    ``load_state_dict``, a write through ``.data`` such as an EMA update) or replaced (``.data =``, a new
    ``Parameter``, ``load_state_dict(assign=True)``), or a config field that changes K/V is edited: a hash of
    every tensor's storage address and version counter (inference tensors have none: 0), of ``_SAMPLED`` of its
    values (``.data`` writes bump no version), and of :func:`prefixkv.persist.config_state`."""
    state = []
    samples: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        version = 0
        with contextlib.suppress(RuntimeError):
            version = t._version
        state.append((t.data_ptr(), version))
        if t.device.type != "meta" and t.numel():
            samples.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():  # one copy per dtype and device, whatever the number of tensors
        values = tuple(
            torch.cat([_few_values(t) for t in group]).cpu().view(torch.uint8).numpy().tobytes()
            for group in samples.values()
        )
    return hash((tuple(state), values, persist.config_state(model.config)))


def _few_values(t: torch.Tensor) -> torch.Tensor:
    """``_SAMPLED`` values of ``t`` at evenly spaced places (all of a smaller one), as a view when it is
    contiguous. Does not mutate."""
    if not t.is_contiguous():
        t = t.reshape(-1)
    n = t.numel()
    return t.as_strided((min(n, _SAMPLED),), (max(1, n // _SAMPLED),), t.storage_offset())


@dataclass(frozen=True)
class WeightsChanged:
    """The namespace of K/V computed after the weights changed since the store was built: ``adapters`` as
    :func:`adapter_space`, and ``state`` as :func:`_weights_state`. Only this process can tell such weights
    apart, so the second tier keeps none of their blocks (its files outlive the process)."""

    adapters: Hashable
    state: int


def _check_chunk_size(invariant: Any, chunk_size: Any, block_size: int) -> int | None:
    """The chunk length of an invariant store (``None`` for the default schedule), after checking the options."""
    if not isinstance(invariant, bool):
        raise TypeError(f"invariant must be True or False, got {invariant!r}")
    if not invariant:
        if chunk_size is not None:
            raise ValueError(f"chunk_size={chunk_size!r} sets the invariant schedule; pass invariant=True with it")
        return None
    if chunk_size is None:
        return 4 * block_size
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size must be a positive multiple of block_size={block_size}, got {chunk_size!r}; "
            f"for example {4 * block_size}"
        )
    return chunk_size


def _check_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a floating torch dtype (names such as ``"bfloat16"`` too), or ``None``."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        named = _DTYPE_NAMES.get(dtype.removeprefix("torch."))
        if named is None:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPE_NAMES)}")
        return named
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch dtype (torch.float16, torch.bfloat16, torch.float32, torch.float64) "
            f"or its name, got {dtype!r}; quantized blocks are not supported yet"
        )
    return dtype


def _layer_devices(model: Any, num_layers: int) -> list[torch.device]:
    """The device each decoder layer computes on (accelerate's execution device when dispatched)."""
    fallback = _execution_device(model) or torch.device("cpu")
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return [_execution_device(layer) or fallback for layer in module]
    return [fallback] * num_layers


class PrefixStore:
    """The long-lived half of prefixkv: the block pool of every attention layer, the radix trie of
    cached prefixes, eviction and statistics. One per model.

    ``max_memory`` (bytes or a string such as ``"2GiB"``) or ``num_blocks`` bounds the pool; without
    either it grows as requests need. ``dtype`` defaults to the model's.

    ``kv_dtype="int8"`` (or ``"fp8"``) stores K/V in 8 bits with a scale per token and KV head, read
    back in ``dtype``: about half the memory of bf16 and a quarter of fp32 per token, at a small, measured
    cost in fidelity (``docs/memory.md``). ``offload="cpu"`` or ``"disk"`` (with ``offload_dir``) moves
    blocks evicted from the pool to host memory or files, within ``max_offload_memory``, and brings them
    back when a later prompt starts with them.

    ``invariant=True`` makes every call's logits bit-identical whatever the store holds (docs/correctness.md,
    "Outputs that never depend on the cache"): prompt K/V are computed in chunks of ``chunk_size`` tokens (a
    multiple of ``block_size``; ``4 * block_size`` by default) at fixed positions, one row at a time, and only
    those chunks are cached and reused.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> ids = torch.arange(1, 12).unsqueeze(0)
    >>> with prefixkv.PagedPrefixCache(store, ids) as cache:
    ...     _ = model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    >>> prefixkv.PagedPrefixCache(store, ids).stats.cached_tokens  # all but the last prompt token
    10
    """

    def __init__(
        self,
        model: Any,
        *,
        block_size: int = 16,
        max_memory: int | str | None = None,
        num_blocks: int | None = None,
        dtype: torch.dtype | str | None = None,
        kv_dtype: str | None = None,
        offload: str | None = None,
        max_offload_memory: int | str | None = None,
        offload_dir: str | os.PathLike[str] | None = None,
        invariant: bool = False,
        chunk_size: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        # the canonical prefill schedule's chunk length; None: the default schedule (reuse at any block)
        self.chunk_size = _check_chunk_size(invariant, chunk_size, block_size)
        if max_memory is not None and num_blocks is not None:
            raise ValueError("give the budget as max_memory or as num_blocks, not both")
        store_dtype = _check_dtype(dtype)
        check_kv_dtype(kv_dtype)
        if offload is None and (max_offload_memory is not None or offload_dir is not None):
            raise ValueError("max_offload_memory and offload_dir need offload='cpu' or offload='disk'")
        check_supported(model)
        self.model = model
        self.block_size = block_size
        shape = attention_shape(model.config)
        self.model_dtype: torch.dtype = getattr(model, "dtype", torch.float32)
        self.dtype = store_dtype or self.model_dtype
        devices = _layer_devices(model, shape.num_layers)
        specs = [LayerSpec(shape.kv_heads, shape.head_dim, d, self.dtype) for d in devices]
        self.kv_dtype = kv_dtype
        self.bytes_per_block = block_bytes(specs, block_size, kv_dtype)
        self.max_blocks = self._budget(max_memory, num_blocks)
        first = _INITIAL_BLOCKS if self.max_blocks is None else min(_INITIAL_BLOCKS, self.max_blocks)
        self._allocator = BlockAllocator(first + 1)
        self.pool = BlockPool(specs, block_size, first + 1, kv_dtype)
        self.tier: OffloadTier | None = None
        if offload is not None:
            limit = None if max_offload_memory is None else parse_bytes(max_offload_memory)
            # the adapters are left out: a tier's keys carry the namespace (active adapters) already, so one
            # directory serves a model under each of its adapters
            model_print = persist.fingerprint(model, adapters=False)
            meta = self._meta(model_print, BLOCK_FORMAT) if offload == "disk" else {}
            self.tier = OffloadTier(offload, max_bytes=limit, directory=offload_dir, meta=meta)
        self._trie = RadixTrie(block_size)
        self._lock = threading.RLock()
        self._claims: weakref.WeakSet[Claim] = weakref.WeakSet()
        self._pins: dict[tuple[Hashable, tuple[int, ...]], list[Node]] = {}
        self._queries = self._misses = self._prompt_tokens = self._hit_tokens = self._evictions = 0
        self._closed = False
        self._tuners = _tuner_layers(model)
        self._weights_at_start = _weights_state(model)
        # the transformers model that computes (inside a PEFT wrapper, its base model): what is hooked and run
        self.hf_model = transformers_model(model)
        self.runner = _the_runner()
        attention.install(self.hf_model)
        self._hooks = self.runner.attach(self)

    def _budget(self, max_memory: int | str | None, num_blocks: int | None) -> int | None:
        if num_blocks is not None:
            if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
                raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
            return num_blocks
        if max_memory is None:
            return None
        budget = parse_bytes(max_memory)
        # the pool's tensors stay within max_memory: the null block (padding) is paid from it too
        blocks = budget // self.bytes_per_block - 1
        if blocks < 1:
            raise ValueError(
                f"max_memory={max_memory!r} ({budget} bytes) is less than one block of {self.block_size} tokens "
                f"({self.bytes_per_block} bytes) plus the reserved padding block; raise max_memory or lower block_size"
            )
        return blocks

    @property
    def invariant(self) -> bool:
        """Whether the store computes prompt K/V in the canonical schedule (``PrefixStore(invariant=True)``)."""
        return self.chunk_size is not None

    def _meta(self, model_print: str, format: str = persist.FORMAT) -> dict[str, str]:
        """The metadata of a file of this store's K/V (:func:`prefixkv.persist.store_meta`) and, for an invariant
        store, its chunk length: K/V computed in another schedule are other K/V (docs/correctness.md, "Files and
        tiers carry the schedule")."""
        meta = persist.store_meta(self, model_print, format)
        if self.chunk_size is not None:
            meta["chunk_size"] = str(self.chunk_size)
        return meta

    def _check_schedule(self, file: persist.PrefixFile, path: str | os.PathLike[str]) -> None:
        """Refuse a file whose K/V were computed in another prefill schedule. Does not mutate."""
        theirs = file.meta.get("chunk_size")
        if theirs != (None if self.chunk_size is None else str(self.chunk_size)):
            kept = "the default schedule" if theirs is None else f"the invariant schedule (chunk_size={theirs})"
            ours = "the default schedule" if self.chunk_size is None else f"chunk_size={self.chunk_size}"
            raise PersistError(
                f"{path} holds K/V computed in {kept}, this store uses {ours}: they are other K/V, whose reuse "
                "would change outputs. Load it into a store with the file's schedule, or compute the prefixes again"
            )

    # -- public API ------------------------------------------------------------------------------

    def space(self) -> Hashable:
        """The namespace that K/V computed now are cached under: ``None``, or for a PEFT model the active,
        disabled and merged adapters, so that a prefix cached with one adapter is never reused with another
        (or with the adapter disabled); and, once a weight or buffer was written or replaced since the store was
        built (a training step, ``load_state_dict``), :class:`WeightsChanged`, so that K/V of the old weights are
        never reused (they wait for eviction or :meth:`clear`). Walks the model's tensors (once per call, not per
        decode step). Does not mutate."""
        if not self._tuners and hasattr(self.model, "peft_config"):
            self._tuners = _tuner_layers(self.model)  # adapters added after the store was built
        adapters = adapter_space(self._tuners)
        state = _weights_state(self.model)
        return adapters if state == self._weights_at_start else WeightsChanged(adapters, state)

    @property
    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters. Does not mutate."""
        with self._lock:
            evictable, pinned = self._unlocked_and_pinned_blocks()
            used = self._allocator.num_used
            cap = self.max_blocks if self.max_blocks is not None else self._allocator.capacity - 1
            nodes = self._trie.nodes()
            return StoreStats(
                queries=self._queries,
                misses=self._misses,
                prompt_tokens=self._prompt_tokens,
                hit_tokens=self._hit_tokens,
                hit_rate=self._hit_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
                blocks_used=used,
                blocks_free=cap - used,
                blocks_evictable=evictable,
                blocks_pinned=pinned,
                bytes_used=used * self.bytes_per_block,
                evictions=self._evictions,
                cached_tokens=sum(len(n.tokens) for n in nodes),
                nodes=len(nodes),
                offload=None if self.tier is None else self.tier.stats,
            )

    def _unlocked_and_pinned_blocks(self) -> tuple[int, int]:
        """Blocks that evicting every unlocked node would free, and blocks under a pin."""
        unlocked: Counter[int] = Counter()
        for node in self._trie.nodes():
            if node.lock == 0:
                unlocked.update(node.blocks)
        rc = self._allocator.refcount
        evictable = sum(1 for b, n in unlocked.items() if rc(b) == n)
        return evictable, len(self._pinned_blocks())

    def _pinned_blocks(self, extra: Node | None = None) -> set[int]:
        """The blocks on the paths of every pin (and of ``extra``). Does not mutate."""
        pinned: set[int] = set()
        ends = [n for nodes in self._pins.values() for n in nodes]
        for node in [*ends, extra] if extra is not None else ends:
            n: Node | None = node
            while n is not None:
                pinned.update(n.blocks)
                n = n.parent
        return pinned

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any refcount disagrees with its holders (trie nodes and live
        cache rows), or the trie is malformed. Does not mutate."""
        with self._lock:
            self._allocator.check_invariants()
            holders = self._trie.check_invariants()
            for claim in list(self._claims):
                holders.update(claim.table)
            for b in range(1, self._allocator.capacity):
                if self._allocator.refcount(b) != holders.get(b, 0):
                    raise AssertionError(
                        f"block {b}: refcount {self._allocator.refcount(b)}, holders {holders.get(b, 0)}"
                    )
            if set(holders) - set(range(1, self._allocator.capacity)):
                raise AssertionError(f"holders name blocks outside the pool: {set(holders)}")
            if self.pool.capacity != self._allocator.capacity:
                raise AssertionError(f"pool has {self.pool.capacity} blocks, allocator {self._allocator.capacity}")
            if self.tier is not None:
                self.tier.check_invariants()

    def pin(self, ids: Sequence[int] | torch.Tensor) -> int:
        """Keep the prefix ``ids`` (a system prompt) cached until :meth:`unpin`. Mutates.

        The part of ``ids`` not cached yet is computed first with the store's model (one forward; all
        of ``ids`` is kept, a last part-filled block included). Pinned blocks count against the budget:
        a pin that would take more blocks than the budget raises :class:`CapacityError` and pins
        nothing. Pins nest: each ``pin`` needs its own ``unpin``. Returns how many tokens it keeps: ``len(ids)``,
        or in an invariant store its whole chunks (the part a later call reuses; fewer than ``chunk_size`` ids
        raise ``ValueError``).

        >>> import prefixkv, torch
        >>> model = prefixkv.models.tiny_model("llama")
        >>> store = prefixkv.PrefixStore(model, block_size=4, num_blocks=8)
        >>> store.pin(torch.arange(3, 13))
        10
        >>> store.stats.blocks_pinned
        3
        """
        ids_list = _as_token_list(ids)
        if not ids_list:
            raise ValueError("pin() needs at least one token id")
        tokens = self._kept(ids_list)
        if not tokens:
            raise ValueError(
                f"an invariant store caches whole chunks of chunk_size={self.chunk_size} tokens; these "
                f"{len(ids_list)} ids hold none, so pinning them keeps nothing. Pin a longer prefix, or build the "
                "store with a smaller chunk_size"
            )
        space = self.space()
        with self._lock:
            self._check_pin_budget(tokens, space)
            end = self._trie.end_node(tokens, space)
            if end is not None:
                self._add_pin(ids_list, end, space)
                return len(tokens)
        # the prefill keeps the published tokens locked until the pin holds them
        with self.runner.prefill(self, tokens, keep_partial=True, count=True), self._lock:
            end = self._trie.end_node(tokens, space)
            if end is None:
                raise RuntimeError("prefixkv: the pin's prefill did not publish its tokens (the model changed?)")
            self._add_pin(ids_list, end, space)
        return len(tokens)

    def _kept(self, tokens: list[int]) -> list[int]:
        """The part of ``tokens`` that :meth:`pin` and :meth:`warm` cache: all of them, or in the invariant
        schedule their whole chunks (the only K/V a later call reuses there). Does not mutate."""
        if self.chunk_size is None:
            return tokens
        return tokens[: len(tokens) // self.chunk_size * self.chunk_size]

    def _check_pin_budget(self, tokens: list[int], space: Hashable) -> None:
        """Raise :class:`CapacityError` if pinning ``tokens`` surely exceeds the budget. Does not mutate."""
        if self.max_blocks is None:
            return
        bs = self.block_size
        m = self._trie.match(tokens, space)
        full = m.length // bs  # chunks cached whole; the rest needs blocks of its own
        pinned = self._pinned_blocks()
        total = len(pinned | set(m.blocks[:full])) + -(-len(tokens) // bs) - full
        if total > self.max_blocks:
            raise self._pin_error(len(tokens), total - len(pinned), len(pinned))

    def _add_pin(self, tokens: list[int], end: Insert, space: Hashable) -> None:
        """Lock ``end.node`` for a pin of ``tokens``, within the budget. Mutates."""
        self._allocator.incref(end.added)  # a split made the straddled block occur twice
        pinned = self._pinned_blocks()
        total = len(self._pinned_blocks(end.node))
        if self.max_blocks is not None and total > self.max_blocks:
            raise self._pin_error(len(tokens), total - len(pinned), len(pinned))
        self._trie.lock(end.node)
        self._pins.setdefault((space, tuple(tokens)), []).append(end.node)

    def _pin_error(self, n: int, blocks: int, pinned: int) -> CapacityError:
        return CapacityError(
            f"prefixkv: pinning {n} tokens takes {blocks} more blocks of {self.block_size} tokens; with the "
            f"{pinned} blocks already pinned that is {blocks + pinned}, over the budget of {self.max_blocks} "
            "blocks. Unpin other prefixes, pin a shorter prefix, or raise max_memory/num_blocks."
        )

    def unpin(self, ids: Sequence[int] | torch.Tensor) -> None:
        """Undo one :meth:`pin` of the same ids. Mutates; raises ``ValueError`` if they are not pinned."""
        tokens = _as_token_list(ids)
        key = (self.space(), tuple(tokens))
        with self._lock:
            nodes = self._pins.get(key)
            if not nodes:
                raise ValueError(
                    f"these {len(tokens)} ids are not pinned ({len(self._pins)} prefixes are); "
                    "pass the same ids that were given to pin()"
                )
            self._trie.unlock(nodes.pop())
            if not nodes:
                del self._pins[key]

    def clear(self) -> int:
        """Drop every cached prefix that is neither pinned nor read by a live cache. Mutates.

        Returns the number of blocks freed.
        """
        with self._lock:
            return self._allocator.decref(self._trie.clear())

    def warm(self, prompts: Iterable[Sequence[int] | torch.Tensor], *, progress: bool = True) -> CacheStats:
        """Compute the KV of each prompt now and cache it, so that later calls starting with one of
        them skip its prefill. Mutates (fills and may evict blocks).

        ``prompts`` holds token id sequences (lists, 1-D tensors, or the rows of a 2-D tensor). Each
        costs one forward pass over its part not cached yet (in an invariant store, one per chunk), with a
        ``tqdm.auto`` progress bar unless ``progress=False``. Only whole blocks are cached: the last
        ``len(prompt) % block_size`` tokens of a prompt are not (in an invariant store, only whole chunks are
        computed and cached). Warm-up lookups count in :attr:`stats` like any other. Returns the
        prompt tokens reused and computed, per prompt (``per_row``) and in total.

        >>> import prefixkv, torch
        >>> store = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
        >>> store.warm([torch.arange(1, 20)], progress=False).computed_tokens
        19
        >>> prefixkv.PagedPrefixCache(store, torch.arange(1, 30)[None]).stats.cached_tokens
        16
        """
        rows = []
        with tqdm(list(prompts), desc="prefixkv warm", unit="prompt", disable=not progress) as bar:
            for prompt in bar:
                with self.runner.prefill(self, _as_token_list(prompt), keep_partial=False, count=True) as row:
                    rows.append(row)
                reused = sum(r.cached_tokens for r in rows)
                bar.set_postfix(reused=reused, computed=sum(r.computed_tokens for r in rows))
        return CacheStats(
            sum(r.prompt_tokens for r in rows),
            sum(r.cached_tokens for r in rows),
            sum(r.computed_tokens for r in rows),
            tuple(rows),
        )

    def save(
        self, path: str | os.PathLike[str], prefixes: Iterable[Sequence[int] | torch.Tensor] | None = None
    ) -> persist.PersistStats:
        """Write the cached prefixes (all, or the cached part of each of ``prefixes``) to a safetensors
        file at ``path``, with the model's fingerprint so it loads only for this model. Does not mutate.
        See ``docs/persistence.md``.

        >>> import prefixkv, torch, tempfile, os
        >>> model = prefixkv.models.tiny_model("llama")
        >>> store = prefixkv.PrefixStore(model, block_size=4)
        >>> ids = torch.arange(3, 20)[None]
        >>> with prefixkv.PagedPrefixCache(store, ids) as cache:
        ...     _ = model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
        >>> path = os.path.join(tempfile.mkdtemp(), "prefixes.safetensors")
        >>> store.save(path).tokens
        16
        >>> prefixkv.PrefixStore.load(path, model).stats.cached_tokens
        16
        """
        wanted = None if prefixes is None else [_as_token_list(p) for p in prefixes]
        now = getattr(self.model, "dtype", self.model_dtype)
        if now != self.model_dtype:
            raise PersistError(
                f"the model now computes in {now} but the store's K/V were computed in "
                f"{self.model_dtype}: the model was cast after the PrefixStore was built; cast it back to save"
            )
        model_print = persist.fingerprint(self.model)
        space = self.space()
        with self._lock:
            nodes = persist.select_nodes(self._trie, wanted, space)
            tensors, blocks = persist.trie_tensors(nodes, self.block_size)
            tensors.update(self.pool.read_blocks(blocks))
        return persist.write(path, tensors, self._meta(model_print), nodes, blocks)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Any, **kwargs: Any) -> PrefixStore:
        """A new store for ``model`` holding the prefixes saved at ``path`` (``kwargs`` as for
        ``PrefixStore``; block size and dtype default to the file's). Raises :class:`PersistError` for a
        truncated, corrupted or newer file, or one saved from another model, dtype or shape."""
        file = persist.read(path)
        kwargs.setdefault("block_size", file.block_size)
        kwargs["dtype"] = kwargs.get("dtype") or file.dtype
        kwargs.setdefault("kv_dtype", file.kv_dtype)
        if "chunk_size" in file.meta and "invariant" not in kwargs:
            kwargs.setdefault("invariant", True)
            kwargs.setdefault("chunk_size", int(file.meta["chunk_size"]))
        model_dtype = getattr(model, "dtype", torch.float32)
        persist.check_compatible(
            file, path, model, kwargs["block_size"], kwargs["dtype"], model_dtype, kwargs["kv_dtype"]
        )
        store = cls(model, **kwargs)
        try:
            store._check_schedule(file, path)
            store._add_file(file)
        except BaseException:
            store.close()
            raise
        return store

    @staticmethod
    def convert(
        path: str | os.PathLike[str], new_path: str | os.PathLike[str], kv_dtype: str | None
    ) -> persist.PersistStats:
        """Write the prefixes saved at ``path`` to ``new_path`` with K/V kept as ``kv_dtype`` (``"int8"``,
        ``"fp8"`` or ``None``): the explicit step between quantized and unquantized stores, which refuse
        each other's files. See :func:`prefixkv.persist.convert`."""
        return persist.convert(path, new_path, kv_dtype)

    def merge(self, path: str | os.PathLike[str]) -> persist.PersistStats:
        """Add the prefixes saved at ``path`` to this store, within its budget (evicting least recently
        used prefixes for room). Mutates only after the file is verified and known to fit; raises
        :class:`PersistError` or :class:`CapacityError` otherwise, leaving the store unchanged."""
        file = persist.read(path)
        persist.check_compatible(file, path, self.model, self.block_size, self.dtype, self.model_dtype, self.kv_dtype)
        self._check_schedule(file, path)
        return self._add_file(file)

    def _add_file(self, file: persist.PrefixFile) -> persist.PersistStats:
        """Insert the file's paths; copy in only the blocks of positions the store lacks. Mutates, or raises
        :class:`CapacityError` before any change when the budget cannot make room."""
        bs = self.block_size
        space = self.space()
        with self._lock:
            trie, alloc = self._trie, self._allocator
            plans, anchors = persist.plan(trie, file.paths, space)
            needed = list(dict.fromkeys(p.table[c] for p in plans for c in range(p.present // bs, len(p.table))))
            for node in anchors:
                trie.lock(node)  # what the plan counts on must survive the evictions that make room
            try:
                room = self._room()
                if room is not None and len(needed) > room:
                    raise CapacityError(
                        f"prefixkv: the file needs {len(needed)} new KV blocks "
                        f"({format_bytes(len(needed) * self.bytes_per_block)}) but the store can make room for "
                        f"only {room} (budget {self.max_blocks} blocks, {alloc.num_used} in use). Raise "
                        "max_memory/num_blocks, close() live caches, unpin or clear() prefixes, or save fewer prefixes"
                    )
                self._ensure_free(len(needed))
                fresh = alloc.allocate(len(needed))
                try:
                    self.pool.write_blocks(fresh, persist.blocks_of(file, needed))
                    slot = dict(zip(needed, fresh))
                    for plan in plans:
                        live = trie.match(plan.tokens, space)
                        assert live.length == plan.present, "the merge plan went stale under the store lock"
                        cut = live.length // bs
                        self._insert(plan.tokens, live.blocks[:cut] + [slot[b] for b in plan.table[cut:]], space)
                finally:
                    alloc.decref(fresh)  # the merge's own hold: the trie holds what it inserted, nothing the rest
            finally:
                for node in anchors:
                    trie.unlock(node)
        return persist.PersistStats(
            prefixes=len(plans),
            tokens=sum(len(p.tokens) - p.present for p in plans),
            blocks=len(needed),
        )

    def _room(self) -> int | None:
        """Blocks the store could make free: free ones, growth left in the budget, and evictable ones
        (``None``: no budget, the pool grows as needed). Does not mutate."""
        alloc = self._allocator
        if self.max_blocks is None:
            return None
        evictable, _ = self._unlocked_and_pinned_blocks()
        return alloc.num_free + (self.max_blocks + 1 - alloc.capacity) + evictable

    def close(self) -> None:
        """Detach from the model: remove the hooks and restore its attention implementation. Mutates."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        attention.uninstall(self.hf_model)

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats
        budget = "unbounded" if self.max_blocks is None else f"{self.max_blocks} blocks"
        return (
            f"PrefixStore(block_size={self.block_size}, {budget}, used={s.blocks_used}, "
            f"cached_tokens={s.cached_tokens}, hit_rate={s.hit_rate:.2f}, {format_bytes(s.bytes_used)})"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: block usage as a bar, hit rate, memory, the most shared prefixes."""
        return display.store_html(self)

    def show(self, tokenizer: Any = None, *, top: int = 5) -> display.StoreView:
        """The store as a notebook shows it, with the ``top`` most shared cached prefixes as text when a
        tokenizer is given (each token's id on hover); printed, the trie as text. Does not mutate.

        >>> import prefixkv
        >>> tok = prefixkv.models.tiny_tokenizer()
        >>> store = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
        >>> _ = store.warm([tok("ba bebo, be kiko.").input_ids], progress=False)
        >>> print(store.show(tok))
        root
        └── 8 tokens [0, 8)  blocks 1-2  evictable  "ba bebo, be kiko."
        """
        return display.StoreView(self, tokenizer, top)

    # -- the contract with PagedPrefixCache: each method takes the store lock itself -------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` detached the store from its model. Does not mutate."""
        return self._closed

    @property
    def is_compileable(self) -> bool:
        """``generate`` asks a cache this first; a store is not a cache, so say what to pass instead."""
        raise CacheMisuseError(
            "a PrefixStore was passed where generate takes a cache; pass one PagedPrefixCache per call: "
            "cache=prefixkv.PagedPrefixCache(store, ids) (past_key_values= before transformers 5.24)"
        )

    @property
    def blocks(self) -> PrefixStore:
        # merge seam: replaced by the BlockManager of blocks.py
        return self

    def ensure_open(self) -> None:
        """Raise ``RuntimeError`` if the store is closed (a new cache cannot use it). Does not mutate."""
        if self._closed:
            raise RuntimeError("this PrefixStore is closed; build a new one for the model")

    def cached_length(self, tokens: Sequence[int], space: Hashable = None) -> int:
        """How many leading ``tokens`` namespace ``space`` holds. Does not mutate."""
        with self._lock:
            return self._trie.match(tokens, space).length

    def claim(self, rows: list[list[int]], space: Hashable, choose: Callable[[list[int]], list[int]]) -> Claimed:
        """Reuse for each of ``rows`` a prefix of what namespace ``space`` holds, in one critical section (another
        thread cannot evict a match before its blocks are taken). ``choose`` gets the matched length of each row
        and returns how many tokens each reuses (at most its match; the cache's rules, such as one offset per
        batch, live there); it runs under the store lock and must not call the store.

        Each row's claim shares the whole blocks it reuses, holds a copy of a part-block it reuses (copy-on-write:
        the row will write after it) and keeps the matched node locked. Mutates LRU times, refcounts, locks (and
        the trie and pool when blocks come back from the second tier); if it raises, every refcount and lock is
        as before. Callers release the claims (:meth:`release`)."""
        bs = self.block_size
        with self._lock:
            matches = self._lookup(rows, space)
            reused = choose([m.length for m in matches])
            claims = [Claim([], None) for _ in rows]
            try:
                for claim, m, r in zip(claims, matches, reused):
                    if r:  # every match locked before any copy makes room: that must not evict another row's
                        self._trie.lock(m.node)
                        claim.node = m.node
                for claim, m, r in zip(claims, matches, reused):
                    shared = m.blocks[: r // bs]
                    self._allocator.incref(shared)
                    claim.table = shared
                    if r % bs:
                        shared.append(self._copy_prefix(m.blocks[r // bs], r % bs))
                for claim, r in zip(claims, reused):
                    if r % bs:
                        self._lock_whole_blocks(claim, r // bs * bs)
            except BaseException:
                self._drop(claims)
                raise
            self._claims.update(claims)
            return Claimed(claims, reused)

    def _lock_whole_blocks(self, claim: Claim, boundary: int) -> None:
        """Move the claim's lock up to the deepest node on its path that ends by ``boundary``, the end of the whole
        blocks it shares: the claim holds its own copy of the part-block after them, so the trie's (and what
        follows) stays evictable, and a repeated request needs no more blocks than the cold one (docs/memory.md).
        The shared blocks stay the claim's (its refcounts); an unlocked node evicted meanwhile is published again
        from the locked one. Mutates locks."""
        node = claim.node
        while node is not None and node.parent is not None and node.end > boundary:
            node = node.parent
        self._move_claim_lock(claim, node if node is not None and node.parent is not None else None)

    def _move_claim_lock(self, claim: Claim, node: Node | None) -> None:
        """Lock ``node`` (``None``: nothing) for the claim instead of what it locked. Mutates locks."""
        if node is None:
            if claim.node is not None:
                self._trie.unlock(claim.node)
        else:
            self._trie.move_lock(claim.node, node)
        claim.node = node

    def empty_claims(self, n: int) -> list[Claim]:
        """``n`` claims that hold nothing yet (rows a cache starts from scratch). Mutates (registers them)."""
        claims = [Claim([], None) for _ in range(n)]
        with self._lock:
            self._claims.update(claims)
        return claims

    def extend(self, claims: Sequence[Claim], spans: Sequence[tuple[int, int]]) -> list[int]:
        """Make room for new tokens: ``spans[i] = (first, last)`` says claim ``i`` is about to write its tokens
        ``first`` to ``last - 1``. A part-block it writes into that something else also holds is replaced by a
        copy of its first ``first % block_size`` slots (copy-on-write; the last holder of a block writes in
        place), and new blocks cover the chunks up to ``last``. Returns the indices of the claims whose block
        under ``first`` was replaced (their earlier slots in that block moved).

        Mutates the claims' tables, refcounts and the pool (making room: growing, evicting); all or nothing: if
        it raises (:class:`CapacityError`), the tables and refcounts are as before."""
        bs, alloc = self.block_size, self._allocator
        cow, grow = [], []
        for i, (claim, (first, last)) in enumerate(zip(claims, spans)):
            if last <= 0:
                grow.append(0)
                continue
            if first % bs and first // bs < len(claim.table) and alloc.refcount(claim.table[first // bs]) > 1:
                cow.append(i)
            grow.append(max(0, -(-last // bs) - len(claim.table)))
        if not cow and not any(grow):
            return []
        copied: list[tuple[int, int]] = []  # (claim, the block it held before its copy)
        grown: list[int] = []
        # several rows growing by more than a block (a batch's prefill) are placed in one free range, each
        # row's run ``stride`` blocks after the previous one's: the blocks its decode steps add later follow it
        # (each row stays one run, and the rows stay evenly spaced: one strided view in attention)
        placed = [i for i, n in enumerate(grow) if n > 1]
        stride = max(grow) + -(-_RESERVE_TOKENS // bs) if len(placed) > 1 else 0
        with self._lock:
            self._ensure_free(self._copies_needed(claims, spans, cow) + sum(grow), spare=stride * len(placed))
            try:
                for i in cow:
                    table, first = claims[i].table, spans[i][0]
                    old = table[first // bs]
                    if alloc.refcount(old) == 1:  # the other sharers copied it already: it is this claim's now
                        continue
                    table[first // bs] = self._copy_prefix(old, first % bs)
                    copied.append((i, old))
                    alloc.decref([old])
                start = self._free_range(stride * len(placed)) if stride else None
                if start is None and stride:  # no room to spare: the runs back to back
                    stride = max(grow)
                    start = alloc.free_run(stride * len(placed))
                where = {} if start is None else {i: start + k * stride - 1 for k, i in enumerate(placed)}
                for i, n in enumerate(grow):
                    if n:  # right after the claim's last block where free: a row's blocks stay a run
                        table = claims[i].table
                        table.extend(alloc.allocate(n, where.get(i, table[-1] if table else None)))
                        grown.append(i)
            except BaseException:
                for i in grown:
                    alloc.decref(claims[i].table[-grow[i] :])
                    del claims[i].table[-grow[i] :]
                for i, old in reversed(copied):
                    table, first = claims[i].table, spans[i][0]
                    alloc.incref([old])
                    alloc.decref([table[first // bs]])
                    table[first // bs] = old
                raise
        return [i for i, _ in copied]

    def _copies_needed(self, claims: Sequence[Claim], spans: Sequence[tuple[int, int]], cow: list[int]) -> int:
        """How many copies the claims in ``cow`` make of the shared part-blocks they write into: one per claim,
        except that the last one holding a block takes it over when nothing else holds it. Does not mutate."""
        bs = self.block_size
        writers = Counter(claims[i].table[spans[i][0] // bs] for i in cow)
        return sum(k if self._allocator.refcount(b) > k else k - 1 for b, k in writers.items())

    def publish(self, claim: Claim, tokens: Sequence[int], *, known: int, end: int, space: Hashable) -> bool:
        """Cache ``tokens[:end]``, whose chunk ``c`` the claim's ``table[c]`` holds, in namespace ``space``, and
        move the claim's lock to the node that ends them. ``known`` leading tokens are on the claim's node's
        path already (what it published or reused before): the insert continues from there, so publishing a
        block of a long sequence costs that block, not the sequence. Callers publish only K/V proven to be those
        of ``tokens`` (``PagedPrefixCache._prove``). Where the trie held some of the whole blocks already (another
        request published those tokens first, or the part-block this claim copied), the claim takes the trie's
        blocks and gives its own back, so that the lock holds no block the claim does not read (docs/memory.md).
        Returns whether the claim's table changed so. Mutates the trie, the claim's table, refcounts and locks."""
        with self._lock:
            node = self._insert(tokens, claim.table, space, after=claim.node, known=known, end=end)
            adopted = self._adopt_trie_blocks(claim, node, known // self.block_size, end // self.block_size)
            self._trie.move_lock(claim.node, node)
            claim.node = node
            return adopted

    def _adopt_trie_blocks(self, claim: Claim, node: Node, first: int, stop: int) -> bool:
        """Make the claim's chunks ``first..stop-1`` the blocks the trie holds them in, on the path that ends at
        ``node``: both hold the proven K/V of the same keys. Returns whether any changed. Mutates the claim's
        table and refcounts."""
        bs = self.block_size
        trie_blocks: dict[int, int] = {}  # chunk -> the block the trie holds it in
        n: Node | None = node
        while n is not None and n.parent is not None and n.end > first * bs:
            for i, block in enumerate(n.blocks):
                trie_blocks.setdefault(n.start // bs + i, block)
            n = n.parent
        table = claim.table
        swaps = [(c, trie_blocks[c]) for c in range(first, stop) if trie_blocks.get(c, table[c]) != table[c]]
        for c, block in swaps:
            self._allocator.incref([block])
            self._allocator.decref([table[c]])
            table[c] = block
        return bool(swaps)

    def _insert(self, tokens: Sequence[int], table: Sequence[int], space: Hashable, **where: Any) -> Node:
        """Insert ``tokens`` with the blocks of ``table`` and count the block occurrences the trie added: the
        one insert of the store (publishing and loading). Mutates."""
        ins = self._trie.insert(tokens, table, space, **where)
        self._allocator.incref(ins.added)
        return ins.node

    def truncate(self, claims: Sequence[Claim], chunks: Sequence[int]) -> None:
        """Keep the first ``chunks[i]`` blocks of claim ``i`` and give back the rest. Mutates."""
        with self._lock:
            dropped: list[int] = []
            for claim, n in zip(claims, chunks):
                dropped.extend(claim.table[n:])
                del claim.table[n:]
            self._allocator.decref(dropped)

    def fork(self, claims: Sequence[Claim]) -> list[Claim]:
        """A new claim per claim holding the same blocks and lock (beams, ``num_return_sequences``, copies of a
        cache): they share blocks until one writes (:meth:`extend` copies). Mutates refcounts and locks."""
        with self._lock:
            forks = []
            for claim in claims:
                self._allocator.incref(claim.table)
                if claim.node is not None:
                    self._trie.lock(claim.node)
                forks.append(Claim(list(claim.table), claim.node))
            self._claims.update(forks)
            return forks

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back every block and lock of ``claims``, which hold nothing afterwards. Mutates."""
        with self._lock:
            self._drop(claims)

    def _drop(self, claims: Sequence[Claim]) -> None:
        self._allocator.decref([b for claim in claims for b in claim.table])
        for claim in claims:
            claim.table = []
            if claim.node is not None:
                self._trie.unlock(claim.node)
                claim.node = None
            self._claims.discard(claim)

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None
    ) -> None:
        """Store new K/V of ``layer`` into their ``slots`` (:meth:`BlockPool.write`), under the lock: another
        thread may grow the pool (a copy) meanwhile, and a write into the old copy would be lost. Mutates the
        pool."""
        with self._lock:
            self.pool.write(layer, slots, key, value, keep)

    def gather(
        self, layer: int, *, table: torch.Tensor | None = None, slots: torch.Tensor | None = None, length: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole rows of ``layer`` copied out of the pool: the first ``length`` columns of block ``table`` rows
        (:meth:`BlockPool.gather_blocks`), or the given ``slots`` (:meth:`BlockPool.gather`). Does not mutate."""
        with self._lock:
            if table is not None:
                return self.pool.gather_blocks(layer, table, length)
            assert slots is not None
            return self.pool.gather(layer, slots)

    def table_view(self, claims: Sequence[Claim]) -> list[TableView]:
        """Each claim's blocks, and whether something else holds each of them too. Does not mutate."""
        with self._lock:
            rc = self._allocator.refcount
            return [TableView(tuple(c.table), tuple(rc(b) > 1 for b in c.table)) for c in claims]

    def prefix_view(self) -> list[NodeView]:
        """A copy of every cached prefix node, for display (:meth:`RadixTrie.view`), pins marked. Does not
        mutate."""
        with self._lock:
            return self._trie.view([n for nodes in self._pins.values() for n in nodes])

    def count_query(self, prompt_tokens: Sequence[int], reused: Sequence[int], *, undo: bool = False) -> None:
        """Count a lookup in :attr:`stats` (``undo``: take back one counted before, as a cache that redoes its
        reuse does). Mutates the counters."""
        sign = -1 if undo else 1
        with self._lock:
            self._queries += sign * len(prompt_tokens)
            self._misses += sign * sum(1 for r in reused if r == 0)
            self._prompt_tokens += sign * sum(prompt_tokens)
            self._hit_tokens += sign * sum(reused)

    # -- inside the store (all under the store lock) ------------------------------------------------

    def _lookup(self, rows: list[list[int]], space: Hashable = None) -> list[Match]:
        """Longest cached prefix of each row in namespace ``space``. Mutates LRU times, and the trie and pool
        when blocks come back from the second tier."""
        with self._lock:
            if self.tier is not None:
                self._restore(rows, space)
            matches = [self._trie.match(r, space) for r in rows]
            for m in matches:
                if m.length:
                    self._trie.touch(m.node)
            return matches

    def _free_range(self, n: int) -> int | None:
        """The first of ``n`` consecutive free blocks, growing the pool by ``n`` for them if it has none and the
        budget allows (never evicting), or ``None``. Mutates (the pool's size)."""
        alloc = self._allocator
        start = alloc.free_run(n)
        if start is None and (self.max_blocks is None or alloc.capacity + n <= self.max_blocks + 1):
            start = alloc.capacity
            self.pool.grow(alloc.capacity + n)
            alloc.grow(alloc.capacity + n)
        return start

    def _ensure_free(self, n: int, spare: int = 0) -> None:
        """Make ``n`` blocks free: grow the pool within the budget (when it grows, by ``spare`` blocks at least:
        a free range for :meth:`_free_range`), then evict LRU unlocked leaves. Mutates; raises
        :class:`CapacityError` with the numbers when even that is not enough."""
        alloc = self._allocator
        if alloc.can_allocate(n):
            return
        limit = None if self.max_blocks is None else self.max_blocks + 1
        if limit is None or alloc.capacity < limit:
            want = max(2 * alloc.capacity, alloc.capacity + n - alloc.num_free, alloc.capacity + spare)
            target = want if limit is None else min(want, limit)
            self.pool.grow(target)
            alloc.grow(target)
        collected = False
        while not alloc.can_allocate(n):
            node = self._trie.evict_lru()
            if node is None:
                if collected:
                    raise self._capacity_error(n)
                # caches nobody closed may be waiting for the cyclic collector (a cache kept alive by a
                # traceback, a user's own cycle): let them give their blocks back once before giving up
                gc.collect()
                collected = True
                continue
            self._evictions += 1
            try:
                if self.tier is not None:
                    self._offload(node)
            finally:
                alloc.decref(node.blocks)  # the node left the trie: its blocks go back whatever the tier did

    # -- the second tier (all under the store lock) ----------------------------------------------

    def _offload(self, node: Node) -> None:
        """Copy the whole blocks of an evicted node to the tier. Mutates the tier only."""
        assert self.tier is not None
        bs = self.block_size
        first, end = node.start // bs, node.end // bs  # chunks [first, end) lie wholly before the edge's end
        space = self._trie.space_of(node)
        if end <= first or isinstance(space, WeightsChanged):
            return
        keys = chunk_keys(self._trie.path_tokens(node), bs, end, space)
        for c in range(first, end):
            if not self.tier.touch(keys[c]):
                self.tier.put(keys[c], self.pool.read_blocks([node.blocks[c - first]]), repr(space))

    def _restore(self, rows: list[list[int]], space: Hashable) -> None:
        """Bring back from the tier the whole blocks that extend each row's match in the trie, and insert
        them. Nodes matched or restored stay locked until every row is done, so that room made for one row
        never evicts another's. Mutates."""
        assert self.tier is not None
        if isinstance(space, WeightsChanged):
            return
        bs, alloc, held = self.block_size, self._allocator, []
        try:
            for row in rows:
                m = self._trie.match(row, space)
                if m.length:
                    self._trie.lock(m.node)
                    held.append(m.node)
                c0 = m.length // bs
                if c0 >= len(row) // bs:
                    continue  # the pool holds every whole block of the row
                keys = chunk_keys(row, bs, len(row) // bs, space)
                n = 0
                while c0 + n < len(keys) and keys[c0 + n] in self.tier:
                    n += 1
                if (c0 + n) * bs <= m.length:
                    continue
                for k in reversed(keys[c0 : c0 + n]):
                    self.tier.touch(k)  # offloading to make room must not drop what this row is about to read
                try:
                    self._ensure_free(n)
                except CapacityError:
                    continue  # no room: the row recomputes what the tier holds
                blocks: list[dict[str, torch.Tensor]] = []
                for key in keys[c0 : c0 + n]:
                    block = self.tier.get(key, repr(space))
                    if block is None:  # a file gone, of another store or failing its checksum: the rest is recomputed
                        break
                    blocks.append(block)
                n = len(blocks)
                if (c0 + n) * bs <= m.length:
                    continue
                fresh = alloc.allocate(n)
                try:
                    self.pool.write_blocks(fresh, {name: torch.cat([b[name] for b in blocks]) for name in blocks[0]})
                    ins = self._trie.insert(row[: (c0 + n) * bs], m.blocks[:c0] + fresh, space)
                    alloc.incref(ins.added)
                finally:
                    alloc.decref(fresh)  # the restore's own hold: the trie holds them now, or nothing does
                self._trie.lock(ins.node)
                held.append(ins.node)
                self.tier.count_restored(n, (c0 + n) * bs - m.length)
        finally:
            for node in held:
                self._trie.unlock(node)

    def _capacity_error(self, n: int) -> CapacityError:
        occurrences = self._trie.check_invariants()
        live = sum(1 for b in range(1, self._allocator.capacity) if self._allocator.refcount(b) > occurrences.get(b, 0))
        _, pinned = self._unlocked_and_pinned_blocks()
        budget = self.max_blocks if self.max_blocks is not None else self._allocator.capacity - 1
        return CapacityError(
            f"prefixkv: {n} more KV blocks are needed, {self._allocator.num_free} are free and no cached prefix "
            f"can be evicted: budget {budget} blocks ({format_bytes(budget * self.bytes_per_block)}, "
            f"{self.block_size} tokens each), {live} held by live caches, {pinned} pinned. "
            "Raise max_memory/num_blocks, close() caches you no longer need, unpin prefixes, "
            "or generate with fewer rows or new tokens."
        )

    def _copy_prefix(self, src: int, n: int) -> int:
        """A fresh block holding the first ``n`` slots of ``src`` (copy-on-write). Mutates."""
        with self._lock:
            self._ensure_free(1)
            (dst,) = self._allocator.allocate(1)
            try:
                self.pool.copy_block(src, dst, n)
            except BaseException:
                self._allocator.decref([dst])
                raise
            return dst

    def _refcount(self, block: int) -> int:
        return self._allocator.refcount(block)


def _as_token_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    """One sequence of token ids as ints; ``ValueError`` for anything else (floats are not truncated)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"expected one sequence of integer token ids, got a {ids.dtype} tensor of shape {tuple(ids.shape)}"
            )
        ids = ids.tolist()
    tokens = []
    for t in ids:
        try:
            value = operator.index(t)  # ints of any kind (numpy's too); never a float truncated
        except TypeError:
            value = -1
        if isinstance(t, bool) or value < 0:
            raise ValueError(f"token ids must be non-negative integers, got {t!r} ({type(t).__name__})")
        tokens.append(value)
    return tokens
