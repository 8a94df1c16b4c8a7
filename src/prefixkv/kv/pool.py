"""The KV tensors: per attention layer, K and V as ``[kv_heads, num_blocks, block_size, head_dim]``.

Head-major: the slots of one head are contiguous across blocks, so the K/V of a run of consecutive blocks is a
view ``[kv_heads, tokens, head_dim]`` whose every head is one contiguous range, which attention reads as fast as
a contiguous tensor (the block-major layout reads about twice as slowly on CPU). Whole blocks leave the pool
(:meth:`BlockPool.read_blocks`, persistence, the second tier) in block-major form, ``[n, block_size, kv_heads,
head_dim]``.

No trie and no transformers here: the pool writes and reads *slots* (``block * block_size + offset``)
that the cache computes. Each layer's tensors live on that layer's device, in the pool's dtype. The pool
starts small and grows (a copy, amortised by doubling) up to whatever capacity the store allows.

Users call ``generate`` under ``torch.inference_mode()`` and ``torch.no_grad()`` alike (docs/correctness.md,
"Releasing caches"). A
tensor made inside ``inference_mode`` is an inference tensor, which refuses in-place writes outside it; so
the pool's tensors are always made as normal tensors (:func:`_normal_tensors`), which accept writes in both.

Quantized storage (``kv_dtype="int8"`` or ``"fp8"``): codes and one scale per token and KV head beside them
(:mod:`prefixkv.kv.quantization`, which holds the math); reads dequantize only the gathered slots, into the pool's
``dtype``; the full-precision cache never exists as a whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..slots import slot_view
from .quantization import SCALE_DTYPE, check_kv_dtype, code_dtype, dequantize, quantize


@contextlib.contextmanager
def _normal_tensors() -> Iterator[None]:
    """Make normal (not inference) tensors without autograd history, whatever mode the caller is in."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class LayerSpec(NamedTuple):
    """Where and how one attention layer's KV is kept (``dtype``: what reads return)."""

    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype


def block_bytes(specs: list[LayerSpec], block_size: int, kv_dtype: str | None = None) -> int:
    """K and V bytes of one block across all layers, scales included.

    >>> spec = LayerSpec(2, 64, torch.device("cpu"), torch.float32)
    >>> block_bytes([spec], 16), block_bytes([spec], 16, "int8")
    (16384, 4224)
    """
    total = 0
    for s in specs:
        if kv_dtype is None:
            total += 2 * block_size * s.kv_heads * s.head_dim * s.dtype.itemsize
        else:  # 1-byte codes and a scale per token and head
            total += 2 * block_size * s.kv_heads * (s.head_dim + SCALE_DTYPE.itemsize)
    return total


