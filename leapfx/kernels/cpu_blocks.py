"""Weights as GGUF blocks, and small-M products over them: ``leapfx_cpu::block_mm`` & co.

A GGUF file stores a linear layer's weight ``[N, K]`` as N rows of ``K / 32`` blocks of 32
weights. :class:`Blocks` holds such a weight as the file's bytes (``data``: uint8
``[N, K / 32 * block bytes]``, often a view of the memory-mapped file) with its format and
shape. Each block dequantizes to float32 as gguf's numpy code does (``gguf.quants``):

========  =====  ==============================================================================
format    bytes  32 weights from
========  =====  ==============================================================================
Q4_0      18     fp16 ``d`` + 16 bytes of 4-bit ``q``: ``w = d * (q - 8)``
Q4_1      20     fp16 ``d``, fp16 ``m`` + 16 bytes of 4-bit ``q``: ``w = d * q + m``
Q8_0      34     fp16 ``d`` + 32 int8 ``q``: ``w = q * d``
F16       64     32 halves; BF16 (64 bytes) and F32 (128) the same
========  =====  ==============================================================================

"Exact" means the kernels' weights are bitwise gguf's dequantized ones (``d * q`` is exact in
float32: 11 significant bits times at most 8; only Q4_1's ``+ m`` rounds, once, as numpy's
does), multiplied by float32 activations and summed in float32. So a product differs from
``x @ dequantize(w).T`` by summation order only (the tests compare at that tolerance), and a
prefill's is that product itself.

===================================  =============================================================
op                                   signature
===================================  =============================================================
``leapfx_cpu::block_mm``             ``(x [..., K] float32, data, fmt, n, k) -> [..., n]``:
                                     ``x @ W.T``; rows of ``x`` share each block's dequantization
                                     (up to 8 at a time); a prefill (32 or more rows of one
                                     sequence, ``x``'s second-to-last size) is ``at::mm`` over
                                     ``W`` dequantized, bitwise a float32 model's product
``leapfx_cpu::block_gated_mlp``      ``(x, gate, up, fmt, I, down, fmt, K)`` (data each):
                                     ``down(silu(x @ gate.T) * (x @ up.T))`` in one call
``leapfx_cpu::block_dequantize``     ``(data, fmt, n, k) -> [n, k]`` float32
``leapfx_cpu::block_rows``           ``(data, fmt, n, k, index [...]) -> [..., k]``: rows of W
                                     dequantized (an embedding lookup)
``leapfx_cpu::block_decoder_layer``  ``(h [B, S, H], norms, q, k, v, o, gate, up, down blocks,
                                     k_cache, v_cache, start, cos, sin, positions, scale,
                                     starts=None, first=None)``: a Llama decoder layer in one
                                     call, its keys and values written into the cache buffers at
                                     slots ``start ..`` (a batch's ragged rows: row b's at
                                     ``starts[b] ..``, attending from ``first[b]``); bitwise the
                                     eager kernel layer's numbers (``modules.kernel_layers``)
===================================  =============================================================

:func:`quantize` writes a float32 weight as Q8_0, Q4_0 or Q4_1 blocks, bitwise as gguf's numpy
``quantize`` (ggml's reference rounding) does: a quantized copy of a float model
(``leapfx.passes.quantized_draft``).

``fmt`` is ggml's type id (:data:`FORMATS`). The kernels (``cpu_blocks.cpp``) need AVX2 and F16C;
built like :mod:`leapfx.kernels.cpu`'s (their own extension, first use). Without them,
:func:`dequantize` (torch ops, the same floats) and ``torch.matmul`` stand in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import cpu

WEIGHTS_PER_BLOCK = 32


@dataclass(frozen=True)
class Format:
    name: str
    type_id: int  # ggml's (gguf.GGMLQuantizationType)
    block_bytes: int


FORMATS = {
    f.name: f
    for f in (
        Format("F32", 0, 128),
        Format("F16", 1, 64),
        Format("Q4_0", 2, 18),
        Format("Q4_1", 3, 20),
        Format("Q8_0", 8, 34),
        Format("BF16", 30, 64),
    )
}


@functools.cache
def available() -> bool:
    """True once the ``leapfx_cpu::block_*`` ops are built and registered (first call)."""
    return cpu.load_ops("blocks", "block_mm", "dequantizing, then torch.matmul", _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("leapfx_cpu::block_mm")
    def _mm_fake(x, w, fmt: int, n: int, k: int):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("leapfx_cpu::block_gated_mlp")
    def _mlp_fake(x, w_gate, w_up, fmt_gu: int, i: int, w_down, fmt_down: int, k_out: int):
        return x.new_empty((*x.shape[:-1], k_out))

    @torch.library.register_fake("leapfx_cpu::block_dequantize")
    def _dq_fake(w, fmt: int, n: int, k: int):
        return w.new_empty((n, k), dtype=torch.float32)

    @torch.library.register_fake("leapfx_cpu::block_rows")
    def _rows_fake(w, fmt: int, n: int, k: int, index):
        return w.new_empty((*index.shape, k), dtype=torch.float32)

    @torch.library.register_fake("leapfx_cpu::block_decoder_layer")
    def _layer_fake(h, *args):
        return h.new_empty(h.shape)


@dataclass(frozen=True)
class Blocks:
    """A ``[n, k]`` weight as GGUF blocks: ``data`` uint8 ``[n, k / 32 * block bytes]``."""

    data: torch.Tensor
    fmt: str
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"Blocks: format {self.fmt!r} is not one of {', '.join(FORMATS)}")
        row = self.k // WEIGHTS_PER_BLOCK * FORMATS[self.fmt].block_bytes
        if (
            self.k % WEIGHTS_PER_BLOCK
            or self.data.dtype != torch.uint8
            or tuple(self.data.shape) != (self.n, row)
        ):
            raise ValueError(
                f"Blocks: data {tuple(self.data.shape)} {self.data.dtype} does not hold "
                f"[{self.n}, {self.k}] in {self.fmt} (uint8 [{self.n}, {row}] and k a multiple "
                f"of {WEIGHTS_PER_BLOCK} expected)"
            )

    @property
    def type_id(self) -> int:
        return FORMATS[self.fmt].type_id

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> Blocks:
        """The rows ``index`` [r] as blocks of their own (a copy)."""
        data = self.data.index_select(0, index.to(device=self.data.device, dtype=torch.long))
        return Blocks(data, self.fmt, data.shape[0], self.k)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Rows of weights sharing a format and ``k``, stacked (a copy): [q | k | v] etc."""
        fmt, k = parts[0].fmt, parts[0].k
        if any(p.fmt != fmt or p.k != k for p in parts):
            raise ValueError(
                "Blocks.cat: every part must share a format and k; got "
                + ", ".join(f"{p.fmt} [{p.n}, {p.k}]" for p in parts)
            )
        data = torch.cat([p.data for p in parts]).contiguous()
        return Blocks(data, fmt, data.shape[0], k)


