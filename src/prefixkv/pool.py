"""The KV tensors: per attention layer, K and V as ``[kv_heads, num_blocks, block_size, head_dim]``.

Head-major: the slots of one head are contiguous across blocks, so the K/V of a run of consecutive blocks is a
view ``[kv_heads, tokens, head_dim]`` whose every head is one contiguous range, which attention reads as fast as
a contiguous tensor (the block-major layout reads about twice as slowly on CPU). Whole blocks leave the pool
(:meth:`BlockPool.read_blocks`, persistence, the second tier) in block-major form, ``[n, block_size, kv_heads,
head_dim]``.

No trie and no transformers here: the pool writes and reads *slots* (``block * block_size + offset``)
that the cache computes. Each layer's tensors live on that layer's device, in the pool's dtype. The pool
starts small and grows (a copy, amortised by doubling) up to whatever capacity the store allows.

Users call ``generate`` under ``torch.inference_mode()`` and ``torch.no_grad()`` alike (DESIGN.md rule 12). A
tensor made inside ``inference_mode`` is an inference tensor, which refuses in-place writes outside it; so
the pool's tensors are always made as normal tensors (:func:`_normal_tensors`), which accept writes in both.

Quantized storage (``kv_dtype="int8"`` or ``"fp8"``): K and V are kept in 8 bits with one float32 scale
per block, per KV head (per layer, K and V apart): ``value = code * scale``. The scale of a block is
its absolute maximum over the slots filled so far divided by the code range (127 for int8, 448 for
fp8 e4m3). A write re-quantizes the blocks it touches: they are dequantized, the new slots placed, the
slots after the last one written cleared (stale data of a block's earlier life, or a cropped tail, must
not widen the scale), and the block quantized again with the scale of its new absolute maximum. While
that maximum does not grow, the codes already there come back unchanged; when it grows, they are rounded
once more to the coarser grid (at most half a step of the new scale each). Reads dequantize only the
gathered blocks, into the pool's ``dtype``; the full-precision cache never exists as a whole.
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
    """Where and how one attention layer's KV is kept (``dtype``: what reads return)."""

    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype


KV_DTYPES = ("int8", "fp8")
"""The quantized storage modes; ``None`` keeps K/V in the pool's ``dtype``."""

# storage element type (fp8 codes are kept as their bytes: CPU index_copy_ has no float8 kernel), the
# type codes are computed in, and the largest code
_CODES: dict[str, tuple[torch.dtype, torch.dtype, float]] = {
    "int8": (torch.int8, torch.int8, 127.0),
    "fp8": (torch.uint8, torch.float8_e4m3fn, 448.0),
}


