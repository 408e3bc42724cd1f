"""Memory passes of the training paths: casts to the products' dtype (with the fp16 guard's power-of-two
scale of the upstream gradients), heads-to-tokens sums, column sums, the scale's undoing on the
outputs, and the guard's check of a call's maxima. Each reads the device-side guard state
(`backfuse/train/guard.py`: STATE_FIELDS) where it needs the scale, so that a call's graph is the same
whatever scale it runs at and the host never reads anything back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import fold, largest, narrow

# The guard state's fields (float32 on the device), in `backfuse/train/guard.py`'s order.
_USED = tl.constexpr(0)  # the exponent k this call scales its upstream gradients by (2^k); the last call's until decided
_AMAX = tl.constexpr(1)  # this call's largest |upstream gradient| (measured as they are cast)
_RHO_MAX = tl.constexpr(2)  # the last call's log2 of the largest |linear tensor| over the upstream's largest
_RHO_MIN = tl.constexpr(3)  # ... of the smallest such maximum of a tensor checked for underflow
_REDO = tl.constexpr(4)  # 1 where this call's upstream gradients did not fit the last call's k: cast again at _USED
FP16_MAX = tl.constexpr(65504.0)
SMALLEST_SAFE = tl.constexpr(2.0**-12)
# Bits of room kept at both ends of the safe range when choosing an exponent, so that the tensors formed
# from the upstream gradients, whose sizes relative to them drift from step to step, stay inside it.
MARGIN = tl.constexpr(4.0)


@triton.jit(do_not_specialize=["r0", "r1", "r2"])
def decide_kernel(state, ranges, r0, r1, r2):
    """One program after an op's upstream gradients were cast at the last call's exponent (state[_USED]),
    their largest |value| a in state[_AMAX]: this call's exponent k, from a and how large the tensors formed
    from them were relative to a in the last call (rho). Among the k where every such tensor fits fp16's safe
    range with MARGIN bits to spare at both ends (without the margins where none does): 0 where that is one
    of them, else the last call's where it is one, else the one nearest to bringing a into [1, 2). Where k is
    not the last call's, state[_USED] = k, state[_REDO] = 1 and the casts' regions r0..r2 (< 0: none) are
    cleared for the second casts (`cast_kernel` REDO) to fill; else state[_REDO] = 0. (a = 0, Inf or NaN:
    the last call's k; every k gives the same.)"""
    amax = tl.load(state + _AMAX)
    last = tl.load(state + _USED)
    a = tl.log2(tl.maximum(amax, 1e-38))
    high = tl.floor(tl.log2(FP16_MAX) - a - tl.load(state + _RHO_MAX))
    low = tl.ceil(tl.log2(SMALLEST_SAFE) - a - tl.load(state + _RHO_MIN))
    roomy = low + 2 * MARGIN <= high
    low = tl.where(roomy, low + MARGIN, low)
    high = tl.where(roomy, high - MARGIN, high)
    k = tl.minimum(tl.maximum(-tl.floor(a), low), high)
    k = tl.where((low <= last) & (last <= high), last, k)
    k = tl.where((low <= 0.0) & (0.0 <= high), 0.0, k)
    k = tl.where((amax == 0.0) | (amax != amax) | (amax > 3.0e38), last, k)
    redo = k != last
    tl.store(state + _REDO, redo.to(tl.float32))
    if redo:
        tl.store(state + _USED, k)
        if r0 >= 0:
            tl.store(ranges + r0, 0.0)
        if r1 >= 0:
            tl.store(ranges + r1, 0.0)
        if r2 >= 0:
            tl.store(ranges + r2, 0.0)


@triton.jit(do_not_specialize=["n", "r"])
def cast_kernel(src, dst, ranges, state, n, r, BLOCK: tl.constexpr, UPSTREAM: tl.constexpr, REDO: tl.constexpr,
                RANGES: tl.constexpr):
    """dst = src in dst's dtype, flat. UPSTREAM: times 2^k, k = state[_USED] (the last call's exponent), and
    the largest |src| into state[_AMAX] for `decide_kernel`; with REDO instead: the second cast, after it,
    which exits at once unless state[_REDO] (and then casts at the k decided). RANGES: the largest |value|
    converted goes to ranges[r]."""
    if REDO:
        if tl.load(state + _REDO) == 0.0:
            return
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    if UPSTREAM:
        if not REDO:
            tl.atomic_max(state + _AMAX, largest(x))
        x = x * tl.exp2(tl.load(state + _USED))
    tl.store(dst + offs, narrow(x, dst.dtype.element_ty), mask=ok)
    if RANGES:
        fold(ranges, r, largest(x))


@triton.jit(do_not_specialize=["S", "stride_b", "stride_h", "stride_s", "r"])
def heads_to_tokens_kernel(src, dst, ranges, state, S, stride_b, stride_h, stride_s, r,
                           GROUP: tl.constexpr, D: tl.constexpr, HEADS_OUT: tl.constexpr, LD: tl.constexpr,
                           BT: tl.constexpr, UPSTREAM: tl.constexpr, REDO: tl.constexpr, RANGES: tl.constexpr):
    """dst[b * S + s, j * D + d] = sum over g < GROUP of src[b, j * GROUP + g, s, d] (src: any strides of
    its first three axes, its last contiguous), in fp32, stored in dst's dtype (token-major, rows LD
    apart, HEADS_OUT heads); UPSTREAM and REDO as `cast_kernel` (the largest |src| of any head goes to
    state[_AMAX]). Grid (token blocks of BT, B * HEADS_OUT)."""
    if REDO:
        if tl.load(state + _REDO) == 0.0:
            return
    bj = tl.program_id(1)
    b = bj // HEADS_OUT
    j = bj % HEADS_OUT
    s = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = s < S
    d = tl.arange(0, D)
    acc = tl.zeros((BT, D), dtype=tl.float32)
    top = 0.0
    for g in range(GROUP):
        base = src + b.to(tl.int64) * stride_b + (j * GROUP + g).to(tl.int64) * stride_h
        x = tl.load(base + s.to(tl.int64)[:, None] * stride_s + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        acc += x
        if UPSTREAM and not REDO:
            top = tl.maximum(top, largest(x))
    if UPSTREAM:
        if not REDO:
            tl.atomic_max(state + _AMAX, top)
        acc = acc * tl.exp2(tl.load(state + _USED))
    tok = (b * S + s).to(tl.int64)
    tl.store(dst + tok[:, None] * LD + j * D + d[None, :], narrow(acc, dst.dtype.element_ty), mask=ok[:, None])
    if RANGES:
        fold(ranges, r, largest(acc))


@triton.jit(do_not_specialize=["T"])
def repeat_heads_kernel(src, dst, T, GROUP: tl.constexpr, D: tl.constexpr, LD_SRC: tl.constexpr,
                        LD_DST: tl.constexpr, BT: tl.constexpr):
    """dst[t, (j * GROUP + g) * D + d] = src[t, j * D + d] for g < GROUP: each KV head's rows written
    once per query head it serves (token-major, rows LD_* apart). Grid (token blocks of BT, KV heads)."""
    j = tl.program_id(1)
    tok = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    ok = (tok < T)[:, None]
    d = tl.arange(0, D)
    x = tl.load(src + tok[:, None] * LD_SRC + j * D + d[None, :], mask=ok, other=0.0)
    for g in tl.static_range(GROUP):
        tl.store(dst + tok[:, None] * LD_DST + (j * GROUP + g) * D + d[None, :], x, mask=ok)


@triton.jit(do_not_specialize=["R", "C", "rows_per_program"])
def column_partials_kernel(x, parts, R, C, rows_per_program, LD: tl.constexpr, ROWS: tl.constexpr,
                           COLS: tl.constexpr):
    """parts[p, c] = sum of x[i, c] over program p's rows (rows_per_program of them, ROWS at a time,
    in order): grid (row groups, column strips of COLS)."""
    p = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    col_ok = cols < C
    acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    start = p * rows_per_program
    end = tl.minimum(start + rows_per_program, R)  # (a last step may reach past the program's rows: masked)
    for i in range(start, end, ROWS):
        rows = i + tl.arange(0, ROWS)
        ok = (rows < end)[:, None] & col_ok[None, :]
        acc += tl.load(x + rows.to(tl.int64)[:, None] * LD + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(parts + p * C + cols, tl.sum(acc, 0), mask=col_ok)


@triton.jit(do_not_specialize=["n_parts", "C"])
def column_finish_kernel(parts, out, state, n_parts, C, ROWS: tl.constexpr, COLS: tl.constexpr,
                         UNSCALE: tl.constexpr):
    """out[c] = sum over the n_parts rows of parts (in order; the same bits every call), stored in
    out's dtype; UNSCALE: times 2^-k, k this call's exponent (the upstream gradients' scale undone)."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    col_ok = cols < C
    acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    for i in range(0, n_parts, ROWS):
        rows = i + tl.arange(0, ROWS)
        acc += tl.load(parts + rows[:, None] * C + cols[None, :], mask=(rows < n_parts)[:, None] & col_ok[None, :],
                       other=0.0)
    total = tl.sum(acc, 0)
    if UNSCALE:
        total = total * tl.exp2(-tl.load(state + _USED))
    tl.store(out + cols, narrow(total, out.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["n"])
def unscale_kernel(x, state, n, BLOCK: tl.constexpr):
    """x *= 2^-k in place, k this call's exponent; every program returns at once when k = 0."""
    k = tl.load(state + _USED)
    if k != 0.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        y = tl.load(x + offs, mask=ok, other=0.0).to(tl.float32) * tl.exp2(-k)
        tl.store(x + offs, narrow(y, x.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_regions"])
def guard_check_kernel(maxima, flags, state, log, n_regions, R: tl.constexpr, SCALED: tl.constexpr):
    """One program at the end of a call: checks each region's largest |value| (maxima, as rounded to
    fp16, so scaled by this call's 2^k where linear) against fp16's safe range, records the regions
    out of range in the host-visible log, keeps (SCALED) how large the linear tensors were relative to
    the upstream gradients for the next call's exponent (`decide_kernel`), and resets the maxima.

    flags per region: 1 linear in the upstream gradients, 2 checked for underflow (4, the upstream
    gradients themselves, is the state's own measure here). log (pinned host memory): [calls, regions found
    out of range in all, then per
    region: calls it was out of range in, the last such call, its largest |value| unscaled]. A linear
    tensor that overflowed to Inf counts as 2^2 times larger than what fp16 holds at this call's scale."""
    i = tl.arange(0, R)
    ok = i < n_regions
    m = tl.load(maxima + i, mask=ok, other=0.0)
    f = tl.load(flags + i, mask=ok, other=0).to(tl.int32)
    tl.store(maxima + i, tl.zeros((R,), dtype=tl.float32), mask=ok)
    linear = (f & 1) != 0
    under = (f & 2) != 0
    k = 0.0
    if SCALED:
        k = tl.load(state + _USED)
    unscaled = tl.where(linear, m * tl.exp2(-k), m)
    bad = ok & ((m > FP16_MAX) | (m != m) | (under & (m > 0.0) & (m < SMALLEST_SAFE)))
    call = tl.load(log)
    n_bad = tl.load(log + 2 + 3 * i, mask=ok, other=0.0)
    tl.store(log + 2 + 3 * i, n_bad + 1.0, mask=bad)
    tl.store(log + 3 + 3 * i, tl.zeros((R,), dtype=tl.float32) + call, mask=bad)
    tl.store(log + 4 + 3 * i, unscaled, mask=bad)
    tl.store(log + 1, tl.load(log + 1) + tl.sum(bad.to(tl.float32), 0))
    tl.store(log, call + 1.0)
    if SCALED:
        top = tl.load(state + _AMAX)
        finite = (m == m) & (m < float("inf"))
        measured = linear & ok & finite & (unscaled > 0.0)
        t = tl.log2(tl.maximum(top, 1e-38))
        rho = tl.where(measured, tl.log2(tl.where(measured, unscaled, 1.0)) - t, 0.0)
        rho = tl.where(linear & ok & ~finite, tl.log2(FP16_MAX) - k - t + 2.0, rho)
        if (top > 0.0) & (top < 3.0e38):
            tl.store(state + _RHO_MAX, tl.max(tl.where(linear & ok & (measured | ~finite), rho, 0.0), 0))
            tl.store(state + _RHO_MIN, tl.min(tl.where(measured & under, rho, 0.0), 0))
        tl.store(state + _AMAX, 0.0)


@triton.jit
def _turn_pairs(y, cos, sin, rows, ok, cos_rows, BT: tl.constexpr, BW: tl.constexpr, W: tl.constexpr,
                D: tl.constexpr, BACK: tl.constexpr):
    """Rows y [BT, BW] (columns W of BW) turned by RoPE on interleaved pairs, head by head of D columns, as
    diffusers' `apply_rotary_emb` turns Wan's q and k: pair i = columns (2i, 2i + 1) turns by cos[t, 2i mod D] and
    sin[t, 2i mod D + 1] of the tables [cos_rows, D] (read in fp32; row t = token mod cos_rows, a position shared by the
    batch's entries); BACK: the transpose (the angle negated), the backward's."""
    lo, hi = tl.split(tl.reshape(y, (BT, BW // 2, 2)))
    i = tl.arange(0, BW // 2)
    at = (rows % cos_rows)[:, None] * D + ((2 * i) % D)[None, :]
    pair_ok = ok[:, None] & (2 * i < W)[None, :]
    c = tl.load(cos + at, mask=pair_ok, other=0.0).to(tl.float32)
    s = tl.load(sin + at + 1, mask=pair_ok, other=0.0).to(tl.float32)
    if BACK:
        s = -s
    return tl.reshape(tl.join(lo * c - hi * s, hi * c + lo * s), (BT, BW))


@triton.jit(do_not_specialize=["T", "cos_rows"])
def row_norm_kernel(x, w, out, rstd, cos, sin, T, cos_rows, eps, W: tl.constexpr, BW: tl.constexpr,
                    LD_X: tl.constexpr, LD_OUT: tl.constexpr, BT: tl.constexpr, RSTD: tl.constexpr,
                    NORM: tl.constexpr, ROPE: tl.constexpr):
    """out = x r w over each row's W features, r = 1 / sqrt(mean(x^2) + eps) (an RMSNorm across all heads,
    as Wan's attentions apply to q and k), BT rows per program, in fp32; ROPE (a head size, 0: none): then turned
    by RoPE on interleaved pairs (`_turn_pairs`, Wan's self-attention); NORM False: out = the turn of x alone.
    RSTD: r into rstd [T] instead (the attention applies the norm as it loads the rows: `attention.py:
    _query_tile`). out may be x (in place)."""
    rows = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    c = tl.arange(0, BW)
    row_ok = rows < T
    ok = row_ok[:, None] & (c < W)[None, :]
    v = tl.load(x + rows[:, None] * LD_X + c[None, :], mask=ok, other=0.0).to(tl.float32)
    if RSTD:
        tl.store(rstd + rows, tl.rsqrt(tl.sum(v * v, 1) / W + eps), mask=row_ok)
    else:
        if NORM:
            r = tl.rsqrt(tl.sum(v * v, 1) / W + eps)
            v = v * r[:, None] * tl.load(w + c, mask=c < W, other=0.0).to(tl.float32)[None, :]
        if ROPE:
            v = _turn_pairs(v, cos, sin, rows, row_ok, cos_rows, BT, BW, W, ROPE, False)
        tl.store(out + rows[:, None] * LD_OUT + c[None, :], narrow(v, out.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T", "cos_rows", "rows_per_program", "r_dx"])
def row_norm_backward_kernel(dy, x, w, dx, parts, bias_parts, ranges, cos, sin, T, cos_rows, eps, rows_per_program,
                             r_dx, W: tl.constexpr, BW: tl.constexpr, LD_DY: tl.constexpr, LD_X: tl.constexpr,
                             LD_DX: tl.constexpr, BT: tl.constexpr, RANGES: tl.constexpr, NORM: tl.constexpr,
                             ROPE: tl.constexpr, BIAS: tl.constexpr):
    """The backward of `row_norm_kernel` over rows_per_program rows (BT at a time): dy turned back first (ROPE),
    then with n = x r and m = dy w, dx = r (m - n mean(m n)) and parts[program] = sum over its rows of dy * n (w's
    gradient, summed in order afterwards); NORM False: dx = dy turned back. BIAS: bias_parts[program] = sum over
    its rows of dx (the gradient of a bias added before the norm, x = a + b). RANGES: the largest |dx| into
    ranges[r_dx]. dx may be dy (in place: a program reads the rows it writes before it writes them)."""
    c = tl.arange(0, BW)
    col_ok = c < W
    if NORM:
        scale = tl.load(w + c, mask=col_ok, other=0.0).to(tl.float32)
    grad_w = tl.zeros((BT, BW), dtype=tl.float32)  # (summed across the BT rows once, at the end)
    grad_b = tl.zeros((BT, BW), dtype=tl.float32)
    top = 0.0
    start = tl.program_id(0) * rows_per_program
    end = tl.minimum(start + rows_per_program, T)  # (a last step may reach past the program's rows: masked)
    for r0 in range(start, end, BT):
        rows = (r0 + tl.arange(0, BT)).to(tl.int64)
        row_ok = rows < end
        ok = row_ok[:, None] & col_ok[None, :]
        d = tl.load(dy + rows[:, None] * LD_DY + c[None, :], mask=ok, other=0.0).to(tl.float32)
        if ROPE:
            d = _turn_pairs(d, cos, sin, rows, row_ok, cos_rows, BT, BW, W, ROPE, True)
        if NORM:
            v = tl.load(x + rows[:, None] * LD_X + c[None, :], mask=ok, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(v * v, 1) / W + eps)[:, None]
            n = v * r
            grad_w += d * n
            m = d * scale[None, :]
            d = r * (m - n * (tl.sum(m * n, 1) / W)[:, None])
        tl.store(dx + rows[:, None] * LD_DX + c[None, :], narrow(d, dx.dtype.element_ty), mask=ok)
        if BIAS:
            grad_b += d
        if RANGES:
            top = tl.maximum(top, largest(d))
    if NORM:
        tl.store(parts + tl.program_id(0).to(tl.int64) * W + c, tl.sum(grad_w, 0), mask=col_ok)
    if BIAS:
        tl.store(bias_parts + tl.program_id(0).to(tl.int64) * W + c, tl.sum(grad_b, 0), mask=col_ok)
    if RANGES:
        fold(ranges, r_dx, top)
