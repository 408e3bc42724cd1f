"""fp16-operand, fp32-accumulate matrix tiles: the building block of every projection product.

Operators write one kernel each that maps its programs onto the products it needs and calls these
device functions, with the constant widths of the model passed as constexpr so that Triton knows
the contiguous dimension and alignment of every operand (16-byte loads, wgmma on Hopper). Their
host side (tile counts, K splits, launch order) is `kernels/schedule.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma_tile(
    a_ptr,
    b_ptr,
    off_m,
    off_n,
    M,
    N,
    k_lo,
    k_hi,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr = None,
):
    """A[off_m:+BM, k_lo:k_hi] @ B[k_lo:k_hi, off_n:+BN] with fp16 operands, as a [BM, BN] fp32 tile.
    A or B may also be fp32 in memory: rounded to fp16 on the way to the tensor cores.

    Any layout works through the strides; rows past M, columns past N and k past k_hi read zeros.
    STAGES: the K loop's software-pipeline depth (None: the launch's num_stages).
    """
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + (k_lo + rk)[None, :].to(tl.int64) * stride_ak
    b_ptrs = b_ptr + (k_lo + rk)[:, None].to(tl.int64) * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        k_ok = (k + rk) < k_hi
        a = tl.load(a_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)  # fp32 operands are rounded as they stream in
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    return acc


@triton.jit
def tma_tile(a_desc, b_desc, a_row, b_row, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr = None):
    """A[a_row:+BM, k_lo:k_hi] @ B[b_row:+BN, k_lo:k_hi]^T as a [BM, BN] fp32 tile, both operands
    row-major fp16 read through TMA tensor descriptors (blocks [BM, BK] and [BN, BK]); rows past a
    descriptor's shape read zeros. STAGES: the K loop's pipeline depth (None: the launch's num_stages).

    Persistent programs that loop over tiles with this body, the tile loop flattened
    (`tl.range(..., flatten=True)`), keep the next tile's loads in flight during an epilogue:
    the study `git show a0074fa:benchmarks/experiments/persistent_products.py` measured 590 against 471 TFLOP/s for one program per
    128 x 128 tile at 8192 x 1024 x 1024.
    """
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        acc = tl.dot(a_desc.load([a_row, k]), b_desc.load([b_row, k]).T, acc)
    return acc


@triton.jit
def store_tile(c_ptr, acc, off_m, off_n, M, N, stride_cm, stride_cn, accumulate, BM: tl.constexpr, BN: tl.constexpr):
    """Write (or, for split-K partial sums, atomically add) a [BM, BN] fp32 tile, masked at the edges."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :].to(tl.int64) * stride_cn
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if accumulate:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def tile_coords(local, M, N, K, splits, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """(off_m, off_n, k_lo, k_hi) of tile `local` of C[M, N] = A[M, K] @ B[K, N] split `splits` ways.

    Tiles run n fastest, then m, then split, so neighbouring programs share A's row block; each
    split owns a BK-aligned slice of K.
    """
    tiles_m = (M + BM - 1) // BM
    tiles_n = (N + BN - 1) // BN
    tn = local % tiles_n
    tm = (local // tiles_n) % tiles_m
    split = local // (tiles_n * tiles_m)
    per_split = ((K + splits - 1) // splits + BK - 1) // BK * BK
    k_lo = split * per_split
    return tm * BM, tn * BN, k_lo, tl.minimum(K, k_lo + per_split)


@triton.jit
def gemm_tile(
    local,
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    splits,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Tile `local` (numbered as in tile_coords) of C[M, N] (+)= A[M, K] @ B[K, N], K split `splits`
    ways (C pre-zeroed if splits > 1)."""
    off_m, off_n, k_lo, k_hi = tile_coords(local, M, N, K, splits, BM, BN, BK)
    acc = mma_tile(a_ptr, b_ptr, off_m, off_n, M, N, k_lo, k_hi,
                   stride_am, stride_ak, stride_bk, stride_bn, BM, BN, BK)
    store_tile(c_ptr, acc, off_m, off_n, M, N, stride_cm, 1, splits > 1, BM, BN)
