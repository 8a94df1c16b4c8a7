"""The KV tensors: per attention layer, each per-token tensor its kind keeps, by name (``k`` and ``v``, and any more a
kind names, :mod:`prefixkv.hf.kinds`), as ``[heads, num_blocks, block_size, size]``, each of the heads and size that
layer hands its cache (:class:`LayerSpec`: a layer's V may differ from its K, a layer from another). The pool is the
only place the name of a tensor in a file or a tier is formed (:func:`stored_name`, :func:`stored_tensors`).

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple, overload

import torch

from ..base.slots import slot_view
from .quantization import SCALE_DTYPE, check_kv_dtype, code_dtype, dequantize, quantize


@contextlib.contextmanager
def _normal_tensors() -> Iterator[None]:
    """Make normal (not inference) tensors without autograd history, whatever mode the caller is in."""
    with torch.inference_mode(False), torch.no_grad():
        yield


K, V = "k", "v"
"""The names of a layer's K and V among its per-token tensors (:attr:`LayerSpec.tensors`)."""


def stored_name(name: str, layer: int) -> str:
    """The name of ``layer``'s tensor ``name`` in a saved file, a tier's block and :meth:`BlockPool.read_blocks`
    (``k.0``, ``v.3``, ``index_k.1``): formed here only."""
    return f"{name}.{layer}"


def scale_name(name: str, layer: int) -> str:
    """The name of the 8-bit scales of ``layer``'s tensor ``name`` (``k_scale.0``), as :func:`stored_name`."""
    return f"{name}_scale.{layer}"


class StoredTensor(NamedTuple):
    """One tensor of a pool's blocks as saved and tiered: its name there (:func:`stored_name`,
    :func:`scale_name`), its layer and per-token tensor name, that tensor's (heads, size), and whether it is the
    8-bit scales of that tensor (``[blocks, block_size, heads]``) rather than the tensor (``[blocks, block_size,
    heads, size]``)."""

    stored: str
    layer: int
    name: str
    shape: tuple[int, int]
    scale: bool


def stored_tensors(layers: Sequence[dict[str, tuple[int, int]]], quantized: bool) -> list[StoredTensor]:
    """Every tensor of the blocks of a pool whose layers keep ``layers`` (each :attr:`LayerSpec.tensors`), by the
    name a file or a tier gives it, scales too where ``quantized``. Does not mutate."""
    out = []
    for i, tensors in enumerate(layers):
        for name, shape in tensors.items():
            out.append(StoredTensor(stored_name(name, i), i, name, shape, False))
            if quantized:
                out.append(StoredTensor(scale_name(name, i), i, name, shape, True))
    return out


class LayerSpec(NamedTuple):
    """Where and how one attention layer's KV is kept (``dtype``: what reads return): K of ``kv_heads`` heads of
    ``head_dim``, and V of ``value_heads`` heads of ``value_dim``, ``None`` where V is shaped as K (multi-head latent
    attention hands ``update`` a latent and a rotary key of other sizes, docs/architectures.md, "Latent attention and
    mixed shapes"), and any more per-token tensors its kind keeps (``extra``: name and (heads, size) each,
    :mod:`prefixkv.hf.kinds`).

    >>> LayerSpec(1, 8, torch.device("cpu"), torch.float32, value_dim=32).value_shape
    (1, 32)
    """

    kv_heads: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype
    value_heads: int | None = None
    value_dim: int | None = None
    extra: tuple[tuple[str, tuple[int, int]], ...] = ()

    @property
    def key_shape(self) -> tuple[int, int]:
        """K's heads and head size."""
        return self.kv_heads, self.head_dim

    @property
    def value_shape(self) -> tuple[int, int]:
        """V's heads and head size."""
        heads = self.kv_heads if self.value_heads is None else self.value_heads
        return heads, self.head_dim if self.value_dim is None else self.value_dim

    @property
    def tensors(self) -> dict[str, tuple[int, int]]:
        """Every per-token tensor the layer keeps, by name: ``k``, ``v`` and the ``extra`` ones, (heads, size) each.

        >>> LayerSpec(2, 8, torch.device("cpu"), torch.float32, extra=(("index_k", (1, 4)),)).tensors
        {'k': (2, 8), 'v': (2, 8), 'index_k': (1, 4)}
        """
        return spec_tensors(self.key_shape, self.value_shape, self.extra)


