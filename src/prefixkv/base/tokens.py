"""Token ids, on the ground floor: one sequence of ids as plain ints (:func:`as_token_list`), how many two sequences
start with in common (:func:`common_length`), and the trie key of a token (:func:`key`: its id, or ``-1 - id``
where the attention mask hides it) with its way back (:func:`token`, :func:`token_ids`), and the keys of an image's
placeholder tokens (:func:`image_key`, a range of their own: a token's key never equals one). The one home of each;
nothing here mutates, and nothing here knows a model, a cache or a store."""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

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


IMAGE_KEYS = 2**62
"""Where the keys of image placeholders begin (:func:`image_key`); every key stays below ``2**63`` (an int64 in
files)."""
_TOKEN_BITS = 20  # a placeholder's token id, in an image key's low bits (vocabularies stay below 2**20)
_HASH_BITS = 42
_TOKEN_MASK = (1 << _TOKEN_BITS) - 1


def image_key(digest: bytes, index: int, token_id: int) -> int:
    """The trie key of the ``index``-th placeholder token ``token_id`` of an image whose processed inputs have
    ``digest`` (:func:`prefixkv.base.images.digest`): 42 bits drawn from the digest and the index, so two images differ
    at every placeholder, above :data:`IMAGE_KEYS`, with the token id in the low bits (:func:`token` gives it back).

    >>> k = image_key(b"one image", 0, 250)
    >>> k >= IMAGE_KEYS, token(k), k == image_key(b"another", 0, 250)
    (True, 250, False)
    """
    if not 0 <= token_id <= _TOKEN_MASK:
        raise ValueError(f"an image placeholder's token id must be at most {_TOKEN_MASK}, got {token_id}")
    drawn = hashlib.blake2b(digest + index.to_bytes(8, "little"), digest_size=8).digest()
    bits: int = int.from_bytes(drawn, "little") >> (64 - _HASH_BITS)
    return IMAGE_KEYS + (bits << _TOKEN_BITS) + token_id


def is_image_key(key: int) -> bool:
    """Whether ``key`` is an image placeholder's (:func:`image_key`)."""
    return key >= IMAGE_KEYS


def token(key: int) -> int:
    """The token id of a trie key (:func:`key`, :func:`image_key`): a hidden token's text is still that token's, an
    image's placeholder is its placeholder id."""
    if key >= IMAGE_KEYS:
        return key & _TOKEN_MASK
    return key if key >= 0 else -1 - key


def token_ids(keys: Sequence[int]) -> list[int]:
    """The token ids of trie keys (:func:`token` of each)."""
    return [token(k) for k in keys]


def relabel(fed: Sequence[int], known: Sequence[int]) -> list[int]:
    """The keys of a forward's ``fed`` tokens (:func:`key` of each) with an image's key wherever the row's ``known``
    key there is one of the same placeholder token: the ids alone cannot say which image a placeholder is, the row's
    keys (built with the images, prefixkv/hf/vision.py) do.

    >>> k = image_key(b"an image", 0, 250)
    >>> relabel([5, 250, 7], [5, k]) == [5, k, 7]
    True
    """
    return [
        k if i >= len(known) or known[i] < IMAGE_KEYS or k < 0 or token(known[i]) != k else known[i]
        for i, k in enumerate(fed)
    ]


def inferred_mask(ids: torch.Tensor, setting: Callable[[str], Any]) -> torch.Tensor | None:
    """The attention mask ``generate`` infers when none is passed: the pad token's places, if the pad token
    occurs and is not an end-of-sequence token (SmolLM2's chat prompts hold it), else none."""
    pad = setting("pad_token_id")
    if pad is None or not bool((ids == pad).any()):
        return None
    eos = setting("eos_token_id")
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return None if int(pad) in eos_ids else ids != pad


# what a chat template is asked to write, to find the token it ends each message with (message_ends)
_PROBES = ("prefixkv probe of a system message", "prefixkv probe of a question", "prefixkv probe of an answer")


def message_ends(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens that end a message for ``tokenizer`` (or a processor holding one): its end-of-sequence
    token, and each special token its chat template writes right after a message's content, with nothing but white
    space before it (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, Mistral's ``[/INST]``). Read from the
    template's output for a probe conversation (system, user, assistant; user and assistant where the template
    refuses a system message), never from names. Empty for a tokenizer with neither. Does not mutate.

    >>> message_ends(object())
    frozenset()
    """
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
    ends: set[int] = set()
    eos = getattr(text_tokenizer, "eos_token_id", None)
    ends.update(e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int))
    special: dict[str, int] = {}
    for id_, added in (getattr(text_tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special[str(added)] = int(id_)
    names, ids = getattr(text_tokenizer, "all_special_tokens", ()), getattr(text_tokenizer, "all_special_ids", ())
    special.update((name, int(id_)) for name, id_ in zip(names, ids) if name)
    text = _probe_conversation(tokenizer)
    for probe in _PROBES:
        at = text.find(probe)
        if at < 0:
            continue
        rest = text[at + len(probe) :]
        found = [(rest.find(name), -len(name), name) for name in special if name in rest]
        if found:
            where, _, name = min(found)  # the earliest, the longest of those there
            if not rest[:where].strip():
                ends.add(special[name])
    return frozenset(ends)


def _probe_conversation(tokenizer: Any) -> str:
    """The text ``tokenizer``'s chat template writes for a conversation of :data:`_PROBES` (``""``: it has none)."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)) or not getattr(tokenizer, "chat_template", None):
        return ""
    messages = [{"role": r, "content": c} for r, c in zip(("system", "user", "assistant"), _PROBES)]
    for conversation in (messages, messages[1:]):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
        except Exception:  # a template that refuses this conversation (raise_exception: no system role)
            continue
        if isinstance(text, str):
            return text
    return ""
