"""The KV tensors: per attention layer, K and V as ``[num_blocks, block_size, kv_heads, head_dim]``.

No trie and no transformers here: the pool writes and reads *slots* (``block * block_size + offset``)
that the cache computes. Each layer's tensors live on that layer's device, in the pool's dtype. The pool
starts small and grows (a copy, amortised by doubling) up to whatever capacity the store allows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            pad = torch.zeros((extra, *k.shape[1:]), device=k.device, dtype=k.dtype)
            self.keys[i] = torch.cat([k, pad])
            self.values[i] = torch.cat([v, pad])

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new K/V. ``slots``: ``[B, q]``; ``key``/``value``: ``[B, kv_heads, q, head_dim]``. Mutates."""
        k, v = self.keys[layer], self.values[layer]
        flat = slots.reshape(-1)
        # [B, H, q, D] -> [B*q, H, D]
        k.view(-1, *k.shape[2:]).index_copy_(0, flat, key.transpose(1, 2).reshape(-1, *k.shape[2:]).to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, flat, value.transpose(1, 2).reshape(-1, *v.shape[2:]).to(v.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. ``slots``: ``[B, L]`` -> two ``[B, kv_heads, L, head_dim]`` tensors."""
        k, v = self.keys[layer], self.values[layer]
        b, n = slots.shape
        flat = slots.reshape(-1)
        keys = k.view(-1, *k.shape[2:]).index_select(0, flat).view(b, n, *k.shape[2:]).transpose(1, 2)
        values = v.view(-1, *v.shape[2:]).index_select(0, flat).view(b, n, *v.shape[2:]).transpose(1, 2)
        return keys, values

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` in every layer. Mutates."""
        for k, v in zip(self.keys, self.values):
            k[dst, :n] = k[src, :n]
            v[dst, :n] = v[src, :n]
