"""``PagedPrefixCache``: the per-call ``transformers.Cache`` whose rows are block tables into a store.

Layout. Every row of the batch has the same number of *columns* (what ``get_seq_length`` reports, pads
included). Row ``i`` has ``pad`` leading padding columns that read the null block, then its tokens:
token ``t`` sits at column ``pad + t`` and in slot ``table[t // block_size] * block_size + t % block_size``.
One block id indexes every layer's pool, so a row has one table for all layers.

Life of a call. At construction the prompt of each row is matched in the trie; matched whole blocks are
shared (refcount), a matched part-block is copied (copy-on-write), and ``get_seq_length`` reports the
reused columns so ``generate`` only prefills the rest. Before each forward the model hook hands over the
ids being fed (DESIGN.md rule 1), and the cache allocates their slots; ``update`` writes K/V there and
returns K/V read back from the blocks; after the forward, blocks that became full are published to the
trie. ``close()`` (or dropping the last reference: no reference cycle keeps a cache alive) gives every
block back.

Keys. A row's ``tokens`` are the keys its K/V are cached under: the token id where the attention mask is 1,
and ``-1 - id`` where a mask with holes hides a token (a hole shifts the positions after it, so the K/V
that follow are not those of the unmasked ids). Leading padding is not part of a row.

The one rule (DESIGN.md rule 11). A row publishes its blocks only while every forward is proven to have
computed the K/V of its keys: ids fed in order, the mask and positions those of the keys, ``use_cache`` on,
no embeddings, the store's namespace (active adapters) unchanged. :meth:`PagedPrefixCache._prove` decides
it for every forward, and a row that fails it forgets its keys (never publishes again). Reuse at
construction is checked against the same facts at the first forward of each ``generate`` call
(:meth:`PagedPrefixCache.plan_call`), which recomputes rather than serve K/V the call does not match.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _compat, attention, display
from .errors import CacheMisuseError
from .stats import CacheStats, RowStats
from .store import Claim, PrefixStore


class _Row:
    """One batch row: leading pad columns, its keys (``None`` once unproven: it never publishes again), its
    claim in the store (block table and the trie node it keeps locked), and its chunks already in the trie."""

    __slots__ = ("claim", "pad", "prompt_len", "published", "real", "tokens")

    def __init__(self, pad: int, tokens: list[int] | None, claim: Claim, published: int):
        self.pad = pad
        self.tokens = tokens
        self.prompt_len = len(tokens) if tokens is not None else 0
        self.claim = claim
        self.published = published
        self.real = 0  # shown tokens among the row's stored columns: the position of the next shown token

    @property
    def table(self) -> list[int]:
        """The row's block table: its claim's, which only the store changes."""
        return self.claim.table

    def clone(self, claim: Claim) -> _Row:
        """This row holding ``claim`` (a :meth:`PrefixStore.fork` of its own)."""
        row = _Row(self.pad, None if self.tokens is None else list(self.tokens), claim, self.published)
        row.prompt_len = self.prompt_len
        row.real = self.real
        return row


def _key(token: int, visible: bool) -> int:
    """The trie key of a token: its id, or ``-1 - id`` where the attention mask hides it."""
    return token if visible else -1 - token


def _real_count(keys: list[int]) -> int:
    """How many of ``keys`` the mask shows (the position of the next shown token)."""
    return sum(1 for k in keys if k >= 0)


class _PagedLayer(CacheLayerMixin):
    """The per-layer face transformers expects; all state lives in the owning cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedPrefixCache, layer_idx: int) -> None:
        super().__init__()
        # a weak reference: a strong one would make every cache a cycle that only the cyclic garbage collector
        # frees, so `del cache` would not give the blocks back (DESIGN.md rule 12)
        self._cache_ref = weakref.ref(cache)
        self._layer_idx = layer_idx
        self.is_initialized = True

    @property
    def _cache(self) -> PagedPrefixCache:
        cache = self._cache_ref()
        if cache is None:
            raise CacheMisuseError("the PagedPrefixCache of this layer was garbage-collected")
        return cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(key_states, value_states, self._layer_idx)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self._layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        return None


