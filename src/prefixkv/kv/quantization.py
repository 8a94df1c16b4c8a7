"""Quantized K/V storage: the math of 8-bit codes and their scales. No pool, no trie.

Quantized storage (``kv_dtype="int8"`` or ``"fp8"``): K and V are kept in 8 bits with one bfloat16 scale
per token and KV head (per layer, K and V apart), ``[kv_heads, num_blocks, block_size]`` beside the codes.
Each token is quantized once, when it is written, and never again: appending to a block leaves the tokens
already there as they are, and copy-on-write copies codes and scales exactly. Each token's head vector is
first turned by a fixed orthogonal matrix (:func:`turn`: a normalised Hadamard matrix when ``head_dim`` is a
power of two, a Hadamard-DCT product otherwise): K has a few channels far larger than the rest, which would
set the scale of every token and leave the other channels a handful of steps; turned, a token's size is
spread evenly over its channels. Then ``code = round(x / scale)`` (int8; fp8 rounds to the nearest e4m3),
``scale`` the token's absolute maximum over the largest code (127, or 448 for e4m3) rounded up to a bfloat16
(no code clips), and a read computes the codes turned back (:func:`turn_back`) times ``scale``. A token's
codes, scales and values read back depend on its own values alone, never on how many tokens are written or
read with it: the turns' sums are exact (:func:`turn`), everything else is elementwise. The scales cost
``2 / head_dim`` bytes per code byte. The pool (:mod:`prefixkv.kv.pool`) keeps the codes and scales and calls
:func:`quantize` as it writes and :func:`dequantize` as it reads.
"""

from __future__ import annotations

import functools
import math

import torch

KV_DTYPES = ("int8", "fp8")
"""The quantized storage modes; ``None`` keeps K/V in the pool's ``dtype``."""

# storage element type (fp8 codes are kept as their bytes: CPU index_copy_ has no float8 kernel), the
# type codes are computed in, the largest code, and a type in which the sums of codes that turning back takes
# are exact (int8: integers, |sum| <= 127 * head_dim < 2**24; e4m3: multiples of 2**-9 up to 448 * head_dim,
# which need up to 25 bits for heads of 128)
_CODES: dict[str, tuple[torch.dtype, torch.dtype, float, torch.dtype]] = {
    "int8": (torch.int8, torch.int8, 127.0, torch.float32),
    "fp8": (torch.uint8, torch.float8_e4m3fn, 448.0, torch.float64),
}
SCALE_DTYPE = torch.bfloat16
"""What a quantized pool keeps its scales in, one per token and KV head: float32's range in 2 bytes."""
_ROUND_UP = 1 + 2**-7  # a positive float32 times this, rounded to the nearest bfloat16, is not below it
_EXPONENT_BITS = 0x7FF0000000000000  # of a float64


def _split(head_dim: int) -> tuple[int, int]:
    """``head_dim`` as ``(p, m)``: its largest power-of-two factor ``p`` and the odd rest ``m``."""
    p = head_dim & -head_dim
    return p, head_dim // p