def dequantize(w: Blocks) -> torch.Tensor:
    """``w`` as float32 ``[n, k]``: gguf's numpy dequantization in torch ops (the same floats;
    the reference the kernels are tested against)."""
    return _dequantize_bytes(w.data.reshape(-1, FORMATS[w.fmt].block_bytes), w.fmt).reshape(
        w.n, w.k
    )


def _half(b: torch.Tensor) -> torch.Tensor:  # [B, 2] uint8 -> [B, 1] float32
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [B, 16] uint8 -> [B, 32]: low, then high
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _dequantize_bytes(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """Blocks ``b`` [B, block bytes] -> float32 [B, 32], the operations of ``gguf.quants``."""
    if fmt == "F32":
        return b.contiguous().view(torch.float32)
    if fmt == "F16":
        return b.contiguous().view(torch.float16).to(torch.float32)
    if fmt == "BF16":
        return b.contiguous().view(torch.bfloat16).to(torch.float32)
    if fmt == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _half(b[:, :2])
    if fmt == "Q4_0":
        q = (_nibbles(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)
        return _half(b[:, :2]) * q
    if fmt == "Q4_1":
        q = _nibbles(b[:, 4:]).to(torch.float32)
        return _half(b[:, :2]) * q + _half(b[:, 2:4])
    raise ValueError(f"dequantize: format {fmt!r} is not one of {', '.join(FORMATS)}")


def block_mm(x: torch.Tensor, w: Blocks) -> torch.Tensor:
    """``x @ dequantize(w).T`` through the kernel (float32 CPU ``x``); without the kernels,
    dequantized, then ``torch.matmul``."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and available():
        return torch.ops.leapfx_cpu.block_mm(x, w.data, w.type_id, w.n, w.k)
    return torch.matmul(x, dequantize(w).to(x.dtype).t())


QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")  # formats :func:`quantize` writes


def quantize(weight: torch.Tensor, fmt: str) -> Blocks:
    """``weight`` [n, k] (k a multiple of 32) as ``fmt`` blocks: gguf's numpy ``quantize``
    (ggml's reference quantization, ``quantize_row_*_ref``) in torch ops, the same bytes.

    >>> quantize(torch.randn(8, 64), "Q4_0").nbytes   # 8 rows of 2 blocks of 18 bytes
    288
    """
    if fmt not in QUANTIZABLE:
        raise ValueError(f"quantize: format {fmt!r} is not one of {', '.join(QUANTIZABLE)}")
    n, k = weight.shape
    if k % WEIGHTS_PER_BLOCK:
        raise ValueError(f"quantize: k = {k} is not a multiple of {WEIGHTS_PER_BLOCK}")
    b = weight.detach().to(device="cpu", dtype=torch.float32).reshape(-1, WEIGHTS_PER_BLOCK)
    if fmt == "Q8_0":
        d = b.abs().amax(dim=1, keepdim=True) / 127
        q = _roundf(b * _inverse(d)).to(torch.int8).view(torch.uint8)
        parts = [_half_bytes(d), q]
    elif fmt == "Q4_0":
        top = b.gather(1, b.abs().argmax(dim=1, keepdim=True))  # the signed value of max |w|
        d = top / -8
        q = torch.trunc(b * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)
        parts = [_half_bytes(d), _pack_nibbles(q)]
    else:  # Q4_1
        low, high = b.amin(dim=1, keepdim=True), b.amax(dim=1, keepdim=True)
        d = (high - low) / 15
        q = torch.trunc((b - low) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 15)
        parts = [_half_bytes(d), _half_bytes(low), _pack_nibbles(q)]
    data = torch.cat(parts, dim=1).reshape(n, -1).contiguous()
    return Blocks(data, fmt, n, k)


def _inverse(d: torch.Tensor) -> torch.Tensor:  # 1 / d, 0 where d is 0 (an all-zero block)
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _roundf(x: torch.Tensor) -> torch.Tensor:  # C's roundf: halves away from zero
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _half_bytes(x: torch.Tensor) -> torch.Tensor:  # [B, 1] float32 -> [B, 2] uint8 (fp16)
    return x.to(torch.float16).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:  # [B, 32] 0..15 -> [B, 16]: low, then high
    return q[:, :16] | (q[:, 16:] << 4)