def layer_spec(
    key: tuple[int, int],
    value: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    extra: tuple[tuple[str, tuple[int, int]], ...] = (),
) -> LayerSpec:
    """The spec of a layer whose K is ``key`` and V ``value`` (heads, head size), V's fields left ``None`` where it is
    shaped as K (so a uniform model's specs, and the files they write, are what they were), and its ``extra``
    per-token tensors."""
    if value == key:
        return LayerSpec(*key, device, dtype, extra=tuple(extra))
    return LayerSpec(*key, device, dtype, *value, extra=tuple(extra))


def spec_tensors(
    key: tuple[int, int], value: tuple[int, int], extra: Sequence[tuple[str, tuple[int, int]]] = ()
) -> dict[str, tuple[int, int]]:
    """A layer's per-token tensors by name (:attr:`LayerSpec.tensors`) from its K and V shapes and ``extra`` ones."""
    return {K: key, V: value, **dict(extra)}


def spec_of(tensors: Mapping[str, tuple[int, int]], device: torch.device, dtype: torch.dtype) -> LayerSpec:
    """The spec of a layer that keeps ``tensors`` (:attr:`LayerSpec.tensors`)."""
    extra = tuple((name, shape) for name, shape in tensors.items() if name not in (K, V))
    return layer_spec(tensors[K], tensors[V], device, dtype, extra)


def block_bytes(specs: list[LayerSpec], block_size: int, kv_dtype: str | None = None) -> int:
    """Bytes of one block across all layers, every per-token tensor of each (K, V and any more), scales included,
    each at its own sizes.

    >>> spec = LayerSpec(2, 64, torch.device("cpu"), torch.float32)
    >>> block_bytes([spec], 16), block_bytes([spec], 16, "int8")
    (16384, 4224)
    """
    total = 0
    for s in specs:
        for heads, dim in s.tensors.values():
            if kv_dtype is None:
                total += block_size * heads * dim * s.dtype.itemsize
            else:  # 1-byte codes and a scale per token and head
                total += block_size * heads * (dim + SCALE_DTYPE.itemsize)
    return total


class _EveryLayer:
    """A pool's attribute that is every layer's tensor ``name`` (or its scales) as a list; set, it replaces them."""

    def __init__(self, name: str, *, scales: bool = False) -> None:
        self._name, self._scales = name, scales

    @overload
    def __get__(self, pool: None, owner: type | None = None) -> _EveryLayer: ...

    @overload
    def __get__(self, pool: BlockPool, owner: type | None = None) -> list[torch.Tensor]: ...

    def __get__(self, pool: BlockPool | None, owner: type | None = None) -> list[torch.Tensor] | _EveryLayer:
        if pool is None:  # read on the class (documentation tools)
            return self
        return [t[self._name] for t in (pool.scales if self._scales else pool.tensors) if t]

    def __set__(self, pool: BlockPool, given: Sequence[torch.Tensor]) -> None:
        for tensors, t in zip(pool.scales if self._scales else pool.tensors, given, strict=True):
            tensors[self._name] = t
        _views_anew(pool)


