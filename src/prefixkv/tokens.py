"""Token ids, on the ground floor: one sequence of ids as plain ints (:func:`as_token_list`), how many two sequences
start with in common (:func:`common_length`), and the trie key of a token (:func:`key`: its id, or ``-1 - id``
where the attention mask hides it) with its way back (:func:`token`, :func:`token_ids`). The one home of each;
nothing here mutates, and nothing here knows a model, a cache or a store."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


def as_token_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    """One sequence of token ids as ints; ``ValueError`` for anything else (floats are not truncated).

    >>> as_token_list(torch.tensor([[5, 6, 7]]))
    [5, 6, 7]
    """
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


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` start with in common.

    >>> common_length([5, 6, 7], [5, 6, 9, 9])
    2
    """
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def key(token: int, visible: bool) -> int:
    """The trie key of a token: its id, or ``-1 - id`` where the attention mask hides it (its K/V differ from
    those of the same token seen).

    >>> key(7, True), key(7, False), key(0, False)
    (7, -8, -1)
    """
    return token if visible else -1 - token


def token(key: int) -> int:
    """The token id of a trie key (:func:`key`): a hidden token's text is still that token's."""
    return key if key >= 0 else -1 - key


def token_ids(keys: Sequence[int]) -> list[int]:
    """The token ids of trie keys (:func:`token` of each)."""
    return [token(k) for k in keys]
