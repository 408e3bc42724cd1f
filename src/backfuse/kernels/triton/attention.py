"""Attention on token-major operands, forward and backward, in FlashAttention-2's schedule: the
training paths' attention for any power-of-two head size, grouped KV heads, causal or not, a sliding
window, an optional soft cap, and query and key lengths that are no multiple of a tile.

Layouts. Row t = b * S + s of a token-major buffer holds token s of batch entry b; head h sits in
columns [h * D, (h + 1) * D) past the pointer given, rows LD_* elements apart (constexprs: a model's
widths, never its token counts). Query head h reads KV head h // GROUP. lse and delta are [B * HEADS,
S_q] fp32; lse is in base-2 units of the logits.

Math. With q.k the product of a query and a key row:
    c = scale * q.k                                  (no cap)
    c = cap * t,  t = tanh(scale * q.k / cap)        (HAS_CAP)
    key j is visible to query i when j < S_k, and also j <= i (CAUSAL), i - j < window (WINDOW);
    with MASK, instead when lo[b, i] <= j <= hi[b, i] (each query row's bounds) and the mask allows it:
      MASK_KEEP:  mask[b, i, j] != 0 (a 0/1 mask; a key padding mask is one with a zero query stride)
      MASK_ADD:   mask[b, i, j] > -1e38, added to the logits after the cap (an additive float mask, the
                  model's 0 / finfo.min), as eager attention adds it
    A query row that sees no key (lo > hi, or the mask allows none) gets O = 0 and its P is 0 in the
    backward, as PyTorch's SDPA gives a fully masked row; with MASK_ADD instead (the bounds kernel marks
    it lo = -1) it weighs every key alike, as eager attention's softmax of logits that all became finfo.min
    does (c = 0 for every key; the backward's dC and the cap's 1 - t^2 as autograd forms them there).
    P = softmax(c) over the visible keys, O = P V, lse = log2 sum_j 2^(c_ij log2 e)
Only the key blocks inside a query block's bounds are visited (forward, dQ), and only the query blocks
whose bounds reach a key block (dK, dV): a window's, a document's or padding's other blocks are skipped,
not masked. The dK, dV programs hold keys fixed, so they read each key's bounds (the queries that see it,
`attention_key_bounds_kernel`) once; where those are exact for every key of the block (a causal, windowed,
padded, packed or image-block mask: no hole, no value added) a query is compared with its key's bounds as
causality is compared, and the rows' bounds and the mask are not read in the loop. The rows that weigh every
key alike (MASK_ADD's fully masked rows: eager attention's padded queries) take no part in the keys' bounds:
each dK, dV program visits them in a loop of their own, over their batch entry's first to last such row (or,
where its keys' bounds are not exact anyway, in the mask-reading loop), so a padded batch under eager attention
keeps the exact loop for its real queries. With a mask to read, the query blocks holding a row whose mask is
more than its bounds (forward, dQ) run in a launch of their own (`READ_APART`), so that the others' kernel keeps
its wgmma in flight.
Backward, from dO:
    delta = rowsum(dO * O),  dP = dO V^T,  dC = P * (dP - delta)
    dS = dC * scale  (* (1 - t^2) with the cap)      -- the gradient of the logits' q.k
    dQ = dS K,  dK = dS^T Q,  dV = P^T dO            (dK, dV summed over each group's query heads)

Q_NORM: q holds the rows before an RMSNorm across all heads (Wan's norm_q), q_rstd [B * S_q] fp32 each
row's 1 / sqrt(mean(q^2) + eps) and q_w its weight; every Q tile is normed as it is loaded,
q r w in fp32 rounded to q's dtype (the values a separate norm would have stored), so the normed
rows are never written.

fp16 range guard: with RANGES each program folds the largest |value| of what it reads (q, k, v; dO)
or writes (dq, dk, dv) into a per-region maximum, `ranges[r_*]` (an atomic max; NaN counts as Inf; a
negative r_*: not checked), which the training paths' guard checks on the device
(`backfuse/train/guard.py`).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
# Triton 3.6's interpreter multiplies bfloat16 tiles wrongly (it reads their bits as integers): there
# the products take the tiles in fp32, which holds every bf16 and fp16 value and their products exactly.
_UPCAST_DOTS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def tanh(x, APPROX: tl.constexpr):
    """tanh(x) in fp32. APPROX: the GPU's one-instruction tanh (relative error <= 2^-11, the size of
    an fp16 rounding of its operands); else through exp2 (the Triton interpreter runs no inline PTX)."""
    if APPROX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def mma(a, b, acc):
    """acc + a @ b on the tensor cores (fp32 sums)."""
    if _UPCAST_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def narrow(x, dtype: tl.constexpr):
    """x rounded to dtype (to nearest, ties to even). Triton 3.6's interpreter truncates to bfloat16;
    there the rounding is done on the bits first."""
    if _UPCAST_DOTS and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def largest(x):
    """The largest |x| of a tile in fp32, NaN counted as Inf (so that an atomic max keeps it)."""
    m = tl.max(tl.abs(x.to(tl.float32)))
    return tl.where(m == m, m, float("inf"))


@triton.jit
def fold(ranges, r, value):
    """ranges[r] = max(ranges[r], value): a region's running maximum (r < 0: a tensor not checked)."""
    if r >= 0:
        tl.atomic_max(ranges + r, value)


@triton.jit
def _logits(qk, scale, cap, HAS_CAP: tl.constexpr, APPROX_TANH: tl.constexpr):
    """(the logits c in base-2 units, t) from q.k; t = tanh(scale q.k / cap), or q.k itself without a cap."""
    if HAS_CAP:
        t = tanh(qk * (scale / cap), APPROX_TANH)
        return t * (cap * _LOG2E), t
    else:
        return qk * (scale * _LOG2E), qk


