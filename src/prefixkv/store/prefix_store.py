"""``PrefixStore``: one per model, what a user calls. The budget, pins and warm-up, save/load/merge, statistics,
the views of a notebook and ``close``; the blocks themselves (pool, allocator, trie, eviction, the second tier
and the lock) are its :class:`~prefixkv.kv.manager.BlockManager`, ``store.blocks``, which caches call, and what
keys them besides the tokens is its :class:`~prefixkv.kv.key_space.KeySpace`. The store is built top-down
(docs/how-it-works.md, "Layers"): it builds its settings (``store.settings``, from its options checked by
:mod:`prefixkv.store.options`), its block manager, the runner of its model (``store.runner``, which pins and warms) and
the model's hooks, and hands each what it needs; none of them imports this module. Its files (save, load, merge,
a disk tier's metadata) go through :mod:`prefixkv.store.files`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from ..attention import interface
from ..base import display
from ..base.errors import CacheMisuseError
from ..base.family import model_errors
from ..base.memory import attention_shape, format_bytes, layer_shapes, parse_bytes, snapshot_budget
from ..base.stats import CacheStats, StoreStats
from ..base.tokens import as_token_list, message_ends
from ..hf import kinds, shapes
from ..hf.hooks import attach_hooks, install_generation_wrappers
from ..hf.runner import ModelRunner
from ..hf.state_files import Carrier
from ..hf.states import Snapshots
from ..kv import prefix_file
from ..kv.key_space import KeySpace, layer_devices, transformers_model, user_space
from ..kv.manager import BlockManager
from ..kv.pool import BlockPool, block_bytes
from ..kv.tier import OffloadTier
from . import files
from .options import check_options, check_priority, max_blocks, offload_kind
from .parallel import agreed_budget

_INITIAL_BLOCKS = 16


class PrefixStore:
    """The long-lived half of prefixkv: the block pool of every attention layer, the radix trie of
    cached prefixes, eviction and statistics. One per model. The blocks themselves are ``store.blocks``
    (:class:`prefixkv.kv.manager.BlockManager`), which caches use; a user needs only the methods here.

    ``max_memory`` (bytes or a string such as ``"2GiB"``) or ``num_blocks`` bounds the pool; without
    either it grows as requests need. ``dtype`` defaults to the model's.

    ``kv_dtype="int8"`` (or ``"fp8"``) stores K/V in 8 bits with a scale per token and KV head, read
    back in ``dtype``: about half the memory of bf16 and a quarter of fp32 per token, at a small, measured
    cost in fidelity (``docs/memory.md``). ``offload="cpu"`` or ``"disk"`` (with ``offload_dir``; ``offload_dir``
    alone means ``"disk"``) moves blocks evicted from the pool to host memory or files, within
    ``max_offload_memory``, and brings them back when a later prompt starts with them.

    ``invariant=True`` makes every call's logits bit-identical whatever the store holds (docs/correctness.md,
    "Outputs that never depend on the cache"): prompt K/V are computed in chunks of ``chunk_size`` tokens (a
    multiple of ``block_size``; ``4 * block_size`` by default) at fixed positions, one row at a time, and only
    those chunks are cached and reused.

    ``attention`` chooses how attention reads the pool (``store.attention_backend`` says which reads it, and why;
    ``store.settings.backend`` is its name, ``store.settings.backend_reason`` that line), chosen once when the store
    is built:
    ``"auto"`` (the default) reads the blocks in place on the CPU (``"blocks"``) and gathers every row's K/V into one
    tensor for the model's own attention elsewhere (``"gather"``: on CUDA until GPU measurements show FlexAttention
    faster); ``"flex"`` reads them in place with torch's FlexAttention (compiled), and falls back to the gather, with
    a warning that says why, where FlexAttention cannot compute exactly what the model would (float64, CUDA block
    sizes that are not a power of two >= 16, soft-capping, a mask it cannot express, invariant stores, a kernel that
    does not compile). It changes no K/V: files and keys leave it out (docs/generate.md, "Choosing the attention
    backend").

    ``tokenizer`` (the model's tokenizer or processor) tells a model with recurrent layers where a conversation's
    messages end: the ids its chat template ends a message with and its end-of-sequence token
    (:func:`prefixkv.base.tokens.message_ends`) become ``store.snapshots.marks``, after each of which a prefill takes
    a snapshot the next prompt resumes at (docs/memory.md, "Recurrent state"). It changes no K/V. Anything that is
    neither (a checkpoint's path, say) is refused with a ``TypeError``.

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
        attention: str = "auto",
        tokenizer: Any = None,
    ) -> None:
        # what the layers below read of the store (``store.settings``, frozen), every option checked first, and the
        # same values as a user reads them: ``store.block_size``, ``store.chunk_size``, ``store.dtype``, ...
        settings = check_options(
            model, block_size=block_size, max_memory=max_memory, num_blocks=num_blocks, dtype=dtype, kv_dtype=kv_dtype,
            offload=offload, max_offload_memory=max_offload_memory, offload_dir=offload_dir, invariant=invariant,
            chunk_size=chunk_size, attention=attention,
        )  # fmt: skip
        install_generation_wrappers()
        self.model = model
        # the transformers model that computes (inside a PEFT wrapper, its base model): what is hooked and run
        self.hf_model = transformers_model(model)
        estimate = attention_shape(model.config)
        self.settings = settings
        self.block_size, self.chunk_size, self.dtype = settings.block_size, settings.chunk_size, settings.dtype
        self.model_dtype, self.kv_dtype, self.attention = settings.model_dtype, settings.kv_dtype, settings.attention
        # what each layer caches: K/V, a recurrent state (snapshots at token positions), both, nothing
        self.layer_kinds = kinds.layer_kinds(model.config.get_text_config(decoder=True))
        devices = layer_devices(model, estimate.num_layers)
        # heads and sizes as the layers hand K/V over, not as the config names them (docs/how-it-works.md)
        measured = shapes.measure(self.hf_model, layer_shapes(model.config), devices[0], self.layer_kinds)
        # what the pool keeps per token of each layer, as its kind says (a layer without K/V: empty pool tensors)
        specs = [
            kinds.of(self.layer_kinds, i).spec(s, d, self.dtype) for i, (s, d) in enumerate(zip(measured, devices))
        ]
        self.bytes_per_block = block_bytes(specs, block_size, kv_dtype)
        spare = snapshot_budget(self.layer_kinds, max_memory)  # the snapshots' share of max_memory
        kv_memory = max_memory if max_memory is None or spare is None else parse_bytes(max_memory) - spare
        # per process of a split model, the same in each (docs/getting-started.md, "Several GPUs")
        self.max_blocks = agreed_budget(
            None
            if self.bytes_per_block == 0 and num_blocks is None  # nothing per block: the snapshots' budget bounds it
            else max_blocks(kv_memory, num_blocks, max(1, self.bytes_per_block), block_size),
            model,
        )
        first = _INITIAL_BLOCKS if self.max_blocks is None else min(_INITIAL_BLOCKS, self.max_blocks)
        self.snapshots = Snapshots(
            spare,
            kv_bytes_per_token=self.bytes_per_block / block_size,
            pool_bytes=None if self.max_blocks is None else (self.max_blocks + 1) * self.bytes_per_block,
        )
        """The recurrent layers' state snapshots (docs/memory.md, "Recurrent state"): empty for other models. The pool
        and they share ``max_memory``: the pool gets what the snapshots' budget (``snapshots.max_bytes``) leaves."""
        self.snapshots.block_size = block_size
        if tokenizer is not None:  # where a conversation's messages end: the prompts part there (Snapshots.marks)
            text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
            if not hasattr(text_tokenizer, "eos_token_id") and not hasattr(tokenizer, "apply_chat_template"):
                raise TypeError(
                    f"tokenizer= takes the model's tokenizer or processor (with an eos_token_id or a chat template), "
                    f"got a {type(tokenizer).__name__}: load it first, e.g. AutoTokenizer.from_pretrained(path)"
                )
            self.snapshots.marks = message_ends(tokenizer)
        # the snapshots as they go to files and the second tier and come back, checked against the model's own states
        stateful = kinds.stateful(self.layer_kinds)
        self._carrier = Carrier(self.snapshots, shapes.state_reference(self.hf_model), devices) if stateful else None
        kind = offload_kind(offload, max_offload_memory, offload_dir)  # offload_dir alone: the disk tier
        tier = files.offload_tier(kind, max_offload_memory, offload_dir, settings, specs, model, self._carrier)
        self.blocks = BlockManager(
            BlockPool(specs, block_size, first + 1, kv_dtype),
            chunk_size=settings.chunk_size,
            max_blocks=self.max_blocks,
            bytes_per_block=self.bytes_per_block,
            tier=tier,
            key_space=KeySpace(model),
        )
        # a snapshot goes with its path's K/V, in whichever key space the trie evicts them (to the tier, with one)
        carrier = self._carrier
        self.blocks.holdings.trie.watchers.append(
            carrier.evicted if tier is not None and carrier is not None else self.snapshots.evicted
        )
        self.runner = ModelRunner(self)
        # the switch to prefixkv attention that the backend was chosen for (interface.can_install); the line that
        # says which backend reads the pool and why is the settings' (docs/generate.md)
        interface.install(self.hf_model)
        self.attention_backend = settings.backend_reason
        self._hooks = attach_hooks(self.hf_model, self)

    # the blocks' pool and tier, as a user reads them: their home is the block manager

    @property
    def pool(self) -> BlockPool:
        """The K/V tensors (``store.blocks.pool``). Does not mutate."""
        return self.blocks.pool

    @property
    def tier(self) -> OffloadTier | None:
        """The second tier (``store.blocks.tier``), or ``None``. Does not mutate."""
        return self.blocks.tier

    @property
    def invariant(self) -> bool:
        """Whether the store computes prompt K/V in the canonical schedule (``PrefixStore(invariant=True)``)."""
        return self.settings.invariant

    @property
    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters (the recurrent-state snapshots' beside the pool's). Does not
        mutate."""
        s = self.snapshots
        return dataclasses.replace(
            self.blocks.ledger.stats(),
            snapshots=len(s),
            snapshot_bytes=s.bytes_used,
            snapshots_taken=s.taken,
            snapshots_used=s.used,
            snapshots_dropped_budget=s.dropped_budget,
            snapshots_dropped_path=s.dropped_path,
            kv_hit_tokens=s.kv_hit_tokens,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any refcount disagrees with its holders (trie nodes and live
        cache rows), or the trie is malformed, or a recurrent-state snapshot outlives its path's K/V or its budget.
        Does not mutate."""
        self.blocks.ledger.check_invariants()
        self.snapshots.check(lambda space, path: self.blocks.cached_length(path, space))

    def cached_length(self, tokens: Sequence[int], space: Hashable = None, *, namespace: str | None = None) -> int:
        """How many leading ``tokens`` namespace ``space`` holds (``None``: the model without adapters) for user
        ``namespace`` (``None``: the one shared namespace; see :class:`PagedPrefixCache`). Does not mutate."""
        return self.blocks.cached_length(tokens, user_space(namespace, space))

    def pin(
        self, ids: Sequence[int] | torch.Tensor, *, priority: int | None = None, namespace: str | None = None
    ) -> int:
        """Keep the prefix ``ids`` (a system prompt) cached until :meth:`unpin`. Mutates.

        The part of ``ids`` not cached yet is computed first with the store's model (one forward; all
        of ``ids`` is kept, a last part-filled block included). Pinned blocks count against the budget:
        a pin that would take more blocks than the budget raises :class:`CapacityError` and pins
        nothing. Pins nest: each ``pin`` needs its own ``unpin``. Returns how many tokens it keeps: ``len(ids)``,
        or in an invariant store its whole chunks (the part a later call reuses; fewer than ``chunk_size`` ids
        raise ``ValueError``).

        ``priority`` (0-100) makes a soft pin instead, as retention priorities do in serving engines: its
        blocks are evicted only after every unpinned prefix of lower priority (unpinned prefixes have 35),
        but they are never kept when nothing else is left, so a soft pin counts against no budget
        (docs/generate.md, "Many prompts at once"). ``unpin`` it with the same priority.

        ``namespace`` pins the prefix for that user's caches only (:class:`PagedPrefixCache`; ``None``: the
        shared namespace, which caches built with a namespace never read); ``unpin`` it with the same name.

        >>> import prefixkv, torch
        >>> model = prefixkv.models.tiny_model("llama")
        >>> store = prefixkv.PrefixStore(model, block_size=4, num_blocks=8)
        >>> store.pin(torch.arange(3, 13))
        10
        >>> store.stats.blocks_pinned
        3
        """
        check_priority(priority)
        with model_errors(self.hf_model):  # a kernel that refuses the model's dtype is the model's (docs/faq.md)
            return self.runner.pin(as_token_list(ids), priority, namespace)

    def unpin(
        self, ids: Sequence[int] | torch.Tensor, *, priority: int | None = None, namespace: str | None = None
    ) -> None:
        """Undo one :meth:`pin` of the same ids, priority and namespace. Mutates; raises ``ValueError`` if they
        are not pinned so."""
        self.blocks.pins.remove(as_token_list(ids), user_space(namespace, self.blocks.space()), priority)

    def clear(self) -> int:
        """Drop every cached prefix that is neither pinned nor read by a live cache, and everything the second
        tier holds (``offload=``: its blocks in host memory, or its files): a later request recomputes them.
        Mutates.

        Returns the number of pool blocks freed.
        """
        return self.blocks.clear()  # the snapshots on the paths dropped go with them (Snapshots.evicted)

    def warm(
        self,
        prompts: Iterable[Sequence[int] | torch.Tensor],
        *,
        progress: bool = True,
        namespace: str | None = None,
    ) -> CacheStats:
        """Compute the KV of each prompt now and cache it, so that later calls starting with one of
        them skip its prefill. Mutates (fills and may evict blocks).

        ``prompts`` holds token id sequences (lists, 1-D tensors, or the rows of a 2-D tensor), not text: tokenize
        text with the tokenizer, and chat messages with ``tokenizer.apply_chat_template`` (the same template as the
        later calls, so that their prompts start with these ids); a string or a message is refused with a
        ``ValueError`` that says so, before anything is computed. Each
        costs one forward pass over its part not cached yet (in an invariant store, one per chunk), with a
        ``tqdm.auto`` progress bar unless ``progress=False``. Only whole blocks are cached: the last
        ``len(prompt) % block_size`` tokens of a prompt are not (in an invariant store, only whole chunks are
        computed and cached). Warm-up lookups count in :attr:`stats` like any other. Returns the
        prompt tokens reused and computed, per prompt (``per_row``) and in total. ``namespace`` caches them for
        that user's caches only (:class:`PagedPrefixCache`).

        >>> import prefixkv, torch
        >>> store = prefixkv.PrefixStore(prefixkv.models.tiny_model("llama"), block_size=4)
        >>> store.warm([torch.arange(1, 20)], progress=False).computed_tokens
        19
        >>> prefixkv.PagedPrefixCache(store, torch.arange(1, 30)[None]).stats.cached_tokens
        16
        """
        given: Iterable[object] = [prompts] if isinstance(prompts, (str, dict)) else prompts
        token_lists = [_as_warm_tokens(prompt) for prompt in given]  # every prompt checked before any is computed
        with model_errors(self.hf_model):
            return self.runner.warm(token_lists, progress=progress, namespace=namespace)

    def save(
        self, path: str | os.PathLike[str], prefixes: Iterable[Sequence[int] | torch.Tensor] | None = None
    ) -> prefix_file.PersistStats:
        """Write the cached prefixes (all, or the cached part of each of ``prefixes``) to a safetensors
        file at ``path``, with the model's fingerprint so it loads only for this model, and for a model with
        recurrent layers the state snapshots on the saved paths. Does not mutate. See ``docs/persistence.md``.

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
        wanted = None if prefixes is None else [as_token_list(p) for p in prefixes]
        snapshots = self.snapshots if kinds.stateful(self.layer_kinds) else None
        return files.save(path, wanted, self.blocks, self.settings, self.model, snapshots)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Any, **kwargs: Any) -> PrefixStore:
        """A new store for ``model`` holding the prefixes saved at ``path`` (``kwargs`` as for
        ``PrefixStore``; block size and dtype default to the file's). Raises :class:`PersistError` for a
        truncated, corrupted or newer file, or one saved from another model, dtype or shape."""
        file = prefix_file.read(path)
        store = cls(model, **files.load_options(file, path, model, kwargs))
        try:
            files.add_file(store.blocks, store.chunk_size, file, path, model, store._carrier)
        except BaseException:
            store.close()
            raise
        return store

    @staticmethod
    def convert(
        path: str | os.PathLike[str], new_path: str | os.PathLike[str], kv_dtype: str | None
    ) -> prefix_file.PersistStats:
        """Write the prefixes saved at ``path`` to ``new_path`` with K/V kept as ``kv_dtype`` (``"int8"``,
        ``"fp8"`` or ``None``): the explicit step between quantized and unquantized stores, which refuse
        each other's files. See :func:`prefixkv.kv.prefix_file.convert`."""
        return prefix_file.convert(path, new_path, kv_dtype)

    def merge(self, path: str | os.PathLike[str]) -> prefix_file.PersistStats:
        """Add the prefixes saved at ``path`` to this store, within its budget (evicting least recently
        used prefixes for room). Mutates only after the file is verified and known to fit; raises
        :class:`PersistError` or :class:`CapacityError` otherwise, leaving the store unchanged."""
        file = prefix_file.read(path)
        prefix_file.check_compatible(file, path, self.block_size, self.dtype, self.model_dtype, self.kv_dtype)
        return files.add_file(self.blocks, self.chunk_size, file, path, self.model, self._carrier)

    def close(self) -> None:
        """Detach from the model: remove the hooks and restore its attention implementation. Mutates."""
        if self.closed:
            return
        self.blocks.close()
        for handle in self._hooks:
            handle.remove()
        interface.uninstall(self.hf_model)

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

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` detached the store from its model. Does not mutate."""
        return self.blocks.closed

    @property
    def is_compileable(self) -> bool:
        """``generate`` asks a cache this first; a store is not a cache, so say what to pass instead."""
        raise _not_a_cache()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """What some transformers releases ask a cache first (before ``is_compileable``): the same refusal."""
        raise _not_a_cache()


def _not_a_cache() -> CacheMisuseError:
    return CacheMisuseError(
        "a PrefixStore was passed where generate takes a cache; pass one PagedPrefixCache per call: "
        "cache=prefixkv.PagedPrefixCache(store, ids)"  # every supported release takes cache= (prefixkv.compat.releases)
    )


def _as_warm_tokens(prompt: object) -> list[int]:
    """One prompt of :meth:`PrefixStore.warm` as token ids; ``ValueError`` for text or chat messages, saying how
    to make ids of them."""
    if isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], str)):
        raise ValueError(
            f"store.warm() takes token ids, got text ({prompt!r:.60}): tokenize it first, "
            "store.warm([tokenizer(text)['input_ids']])"
        )
    if isinstance(prompt, dict) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict)):
        raise ValueError(
            f"store.warm() takes token ids, got chat messages ({prompt!r:.60}): apply the chat template first, "
            "store.warm([tokenizer.apply_chat_template(messages, return_dict=True)['input_ids']]), with the "
            "template settings of the later calls so that their prompts start with these ids"
        )
    return as_token_list(prompt)  # type: ignore[arg-type]