def _column_slots(row: _Row, start: int, stop: int, block_size: int) -> torch.Tensor:
    """Pool slots of columns ``[start, stop)`` of ``row``, a LongTensor; pad columns read slot 0 (the
    null block)."""
    table, pad = row.table, row.pad
    if stop - start <= 8:  # the decode step: plain ints beat tensor set-up
        return torch.tensor(_slot_list(row, start, stop, block_size), dtype=torch.long)
    t = torch.arange(start - pad, stop - pad)
    blocks = torch.tensor(table, dtype=torch.long) if table else torch.zeros(1, dtype=torch.long)
    slots = blocks[t.clamp(min=0) // block_size] * block_size + t.clamp(min=0) % block_size
    return slots.masked_fill_(t < 0, 0)


def _slot_list(row: _Row, start: int, stop: int, block_size: int) -> list[int]:
    """:func:`_column_slots` as plain ints, for a few columns."""
    table, pad = row.table, row.pad
    return [
        0 if c < pad else table[(c - pad) // block_size] * block_size + (c - pad) % block_size
        for c in range(start, stop)
    ]


# runs shorter than this many blocks are gathered (one copy per row) rather than read as views (one call each)
_MIN_RUN = 8
# ... except for a row read alone, up to this many short runs (more: one gather rather than a call each)
_LONE_ROW_VIEWS = 2


def _table_runs(table: list[int], memo: dict[int, tuple[list[int], int, list[list[int]]]] | None) -> list[list[int]]:
    """``[first, end)`` block indices of the runs of consecutive block ids in ``table``. With ``memo`` (kept by the
    caller, cleared whenever a table changes other than at its end), a table seen before is walked again only
    from its last block (which copy-on-write may have replaced): a decode step costs O(1), not O(blocks). Mutates
    ``memo``."""
    entry = None if memo is None else memo.get(id(table))
    runs: list[list[int]] = []
    walked = 0
    if entry is not None and entry[0] is table and entry[1] <= len(table):
        keep = max(0, entry[1] - 1)
        for first, end in entry[2]:
            if first >= keep:
                break
            runs.append([first, min(end, keep)])
        walked = keep
    for b in range(walked, len(table)):
        if runs and runs[-1][1] == b and table[b] == table[b - 1] + 1:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    if memo is not None:
        memo[id(table)] = (table, len(table), runs)
    return runs


def _runs(
    table: list[int],
    begin: int,
    stop: int,
    block_size: int,
    memo: dict[int, tuple[list[int], int, list[list[int]]]] | None = None,
) -> list[tuple[int, int, int]]:
    """Tokens ``[begin, stop)`` of ``table`` (``begin`` a multiple of ``block_size``) as runs of consecutive block
    ids: ``(first token, end token, first slot)``. Mutates ``memo`` only (:func:`_table_runs`)."""
    out = []
    b, last = begin // block_size, -(-stop // block_size)
    for first, end in _table_runs(table, memo):
        lo, hi = max(first, b), min(end, last)
        if lo < hi:
            out.append((lo * block_size, min(hi * block_size, stop), table[lo] * block_size))
    return out


def _gather_read(rows: list[int], pieces: list[list[tuple[int, int, int]]], pads: list[int]) -> attention.Read:
    """One read of the scattered pieces ``(first token, end token, first slot)`` of several rows, padded to the
    longest row's count (``valid`` marks the real ones)."""
    width = max(sum(hi - lo for lo, hi, _ in row) for row in pieces)
    slots = torch.zeros((len(rows), width), dtype=torch.long)
    columns = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for j, (row, row_pieces) in enumerate(zip(rows, pieces)):
        n = 0
        for lo, hi, slot in row_pieces:
            slots[j, n : n + hi - lo] = torch.arange(slot, slot + hi - lo)
            columns[j, n : n + hi - lo] = torch.arange(pads[row] + lo, pads[row] + hi)
            n += hi - lo
        valid[j, :n] = True
    return attention.Read(tuple(rows), (0,) * len(rows), width, slots=slots, offsets=columns, valid=valid)


def plan_reads(
    pads: list[int],
    tables: list[list[int]],
    start: int,
    q: int,
    block_size: int,
    memo: dict[int, tuple[list[int], int, list[list[int]]]] | None = None,
) -> tuple[list[attention.Read], int | None]:
    """Where each row's held K/V sit, for a forward feeding ``q`` columns after ``start``, as few reads as
    possible. Leading blocks that several rows hold are read once for all of them (cascade). Each row's first run
    of consecutive blocks is a view of the pool, and when those runs start at evenly spaced slots (the rows of a
    batch prefilled together) one strided view serves every row; other runs of at least ``_MIN_RUN`` blocks are
    views too; what is left of every row (the blocks decode steps add one at a time, interleaved between rows) is
    one gather for the whole batch. A one-token forward reads its own new column from the pool too; a longer one
    attends its new K/V from the arguments, from column ``start`` (the second value). Does not mutate."""
    bs = block_size
    end = start + q if q == 1 else start
    spans = [max(0, end - pad) for pad in pads]
    first = [0] * len(pads)
    reads: list[attention.Read] = []
    by_block: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if spans[i] >= bs and table:
            by_block.setdefault(table[0], []).append(i)
    for members in by_block.values():
        if len(members) < 2:
            continue
        shared = [tables[i] for i in members]
        blocks = 0
        for column in zip(*shared):
            if any(b != column[0] for b in column):
                break
            blocks += 1
        tokens = min(blocks, *(spans[i] // bs for i in members)) * bs  # whole blocks: the rest starts aligned
        if not tokens:
            continue
        for lo, hi, slot in _runs(shared[0], 0, tokens, bs, memo):
            reads.append(attention.Read(tuple(members), tuple(pads[i] + lo for i in members), hi - lo, slot))
        for i in members:
            first[i] = tokens
    rows = [i for i in range(len(pads)) if spans[i] > first[i]]
    runs_of = {i: _runs(tables[i], first[i], spans[i], bs, memo) for i in rows}
    # every row's first run: one strided view when they start at evenly spaced slots
    heads = [runs_of[i][0] for i in rows]
    common = min((hi - lo for lo, hi, _ in heads), default=0)
    steps = {heads[j + 1][2] - heads[j][2] for j in range(len(heads) - 1)}
    if len(rows) > 1 and len(steps) == 1 and min(steps) >= 0 and common >= bs:
        (step,) = steps
        columns = tuple(pads[i] + runs_of[i][0][0] for i in rows)
        reads.append(attention.Read(tuple(rows), columns, common, heads[0][2], row_stride=step))
        for i in rows:
            lo, hi, slot = runs_of[i][0]
            runs_of[i][0] = (lo + common, hi, slot + common)
    scattered: dict[int, list[tuple[int, int, int]]] = {}
    for i in rows:
        pieces = [(lo, hi, slot) for lo, hi, slot in runs_of[i] if hi > lo]
        short = sum(1 for lo, hi, _ in pieces if hi - lo < _MIN_RUN * bs)
        for lo, hi, slot in pieces:
            # in a batch, only long runs are worth a call of their own; a lone row's few short runs (a cached
            # prefix, then its own blocks elsewhere in the pool) are views too: no index tensors, no padding mask
            if hi - lo >= _MIN_RUN * bs or (len(rows) == 1 and short <= _LONE_ROW_VIEWS):
                reads.append(attention.Read((i,), (pads[i] + lo,), hi - lo, slot))
            else:
                scattered.setdefault(i, []).append((lo, hi, slot))
    if scattered:
        reads.append(_gather_read(list(scattered), list(scattered.values()), pads))
    return reads, None if q == 1 else start


def _chunk_end(keys: list[int], chunk: int) -> int:
    """Where the canonical chunks of a prompt row end in an invariant store: after the whole chunks before the
    one that holds its last token (generate's own forward computes that one, rule 2) and before its first token
    the mask hides (a prefill without the row's mask would compute other K/V). Does not mutate."""
    hidden = next((t for t, k in enumerate(keys) if k < 0), len(keys))
    return min(len(keys) - 1, hidden) // chunk * chunk


def check_mask(attention_mask: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """``attention_mask`` as a CPU bool tensor, after checking its shape and that it holds only 0 and 1 (of
    any dtype: a float 0.5 is an error, not padding). Does not mutate."""
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(shape)}, got {got}")
    mask = attention_mask.detach().cpu()
    if mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        bad = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got {bad}")
    return mask.to(torch.bool)


def layout(input_ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[list[int], list[list[int]]]:
    """Each row's leading padding and its keys (:func:`_key`) under ``mask`` (a bool tensor, ``None``: all
    ones). Does not mutate."""
    ids = input_ids.detach().cpu().tolist()
    if mask is None:
        return [0] * len(ids), ids
    pads = (mask.to(torch.long).cumsum(dim=1) == 0).sum(dim=1).tolist()
    visible = mask.tolist()
    return pads, [[_key(t, v) for t, v in zip(row[p:], vis[p:])] for row, vis, p in zip(ids, visible, pads)]


# inputs of a generate call that change the embeddings, so the K/V of the ids (multimodal inputs never reach a
# text-only model's cache)
_EMBEDDING_INPUTS = ("token_type_ids", "mm_token_type_ids")


def _custom_positions(input_ids: torch.Tensor, attention_mask: Any, position_ids: Any) -> str | None:
    """Why a generate call's own ``position_ids`` make construction's reuse wrong (they are not those the mask
    implies: the count of shown tokens before each), or ``None``."""
    if position_ids is None:
        return None
    reason = "position_ids of its own (K/V depend on positions; the cache keys assume the mask's)"
    if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) != tuple(input_ids.shape):
        return reason
    shown = torch.ones(input_ids.shape, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    expected = shown.to(torch.long).cumsum(dim=1) - 1
    return reason if bool(((position_ids.cpu() != expected) & shown).any()) else None


def _token(key: int) -> int:
    """The token id of a key."""
    return key if key >= 0 else -1 - key


def _shown(row: _Row, columns: int) -> list[bool]:
    """The attention mask that the first ``columns`` columns of ``row`` were computed under."""
    pad = min(row.pad, columns)
    assert row.tokens is not None
    return [False] * pad + [k >= 0 for k in row.tokens[: columns - pad]]


def _mask_rows(mask: Any, rows: int, width: int, since: int) -> list[list[bool]] | Literal[False] | None:
    """Columns ``since`` to ``width`` of a forward's 2-D attention mask as lists of bools (``None`` without a
    mask, ``False`` for one this cache cannot read: 4-D, or not ``[rows, width]``). Only the columns asked for
    are read: a decode step reads its new ones, not the whole context."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (rows, width):
        return False
    values = mask[:, since:].detach().cpu()
    if values.dtype != torch.bool and ((values != 0) & (values != 1)).any():
        return False
    rows_list: list[list[bool]] = values.to(torch.bool).tolist()
    return rows_list


def _position_rows(position_ids: Any, rows: int, q: int) -> list[list[int]] | Literal[False] | None:
    """The positions of a forward's ``q`` columns per row (``None`` when the model derives them, ``False`` for
    positions this cache cannot read, such as 3-D rotary sections)."""
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] not in (1, rows):
        return False
    values: list[list[int]] = position_ids[:, -q:].cpu().tolist()
    return values * rows if len(values) == 1 and rows > 1 else values


def _positions_ok(row: _Row, first: int, shown: list[bool], positions: list[list[int]] | None, i: int) -> bool:
    """Whether the shown tokens fed to ``row`` sit at the positions their keys imply: the count of shown tokens
    before each. Without ``position_ids`` the model counts columns, which agrees only without padding or holes."""
    if positions is None:
        return row.pad == 0 and row.real == first and all(shown)
    fed = positions[i][len(positions[i]) - len(shown) :]
    expected = row.real
    for position, visible in zip(fed, shown):
        if visible:
            if position != expected:
                return False
            expected += 1
    return True


def _check_prompt(input_ids: Any, attention_mask: Any) -> tuple[list[int], list[list[int]]]:
    """Validate a prompt batch; return each row's pad count and keys (a mask with holes or right padding
    keys the hidden tokens apart, so their rows reuse and publish only what was computed under that mask)."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
        or input_ids.is_complex()
        or input_ids.dtype == torch.bool
    ):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"input_ids must be a 2-D integer tensor [batch, seq_len] (e.g. tokenizer(..., return_tensors='pt')), "
            f"got {shape}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)})")
    mask = None if attention_mask is None else check_mask(attention_mask, tuple(input_ids.shape))
    if mask is not None and not mask.any(dim=1).all():
        row = int((~mask.any(dim=1)).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask is all padding")
    return layout(input_ids, mask)


@_compat.adapt_cache
class PagedPrefixCache(Cache):
    """A ``transformers`` cache whose KV lives in a :class:`PrefixStore`'s shared blocks.

    Build one per ``generate`` call. With ``input_ids`` (and, for a padded batch, ``attention_mask``)
    each row's longest cached prefix is attached at construction, so ``generate`` only prefills the rest;
    at least the last prompt token is always recomputed. Close it (``close()``, ``with``) to give its
    blocks back; what it computed stays cached in the store for later calls.

    >>> import prefixkv, torch
    >>> model = prefixkv.models.tiny_model("llama")
    >>> store = prefixkv.PrefixStore(model, block_size=4)
    >>> ids = torch.arange(1, 12).unsqueeze(0)
    >>> with prefixkv.PagedPrefixCache(store, ids) as cache:
    ...     out = model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    >>> cache.stats.cached_tokens, cache.stats.computed_tokens
    (0, 11)
    """

    def __init__(
        self,
        store: PrefixStore,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(store, PrefixStore):
            raise TypeError(f"PagedPrefixCache needs a PrefixStore, got {type(store).__name__}")
        self.store = store
        self.block_size = store.block_size
        num_layers = len(store.pool.specs)
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])
        self._rows: list[_Row] = []
        self._length = 0
        self._seen = [0] * num_layers
        # derived per forward, for update(): the slots of the new columns, and which of them to store (None: all;
        # pads are skipped so the null block stays zeros); the whole slot table and the block-aligned table
        # (None: some row's padding is not whole blocks) are built only for a forward that gathers whole rows
        self._new_slots = torch.zeros((0, 0), dtype=torch.long)
        self._keep: torch.Tensor | None = None
        self._slot_table: tuple[tuple[int, int], torch.device, torch.Tensor] | None = None
        # what this forward's attention reads (attention.BlocksForward), and each row table's runs of consecutive
        # block ids, kept between forwards (a table that only grew is re-walked from its last block)
        self._forward: attention.BlocksForward | None = None
        self._runs_memo: dict[int, tuple[list[int], int, list[list[int]]]] = {}
        self._tables_version = 0
        self._block_table: tuple[tuple[int, int], torch.device, torch.Tensor | None] | None = None
        self._owner: int | None = None
        self._guard = threading.Lock()
        self._closed = False
        self._release_pending = False  # closed from another thread mid-forward: that forward releases at its end
        self._stats = CacheStats(0, 0, 0, ())
        self._refeed_pending = False
        # the store's namespace (active adapters) that the reused and published K/V belong to
        self._space: Hashable = store.space()
        # False while the held columns are only what construction reused (a generate call may still redo them)
        self._computed = False
        # whether a forward publishes the blocks it filled (in an invariant store, only the runner's chunk forwards)
        self._publishes = store.chunk_size is None
        # set by the prepare_inputs_for_generation wrapper for a decode step of generate, whose mask only
        # appends ones to the one checked in full at the call's first step
        self.decode_step = False
        store.ensure_open()
        # the prompt rows as given (pads included), to recognise them in the generate call
        self._prompt_ids: list[list[int]] | None = None
        if input_ids is not None:
            pads, keys = _check_prompt(input_ids, attention_mask)
            self._prompt_ids = input_ids.cpu().tolist()
            self.attach_prompt(pads, keys)
        elif attention_mask is not None:
            raise ValueError("attention_mask was given without input_ids")

    # -- construction ----------------------------------------------------------------------------

    def attach_prompt(
        self, pads: list[int], rows: list[list[int]], *, count: bool = True, chunks: bool = False
    ) -> None:
        """Start this cache (built without ``input_ids``) from prompt rows given as keys (token ids; ``-1 - id``
        where a mask hides one) after ``pads`` leading pad columns: match each row, keep the batch to one offset
        (DESIGN.md rule 3), share or copy blocks. Rows that share a prefix the store does not hold yet get it
        computed once, first (in-batch sharing, by the store's runner). With ``count=False`` the lookup stays out
        of the store's statistics (that inner prefill). For prefixkv's own layers (scoring, prefill). Mutates.

        In an invariant store (docs/correctness.md, "Outputs that never depend on the cache") each row first has
        its canonical chunks computed (:func:`_chunk_end`, by the store's runner), reuses exactly those, and this
        cache publishes nothing: every K/V a later call may reuse comes from a canonical chunk forward. With
        ``chunks`` this cache is such a forward's (the runner's): its one row, a whole number of chunks, reuses
        every whole chunk the store holds, and its forwards publish."""
        store, bs, chunk = self.store, self.block_size, self.store.chunk_size
        self._publishes = chunk is None or chunks
        caps = [len(r) - 1 for r in rows]  # one prompt token stays uncached (rule 2)
        held: list[int] | None = None
        offset = 0

        def choose(lengths: list[int]) -> list[int]:
            nonlocal offset
            matched = [min(n, c) for n, c in zip(lengths, caps)]
            if chunk is not None:
                matched = [m // chunk * chunk for m in matched]
            offset = min(p + m for p, m in zip(pads, matched))
            return [max(0, offset - p) for p in pads]

        with contextlib.ExitStack() as prefills:
            if chunk is None:
                prefilled = store.runner.prefill_shared(store, rows) if len(rows) > 1 else []
            elif chunks:
                caps, prefilled = [len(r) for r in rows], []
            else:
                caps, prefilled = [_chunk_end(r, chunk) for r in rows], []
                # what the runner computes stays locked until the rows hold it
                held = prefills.enter_context(store.runner.prefill_chunks(store, [r[:c] for r, c in zip(rows, caps)]))
            claims, reused = store.claim(rows, self._space, choose)
        self._rows = [_Row(p, toks, c, r // bs) for p, toks, c, r in zip(pads, rows, claims, reused)]
        for row, r in zip(self._rows, reused):
            row.real = _real_count(row.tokens[:r] if row.tokens is not None else [])
        self._length = offset
        self._seen = [offset] * len(self._seen)
        self._tables_version += 1
        self._runs_memo.clear()  # a table changed other than at its end
        if held is not None:  # what the canonical prefill computed was computed by this call
            reused = [min(h, r) for h, r in zip(held, reused)]
        # the shared prefill's tokens were computed by this call: charge them to a row that reused them
        for cost, members in prefilled:
            j = max(members, key=lambda i: reused[i])
            reused[j] -= min(cost, reused[j])
        per_row = tuple(RowStats(len(t), r, len(t) - r) for t, r in zip(rows, reused))
        self._stats = CacheStats(
            sum(s.prompt_tokens for s in per_row),
            sum(reused),
            sum(s.computed_tokens for s in per_row),
            per_row,
        )
        if count:
            store.count_query([len(t) for t in rows], reused)

    @property
    def stats(self) -> CacheStats:
        """Prompt tokens reused and computed, per row and in total (fixed at construction)."""
        return self._stats

    def publish_all(self) -> None:
        """Publish every token of this one-row cache, a last part-filled block included (what
        ``PrefixStore.pin`` keeps; a forward publishes whole blocks only). Raises :class:`CacheMisuseError` when
        its K/V could not be proven to be those of its ids. Mutates."""
        (row,) = self._rows
        if row.tokens is None:
            raise CacheMisuseError("the prefill's K/V could not be proven to be those of its ids; nothing pinned")
        bs = self.block_size
        self.store.publish(row.claim, row.tokens, known=row.published * bs, end=len(row.tokens), space=self._space)

    # -- the generate-call protocol (called by the prepare_inputs_for_generation wrapper in patch.py)

    def activate_past_recording(self) -> None:
        """Assisted and prompt-lookup decoding call this before their first forward, which feeds the whole
        sequence again (DESIGN.md rule 7); that forward will then skip the columns already held. Mutates."""
        self._refeed_pending = True

    def plan_call(
        self, input_ids: torch.Tensor, next_sequence_length: int | None, kwargs: dict[str, Any]
    ) -> int | None:
        """At the first forward of a ``generate`` call: make what this cache holds fit the call, and return the
        ``next_sequence_length`` to feed.

        A cache that has computed nothing yet holds only what construction reused; if the call's mask, namespace
        or inputs differ from what that reuse assumed (``generate`` inferred a mask with holes from the pad
        token, an adapter was switched, ``inputs_embeds`` or ``use_cache=False`` were passed), the reuse is
        redone for the call as it is, or dropped. A second call on the same cache must pass the first call's
        output plus new tokens (transformers' "continue generation" pattern); any other sequence would be
        silently attended to the wrong K/V, so it raises :class:`CacheMisuseError`. Mutates."""
        if self._closed:
            raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
        refeed = self._refeed_pending
        self._refeed_pending = False
        if input_ids.dim() != 2:
            return next_sequence_length
        embeds = kwargs.get("inputs_embeds")
        if not self._computed:
            planned = self._replan(input_ids, kwargs.get("attention_mask"), embeds, kwargs.get("use_cache"), kwargs)
            if planned:
                width = embeds.shape[1] if isinstance(embeds, torch.Tensor) else input_ids.shape[1]
                return None if next_sequence_length is None and self._length == 0 else width - self._length
        held = self._length
        if held == 0:
            return next_sequence_length
        width = input_ids.shape[1]
        if next_sequence_length is None and not refeed:
            self._check_new_tokens(width, kwargs.get("attention_mask"), kwargs.get("position_ids"))
            return None
        self._check_continues(input_ids, held)
        if next_sequence_length is not None:
            return next_sequence_length
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            warnings.warn(
                "prefixkv: assisted or prompt-lookup decoding with output_attentions/output_hidden_states "
                "recomputes the whole prompt, so prefix reuse is off for this generate call",
                stacklevel=2,
            )
            self._drop_reuse()
            return None
        return width - held

    def _replan(
        self, input_ids: torch.Tensor, attention_mask: Any, embeds: Any, use_cache: Any, kwargs: dict[str, Any]
    ) -> bool:
        """Before this cache computes anything: redo construction's reuse for the call as it really is. Returns
        whether it changed what the cache holds. Mutates."""
        if not self._rows or all(row.tokens is None for row in self._rows):
            return False
        others = [name for name in _EMBEDDING_INPUTS if kwargs.get(name) is not None]
        embeds_ids = None if isinstance(embeds, torch.Tensor) else input_ids
        why = self._unproven(embeds_ids, use_cache, others, check_space=False)
        # a chunk of a chunked prefill (``prefill_chunk_size``) feeds only its columns after the held ones, so its
        # positions start there: _check_new_tokens checks them, and _prove checks the call's mask and positions
        chunk = self._prompt_ids is not None and input_ids.shape[1] != len(self._prompt_ids[0])
        if why is None and not chunk:
            why = _custom_positions(input_ids, attention_mask, kwargs.get("position_ids"))
        if why is not None:
            had = self._length
            self._drop_reuse()
            for row in self._rows:
                row.tokens = None
            warnings.warn(
                f"prefixkv: {why}: this PagedPrefixCache neither reuses nor publishes cached K/V in this generate call",
                stacklevel=4,
            )
            return had > 0
        rows = len(self._rows)
        if self._prompt_ids is None or input_ids.shape[0] % rows:
            return False
        per = input_ids.shape[0] // rows
        if input_ids[::per].cpu().tolist() != self._prompt_ids:
            return False  # not the prompt this cache was built from: _check_continues says so
        mask = None if attention_mask is None else check_mask(attention_mask, tuple(input_ids.shape))[::per]
        pads, keys = layout(input_ids[::per], mask)
        space = self.store.space()
        if any(not k for k in keys) or (
            space == self._space and all(p == r.pad and k == r.tokens for p, k, r in zip(pads, keys, self._rows))
        ):
            return False
        before = self._stats.per_row
        self._release_rows(self._rows)
        self._rows = []
        self._length = 0
        self._space = space
        self.store.count_query([r.prompt_tokens for r in before], [r.cached_tokens for r in before], undo=True)
        self.attach_prompt(pads, keys)
        return True

    def _check_new_tokens(
        self, width: int, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> None:
        """A call that passes only its new tokens (and chunked prefill) must place them right after the held
        columns: its attention mask spans both, or (once generate dropped an all-ones mask) the position of its
        last token is the last column's. Raise :class:`CacheMisuseError` otherwise."""
        held = self._length
        if attention_mask is not None and attention_mask.dim() == 2:
            if attention_mask.shape[1] != held + width:
                raise CacheMisuseError(
                    f"generate was given {width} new tokens and an attention mask of {attention_mask.shape[1]} "
                    f"columns, but this PagedPrefixCache holds {held}: the mask must span the cached columns and "
                    "the new tokens (or pass the whole sequence: the last output plus new tokens)"
                )
            return
        if position_ids is None or position_ids.dim() != 2 or not self._rows:
            return
        last = position_ids[:, -1].tolist()
        per = max(1, len(last) // len(self._rows))
        for j, position in enumerate(last):
            expected = held + width - 1 - self._rows[min(j // per, len(self._rows) - 1)].pad
            if position != expected:
                raise CacheMisuseError(
                    f"row {j}: generate places its {width} new tokens to end at position {position}, but after the "
                    f"{held} columns this PagedPrefixCache holds they end at {expected}: pass an attention mask "
                    "spanning the cached columns and the new tokens, or the whole sequence"
                )

    def _check_continues(self, input_ids: torch.Tensor, held: int) -> None:
        """Raise :class:`CacheMisuseError` unless every row of ``input_ids`` starts with the tokens this cache
        holds in its first ``held`` columns (rows whose tokens are unknown, from embeddings, are skipped)."""
        width, batch, rows = input_ids.shape[1], input_ids.shape[0], len(self._rows)
        if width <= held:
            raise CacheMisuseError(
                f"generate was called with {width} columns but this PagedPrefixCache already holds {held}: a cache "
                "only continues a longer sequence that starts with what it holds (the output of its last generate "
                "call plus new tokens). Build a new cache for a new prompt (the store still reuses its prefix)"
            )
        if rows == 0:
            return
        if batch % rows:
            raise CacheMisuseError(
                f"this cache holds {rows} rows but generate was called with {batch}; continue with the same batch"
            )
        ids = input_ids[:, :held].cpu().tolist()
        for j, seq in enumerate(ids):
            row = self._rows[j // (batch // rows)]
            if row.tokens is None:
                continue
            stored = [_token(k) for k in row.tokens[: max(0, held - row.pad)]]
            given = seq[min(row.pad, held) :]
            if given[: len(stored)] != stored:
                t = next(t for t, (a, b) in enumerate(zip(given, stored)) if a != b)
                raise CacheMisuseError(
                    f"row {j}: token {t} passed to generate is {given[t]}, but this PagedPrefixCache holds {stored[t]} "
                    "there: a cache only continues the sequence it holds (the output of its last generate call plus "
                    "new tokens). Build a new cache for a new prompt (the store still reuses its prefix)"
                )

    def _drop_reuse(self) -> None:
        """Give back every held column, so the next forward recomputes the sequence from its start. Mutates."""
        self._truncate(0)
        before = self._stats.per_row
        per_row = tuple(RowStats(r.prompt_tokens, 0, r.prompt_tokens) for r in before)
        self._stats = CacheStats(self._stats.prompt_tokens, 0, self._stats.prompt_tokens, per_row)
        # the store counted this lookup's reuse at construction: count it as the miss it has become
        prompts = [r.prompt_tokens for r in before]
        self.store.count_query(prompts, [r.cached_tokens for r in before], undo=True)
        self.store.count_query(prompts, [0] * len(prompts))

    # -- the forward protocol (called by the model hooks in patch.py) ----------------------------

    def begin_forward(
        self,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        others: Sequence[str] = (),
        positions_matter: bool = True,
    ) -> None:
        """Take the ids about to be fed, prove what their K/V will be, and allocate their slots. ``others``
        names the forward's other inputs, which this cache cannot tell the effect of (``token_type_ids``).
        Mutates."""
        me = threading.get_ident()
        with self._guard:
            if self._closed:
                raise CacheMisuseError("this PagedPrefixCache is closed; build a new one for each generate call")
            if self._owner is not None and self._owner != me:
                raise CacheMisuseError(
                    "this PagedPrefixCache is in use by a generate call in another thread; "
                    "give each concurrent call its own cache"
                )
            self._owner = me
        decode_step, self.decode_step = self.decode_step, False
        if self._length != min(self._seen):
            self._truncate(min(self._seen))  # an earlier forward raised half-way: drop its columns
        x = input_ids if input_ids is not None else inputs_embeds
        if x is None:
            raise CacheMisuseError("a forward with a PagedPrefixCache needs input_ids or inputs_embeds")
        batch, q = x.shape[0], x.shape[1]
        if not self._rows:
            self._start_rows(batch, q, input_ids, attention_mask)
        elif batch != len(self._rows):
            if batch % len(self._rows):
                raise CacheMisuseError(
                    f"this cache holds {len(self._rows)} rows but the forward feeds {batch}; "
                    "build the cache from the same batch you pass to generate"
                )
            self._select([i for i in range(len(self._rows)) for _ in range(batch // len(self._rows))])
        start = self._length
        # allocation first: it may raise CapacityError, and the keys _prove records must then not be there yet;
        # if _prove raises, the next forward drops the allocated columns (the `_seen` check above)
        self._allocate(q)
        unproven = self._unproven(input_ids, use_cache, others, check_space=not decode_step)
        if unproven:
            self._forget(range(len(self._rows)))
        else:
            self._prove(
                input_ids,
                start,
                q,
                attention_mask,
                position_ids,
                whole_mask=not decode_step,
                positions_matter=positions_matter,
            )
        self._computed = True
        self._begin_reads(start, q)

    def _begin_reads(self, start: int, q: int) -> None:
        """Tell this thread's attention where the rows' K/V are (:class:`attention.BlocksForward`), on a model that
        runs ``prefixkv`` attention with its pool on a device of ``attention.READ_DEVICES``. Until a forward of that
        model showed every layer handing the K/V from ``update`` to that attention unchanged, ``update`` hands out
        whole rows and the forward only checks it (``probe``); a quantized pool, or one kept in another dtype than
        the model computes in (``PrefixStore(dtype=...)``), is read whole rows at a time too, cast. Mutates."""
        model = self.store.hf_model
        specs = self.store.pool.specs
        if self.store.invariant:
            # the canonical read (docs/correctness.md): every row's K/V gathered whole, in logical order, for
            # the model's own attention, one kernel call over them, however the blocks lie in the pool
            return
        if not attention.serves(model) or any(s.device.type not in attention.READ_DEVICES for s in specs):
            return
        probe = (
            not attention.verified(model)
            or self.store.pool.kv_dtype is not None
            or any(s.dtype != getattr(model, "dtype", s.dtype) for s in specs)
        )
        reads, new_from = (
            ([], None)
            if probe
            else plan_reads(
                [r.pad for r in self._rows], [r.table for r in self._rows], start, q, self.block_size, self._runs_memo
            )
        )
        me = weakref.ref(self)  # no cycle: a failed forward must not keep the cache

        def gather(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            cache = me()
            if cache is None:
                raise CacheMisuseError("the PagedPrefixCache of this forward was garbage-collected")
            return cache._gather(layer, specs[layer].device)

        forward = attention.BlocksForward(self.store.pool, reads, start + q, new_from, gather, probe=probe)
        self._forward = forward
        attention.begin(forward)

    def _start_rows(
        self, batch: int, q: int, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
    ) -> None:
        pads = [0] * batch
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] >= q:
            mask = attention_mask[:, : self._length + q].to(torch.long).cpu()
            pads = (mask.cumsum(dim=1) == 0).sum(dim=1).tolist()
        known = input_ids is not None and self._length == 0
        self._rows = [_Row(p, [] if known else None, c, 0) for p, c in zip(pads, self.store.empty_claims(batch))]
        self._tables_version += 1
        self._runs_memo.clear()  # a table changed other than at its end

    def _prove(
        self,
        input_ids: torch.Tensor | None,
        start: int,
        q: int,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        *,
        whole_mask: bool,
        positions_matter: bool = True,
    ) -> None:
        """The one rule (DESIGN.md rule 11), row by row, for the ``q`` columns a forward feeds once
        :meth:`_unproven` found nothing that rules out every row (embeddings, ``use_cache=False``, other inputs,
        training mode, another namespace). A row keeps its keys and records the new ones only if the forward
        provably computes the K/V of those keys: an attention mask that hides exactly the row's padding and the
        keys' hidden tokens (over every column, or, on a ``generate`` decode step whose mask only grows by ones,
        over the new ones), and, where the model takes ``position_ids`` (``positions_matter``), positions that
        count the shown tokens. A row that fails forgets its keys and never publishes again. Raises
        :class:`CacheMisuseError` where the forward contradicts the row's prompt ids, or its mask or positions
        contradict K/V that construction reused. Mutates."""
        rows = self._rows
        if input_ids is None or all(row.tokens is None for row in rows):
            return
        since = 0 if whole_mask else start  # the mask's columns to read; `new` is where this forward's begin
        new = start - since
        mask = _mask_rows(attention_mask, len(rows), start + q, since)
        positions = _position_rows(position_ids, len(rows), q)
        if mask is False or positions is False:
            self._forget(range(len(rows)))  # a 4-D mask or 3-D positions: nothing this cache can check
            return
        ids = input_ids.cpu().tolist()
        reused = not self._computed and start > 0
        for i, row in enumerate(rows):
            if row.tokens is None:
                continue
            skip = min(q, max(0, row.pad - start))  # new columns that are padding
            first = max(0, start - row.pad)  # token index of the first new real column
            shown = [True] * (q - skip) if mask is None else mask[i][new + skip : new + q]
            keys = [_key(t, v) for t, v in zip(ids[i][skip:], shown)]
            known = row.tokens[first : first + len(keys)]
            if keys[: len(known)] != known:
                if [_token(k) for k in keys[: len(known)]] != [_token(k) for k in known]:
                    raise CacheMisuseError(
                        f"row {i}: the tokens fed at positions {first}..{first + len(keys) - 1} differ from the "
                        "prompt this PagedPrefixCache was built with; build a new cache for a new prompt"
                    )
                self._contradicts_reuse(i, reused, "attention mask")
                self._forget([i])
                continue
            if mask is None:  # the model attends every column: right only with no padding and no holes
                old_ok, pads_hidden = row.pad == 0 and row.real == first, True
            else:
                old = mask[i][:new]  # every held column when whole_mask, else none
                old_ok, pads_hidden = old == _shown(row, len(old)), not any(mask[i][new : new + skip])
            if not old_ok:
                self._contradicts_reuse(i, reused, "attention mask")
            placed = not positions_matter or _positions_ok(row, first, shown, positions, i)
            if not placed:
                self._contradicts_reuse(i, reused, "position layout")
            if not (old_ok and pads_hidden and placed):
                self._forget([i])
                continue
            row.tokens.extend(keys[len(known) :])
            row.real += sum(shown)

    def _unproven(self, input_ids: Any, use_cache: Any, others: Sequence[str], *, check_space: bool) -> str | None:
        """Why no row of this forward can be proven, whatever its mask: embeddings need not be those of the ids
        (a soft prompt); ``use_cache=False`` re-feeds the sequence; inputs such as ``token_type_ids`` change the
        embeddings; dropout in training mode makes K/V random; another adapter or changed weights compute other
        K/V (checked except on ``generate``'s decode steps, which cannot change them). ``None`` if none."""
        if use_cache is False:
            return "use_cache=False"
        if input_ids is None:
            return "inputs_embeds (their K/V need not be those of the ids)"
        if others:
            return f"{', '.join(others)} (inputs whose effect on K/V prefixkv cannot check)"
        if self.store.hf_model.training:
            return "a model in training mode (dropout makes K/V random; call model.eval())"
        if check_space and self.store.space() != self._space:
            return "another adapter or changed weights"
        return None

    def _contradicts_reuse(self, i: int, reused: bool, what: str) -> None:
        if reused:
            raise CacheMisuseError(
                f"row {i}: the {what} of this forward is not the one this PagedPrefixCache was built for, so the "
                f"K/V it reused are not those this forward needs; build the cache with the {what} you pass to "
                "the model (or build it without input_ids)"
            )

    def _forget(self, indices: Any) -> None:
        """The rows ``indices`` stop publishing: their K/V from now on are not provably those of their ids."""
        for i in indices:
            self._rows[i].tokens = None

    def _allocate(self, q: int) -> None:
        """Blocks (and copies of shared part-blocks about to be written) for ``q`` new columns."""
        bs, start = self.block_size, self._length
        sizes = [len(row.table) for row in self._rows]
        spans = [(max(0, start - row.pad), start + q - row.pad) for row in self._rows]
        copied = self.store.extend([row.claim for row in self._rows], spans)
        if copied or any(len(row.table) != n for row, n in zip(self._rows, sizes)):
            self._tables_version += 1
        if q <= 8:  # the decode step: one tensor from plain ints beats a tensor set-up per row
            lists = [_slot_list(row, start, start + q, bs) for row in self._rows]
            new = torch.tensor(lists, dtype=torch.long)
            pads = any(0 in slots for slots in lists)
        else:
            new = torch.stack([_column_slots(row, start, start + q, bs) for row in self._rows])
            pads = bool((new == 0).any())
        self._keep = (new.reshape(-1) != 0).nonzero().view(-1) if pads else None
        self._new_slots = new
        self._length = start + q

    def end_forward(self, ok: bool) -> None:
        """After a forward (``ok``: it returned; a forward that raised publishes nothing): publish the blocks it
        filled, so later calls can reuse them, and carry out a ``close()`` that another thread asked for
        meanwhile. Mutates."""
        if self._owner != threading.get_ident():
            return  # begin_forward refused this forward (the cache is another thread's): nothing of ours ran
        bs = self.block_size
        forward, self._forward = self._forward, None
        if forward is not None:
            attention.end(forward)
            if ok and forward.probe and forward.every_layer_served():
                attention.mark_verified(self.store.hf_model)
        try:
            if not ok or self._closed or not self._publishes:
                return
            for row in self._rows:
                if row.tokens is None:
                    continue
                full = max(0, self._length - row.pad) // bs
                if full > row.published:
                    known = row.published * bs  # on the path of the row's trie node: publish continues from it
                    if self.store.publish(row.claim, row.tokens, known=known, end=full * bs, space=self._space):
                        self._tables_version += 1  # the row now reads blocks the trie held those tokens in
                        self._runs_memo.clear()
                    row.published = full
        finally:
            with self._guard:
                self._owner = None
                release, self._release_pending = self._release_pending, False
            if release:
                self._release()

    # -- transformers Cache interface ------------------------------------------------------------

    @attention.outside_compile
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (``[B, kv_heads, q, head_dim]``) into their slots and return the layer's
        whole K/V read from the blocks, ``[B, kv_heads, columns, head_dim]``."""
        if self._owner != threading.get_ident():
            raise CacheMisuseError(
                "PagedPrefixCache.update was called outside a forward of the model its PrefixStore was built "
                "for (or after the store was closed); pass the cache to that model"
            )
        if self._closed:
            raise CacheMisuseError(
                "this PagedPrefixCache was closed during the forward (close() from another thread cancels the "
                "generate call using it); its blocks are given back when the forward ends"
            )
        specs = self.store.pool.specs
        if layer_idx >= len(specs):
            raise CacheMisuseError(f"layer {layer_idx} does not exist in a store built for {len(specs)} layers")
        spec = specs[layer_idx]
        if key_states.shape[1] != spec.kv_heads or key_states.shape[-1] != spec.head_dim:
            raise CacheMisuseError(
                f"layer {layer_idx} gives K of {key_states.shape[1]} heads x {key_states.shape[-1]}, but the store "
                f"was built for {spec.kv_heads} x {spec.head_dim}: this cache's store belongs to another model"
            )
        if key_states.device != spec.device or key_states.dtype != self.store.model_dtype:
            raise CacheMisuseError(
                f"layer {layer_idx} now computes in {key_states.dtype} on {key_states.device}, but the store was "
                f"built for {self.store.model_dtype} on {spec.device}: the model was moved or cast after the "
                "PrefixStore was built; build a new store"
            )
        seen, q = self._seen[layer_idx], key_states.shape[-2]
        if seen + q != self._length:
            raise CacheMisuseError(
                f"layer {layer_idx} got {q} new tokens but this forward allocated {self._length - seen}"
            )
        device = key_states.device
        keep = None if self._keep is None else self._keep.to(device)
        forward = self._forward
        self.store.write(layer_idx, self._new_slots.to(device), key_states, value_states, keep)
        self._seen[layer_idx] = self._length
        if forward is not None and not forward.probe:
            # the attention reads the held K/V where they are (attention.blocks_attention)
            forward.hand_out(layer_idx, key_states)
            return key_states, value_states
        keys, values = self._gather(layer_idx, device)
        if keys.dtype != key_states.dtype:
            keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
        if forward is not None:
            forward.hand_out(layer_idx, keys)
        return keys, values

    def _gather(self, layer_idx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's whole K/V of ``layer_idx``, ``[B, kv_heads, columns, head_dim]``, copied out of the pool (the
        path of models whose attention does not read the blocks). Does not mutate."""
        table = self._block_table_on(device)
        if table is not None:
            return self.store.gather(layer_idx, table=table, length=self._length)
        return self.store.gather(layer_idx, slots=self._slots_on(device))

    def _block_table_on(self, device: torch.device) -> torch.Tensor | None:
        """``[B, C]`` block ids such that column ``c`` of row ``i`` sits in block ``[i, c // block_size]`` at
        offset ``c % block_size`` (leading whole blocks of padding read the null block), or ``None`` when some
        row's padding is not a whole number of blocks. Rebuilt only when a table changed."""
        cached = self._block_table
        bs = self.block_size
        chunks = -(-self._length // bs)
        if cached is not None and cached[0] == (self._tables_version, chunks) and cached[1] == device:
            return cached[2]
        table: torch.Tensor | None = None
        if self._rows and all(row.pad % bs == 0 for row in self._rows):
            lists = [[0] * (row.pad // bs) + row.table for row in self._rows]
            table = torch.tensor([t[:chunks] + [0] * (chunks - len(t)) for t in lists], dtype=torch.long, device=device)
        self._block_table = ((self._tables_version, chunks), device, table)
        return table

    def _slots_on(self, device: torch.device) -> torch.Tensor:
        """``[B, columns]`` pool slots of every column (pads read the null block), rebuilt when a table changed."""
        key = (self._tables_version, self._length)
        cached = self._slot_table
        if cached is not None and cached[0] == key and cached[1] == device:
            return cached[2]
        bs = self.block_size
        slots = torch.stack([_column_slots(row, 0, self._length, bs) for row in self._rows]).to(device)
        self._slot_table = (key, device, slots)
        return slots

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns stored for ``layer_idx`` (pads included), a Python int."""
        return self._seen[layer_idx] if layer_idx < len(self._seen) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``, sharing its blocks. Mutates."""
        self._select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select([i for i in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices.tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (a negative int, as in ``DynamicCache``). Mutates."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove:
            self._truncate(max(0, self._length + tokens_to_remove))

    def reset(self) -> None:
        """Give every block back and forget the rows; the cache can start a new sequence. Mutates."""
        self._release_rows(self._rows)
        self._rows = []
        self._length = 0
        self._seen = [0] * len(self._seen)
        self._tables_version += 1
        self._runs_memo.clear()  # a table changed other than at its end

    # -- row surgery -----------------------------------------------------------------------------

    def _select(self, indices: list[int]) -> None:
        if indices == list(range(len(self._rows))):
            return
        claims = self.store.fork([self._rows[j].claim for j in indices])
        rows = [self._rows[j].clone(c) for j, c in zip(indices, claims)]
        self._release_rows(self._rows)
        self._rows = rows
        self._tables_version += 1
        self._runs_memo.clear()  # a table changed other than at its end

    def _truncate(self, length: int) -> None:
        bs = self.block_size
        keeps = [max(0, length - row.pad) for row in self._rows]
        self.store.truncate([row.claim for row in self._rows], [-(-keep // bs) for keep in keeps])
        for row, keep in zip(self._rows, keeps):
            row.published = min(row.published, keep // bs)
            if row.tokens is not None:
                del row.tokens[max(keep, row.prompt_len) :]
                row.real = _real_count(row.tokens[:keep])
        self._length = length
        self._seen = [length] * len(self._seen)
        self._tables_version += 1
        self._runs_memo.clear()  # a table changed other than at its end

    def _release_rows(self, rows: list[_Row]) -> None:
        self.store.release([row.claim for row in rows])

    def _held_blocks(self) -> Counter[int]:
        return Counter(b for row in self._rows for b in row.table)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Give the blocks back to the store (what was published stays cached). Idempotent.

        Called from another thread while a forward uses this cache (a cancel), it stops that forward at its
        next layer and the blocks are given back when the forward ends, never while it may still write."""
        with self._guard:
            if self._closed:
                return
            self._closed = True
            if self._owner is not None and self._owner != threading.get_ident():
                self._release_pending = True
                return
        self._release()

    def _release(self) -> None:
        self._release_rows(self._rows)
        self._rows = []

    def __enter__(self) -> PagedPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # at interpreter shutdown, or for a half-built cache, there may be nothing left to give back to; a cache
        # nobody references has no forward running, so a release still pending happens here. A plain try: at
        # shutdown this module's globals (contextlib among them) may already be None
        try:
            if self._release_pending:
                self._release_pending = False
                self._release()
            else:
                self.close()
        except Exception:  # a finalizer must not raise, and has no one to report to
            pass

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedPrefixCache:
        """A second cache holding the same columns, sharing their blocks (copy-on-write), on the same store:
        transformers' recipe of copying a prompt's cache for each continuation, without copying K/V."""
        if self._closed:
            raise CacheMisuseError("this PagedPrefixCache is closed; there is nothing to copy")
        if self._owner is not None:
            raise CacheMisuseError("a PagedPrefixCache cannot be copied while a forward uses it")
        other = PagedPrefixCache(self.store)
        claims = self.store.fork([row.claim for row in self._rows])
        other._rows = [row.clone(c) for row, c in zip(self._rows, claims)]
        other._length, other._seen = self._length, list(self._seen)
        other._stats, other._space, other._computed = self._stats, self._space, self._computed
        other._prompt_ids = self._prompt_ids
        other._publishes = self._publishes
        return other

    @property
    def closed(self) -> bool:
        """Whether the cache gave its blocks back (``close()``). Does not mutate."""
        return self._closed

    def block_tables(self) -> list[display.RowTable]:
        """Each row's leading padding, block table, and which of its blocks something else holds too (the
        trie, another row, another cache); empty once closed. Does not mutate."""
        rows = list(self._rows)
        views = self.store.table_view([row.claim for row in rows])
        return [display.RowTable(row.pad, v.blocks, v.shared) for row, v in zip(rows, views)]

    def __repr__(self) -> str:
        s = self._stats
        state = "closed" if self._closed else f"{len(self._rows)} rows x {self._length} columns"
        return (
            f"PagedPrefixCache({state}, prompt_tokens={s.prompt_tokens}, cached_tokens={s.cached_tokens}, "
            f"computed_tokens={s.computed_tokens})"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: reused and computed prompt tokens per row, and each row's block table."""
        return display.cache_html(self)
