"""Flat memory passes used inside operators' prologue kernels: fp32 -> fp16 casts and zero fills.

A program handles one chunk of BLOCK * ITERS elements, BLOCK at a time, so that a pass over a
large tensor needs few programs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_chunk(src, dst, n, chunk, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst[i] = fp16(src[i]) over chunk `chunk` (of n elements)."""
    base = chunk.to(tl.int64) * (BLOCK * ITERS)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float16), mask=mask)


@triton.jit
def zero_chunk(dst, n, chunk, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst[i] = 0 over chunk `chunk` (of n elements)."""
    base = chunk.to(tl.int64) * (BLOCK * ITERS)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.zeros((BLOCK,), dtype=dst.dtype.element_ty), mask=offs < n)


def chunks(n: int, block: int, iters: int) -> int:
    """Programs a flat pass over n elements needs."""
    return triton.cdiv(n, block * iters)
