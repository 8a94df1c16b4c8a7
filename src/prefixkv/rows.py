"""A row of a ``PagedPrefixCache``: its leading padding, the keys its K/V are cached under, whether those K/V are
proven to be the keys' (docs/correctness.md, "Publish only what is proven"), its claim in the store, and the slot
arithmetic of its columns.

Layout. Every row of a batch has the same number of *columns* (pads included). Row ``i`` has ``pad`` leading
padding columns that read the null block, then its tokens: token ``t`` sits at column ``pad + t`` and in slot
``table[t // block_size] * block_size + t % block_size``. One block id indexes every layer's pool, so a row has one
table for all layers.

Keys. A row's ``keys`` are the token ids where the attention mask is 1, and ``-1 - id`` where a mask with holes
hides a token (a hole shifts the positions after it, so the K/V that follow are not those of the unmasked ids).
Leading padding is not part of a row."""

from __future__ import annotations

from typing import Any

import torch

from .blocks import Claim
from .reads import column_slots


class Row:
    """One batch row: leading pad columns, its keys and whether they are ``proven`` (an unproven row has no keys
    and never publishes again), the prompt's length among them, its claim in the store (block table and the trie
    node it keeps locked), its blocks already in the trie, and ``real``: the shown tokens among its stored columns
    (the position of its next shown token)."""

    __slots__ = ("claim", "keys", "pad", "prompt_len", "proven", "published", "real")

    def __init__(self, pad: int, keys: list[int] | None, claim: Claim, published: int) -> None:
        self.pad = pad
        self.proven = keys is not None
        self.keys: list[int] = [] if keys is None else keys
        self.prompt_len = len(self.keys)
        self.claim = claim
        self.published = published
        self.real = 0

    @property
    def table(self) -> list[int]:
        """The row's block table: its claim's, which only the store changes."""
        return self.claim.table

    def forget(self) -> None:
        """From now on the row's K/V are not provably those of its ids: it drops its keys and never publishes
        again. Mutates."""
        self.proven = False
        self.keys = []

    def clone(self, claim: Claim) -> Row:
        """This row holding ``claim`` (a fork of its own)."""
        row = Row(self.pad, list(self.keys) if self.proven else None, claim, self.published)
        row.prompt_len = self.prompt_len
        row.real = self.real
        return row

    def truncate(self, keep: int, block_size: int) -> None:
        """Keep the first ``keep`` tokens (the prompt's keys stay: a later call re-feeds them). Mutates."""
        self.published = min(self.published, keep // block_size)
        if self.proven:
            del self.keys[max(keep, self.prompt_len) :]
            self.real = real_count(self.keys[:keep])


def key(token: int, visible: bool) -> int:
    """The trie key of a token: its id, or ``-1 - id`` where the attention mask hides it."""
    return token if visible else -1 - token


def token(key: int) -> int:
    """The token id of a key."""
    return key if key >= 0 else -1 - key


def real_count(keys: list[int]) -> int:
    """How many of ``keys`` the mask shows (the position of the next shown token)."""
    return sum(1 for k in keys if k >= 0)


def slot_list(row: Row, start: int, stop: int, block_size: int) -> list[int]:
    """Pool slots of columns ``[start, stop)`` of ``row`` as plain ints (for a few columns); pad columns read
    slot 0 (the null block)."""
    table, pad = row.table, row.pad
    return [
        0 if c < pad else table[(c - pad) // block_size] * block_size + (c - pad) % block_size
        for c in range(start, stop)
    ]


def new_slots(rows: list[Row], start: int, q: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, q]`` pool slots of the columns a forward feeds after ``start``, and which of them (flat indices) to
    store (``None``: all; pads are skipped so the null block stays zeros). Does not mutate."""
    if q <= 8:  # the decode step: one tensor from plain ints beats a tensor set-up per row
        lists = [slot_list(row, start, start + q, block_size) for row in rows]
        new = torch.tensor(lists, dtype=torch.long)
        pads = any(0 in slots for slots in lists)
    else:
        new = torch.stack([column_slots(row.pad, row.table, start, start + q, block_size) for row in rows])
        pads = bool((new == 0).any())
    return new, (new.reshape(-1) != 0).nonzero().view(-1) if pads else None


def chunk_end(keys: list[int], chunk: int) -> int:
    """Where the canonical chunks of a prompt row end in an invariant store: after the whole chunks before the
    one that holds its last token (generate's own forward computes that one) and before its first token the mask
    hides (a prefill without the row's mask would compute other K/V). Does not mutate."""
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
    """Each row's leading padding and its keys (:func:`key`) under ``mask`` (a bool tensor, ``None``: all
    ones). Does not mutate."""
    ids = input_ids.detach().cpu().tolist()
    if mask is None:
        return [0] * len(ids), ids
    pads = (mask.to(torch.long).cumsum(dim=1) == 0).sum(dim=1).tolist()
    visible = mask.tolist()
    return pads, [[key(t, v) for t, v in zip(row[p:], vis[p:])] for row, vis, p in zip(ids, visible, pads)]


def check_prompt(input_ids: Any, attention_mask: Any) -> tuple[list[int], list[list[int]]]:
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
