"""037 — QK-norm + RoPE attention core, backward (Gemma 3 4B).

Forward: q, k, v projections; Gemma RMSNorm per head on q and k (weight applied as 1 + w); RoPE
(rotate-half) after the norm; soft-capped, causal, GQA (3 query heads per KV head) attention.
The backward recomputes the forward from X, then runs attention, RoPE and RMSNorm backward and the
six projection products.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..kernels import buffers
from ..kernels.elementwise import cast_chunk, chunks, column_sums, transpose_tile, zero_chunk
from ..kernels.fp16_range import RangeSlots, max_abs
from ..kernels.gemm import TileConfig, choose_splits, gemm_tile, mma_tile, store_tile, tile_coords, tile_count
from ..kernels.launch import FastKernel, after_previous_launch
from ..problem import Problem, Scalar, Tensor, fp32_matmul

HIDDEN = 3072
HEADS = 24
KV_HEADS = 8
GROUP = HEADS // KV_HEADS
HEAD_DIM = 128
HALF = HEAD_DIM // 2
Q_OUT = HEADS * HEAD_DIM  # 3072
KV_OUT = KV_HEADS * HEAD_DIM  # 1024
QK = Q_OUT + KV_OUT  # 4096: the q and k heads, which are normed and rotated
QKV = QK + KV_OUT  # 5120: width of the stacked [q | k | v] projection
ROPE_THETA = 10000.0

B, S = "batch_size", "seq_len"


def rotate_half(x):
    """rot(x) = concat(-x[64:], x[:64])."""
    return torch.cat((-x[..., HALF:], x[..., :HALF]), dim=-1)


def rotate_half_transposed(y):
    """rot^T(y) = concat(y[64:], -y[:64])."""
    return torch.cat((y[..., HALF:], -y[..., :HALF]), dim=-1)


def rope_tables(batch: int, seq: int, device) -> tuple:
    """Real RoPE tables: angle(pos, i) = pos * theta^(-i/64), concatenated twice to 128 features."""
    inv_freq = ROPE_THETA ** (-torch.arange(HALF, dtype=torch.float64) / HALF)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)

    def table(t):
        return t.to(torch.float32).expand(batch, seq, HEAD_DIM).contiguous().to(device)

    return table(angles.cos()), table(angles.sin())


class Gemma3AttnCoreBackward(Problem):
    id = "037"
    name = "037_qk_norm_rope_attention_core_backward"
    workload_file = "037_gemma3_attn_core_bwd.jsonl"
    inputs = (
        Tensor("grad_output", (B, S, HIDDEN)),
        Tensor("hidden_states", (B, S, HIDDEN)),
        Tensor("cos", (B, S, HEAD_DIM)),
        Tensor("sin", (B, S, HEAD_DIM)),
        Tensor("q_weight", (Q_OUT, HIDDEN)),
        Tensor("k_weight", (KV_OUT, HIDDEN)),
        Tensor("v_weight", (KV_OUT, HIDDEN)),
        Tensor("o_weight", (HIDDEN, Q_OUT)),
        Tensor("q_norm_weight", (HEAD_DIM,)),
        Tensor("k_norm_weight", (HEAD_DIM,)),
        Scalar("scaling", 1 / math.sqrt(HEAD_DIM)),
        Scalar("attn_logit_softcapping", 50.0),
        Scalar("rms_norm_eps", 1e-6),
    )
    outputs = (
        Tensor("grad_hidden_states", (B, S, HIDDEN)),
        Tensor("grad_q_weight", (Q_OUT, HIDDEN)),
        Tensor("grad_k_weight", (KV_OUT, HIDDEN)),
        Tensor("grad_v_weight", (KV_OUT, HIDDEN)),
        Tensor("grad_o_weight", (HIDDEN, Q_OUT)),
        Tensor("grad_q_norm_weight", (HEAD_DIM,)),
        Tensor("grad_k_norm_weight", (HEAD_DIM,)),
    )
    upstream_grads = ("grad_output",)
    differentiates = ("hidden_states", "q_weight", "k_weight", "v_weight", "o_weight", "q_norm_weight", "k_norm_weight")

    def draw(self, axes, gen, device):
        def normal(spec, scale):
            return torch.randn(spec.shape(axes), generator=gen, device=device) * scale

        go, x, _, _, wq, wk, wv, wo, qnw, knw = self.inputs[:10]
        grad_output = normal(go, 1.0)
        hidden = normal(x, 1 / math.sqrt(HIDDEN))
        cos, sin = rope_tables(axes[B], axes[S], device)
        weights = [normal(w, math.sqrt(2 / HIDDEN)) for w in (wq, wk, wv, wo)]
        return [grad_output, hidden, cos, sin, *weights, normal(qnw, 0.02), normal(knw, 0.02)]

    def _project(self, x, cos, sin, wq, wk, wv, qnw, knw, eps):
        """Forward up to the attention inputs, keeping what the backward needs."""
        batch, seq, _ = x.shape
        x2 = x.reshape(batch * seq, HIDDEN)

        def heads(t, n):
            return t.view(batch, seq, n, HEAD_DIM).transpose(1, 2)

        cos, sin = cos[:, None], sin[:, None]

        def norm_rope(raw, w):
            r = torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + eps)
            normed = raw * r
            hat = normed * (1 + w)
            return dict(raw=raw, r=r, normed=normed, rotated=hat * cos + rotate_half(hat) * sin)

        q = norm_rope(heads(x2 @ wq.T, HEADS), qnw)
        k = norm_rope(heads(x2 @ wk.T, KV_HEADS), knw)
        v = heads(x2 @ wv.T, KV_HEADS)
        return x2, q, k, v

    @staticmethod
    def _attention_probs(qr, kr, scaling, cap):
        seq = qr.shape[2]
        z = (qr @ kr.transpose(-1, -2)) * scaling
        t = torch.tanh(z / cap)
        masked = torch.ones(seq, seq, dtype=torch.bool, device=qr.device).triu(1)
        return t, torch.softmax((t * cap).masked_fill(masked, float("-inf")), dim=-1)

    def reference_math(self, go, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps):
        batch, seq, _ = x.shape
        x2, q, k, v = self._project(x, cos, sin, wq, wk, wv, qnw, knw, eps)
        kr = k["rotated"].repeat_interleave(GROUP, dim=1)  # query head h reads KV head h // 3
        vr = v.repeat_interleave(GROUP, dim=1)
        t, p = self._attention_probs(q["rotated"], kr, scaling, cap)

        def tokens(t_heads):
            return t_heads.transpose(1, 2).reshape(batch * seq, -1)

        go2 = go.reshape(batch * seq, HIDDEN)
        grad_wo = go2.T @ tokens(p @ vr)
        d_out = (go2 @ wo).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)

        dp = d_out @ vr.transpose(-1, -2)
        dv_per_q = p.transpose(-1, -2) @ d_out
        dc = p * (dp - (dp * p).sum(-1, keepdim=True))
        ds = dc * (1 - t * t) * scaling
        dqr = ds @ kr
        dkr_per_q = ds.transpose(-1, -2) @ q["rotated"]

        def group_sum(g):
            return g.view(batch, KV_HEADS, GROUP, seq, HEAD_DIM).sum(2)

        cos_h, sin_h = cos[:, None], sin[:, None]

        def rope_norm_backward(d_rot, state, w):
            d_hat = d_rot * cos_h + rotate_half_transposed(d_rot * sin_h)
            grad_w = (d_hat * state["normed"]).sum((0, 1, 2))
            m = d_hat * (1 + w)
            r, raw = state["r"], state["raw"]
            d_raw = r * m - (r**3 / HEAD_DIM) * raw * (m * raw).sum(-1, keepdim=True)
            return d_raw, grad_w

        dq, grad_qnw = rope_norm_backward(dqr, q, qnw)
        dk, grad_knw = rope_norm_backward(group_sum(dkr_per_q), k, knw)
        gq, gk, gv = tokens(dq), tokens(dk), tokens(group_sum(dv_per_q))
        grad_x = gq @ wq + gk @ wk + gv @ wv
        return (
            grad_x.view(batch, seq, HIDDEN),
            gq.T @ x2,
            gk.T @ x2,
            gv.T @ x2,
            grad_wo,
            grad_qnw,
            grad_knw,
        )

    def forward(self, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps):
        batch, seq, _ = x.shape
        _, q, k, v = self._project(x, cos, sin, wq, wk, wv, qnw, knw, eps)
        kr = k["rotated"].repeat_interleave(GROUP, dim=1)
        _, p = self._attention_probs(q["rotated"], kr, scaling, cap)
        attn = (p @ v.repeat_interleave(GROUP, dim=1)).transpose(1, 2).reshape(batch, seq, Q_OUT)
        return attn @ wo.T

    def macs(self, axes):
        tokens = axes[B] * axes[S]
        # Forward QKV (5120 wide), dA and grad_Wo, grad_hidden and grad_[Wq;Wk;Wv].
        projections = tokens * HIDDEN * (5120 + 2 * Q_OUT + 2 * 5120)
        # Six attention products (QK^T, PV, dP, dV, dQ, dK) over the causal triangle.
        causal_pairs = axes[S] * (axes[S] + 1) // 2
        return projections + 6 * axes[B] * HEADS * causal_pairs * HEAD_DIM

    def fused(self, go, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps, needs=None, deterministic=False,
              ranges=None):
        if x.shape[0] * x.shape[1] * QKV >= 2**31:  # the kernels count elements in int32
            with fp32_matmul(tf32=False):
                return self.reference_math(go, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps)
        return gemma3_attention_backward(go, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps, needs=needs,
                                         deterministic=deterministic, ranges=ranges)


PROBLEM = Gemma3AttnCoreBackward()

# ---- fused path: five launches -------------------------------------------------------------------
# 1. pack: fp16 copies of X, grad_output, [Wq; Wk; Wv] and Wo^T; zero fills for split-K outputs;
# 2. forward products: raw [q | k | v] = X [Wq; Wk; Wv]^T and dA = grad_output Wo (fp16), with
#    RMSNorm and RoPE of the q and k heads in the epilogue, giving rot = [qr | kr];
# 3. attention forward: per (batch, head, query block) the context A, the log-sum-exp of each row
#    and delta = rowsum(A * dA);
# 4. attention backward: dK/dV programs per (batch, KV head, key block) looping over the group's 3
#    query heads, dQ programs per (batch, head, query block); RoPE and RMSNorm backward in their
#    epilogues write G = [dq | dk | dv] token-major, plus partial norm-weight gradients;
# 5. gradient products: grad_hidden = G [Wq; Wk; Wv], grad_[Wq; Wk; Wv] = G^T X, grad_Wo =
#    grad_output^T A, and the norm-weight gradients from their partials.
# From CUBLAS_MIN_FLOP on, cuBLAS does the products of 2 and 5: launch 2 then only norms and rotates,
# launch 5 only sums the norm-weight partials.

_HIDDEN = tl.constexpr(HIDDEN)
_HEADS = tl.constexpr(HEADS)
_KV_HEADS = tl.constexpr(KV_HEADS)
_GROUP = tl.constexpr(GROUP)
_HEAD_DIM = tl.constexpr(HEAD_DIM)
_HALF = tl.constexpr(HALF)
_Q_OUT = tl.constexpr(Q_OUT)
_KV_OUT = tl.constexpr(KV_OUT)
_QKV = tl.constexpr(QKV)
_QK = tl.constexpr(QK)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=["T", "zero_gx", "zero_wqkv", "zero_wo", "n_arrivals"])
def _pack_kernel(
    go, x, wq, wk, wv, wo,
    go16, x16, wqkv16, wo_t16, ranges, grad_x, grad_wqkv, grad_wo, arrivals,
    T, zero_gx, zero_wqkv, zero_wo, n_arrivals,
    TILE: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ranges, in order: flat casts of grad_output, X, Wq, Wk, Wv (into [Wq; Wk; Wv]), Wo^T
    tiles, then zero fills of the split-K products' outputs whose flag is set and of the attention
    backward's n_arrivals counters. Each converting program stores the largest |value| it converted
    in ranges[pid]."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    CHUNK: tl.constexpr = BLOCK * ITERS
    WQ: tl.constexpr = _Q_OUT * _HIDDEN
    WKV: tl.constexpr = _KV_OUT * _HIDDEN
    WQ_CHUNKS: tl.constexpr = (WQ + CHUNK - 1) // CHUNK
    WKV_CHUNKS: tl.constexpr = (WKV + CHUNK - 1) // CHUNK
    WQKV_CHUNKS: tl.constexpr = (_QKV * _HIDDEN + CHUNK - 1) // CHUNK
    n_act = T * _HIDDEN
    act_chunks = (n_act + CHUNK - 1) // CHUNK
    e_go = act_chunks
    e_x = e_go + act_chunks
    e_wq = e_x + WQ_CHUNKS
    e_wk = e_wq + WKV_CHUNKS
    e_wv = e_wk + WKV_CHUNKS
    e_wo = e_wv + (_HIDDEN // TILE) * (_Q_OUT // TILE)
    e_gx = e_wo + zero_gx * act_chunks
    e_zwqkv = e_gx + zero_wqkv * WQKV_CHUNKS
    e_zwo = e_zwqkv + zero_wo * WQ_CHUNKS
    largest = 0.0
    if pid < e_go:
        largest = cast_chunk(go, go16, n_act, pid, BLOCK, ITERS)
    elif pid < e_x:
        largest = cast_chunk(x, x16, n_act, pid - e_go, BLOCK, ITERS)
    elif pid < e_wq:
        largest = cast_chunk(wq, wqkv16, WQ, pid - e_x, BLOCK, ITERS)
    elif pid < e_wk:
        largest = cast_chunk(wk, wqkv16 + WQ, WKV, pid - e_wq, BLOCK, ITERS)
    elif pid < e_wv:
        largest = cast_chunk(wv, wqkv16 + WQ + WKV, WKV, pid - e_wk, BLOCK, ITERS)
    elif pid < e_wo:
        largest = transpose_tile(wo, wo_t16, pid - e_wv, _HIDDEN, TILE)
    elif pid < e_gx:
        zero_chunk(grad_x, n_act, pid - e_wo, BLOCK, ITERS)
    elif pid < e_zwqkv:
        zero_chunk(grad_wqkv, _QKV * _HIDDEN, pid - e_gx, BLOCK, ITERS)
    elif pid < e_zwo:
        zero_chunk(grad_wo, WQ, pid - e_zwqkv, BLOCK, ITERS)
    else:
        zero_chunk(arrivals, n_arrivals, pid - e_zwo, BLOCK, ITERS)
    if pid < e_wo:
        tl.store(ranges + pid, largest)


@triton.jit
def _halves(x):
    """[R, 128] -> its feature halves [R, 64], [R, 64] (the pairs RoPE rotates together)."""
    R: tl.constexpr = x.shape[0]
    return tl.split(tl.permute(tl.reshape(x, (R, 2, _HALF)), (0, 2, 1)))


@triton.jit
def _whole(lo, hi):
    """Inverse of _halves."""
    R: tl.constexpr = lo.shape[0]
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (R, _HEAD_DIM))


@triton.jit
def _rope_table(table, tok, ok):
    """cos or sin rows of tokens tok ([R]) as halves [R, 64], [R, 64]."""
    d = tl.arange(0, _HALF)
    row = table + tok[:, None].to(tl.int64) * _HEAD_DIM + d[None, :]
    return tl.load(row, mask=ok, other=0.0), tl.load(row + _HALF, mask=ok, other=0.0)


@triton.jit(do_not_specialize=["T"])
def _forward_products_kernel(
    x16, go16, wqkv16, wo_t16, cos, sin, q_norm_w, k_norm_w,
    qk32, v16, rot16, d_attn16, ranges,
    T, eps, q_scale,
    BM: tl.constexpr, BK: tl.constexpr, PRODUCTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One head (128 columns) per tile. PRODUCTS: [q | k | v] = X [Wq; Wk; Wv]^T (q, k in fp32 to
    qk32: the norm backward's sums over every token need them more exact than fp16; v in fp16 to
    v16) and dA = grad_output Wo (fp16); both read a row-major A and a [N, 3072] B^T (hence Wo
    transposed in the pack), so they share one call site and one shared-memory ring. Without
    PRODUCTS (cuBLAS made qk32 and v16; the grid covers [q | k | v] only) just the epilogue runs.
    Epilogue of a q or k head: rot16 = RoPE(RMSNorm(q) * (1 + w)), q heads times q_scale = scaling /
    cap (so that the attention's products give z / cap, the tanh's argument, with no multiply per
    logit), and the tile's largest |rot| in ranges[head * row_blocks + row_block]; v and dA are
    checked where attention reads them."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    t_qkv = ((T + BM - 1) // BM) * (_QKV // _HEAD_DIM)
    on_qkv = pid < t_qkv
    local = tl.where(on_qkv, pid, pid - t_qkv)
    width = tl.multiple_of(tl.where(on_qkv, _QKV, _Q_OUT), 1024)
    off_m = (local // (width // _HEAD_DIM)) * BM
    off_n = (local % (width // _HEAD_DIM)) * _HEAD_DIM
    tok = off_m + tl.arange(0, BM)
    ok = tok[:, None] < T
    d = tl.arange(0, _HEAD_DIM)
    rows = tok[:, None].to(tl.int64)
    on_qk = on_qkv & (off_n < _QK)
    if PRODUCTS:
        acc = mma_tile(
            tl.where(on_qkv, x16, go16), tl.where(on_qkv, wqkv16, wo_t16),
            off_m, off_n, T, width, 0, _HIDDEN, _HIDDEN, 1, 1, _HIDDEN, BM, _HEAD_DIM, BK,
        )
        if on_qk:
            tl.store(qk32 + rows * _QK + off_n + d[None, :], acc, mask=ok)
        elif on_qkv:
            tl.store(v16 + rows * _KV_OUT + off_n - _QK + d[None, :], acc.to(tl.float16), mask=ok)
        else:
            tl.store(d_attn16 + rows * _Q_OUT + off_n + d[None, :], acc.to(tl.float16), mask=ok)
    if on_qk:
        if PRODUCTS:
            raw = acc
        else:
            raw = tl.load(qk32 + rows * _QK + off_n + d[None, :], mask=ok, other=0.0)
        row_blocks = (T + BM - 1) // BM
        r = tl.rsqrt(tl.sum(raw * raw, 1) / _HEAD_DIM + eps)
        w = tl.load(tl.where(off_n < _Q_OUT, q_norm_w, k_norm_w) + d)
        lo, hi = _halves(raw * r[:, None] * (1 + w)[None, :])
        cos_lo, cos_hi = _rope_table(cos, tok, ok)
        sin_lo, sin_hi = _rope_table(sin, tok, ok)
        rot = _whole(lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi) * tl.where(off_n < _Q_OUT, q_scale, 1.0)
        tl.store(rot16 + rows * _QK + off_n + d[None, :], rot.to(tl.float16), mask=ok)
        tl.store(ranges + (off_n // _HEAD_DIM) * row_blocks + off_m // BM, max_abs(tl.where(ok, rot, 0.0)))


@triton.jit
def _head_rows(buf16, width, column0, tok, ok):
    """The [R, 128] fp16 slice of a token-major buffer for tokens tok at column column0."""
    d = tl.arange(0, _HEAD_DIM)
    return tl.load(buf16 + tok[:, None].to(tl.int64) * width + column0 + d[None, :], mask=ok, other=0.0)


@triton.jit
def _query_block(index, programs, S, BM: tl.constexpr):
    """Program `index` of `programs` over (batch, head, block of BM queries), the last blocks (most
    keys) first: its batch, head, batch * heads + head, block and query positions."""
    n_blocks = (S + BM - 1) // BM
    n_heads = programs // n_blocks
    bh = index % n_heads
    block = n_blocks - 1 - index // n_heads
    return bh // _HEADS, bh % _HEADS, bh, block, block * BM + tl.arange(0, BM)


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
def _attention_forward_kernel(
    rot16, v16, d_attn16, attn16, lse, delta, ranges,
    S, cap,
    BM: tl.constexpr, BN: tl.constexpr, APPROX_TANH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (batch, head, block of BM queries), the last blocks (most keys) first: softmax over the
    capped, causal logits (online, in base 2), A = P v (fp16, token-major), the row log-sum-exp and
    delta = rowsum(A * dA); the largest |dA| of the block in ranges[pid]. (A needs no check: its
    rows are convex combinations of v's, which the attention backward checks.)"""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    b, h, bh, block, rows = _query_block(pid, tl.num_programs(0), S, BM)
    kv = h // _GROUP
    row_ok = rows < S
    q = _head_rows(rot16, _QK, h * _HEAD_DIM, b * S + rows, row_ok[:, None])
    row_max = tl.full((BM,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, _HEAD_DIM), dtype=tl.float32)
    log2_scale = cap * _LOG2E  # > 0: row maxima of t are those of the capped logits
    for n0 in range(0, tl.minimum((block + 1) * BM, S), BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = (cols < S)[:, None]
        k = _head_rows(rot16, _QK, _Q_OUT + kv * _HEAD_DIM, b * S + cols, col_ok)
        v = _head_rows(v16, _KV_OUT, kv * _HEAD_DIM, b * S + cols, col_ok)
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
    d = tl.arange(0, _HEAD_DIM)
    offs = tok[:, None].to(tl.int64) * _Q_OUT + h * _HEAD_DIM + d[None, :]
    tl.store(attn16 + offs, attn.to(tl.float16), mask=row_ok[:, None])
    d_attn = tl.load(d_attn16 + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(lse + bh * S + rows, row_max + tl.log2(row_sum), mask=row_ok)
    tl.store(delta + bh * S + rows, tl.sum(attn * d_attn, 1), mask=row_ok)
    tl.store(ranges + pid, max_abs(d_attn))


@triton.jit
def _rope_norm_backward(d_rot, qk32, cos, sin, norm_w, g16, tok, ok, column, eps):
    """RoPE, then RMSNorm backward of one head's rows: writes d(raw projection) to G in fp16 and
    returns this tile's share of the norm-weight gradient, sum over rows of d(qhat) * qn, and the
    tile's largest |d(raw)|."""
    lo, hi = _halves(d_rot)
    cos_lo, cos_hi = _rope_table(cos, tok, ok)
    sin_lo, sin_hi = _rope_table(sin, tok, ok)
    d_hat = _whole(lo * cos_lo + hi * sin_hi, hi * cos_hi - lo * sin_lo)
    raw = _head_rows(qk32, _QK, column, tok, ok)
    r = tl.rsqrt(tl.sum(raw * raw, 1) / _HEAD_DIM + eps)
    normed = raw * r[:, None]
    m = d_hat * (1 + tl.load(norm_w + tl.arange(0, _HEAD_DIM)))[None, :]
    d_raw = r[:, None] * (m - normed * (tl.sum(m * normed, 1) / _HEAD_DIM)[:, None])
    d = tl.arange(0, _HEAD_DIM)
    tl.store(g16 + tok[:, None].to(tl.int64) * _QKV + column + d[None, :], d_raw.to(tl.float16), mask=ok)
    return tl.sum(d_hat * normed, 0), max_abs(d_raw)


@triton.jit
def _group_sum(kv_parts, arrivals, slot, g, dk, dv, key_tok, col_ok, kv, tokens, HEAD_SPLIT: tl.constexpr):
    """Hand-off between the HEAD_SPLIT programs that share a key block, one per query head: each
    stores its fp32 dK, dV partial and counts itself in; the last to arrive (acq_rel, so the others'
    stores are visible) sums the partials in head order, the same order on every call. Returns the
    sums and whether this program was the last."""
    d = tl.arange(0, _HEAD_DIM)
    off = key_tok[:, None].to(tl.int64) * (2 * _KV_OUT) + kv * _HEAD_DIM + d[None, :]
    part = tokens.to(tl.int64) * (2 * _KV_OUT)
    tl.store(kv_parts + g * part + off, dk, mask=col_ok)
    tl.store(kv_parts + g * part + off + _KV_OUT, dv, mask=col_ok)
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    last = tl.atomic_add(arrivals + slot, 1, sem="acq_rel") == HEAD_SPLIT - 1
    dk = tl.zeros_like(dk)
    dv = tl.zeros_like(dv)
    if last:
        for i in tl.static_range(HEAD_SPLIT):  # L2 reads (.cg): other programs wrote them
            dk += tl.load(kv_parts + i * part + off, mask=col_ok, other=0.0, cache_modifier=".cg")
            dv += tl.load(kv_parts + i * part + off + _KV_OUT, mask=col_ok, other=0.0, cache_modifier=".cg")
    return dk, dv, last


@triton.jit
def _key_block_grads(pid, rot16, qk32, v16, d_attn16, lse, delta, cos, sin, k_norm_w, g16, k_norm_parts, ranges,
                     kv_parts, arrivals, S, kv_programs, scaling, cap, eps, KV_BN: tl.constexpr,
                     KV_BM: tl.constexpr, HEAD_SPLIT: tl.constexpr, APPROX_TANH: tl.constexpr):
    """dK, dV of one (batch, KV head, block of KV_BN keys), summed over the group's query heads and
    the causal query blocks (KV_BM at a time); RoPE and RMSNorm backward of dK into G. HEAD_SPLIT >
    1: each of that many programs takes GROUP / HEAD_SPLIT of the query heads and the last to finish
    sums them (_group_sum) — for small grids, whose first key blocks' programs (all later queries
    of three heads) would otherwise be the launch's critical path. Outputs of a key block go to
    slot pid // HEAD_SPLIT of k_norm_parts and ranges."""
    n_kv = kv_programs // ((S + KV_BN - 1) // KV_BN)
    block = pid // n_kv
    g0 = (pid % n_kv) % HEAD_SPLIT * (_GROUP // HEAD_SPLIT)
    b = (pid % n_kv) // HEAD_SPLIT // _KV_HEADS
    kv = (pid % n_kv) // HEAD_SPLIT % _KV_HEADS
    cols = block * KV_BN + tl.arange(0, KV_BN)
    key_tok = b * S + cols
    col_ok = (cols < S)[:, None]
    k = _head_rows(rot16, _QK, _Q_OUT + kv * _HEAD_DIM, key_tok, col_ok)
    v = _head_rows(v16, _KV_OUT, kv * _HEAD_DIM, key_tok, col_ok)
    dk = tl.zeros((KV_BN, _HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((KV_BN, _HEAD_DIM), dtype=tl.float32)
    for g in range(g0, g0 + _GROUP // HEAD_SPLIT):
        bh = b * _HEADS + kv * _GROUP + g
        for m0 in range((block * KV_BN) // KV_BM * KV_BM, S, KV_BM):
            rows = m0 + tl.arange(0, KV_BM)
            row_ok = rows < S
            q = _head_rows(rot16, _QK, (kv * _GROUP + g) * _HEAD_DIM, b * S + rows, row_ok[:, None])
            d_attn = _head_rows(d_attn16, _Q_OUT, (kv * _GROUP + g) * _HEAD_DIM, b * S + rows, row_ok[:, None])
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
    slots = kv_programs // HEAD_SPLIT
    last = True
    if HEAD_SPLIT > 1:
        dk, dv, last = _group_sum(kv_parts, arrivals, slot, g0 // (_GROUP // HEAD_SPLIT), dk, dv, key_tok, col_ok,
                                  kv, n_kv // HEAD_SPLIT // _KV_HEADS * S, HEAD_SPLIT)
    if last:
        # dK = scaling * sum dS^T q = cap * sum dS^T (q scaling / cap)
        part, dk_largest = _rope_norm_backward(dk * cap, qk32, cos, sin, k_norm_w, g16, key_tok, col_ok,
                                               _Q_OUT + kv * _HEAD_DIM, eps)
        tl.store(k_norm_parts + slot * _HEAD_DIM + tl.arange(0, _HEAD_DIM), part)
        d = tl.arange(0, _HEAD_DIM)
        tl.store(g16 + key_tok[:, None].to(tl.int64) * _QKV + _QK + kv * _HEAD_DIM + d[None, :], dv.to(tl.float16),
                 mask=col_ok)
        tl.store(ranges + slot, max_abs(v.to(tl.float32)))
        tl.store(ranges + slots + slot, dk_largest)
        tl.store(ranges + 2 * slots + slot, max_abs(dv))


@triton.jit
def _query_block_grads(local, q_programs, rot16, qk32, v16, d_attn16, lse, delta, cos, sin, q_norm_w, g16, q_norm_parts,
                       ranges, S, kv_slots, scaling, cap, eps, Q_BM: tl.constexpr, Q_BN: tl.constexpr,
                       APPROX_TANH: tl.constexpr):
    """dQ of one (batch, head, block of Q_BM queries) over its causal keys (Q_BN at a time), heaviest
    blocks first; RoPE and RMSNorm backward into G."""
    b, h, bh, block, rows = _query_block(local, q_programs, S, Q_BM)
    kv = h // _GROUP
    row_ok = rows < S
    tok = b * S + rows
    q = _head_rows(rot16, _QK, h * _HEAD_DIM, tok, row_ok[:, None])
    d_attn = _head_rows(d_attn16, _Q_OUT, h * _HEAD_DIM, tok, row_ok[:, None])
    row_lse = tl.load(lse + bh * S + rows, mask=row_ok, other=float("inf"))  # P = 0 past S
    row_delta = tl.load(delta + bh * S + rows, mask=row_ok, other=0.0)
    dq = tl.zeros((Q_BM, _HEAD_DIM), dtype=tl.float32)
    for n0 in range(0, tl.minimum((block + 1) * Q_BM, S), Q_BN):
        cols = n0 + tl.arange(0, Q_BN)
        col_ok = (cols < S)[:, None]
        k = _head_rows(rot16, _QK, _Q_OUT + kv * _HEAD_DIM, b * S + cols, col_ok)
        v = _head_rows(v16, _KV_OUT, kv * _HEAD_DIM, b * S + cols, col_ok)
        t = _capped(tl.dot(q, tl.trans(k)), APPROX_TANH)
        visible = cols[None, :] <= rows[:, None]
        p = tl.where(visible, tl.exp2(t * (cap * _LOG2E) - row_lse[:, None]), 0.0)
        dp = tl.dot(d_attn, tl.trans(v))
        ds = p * (dp - row_delta[:, None]) * (1.0 - t * t)  # dS / scaling
        dq = tl.dot(ds.to(tl.float16), k, dq)
    part, dq_largest = _rope_norm_backward(dq * scaling, qk32, cos, sin, q_norm_w, g16, tok, row_ok[:, None],
                                           h * _HEAD_DIM, eps)
    tl.store(q_norm_parts + local * _HEAD_DIM + tl.arange(0, _HEAD_DIM), part)
    tl.store(ranges + 3 * kv_slots + local, dq_largest)


@triton.jit(do_not_specialize=["S", "kv_programs"])
def _attention_backward_kernel(
    rot16, qk32, v16, d_attn16, lse, delta, cos, sin, q_norm_w, k_norm_w,
    g16, q_norm_parts, k_norm_parts, ranges, kv_parts, arrivals,
    S, kv_programs, scaling, cap, eps,
    KV_BN: tl.constexpr, KV_BM: tl.constexpr, Q_BM: tl.constexpr, Q_BN: tl.constexpr, HEAD_SPLIT: tl.constexpr,
    APPROX_TANH: tl.constexpr, PDL: tl.constexpr,
):
    """The first kv_programs programs: dK, dV of a key block; the rest: dQ of a query block (one
    launch of both kinds beat two launches: benchmarks/notes/037.md). P is recomputed from the
    forward's log-sum-exp; dS = P (dP - delta) (1 - t^2) scaling, the soft cap's derivative included
    (the factor scaling is applied to dK and dQ once, after the sums; rot q arrives scaled by
    scaling / cap, so dK's factor is cap).
    The largest |value| of each tile of v, dk, dv (dK/dV programs) and dq (dQ programs) goes to
    ranges, in that order of regions (kv_programs / HEAD_SPLIT slots each for the first three)."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    if pid < kv_programs:
        _key_block_grads(pid, rot16, qk32, v16, d_attn16, lse, delta, cos, sin, k_norm_w, g16, k_norm_parts, ranges,
                         kv_parts, arrivals, S, kv_programs, scaling, cap, eps, KV_BN, KV_BM, HEAD_SPLIT, APPROX_TANH)
    else:
        _query_block_grads(pid - kv_programs, tl.num_programs(0) - kv_programs, rot16, qk32, v16, d_attn16, lse,
                           delta, cos, sin, q_norm_w, g16, q_norm_parts, ranges, S, kv_programs // HEAD_SPLIT, scaling,
                           cap, eps, Q_BM, Q_BN, APPROX_TANH)


@triton.jit(do_not_specialize=["T", "split_gx", "split_wqkv", "split_wo", "n_q_parts", "n_k_parts"])
def _gradient_products_kernel(
    g16, wqkv16, x16, go16, attn16, q_norm_parts, k_norm_parts,
    grad_x, grad_wqkv, grad_wo, grad_q_norm_w, grad_k_norm_w,
    T, split_gx, split_wqkv, split_wo, n_q_parts, n_k_parts,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """grad_hidden = G [Wq; Wk; Wv] (A row-major); then, A read feature-contiguous, the weight
    gradients grad_[Wq; Wk; Wv] = G^T X (one output; its row blocks are the three) and grad_Wo =
    grad_output^T A. K splits per product (outputs pre-zeroed when split; 0 skips the product).
    The last 2 * 128 / SUM_COLS programs sum the norm-weight partials in a fixed order (many short
    sums: on the cuBLAS path they are the whole launch, and its latency)."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    t_gx = ((T + BM - 1) // BM) * (_HIDDEN // BN) * split_gx
    t_wqkv = (_QKV // BM) * (_HIDDEN // BN) * split_wqkv
    t_wo = (_Q_OUT // BM) * (_HIDDEN // BN) * split_wo
    local = pid - t_gx
    if pid < t_gx:
        gemm_tile(pid, g16, wqkv16, grad_x, T, _HIDDEN, _QKV, _QKV, 1, _HIDDEN, 1, _HIDDEN, split_gx, BM, BN, BK)
    elif local < t_wqkv + t_wo:
        on_qkv = local < t_wqkv
        rows = tl.where(on_qkv, _QKV, _Q_OUT)
        splits = tl.where(on_qkv, split_wqkv, split_wo)
        off_m, off_n, k_lo, k_hi = tile_coords(tl.where(on_qkv, local, local - t_wqkv), rows, _HIDDEN, T, splits,
                                               BM, BN, BK)
        acc = mma_tile(tl.where(on_qkv, g16, go16), tl.where(on_qkv, x16, attn16), off_m, off_n, rows, _HIDDEN,
                       k_lo, k_hi, 1, tl.multiple_of(rows, 1024), _HIDDEN, 1, BM, BN, BK)
        store_tile(tl.where(on_qkv, grad_wqkv, grad_wo), acc, off_m, off_n, rows, _HIDDEN, _HIDDEN, 1, splits > 1,
                   BM, BN)
    else:
        strip = local - t_wqkv - t_wo
        on_q = strip < _HEAD_DIM // SUM_COLS
        cols = (strip % (_HEAD_DIM // SUM_COLS)) * SUM_COLS + tl.arange(0, SUM_COLS)
        total = column_sums(tl.where(on_q, q_norm_parts, k_norm_parts), tl.where(on_q, n_q_parts, n_k_parts),
                            _HEAD_DIM, cols, SUM_ROWS, SUM_COLS)
        tl.store(tl.where(on_q, grad_q_norm_w, grad_k_norm_w) + cols, total)


PACK = FastKernel(_pack_kernel)
FORWARD_PRODUCTS = FastKernel(_forward_products_kernel)
ATTENTION_FORWARD = FastKernel(_attention_forward_kernel)
ATTENTION_BACKWARD = FastKernel(_attention_backward_kernel)
GRADIENT_PRODUCTS = FastKernel(_gradient_products_kernel)


class PackConfig(NamedTuple):
    """Wo^T tile side; flat passes: elements per step, steps per program."""

    tile: int = 64
    block: int = 8192
    iters: int = 1
    warps: int = 4


class AttentionConfig(NamedTuple):
    """Forward: fwd_bm queries per program, fwd_bn keys per step. Backward: kv_bn keys per dK/dV
    program, kv_bm queries per step; q_bm queries per dQ program, q_bn keys per step. approx_tanh:
    the soft cap's tanh as one GPU instruction (the interpreter needs False)."""

    fwd_bm: int = 64
    fwd_bn: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    kv_bn: int = 64
    kv_bm: int = 32
    q_bm: int = 64
    q_bn: int = 32
    warps: int = 4
    stages: int = 3
    approx_tanh: bool = True
    # Keys per forward step up to short_seq tokens: loops of at most four steps, half of them on the
    # diagonal, where narrower steps compute fewer masked logits.
    short_fwd_bn: int = 32
    short_seq: int = 256
    # Keys per dK/dV program when kv_bn-key programs would not fill the GPU once (batch 1-4 at short
    # sequences): twice the programs, each half as long on the launch's critical path.
    few_kv_bn: int = 32
    # dK/dV programs split by query head (summed by the last of the group) while the split grid
    # has at most head_split_per_sm programs per SM, from head_split_min_seq tokens: at batch 1 the
    # first key blocks' programs (three heads times every later query) are the launch's critical
    # path; shorter loops gain nothing (benchmarks/notes/037.md row 27). 0: never.
    head_split_per_sm: float = 3.0
    head_split_min_seq: int = 256


class Config(NamedTuple):
    pack: PackConfig = PackConfig()
    # bn: one head per tile (the norm is per head). Products run here below 512 tokens only (else
    # cuBLAS): 64-row tiles at 4 warps, so that 128 tokens still give 128 programs, not 64.
    forward: TileConfig = TileConfig(64, HEAD_DIM, 64, 4, 4)
    attention: AttentionConfig = AttentionConfig()
    gradients: TileConfig = TileConfig(128, 128, 32, 4, 6)
    pdl: bool = True  # launches after the first as programmatic dependent launches (GPU only)
    # The forward launch when cuBLAS made the projections and it only norms and rotates: a pass over
    # memory, so small tiles and few registers (71 at 32 rows, 4 warps) for many programs per SM.
    norm_rope: TileConfig = TileConfig(32, HEAD_DIM, 64, 4, 1)


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles.
INTERPRETER_CONFIG = Config(pack=PackConfig(1024, 1 << 20, 1, 4), forward=TileConfig(128, HEAD_DIM, 1024, 4, 1),
                            attention=AttentionConfig(32, 16, 4, 1, 32, 16, 32, 16, 4, 1, approx_tanh=False, short_fwd_bn=16),
                            gradients=TileConfig(1024, 1024, 256, 4, 1), pdl=False,
                            norm_rope=TileConfig(128, HEAD_DIM, 1024, 4, 1))
SUM_ROWS, SUM_COLS = 256, 16  # norm-weight gradients: partial rows per step, columns per program
# From this much product work (FLOP) on, the products go to cuBLAS (measured: benchmarks/notes/037.md).
CUBLAS_MIN_FLOP = 40e9


@contextlib.contextmanager
def fp32_sums_in_fp16_products():
    """cuBLAS products with fp16 output keep fp32 sums throughout (no fp16 split-K reductions)."""
    matmul = torch.backends.cuda.matmul
    saved, matmul.allow_fp16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction, False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction = saved


def gemma3_attention_backward(go, x, cos, sin, wq, wk, wv, wo, q_norm_w, k_norm_w, scaling, cap, eps, *,
                              needs=None, deterministic=False, ranges=None, config=None, products=None, sms=None):
    """The 037 outputs from the official inputs (validated by the caller).

    needs: one bool per output (None: all); grad_hidden's product, the three projection weights'
    products and grad_Wo's product are skipped when nobody needs them.
    deterministic: the same outputs bit for bit on every call (no K splits; nothing else uses
    atomics; cuBLAS products are reproducible on one GPU model as they are). ranges: a RangeSlots that
    receives the largest |value| of every tensor rounded to fp16. config: shapes of the
    five launches (None: CONFIG on a GPU, INTERPRETER_CONFIG on the CPU). products: the projection
    products as our tiles ("triton") or as torch.mm on our fp16 operands ("cublas": our forward
    products launch then only norms and rotates); None picks by size on a GPU. sms: processors to
    balance the products' K splits over (the GPU's count; on the CPU, 1).
    """
    batch, seq, _ = x.shape
    tokens = batch * seq
    device = x.device
    cfg = config or (CONFIG if device.type == "cuda" else INTERPRETER_CONFIG)
    pk, at, gr, pdl = cfg.pack, cfg.attention, cfg.gradients, cfg.pdl
    if HEAD_DIM != cfg.forward.bn or HEAD_DIM != cfg.norm_rope.bn:
        raise ValueError(f"037 forward launch: tile width must be one head ({HEAD_DIM}), got "
                         f"{cfg.forward.bn} and {cfg.norm_rope.bn}")
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    f16 = lambda *shape: buffers.empty(shape, torch.float16, device)  # noqa: E731
    f32 = lambda *shape: buffers.empty(shape, torch.float32, device)  # noqa: E731
    go16, x16, d_attn16, attn16 = (f16(tokens, HIDDEN) for _ in range(4))
    qk32, v16, rot16, g16 = f32(tokens, QK), f16(tokens, KV_OUT), f16(tokens, QK), f16(tokens, QKV)
    wqkv16, wo_t16 = f16(QKV, HIDDEN), f16(HIDDEN, Q_OUT)
    lse, delta = f32(batch * HEADS * seq), f32(batch * HEADS * seq)
    kv_bn = at.few_kv_bn if batch * KV_HEADS * triton.cdiv(seq, at.kv_bn) <= sms else at.kv_bn
    kv_slots = batch * KV_HEADS * triton.cdiv(seq, kv_bn)  # one per (batch, KV head, key block)
    head_split = GROUP if kv_slots * GROUP <= at.head_split_per_sm * sms and seq >= at.head_split_min_seq else 1
    kv_programs = kv_slots * head_split
    q_programs = batch * HEADS * triton.cdiv(seq, at.q_bm)
    q_norm_parts, k_norm_parts = f32(q_programs, HEAD_DIM), f32(kv_slots, HEAD_DIM)
    # the split programs' fp32 dK, dV partials and arrival counters (placeholders when unsplit)
    kv_parts = f32(head_split * tokens if head_split > 1 else 1, 2 * KV_OUT)
    arrivals = buffers.empty((kv_slots if head_split > 1 else 1,), torch.int32, device)
    grad_x = f32(batch, seq, HIDDEN)
    # grad_Wq, grad_Wk, grad_Wv are row blocks of one tensor, which one product writes.
    grad_wqkv, grad_wo = f32(QKV, HIDDEN), f32(HIDDEN, Q_OUT)
    grad_wq, grad_wk, grad_wv = grad_wqkv[:Q_OUT], grad_wqkv[Q_OUT:QK], grad_wqkv[QK:]
    grad_q_norm_w, grad_k_norm_w = f32(HEAD_DIM), f32(HEAD_DIM)

    # grad_hidden, grad_[Wq; Wk; Wv], grad_Wo as (M, N, K).
    gradient_products = [(tokens, HIDDEN, QKV), (QKV, HIDDEN, tokens), (Q_OUT, HIDDEN, tokens)]
    if products is None:
        flop = 2 * sum(m * n * k for m, n, k in gradient_products)
        products = "cublas" if device.type == "cuda" and flop >= CUBLAS_MIN_FLOP else "triton"
    on_cublas = products == "cublas"
    fw = cfg.norm_rope if on_cublas else cfg.forward
    needs = needs or (True,) * 7
    wanted = [needs[0], any(needs[1:4]), needs[4]]
    if on_cublas:  # our launch only sums the norm-weight partials
        splits = [0] * 3
    else:
        splits = [1] * 3 if deterministic else choose_splits(gradient_products, gr.bm, gr.bn, gr.bk, sms)
    split_gx, split_wqkv, split_wo = (s * w for s, w in zip(splits, wanted))  # 0: skipped
    gradient_tiles = sum(tile_count(m, n, s, gr.bm, gr.bn) for (m, n, _), s in
                         zip(gradient_products, (split_gx, split_wqkv, split_wo)))
    flat = lambda n: chunks(n, pk.block, pk.iters)  # noqa: E731
    n_act, n_wq, n_wkv = flat(tokens * HIDDEN), flat(Q_OUT * HIDDEN), flat(KV_OUT * HIDDEN)
    n_arrivals = kv_slots if head_split > 1 else 0
    n_pack = (2 * n_act + n_wq + 2 * n_wkv + (HIDDEN // pk.tile) * (Q_OUT // pk.tile)
              + (split_gx > 1) * n_act + (split_wqkv > 1) * flat(QKV * HIDDEN) + (split_wo > 1) * n_wq
              + flat(n_arrivals))
    forward_tiles = tile_count(tokens, QKV, 1, fw.bm, fw.bn) + (not on_cublas) * tile_count(tokens, Q_OUT, 1, fw.bm,
                                                                                           fw.bn)
    fwd_programs = batch * HEADS * triton.cdiv(seq, at.fwd_bm)
    ranges = ranges or RangeSlots()
    row_blocks = triton.cdiv(tokens, fw.bm)
    pack_ranges = ranges.reserve({"grad_output": n_act, "hidden_states": n_act, "q_weight": n_wq, "k_weight": n_wkv,
                                  "v_weight": n_wkv, "o_weight": (HIDDEN // pk.tile) * (Q_OUT // pk.tile)})
    forward_ranges = ranges.reserve({"normed, rotated q": HEADS * row_blocks, "normed, rotated k": KV_HEADS * row_blocks})
    attention_forward_ranges = ranges.reserve({"gradient of attention output": fwd_programs})
    gradients = ("gradient of k projection", "gradient of v projection", "gradient of q projection")
    attention_backward_ranges = ranges.reserve({"v projection": kv_slots, gradients[0]: kv_slots,
                                                gradients[1]: kv_slots, gradients[2]: q_programs},
                                               overflow_only=gradients)
    ranges.allocate(device)
    # cap tanh(z / cap) depends on |cap| only; the kernels take cap > 0.
    cap = abs(float(cap))
    # cuBLAS products: operand views made before the first launch, so they add no gaps. The forward
    # ones write q, k in fp32 and v, dA in fp16 (their fp32 sums rounded once, as our tiles do).
    cublas_forward = [(x16, wqkv16[:QK].T, qk32), (x16, wqkv16[QK:].T, v16), (go16, wo_t16.T, d_attn16)]
    cublas_gradients = [(g16, wqkv16, grad_x.view(tokens, HIDDEN), wanted[0]),
                       (g16.T, x16, grad_wqkv, wanted[1]), (go16.T, attn16, grad_wo, wanted[2])]

    with buffers.on_device(device):
        pack = PACK.prepare(
            (n_pack,),
            go, x, wq, wk, wv, wo,
            go16, x16, wqkv16, wo_t16, ranges.block(pack_ranges), grad_x, grad_wqkv, grad_wo, arrivals,
            tokens, int(split_gx > 1), int(split_wqkv > 1), int(split_wo > 1), n_arrivals,
            TILE=pk.tile, BLOCK=pk.block, ITERS=pk.iters, PDL=pdl, num_warps=pk.warps)
        launches = [
            FORWARD_PRODUCTS.prepare(
                (forward_tiles,),
                x16, go16, wqkv16, wo_t16, cos, sin, q_norm_w, k_norm_w,
                qk32, v16, rot16, d_attn16, ranges.block(forward_ranges),
                tokens, float(eps), float(scaling) / cap,
                BM=fw.bm, BK=fw.bk, PRODUCTS=not on_cublas, PDL=pdl, num_warps=fw.warps, num_stages=fw.stages,
                launch_pdl=pdl),
            ATTENTION_FORWARD.prepare(
                (fwd_programs,),
                rot16, v16, d_attn16, attn16, lse, delta, ranges.block(attention_forward_ranges),
                seq, cap,
                BM=at.fwd_bm, BN=at.short_fwd_bn if seq <= at.short_seq else at.fwd_bn, APPROX_TANH=at.approx_tanh,
                PDL=pdl, num_warps=at.fwd_warps,
                num_stages=at.fwd_stages, launch_pdl=pdl),
            ATTENTION_BACKWARD.prepare(
                (kv_programs + q_programs,),
                rot16, qk32, v16, d_attn16, lse, delta, cos, sin, q_norm_w, k_norm_w,
                g16, q_norm_parts, k_norm_parts, ranges.block(attention_backward_ranges), kv_parts, arrivals,
                seq, kv_programs, float(scaling), cap, float(eps),
                KV_BN=kv_bn, KV_BM=at.kv_bm, Q_BM=at.q_bm, Q_BN=at.q_bn, HEAD_SPLIT=head_split,
                APPROX_TANH=at.approx_tanh, PDL=pdl,
                num_warps=at.warps, num_stages=at.stages, launch_pdl=pdl),
            GRADIENT_PRODUCTS.prepare(
                (gradient_tiles + 2 * HEAD_DIM // SUM_COLS,),
                g16, wqkv16, x16, go16, attn16, q_norm_parts, k_norm_parts,
                grad_x, grad_wqkv, grad_wo, grad_q_norm_w, grad_k_norm_w,
                tokens, split_gx, split_wqkv, split_wo, q_programs, kv_slots,
                BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=SUM_ROWS, SUM_COLS=SUM_COLS, PDL=pdl, num_warps=gr.warps,
                num_stages=gr.stages, launch_pdl=pdl),
        ]
        pack()
        if on_cublas:
            with fp32_sums_in_fp16_products():
                for a, b, out in cublas_forward:
                    if out.dtype == torch.float32:
                        torch.mm(a, b, out_dtype=torch.float32, out=out)
                    else:
                        torch.mm(a, b, out=out)
        for launch in launches:
            launch()
        if on_cublas:
            for a, b, out, needed in cublas_gradients:
                if needed:
                    torch.mm(a, b, out_dtype=torch.float32, out=out)
    return grad_x, grad_wq, grad_wk, grad_wv, grad_wo, grad_q_norm_w, grad_k_norm_w