class BlockPool:
    """Per-token storage for every layer, addressed by slot index: ``tensors[layer][name]`` for each per-token
    tensor a layer keeps (:attr:`LayerSpec.tensors`: ``k``, ``v`` and any more its kind names), each ``[heads,
    num_blocks, block_size, size]``, and in a quantized pool ``scales[layer][name]`` beside them. Read through
    :meth:`layer`, :meth:`slots`, :meth:`gather` and the block methods; :attr:`keys` and :attr:`values` are every
    layer's K and V.

    >>> spec = LayerSpec(2, 4, torch.device("cpu"), torch.float32)
    >>> pool = BlockPool([spec], block_size=16, capacity=3)
    >>> pool.layer(0)["k"].shape
    torch.Size([2, 3, 16, 4])
    """

    def __init__(self, layers: list[LayerSpec], block_size: int, capacity: int, kv_dtype: str | None = None) -> None:
        check_kv_dtype(kv_dtype)
        self.specs = layers
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.tensors: list[dict[str, torch.Tensor]] = []
        # quantized pools only: per layer and name ``[heads, num_blocks, block_size]`` scales
        self.scales: list[dict[str, torch.Tensor]] = []
        self.moves = 0  # growths and shrinks so far: the only operations that give the tensors new storage
        self.growing = False  # a growth is copying the tensors now (in another thread): a write may miss the copy
        with _normal_tensors():
            for s in layers:
                tensors, scales = _allocated(s, block_size, capacity, kv_dtype)
                self.tensors.append(tensors)
                self.scales.append(scales)
        self._views = _slot_views(self.tensors)
        self.kv_slots: list[tuple[torch.Tensor, torch.Tensor]] = _kv_slots(self._views)
        """Every layer's K and V by slot (:meth:`slots` of each layer), a new list whenever the tensors change: a
        decode step takes them all at once, by this attribute (no call into the pool a layer)."""

    def layer(self, layer: int) -> Mapping[str, torch.Tensor]:
        """``layer``'s per-token tensors by name, ``[heads, num_blocks, block_size, size]`` each (8-bit codes in a
        quantized pool): the tensors themselves, which a growth replaces (read them at each use)."""
        return self.tensors[layer]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s K and V, as :meth:`layer` holds them."""
        tensors = self.tensors[layer]
        return tensors[K], tensors[V]

    keys = _EveryLayer(K)
    """Every layer's K (:meth:`layer`'s ``k``); set, each layer's K is replaced."""
    values = _EveryLayer(V)
    """Every layer's V (:meth:`layer`'s ``v``); set, each layer's V is replaced."""
    key_scales = _EveryLayer(K, scales=True)
    """Every layer's K scales (quantized pools; empty otherwise)."""
    value_scales = _EveryLayer(V, scales=True)
    """Every layer's V scales (quantized pools; empty otherwise)."""

    @property
    def capacity(self) -> int:
        return self.tensors[0][K].shape[1] if self.tensors else 0

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, every per-token tensor, scales included."""
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
                tensors = [{name: new(t) for name, t in per_layer.items()} for per_layer in self.tensors]
                scales = [{name: new(t) for name, t in per_layer.items()} for per_layer in self.scales]
            self.tensors, self.scales = tensors, scales
            _views_anew(self)
            self.moves += 1
        finally:
            self.growing = False

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
            self._write_quantized(layer, flat, {K: new_k, V: new_v})
            return
        k.index_copy_(1, flat, new_k.transpose(0, 1).to(k.dtype))
        v.index_copy_(1, flat, new_v.transpose(0, 1).to(v.dtype))

    @torch.no_grad()
    def write_tensor(
        self, layer: int, name: str, slots: torch.Tensor, given: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        """Store new values of ``layer``'s per-token tensor ``name`` (one its kind keeps besides K and V), as
        :meth:`write` stores K: ``given`` ``[B, heads, q, size]``. Mutates."""
        flat = slots.reshape(-1)
        new = given.transpose(1, 2).reshape(-1, given.shape[1], given.shape[3])  # [B*q, H, D]
        if keep is not None:
            flat, new = flat[keep], new[keep]
        if self.kv_dtype is not None:
            self._write_quantized(layer, flat, {name: new})
            return
        stored = self.slot(layer, name)
        stored.index_copy_(1, flat, new.transpose(0, 1).to(stored.dtype))

    def _write_quantized(self, layer: int, flat: torch.Tensor, new: dict[str, torch.Tensor]) -> None:
        """Quantize ``[N, heads, size]`` values of each named tensor and place codes and scales at ``flat`` slots.
        Mutates."""
        shapes = {t.shape for t in new.values()}
        if len(new) > 1 and len(shapes) == 1:  # all in one call
            codes, scale = self._quantize(torch.stack(list(new.values())).to(torch.float32))
            coded = [(codes[i], scale[i]) for i in range(len(new))]
        else:  # each token's codes come from its own values alone, so apart they are what they are together
            coded = [self._quantize(t.to(torch.float32)) for t in new.values()]
        for name, (codes_i, scale_i) in zip(new, coded, strict=True):
            slot_view(self.tensors[layer][name]).index_copy_(1, flat, codes_i.transpose(0, 1))
            scales = self.scales[layer][name]
            scales.view(scales.shape[0], -1).index_copy_(1, flat, scale_i.T)

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
        views, tensors = self._views[layer] if layer < len(self._views) else {}, self.tensors[layer]
        k, v = views.get(K), views.get(V)
        if k is None or v is None or k[0] is not tensors[K] or v[0] is not tensors[V]:  # set from outside: anew
            _views_anew(self)
            views = self._views[layer]
            k, v = views[K], views[V]
        return k[1], v[1]

    def slot(self, layer: int, name: str) -> torch.Tensor:
        """``layer``'s per-token tensor ``name`` indexed by slot, ``[heads, num_blocks * block_size, size]``, as
        :meth:`slots`."""
        t = self.tensors[layer][name]
        view = self._views[layer].get(name) if layer < len(self._views) else None
        return view[1] if view is not None and view[0] is t else slot_view(t)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. ``slots``: ``[B, L]`` -> two ``[B, kv_heads, L, head_dim]`` tensors (each of its
        own heads and size)."""
        return self.gather_tensor(layer, K, slots), self.gather_tensor(layer, V, slots)

    def gather_tensor(self, layer: int, name: str, slots: torch.Tensor) -> torch.Tensor:
        """``layer``'s tensor ``name`` at the given slots: ``slots`` ``[B, L]`` -> ``[B, heads, L, size]`` in the
        layer's dtype. Does not mutate."""
        flat = slots.reshape(-1)
        stored = self.slot(layer, name)
        if self.kv_dtype is None:
            return _gathered(stored, flat, slots.shape)
        scales = self.scales[layer][name]
        taken = _gathered_codes(stored, scales, flat)  # [B*L, H, D] codes, [B*L, H] scales
        values = self._dequantize(*taken, self.specs[layer].dtype)
        return values.view(slots.shape[0], slots.shape[1], *values.shape[1:]).transpose(1, 2)

    def gather_blocks(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``length`` columns when column ``c`` sits in block ``table[:, c // block_size]`` at
        offset ``c % block_size``: whole blocks are copied, a ``block_size`` times shorter index than
        :meth:`gather`. ``table``: ``[B, C]`` -> two ``[B, kv_heads, length, head_dim]`` tensors."""
        return self.gather_blocks_tensor(layer, K, table, length), self.gather_blocks_tensor(layer, V, table, length)

    def gather_blocks_tensor(self, layer: int, name: str, table: torch.Tensor, length: int) -> torch.Tensor:
        """:meth:`gather_blocks` of ``layer``'s tensor ``name``: ``[B, heads, length, size]``. Does not mutate."""
        flat = table.reshape(-1)
        b, c = table.shape
        t = self.tensors[layer][name]
        if self.kv_dtype is not None:
            scales = self.scales[layer][name]
            values = self._dequantize(_take(t, flat), _take_scales(scales, flat), self.specs[layer].dtype)
            return values.view(b, c * self.block_size, t.shape[0], t.shape[3])[:, :length].transpose(1, 2)
        taken = t.index_select(1, flat).view(t.shape[0], b, c * self.block_size, t.shape[3])
        return taken[:, :, :length].transpose(0, 1)

    @torch.no_grad()
    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` in every layer. Mutates."""
        for t in _every(self):
            t[:, dst, :n] = t[:, src, :n]

    @torch.no_grad()
    def zero_null_block(self) -> None:
        """Zeros in block 0 of every tensor (the null block, which stands in for padding). Mutates."""
        for t in _every(self):
            t[:, 0].zero_()

    def _stored(self) -> dict[str, torch.Tensor]:
        """Every tensor by the name :meth:`read_blocks` gives its blocks (:func:`stored_tensors`)."""
        layers = [s.tensors for s in self.specs]
        return {
            s.stored: (self.scales if s.scale else self.tensors)[s.layer][s.name]
            for s in stored_tensors(layers, self.kv_dtype is not None)
        }

    def read_blocks(self, blocks: list[int], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Copies of whole blocks as stored (codes and scales when quantized), on ``device``, by name
        (:func:`stored_tensors`: ``k.{layer}``, ``v.{layer}``, any more per-token tensor ``{name}.{layer}`` and,
        when quantized, ``{name}_scale.{layer}``): ``[len(blocks), block_size, heads, size]`` tensors,
        ``[len(blocks), block_size, heads]`` scales. Does not mutate."""
        out = {}
        for name, t in self._stored().items():
            index = torch.tensor(blocks, dtype=torch.long, device=t.device)
            out[name] = (_take_scales(t, index) if t.dim() == 3 else _take(t, index)).to(device)  # 3: scales
        return out

    @torch.no_grad()
    def write_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Fill whole blocks of every layer from tensors as :meth:`read_blocks` returns them (unquantized tensors
        are cast to each layer's dtype), moved to each layer's device. Mutates."""
        for name, t in self._stored().items():
            index = torch.tensor(blocks, dtype=torch.long, device=t.device)
            given = tensors[name].to(device=t.device, dtype=t.dtype, non_blocking=True)
            if t.dim() == 3:  # scales
                t.index_copy_(1, index, given.permute(2, 0, 1))
            else:
                _put(t, index, given)


def _allocated(
    s: LayerSpec, block_size: int, capacity: int, kv_dtype: str | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A layer's tensors of ``capacity`` blocks, zeros, and in a quantized pool their scales, by name."""
    store = s.dtype if kv_dtype is None else code_dtype(kv_dtype)
    tensors, scales = {}, {}
    for name, (heads, dim) in s.tensors.items():
        shape = (heads, capacity, block_size, dim)
        # zeros, not empty: the null block stands in for padding and must hold finite values
        tensors[name] = _held(torch.zeros(shape, device=s.device, dtype=store))
        if kv_dtype is not None:
            scales[name] = _held(torch.zeros(shape[:3], device=s.device, dtype=SCALE_DTYPE))
    return tensors, scales


def _slot_views(layers: list[dict[str, torch.Tensor]]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Every layer's tensors and their slot views (:meth:`BlockPool.slots`), made once per storage (a decode step
    asks for them every layer)."""
    return [{name: (t, slot_view(t)) for name, t in per_layer.items()} for per_layer in layers]


def _views_anew(pool: BlockPool) -> None:
    """Make ``pool``'s slot views (:meth:`BlockPool.slots`, :attr:`BlockPool.kv_slots`) of its tensors now, after
    they changed. Mutates the pool."""
    pool._views = _slot_views(pool.tensors)
    pool.kv_slots = _kv_slots(pool._views)


def _kv_slots(views: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V slot views out of :func:`_slot_views`'s."""
    return [(per_layer[K][1], per_layer[V][1]) for per_layer in views]


def _every(pool: BlockPool) -> list[torch.Tensor]:
    """Every tensor of ``pool``, scales included."""
    return [t for per_layer in (*pool.tensors, *pool.scales) for t in per_layer.values()]


def _gathered_codes(codes: torch.Tensor, scales: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``[N, H, D]`` and scales ``[N, H]`` of slots ``flat`` of one quantized tensor, ``codes`` ``[H, slots,
    D]``, ``scales`` ``[H, num_blocks, block_size]``."""
    taken = codes.index_select(1, flat)  # [H, N, D]
    scale = scales.view(codes.shape[0], -1).index_select(1, flat)  # [H, N]
    return taken.transpose(0, 1), scale.T


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
