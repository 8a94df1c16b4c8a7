"""What an image is, to the trie: a digest of its processed inputs (:func:`digest`), from which its placeholder
tokens take their keys (:func:`prefixkv.base.tokens.image_key`; :func:`prefixkv.base.tokens.relabel`, how a
forward's fed ids take them). It reads tensors (their bytes, shape and dtype), never a config; nothing here mutates."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import torch


def digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A digest of one image's processed inputs by name (its part of ``pixel_values``, its ``image_grid_thw``,
    ``image_sizes``, masks, its placeholders' token types, the keywords that change its encoding): every name, dtype,
    shape and byte, so the same image processed and encoded alike has the same digest and anything else another.

    >>> a = {"pixel_values": torch.zeros(2, 3)}
    >>> same, other = {"pixel_values": torch.zeros(2, 3)}, {"pixel_values": torch.zeros(3, 2)}
    >>> digest(a) == digest(same), digest(a) == digest(other)
    (True, False)
    """
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def unknown() -> bytes:
    """A digest no image has: that of an image the cache was not given, whose placeholders then match nothing."""
    return os.urandom(32)
