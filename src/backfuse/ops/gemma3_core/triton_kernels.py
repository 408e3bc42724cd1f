"""037's Triton kernels, one per launch (`backward.py` launches them as `config.plan` says):

1. pack: fp16 copies of X, grad_output, [Wq; Wk; Wv] and Wo^T; zero fills for split-K outputs;
2. forward products: raw [q | k | v] = X [Wq; Wk; Wv]^T and dA = grad_output Wo (fp16), with
   RMSNorm and RoPE of the q and k heads in the epilogue, giving rot = [qr | kr];
3. attention forward: per (batch, head, query block) the context A, the log-sum-exp of each row
   and delta = rowsum(A * dA);
4. attention backward: dK/dV programs per (batch, KV head, key block) looping over the group's 3
   query heads, dQ programs per (batch, head, query block); RoPE and RMSNorm backward in their
   epilogues write G = [dq | dk | dv] token-major, plus partial norm-weight gradients;
5. gradient products: grad_Wo = grad_output^T A, grad_hidden = G [Wq; Wk; Wv], grad_[Wq; Wk; Wv] =
   G^T X, and the norm-weight gradients from their partials.
On the cuBLAS path cuBLAS does the products of 2 and 5: launch 2 then only norms and rotates q, k
and copies v to fp16, launch 5 only sums the norm-weight partials.

The operator's sizes are constexpr parameters, given by the plan (`config.size_constexprs`): HIDDEN,
HEADS query heads and KV_HEADS KV heads (GROUP query heads each) of HEAD_DIM features (HALF: the
halves RoPE rotates together), Q_OUT and KV_OUT the q and the k / v projections' widths, QK = [q | k]'s
and QKV = [q | k | v]'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.triton.elementwise import cast_chunk, column_sums, max_abs, transpose_tile, zero_chunk
from ...kernels.triton.gemm import gemm_tile, mma_tile, store_tile, tile_coords
from ...kernels.triton.pdl import after_previous_launch
from ...kernels.triton.queue import wait_at_least

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["T", "n_counters", "first", "e_go", "e_wo", "e_x", "e_wq", "e_wk", "e_wv", "e_gx",
                                "e_zwqkv", "e_zwo"])
def pack_kernel(
    go, x, wq, wk, wv, wo,
    go16, x16, wqkv16, wo_t16, ranges, grad_x, grad_wqkv, grad_wo, counters,
    T, n_counters, first, e_go, e_wo, e_x, e_wq, e_wk, e_wv, e_gx, e_zwqkv, e_zwo,
    HIDDEN: tl.constexpr, Q_OUT: tl.constexpr, KV_OUT: tl.constexpr, QKV: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """go16 = fp16 of grad_output; wo_t16 = fp16(Wo^T) in TILE x TILE tiles; x16 = fp16 of X; wqkv16 =
    fp16 of [Wq; Wk; Wv]; zeros in grad_x, grad_[Wq; Wk; Wv], grad_Wo where their product is split, and
    in the attention backward's n_counters counters. The program segments are `config.pack_layout`'s,
    in its order; e_* is the end of each but the last. This launch runs the layout's programs from
    `first` on (`Plan.pack_parts`). Each converting program (before e_wv) stores the largest |value|
    it converted in ranges[program]."""
    after_previous_launch(PDL)
    pid = tl.program_id(0) + first
    WQ: tl.constexpr = Q_OUT * HIDDEN
    WKV: tl.constexpr = KV_OUT * HIDDEN
    n_act = T * HIDDEN
    largest = 0.0
    if pid < e_go:
        largest = cast_chunk(go, go16, n_act, pid, BLOCK, ITERS)
    elif pid < e_wo:
        largest = transpose_tile(wo, wo_t16, pid - e_go, HIDDEN, TILE)
    elif pid < e_x:
        largest = cast_chunk(x, x16, n_act, pid - e_wo, BLOCK, ITERS)
    elif pid < e_wq:
        largest = cast_chunk(wq, wqkv16, WQ, pid - e_x, BLOCK, ITERS)
    elif pid < e_wk:
        largest = cast_chunk(wk, wqkv16 + WQ, WKV, pid - e_wq, BLOCK, ITERS)
    elif pid < e_wv:
        largest = cast_chunk(wv, wqkv16 + WQ + WKV, WKV, pid - e_wk, BLOCK, ITERS)
    elif pid < e_gx:
        zero_chunk(grad_x, n_act, pid - e_wv, BLOCK, ITERS)
    elif pid < e_zwqkv:
        zero_chunk(grad_wqkv, QKV * HIDDEN, pid - e_gx, BLOCK, ITERS)
    elif pid < e_zwo:
        zero_chunk(grad_wo, WQ, pid - e_zwqkv, BLOCK, ITERS)
    else:
        zero_chunk(counters, n_counters, pid - e_zwo, BLOCK, ITERS)
    if pid < e_wv:
        tl.store(ranges + pid, largest)


@triton.jit
def _halves(x, HALF: tl.constexpr):
    """[R, 128] -> its feature halves [R, 64], [R, 64] (the pairs RoPE rotates together)."""
    R: tl.constexpr = x.shape[0]
    return tl.split(tl.permute(tl.reshape(x, (R, 2, HALF)), (0, 2, 1)))


@triton.jit
def _whole(lo, hi, HEAD_DIM: tl.constexpr):
    """Inverse of _halves."""
    R: tl.constexpr = lo.shape[0]
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (R, HEAD_DIM))


@triton.jit
def _rope_table(table, tok, ok, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """cos or sin rows of tokens tok ([R]) as halves [R, 64], [R, 64]."""
    d = tl.arange(0, HALF)
    row = table + tok[:, None].to(tl.int64) * HEAD_DIM + d[None, :]
    return tl.load(row, mask=ok, other=0.0), tl.load(row + HALF, mask=ok, other=0.0)


@triton.jit(do_not_specialize=["T", "end_qkv"])
def forward_products_kernel(
    x16, go16, wqkv16, wo_t16, cos, sin, q_norm_w, k_norm_w,
    qk32, v16, rot16, d_attn16, ranges,
    T, end_qkv, eps, q_scale,
    HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, Q_OUT: tl.constexpr, KV_OUT: tl.constexpr,
    QK: tl.constexpr, QKV: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, PRODUCTS: tl.constexpr, QK_WIDTH: tl.constexpr,
    PDL: tl.constexpr,
):
    """One head (128 columns) per tile. PRODUCTS: [q | k | v] = X [Wq; Wk; Wv]^T (q, k in fp32 to
    qk32: the norm backward's sums over every token need them more exact than fp16; v in fp16 to
    v16) and dA = grad_output Wo (fp16); both read a row-major A and a [N, 3072] B^T (hence Wo
    transposed in the pack), so they share one call site and one shared-memory ring. Without
    PRODUCTS (one cuBLAS product made all of [q | k | v] in fp32 in qk32; the grid covers its heads
    only) the epilogue runs and v's heads are copied to v16. qk32's rows are QK_WIDTH wide (the
    plan's qk_width).
    Programs [0, end_qkv) make [q | k | v]'s tiles, the rest dA's (the plan's forward_bounds).
    Epilogue of a q or k head: rot16 = RoPE(RMSNorm(q) * (1 + w)), q heads times q_scale = scaling /
    cap (so that the attention's products give z / cap, the tanh's argument, with no multiply per
    logit), and the tile's largest |rot| in ranges[head * row_blocks + row_block]; v and dA are
    checked where attention reads them."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    on_qkv = pid < end_qkv
    local = tl.where(on_qkv, pid, pid - end_qkv)
    width = tl.multiple_of(tl.where(on_qkv, QKV, Q_OUT), 1024)
    off_m = (local // (width // HEAD_DIM)) * BM
    off_n = (local % (width // HEAD_DIM)) * HEAD_DIM
    tok = off_m + tl.arange(0, BM)
    ok = tok[:, None] < T
    d = tl.arange(0, HEAD_DIM)
    rows = tok[:, None].to(tl.int64)
    on_qk = on_qkv & (off_n < QK)
    on_v = on_qkv & (off_n >= QK)
    if PRODUCTS:
        acc = mma_tile(
            tl.where(on_qkv, x16, go16), tl.where(on_qkv, wqkv16, wo_t16),
            off_m, off_n, T, width, 0, HIDDEN, HIDDEN, 1, 1, HIDDEN, BM, HEAD_DIM, BK,
        )
        if on_qk:
            tl.store(qk32 + rows * QK_WIDTH + off_n + d[None, :], acc, mask=ok)
        elif on_qkv:
            tl.store(v16 + rows * KV_OUT + off_n - QK + d[None, :], acc.to(tl.float16), mask=ok)
        else:
            tl.store(d_attn16 + rows * Q_OUT + off_n + d[None, :], acc.to(tl.float16), mask=ok)
    elif on_v:
        v = tl.load(qk32 + rows * QK_WIDTH + off_n + d[None, :], mask=ok, other=0.0)
        tl.store(v16 + rows * KV_OUT + off_n - QK + d[None, :], v.to(tl.float16), mask=ok)
    if on_qk:
        if PRODUCTS:
            raw = acc
        else:
            raw = tl.load(qk32 + rows * QK_WIDTH + off_n + d[None, :], mask=ok, other=0.0)
        row_blocks = (T + BM - 1) // BM
        r = tl.rsqrt(tl.sum(raw * raw, 1) / HEAD_DIM + eps)
        w = tl.load(tl.where(off_n < Q_OUT, q_norm_w, k_norm_w) + d)
        lo, hi = _halves(raw * r[:, None] * (1 + w)[None, :], HALF)
        cos_lo, cos_hi = _rope_table(cos, tok, ok, HEAD_DIM, HALF)
        sin_lo, sin_hi = _rope_table(sin, tok, ok, HEAD_DIM, HALF)
        rot = _whole(lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi, HEAD_DIM) * tl.where(off_n < Q_OUT, q_scale, 1.0)
        tl.store(rot16 + rows * QK + off_n + d[None, :], rot.to(tl.float16), mask=ok)
        tl.store(ranges + (off_n // HEAD_DIM) * row_blocks + off_m // BM, max_abs(tl.where(ok, rot, 0.0)))


@triton.jit
def _head_rows(buf16, width, column0, tok, ok, HEAD_DIM: tl.constexpr):
    """The [R, 128] fp16 slice of a token-major buffer for tokens tok at column column0."""
    d = tl.arange(0, HEAD_DIM)
    return tl.load(buf16 + tok[:, None].to(tl.int64) * width + column0 + d[None, :], mask=ok, other=0.0)


@triton.jit
def _query_block(index, programs, S, BM: tl.constexpr, HEADS: tl.constexpr):
    """Program `index` of `programs` over (batch, head, block of BM queries), the last blocks (most
    keys) first: its batch, head, batch * heads + head, block and query positions."""
    n_blocks = (S + BM - 1) // BM
    n_heads = programs // n_blocks
    bh = index % n_heads
    block = n_blocks - 1 - index // n_heads
    return bh // HEADS, bh % HEADS, bh, block, block * BM + tl.arange(0, BM)


@triton.jit
def _capped(x, APPROX_TANH: tl.constexpr):
    """t = tanh(x) for x = z / cap (rot q comes scaled by scaling / cap). APPROX_TANH: the GPU's tanh
    instruction (one special-function op; relative error <= 2^-11, the size of the fp16 rounding of
    the logits' operands); else through exp2 (the Triton interpreter cannot run inline PTX)."""
    if APPROX_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit(do_not_specialize=["S"])
def attention_forward_kernel(
    rot16, v16, d_attn16, attn16, lse, delta, ranges,
    S, cap,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, Q_OUT: tl.constexpr, KV_OUT: tl.constexpr,
    QK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, APPROX_TANH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (batch, head, block of BM queries), the last blocks (most keys) first: softmax over the
    capped, causal logits (online, in base 2), A = P v (fp16, token-major), the row log-sum-exp and
    delta = rowsum(A * dA); the largest |dA| of the block in ranges[pid]. (A needs no check: its
    rows are convex combinations of v's, which the attention backward checks.)"""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    b, h, bh, block, rows = _query_block(pid, tl.num_programs(0), S, BM, HEADS)
    kv = h // GROUP
    row_ok = rows < S
    q = _head_rows(rot16, QK, h * HEAD_DIM, b * S + rows, row_ok[:, None], HEAD_DIM)
    row_max = tl.full((BM,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, HEAD_DIM), dtype=tl.float32)
    log2_scale = cap * _LOG2E  # > 0: row maxima of t are those of the capped logits
    for n0 in range(0, tl.minimum((block + 1) * BM, S), BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = (cols < S)[:, None]
        k = _head_rows(rot16, QK, Q_OUT + kv * HEAD_DIM, b * S + cols, col_ok, HEAD_DIM)
        v = _head_rows(v16, KV_OUT, kv * HEAD_DIM, b * S + cols, col_ok, HEAD_DIM)
        t = _capped(tl.dot(q, tl.trans(k)), APPROX_TANH)
        t = tl.where(cols[None, :] <= rows[:, None], t, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(t, 1) * log2_scale)  # in base-2 units of the capped logits
        shrink = tl.exp2(row_max - new_max)
        p = tl.exp2(t * log2_scale - new_max[:, None])
        row_sum = row_sum * shrink + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), v, acc * shrink[:, None])
        row_max = new_max
    attn = acc / row_sum[:, None]
    tok = b * S + rows
    d = tl.arange(0, HEAD_DIM)
    offs = tok[:, None].to(tl.int64) * Q_OUT + h * HEAD_DIM + d[None, :]
    tl.store(attn16 + offs, attn.to(tl.float16), mask=row_ok[:, None])
    d_attn = tl.load(d_attn16 + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(lse + bh * S + rows, row_max + tl.log2(row_sum), mask=row_ok)
    tl.store(delta + bh * S + rows, tl.sum(attn * d_attn, 1), mask=row_ok)
    tl.store(ranges + pid, max_abs(d_attn))


@triton.jit
def _rope_norm_backward(d_rot, qk32, cos, sin, norm_w, g16, tok, ok, column, eps, QK_WIDTH: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, QKV: tl.constexpr):
    """RoPE, then RMSNorm backward of one head's rows: writes d(raw projection) to G in fp16 and
    returns this tile's share of the norm-weight gradient, sum over rows of d(qhat) * qn, and the
    tile's largest |d(raw)|."""
    lo, hi = _halves(d_rot, HALF)
    cos_lo, cos_hi = _rope_table(cos, tok, ok, HEAD_DIM, HALF)
    sin_lo, sin_hi = _rope_table(sin, tok, ok, HEAD_DIM, HALF)
    d_hat = _whole(lo * cos_lo + hi * sin_hi, hi * cos_hi - lo * sin_lo, HEAD_DIM)
    raw = _head_rows(qk32, QK_WIDTH, column, tok, ok, HEAD_DIM)
    r = tl.rsqrt(tl.sum(raw * raw, 1) / HEAD_DIM + eps)
    normed = raw * r[:, None]
    m = d_hat * (1 + tl.load(norm_w + tl.arange(0, HEAD_DIM)))[None, :]
    d_raw = r[:, None] * (m - normed * (tl.sum(m * normed, 1) / HEAD_DIM)[:, None])
    d = tl.arange(0, HEAD_DIM)
    tl.store(g16 + tok[:, None].to(tl.int64) * QKV + column + d[None, :], d_raw.to(tl.float16), mask=ok)
    return tl.sum(d_hat * normed, 0), max_abs(d_raw)


@triton.jit
def _group_sum(kv_parts, arrivals, slot, g, dk, dv, key_tok, col_ok, kv, tokens, HEAD_SPLIT: tl.constexpr,
               HEAD_DIM: tl.constexpr, KV_OUT: tl.constexpr):
    """Hand-off between the HEAD_SPLIT programs that share a key block, one per query head: each
    stores its fp32 dK, dV partial and counts itself in; the last to arrive (acq_rel, so the others'
    stores are visible) sums the partials in head order, the same order on every call. Returns the
    sums and whether this program was the last."""
    d = tl.arange(0, HEAD_DIM)
    off = key_tok[:, None].to(tl.int64) * (2 * KV_OUT) + kv * HEAD_DIM + d[None, :]
    part = tokens.to(tl.int64) * (2 * KV_OUT)
    tl.store(kv_parts + g * part + off, dk, mask=col_ok)
    tl.store(kv_parts + g * part + off + KV_OUT, dv, mask=col_ok)
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    last = tl.atomic_add(arrivals + slot, 1, sem="acq_rel") == HEAD_SPLIT - 1
    dk = tl.zeros_like(dk)
    dv = tl.zeros_like(dv)
    if last:
        for i in tl.static_range(HEAD_SPLIT):  # L2 reads (.cg): other programs wrote them
            dk += tl.load(kv_parts + i * part + off, mask=col_ok, other=0.0, cache_modifier=".cg")
            dv += tl.load(kv_parts + i * part + off + KV_OUT, mask=col_ok, other=0.0, cache_modifier=".cg")
    return dk, dv, last


@triton.jit
def _key_block_grads(pid, rot16, qk32, v16, d_attn16, lse, delta, cos, sin, k_norm_w, g16, k_norm_parts, ranges,
                     kv_parts, arrivals, S, kv_programs, r_v, r_dk, r_dv, scaling, cap, eps, KV_BN: tl.constexpr,
                     KV_BM: tl.constexpr, HEAD_SPLIT: tl.constexpr, QK_WIDTH: tl.constexpr,
                     APPROX_TANH: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, Q_OUT: tl.constexpr, KV_OUT: tl.constexpr,
                     QK: tl.constexpr, QKV: tl.constexpr):
    """dK, dV of one (batch, KV head, block of KV_BN keys), summed over the group's query heads and
    the causal query blocks (KV_BM at a time); RoPE and RMSNorm backward of dK into G. HEAD_SPLIT >
    1: each of that many programs takes GROUP / HEAD_SPLIT of the query heads and the last to finish
    sums them (_group_sum) — for small grids, whose first key blocks' programs (all later queries
    of three heads) would otherwise be the launch's critical path. Outputs of a key block go to
    slot pid // HEAD_SPLIT of k_norm_parts and of the range regions at r_v, r_dk, r_dv."""
    n_kv = kv_programs // ((S + KV_BN - 1) // KV_BN)
    block = pid // n_kv
    g0 = (pid % n_kv) % HEAD_SPLIT * (GROUP // HEAD_SPLIT)
    b = (pid % n_kv) // HEAD_SPLIT // KV_HEADS
    kv = (pid % n_kv) // HEAD_SPLIT % KV_HEADS
    cols = block * KV_BN + tl.arange(0, KV_BN)
    key_tok = b * S + cols
    col_ok = (cols < S)[:, None]
    k = _head_rows(rot16, QK, Q_OUT + kv * HEAD_DIM, key_tok, col_ok, HEAD_DIM)
    v = _head_rows(v16, KV_OUT, kv * HEAD_DIM, key_tok, col_ok, HEAD_DIM)
    dk = tl.zeros((KV_BN, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((KV_BN, HEAD_DIM), dtype=tl.float32)
    for g in range(g0, g0 + GROUP // HEAD_SPLIT):
        bh = b * HEADS + kv * GROUP + g
        for m0 in range((block * KV_BN) // KV_BM * KV_BM, S, KV_BM):
            rows = m0 + tl.arange(0, KV_BM)
            row_ok = rows < S
            q = _head_rows(rot16, QK, (kv * GROUP + g) * HEAD_DIM, b * S + rows, row_ok[:, None], HEAD_DIM)
            d_attn = _head_rows(d_attn16, Q_OUT, (kv * GROUP + g) * HEAD_DIM, b * S + rows, row_ok[:, None], HEAD_DIM)
            row_lse = tl.load(lse + bh * S + rows, mask=row_ok, other=float("inf"))  # P = 0 past S
            row_delta = tl.load(delta + bh * S + rows, mask=row_ok, other=0.0)
            t = _capped(tl.dot(k, tl.trans(q)), APPROX_TANH)  # [keys, queries]
            visible = cols[:, None] <= rows[None, :]
            p = tl.where(visible, tl.exp2(t * (cap * _LOG2E) - row_lse[None, :]), 0.0)
            dv = tl.dot(p.to(tl.float16), d_attn, dv)
            dp = tl.dot(v, tl.trans(d_attn))
            ds = p * (dp - row_delta[None, :]) * (1.0 - t * t)  # dS / scaling
            dk = tl.dot(ds.to(tl.float16), q, dk)
    slot = pid // HEAD_SPLIT
    last = True
    if HEAD_SPLIT > 1:
        dk, dv, last = _group_sum(kv_parts, arrivals, slot, g0 // (GROUP // HEAD_SPLIT), dk, dv, key_tok, col_ok,
                                  kv, n_kv // HEAD_SPLIT // KV_HEADS * S, HEAD_SPLIT, HEAD_DIM, KV_OUT)
    if last:
        # dK = scaling * sum dS^T q = cap * sum dS^T (q scaling / cap)
        part, dk_largest = _rope_norm_backward(dk * cap, qk32, cos, sin, k_norm_w, g16, key_tok, col_ok,
                                               Q_OUT + kv * HEAD_DIM, eps, QK_WIDTH, HEAD_DIM, HALF, QKV)
        tl.store(k_norm_parts + slot * HEAD_DIM + tl.arange(0, HEAD_DIM), part)
        d = tl.arange(0, HEAD_DIM)
        tl.store(g16 + key_tok[:, None].to(tl.int64) * QKV + QK + kv * HEAD_DIM + d[None, :], dv.to(tl.float16),
                 mask=col_ok)
        tl.store(ranges + r_v + slot, max_abs(v.to(tl.float32)))
        tl.store(ranges + r_dk + slot, dk_largest)
        tl.store(ranges + r_dv + slot, max_abs(dv))


@triton.jit
def _query_block_grads(local, q_programs, rot16, qk32, v16, d_attn16, lse, delta, cos, sin, q_norm_w, g16, q_norm_parts,
                       ranges, S, r_dq, scaling, cap, eps, Q_BM: tl.constexpr, Q_BN: tl.constexpr,
                       QK_WIDTH: tl.constexpr, APPROX_TANH: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HALF: tl.constexpr, Q_OUT: tl.constexpr, KV_OUT: tl.constexpr,
                       QK: tl.constexpr, QKV: tl.constexpr):
    """dQ of one (batch, head, block of Q_BM queries) over its causal keys (Q_BN at a time), heaviest
    blocks first; RoPE and RMSNorm backward into G."""
    b, h, bh, block, rows = _query_block(local, q_programs, S, Q_BM, HEADS)
    kv = h // GROUP
    row_ok = rows < S
    tok = b * S + rows
    q = _head_rows(rot16, QK, h * HEAD_DIM, tok, row_ok[:, None], HEAD_DIM)
    d_attn = _head_rows(d_attn16, Q_OUT, h * HEAD_DIM, tok, row_ok[:, None], HEAD_DIM)
    row_lse = tl.load(lse + bh * S + rows, mask=row_ok, other=float("inf"))  # P = 0 past S
    row_delta = tl.load(delta + bh * S + rows, mask=row_ok, other=0.0)
    dq = tl.zeros((Q_BM, HEAD_DIM), dtype=tl.float32)
    for n0 in range(0, tl.minimum((block + 1) * Q_BM, S), Q_BN):
        cols = n0 + tl.arange(0, Q_BN)
        col_ok = (cols < S)[:, None]
        k = _head_rows(rot16, QK, Q_OUT + kv * HEAD_DIM, b * S + cols, col_ok, HEAD_DIM)
        v = _head_rows(v16, KV_OUT, kv * HEAD_DIM, b * S + cols, col_ok, HEAD_DIM)
        t = _capped(tl.dot(q, tl.trans(k)), APPROX_TANH)
        visible = cols[None, :] <= rows[:, None]
        p = tl.where(visible, tl.exp2(t * (cap * _LOG2E) - row_lse[:, None]), 0.0)
        dp = tl.dot(d_attn, tl.trans(v))
        ds = p * (dp - row_delta[:, None]) * (1.0 - t * t)  # dS / scaling
        dq = tl.dot(ds.to(tl.float16), k, dq)
    part, dq_largest = _rope_norm_backward(dq * scaling, qk32, cos, sin, q_norm_w, g16, tok, row_ok[:, None],
                                           h * HEAD_DIM, eps, QK_WIDTH, HEAD_DIM, HALF, QKV)
    tl.store(q_norm_parts + local * HEAD_DIM + tl.arange(0, HEAD_DIM), part)
    tl.store(ranges + r_dq + local, dq_largest)


@triton.jit(do_not_specialize=["S", "kv_programs", "done", "r_v", "r_dk", "r_dv", "r_dq"])
def attention_backward_kernel(
    rot16, qk32, v16, d_attn16, lse, delta, cos, sin, q_norm_w, k_norm_w,
    g16, q_norm_parts, k_norm_parts, ranges, kv_parts, counters,
    S, kv_programs, done, r_v, r_dk, r_dv, r_dq, scaling, cap, eps,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    Q_OUT: tl.constexpr, KV_OUT: tl.constexpr, QK: tl.constexpr, QKV: tl.constexpr,
    KV_BN: tl.constexpr, KV_BM: tl.constexpr, Q_BM: tl.constexpr, Q_BN: tl.constexpr, HEAD_SPLIT: tl.constexpr,
    QK_WIDTH: tl.constexpr, APPROX_TANH: tl.constexpr, PDL: tl.constexpr,
):
    """Programs [0, kv_programs): dK, dV of a key block; the rest: dQ of a query block (one launch of
    both kinds beat two launches: benchmarks/notes/037.md). P is recomputed from the forward's
    log-sum-exp; dS = P (dP - delta) (1 - t^2) scaling, the soft cap's derivative included (the
    factor scaling is applied to dK and dQ once, after the sums; rot q arrives scaled by
    scaling / cap, so dK's factor is cap).
    The largest |value| of each tile of v, dk, dv (dK/dV programs) and dq (dQ programs) goes to its
    slot in ranges past the region's first slot r_v, r_dk, r_dv, r_dq (the plan's layout).

    counters (zeroed by the pack): the split dK/dV programs' arrivals, then at `done` the count of
    programs past their stores (G, the norm-weight partials), which the gradient launch waits on."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    if pid < kv_programs:
        _key_block_grads(pid, rot16, qk32, v16, d_attn16, lse, delta, cos, sin, k_norm_w, g16, k_norm_parts, ranges,
                         kv_parts, counters, S, kv_programs, r_v, r_dk, r_dv, scaling, cap, eps, KV_BN, KV_BM,
                         HEAD_SPLIT, QK_WIDTH, APPROX_TANH, HEADS, KV_HEADS, GROUP, HEAD_DIM, HALF, Q_OUT, KV_OUT, QK,
                         QKV)
    else:
        _query_block_grads(pid - kv_programs, tl.num_programs(0) - kv_programs, rot16, qk32, v16, d_attn16, lse,
                           delta, cos, sin, q_norm_w, g16, q_norm_parts, ranges, S, r_dq, scaling, cap, eps, Q_BM,
                           Q_BN, QK_WIDTH, APPROX_TANH, HEADS, GROUP, HEAD_DIM, HALF, Q_OUT, KV_OUT, QK, QKV)
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    tl.atomic_add(counters + done, 1, sem="release")


@triton.jit(do_not_specialize=["T", "split_gx", "split_wqkv", "split_wo", "start_gx", "end_gx", "start_wqkv", "end_wqkv",
                                "start_wo", "end_wo", "sums_start", "done", "n_done", "n_q_parts", "n_k_parts"])
def gradient_products_kernel(
    g16, wqkv16, x16, go16, attn16, q_norm_parts, k_norm_parts, counters,
    grad_x, grad_wqkv, grad_wo, grad_q_norm_w, grad_k_norm_w,
    T, split_gx, split_wqkv, split_wo, start_gx, end_gx, start_wqkv, end_wqkv, start_wo, end_wo, sums_start, done,
    n_done, n_q_parts, n_k_parts,
    HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr, Q_OUT: tl.constexpr, QKV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """grad_hidden = G [Wq; Wk; Wv] (A row-major); then, A read feature-contiguous, the weight
    gradients grad_[Wq; Wk; Wv] = G^T X (one output; its row blocks are the three) and grad_Wo =
    grad_output^T A. K splits per product (outputs pre-zeroed when split; 0 skips the product).
    Their tiles are the programs [start_*, end_*) (the plan's gradient_bounds, in its
    GRADIENT_ORDER); the programs from sums_start on sum the norm-weight partials in a fixed order
    (many short sums: on the cuBLAS path they are the whole launch, and its latency).

    PDL: launched while the attention backward runs, this launch does not wait for its end. The
    tiles that read G (grad_hidden's, grad_[Wq; Wk; Wv]'s) and the sums wait for counters[done] to
    reach n_done, every attention-backward program's stores made; grad_Wo's read what earlier
    launches wrote and start at once, beside the attention. This launch's programs are scheduled
    only once every attention-backward program has started (PDL's rule), past its own wait for the
    launches before: nothing this launch waits on can wait on it (benchmarks/notes/hardening.md,
    "Session 23")."""
    pid = tl.program_id(0)
    in_gx = (pid >= start_gx) & (pid < end_gx)
    in_wqkv = (pid >= start_wqkv) & (pid < end_wqkv)
    in_wo = (pid >= start_wo) & (pid < end_wo)
    if PDL:
        if in_gx | in_wqkv:
            wait_at_least(counters + done, n_done)
    if in_gx:
        gemm_tile(pid - start_gx, g16, wqkv16, grad_x, T, HIDDEN, QKV, QKV, 1, HIDDEN, 1, HIDDEN, split_gx, BM,
                  BN, BK)
    elif in_wqkv | in_wo:
        rows = tl.where(in_wqkv, QKV, Q_OUT)
        splits = tl.where(in_wqkv, split_wqkv, split_wo)
        off_m, off_n, k_lo, k_hi = tile_coords(pid - tl.where(in_wqkv, start_wqkv, start_wo), rows, HIDDEN, T,
                                               splits, BM, BN, BK)
        acc = mma_tile(tl.where(in_wqkv, g16, go16), tl.where(in_wqkv, x16, attn16), off_m, off_n, rows, HIDDEN,
                       k_lo, k_hi, 1, tl.multiple_of(rows, 1024), HIDDEN, 1, BM, BN, BK)
        store_tile(tl.where(in_wqkv, grad_wqkv, grad_wo), acc, off_m, off_n, rows, HIDDEN, HIDDEN, 1, splits > 1,
                   BM, BN)
    elif pid >= sums_start:
        if PDL:
            wait_at_least(counters + done, n_done)
        strip = pid - sums_start
        on_q = strip < HEAD_DIM // SUM_COLS
        cols = (strip % (HEAD_DIM // SUM_COLS)) * SUM_COLS + tl.arange(0, SUM_COLS)
        total = column_sums(tl.where(on_q, q_norm_parts, k_norm_parts), tl.where(on_q, n_q_parts, n_k_parts),
                            HEAD_DIM, cols, SUM_ROWS, SUM_COLS)
        tl.store(tl.where(on_q, grad_q_norm_w, grad_k_norm_w) + cols, total)
