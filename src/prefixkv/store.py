"""``PrefixStore``: one per model. Ties the allocator, the trie and the pool together and owns the
budget, eviction, pins, statistics and the lock that lets several threads share one store."""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import attention, patch
from .allocator import BlockAllocator
from .errors import CapacityError, UnsupportedModelError
from .memory import attention_shape, format_bytes, parse_bytes
from .pool import BlockPool, LayerSpec
from .trie import Match, Node, RadixTrie

if TYPE_CHECKING:
    from .cache import PagedPrefixCache

_INITIAL_BLOCKS = 16


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store. ``hit_rate`` is reused prompt tokens over all prompt tokens looked up."""

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


def _check_supported(model: Any) -> None:
    """Refuse, by family and reason, the models whose cache prefixkv cannot hold exactly."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no `config`; pass a transformers causal LM")
    family = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{family} is an encoder-decoder model; prefixkv caches decoder-only causal LMs only"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text, "layer_types", None) or [])
    recurrent = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent"}
    if layer_types & recurrent or any(
        getattr(text, name, None) is not None for name in ("ssm_state_size", "state_size", "mamba_d_state")
    ):
        raise UnsupportedModelError(
            f"{family} has state-space or linear-attention layers, whose state is not a per-token KV cache; "
            "prefixkv cannot reuse a prefix for it"
        )
    if getattr(text, "kv_lora_rank", None) is not None:
        raise UnsupportedModelError(
            f"{family} uses multi-head latent attention (MLA), which prefixkv does not support yet"
        )
    v_dim = getattr(text, "v_head_dim", None)
    if v_dim is not None and v_dim != attention_shape(text).head_dim:
        raise UnsupportedModelError(
            f"{family} has value heads of size {v_dim} and key heads of size {attention_shape(text).head_dim}; "
            "prefixkv needs K and V of the same head size"
        )