@functools.cache
def _signs(p: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Sylvester's ``[p, p]`` matrix of +1 and -1 (``p`` a power of two)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


@functools.cache
def _dct(m: int, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II of size ``m`` as ``[m, m]`` float32, ``x @ _dct(m)`` its coefficients."""
    n = torch.arange(m, dtype=torch.float64)
    dct = torch.cos(math.pi / m * (n[None, :] + 0.5) * n[:, None]) * math.sqrt(2 / m)
    dct[0] /= math.sqrt(2)
    return dct.T.contiguous().float().to(device)


def _mix(x: torch.Tensor, dct: torch.Tensor) -> torch.Tensor:
    """``[N, m, p]`` -> ``out[:, c] = sum_b x[:, b] * dct[b, c]``, summed elementwise in the order ``b = 0, 1, ...``
    (no matmul: each row's result is its own, whatever rows come with it)."""
    out = x[:, :1] * dct[0][None, :, None]
    for b in range(1, dct.shape[0]):
        out = out + x[:, b : b + 1] * dct[b][None, :, None]
    return out


def turn(x: torch.Tensor) -> torch.Tensor:
    """Head vectors ``[..., head_dim]`` turned by a fixed orthogonal matrix, in float32. With ``head_dim = p *
    m`` (``p`` its largest power-of-two factor, ``m`` odd), the matrix is the Kronecker product of the
    orthonormal DCT-II of size ``m`` and Sylvester's Hadamard matrix over ``sqrt(p)`` (the normalised Hadamard
    matrix when ``head_dim`` is a power of two). Fixed by ``head_dim`` alone, so saved files need no copy.

    Each vector's result is a function of its own values alone, bit for bit, whatever other vectors are
    turned with it and whatever kernel the machine picks (docs/memory.md, "A token's codes depend on its own
    values alone"): each block of ``p`` values is first rounded onto a grid of ``2**-(51 - log2 p)`` times the
    power of two above its largest value (far finer than any 8-bit code), so the Hadamard sums, taken by a
    matmul of integers of at most ``2**(51 - log2 p)`` and +-1 in float64, are exact in every order; the rest
    is elementwise.

    >>> x = torch.randn(5, 64)
    >>> bool(torch.equal(turn(x)[2:3], turn(x[2:3]))), bool(torch.allclose(turn_back(turn(x)), x, atol=1e-5))
    (True, True)
    """
    p, m = _split(x.shape[-1])
    bits = 51 - (p.bit_length() - 1)  # |integers| <= 2**bits, so p of them sum to at most 2**51: exact in float64
    rows = x.reshape(-1, m, p).double()
    top = rows.abs().amax(-1, keepdim=True)
    # the power of two just above the block's largest value, exactly: its exponent bits alone, doubled
    # (torch.frexp does the same but runs ~100x slower on CPU)
    unit = torch.where(top > 0, (top.view(torch.int64) & _EXPONENT_BITS).view(torch.float64) * 2, 1.0)
    ints = (rows * (2.0**bits / unit)).round_()  # scaling by powers of two is exact
    # + 0.0: an exact zero sum is +0.0 whatever the order (a sum of -0.0 terms may give either sign)
    turned = ((ints @ _signs(p, torch.float64, x.device) + 0.0) * (unit / 2.0**bits / math.sqrt(p))).float()
    if m > 1:
        turned = _mix(turned, _dct(m, x.device))
    return turned.reshape(x.shape)


def turn_back(y: torch.Tensor, exact: torch.dtype = torch.float64) -> torch.Tensor:
    """The inverse of :func:`turn` (its transpose) for float ``y`` ``[..., head_dim]``, in ``y``'s dtype: a
    Hadamard matmul whose sums are taken in ``exact`` (the pool passes codes, whose sums are exact in it, so
    each vector's result is its own bit for bit), then the DCT-II's transpose elementwise, over ``sqrt(p)``."""
    p, m = _split(y.shape[-1])
    rows = y.reshape(-1, m, p).to(exact)
    back = (rows @ _signs(p, exact, y.device) + 0.0).to(y.dtype)
    if m > 1:
        back = _mix(back, _dct(m, y.device).T.to(y.dtype))
    return (back * (1 / math.sqrt(p))).reshape(y.shape)


def check_kv_dtype(kv_dtype: str | None) -> None:
    """Raise ``ValueError`` unless ``kv_dtype`` names a storage mode. Does not mutate."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None (unquantized), 'int8' or 'fp8', got {kv_dtype!r}")


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of float32 ``x`` ``[..., kv_heads, head_dim]``: one scale per head, ``[..., kv_heads]``.
    Does not mutate ``x``."""
    store, code, top, _ = _CODES[kv_dtype]
    x = turn(x)
    scale = (x.abs().amax(dim=-1) / top * _ROUND_UP).to(SCALE_DTYPE)
    # an all-zero head keeps scale 0 (its codes are 0); dividing by 1 there avoids 0/0
    scaled = x / torch.where(scale > 0, scale, 1.0).to(torch.float32)[..., None]
    if code == torch.int8:
        return scaled.round_().clamp_(-top, top).to(torch.int8), scale
    return scaled.clamp_(-top, top).to(code).view(store), scale


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, kv_dtype: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes``: ``[..., kv_heads, head_dim]``, ``scale``: ``[..., kv_heads]`` -> values in ``dtype``."""
    _, code, _, exact = _CODES[kv_dtype]
    values = codes.view(code).to(torch.float32) if code != torch.int8 else codes.to(torch.float32)
    # turned back before scaling: the sums are then of codes, exact in ``exact``
    return (turn_back(values, exact) * scale.to(torch.float32)[..., None]).to(dtype)


def code_dtype(kv_dtype: str) -> torch.dtype:
    """The element type a quantized pool stores its codes in (fp8 codes as their bytes, ``uint8``)."""
    return _CODES[kv_dtype][0]
