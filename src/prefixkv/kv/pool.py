"""The KV tensors: per attention layer, K and V as ``[kv_heads, num_blocks, block_size, head_dim]``, each of the heads
and size that layer hands its cache (:class:`LayerSpec`: a layer's V may differ from its K, a layer from another).

Head-major: the slots of one head are contiguous across blocks, so the K/V of a run of consecutive blocks is a
view ``[kv_heads, tokens, head_dim]`` whose every head is one contiguous range, which attention reads as fast as
a contiguous tensor (the block-major layout reads about twice as slowly on CPU). Whole blocks leave the pool
(:meth:`BlockPool.read_blocks`, persistence, the second tier) in block-major form, ``[n, block_size, kv_heads,
head_dim]``.

No trie and no transformers here: the pool writes and reads *slots* (``block * block_size + offset``)
that the cache computes. Each layer's tensors live on that layer's device, in the pool's dtype. The pool
starts small and grows (a copy, amortised by doubling) up to whatever capacity the store allows.

A pool CUDA graphs can hold: a compiled decode step writes into the pool's tensors, inputs of its graph, so they
keep their storage for as long as the pool keeps its size. Every write, eviction, tier move and ``clear`` with a
live cache works in place; only :meth:`BlockPool.grow`, and :meth:`BlockPool.shrink` when a ``clear`` finds no live
cache, move storage, and they count so (:attr:`BlockPool.moves`). Each tensor is marked
a static address for the compiler (``torch._dynamo.mark_static_address``, unguarded, as transformers'
``StaticCache`` marks its own): a graph is captured over it without a copy, and where a growth gave a step new
tensors, CUDA graphs re-record that step rather than replay the old addresses (docs/how-it-works.md, "A decode step
that compiles").

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
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from ..base.slots import slot_view
from .quantization import SCALE_DTYPE, check_kv_dtype, code_dtype, dequantize, quantize


@contextlib.contextmanager
def _normal_tensors() -> Iterator[None]:
    """Make normal (not inference) tensors without autograd history, whatever mode the caller is in."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class LayerSpec(NamedTuple):
    """Where and how one attention layer's KV is kept (``dtype``: what reads return): K of ``kv_heads`` heads of
    ``head_dim``, and V of ``value_heads`` heads of ``value_dim``, ``None`` where V is shaped as K (multi-head latent
    attention hands ``update`` a latent and a rotary key of other sizes, docs/architectures.md, "Latent attention and
    mixed shapes").

    >>> LayerSpec(1, 8, torch.device("cpu"), torch.float32, value_dim=32).value_shape
    (1, 32)
    """

    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    value_heads: int | None = None
    value_dim: int | None = None

    @property
    def key_shape(self) -> tuple[int, int]:
        """K's heads and head size."""
        return self.kv_heads, self.head_dim

    @property
    def value_shape(self) -> tuple[int, int]:
        """V's heads and head size."""
        heads = self.kv_heads if self.value_heads is None else self.value_heads
        return heads, self.head_dim if self.value_dim is None else self.value_dim


def layer_spec(key: tuple[int, int], value: tuple[int, int], device: torch.device, dtype: torch.dtype) -> LayerSpec:
    """The spec of a layer whose K is ``key`` and V ``value`` (heads, head size), V's fields left ``None`` where it is
    shaped as K (so a uniform model's specs, and the files they write, are what they were)."""
    if value == key:
        return LayerSpec(*key, device, dtype)
    return LayerSpec(*key, device, dtype, *value)