def _layer_devices(model: Any, num_layers: int) -> list[torch.device]:
    """The device each decoder layer computes on (accelerate's execution device when dispatched)."""
    fallback = getattr(model, "device", torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            devices = []
            for layer in module:
                hook = getattr(layer, "_hf_hook", None)
                device = getattr(hook, "execution_device", None)
                if device is None:
                    param = next(layer.parameters(), None)
                    device = param.device if param is not None and param.device.type != "meta" else fallback
                devices.append(torch.device(device))
            return devices
    return [torch.device(fallback)] * num_layers


class PrefixStore:
    """The long-lived half of prefixkv: the block pool of every attention layer, the radix trie of
    cached prefixes, eviction and statistics. One per model.

    ``max_memory`` (bytes or a string such as ``"2GiB"``) or ``num_blocks`` bounds the pool; without
    either it grows as requests need. ``dtype`` defaults to the model's.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> ids = torch.arange(1, 12).unsqueeze(0)
    >>> with prefixkv.PagedPrefixCache(store, ids) as cache:
    ...     _ = model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    >>> prefixkv.PagedPrefixCache(store, ids).stats.cached_tokens
    8
    """

    def __init__(
        self,
        model: Any,
        *,
        block_size: int = 16,
        max_memory: int | str | None = None,
        num_blocks: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if max_memory is not None and num_blocks is not None:
            raise ValueError("give the budget as max_memory or as num_blocks, not both")
        _check_supported(model)
        self.model = model
        self.block_size = block_size
        shape = attention_shape(model.config)
        self.model_dtype: torch.dtype = getattr(model, "dtype", torch.float32)
        self.dtype = dtype or self.model_dtype
        devices = _layer_devices(model, shape.num_layers)
        specs = [LayerSpec(shape.kv_heads, shape.head_dim, d, self.dtype) for d in devices]
        self.bytes_per_block = BlockPool(specs, block_size, 0).bytes_per_block
        self.max_blocks = self._budget(max_memory, num_blocks)
        first = _INITIAL_BLOCKS if self.max_blocks is None else min(_INITIAL_BLOCKS, self.max_blocks)
        self._allocator = BlockAllocator(first + 1)
        self.pool = BlockPool(specs, block_size, first + 1)
        self._trie = RadixTrie(block_size)
        self._lock = threading.RLock()
        self._caches: weakref.WeakSet[PagedPrefixCache] = weakref.WeakSet()
        self._pins: dict[tuple[int, ...], list[Node]] = {}
        self._queries = self._misses = self._prompt_tokens = self._hit_tokens = self._evictions = 0
        self._closed = False
        attention.install(model)
        self._hooks = patch.attach_hooks(model, self)

    def _budget(self, max_memory: int | str | None, num_blocks: int | None) -> int | None:
        if num_blocks is not None:
            if not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
            return num_blocks
        if max_memory is None:
            return None
        budget = parse_bytes(max_memory)
        blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise ValueError(
                f"max_memory={max_memory!r} ({budget} bytes) is less than one block of {self.block_size} tokens "
                f"({self.bytes_per_block} bytes); raise max_memory or lower block_size"
            )
        return blocks

    # -- public API ------------------------------------------------------------------------------

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
            )

    def _unlocked_and_pinned_blocks(self, occurrences: Counter[int]) -> tuple[int, int]:
        """Blocks that evicting every unlocked node would free, and blocks under a pin."""
        unlocked: Counter[int] = Counter()
        for node in self._trie.nodes():
            if node.lock == 0:
                unlocked.update(node.blocks)
        rc = self._allocator.refcount
        evictable = sum(1 for b, n in unlocked.items() if rc(b) == n)
        pinned: set[int] = set()
        for node in (n for nodes in self._pins.values() for n in nodes):
            n: Node | None = node
            while n is not None:
                pinned.update(n.blocks)
                n = n.parent
        return evictable, len(pinned)

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

    def pin(self, ids: Sequence[int] | torch.Tensor) -> int:
        """Keep the cached part of ``ids`` from eviction until :meth:`unpin`. Mutates.

        Returns the number of tokens pinned (the cached prefix of ``ids``, which may be shorter).
        """
        tokens = _as_token_list(ids)
        with self._lock:
            m = self._trie.match(tokens)
            if m.length == 0:
                return 0
            self._trie.lock(m.node)
            self._pins.setdefault(tuple(tokens), []).append(m.node)
            return m.length

    def unpin(self, ids: Sequence[int] | torch.Tensor) -> None:
        """Undo one :meth:`pin` of the same ids. Mutates; raises ``KeyError`` if they are not pinned."""
        tokens = _as_token_list(ids)
        with self._lock:
            nodes = self._pins.get(tuple(tokens))
            if not nodes:
                raise KeyError("these ids are not pinned; pass the same ids that were given to pin()")
            self._trie.unlock(nodes.pop())
            if not nodes:
                del self._pins[tuple(tokens)]

    def clear(self) -> int:
        """Drop every cached prefix that is neither pinned nor read by a live cache. Mutates.

        Returns the number of blocks freed.
        """
        with self._lock:
            return self._allocator.decref(self._trie.clear())

    def close(self) -> None:
        """Detach from the model: remove the hooks and restore its attention implementation. Mutates."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        attention.uninstall(self.model)

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

    # -- for PagedPrefixCache (all under the store lock) -----------------------------------------

    def _lookup(self, rows: list[list[int]]) -> list[Match]:
        """Longest cached prefix of each row. Mutates only LRU times."""
        with self._lock:
            matches = [self._trie.match(r) for r in rows]
            for m in matches:
                if m.length:
                    self._trie.touch(m.node)
            return matches

    def _count_query(self, prompt_tokens: Sequence[int], reused: Sequence[int]) -> None:
        with self._lock:
            self._queries += len(prompt_tokens)
            self._misses += sum(1 for r in reused if r == 0)
            self._prompt_tokens += sum(prompt_tokens)
            self._hit_tokens += sum(reused)

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
        while not alloc.can_allocate(n):
            released = self._trie.evict_one()
            if released is None:
                raise self._capacity_error(n)
            self._evictions += 1
            alloc.decref(released)

    def _capacity_error(self, n: int) -> CapacityError:
        occurrences = self._trie.check_invariants()
        live = sum(1 for b in range(1, self._allocator.capacity) if self._allocator.refcount(b) > occurrences.get(b, 0))
        _, pinned = self._unlocked_and_pinned_blocks(occurrences)
        budget = self.max_blocks if self.max_blocks is not None else self._allocator.capacity - 1
        return CapacityError(
            f"prefixkv: {n} more KV blocks are needed but none can be freed: budget {budget} blocks "
            f"({format_bytes(budget * self.bytes_per_block)}, {self.block_size} tokens each), "
            f"{live} held by live caches, {pinned} pinned, {self._allocator.num_free} free. "
            "Raise max_memory/num_blocks, close() caches you no longer need, unpin prefixes, "
            "or generate with fewer rows or new tokens."
        )

    def _allocate(self, n: int) -> list[int]:
        with self._lock:
            self._ensure_free(n)
            return self._allocator.allocate(n)

    def _copy_prefix(self, src: int, n: int) -> int:
        """A fresh block holding the first ``n`` slots of ``src`` (copy-on-write). Mutates."""
        with self._lock:
            self._ensure_free(1)
            (dst,) = self._allocator.allocate(1)
            self.pool.copy_block(src, dst, n)
            return dst

    def _refcount(self, block: int) -> int:
        return self._allocator.refcount(block)

    def _incref(self, blocks: list[int]) -> None:
        with self._lock:
            self._allocator.incref(blocks)

    def _decref(self, blocks: list[int]) -> None:
        with self._lock:
            self._allocator.decref(blocks)

    def _publish(self, tokens: list[int], table: list[int], old: Node | None) -> Node:
        """Insert ``tokens`` (whole blocks of computed KV) and move the caller's lock to the new end
        node. Mutates."""
        with self._lock:
            ins = self._trie.insert(tokens, table)
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

    def _cached_prefixes(self) -> Iterator[Node]:
        return iter(self._trie.nodes())


def _as_token_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"expected one sequence of integer token ids, got a tensor of shape {tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    return [int(t) for t in ids]
