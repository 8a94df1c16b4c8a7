"""The KV tensors: per attention layer, K and V as ``[num_blocks, block_size, kv_heads, head_dim]``.

No trie and no transformers here: the pool writes and reads *slots* (``block * block_size + offset``)
that the cache computes. Each layer's tensors live on that layer's device, in the pool's dtype. The pool
starts small and grows (a copy, amortised by doubling) up to whatever capacity the store allows.

Users call ``generate`` under ``torch.inference_mode()`` and ``torch.no_grad()`` alike (DESIGN.md rule 12). A
tensor made inside ``inference_mode`` is an inference tensor, which refuses in-place writes outside it; so
the pool's tensors are always made as normal tensors (:func:`_normal_tensors`), which accept writes in both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch


@contextlib.contextmanager
def _normal_tensors() -> Iterator[None]:
    """Make normal (not inference) tensors without autograd history, whatever mode the caller is in."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class LayerSpec(NamedTuple):
    """Where and how one attention layer's KV is kept."""

    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype


class BlockPool:
    """K/V storage for every layer, addressed by slot index.

    >>> spec = LayerSpec(2, 4, torch.device("cpu"), torch.float32)
    >>> pool = BlockPool([spec], block_size=16, capacity=3)
    >>> pool.keys[0].shape
    torch.Size([3, 16, 2, 4])
    """

    def __init__(self, layers: list[LayerSpec], block_size: int, capacity: int) -> None:
        self.specs = layers
        self.block_size = block_size
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        with _normal_tensors():
            self._allocate(layers, block_size, capacity)

    def _allocate(self, layers: list[LayerSpec], block_size: int, capacity: int) -> None:
        for s in layers:
            shape = (capacity, block_size, s.kv_heads, s.head_dim)
            # zeros, not empty: the null block stands in for padding and must hold finite values
            self.keys.append(torch.zeros(shape, device=s.device, dtype=s.dtype))
            self.values.append(torch.zeros(shape, device=s.device, dtype=s.dtype))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers."""
        return sum(
            2 * self.block_size * s.kv_heads * s.head_dim * torch.empty((), dtype=s.dtype).element_size()
            for s in self.specs
        )

    def grow(self, capacity: int) -> None:
        """Enlarge every layer to ``capacity`` blocks, keeping the contents. Mutates."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        with _normal_tensors():
            keys, values = [], []
            for k, v in zip(self.keys, self.values):
                pad = torch.zeros((extra, *k.shape[1:]), device=k.device, dtype=k.dtype)
                keys.append(torch.cat([k, pad]))
                values.append(torch.cat([v, pad]))
        self.keys, self.values = keys, values  # all layers at once: a failure half-way leaves the old pool

    @torch.no_grad()
    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        """Store new K/V. ``slots``: ``[B, q]``; ``key``/``value``: ``[B, kv_heads, q, head_dim]``; ``keep``:
        the positions (in ``B * q`` order) to store, ``None`` for all (padding is never stored). Mutates."""
        k, v = self.keys[layer], self.values[layer]
        flat = slots.reshape(-1)
        # [B, H, q, D] -> [B*q, H, D]
        new_k = key.transpose(1, 2).reshape(-1, *k.shape[2:])
        new_v = value.transpose(1, 2).reshape(-1, *v.shape[2:])
        if keep is not None:
            flat, new_k, new_v = flat[keep], new_k[keep], new_v[keep]
        k.view(-1, *k.shape[2:]).index_copy_(0, flat, new_k.to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, flat, new_v.to(v.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. ``slots``: ``[B, L]`` -> two ``[B, kv_heads, L, head_dim]`` tensors."""
        k, v = self.keys[layer], self.values[layer]
        b, n = slots.shape
        flat = slots.reshape(-1)
        keys = k.view(-1, *k.shape[2:]).index_select(0, flat).view(b, n, *k.shape[2:]).transpose(1, 2)
        values = v.view(-1, *v.shape[2:]).index_select(0, flat).view(b, n, *v.shape[2:]).transpose(1, 2)
        return keys, values

    def gather_blocks(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``length`` columns when column ``c`` sits in block ``table[:, c // block_size]`` at
        offset ``c % block_size``: whole blocks are copied, a ``block_size`` times shorter index than
        :meth:`gather`. ``table``: ``[B, C]`` -> two ``[B, kv_heads, length, head_dim]`` tensors."""
        k, v = self.keys[layer], self.values[layer]
        b, c = table.shape
        flat = table.reshape(-1)
        keys = k.index_select(0, flat).view(b, c * self.block_size, *k.shape[2:])[:, :length].transpose(1, 2)
        values = v.index_select(0, flat).view(b, c * self.block_size, *v.shape[2:])[:, :length].transpose(1, 2)
        return keys, values

    @torch.no_grad()
    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` in every layer. Mutates."""
        for k, v in zip(self.keys, self.values):
            k[dst, :n] = k[src, :n]
            v[dst, :n] = v[src, :n]

    def read_blocks(self, blocks: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of whole blocks on the CPU, per layer ``[len(blocks), block_size, kv_heads, head_dim]``."""
        keys, values = [], []
        for k, v in zip(self.keys, self.values):
            index = torch.tensor(blocks, dtype=torch.long, device=k.device)
            keys.append(k.index_select(0, index).cpu())
            values.append(v.index_select(0, index).cpu())
        return keys, values

    @torch.no_grad()
    def write_blocks(self, blocks: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill whole blocks of every layer from ``[len(blocks), block_size, kv_heads, head_dim]`` tensors,
        moved to each layer's device and dtype. Mutates."""
        for k, v, new_k, new_v in zip(self.keys, self.values, keys, values):
            index = torch.tensor(blocks, dtype=torch.long, device=k.device)
            k.index_copy_(0, index, new_k.to(device=k.device, dtype=k.dtype))
            v.index_copy_(0, index, new_v.to(device=v.device, dtype=v.dtype))
