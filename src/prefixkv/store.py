"""``PrefixStore``: one per model. Ties the allocator, the trie and the pool together and owns the
budget, eviction, pins, statistics and the lock that lets several threads share one store."""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
import os
import threading
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from . import attention, display, patch, persist
from .allocator import BlockAllocator
from .errors import CapacityError
from .memory import attention_shape, format_bytes, parse_bytes
from .pool import BlockPool, LayerSpec, block_bytes, check_kv_dtype
from .support import check_supported
from .tier import BLOCK_FORMAT, OffloadTier, TierStats, chunk_keys
from .trie import Insert, Match, Node, RadixTrie

if TYPE_CHECKING:
    from .cache import CacheStats, PagedPrefixCache

_INITIAL_BLOCKS = 16
_DTYPE_NAMES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store. ``hit_rate`` is reused prompt tokens over all prompt tokens looked up;
    ``misses`` counts looked-up rows that reused nothing; ``evictions`` counts the cached prefixes (trie
    nodes) dropped to make room, least recently used first (not those dropped by :meth:`PrefixStore.clear`).
    With a second tier (``offload=``), ``offload`` holds its blocks, bytes and hits; the fields above
    count the pool alone, except ``hit_tokens`` (every reused token, from either tier)."""

    queries: int
    misses: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    blocks_used: int
    blocks_free: int
    blocks_evictable: int
    blocks_pinned: int
    bytes_used: int
    evictions: int
    cached_tokens: int
    nodes: int
    offload: TierStats | None = None


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


def _weights_state(model: Any) -> int:
    """A number that changes when any parameter or buffer of ``model`` is written in place (an optimizer step,
    ``load_state_dict``) or replaced (``.data =``, a new ``Parameter``, ``load_state_dict(assign=True)``): a hash
    of every tensor's storage address and version counter (inference tensors have none: 0)."""
    state = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        version = 0
        with contextlib.suppress(RuntimeError):
            version = t._version
        state.append((t.data_ptr(), version))
    return hash(tuple(state))