class BlockPool:
    """K/V storage for every layer, addressed by slot index.

    >>> spec = LayerSpec(2, 4, torch.device("cpu"), torch.float32)
    >>> pool = BlockPool([spec], block_size=16, capacity=3)
    >>> pool.keys[0].shape
    torch.Size([2, 3, 16, 4])
    """

    def __init__(self, layers: list[LayerSpec], block_size: int, capacity: int, kv_dtype: str | None = None) -> None:
        check_kv_dtype(kv_dtype)
        self.specs = layers
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # quantized pools only: per layer ``[kv_heads, num_blocks, block_size]`` scales of K and of V
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        with _normal_tensors():
            self._allocate(layers, block_size, capacity, kv_dtype)

    def _allocate(self, layers: list[LayerSpec], block_size: int, capacity: int, kv_dtype: str | None) -> None:
        for s in layers:
            shape = (s.kv_heads, capacity, block_size, s.head_dim)
            store = s.dtype if kv_dtype is None else code_dtype(kv_dtype)
            # zeros, not empty: the null block stands in for padding and must hold finite values
            self.keys.append(torch.zeros(shape, device=s.device, dtype=store))
            self.values.append(torch.zeros(shape, device=s.device, dtype=store))
            if kv_dtype is not None:
                for scales in (self.key_scales, self.value_scales):
                    scales.append(torch.zeros(shape[:3], device=s.device, dtype=SCALE_DTYPE))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers, scales included."""
        return block_bytes(self.specs, self.block_size, self.kv_dtype)

    def grow(self, capacity: int) -> None:
        """Enlarge every layer to ``capacity`` blocks, keeping the contents. Mutates."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        with _normal_tensors():
            grown = [
                [_grown(t, extra) for t in tensors]
                for tensors in (self.keys, self.values, self.key_scales, self.value_scales)
            ]
        # all layers at once: a failure half-way leaves the old pool
        self.keys, self.values, self.key_scales, self.value_scales = grown

    @torch.no_grad()
    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        """Store new K/V. ``slots``: ``[B, q]``; ``key``/``value``: ``[B, kv_heads, q, head_dim]``; ``keep``:
        the positions (in ``B * q`` order) to store, ``None`` for all (padding is never stored). Mutates."""
        k, v = self.slots(layer)
        flat = slots.reshape(-1)
        heads, dim = key.shape[1], key.shape[3]
        if keep is None and self.kv_dtype is None:
            # [B, H, q, D] -> [H, B*q, D] (a view for a decode step): the fewest calls for the step that runs most
            k.index_copy_(1, flat, key.transpose(0, 1).reshape(heads, -1, dim).to(k.dtype))
            v.index_copy_(1, flat, value.transpose(0, 1).reshape(heads, -1, dim).to(v.dtype))
            return
        # [B, H, q, D] -> [B*q, H, D]
        new_k = key.transpose(1, 2).reshape(-1, heads, dim)
        new_v = value.transpose(1, 2).reshape(-1, heads, dim)
        if keep is not None:
            flat, new_k, new_v = flat[keep], new_k[keep], new_v[keep]
        if self.kv_dtype is not None:
            self._write_quantized(layer, flat, new_k, new_v)
            return
        k.index_copy_(1, flat, new_k.transpose(0, 1).to(k.dtype))
        v.index_copy_(1, flat, new_v.transpose(0, 1).to(v.dtype))

    def _write_quantized(self, layer: int, flat: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Quantize ``[N, kv_heads, head_dim]`` values and place codes and scales at ``flat`` slots. Mutates."""
        codes, scale = self._quantize(torch.stack((new_k, new_v)).to(torch.float32))  # K and V in one call
        for i, (stored, scales) in enumerate(((self.keys, self.key_scales), (self.values, self.value_scales))):
            slot_view(stored[layer]).index_copy_(1, flat, codes[i].transpose(0, 1))
            scales[layer].view(scales[layer].shape[0], -1).index_copy_(1, flat, scale[i].T)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv_dtype is not None
        return quantize(x, self.kv_dtype)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        assert self.kv_dtype is not None
        return dequantize(codes, scale, self.kv_dtype, dtype)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V (their 8-bit codes in a quantized pool) indexed by slot, each ``[kv_heads,
        num_blocks * block_size, head_dim]`` (:func:`prefixkv.slots.slot_view`): views, so a write through them
        writes the pool."""
        return slot_view(self.keys[layer]), slot_view(self.values[layer])

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. ``slots``: ``[B, L]`` -> two ``[B, kv_heads, L, head_dim]`` tensors."""
        k, v = self.slots(layer)
        b, n = slots.shape
        heads, dim = k.shape[0], k.shape[2]
        flat = slots.reshape(-1)
        keys = k.index_select(1, flat)  # [H, B*n, D]
        values = v.index_select(1, flat)
        if self.kv_dtype is not None:
            dtype = self.specs[layer].dtype
            k_scale = self.key_scales[layer].view(heads, -1).index_select(1, flat)  # [H, B*n]
            v_scale = self.value_scales[layer].view(heads, -1).index_select(1, flat)
            keys = self._dequantize(keys.transpose(0, 1), k_scale.T, dtype)  # [B*n, H, D]
            values = self._dequantize(values.transpose(0, 1), v_scale.T, dtype)
            return keys.view(b, n, heads, dim).transpose(1, 2), values.view(b, n, heads, dim).transpose(1, 2)
        return keys.view(heads, b, n, dim).transpose(0, 1), values.view(heads, b, n, dim).transpose(0, 1)

    def gather_blocks(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``length`` columns when column ``c`` sits in block ``table[:, c // block_size]`` at
        offset ``c % block_size``: whole blocks are copied, a ``block_size`` times shorter index than
        :meth:`gather`. ``table``: ``[B, C]`` -> two ``[B, kv_heads, length, head_dim]`` tensors."""
        k, v = self.keys[layer], self.values[layer]
        b, c = table.shape
        heads, dim = k.shape[0], k.shape[3]
        flat = table.reshape(-1)
        if self.kv_dtype is not None:
            dtype = self.specs[layer].dtype
            keys = self._dequantize(_take(k, flat), _take_scales(self.key_scales[layer], flat), dtype)
            values = self._dequantize(_take(v, flat), _take_scales(self.value_scales[layer], flat), dtype)
            keys = keys.view(b, c * self.block_size, heads, dim)[:, :length].transpose(1, 2)
            values = values.view(b, c * self.block_size, heads, dim)[:, :length].transpose(1, 2)
            return keys, values
        keys = k.index_select(1, flat).view(heads, b, c * self.block_size, dim)[:, :, :length].transpose(0, 1)
        values = v.index_select(1, flat).view(heads, b, c * self.block_size, dim)[:, :, :length].transpose(0, 1)
        return keys, values

    @torch.no_grad()
    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` in every layer. Mutates."""
        for t in (*self.keys, *self.values, *self.key_scales, *self.value_scales):
            t[:, dst, :n] = t[:, src, :n]

    def _stored(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for layer in range(len(self.specs)):
            tensors[f"k.{layer}"], tensors[f"v.{layer}"] = self.keys[layer], self.values[layer]
            if self.kv_dtype is not None:
                tensors[f"k_scale.{layer}"] = self.key_scales[layer]
                tensors[f"v_scale.{layer}"] = self.value_scales[layer]
        return tensors

    def read_blocks(self, blocks: list[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Copies of whole blocks as stored (codes and scales when quantized), on ``device``, by name
        (``k.{layer}``, ``v.{layer}`` and, when quantized, ``k_scale.{layer}``, ``v_scale.{layer}``):
        ``[len(blocks), block_size, kv_heads, head_dim]`` K/V, ``[len(blocks), block_size, kv_heads]`` scales.
        Does not mutate."""
        out = {}
        for name, t in self._stored().items():
            index = torch.tensor(blocks, dtype=torch.long, device=t.device)
            out[name] = (_take_scales(t, index) if "scale" in name else _take(t, index)).to(device)
        return out

    @torch.no_grad()
    def write_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Fill whole blocks of every layer from tensors as :meth:`read_blocks` returns them (unquantized K/V
        are cast to each layer's dtype), moved to each layer's device. Mutates."""
        for name, t in self._stored().items():
            index = torch.tensor(blocks, dtype=torch.long, device=t.device)
            given = tensors[name].to(device=t.device, dtype=t.dtype, non_blocking=True)
            if "scale" in name:
                t.index_copy_(1, index, given.permute(2, 0, 1))
            else:
                _put(t, index, given)


def _take(t: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copies of whole blocks of a layer's K or V in block-major form, ``[n, block_size, kv_heads, head_dim]``."""
    return t.index_select(1, blocks).permute(1, 2, 0, 3)


def _take_scales(t: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copies of whole blocks of a layer's scales in block-major form, ``[n, block_size, kv_heads]``."""
    return t.index_select(1, blocks).permute(1, 2, 0)


def _put(t: torch.Tensor, blocks: torch.Tensor, values: torch.Tensor) -> None:
    """Write whole blocks given in block-major form into a layer's K or V. Mutates ``t``."""
    t.index_copy_(1, blocks, values.permute(2, 0, 1, 3))


def _grown(t: torch.Tensor, extra: int) -> torch.Tensor:
    """``t`` with ``extra`` zero blocks appended along its block dimension (1: ``[kv_heads, num_blocks, ...]``)."""
    shape = list(t.shape)
    shape[1] = extra
    return torch.cat([t, torch.zeros(shape, device=t.device, dtype=t.dtype)], dim=1)
