"""Gemma's per-head query/key RMSNorm followed by rotate-half RoPE, forward and backward, on token-major
rows (the training paths of 037; NORM False: RoPE alone, as Gemma 2 has no QK norm). (Wan's norm across the
heads with RoPE on interleaved pairs is a row pass: `passes.py: row_norm_kernel`.)

For one head's row x (D features, halves lo = x[:D/2], hi = x[D/2:]):
    r = 1 / sqrt(mean(x^2) + eps),  n = x r,  y = n (1 + w)                 (RMSNorm, Gemma's 1 + w)
    out_lo = y_lo cos_lo - y_hi sin_lo,  out_hi = y_hi cos_hi + y_lo sin_hi  (y cos + rot(y) sin)
Backward from d(out):
    dy_lo = dout_lo cos_lo + dout_hi sin_hi,  dy_hi = dout_hi cos_hi - dout_lo sin_lo
    grad_w = sum over rows of dy * n;  m = dy (1 + w);  dx = r (m - n mean(m n))
cos and sin have a row per token, or per position shared by every batch entry: token t reads row
t % cos_rows. Grid (token blocks of BT, heads).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import fold, largest, narrow


@triton.jit
def _columns(D: tl.constexpr):
    """The columns of a head's lo and hi halves."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    return d, HALF + d


@triton.jit
def _halves(base, tok, ok, LD: tl.constexpr, column, D: tl.constexpr):
    """The [BT, D/2] lo and hi halves of a head's rows, in fp32."""
    lo, hi = _columns(D)
    rows = base + tok.to(tl.int64)[:, None] * LD + column
    return (tl.load(rows + lo[None, :], mask=ok[:, None], other=0.0).to(tl.float32),
            tl.load(rows + hi[None, :], mask=ok[:, None], other=0.0).to(tl.float32))


@triton.jit
def _store_halves(base, tok, ok, LD: tl.constexpr, column, D: tl.constexpr, lo, hi):
    c_lo, c_hi = _columns(D)
    rows = base + tok.to(tl.int64)[:, None] * LD + column
    tl.store(rows + c_lo[None, :], narrow(lo, base.dtype.element_ty), mask=ok[:, None])
    tl.store(rows + c_hi[None, :], narrow(hi, base.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _tables(cos, sin, row, ok, D: tl.constexpr):
    """(cos_lo, cos_hi, sin_lo, sin_hi) of the rows `row` of the tables [rows, D]."""
    c_lo, c_hi = _halves(cos, row, ok, D, 0, D)
    s_lo, s_hi = _halves(sin, row, ok, D, 0, D)
    return c_lo, c_hi, s_lo, s_hi


@triton.jit(do_not_specialize=["T", "cos_rows"])
def norm_rope_kernel(x, w, cos, sin, out, T, cos_rows, eps, D: tl.constexpr, LD_X: tl.constexpr, LD_OUT: tl.constexpr,
                     BT: tl.constexpr, NORM: tl.constexpr):
    """out = RoPE(RMSNorm(x) (1 + w)) (NORM) or RoPE(x) of one head (program_id(1)) over BT tokens. out may be
    x (in place)."""
    h = tl.program_id(1)
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = tok < T
    y_lo, y_hi = _halves(x, tok, ok, LD_X, h * D, D)
    if NORM:
        r = tl.rsqrt((tl.sum(y_lo * y_lo, 1) + tl.sum(y_hi * y_hi, 1)) / D + eps)[:, None]
        w_lo, w_hi = _halves(w, tl.zeros((1,), dtype=tl.int32), tl.full((1,), True, tl.int1), D, 0, D)
        y_lo, y_hi = y_lo * r * (1.0 + w_lo), y_hi * r * (1.0 + w_hi)
    c_lo, c_hi, s_lo, s_hi = _tables(cos, sin, tok % cos_rows, ok, D)
    _store_halves(out, tok, ok, LD_OUT, h * D, D, y_lo * c_lo - y_hi * s_lo, y_hi * c_hi + y_lo * s_hi)


@triton.jit(do_not_specialize=["T", "cos_rows", "r_dx"])
def norm_rope_backward_kernel(dout, x, w, cos, sin, dx, parts, ranges, T, cos_rows, eps, r_dx, D: tl.constexpr,
                              LD_DOUT: tl.constexpr, LD_X: tl.constexpr, LD_DX: tl.constexpr, BT: tl.constexpr,
                              RANGES: tl.constexpr, NORM: tl.constexpr):
    """dx of one head (program_id(1)) over BT tokens, and (NORM) this block's share of grad_w in
    parts[head * token blocks + block] (summed in order afterwards: the same bits every call). dx may be
    dout (in place): a program reads the rows it writes, and only those, before it writes them."""
    h = tl.program_id(1)
    block = tl.program_id(0)
    tok = block * BT + tl.arange(0, BT)
    ok = tok < T
    g_lo, g_hi = _halves(dout, tok, ok, LD_DOUT, h * D, D)
    c_lo, c_hi, s_lo, s_hi = _tables(cos, sin, tok % cos_rows, ok, D)
    dx_lo, dx_hi = g_lo * c_lo + g_hi * s_hi, g_hi * c_hi - g_lo * s_lo
    if NORM:
        lo, hi = _halves(x, tok, ok, LD_X, h * D, D)
        r = tl.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / D + eps)[:, None]
        n_lo, n_hi = lo * r, hi * r
        row = parts + (h * tl.num_programs(0) + block).to(tl.int64) * D
        col_lo, col_hi = _columns(D)
        tl.store(row + col_lo, tl.sum(dx_lo * n_lo, 0))
        tl.store(row + col_hi, tl.sum(dx_hi * n_hi, 0))
        w_lo, w_hi = _halves(w, tl.zeros((1,), dtype=tl.int32), tl.full((1,), True, tl.int1), D, 0, D)
        m_lo, m_hi = dx_lo * (1.0 + w_lo), dx_hi * (1.0 + w_hi)
        mean = ((tl.sum(m_lo * n_lo, 1) + tl.sum(m_hi * n_hi, 1)) / D)[:, None]
        dx_lo, dx_hi = r * (m_lo - n_lo * mean), r * (m_hi - n_hi * mean)
    _store_halves(dx, tok, ok, LD_DX, h * D, D, dx_lo, dx_hi)
    if RANGES:
        fold(ranges, r_dx, tl.maximum(largest(dx_lo), largest(dx_hi)))