def block_bytes(specs: list[LayerSpec], block_size: int, kv_dtype: str | None = None) -> int:
    """K and V bytes of one block across all layers, scales included, each layer at its own K and V sizes.

    >>> spec = LayerSpec(2, 64, torch.device("cpu"), torch.float32)
    >>> block_bytes([spec], 16), block_bytes([spec], 16, "int8")
    (16384, 4224)
    """
    total = 0
    for s in specs:
        for heads, dim in (s.key_shape, s.value_shape):
            if kv_dtype is None:
                total += block_size * heads * dim * s.dtype.itemsize
            else:  # 1-byte codes and a scale per token and head
                total += block_size * heads * (dim + SCALE_DTYPE.itemsize)
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
        self.moves = 0  # growths and shrinks so far: the only operations that give the tensors new storage
        self.growing = False  # a growth is copying the tensors now (in another thread): a write may miss the copy
        with _normal_tensors():
            self._allocate(layers, block_size, capacity, kv_dtype)
        self._views = self._slot_views()

    def _allocate(self, layers: list[LayerSpec], block_size: int, capacity: int, kv_dtype: str | None) -> None:
        for s in layers:
            store = s.dtype if kv_dtype is None else code_dtype(kv_dtype)
            for (heads, dim), tensors, scales in (
                (s.key_shape, self.keys, self.key_scales),
                (s.value_shape, self.values, self.value_scales),
            ):
                shape = (heads, capacity, block_size, dim)
                # zeros, not empty: the null block stands in for padding and must hold finite values
                tensors.append(_held(torch.zeros(shape, device=s.device, dtype=store)))
                if kv_dtype is not None:
                    scales.append(_held(torch.zeros(shape[:3], device=s.device, dtype=SCALE_DTYPE)))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block across all layers, scales included."""
        return block_bytes(self.specs, self.block_size, self.kv_dtype)

    def grow(self, capacity: int) -> None:
        """Enlarge every layer to ``capacity`` blocks, keeping the contents: new tensors (:attr:`moves` counts
        them), so a compiled step holding the old ones writes there (:meth:`prefixkv.attention.static.StaticStep.
        carry_over`). Mutates."""
        extra = capacity - self.capacity
        if extra > 0:
            self._move(lambda t: _grown(t, extra))

    def _move(self, new: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Give every layer's tensors new storage, ``new(t)`` of each, all layers at once (a failure half-way leaves
        the old pool), and count the move (:attr:`moves`; :meth:`write_unlocked` reads it). Mutates."""
        self.growing = True
        try:
            with _normal_tensors():
                moved = [
                    [new(t) for t in tensors]
                    for tensors in (self.keys, self.values, self.key_scales, self.value_scales)
                ]
            self.keys, self.values, self.key_scales, self.value_scales = moved
            self._views = self._slot_views()
            self.moves += 1
        finally:
            self.growing = False

    def _slot_views(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every layer's K and V and their :meth:`slots`, made once per storage (a decode step asks for them every
        layer)."""
        return [(k, v, slot_view(k), slot_view(v)) for k, v in zip(self.keys, self.values)]

    def write_unlocked(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None = None
    ) -> bool:
        """:meth:`write` without the store's lock, and whether it surely landed: ``False`` where a growth (in
        another thread, which holds the lock) copied the tensors meanwhile, so that the write may be in the old
        ones only; the caller then writes again under the lock (a write is idempotent). The decode step's write:
        no lock taken where no growth runs, which is every step but a handful. Mutates."""
        moves = self.moves
        if self.growing:
            return False
        self.write(layer, slots, key, value, keep)
        return not self.growing and self.moves == moves

    def shrink(self, capacity: int) -> None:
        """Keep the first ``capacity`` blocks of every layer (those after them hold nothing anyone reads) and give the
        rest back to the device: new tensors, a move as a growth is (:attr:`moves`), made only while no live cache
        reads the pool (:meth:`prefixkv.kv.manager.BlockManager.clear`). Mutates."""
        if capacity < self.capacity:
            self._move(lambda t: _held(t[:, :capacity].clone()))

    @torch.no_grad()
    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        """Store new K/V. ``slots``: ``[B, q]``; ``key``/``value``: ``[B, kv_heads, q, head_dim]`` (each of its own
        heads and size, :class:`LayerSpec`); ``keep``: the positions (in ``B * q`` order) to store, ``None`` for all
        (padding is never stored). Mutates."""
        k, v = self.slots(layer)
        flat = slots.reshape(-1)
        if keep is None and self.kv_dtype is None:
            # [B, H, q, D] -> [H, B*q, D] (a view for a decode step): the fewest calls for the step that runs most
            k.index_copy_(1, flat, key.transpose(0, 1).reshape(key.shape[1], -1, key.shape[3]).to(k.dtype))
            v.index_copy_(1, flat, value.transpose(0, 1).reshape(value.shape[1], -1, value.shape[3]).to(v.dtype))
            return
        # [B, H, q, D] -> [B*q, H, D]
        new_k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3])
        new_v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
        if keep is not None:
            flat, new_k, new_v = flat[keep], new_k[keep], new_v[keep]
        if self.kv_dtype is not None:
            self._write_quantized(layer, flat, new_k, new_v)
            return
        k.index_copy_(1, flat, new_k.transpose(0, 1).to(k.dtype))
        v.index_copy_(1, flat, new_v.transpose(0, 1).to(v.dtype))

    def _write_quantized(self, layer: int, flat: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Quantize ``[N, kv_heads, head_dim]`` values and place codes and scales at ``flat`` slots. Mutates."""
        if new_k.shape == new_v.shape:  # K and V in one call
            codes, scale = self._quantize(torch.stack((new_k, new_v)).to(torch.float32))
            coded = [(codes[0], scale[0]), (codes[1], scale[1])]
        else:  # each token's codes come from its own values alone, so apart they are what they are together
            coded = [self._quantize(t.to(torch.float32)) for t in (new_k, new_v)]
        for (codes_i, scale_i), stored, scales in zip(
            coded, (self.keys, self.values), (self.key_scales, self.value_scales), strict=True
        ):
            slot_view(stored[layer]).index_copy_(1, flat, codes_i.transpose(0, 1))
            scales[layer].view(scales[layer].shape[0], -1).index_copy_(1, flat, scale_i.T)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv_dtype is not None
        return quantize(x, self.kv_dtype)

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        assert self.kv_dtype is not None
        return dequantize(codes, scale, self.kv_dtype, dtype)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V (their 8-bit codes in a quantized pool) indexed by slot, each ``[kv_heads,
        num_blocks * block_size, head_dim]`` (:func:`prefixkv.base.slots.slot_view`): views, so a write through them
        writes the pool."""
        k, v, k_slots, v_slots = self._views[layer] if layer < len(self._views) else (None, None, None, None)
        if k is not self.keys[layer] or v is not self.values[layer]:  # tensors set from outside: views made anew
            self._views = self._slot_views()
            k, v, k_slots, v_slots = self._views[layer]
        assert k_slots is not None and v_slots is not None
        return k_slots, v_slots

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. ``slots``: ``[B, L]`` -> two ``[B, kv_heads, L, head_dim]`` tensors (each of its
        own heads and size)."""
        flat = slots.reshape(-1)
        k, v = self.slots(layer)
        if self.kv_dtype is None:
            return _gathered(k, flat, slots.shape), _gathered(v, flat, slots.shape)
        dtype = self.specs[layer].dtype
        return (
            self._gathered_codes(k, self.key_scales[layer], flat, slots.shape, dtype),
            self._gathered_codes(v, self.value_scales[layer], flat, slots.shape, dtype),
        )

    def _gathered_codes(
        self, codes: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """:meth:`gather` of one quantized tensor, ``codes`` ``[H, slots, D]``: ``[B, H, L, D]`` in ``dtype``."""
        heads, dim = codes.shape[0], codes.shape[2]
        taken = codes.index_select(1, flat)  # [H, B*n, D]
        scale = scales.view(heads, -1).index_select(1, flat)  # [H, B*n]
        values = self._dequantize(taken.transpose(0, 1), scale.T, dtype)  # [B*n, H, D]
        return values.view(shape[0], shape[1], heads, dim).transpose(1, 2)

    def gather_blocks(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``length`` columns when column ``c`` sits in block ``table[:, c // block_size]`` at
        offset ``c % block_size``: whole blocks are copied, a ``block_size`` times shorter index than
        :meth:`gather`. ``table``: ``[B, C]`` -> two ``[B, kv_heads, length, head_dim]`` tensors."""
        flat = table.reshape(-1)
        b, c = table.shape
        pairs = ((self.keys, self.key_scales), (self.values, self.value_scales))
        if self.kv_dtype is not None:
            dtype = self.specs[layer].dtype
            out = []
            for tensors, scales in pairs:
                t = tensors[layer]
                values = self._dequantize(_take(t, flat), _take_scales(scales[layer], flat), dtype)
                out.append(values.view(b, c * self.block_size, t.shape[0], t.shape[3])[:, :length].transpose(1, 2))
            return out[0], out[1]
        k, v = (
            t.index_select(1, flat).view(t.shape[0], b, c * self.block_size, t.shape[3])[:, :, :length].transpose(0, 1)
            for t in (self.keys[layer], self.values[layer])
        )
        return k, v

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


def _gathered(t: torch.Tensor, flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Slots ``flat`` of a layer's K or V ``[H, slots, D]`` as ``[B, H, L, D]`` (``shape``: ``[B, L]``)."""
    heads, dim = t.shape[0], t.shape[2]
    return t.index_select(1, flat).view(heads, shape[0], shape[1], dim).transpose(0, 1)


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
    return _held(torch.cat([t, torch.zeros(shape, device=t.device, dtype=t.dtype)], dim=1))


def _held(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked a static address for the compiler (unguarded: a graph captured over it re-records, not
    replays, where a growth hands a step new tensors). Mutates only ``t``'s dynamo mark."""
    torch._dynamo.mark_static_address(t, guard=False)
    return t