@triton.jit
def _visible(rows, cols, S_k, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Whether key cols is visible to query rows (broadcast against each other)."""
    ok = cols < S_k
    if CAUSAL:
        ok = ok & (cols <= rows)
    if WINDOW:
        ok = ok & (rows - cols < window)
    return ok


MASK_NONE = tl.constexpr(0)
MASK_BOUNDS = tl.constexpr(1)  # the bounds alone
MASK_KEEP = tl.constexpr(2)
MASK_ADD = tl.constexpr(3)
_MASKED_OUT = tl.constexpr(-1.0e38)  # an additive mask value at or below it hides the key (finfo.min of any dtype)
_PARTIAL = tl.constexpr(1 << 30)  # added to a row's stored hi: the mask hides keys inside its bounds (or adds to them)
# READ_APART: with a mask to read (MASK_KEEP, MASK_ADD) the forward's and the dQ programs' blocks with a partial row
# run in a launch of their own (READS). A loop that reads the mask tile beside the logits' tile makes ptxas
# serialize every wgmma of its kernel (C7515: "non wgmma instructions defining accumulator registers"), so in one
# kernel with it the other blocks' loops lost their overlap too: a dense causal additive mask, which no row reads,
# cost Gemma 2 9B's backward 13.6 ms a step against ~8.8 unmasked (session 45). The key blocks' programs keep their
# three loops in one kernel: without the dQ programs' mask read, ptxas overlaps them (`tests/sm90_kernels.py`).


@triton.jit
def _masked(s, r2, c2, lo2, hi2, b, mask, m_sb, m_sq, m_sk, partial, MASK: tl.constexpr):
    """(logits s with an additive mask added, which of them are visible) for the tile of query rows r2
    and key columns c2 (broadcast against each other) with the rows' bounds lo2, hi2. Unless some row of
    the tile is `partial` (`_row_bounds`: its mask hides a key inside its bounds, or adds a nonzero value
    there), the bounds alone decide and the mask is not read: a causal, padded, packed or image-block mask
    is its rows' bounds everywhere."""
    ok = (c2 >= lo2) & (c2 <= hi2)
    if MASK == MASK_KEEP:
        if partial:
            at = b.to(tl.int64) * m_sb + r2.to(tl.int64) * m_sq + c2.to(tl.int64) * m_sk
            ok = ok & (tl.load(mask + at, mask=ok, other=0) != 0)
    if MASK == MASK_ADD:
        if partial:
            at = b.to(tl.int64) * m_sb + r2.to(tl.int64) * m_sq + c2.to(tl.int64) * m_sk
            add = tl.load(mask + at, mask=ok, other=0.0).to(tl.float32)
            alike = lo2 < 0  # a row the mask hides every key from: every key alike, logit 0
            ok = ok & ((add > _MASKED_OUT) | alike)
            s = tl.where(alike, 0.0, s + tl.maximum(add, _MASKED_OUT) * _LOG2E)  # (finite: a hidden key: ok)
    return s, ok


@triton.jit
def _row_bounds(lo, hi, b, rows, row_ok, S_q, S_k):
    """Each query row's bounds [lo, hi] (rows past S_q: none) and whether the row is partial: its mask hides
    keys inside its bounds, or adds nonzero values there (`attention_bounds_kernel` adds _PARTIAL to its hi)."""
    at = b * S_q + rows
    stored = tl.load(hi + at, mask=row_ok, other=-1)
    partial = stored >= _PARTIAL
    return tl.load(lo + at, mask=row_ok, other=S_k), tl.where(partial, stored - _PARTIAL, stored), partial


@triton.jit
def _head_tile(base, tok, ok, LD: tl.constexpr, column, D: tl.constexpr):
    """The [R, D] tile of tokens tok ([R]) at `column` of a token-major buffer (zeros where not ok)."""
    d = tl.arange(0, D)
    return tl.load(base + tok.to(tl.int64)[:, None] * LD + column + d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _query_tile(q, q_rstd, q_w, tok, ok, LD: tl.constexpr, h, D: tl.constexpr, Q_NORM: tl.constexpr):
    """The [R, D] tile of query head h for tokens tok; Q_NORM: normed as it is loaded (module docstring)."""
    qt = _head_tile(q, tok, ok, LD, h * D, D)
    if Q_NORM:
        r = tl.load(q_rstd + tok, mask=ok, other=0.0)
        w = tl.load(q_w + h * D + tl.arange(0, D)).to(tl.float32)
        qt = narrow(qt.to(tl.float32) * r[:, None] * w[None, :], qt.dtype)
    return qt


@triton.jit
def _store_head_tile(base, tok, ok, LD: tl.constexpr, column, D: tl.constexpr, x):
    d = tl.arange(0, D)
    tl.store(base + tok.to(tl.int64)[:, None] * LD + column + d[None, :], narrow(x, base.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _forward_steps(qt, rows, lo_r, hi_r, m_i, l_i, acc, b, kv, n_lo, n_hi, k, v, mask, S_k, scale, cap, window, m_sb, m_sq,
                   m_sk, D: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr, BN: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, RANGES: tl.constexpr,
                   APPROX_TANH: tl.constexpr, MASK: tl.constexpr):
    """The forward's online softmax over key blocks [n_lo, n_hi): (m_i, l_i, acc, largest |k|, largest |v|).
    MASK: what the tiles read (MASK_BOUNDS: the rows' bounds alone, where no row of the block is partial)."""
    k_max = 0.0
    v_max = 0.0
    for n0 in range(n_lo, n_hi, BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < S_k
        kt = _head_tile(k, b * S_k + cols, col_ok, LD_K, kv * D, D)
        vt = _head_tile(v, b * S_k + cols, col_ok, LD_V, kv * D, D)
        s, t = _logits(mma(qt, tl.trans(kt), None), scale, cap, HAS_CAP, APPROX_TANH)
        visible = _visible(rows[:, None], cols[None, :], S_k, window, CAUSAL, WINDOW)
        if MASK != MASK_NONE:
            s, seen = _masked(s, rows[:, None], cols[None, :], lo_r[:, None], hi_r[:, None], b, mask, m_sb, m_sq, m_sk,
                              True, MASK)
            visible = visible & seen
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = mma(narrow(p, vt.dtype), vt, acc * alpha[:, None])
        m_i = m_new
        if RANGES:
            k_max = tl.maximum(k_max, largest(kt))
            v_max = tl.maximum(v_max, largest(vt))
    return m_i, l_i, acc, k_max, v_max


@triton.jit
def _alike_steps(b, kv, k, v, S_k, D: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, RANGES: tl.constexpr):
    """The forward of a block whose rows all weigh every key alike (MASK_ADD's fully masked rows, eager's padded
    queries: every logit finfo.min, so P = 1 / S_k for every key): (m_i, l_i, acc, largest |k|, largest |v|) as
    `_forward_steps` returns them, m_i = 0 and l_i = S_k (lse = log2 S_k, as the backward's KEYS_ALIKE loop reads
    it) and acc the sum of V, from V alone: no logits (K is read only for the range guard)."""
    total = tl.zeros((BN, D), dtype=tl.float32)
    k_max = 0.0
    v_max = 0.0
    for n0 in range(0, S_k, BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < S_k
        vt = _head_tile(v, b * S_k + cols, col_ok, LD_V, kv * D, D)
        total += vt.to(tl.float32)
        if RANGES:
            k_max = tl.maximum(k_max, largest(_head_tile(k, b * S_k + cols, col_ok, LD_K, kv * D, D)))
            v_max = tl.maximum(v_max, largest(vt))
    acc = tl.zeros((BM, D), dtype=tl.float32) + tl.sum(total, 0)[None, :]
    return tl.zeros((BM,), dtype=tl.float32), tl.zeros((BM,), dtype=tl.float32) + S_k, acc, k_max, v_max


@triton.jit(do_not_specialize=["S_q", "S_k", "window", "r_q", "r_k", "r_v", "m_sb", "m_sq", "m_sk"])
def attention_forward_kernel(
    q, k, v, o, lse, ranges, q_rstd, q_w, lo, hi, mask,
    S_q, S_k, scale, cap, window, r_q, r_k, r_v, m_sb, m_sq, m_sk,
    HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    LD_Q: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr, LD_O: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    RANGES: tl.constexpr, APPROX_TANH: tl.constexpr, Q_NORM: tl.constexpr, MASK: tl.constexpr, READS: tl.constexpr,
):
    """O and lse of BM queries of one (batch entry, head): grid (B * HEADS, query blocks), the last
    blocks (the most keys when causal) first. Online softmax over BN keys at a time, only over the
    key blocks the mask leaves visible (a window's earlier blocks are skipped, not masked); with MASK,
    the key blocks between the block's rows' lowest and highest bounds; with MASK_ADD, a block whose rows all
    weigh every key alike from V alone (`_alike_steps`). READS: this launch takes the blocks with a partial row
    alone, whose tiles read the mask; else it takes every other block (`READ_APART`)."""
    bh = tl.program_id(0)
    block = tl.num_programs(1) - 1 - tl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    kv = h // GROUP
    rows = block * BM + tl.arange(0, BM)
    row_ok = rows < S_q
    m_i = tl.full((BM,), -1.0e30, dtype=tl.float32)  # finite: a row with no visible key yet adds exp2(-inf) = 0
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    n_lo = 0
    n_hi = S_k
    if CAUSAL:
        n_hi = tl.minimum(S_k, (block + 1) * BM)
    if WINDOW:
        n_lo = tl.maximum(0, block * BM - window + 1) // BN * BN
    lo_r = rows  # (read only with MASK)
    hi_r = rows
    partial = False
    alike = False
    if MASK != MASK_NONE:
        lo_r, hi_r, part_r = _row_bounds(lo, hi, b, rows, row_ok, S_q, S_k)
        if MASK == MASK_KEEP or MASK == MASK_ADD:
            partial = tl.max(part_r.to(tl.int32)) > 0
        if MASK == MASK_ADD:
            alike = tl.max(lo_r) < 0  # (a row past S_q has lo = S_k: a block holding one is not alike)
        n_lo = tl.maximum(0, tl.min(lo_r)) // BN * BN
        n_hi = tl.minimum(S_k, tl.max(hi_r) + 1)
    # a block with no partial row: its rows' bounds alone decide (`_masked` with MASK_BOUNDS)
    FAST: tl.constexpr = MASK_BOUNDS if MASK == MASK_KEEP or MASK == MASK_ADD else MASK
    if partial == READS:  # (partial: static False without a mask to read, where READS is False)
        qt = _query_tile(q, q_rstd, q_w, b * S_q + rows, row_ok, LD_Q, h, D, Q_NORM)
        if not READS:
            m_i, l_i, acc, k_max, v_max = _forward_steps(
                qt, rows, lo_r, hi_r, m_i, l_i, acc, b, kv, n_lo, n_hi, k, v, mask, S_k, scale, cap, window, m_sb, m_sq,
                m_sk, D, LD_K, LD_V, BN, CAUSAL, WINDOW, HAS_CAP, RANGES, APPROX_TANH, FAST)
        elif alike:  # (static False but with MASK_ADD; such rows are partial)
            m_i, l_i, acc, k_max, v_max = _alike_steps(b, kv, k, v, S_k, D, LD_K, LD_V, BM, BN, RANGES)
        else:
            m_i, l_i, acc, k_max, v_max = _forward_steps(
                qt, rows, lo_r, hi_r, m_i, l_i, acc, b, kv, n_lo, n_hi, k, v, mask, S_k, scale, cap, window, m_sb, m_sq,
                m_sk, D, LD_K, LD_V, BN, CAUSAL, WINDOW, HAS_CAP, RANGES, APPROX_TANH, MASK)
        seen = l_i > 0.0  # a row seeing no key (masked, or past S_q): O = 0, lse = inf (its P is 0 in the backward)
        l_i = tl.where(seen, l_i, 1.0)
        _store_head_tile(o, b * S_q + rows, row_ok, LD_O, h * D, D, acc / l_i[:, None])
        tl.store(lse + bh * S_q + rows, tl.where(seen, m_i + tl.log2(l_i), float("inf")), mask=row_ok)
        if RANGES:
            fold(ranges, r_q, largest(qt))
            fold(ranges, r_k, k_max)
            fold(ranges, r_v, v_max)


@triton.jit(do_not_specialize=["T", "S_q", "r_do"])
def attention_delta_kernel(
    o, do, delta, ranges,
    T, S_q, r_do,
    HEADS: tl.constexpr, D: tl.constexpr, LD_O: tl.constexpr, LD_DO: tl.constexpr, BT: tl.constexpr,
    RANGES: tl.constexpr,
):
    """delta = rowsum(dO * O) of BT tokens of one head: grid (token blocks, HEADS)."""
    h = tl.program_id(1)
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = tok < T
    ot = _head_tile(o, tok, ok, LD_O, h * D, D).to(tl.float32)
    dot_ = _head_tile(do, tok, ok, LD_DO, h * D, D).to(tl.float32)
    tl.store(delta + ((tok // S_q) * HEADS + h) * S_q + tok % S_q, tl.sum(ot * dot_, 1), mask=ok)
    if RANGES:
        fold(ranges, r_do, largest(dot_))


KEYS_EXACT = tl.constexpr(0)  # every key's visible queries are its bounds [k_lo, k_hi]
KEYS_ROWS = tl.constexpr(1)  # each query row's bounds and mask decide (`_masked`)
KEYS_ALIKE = tl.constexpr(2)  # the rows weighing every key alike (lo < 0), and only they: logit 0 for every key


@triton.jit
def _key_steps(dk_acc, dv_acc, kt, vt, cols, k_lo2, k_hi2, b, kv, m_lo, m_hi, q, do, lse, delta, dq, q_rstd, q_w, lo, hi,
               mask, S_q, S_k, scale, cap, window, m_sb, m_sq, m_sk, HEADS: tl.constexpr, GROUP: tl.constexpr,
               D: tl.constexpr, LD_Q: tl.constexpr, LD_DO: tl.constexpr, LD_DQ: tl.constexpr, KV_BN: tl.constexpr,
               KV_BM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
               APPROX_TANH: tl.constexpr, DQ_ATOMIC: tl.constexpr, Q_NORM: tl.constexpr, MASK: tl.constexpr,
               KEYS: tl.constexpr):
    """(dK, dV sums) of one key block, dk_acc and dv_acc plus the sums over queries [m_lo, m_hi) of the group's
    heads. With MASK, which queries see which keys: KEYS_EXACT, exactly those inside each key's bounds k_lo2 <= i
    <= k_hi2 ([KV_BN, 1]: `attention_key_bounds_kernel`), compared as causality is; KEYS_ROWS, each query row's
    bounds and its mask (`_masked`), loaded a step at a time; KEYS_ALIKE, the rows that weigh every key alike
    alone, every key at logit 0 (the cap's 1 - t^2 still from q.k, as autograd forms it through eager's
    finfo.min)."""
    for g in range(GROUP):
        h = kv * GROUP + g
        bh = b * HEADS + h
        for m0 in range(m_lo, m_hi, KV_BM):
            rows = m0 + tl.arange(0, KV_BM)
            row_ok = rows < S_q
            qt = _query_tile(q, q_rstd, q_w, b * S_q + rows, row_ok, LD_Q, h, D, Q_NORM)
            dot_ = _head_tile(do, b * S_q + rows, row_ok, LD_DO, h * D, D)
            row_lse = tl.load(lse + bh * S_q + rows, mask=row_ok, other=float("inf"))  # P = 0 past S_q
            row_delta = tl.load(delta + bh * S_q + rows, mask=row_ok, other=0.0)
            s, t = _logits(mma(kt, tl.trans(qt), None), scale, cap, HAS_CAP, APPROX_TANH)  # [keys, queries]
            visible = _visible(rows[None, :], cols[:, None], S_k, window, CAUSAL, WINDOW)
            if MASK != MASK_NONE:
                if KEYS == KEYS_EXACT:
                    visible = visible & (rows[None, :] >= k_lo2) & (rows[None, :] <= k_hi2)
                elif KEYS == KEYS_ALIKE:
                    alike = tl.load(lo + b * S_q + rows, mask=row_ok, other=S_k) < 0
                    visible = visible & alike[None, :]
                    s = tl.zeros_like(s)
                else:
                    lo_r, hi_r, part_r = _row_bounds(lo, hi, b, rows, row_ok, S_q, S_k)
                    s, seen = _masked(s, rows[None, :], cols[:, None], lo_r[None, :], hi_r[None, :], b, mask, m_sb,
                                      m_sq, m_sk, tl.max(part_r.to(tl.int32)) > 0, MASK)
                    visible = visible & seen
            p = tl.where(visible, tl.exp2(s - row_lse[None, :]), 0.0)
            dv_acc = mma(narrow(p, dot_.dtype), dot_, dv_acc)
            ds = p * (mma(vt, tl.trans(dot_), None) - row_delta[None, :])
            if HAS_CAP:
                ds = ds * (1.0 - t * t)
            ds = narrow(ds, qt.dtype)
            dk_acc = mma(ds, qt, dk_acc)
            if DQ_ATOMIC:
                dq_part = mma(tl.trans(ds), kt, tl.zeros((KV_BM, D), dtype=tl.float32)) * scale
                offs = (b * S_q + rows).to(tl.int64)[:, None] * LD_DQ + h * D + tl.arange(0, D)[None, :]
                tl.atomic_add(dq + offs, dq_part, mask=row_ok[:, None], sem="relaxed")
    return dk_acc, dv_acc


@triton.jit
def _share(m_lo, m_hi, part, split, KV_BM: tl.constexpr):
    """The part-th of `split` runs of whole KV_BM steps that queries [m_lo, m_hi) divide into."""
    steps = (tl.cdiv(tl.maximum(m_hi - m_lo, 0), KV_BM) + split - 1) // split
    lo = m_lo + part * steps * KV_BM
    return lo, tl.minimum(m_hi, lo + steps * KV_BM)


@triton.jit
def _key_block(pid, kv_programs, split, q, k, v, do, lse, delta, dq, dk, dv, ranges, q_rstd, q_w, lo, hi, k_lo, k_hi,
               alike, mask, S_q, S_k, scale, cap, window, r_dk, r_dv, m_sb, m_sq, m_sk, HEADS: tl.constexpr,
               GROUP: tl.constexpr, D: tl.constexpr, LD_Q: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr,
               LD_DO: tl.constexpr, LD_DQ: tl.constexpr, LD_DK: tl.constexpr, LD_DV: tl.constexpr,
               KV_BN: tl.constexpr, KV_BM: tl.constexpr, KV_ATOMIC: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, RANGES: tl.constexpr, APPROX_TANH: tl.constexpr,
               DQ_ATOMIC: tl.constexpr, Q_NORM: tl.constexpr, MASK: tl.constexpr):
    """dK, dV of KV_BN keys of one (batch entry, KV head), summed over the group's query heads and the
    visible queries (KV_BM at a time); key blocks in order (the first have the most queries when
    causal). KV_ATOMIC: `split` programs (a runtime count, so that no length compiles another kernel) share
    a key block, each over a run of its queries, and add their sums into fp32 dk, dv (zeroed before) by
    atomics; else split is 1. DQ_ATOMIC: each step also adds its part of
    dQ, scale dS^T K, into fp32 dq (zeroed before) by atomics. With MASK the queries visited are those the
    block's keys' bounds reach (k_lo, k_hi), and where every key's bounds are exact they alone decide; with MASK_ADD
    the rows that weigh every key alike, between their batch entry's first and last (`alike`), then take a loop of
    their own, or where a key's bounds are not exact join the mask-reading loop's range."""
    per_block = kv_programs // ((S_k + KV_BN - 1) // KV_BN)
    block = pid // per_block
    rest = pid % per_block
    part = rest % split
    KV_HEADS: tl.constexpr = HEADS // GROUP
    b = rest // split // KV_HEADS
    kv = rest // split % KV_HEADS
    cols = block * KV_BN + tl.arange(0, KV_BN)
    col_ok = cols < S_k
    kt = _head_tile(k, b * S_k + cols, col_ok, LD_K, kv * D, D)
    vt = _head_tile(v, b * S_k + cols, col_ok, LD_V, kv * D, D)
    m_lo = 0
    m_hi = S_q
    if CAUSAL:
        m_lo = block * KV_BN // KV_BM * KV_BM
    if WINDOW:
        m_hi = tl.minimum(S_q, block * KV_BN + KV_BN - 1 + window)
    k_lo2 = cols[:, None]  # (read only with MASK)
    k_hi2 = cols[:, None]
    exact = False
    if MASK != MASK_NONE:
        k_lo_c, k_hi_c, k_part = _row_bounds(k_lo, k_hi, b, cols, col_ok, S_k, S_q)
        m_lo = tl.maximum(0, tl.min(k_lo_c)) // KV_BM * KV_BM
        m_hi = tl.minimum(S_q, tl.max(k_hi_c) + 1)
        k_lo2 = k_lo_c[:, None]
        k_hi2 = k_hi_c[:, None]
        exact = tl.max(k_part.to(tl.int32)) == 0
    a_lo = 0  # the alike rows' queries [a_lo, a_end), visited in a loop of their own (read only with MASK_ADD)
    a_end = 0
    if MASK == MASK_ADD:
        a_lo = tl.load(alike + 2 * b) // KV_BM * KV_BM
        a_end = tl.load(alike + 2 * b + 1) + 1
        if not exact:  # the mask-reading loop weighs them as `_masked` does: it visits them, and no loop of theirs runs
            some = a_lo < a_end
            m_lo = tl.where(some, tl.minimum(m_lo, a_lo), m_lo)
            m_hi = tl.where(some, tl.maximum(m_hi, a_end), m_hi)
            a_end = a_lo
    if KV_ATOMIC:
        m_lo, m_hi = _share(m_lo, m_hi, part, split, KV_BM)
        a_lo, a_end = _share(a_lo, a_end, part, split, KV_BM)
    dk_acc = tl.zeros((KV_BN, D), dtype=tl.float32)
    dv_acc = tl.zeros((KV_BN, D), dtype=tl.float32)
    if exact:  # every key's bounds exact: compared as causality is (static False without a mask)
        dk_acc, dv_acc = _key_steps(dk_acc, dv_acc, kt, vt, cols, k_lo2, k_hi2, b, kv, m_lo, m_hi, q, do, lse, delta, dq,
                                    q_rstd, q_w, lo, hi, mask, S_q, S_k, scale, cap, window, m_sb, m_sq, m_sk, HEADS, GROUP,
                                    D, LD_Q, LD_DO, LD_DQ, KV_BN, KV_BM, CAUSAL, WINDOW, HAS_CAP, APPROX_TANH, DQ_ATOMIC,
                                    Q_NORM, MASK, KEYS_EXACT)
    else:
        dk_acc, dv_acc = _key_steps(dk_acc, dv_acc, kt, vt, cols, k_lo2, k_hi2, b, kv, m_lo, m_hi, q, do, lse, delta, dq,
                                    q_rstd, q_w, lo, hi, mask, S_q, S_k, scale, cap, window, m_sb, m_sq, m_sk, HEADS, GROUP,
                                    D, LD_Q, LD_DO, LD_DQ, KV_BN, KV_BM, CAUSAL, WINDOW, HAS_CAP, APPROX_TANH, DQ_ATOMIC,
                                    Q_NORM, MASK, KEYS_ROWS)
    if MASK == MASK_ADD:
        dk_acc, dv_acc = _key_steps(dk_acc, dv_acc, kt, vt, cols, k_lo2, k_hi2, b, kv, a_lo, a_end, q, do, lse, delta,
                                    dq, q_rstd, q_w, lo, hi, mask, S_q, S_k, scale, cap, window, m_sb, m_sq, m_sk, HEADS,
                                    GROUP, D, LD_Q, LD_DO, LD_DQ, KV_BN, KV_BM, CAUSAL, WINDOW, HAS_CAP, APPROX_TANH,
                                    DQ_ATOMIC, Q_NORM, MASK, KEYS_ALIKE)
    dk_acc = dk_acc * scale
    tok = b * S_k + cols
    if KV_ATOMIC:
        d = tl.arange(0, D)
        offs = tok.to(tl.int64)[:, None] * LD_DK + kv * D + d[None, :]
        tl.atomic_add(dk + offs, dk_acc, mask=col_ok[:, None], sem="relaxed")
        offs = tok.to(tl.int64)[:, None] * LD_DV + kv * D + d[None, :]
        tl.atomic_add(dv + offs, dv_acc, mask=col_ok[:, None], sem="relaxed")
    else:
        _store_head_tile(dk, tok, col_ok, LD_DK, kv * D, D, dk_acc)
        _store_head_tile(dv, tok, col_ok, LD_DV, kv * D, D, dv_acc)
        if RANGES:
            fold(ranges, r_dk, largest(dk_acc))
            fold(ranges, r_dv, largest(dv_acc))


@triton.jit
def _query_steps(qt, dot_, row_lse, row_delta, rows, lo_r, hi_r, b, kv, n_lo, n_hi, k, v, mask, S_k, scale, cap, window,
                 m_sb, m_sq, m_sk, partial, D: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr, Q_BM: tl.constexpr,
                 Q_BN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
                 APPROX_TANH: tl.constexpr, MASK: tl.constexpr):
    """dQ (before its scale) of a query block over key blocks [n_lo, n_hi); with MASK the mask is read where the
    block is `partial` (`_masked`)."""
    dq_acc = tl.zeros((Q_BM, D), dtype=tl.float32)
    for n0 in range(n_lo, n_hi, Q_BN):
        cols = n0 + tl.arange(0, Q_BN)
        col_ok = cols < S_k
        kt = _head_tile(k, b * S_k + cols, col_ok, LD_K, kv * D, D)
        vt = _head_tile(v, b * S_k + cols, col_ok, LD_V, kv * D, D)
        s, t = _logits(mma(qt, tl.trans(kt), None), scale, cap, HAS_CAP, APPROX_TANH)
        visible = _visible(rows[:, None], cols[None, :], S_k, window, CAUSAL, WINDOW)
        if MASK != MASK_NONE:
            s, seen = _masked(s, rows[:, None], cols[None, :], lo_r[:, None], hi_r[:, None], b, mask, m_sb, m_sq, m_sk,
                              partial, MASK)
            visible = visible & seen
        p = tl.where(visible, tl.exp2(s - row_lse[:, None]), 0.0)
        ds = p * (mma(dot_, tl.trans(vt), None) - row_delta[:, None])
        if HAS_CAP:
            ds = ds * (1.0 - t * t)
        dq_acc = mma(narrow(ds, kt.dtype), kt, dq_acc)
    return dq_acc


@triton.jit
def _query_block(local, q_programs, q, k, v, do, lse, delta, dq, ranges, q_rstd, q_w, lo, hi, mask, S_q, S_k, scale,
                 cap, window, r_dq, m_sb, m_sq, m_sk, HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                 LD_Q: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr, LD_DO: tl.constexpr, LD_DQ: tl.constexpr,
                 Q_BM: tl.constexpr, Q_BN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 HAS_CAP: tl.constexpr, RANGES: tl.constexpr, APPROX_TANH: tl.constexpr, Q_NORM: tl.constexpr,
                 MASK: tl.constexpr, READS: tl.constexpr):
    """dQ of Q_BM queries of one (batch entry, head) over their visible keys (Q_BN at a time), the
    last query blocks (the most keys when causal) first; READS: the blocks with a partial row alone, else every
    other block (`READ_APART`)."""
    per_block = q_programs // ((S_q + Q_BM - 1) // Q_BM)
    block = (q_programs - 1 - local) // per_block
    bh = local % per_block
    b = bh // HEADS
    h = bh % HEADS
    kv = h // GROUP
    rows = block * Q_BM + tl.arange(0, Q_BM)
    row_ok = rows < S_q
    tok = b * S_q + rows
    n_lo = 0
    n_hi = S_k
    if CAUSAL:
        n_hi = tl.minimum(S_k, (block + 1) * Q_BM)
    if WINDOW:
        n_lo = tl.maximum(0, block * Q_BM - window + 1) // Q_BN * Q_BN
    lo_r = rows  # (read only with MASK)
    hi_r = rows
    partial = False
    if MASK != MASK_NONE:
        lo_r, hi_r, part_r = _row_bounds(lo, hi, b, rows, row_ok, S_q, S_k)
        partial = tl.max(part_r.to(tl.int32)) > 0
        n_lo = tl.maximum(0, tl.min(lo_r)) // Q_BN * Q_BN
        n_hi = tl.minimum(S_k, tl.max(hi_r) + 1)
    FAST: tl.constexpr = MASK_BOUNDS if MASK == MASK_KEEP or MASK == MASK_ADD else MASK
    LOOP: tl.constexpr = MASK if READS else FAST  # (READS: the mask read where the block is partial)
    if partial == READS:
        qt = _query_tile(q, q_rstd, q_w, tok, row_ok, LD_Q, h, D, Q_NORM)
        dot_ = _head_tile(do, tok, row_ok, LD_DO, h * D, D)
        row_lse = tl.load(lse + bh * S_q + rows, mask=row_ok, other=float("inf"))
        row_delta = tl.load(delta + bh * S_q + rows, mask=row_ok, other=0.0)
        dq_acc = _query_steps(qt, dot_, row_lse, row_delta, rows, lo_r, hi_r, b, kv, n_lo, n_hi, k, v, mask, S_k, scale,
                              cap, window, m_sb, m_sq, m_sk, partial, D, LD_K, LD_V, Q_BM, Q_BN, CAUSAL, WINDOW, HAS_CAP,
                              APPROX_TANH, LOOP)
        dq_acc = dq_acc * scale
        _store_head_tile(dq, tok, row_ok, LD_DQ, h * D, D, dq_acc)
        if RANGES:
            fold(ranges, r_dq, largest(dq_acc))


@triton.jit(do_not_specialize=["S_q", "S_k", "window", "kv_programs", "split", "r_dq", "r_dk", "r_dv", "m_sb", "m_sq",
                               "m_sk"])
def attention_backward_kernel(
    q, k, v, do, lse, delta, dq, dk, dv, ranges, q_rstd, q_w, lo, hi, k_lo, k_hi, alike, mask,
    S_q, S_k, scale, cap, window, kv_programs, split, r_dq, r_dk, r_dv, m_sb, m_sq, m_sk,
    HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    LD_Q: tl.constexpr, LD_K: tl.constexpr, LD_V: tl.constexpr, LD_DO: tl.constexpr,
    LD_DQ: tl.constexpr, LD_DK: tl.constexpr, LD_DV: tl.constexpr,
    KV_BN: tl.constexpr, KV_BM: tl.constexpr, Q_BM: tl.constexpr, Q_BN: tl.constexpr, KV_ATOMIC: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, RANGES: tl.constexpr,
    APPROX_TANH: tl.constexpr, DQ_ATOMIC: tl.constexpr, Q_NORM: tl.constexpr, MASK: tl.constexpr, READS: tl.constexpr,
):
    """Programs [0, kv_programs): dK, dV of a key block (`_key_block`); the rest: dQ of a query block
    (`_query_block`). P is recomputed from lse; one launch of both kinds, each independent of the other.
    DQ_ATOMIC: no dQ programs; the key blocks' programs add dQ into fp32 dq instead. With Q_NORM, dq is
    the gradient of the normed queries. READS: a launch of dQ programs alone, those of the query blocks with a
    partial row (`READ_APART`); the first launch's dQ programs then take the others."""
    pid = tl.program_id(0)
    if READS:
        _query_block(pid, tl.num_programs(0), q, k, v, do, lse, delta, dq, ranges, q_rstd, q_w, lo, hi, mask, S_q, S_k,
                     scale, cap, window, r_dq, m_sb, m_sq, m_sk, HEADS, GROUP, D, LD_Q, LD_K, LD_V, LD_DO, LD_DQ, Q_BM,
                     Q_BN, CAUSAL, WINDOW, HAS_CAP, RANGES, APPROX_TANH, Q_NORM, MASK, True)
    elif pid < kv_programs:
        _key_block(pid, kv_programs, split, q, k, v, do, lse, delta, dq, dk, dv, ranges, q_rstd, q_w, lo, hi, k_lo, k_hi,
                   alike, mask, S_q, S_k, scale, cap, window, r_dk, r_dv, m_sb, m_sq, m_sk, HEADS, GROUP, D, LD_Q, LD_K, LD_V,
                   LD_DO, LD_DQ, LD_DK, LD_DV, KV_BN, KV_BM, KV_ATOMIC, CAUSAL, WINDOW, HAS_CAP, RANGES, APPROX_TANH,
                   DQ_ATOMIC, Q_NORM, MASK)
    elif not DQ_ATOMIC:
        _query_block(pid - kv_programs, tl.num_programs(0) - kv_programs, q, k, v, do, lse, delta, dq, ranges, q_rstd,
                     q_w, lo, hi, mask, S_q, S_k, scale, cap, window, r_dq, m_sb, m_sq, m_sk, HEADS, GROUP, D, LD_Q,
                     LD_K, LD_V, LD_DO, LD_DQ, Q_BM, Q_BN, CAUSAL, WINDOW, HAS_CAP, RANGES, APPROX_TANH, Q_NORM, MASK,
                     False)


@triton.jit(do_not_specialize=["tokens", "documents", "steps"])
def documents_kernel(out, cu_q, cu_k, tokens, documents, steps, BLOCK: tl.constexpr):
    """Packed documents as `attention_bounds_kernel` takes them (`train/masks.py: documents_from_cu_seqlens`,
    whose math this is), from FlashAttention's cumulative lengths cu_q, cu_k [documents + 1]: grid (token
    blocks of BLOCK). Query t's document is c - 1, c the count of cu_q's entries at or below t (a binary
    search over c in [0, documents + 1], `steps` halvings); inside a document its first visible key is
    cu_k[c - 1] and its last t + cu_k[c] - cu_q[c] (causality aligned to the document's last query and key),
    outside every one (tokens, -1). out [2, tokens] int32: the first keys, then the last."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < tokens
    lo = tl.zeros((BLOCK,), dtype=tl.int32)
    hi = lo + documents + 1
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_q + mid - 1, mask=ok & (mid > 0), other=-1) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    inside = ok & (lo > 0) & (lo <= documents)
    first = tl.load(cu_k + lo - 1, mask=inside, other=0)
    last = t + tl.load(cu_k + lo, mask=inside, other=0) - tl.load(cu_q + lo, mask=inside, other=0)
    tl.store(out + t, tl.where(inside, first, tokens).to(tl.int32), mask=ok)
    tl.store(out + tokens + t, tl.where(inside, last, -1).to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=["S_q", "S_k", "window", "m_sb", "m_sq", "m_sk"])
def attention_bounds_kernel(
    lo, hi, mask, documents,
    S_q, S_k, window, m_sb, m_sq, m_sk,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr, MASK: tl.constexpr,
    BR: tl.constexpr, BN: tl.constexpr,
):
    """Each query row's bounds [lo, hi] for the attention kernels' MASK: grid (B, row blocks of BR).
    Start from every key, keep j <= i (CAUSAL), those of the row's document (DOCS, packed documents: its
    first and last visible key, documents[0, b, i] and documents[1, b, i]), the window's counting back from
    the last key kept (WINDOW: j > that - window); then with a mask (MASK_KEEP, MASK_ADD) narrow them to the
    first and last key it allows inside them, marking the rows where it is more than those bounds (a key
    hidden between them, or a nonzero value added: hi + _PARTIAL), whose tiles read the mask. A row that
    sees no key gets lo = S_k, hi = -1; with MASK_ADD lo = -1, hi = S_k - 1, partial (every key alike, as
    eager attention: `_masked`)."""
    b = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    row_ok = rows < S_q
    r_lo = tl.zeros((BR,), dtype=tl.int32)
    r_hi = tl.where(row_ok, S_k - 1, -1)  # (a row past S_q sees no key: the mask is never read for it)
    if CAUSAL:
        r_hi = tl.minimum(r_hi, rows)
    if DOCS:
        at = b * S_q + rows
        r_lo = tl.maximum(r_lo, tl.load(documents + at, mask=row_ok, other=0))
        r_hi = tl.minimum(r_hi, tl.load(documents + tl.num_programs(0) * S_q + at, mask=row_ok, other=-1))
    if WINDOW:
        r_lo = tl.maximum(r_lo, r_hi - window + 1)
    partial = tl.zeros((BR,), dtype=tl.int32)
    if MASK == MASK_KEEP or MASK == MASK_ADD:
        first = tl.full((BR,), S_k, dtype=tl.int32)
        last = tl.full((BR,), -1, dtype=tl.int32)
        count = tl.zeros((BR,), dtype=tl.int32)  # keys the mask allows inside the bounds
        added = tl.zeros((BR,), dtype=tl.int32)  # of them, those it adds a nonzero value to (MASK_ADD)
        n_lo = tl.maximum(0, tl.min(tl.where(row_ok, r_lo, S_k))) // BN * BN
        n_hi = tl.minimum(S_k, tl.max(tl.where(row_ok, r_hi, -1)) + 1)
        for n0 in range(n_lo, n_hi, BN):
            cols = n0 + tl.arange(0, BN)
            s, seen = _masked(tl.zeros((BR, BN), dtype=tl.float32), rows[:, None], cols[None, :], r_lo[:, None],
                              r_hi[:, None], b, mask, m_sb, m_sq, m_sk, True, MASK)
            seen = seen & row_ok[:, None] & (cols[None, :] < S_k)
            first = tl.minimum(first, tl.min(tl.where(seen, cols[None, :], S_k), 1))
            last = tl.maximum(last, tl.max(tl.where(seen, cols[None, :], -1), 1))
            count += tl.sum(seen.to(tl.int32), 1)
            added += tl.sum((seen & (s != 0.0)).to(tl.int32), 1)
        r_lo = first
        r_hi = last
        # partial: the allowed keys are not the whole of [first, last] (holes), or some get a value added
        partial = ((count < last - first + 1) | (added > 0)).to(tl.int32)
    empty = r_lo > r_hi
    if MASK == MASK_ADD:  # every key alike (see `_masked`): the mask is read for those rows
        tl.store(lo + b * S_q + rows, tl.where(empty, -1, r_lo), mask=row_ok)
        tl.store(hi + b * S_q + rows, tl.where(empty, S_k - 1 + _PARTIAL, r_hi + partial * _PARTIAL), mask=row_ok)
    else:
        tl.store(lo + b * S_q + rows, tl.where(empty, S_k, r_lo), mask=row_ok)
        tl.store(hi + b * S_q + rows, tl.where(empty, -1, r_hi + partial * _PARTIAL), mask=row_ok)


@triton.jit(do_not_specialize=["S_q", "S_k"])
def attention_key_bounds_kernel(lo, hi, k_lo, k_hi, alike, S_q, S_k, BR: tl.constexpr, BK: tl.constexpr):
    """Each key's bounds [k_lo, k_hi] from the query rows' (`attention_bounds_kernel`'s lo, hi): grid (B, key
    blocks of BK). k_lo, k_hi are the first and last query whose bounds reach the key; the key is marked
    (k_hi + _PARTIAL) unless the queries that see it are exactly those (no query between them whose bounds
    miss it, and none of them partial: its mask read). A key no query sees gets k_lo = S_q, k_hi = -1. The
    rows that weigh every key alike (lo < 0: MASK_ADD's fully masked rows) are left out: alike[2 b], alike[2 b + 1]
    get the first and last of them in batch entry b (S_q, -1: none), which the dK, dV programs visit apart. The
    dK, dV programs visit the queries between their keys' bounds, and where no key of theirs is marked, compare
    each query with its key's bounds alone, as causality is compared."""
    b = tl.program_id(0)
    keys = tl.program_id(1) * BK + tl.arange(0, BK)
    key_ok = keys < S_k
    first_key = tl.program_id(1) * BK
    last_key = tl.minimum(S_k, first_key + BK) - 1
    first = tl.full((BK,), S_q, dtype=tl.int32)
    last = tl.full((BK,), -1, dtype=tl.int32)
    count = tl.zeros((BK,), dtype=tl.int32)
    marked = tl.zeros((BK,), dtype=tl.int32)
    a_first = S_q + 0
    a_last = S_q * 0 - 1
    for m0 in range(0, S_q, BR):
        rows = m0 + tl.arange(0, BR)
        lo_r, hi_r, part_r = _row_bounds(lo, hi, b, rows, rows < S_q, S_q, S_k)
        same = lo_r < 0  # every key alike
        a_first = tl.minimum(a_first, tl.min(tl.where(same, rows, S_q)))
        a_last = tl.maximum(a_last, tl.max(tl.where(same, rows, -1)))
        lo_r = tl.where(same, S_k, lo_r)
        hi_r = tl.where(same, -1, hi_r)
        if (tl.min(lo_r) <= last_key) & (tl.max(hi_r) >= first_key):  # a row of the block reaches a key of ours
            reach = (lo_r[:, None] <= keys[None, :]) & (hi_r[:, None] >= keys[None, :])
            first = tl.minimum(first, tl.min(tl.where(reach, rows[:, None], S_q), 0))
            last = tl.maximum(last, tl.max(tl.where(reach, rows[:, None], -1), 0))
            count += tl.sum(reach.to(tl.int32), 0)
            marked = tl.maximum(marked, tl.max((reach & part_r[:, None]).to(tl.int32), 0))
    exact = (count == 0) | ((count == last - first + 1) & (marked == 0))
    tl.store(k_lo + b * S_k + keys, first, mask=key_ok)
    tl.store(k_hi + b * S_k + keys, tl.where(exact, last, last + _PARTIAL), mask=key_ok)
    if tl.program_id(1) == 0:
        tl.store(alike + 2 * b, a_first)
        tl.store(alike + 2 * b + 1, a_last)