def check_kv_dtype(kv_dtype: str | None) -> None:
    """Raise ``ValueError`` unless ``kv_dtype`` names a storage mode. Does not mutate."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None (unquantized), 'int8' or 'fp8', got {kv_dtype!r}")


def block_bytes(specs: list[LayerSpec], block_size: int, kv_dtype: str | None = None) -> int:
    """K and V bytes of one block across all layers, scales included.

    >>> spec = LayerSpec(2, 64, torch.device("cpu"), torch.float32)
    >>> block_bytes([spec], 16), block_bytes([spec], 16, "int8")
    (16384, 4112)
    """
    total = 0
    for s in specs:
        if kv_dtype is None:
            total += 2 * block_size * s.kv_heads * s.head_dim * torch.empty((), dtype=s.dtype).element_size()
        else:
            total += 2 * (block_size * s.kv_heads * s.head_dim + 4 * s.kv_heads)  # 1-byte codes, float32 scales
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
        # quantized pools only: per layer ``[num_blocks, kv_heads]`` float32 scales of K and of V
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        with _normal_tensors():
            self._allocate(layers, block_size, capacity, kv_dtype)

    def _allocate(self, layers: list[LayerSpec], block_size: int, capacity: int, kv_dtype: str | None) -> None:
        for s in layers:
            shape = (s.kv_heads, capacity, block_size, s.head_dim)
            store = s.dtype if kv_dtype is None else _CODES[kv_dtype][0]
            # zeros, not empty: the null block stands in for padding and must hold finite values
            self.keys.append(torch.zeros(shape, device=s.device, dtype=store))
            self.values.append(torch.zeros(shape, device=s.device, dtype=store))
            if kv_dtype is not None:
                self.key_scales.append(torch.zeros((capacity, s.kv_heads), device=s.device, dtype=torch.float32))
                self.value_scales.append(torch.zeros((capacity, s.kv_heads), device=s.device, dtype=torch.float32))

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
                [_grown(t, extra, dim) for t in tensors]
                for tensors, dim in ((self.keys, 1), (self.values, 1), (self.key_scales, 0), (self.value_scales, 0))
            ]
        # all layers at once: a failure half-way leaves the old pool
        self.keys, self.values, self.key_scales, self.value_scales = grown

    @torch.no_grad()
    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        """Store new K/V. ``slots``: ``[B, q]``; ``key``/``value``: ``[B, kv_heads, q, head_dim]``; ``keep``:
        the positions (in ``B * q`` order) to store, ``None`` for all (padding is never stored). Mutates."""
        k, v = self.keys[layer], self.values[layer]
        flat = slots.reshape(-1)
        # [B, H, q, D] -> [B*q, H, D]
        heads, dim = key.shape[1], key.shape[3]
        new_k = key.transpose(1, 2).reshape(-1, heads, dim)
        new_v = value.transpose(1, 2).reshape(-1, heads, dim)
        if keep is not None:
            flat, new_k, new_v = flat[keep], new_k[keep], new_v[keep]
        if self.kv_dtype is not None:
            self._write_quantized(layer, flat, new_k, new_v)
            return
        _slots(k).index_copy_(1, flat, new_k.transpose(0, 1).to(k.dtype))
        _slots(v).index_copy_(1, flat, new_v.transpose(0, 1).to(v.dtype))

    def _write_quantized(self, layer: int, flat: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Place ``[N, kv_heads, head_dim]`` values at ``flat`` slots, re-quantizing the touched blocks. Mutates."""
        if flat.numel() == 0:
            return
        bs = self.block_size
        blocks, offsets = flat // bs, flat % bs
        touched, which = torch.unique(blocks, return_inverse=True)
        last = torch.full_like(touched, -1).scatter_reduce_(0, which, offsets, "amax")
        stale = torch.arange(bs, device=flat.device)[None, :] > last[:, None]  # [U, bs]: after the last written slot
        for codes, scales, new in ((self.keys, self.key_scales, new_k), (self.values, self.value_scales, new_v)):
            block = self._dequantize(_take(codes[layer], touched), scales[layer].index_select(0, touched))
            block[which, offsets] = new.to(torch.float32)
            block[stale] = 0
            q, scale = self._quantize(block)
            _put(codes[layer], touched, q)
            scales[layer].index_copy_(0, touched, scale)

    def _quantize(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and ``[U, kv_heads]`` scales of float32 blocks ``[U, block_size, kv_heads, head_dim]``."""
        assert self.kv_dtype is not None
        store, code, top = _CODES[self.kv_dtype]
        scale = block.abs().amax(dim=(1, 3)) / top
        # an all-zero head keeps scale 0 (its codes are 0); dividing by 1 there avoids 0/0
        scaled = block / torch.where(scale > 0, scale, 1.0)[:, None, :, None]
        if code == torch.int8:
            return scaled.round_().clamp_(-top, top).to(torch.int8), scale
        return scaled.clamp_(-top, top).to(code).view(store), scale

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes``: ``[U, block_size, kv_heads, head_dim]``, ``scale``: ``[U, kv_heads]`` -> values in ``dtype``."""
        assert self.kv_dtype is not None
        code = _CODES[self.kv_dtype][1]
        values = codes.view(code).to(torch.float32) if code != torch.int8 else codes.to(torch.float32)
        return (values * scale[:, None, :, None]).to(dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. ``slots``: ``[B, L]`` -> two ``[B, kv_heads, L, head_dim]`` tensors."""
        k, v = self.keys[layer], self.values[layer]
        b, n = slots.shape
        heads, dim = k.shape[0], k.shape[3]
        flat = slots.reshape(-1)
        keys = _slots(k).index_select(1, flat)  # [H, B*n, D]
        values = _slots(v).index_select(1, flat)
        if self.kv_dtype is not None:
            dtype, block = self.specs[layer].dtype, flat // self.block_size
            keys = self._dequantize(keys.transpose(0, 1)[:, None], self.key_scales[layer].index_select(0, block), dtype)
            values = self._dequantize(
                values.transpose(0, 1)[:, None], self.value_scales[layer].index_select(0, block), dtype
            )
            return (
                keys.view(b, n, heads, dim).transpose(1, 2),
                values.view(b, n, heads, dim).transpose(1, 2),
            )
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
            keys = self._dequantize(_take(k, flat), self.key_scales[layer].index_select(0, flat), dtype)
            values = self._dequantize(_take(v, flat), self.value_scales[layer].index_select(0, flat), dtype)
            keys = keys.view(b, c * self.block_size, heads, dim)[:, :length].transpose(1, 2)
            values = values.view(b, c * self.block_size, heads, dim)[:, :length].transpose(1, 2)
            return keys, values
        keys = k.index_select(1, flat).view(heads, b, c * self.block_size, dim)[:, :, :length].transpose(0, 1)
        values = v.index_select(1, flat).view(heads, b, c * self.block_size, dim)[:, :, :length].transpose(0, 1)
        return keys, values

    @torch.no_grad()
    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` in every layer. Mutates."""
        for k, v in zip(self.keys, self.values):
            k[:, dst, :n] = k[:, src, :n]
            v[:, dst, :n] = v[:, src, :n]
        for scales in (*self.key_scales, *self.value_scales):
            scales[dst] = scales[src]  # a scale too wide for the first n slots; the next write narrows it

    def tensor_names(self) -> list[str]:
        """Names of the per-layer tensors :meth:`read_blocks` returns: ``k.{layer}``, ``v.{layer}`` and, when
        quantized, ``k_scale.{layer}``, ``v_scale.{layer}``."""
        kinds = ("k", "v") if self.kv_dtype is None else ("k", "v", "k_scale", "v_scale")
        return [f"{kind}.{layer}" for layer in range(len(self.specs)) for kind in kinds]

    def _stored(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for layer in range(len(self.specs)):
            tensors[f"k.{layer}"], tensors[f"v.{layer}"] = self.keys[layer], self.values[layer]
            if self.kv_dtype is not None:
                tensors[f"k_scale.{layer}"] = self.key_scales[layer]
                tensors[f"v_scale.{layer}"] = self.value_scales[layer]
        return tensors

    def read_blocks(self, blocks: list[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Copies of whole blocks as stored (codes and scales when quantized), on ``device``, by
        :meth:`tensor_names`: ``[len(blocks), block_size, kv_heads, head_dim]`` K/V, ``[len(blocks),
        kv_heads]`` scales. Does not mutate."""
        out = {}
        for name, t in self._stored().items():
            index = torch.tensor(blocks, dtype=torch.long, device=t.device)
            out[name] = (t.index_select(0, index) if "scale" in name else _take(t, index)).to(device)
        return out

    @torch.no_grad()
    def write_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Fill whole blocks of every layer from tensors as :meth:`read_blocks` returns them (unquantized K/V
        are cast to each layer's dtype), moved to each layer's device. Mutates."""
        for name, t in self._stored().items():
            index = torch.tensor(blocks, dtype=torch.long, device=t.device)
            given = tensors[name].to(device=t.device, dtype=t.dtype, non_blocking=True)
            if "scale" in name:
                t.index_copy_(0, index, given)
            else:
                _put(t, index, given)


def _slots(t: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, num_blocks * block_size, head_dim]`` view of a layer's K or V, indexed by slot."""
    return t.view(t.shape[0], -1, t.shape[3])


def _take(t: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copies of whole blocks of a layer's K or V in block-major form, ``[n, block_size, kv_heads, head_dim]``."""
    return t.index_select(1, blocks).permute(1, 2, 0, 3)


def _put(t: torch.Tensor, blocks: torch.Tensor, values: torch.Tensor) -> None:
    """Write whole blocks given in block-major form into a layer's K or V. Mutates ``t``."""
    t.index_copy_(1, blocks, values.permute(2, 0, 1, 3))


def _grown(t: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    """``t`` with ``extra`` zero blocks appended along its block dimension ``dim``."""
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, torch.zeros(shape, device=t.device, dtype=t.dtype)], dim=dim)


def code_dtype(kv_dtype: str) -> torch.dtype:
    """The element type a quantized pool stores its codes in (fp8 codes as their bytes, ``uint8``)."""
    return _CODES[kv_dtype][0]