@dataclass(frozen=True)
class WeightsChanged:
    """The namespace of K/V computed after the weights changed since the store was built: ``adapters`` as
    :func:`adapter_space`, and ``state`` as :func:`_weights_state`. Only this process can tell such weights
    apart, so the second tier keeps none of their blocks (its files outlive the process)."""

    adapters: Hashable
    state: int


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

    ``kv_dtype="int8"`` (or ``"fp8"``) stores K/V in 8 bits with a scale per block and KV head, read
    back in ``dtype``: about half the memory of bf16 and a quarter of fp32 per token, at a small, measured
    cost in fidelity (``docs/memory.md``). ``offload="cpu"`` or ``"disk"`` (with ``offload_dir``) moves
    blocks evicted from the pool to host memory or files, within ``max_offload_memory``, and brings them
    back when a later prompt starts with them.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> ids = torch.arange(1, 12).unsqueeze(0)
    >>> with prefixkv.PagedPrefixCache(store, ids) as cache:
    ...     _ = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
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
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
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
            meta = persist.store_meta(self, persist.fingerprint(model), BLOCK_FORMAT) if offload == "disk" else {}
            self.tier = OffloadTier(offload, max_bytes=limit, directory=offload_dir, meta=meta)
        self._trie = RadixTrie(block_size)
        self._lock = threading.RLock()
        self._caches: weakref.WeakSet[PagedPrefixCache] = weakref.WeakSet()
        self._pins: dict[tuple[Hashable, tuple[int, ...]], list[Node]] = {}
        self._queries = self._misses = self._prompt_tokens = self._hit_tokens = self._evictions = 0
        self._closed = False
        self._tuners = _tuner_layers(model)
        self._weights_at_start = _weights_state(model)
        self._hf_model = transformers_model(model)
        attention.install(self._hf_model)
        self._hooks = patch.attach_hooks(self._hf_model, self)

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
            occurrences = self._trie.check_invariants()
            evictable, pinned = self._unlocked_and_pinned_blocks(occurrences)
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

    def _unlocked_and_pinned_blocks(self, occurrences: Counter[int]) -> tuple[int, int]:
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
            for cache in list(self._caches):
                holders.update(cache._held_blocks())
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
        nothing. Pins nest: each ``pin`` needs its own ``unpin``. Returns ``len(ids)``.

        >>> import prefixkv, torch
        >>> model = prefixkv.models.tiny_model("llama")
        >>> store = prefixkv.PrefixStore(model, block_size=4, num_blocks=8)
        >>> store.pin(torch.arange(3, 13))
        10
        >>> store.stats.blocks_pinned
        3
        """
        tokens = _as_token_list(ids)
        if not tokens:
            raise ValueError("pin() needs at least one token id")
        space = self.space()
        with self._lock:
            self._check_pin_budget(tokens, space)
            end = self._trie.end_node(tokens, space)
            if end is not None:
                self._add_pin(tokens, end, space)
                return len(tokens)
        from .cache import PagedPrefixCache  # cache.py imports this module

        with PagedPrefixCache(self, torch.tensor([tokens])) as cache:
            cache._prefill(keep_partial=True)  # the cache keeps the published tokens locked until the pin holds them
            with self._lock:
                end = self._trie.end_node(tokens, space)
                if end is None:
                    raise RuntimeError("prefixkv: the pin's prefill did not publish its tokens (the model changed?)")
                self._add_pin(tokens, end, space)
        return len(tokens)

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
        costs one forward pass over its part not cached yet, with a ``tqdm.auto`` progress bar unless
        ``progress=False``. Only whole blocks are cached: the last ``len(prompt) % block_size`` tokens
        of a prompt are not. Warm-up lookups count in :attr:`stats` like any other. Returns the
        prompt tokens reused and computed, per prompt (``per_row``) and in total.

        >>> import prefixkv, torch
        >>> store = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
        >>> store.warm([torch.arange(1, 20)], progress=False).computed_tokens
        19
        >>> prefixkv.PagedPrefixCache(store, torch.arange(1, 30)[None]).stats.cached_tokens
        16
        """
        from .cache import CacheStats, PagedPrefixCache

        rows = []
        with tqdm(list(prompts), desc="prefixkv warm", unit="prompt", disable=not progress) as bar:
            for prompt in bar:
                with PagedPrefixCache(self, torch.tensor([_as_token_list(prompt)], dtype=torch.long)) as cache:
                    cache._prefill(keep_partial=False)
                rows.append(cache.stats.per_row[0])
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
        ...     _ = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
        >>> path = os.path.join(tempfile.mkdtemp(), "prefixes.safetensors")
        >>> store.save(path).tokens
        16
        >>> prefixkv.PrefixStore.load(path, model).stats.cached_tokens
        16
        """
        wanted = None if prefixes is None else [_as_token_list(p) for p in prefixes]
        return persist.save(self, path, wanted)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Any, **kwargs: Any) -> PrefixStore:
        """A new store for ``model`` holding the prefixes saved at ``path`` (``kwargs`` as for
        ``PrefixStore``; block size and dtype default to the file's). Raises :class:`PersistError` for a
        truncated, corrupted or newer file, or one saved from another model, dtype or shape."""
        return persist.load(cls, path, model, **kwargs)

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
        return persist.merge(self, path)

    def close(self) -> None:
        """Detach from the model: remove the hooks and restore its attention implementation. Mutates."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        attention.uninstall(self._hf_model)

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

    # -- for PagedPrefixCache (all under the store lock) -----------------------------------------

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

    def _count_query(self, prompt_tokens: Sequence[int], reused: Sequence[int], *, undo: bool = False) -> None:
        """Count a lookup (``undo``: take back one counted before, as a cache that redoes its reuse does)."""
        sign = -1 if undo else 1
        with self._lock:
            self._queries += sign * len(prompt_tokens)
            self._misses += sign * sum(1 for r in reused if r == 0)
            self._prompt_tokens += sign * sum(prompt_tokens)
            self._hit_tokens += sign * sum(reused)

    def _ensure_free(self, n: int) -> None:
        """Make ``n`` blocks free: grow the pool within the budget, then evict LRU unlocked leaves.
        Mutates; raises :class:`CapacityError` with the numbers when even that is not enough."""
        alloc = self._allocator
        if alloc.can_allocate(n):
            return
        limit = None if self.max_blocks is None else self.max_blocks + 1
        if limit is None or alloc.capacity < limit:
            want = max(2 * alloc.capacity, alloc.capacity + n - alloc.num_free)
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
            if self.tier is not None:
                self._offload(node)
            alloc.decref(node.blocks)

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
                self.tier.put(keys[c], self.pool.read_blocks([node.blocks[c - first]]))

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
                    block = self.tier.get(key)
                    if block is None:  # a file that failed its checksum: the rest is recomputed
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
        _, pinned = self._unlocked_and_pinned_blocks(occurrences)
        budget = self.max_blocks if self.max_blocks is not None else self._allocator.capacity - 1
        return CapacityError(
            f"prefixkv: {n} more KV blocks are needed, {self._allocator.num_free} are free and no cached prefix "
            f"can be evicted: budget {budget} blocks ({format_bytes(budget * self.bytes_per_block)}, "
            f"{self.block_size} tokens each), {live} held by live caches, {pinned} pinned. "
            "Raise max_memory/num_blocks, close() caches you no longer need, unpin prefixes, "
            "or generate with fewer rows or new tokens."
        )

    def _allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` fresh blocks, the ones right after block ``after`` where free (a row's blocks stay a run)."""
        with self._lock:
            self._ensure_free(n)
            return self._allocator.allocate(n, after)

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

    def _incref(self, blocks: list[int]) -> None:
        with self._lock:
            self._allocator.incref(blocks)

    def _decref(self, blocks: list[int]) -> None:
        with self._lock:
            self._allocator.decref(blocks)

    def _publish(self, tokens: list[int], table: list[int], old: Node | None, space: Hashable) -> Node:
        """Insert ``tokens`` (whole blocks of computed KV) into namespace ``space`` and move the caller's lock
        to the new end node. Mutates. Callers publish only K/V proven to be those of ``tokens``
        (``PagedPrefixCache._prove``)."""
        with self._lock:
            ins = self._trie.insert(tokens, table, space)
            self._allocator.incref(ins.added)
            self._trie.lock(ins.node)
            if old is not None:
                self._trie.unlock(old)
            return ins.node

    def _lock_node(self, node: Node) -> None:
        with self._lock:
            self._trie.lock(node)

    def _unlock_node(self, node: Node) -> None:
        with self._lock:
            self._trie.unlock(node)

    def _register(self, cache: PagedPrefixCache) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this PrefixStore is closed; build a new one for the model")
            self._caches.add(cache)

    def _unregister(self, cache: PagedPrefixCache) -> None:
        with self._lock:
            self._caches.discard(cache)


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
