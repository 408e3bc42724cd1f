"""Memory passes used inside operators' pack kernels: fp32 -> fp16 casts (flat or transposing,
returning the largest |value| they converted for the fp16 range guard), zero fills, fixed-order
column sums of per-program partial rows, and the guard's tile maximum.

A flat pass's program handles one chunk of BLOCK * ITERS elements, BLOCK at a time, so that a pass
over a large tensor needs few programs (`kernels/schedule.py: chunks` counts them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def max_abs(x):
    """Largest |x| over a tile, for the fp16 range guard (`backfuse/fp16_guard.py`). (NaN needs no
    check: the kernels make none from finite fp16 operands, and NaN inputs give NaN outputs, as in
    the reference.)"""
    return tl.max(tl.abs(x))


@triton.jit
def cast_chunk(src, dst, n, chunk, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst[i] = fp16(src[i]) over chunk `chunk` (of n elements); returns the chunk's largest |src[i]|."""
    base = chunk.to(tl.int64) * (BLOCK * ITERS)
    largest = tl.zeros((BLOCK,), dtype=tl.float32)  # elementwise: one reduction at the end, not per step
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0.0)
        tl.store(dst + offs, x.to(tl.float16), mask=mask)
        largest = tl.maximum(largest, tl.abs(x))
    return tl.max(largest)


@triton.jit
def zero_chunk(dst, n, chunk, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """dst[i] = 0 over chunk `chunk` (of n elements)."""
    base = chunk.to(tl.int64) * (BLOCK * ITERS)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.zeros((BLOCK,), dtype=dst.dtype.element_ty), mask=offs < n)


@triton.jit
def transpose_tile(w, wt16, tile, N: tl.constexpr, T: tl.constexpr):
    """wt16 = fp16(w^T) on one [T, T] tile of a square [N, N] matrix (tiles row-major); returns the
    tile's largest |w|."""
    i = (tile // (N // T)) * T + tl.arange(0, T)
    j = (tile % (N // T)) * T + tl.arange(0, T)
    x = tl.load(w + i[:, None] * N + j[None, :])
    tl.store(wt16 + j[:, None] * N + i[None, :], tl.trans(x).to(tl.float16))
    return max_abs(x)


@triton.jit
def column_sums(parts, n_parts, width, cols, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr):
    """Column sums over the n_parts rows of parts[n_parts, width] for columns cols ([SUM_COLS]), in a
    fixed order (so the result is the same every call), SUM_ROWS rows at a time. The rows are read
    from L2 (.cg): other programs of the same launch may have written them (after a counter said so)."""
    total = tl.zeros((SUM_ROWS, SUM_COLS), dtype=tl.float32)
    for part in range(0, n_parts, SUM_ROWS):
        rows = part + tl.arange(0, SUM_ROWS)
        total += tl.load(parts + rows[:, None] * width + cols[None, :], mask=rows[:, None] < n_parts, other=0.0,
                         cache_modifier=".cg")
    return tl.sum(total, 0)
