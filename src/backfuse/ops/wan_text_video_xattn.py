"""021 — text-to-video cross-attention conditioning, backward (Wan 2.2 T2V A14B).

Forward: Q = video @ Wq^T + bq, K = text @ Wk^T + bk, V = text @ Wv^T + bv (16 heads of 64),
P = softmax(scale * Q K^T) over the text tokens (no mask), C = P V token-major, out = C Wo^T + bo.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..kernels import buffers
from ..kernels.elementwise import cast_chunk, chunks, column_sums, transpose_tile, zero_chunk
from ..kernels.fp16_range import RangeSlots, max_abs
from ..kernels.gemm import TileConfig, choose_splits, gemm_tile, longest_first, tile_count, tma_tile
from ..kernels.launch import FastKernel, after_previous_launch
from ..problem import Problem, Scalar, Tensor, fp32_matmul

HIDDEN = 1024
HEADS = 16
HEAD_DIM = 64

B, NV, NT = "batch_size", "num_video_tokens", "num_text_tokens"


class WanTextVideoCrossAttnBackward(Problem):
    id = "021"
    name = "021_cross_attention_text_video_conditioning_backward"
    workload_file = "021_wan_xattn_text_video_bwd.jsonl"
    inputs = (
        Tensor("grad_output", (B, NV, HIDDEN)),
        Tensor("video_latents", (B, NV, HIDDEN)),
        Tensor("text_embeddings", (B, NT, HIDDEN)),
        Tensor("query_weight", (HIDDEN, HIDDEN)),
        Tensor("query_bias", (HIDDEN,)),
        Tensor("key_weight", (HIDDEN, HIDDEN)),
        Tensor("key_bias", (HIDDEN,)),
        Tensor("value_weight", (HIDDEN, HIDDEN)),
        Tensor("value_bias", (HIDDEN,)),
        Tensor("output_weight", (HIDDEN, HIDDEN)),
        Tensor("output_bias", (HIDDEN,)),
        Scalar("scale", 1 / math.sqrt(HEAD_DIM)),
    )
    outputs = (
        Tensor("grad_video_latents", (B, NV, HIDDEN)),
        Tensor("grad_text_embeddings", (B, NT, HIDDEN)),
        Tensor("grad_query_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_query_bias", (HIDDEN,)),
        Tensor("grad_key_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_key_bias", (HIDDEN,)),
        Tensor("grad_value_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_value_bias", (HIDDEN,)),
        Tensor("grad_output_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_output_bias", (HIDDEN,)),
    )
    upstream_grads = ("grad_output",)
    differentiates = (
        "video_latents",
        "text_embeddings",
        "query_weight",
        "query_bias",
        "key_weight",
        "key_bias",
        "value_weight",
        "value_bias",
        "output_weight",
        "output_bias",
    )

    def draw(self, axes, gen, device):
        # Weights ~ N(0, 1/1024); biases, activations and grad_output ~ N(0, 1).
        return [
            torch.randn(spec.shape(axes), generator=gen, device=device)
            * (1 / math.sqrt(HIDDEN) if spec.name.endswith("_weight") else 1.0)
            for spec in self.inputs
            if isinstance(spec, Tensor)
        ]

    @staticmethod
    def _heads(t, batch):
        return t.view(batch, -1, HEADS, HEAD_DIM).transpose(1, 2)

    @staticmethod
    def _tokens(t):
        batch, _, n, _ = t.shape
        return t.transpose(1, 2).reshape(batch * n, HIDDEN)

    def _attention(self, video, text, wq, bq, wk, bk, wv, bv, scale):
        batch = video.shape[0]
        q = self._heads(video @ wq.T + bq, batch)
        k = self._heads(text @ wk.T + bk, batch)
        v = self._heads(text @ wv.T + bv, batch)
        p = torch.softmax(scale * (q @ k.transpose(-1, -2)), dim=-1)
        return q, k, v, p

    def reference_math(self, go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale):
        batch = video.shape[0]
        q, k, v, p = self._attention(video, text, wq, bq, wk, bk, wv, bv, scale)
        go2 = go.reshape(-1, HIDDEN)
        video2, text2 = video.reshape(-1, HIDDEN), text.reshape(-1, HIDDEN)
        grad_wo = go2.T @ self._tokens(p @ v)
        d_ctx = self._heads(go2 @ wo, batch)
        dp = d_ctx @ v.transpose(-1, -2)
        dv = self._tokens(p.transpose(-1, -2) @ d_ctx)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq = self._tokens(ds @ k)
        dk = self._tokens(ds.transpose(-1, -2) @ q)
        return (
            (dq @ wq).view(video.shape),
            (dk @ wk + dv @ wv).view(text.shape),
            dq.T @ video2,
            dq.sum(0),
            dk.T @ text2,
            dk.sum(0),
            dv.T @ text2,
            dv.sum(0),
            grad_wo,
            go2.sum(0),
        )

    def forward(self, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale):
        _, _, v, p = self._attention(video, text, wq, bq, wk, bk, wv, bv, scale)
        return (p @ v).transpose(1, 2).reshape(video.shape) @ wo.T + bo

    def macs(self, axes):
        video_tokens = axes[B] * axes[NV]
        text_tokens = axes[B] * axes[NT]
        # Video side: Q forward, dC, grad_Wo, grad_video, grad_Wq. Text side: K and V forward,
        # grad_text (two), grad_Wk, grad_Wv. Attention: QK^T, PV, dP, dV, dQ, dK.
        projections = (5 * video_tokens + 6 * text_tokens) * HIDDEN * HIDDEN
        return projections + 6 * axes[B] * axes[NV] * axes[NT] * HIDDEN

    def fused(self, go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale, needs=None, deterministic=False,
              ranges=None):
        if go.numel() >= 2**31 or 2 * text.numel() >= 2**31:  # the kernels count elements in int32
            with fp32_matmul(tf32=False):
                return self.reference_math(go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale)
        return text_video_xattn_backward(go, video, text, wq, bq, wk, bk, wv, bv, wo, scale, needs=needs,
                                         deterministic=deterministic, ranges=ranges)


PROBLEM = WanTextVideoCrossAttnBackward()

# ---- fused path: four launches -------------------------------------------------------------------
# 1. pack: fp16 copies of every product operand (Wo transposed), column sums of grad_output, zero fills;
# 2. forward products: Q, [K | V] (bias added) and dC = grad_output Wo, all fp16;
# 3. attention: per (batch, head, block of video tokens) C, dQ, dK/dV and the q/k/v bias gradients;
# 4. gradient products: grad_Wq, grad_Wo, grad_Wk, grad_Wv, grad_video, grad_text, and the q/k/v bias
#    gradients. From CUBLAS_MIN_FLOP on, cuBLAS does these products and launch 4 only sums the biases.

_HIDDEN = tl.constexpr(HIDDEN)
_HEADS = tl.constexpr(HEADS)
_HEAD_DIM = tl.constexpr(HEAD_DIM)
_KV = tl.constexpr(2 * HIDDEN)  # width of the stacked [K | V] rows
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _grad_output_tile(go, go16, colsum_parts, tile, TV, ROWS: tl.constexpr, COLS: tl.constexpr):
    """go16 = fp16(grad_output) on ROWS tokens; colsum_parts[tile] = their fp32 column sums (for grad_bo).
    Returns their largest |value|."""
    r = tile * ROWS + tl.arange(0, ROWS)
    ok = r[:, None] < TV
    largest = 0.0
    for c0 in tl.static_range(0, _HIDDEN, COLS):
        c = c0 + tl.arange(0, COLS)
        offs = r[:, None].to(tl.int64) * _HIDDEN + c[None, :]
        x = tl.load(go + offs, mask=ok, other=0.0)
        tl.store(go16 + offs, x.to(tl.float16), mask=ok)
        tl.store(colsum_parts + tile * _HIDDEN + c, tl.sum(x, 0))
        largest = tl.maximum(largest, max_abs(x))
    return largest


@triton.jit(do_not_specialize=["TV", "TT", "n_heads", "zero_dkv", "zero_wq", "zero_wo", "zero_wkv", "zero_gv",
                                "zero_gt"])
def _pack_kernel(
    go, video, text, wq, wk, wv, wo,
    go16, video16, text16, wq16, wkv16, wo_t16, colsum_parts, ranges,
    dkv32, arrivals, grad_wq, grad_wo, grad_wk, grad_wv, grad_video, grad_text,
    TV, TT, n_heads, zero_dkv, zero_wq, zero_wo, zero_wkv, zero_gv, zero_gt,
    ROWS: tl.constexpr, COLS: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ranges, in order: grad_output row tiles, flat casts of video, text, Wq, Wk, Wv (as
    [Wk; Wv]), Wo^T tiles, one program zeroing the attention's arrival counters, then zero fills of
    dK/dV and of the split-K products' outputs whose flag is set. Each converting program stores
    the largest |value| it converted in ranges[pid]."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    CHUNK: tl.constexpr = BLOCK * ITERS
    W: tl.constexpr = _HIDDEN * _HIDDEN
    W_CHUNKS: tl.constexpr = (W + CHUNK - 1) // CHUNK
    n_video = TV * _HIDDEN
    n_text = TT * _HIDDEN
    n_dkv = TT * _KV
    e_go = (TV + ROWS - 1) // ROWS
    e_video = e_go + (n_video + CHUNK - 1) // CHUNK
    e_text = e_video + (n_text + CHUNK - 1) // CHUNK
    e_wq = e_text + W_CHUNKS
    e_wk = e_wq + W_CHUNKS
    e_wv = e_wk + W_CHUNKS
    e_wo = e_wv + (_HIDDEN // T) * (_HIDDEN // T)
    e_small = e_wo + 1
    e_dkv = e_small + zero_dkv * ((n_dkv + CHUNK - 1) // CHUNK)
    e_zwq = e_dkv + zero_wq * W_CHUNKS
    e_zwo = e_zwq + zero_wo * W_CHUNKS
    e_zwk = e_zwo + zero_wkv * W_CHUNKS
    e_zwv = e_zwk + zero_wkv * W_CHUNKS
    e_zgv = e_zwv + zero_gv * ((n_video + CHUNK - 1) // CHUNK)
    largest = 0.0
    if pid < e_go:
        largest = _grad_output_tile(go, go16, colsum_parts, pid, TV, ROWS, COLS)
    elif pid < e_video:
        largest = cast_chunk(video, video16, n_video, pid - e_go, BLOCK, ITERS)
    elif pid < e_text:
        largest = cast_chunk(text, text16, n_text, pid - e_video, BLOCK, ITERS)
    elif pid < e_wq:
        largest = cast_chunk(wq, wq16, W, pid - e_text, BLOCK, ITERS)
    elif pid < e_wk:
        largest = cast_chunk(wk, wkv16, W, pid - e_wq, BLOCK, ITERS)
    elif pid < e_wv:
        largest = cast_chunk(wv, wkv16 + W, W, pid - e_wk, BLOCK, ITERS)
    elif pid < e_wo:
        largest = transpose_tile(wo, wo_t16, pid - e_wv, _HIDDEN, T)
    elif pid < e_small:
        c = tl.arange(0, _HIDDEN)
        for c0 in range(0, n_heads, _HIDDEN):
            tl.store(arrivals + c0 + c, tl.zeros((_HIDDEN,), dtype=tl.int32), mask=c0 + c < n_heads)
    elif pid < e_dkv:
        zero_chunk(dkv32, n_dkv, pid - e_small, BLOCK, ITERS)
    elif pid < e_zwq:
        zero_chunk(grad_wq, W, pid - e_dkv, BLOCK, ITERS)
    elif pid < e_zwo:
        zero_chunk(grad_wo, W, pid - e_zwq, BLOCK, ITERS)
    elif pid < e_zwk:
        zero_chunk(grad_wk, W, pid - e_zwo, BLOCK, ITERS)
    elif pid < e_zwv:
        zero_chunk(grad_wv, W, pid - e_zwk, BLOCK, ITERS)
    elif pid < e_zgv:
        zero_chunk(grad_video, n_video, pid - e_zwv, BLOCK, ITERS)
    else:
        zero_chunk(grad_text, n_text, pid - e_zgv, BLOCK, ITERS)
    if pid < e_wo:
        tl.store(ranges + pid, largest)


@triton.jit(do_not_specialize=["TV", "TT", "n_parts", "n_programs"])
def _forward_products_kernel(
    act16, w16, bq, bk, bv,
    q16, kv16, dc16, colsum_parts, grad_bo, ranges,
    TV, TT, n_parts, n_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Q = video Wq^T + bq, [K | V] = text [Wk; Wv]^T + [bk | bv], dC = grad_output Wo (fp16 out),
    then grad_bo from the pack's column sums. Each tile's largest |value| goes to ranges, column
    tiles outermost within each product, so that Q, K, V and dC each have one range of slots.

    act16 is [video; text; grad_output] and w16 is [Wq; Wk; Wv; Wo^T], each [rows, 1024] row-major,
    so every product reads row blocks of the same two TMA descriptors (a tile's rows past its
    product's read the next product's rows, which only reach rows it does not store). The first
    n_programs programs loop over all tiles (persistent); the rest sum columns for grad_bo.
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    t_q = ((TV + BM - 1) // BM) * (_HIDDEN // BN)
    t_kv = ((TT + BM - 1) // BM) * (2 * _HIDDEN // BN)
    if pid < n_programs:
        a_desc = tl.make_tensor_descriptor(act16, shape=[2 * TV + TT, _HIDDEN], strides=[_HIDDEN, 1],
                                           block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(w16, shape=[4 * _HIDDEN, _HIDDEN], strides=[_HIDDEN, 1],
                                           block_shape=[BN, BK])
        for tile in tl.range(pid, 2 * t_q + t_kv, n_programs, flatten=True):
            on_q = tile < t_q
            on_kv = (tile >= t_q) & (tile < t_q + t_kv)
            local = tl.where(on_q, tile, tl.where(on_kv, tile - t_q, tile - t_q - t_kv))
            width = tl.where(on_kv, 2 * _HIDDEN, _HIDDEN)
            rows = tl.where(on_kv, TT, TV)
            off_m = (local // (width // BN)) * BM
            off_n = (local % (width // BN)) * BN
            acc = tma_tile(a_desc, b_desc, tl.where(on_q, 0, tl.where(on_kv, TV, TV + TT)) + off_m,
                           tl.where(on_q, 0, tl.where(on_kv, _HIDDEN, 3 * _HIDDEN)) + off_n, 0, _HIDDEN, BM, BN, BK)
            rn = off_n + tl.arange(0, BN)
            bias = tl.where(on_q, bq + rn, tl.where(rn < _HIDDEN, bk + rn, bv + rn - _HIDDEN))
            acc += tl.load(bias, mask=on_q | on_kv, other=0.0)[None, :]
            rm = off_m + tl.arange(0, BM)
            out = tl.where(on_q, q16, tl.where(on_kv, kv16, dc16))
            tl.store(out + rm[:, None].to(tl.int64) * width + rn[None, :], acc.to(tl.float16),
                     mask=rm[:, None] < rows)
            row_blocks = (rows + BM - 1) // BM
            slot = tile - local + (off_n // BN) * row_blocks + off_m // BM
            tl.store(ranges + slot, max_abs(tl.where(rm[:, None] < rows, acc, 0.0)))
    else:
        cols = (pid - n_programs) * SUM_COLS + tl.arange(0, SUM_COLS)
        tl.store(grad_bo + cols, column_sums(colsum_parts, n_parts, _HIDDEN, cols, SUM_ROWS, SUM_COLS))


@triton.jit
def _kv_tile(kv16, h, rn, NT, column0):
    """K (column0 = 0) or V (column0 = _HIDDEN) of head h for text tokens rn: [BN, 64] fp16 (kv16 at
    the batch's first row)."""
    d = tl.arange(0, _HEAD_DIM)
    ptrs = kv16 + rn[:, None] * _KV + column0 + h * _HEAD_DIM + d[None, :]
    return tl.load(ptrs, mask=rn[:, None] < NT, other=0.0)


@triton.jit
def _finish_kv_grads(dkv32, dkv16, h, NT, TT, runs, BN: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """dK, dV of head h (dkv32, dkv16 at the batch's first row): the runs' fp32 sums (read from L2, bypassing L1) to fp16; returns
    their column sums and largest |value|s. DETERMINISTIC: one partial per run, added in run order;
    else one atomic sum."""
    d = tl.arange(0, _HEAD_DIM)
    sum_dk = tl.zeros((_HEAD_DIM,), dtype=tl.float32)
    sum_dv = tl.zeros((_HEAD_DIM,), dtype=tl.float32)
    dk_largest = 0.0
    dv_largest = 0.0
    for n0 in range(0, NT, BN):
        rn = n0 + tl.arange(0, BN)
        kv_off = rn[:, None] * _KV + h * _HEAD_DIM + d[None, :]
        n_ok = rn[:, None] < NT
        dk = tl.load(dkv32 + kv_off, mask=n_ok, other=0.0, cache_modifier=".cg")
        dv = tl.load(dkv32 + kv_off + _HIDDEN, mask=n_ok, other=0.0, cache_modifier=".cg")
        if DETERMINISTIC:
            for run in range(1, runs):
                part = dkv32 + run * (TT * _KV).to(tl.int64) + kv_off
                dk += tl.load(part, mask=n_ok, other=0.0, cache_modifier=".cg")
                dv += tl.load(part + _HIDDEN, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(dkv16 + kv_off, dk.to(tl.float16), mask=n_ok)
        tl.store(dkv16 + kv_off + _HIDDEN, dv.to(tl.float16), mask=n_ok)
        sum_dk += tl.sum(dk, 0)
        sum_dv += tl.sum(dv, 0)
        dk_largest = tl.maximum(dk_largest, max_abs(dk))
        dv_largest = tl.maximum(dv_largest, max_abs(dv))
    return sum_dk, sum_dv, dk_largest, dv_largest


@triton.jit
def _tile_grads(q, dc, v, p, scaled_delta, scale, dk, dv):
    """One text tile's backward from its P (fp32) and δ·scale: dS = P (dP − δ) scale (fp16, for
    dQ += dS K; a multiply-add and a multiply per element), and dK += dS^T Q, dV += P^T dC."""
    dp = tl.dot(dc, tl.trans(v))
    ds = (p * (dp * scale - scaled_delta[:, None])).to(tl.float16)
    return ds, tl.dot(tl.trans(ds), q, dk), tl.dot(tl.trans(p.to(tl.float16)), dc, dv)


@triton.jit
def _emit_kv_grads(dkv16, dkv32, h, rn, NT, TT, run, dk, dv, ALONE: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """ALONE (every head has one run): the tile's dK, dV in fp16; else runs sharing a head add fp32
    partial sums (DETERMINISTIC: each run stores its own partial, summed in order by the last to
    arrive). dkv16, dkv32 point at the batch's first row.

    A constexpr, not a runtime branch on the run count: a branch made these stores and atomics 4x
    narrower (they then left straight from the products' register layout; 021.md row 29), and
    masks still issue the unused half."""
    d = tl.arange(0, _HEAD_DIM)
    off = rn[:, None] * _KV + h * _HEAD_DIM + d[None, :]
    n_ok = rn[:, None] < NT
    if ALONE:
        tl.store(dkv16 + off, dk.to(tl.float16), mask=n_ok)
        tl.store(dkv16 + off + _HIDDEN, dv.to(tl.float16), mask=n_ok)
    elif DETERMINISTIC:
        part = dkv32 + run * (TT * _KV).to(tl.int64) + off
        tl.store(part, dk, mask=n_ok)
        tl.store(part + _HIDDEN, dv, mask=n_ok)
    else:
        tl.atomic_add(dkv32 + off, dk, mask=n_ok, sem="relaxed")
        tl.atomic_add(dkv32 + off + _HIDDEN, dv, mask=n_ok, sem="relaxed")


@triton.jit
def _video_rows(q16, dc16, h, rm, NV):
    """Q and dC of head h for video tokens rm ([BM, 64] fp16; q16, dc16 at the batch's first row),
    their offsets and row mask."""
    d = tl.arange(0, _HEAD_DIM)
    tok = rm[:, None] * _HIDDEN + h * _HEAD_DIM + d[None, :]
    m_ok = rm[:, None] < NV
    return tl.load(q16 + tok, mask=m_ok, other=0.0), tl.load(dc16 + tok, mask=m_ok, other=0.0), tok, m_ok


@triton.jit
def _logits(q, k, rn, NT, MASKED: tl.constexpr):
    """Q K^T for text tokens rn, unscaled; MASKED: -inf past the text (a head tile followed by a tail
    lies wholly within it)."""
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(rn[None, :] < NT, s, float("-inf"))
    return s


@triton.jit(do_not_specialize=["NV", "NT", "TT", "per_program", "scale"])
def _attention_kernel(
    q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, arrivals, ranges,
    NV, NT, TT, per_program, scale,
    BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr, ONE_TILE: tl.constexpr, ALONE: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (batch, head, run of `per_program` blocks of BM video tokens): C, dQ and the run's share
    of dK and dV.

    With P known, δ = rowsum(P∘dP) = rowsum(dC∘C), dP = dC V^T, dS = P(dP − δ)·scale, dQ = dS K,
    dK = dS^T Q, dV = P^T dC. ONE_TILE (all NT text tokens within BN + BN_TAIL): K and V are loaded
    once, P comes straight from the logits, and dK, dV add up over the run in registers; BN_TAIL > 0
    splits the text into a head of BN tokens and a tail of BN_TAIL (77 tokens: 64 + 16, not a
    padded 128, since every product and every softmax step scales with the padded width). Otherwise (runs
    of one block) pass 1 is the forward over text tiles (online softmax) for C and the
    log-sum-exp, and pass 2 recomputes P tile by tile. ALONE (one run per head: runs == 1) writes
    dK, dV in fp16; otherwise runs add fp32 partial sums and the last to arrive converts them.
    Column sums of dQ, dK, dV (the bias gradients) go to this program's row of bias_parts
    ([programs / 16, 3 * 1024]: batch-major, then run), summed later in a fixed order. The largest
    |value| of the dQ, dK and dV this program rounds to fp16 goes to ranges[pid + i * programs],
    i = 0..2 (0 for dK, dV left to the head's last run). C needs no check: its rows are convex
    combinations of V's, which the forward products check.
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    m_blocks = (NV + BM - 1) // BM
    runs = (m_blocks + per_program - 1) // per_program
    bh = pid // runs
    b = bh // _HEADS
    h = bh % _HEADS
    d = tl.arange(0, _HEAD_DIM)
    first = (pid % runs) * per_program
    qk_scale = scale * _LOG2E  # softmax in base 2
    # The batch's first rows: offsets within a batch fit 32 bits (one wide multiply-add per address).
    video_row0 = (b * NV).to(tl.int64) * _HIDDEN
    q16 += video_row0
    dc16 += video_row0
    ctx16 += video_row0
    dq16 += video_row0
    text_row0 = (b * NT).to(tl.int64) * _KV
    kv16 += text_row0
    dkv16 += text_row0
    dkv32 += text_row0
    sum_dq = tl.zeros((_HEAD_DIM,), dtype=tl.float32)

    if ONE_TILE:
        rn = tl.arange(0, BN)
        k = _kv_tile(kv16, h, rn, NT, 0)
        v = _kv_tile(kv16, h, rn, NT, _HIDDEN)
        dk = tl.zeros((BN, _HEAD_DIM), dtype=tl.float32)
        dv = tl.zeros((BN, _HEAD_DIM), dtype=tl.float32)
        if BN_TAIL:
            rt = BN + tl.arange(0, BN_TAIL)
            kt = _kv_tile(kv16, h, rt, NT, 0)
            vt = _kv_tile(kv16, h, rt, NT, _HIDDEN)
            dkt = tl.zeros((BN_TAIL, _HEAD_DIM), dtype=tl.float32)
            dvt = tl.zeros((BN_TAIL, _HEAD_DIM), dtype=tl.float32)
        # Row maxima of |dQ| over the run (a whole-tile maximum per step would cost a shared-memory
        # reduction and registers inside the loop).
        dq_rows = tl.zeros((BM,), dtype=tl.float32)
        for block in range(first, tl.minimum(first + per_program, m_blocks)):
            q, dc, tok, m_ok = _video_rows(q16, dc16, h, block * BM + tl.arange(0, BM), NV)
            # Row maxima of the unscaled logits (scale > 0), so that scaling and subtracting the
            # maximum are one multiply-add per logit.
            s = _logits(q, k, rn, NT, BN_TAIL == 0)
            row_max = tl.max(s, 1)
            if BN_TAIL:
                st = _logits(q, kt, rt, NT, True)
                row_max = tl.maximum(row_max, tl.max(st, 1))
            row_max *= qk_scale
            p = tl.exp2(s * qk_scale - row_max[:, None])
            row_sum = tl.sum(p, 1)
            if BN_TAIL:
                pt = tl.exp2(st * qk_scale - row_max[:, None])
                row_sum += tl.sum(pt, 1)
            inv_sum = 1.0 / row_sum  # one division per row, then multiplies
            p = p * inv_sum[:, None]
            ctx = tl.dot(p.to(tl.float16), v)
            if BN_TAIL:
                pt = pt * inv_sum[:, None]
                ctx = tl.dot(pt.to(tl.float16), vt, ctx)
            tl.store(ctx16 + tok, ctx.to(tl.float16), mask=m_ok)
            scaled_delta = tl.sum(dc.to(tl.float32) * ctx, 1) * scale
            ds, dk, dv = _tile_grads(q, dc, v, p, scaled_delta, scale, dk, dv)
            dq = tl.dot(ds, k)
            if BN_TAIL:
                dst, dkt, dvt = _tile_grads(q, dc, vt, pt, scaled_delta, scale, dkt, dvt)
                dq = tl.dot(dst, kt, dq)
            tl.store(dq16 + tok, dq.to(tl.float16), mask=m_ok)
            sum_dq += tl.sum(dq, 0)
            dq_rows = tl.maximum(dq_rows, tl.max(tl.abs(dq), 1))
        _emit_kv_grads(dkv16, dkv32, h, rn, NT, TT, pid % runs, dk, dv, ALONE, DETERMINISTIC)
        sum_dk = tl.sum(dk, 0)
        sum_dv = tl.sum(dv, 0)
        dq_largest = tl.max(dq_rows)
        dk_largest = max_abs(dk)
        dv_largest = max_abs(dv)
        if BN_TAIL:
            _emit_kv_grads(dkv16, dkv32, h, rt, NT, TT, pid % runs, dkt, dvt, ALONE, DETERMINISTIC)
            sum_dk += tl.sum(dkt, 0)
            sum_dv += tl.sum(dvt, 0)
            dk_largest = tl.maximum(dk_largest, max_abs(dkt))
            dv_largest = tl.maximum(dv_largest, max_abs(dvt))
    else:
        q, dc, tok, m_ok = _video_rows(q16, dc16, h, first * BM + tl.arange(0, BM), NV)
        row_max = tl.full((BM,), float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros((BM,), dtype=tl.float32)
        ctx = tl.zeros((BM, _HEAD_DIM), dtype=tl.float32)
        for n0 in range(0, NT, BN):
            rn = n0 + tl.arange(0, BN)
            k = _kv_tile(kv16, h, rn, NT, 0)
            v = _kv_tile(kv16, h, rn, NT, _HIDDEN)
            s = _logits(q, k, rn, NT, True)
            new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
            shrink = tl.exp2(row_max - new_max)
            p = tl.exp2(s * qk_scale - new_max[:, None])
            row_sum = row_sum * shrink + tl.sum(p, 1)
            ctx = tl.dot(p.to(tl.float16), v, ctx * shrink[:, None])
            row_max = new_max
        ctx = ctx * (1.0 / row_sum)[:, None]
        lse = row_max + tl.log2(row_sum)
        tl.store(ctx16 + tok, ctx.to(tl.float16), mask=m_ok)
        scaled_delta = tl.sum(dc.to(tl.float32) * ctx, 1) * scale

        dq = tl.zeros((BM, _HEAD_DIM), dtype=tl.float32)
        sum_dk = tl.zeros((_HEAD_DIM,), dtype=tl.float32)
        sum_dv = tl.zeros((_HEAD_DIM,), dtype=tl.float32)
        dk_rows = tl.zeros((BN,), dtype=tl.float32)  # maxima of |dK|, |dV| rows over the text tiles
        dv_rows = tl.zeros((BN,), dtype=tl.float32)
        for n0 in range(0, NT, BN):
            rn = n0 + tl.arange(0, BN)
            k = _kv_tile(kv16, h, rn, NT, 0)
            v = _kv_tile(kv16, h, rn, NT, _HIDDEN)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            p = tl.where(rn[None, :] < NT, tl.exp2(s - lse[:, None]), 0.0)
            zero = tl.zeros((BN, _HEAD_DIM), dtype=tl.float32)
            ds, dk, dv = _tile_grads(q, dc, v, p, scaled_delta, scale, zero, zero)
            dq = tl.dot(ds, k, dq)
            _emit_kv_grads(dkv16, dkv32, h, rn, NT, TT, pid % runs, dk, dv, ALONE, DETERMINISTIC)
            sum_dk += tl.sum(dk, 0)
            sum_dv += tl.sum(dv, 0)
            dk_rows = tl.maximum(dk_rows, tl.max(tl.abs(dk), 1))
            dv_rows = tl.maximum(dv_rows, tl.max(tl.abs(dv), 1))
        tl.store(dq16 + tok, dq.to(tl.float16), mask=m_ok)
        sum_dq = tl.sum(dq, 0)
        dq_largest = max_abs(dq)
        dk_largest = tl.max(dk_rows)
        dv_largest = tl.max(dv_rows)
    row = bias_parts + (b * runs + pid % runs) * (3 * _HIDDEN) + h * _HEAD_DIM + d
    tl.store(row, sum_dq)
    programs = tl.num_programs(0)
    tl.store(ranges + pid, dq_largest)
    tl.store(ranges + programs + pid, dk_largest if ALONE else 0.0)
    tl.store(ranges + 2 * programs + pid, dv_largest if ALONE else 0.0)
    if ALONE:
        tl.store(row + _HIDDEN, sum_dk)
        tl.store(row + 2 * _HIDDEN, sum_dv)
    else:
        # dK, dV column sums come from the run that converts the head's sums; the others leave 0.
        tl.store(row + _HIDDEN, tl.zeros((_HEAD_DIM,), dtype=tl.float32))
        tl.store(row + 2 * _HIDDEN, tl.zeros((_HEAD_DIM,), dtype=tl.float32))
        # Publish this run's sums; the last run of the head to arrive converts them all.
        tl.debug_barrier()
        if tl.atomic_add(arrivals + bh, 1, sem="acq_rel") == runs - 1:
            sum_dk, sum_dv, dk_largest, dv_largest = _finish_kv_grads(dkv32, dkv16, h, NT, TT, runs, BN,
                                                                      DETERMINISTIC)
            tl.store(row + _HIDDEN, sum_dk)
            tl.store(row + 2 * _HIDDEN, sum_dv)
            tl.store(ranges + programs + pid, dk_largest)
            tl.store(ranges + 2 * programs + pid, dv_largest)


@triton.jit(do_not_specialize=["TV", "TT", "split_wv", "split_wt", "split_gv", "split_gt", "start_gv", "start_gt",
                                "start_wv", "start_wt", "n_parts"])
def _gradient_products_kernel(
    dq16, dkv16, go16, video16, text16, ctx16, wq16, wkv16, bias_parts,
    grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv,
    TV, TT, split_wv, split_wt, split_gv, split_gt, start_gv, start_gt, start_wv, start_wt, n_parts,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Input gradients (A row-major): grad_video = dQ Wq, grad_text = [dK | dV] [Wk; Wv]; then weight
    gradients (A read feature-contiguous): grad_Wq = dQ^T video, grad_Wo = grad_output^T C,
    grad_Wk = dK^T text, grad_Wv = dV^T text. One call site per layout, so one shared-memory ring
    each. K splits (outputs pre-zeroed when split; 0 skips the products): split_gv, split_gt for
    grad_video, grad_text; split_wv for the weight gradients over video tokens, split_wt for those
    over text tokens. The four groups of tiles (grad_video; grad_text; grad_Wq and grad_Wo; grad_Wk
    and grad_Wv) start at program start_gv, start_gt, start_wv, start_wt (the host orders them
    longest tiles first, so that short tiles fill the last wave). Then 3 * 1024 / SUM_COLS programs
    sum the attention's bias_parts into grad_bq, grad_bk, grad_bv."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    t_gv = ((TV + BM - 1) // BM) * (_HIDDEN // BN) * split_gv
    t_gt = ((TT + BM - 1) // BM) * (_HIDDEN // BN) * split_gt
    t_w = (_HIDDEN // BM) * (_HIDDEN // BN)
    t_wv = t_w * split_wv  # per product of the pair
    t_wt = t_w * split_wt
    in_gv = (pid >= start_gv) & (pid < start_gv + t_gv)
    in_gt = (pid >= start_gt) & (pid < start_gt + t_gt)
    in_wv = (pid >= start_wv) & (pid < start_wv + 2 * t_wv)
    in_wt = (pid >= start_wt) & (pid < start_wt + 2 * t_wt)
    if in_gv | in_gt:
        depth = tl.multiple_of(tl.where(in_gv, _HIDDEN, 2 * _HIDDEN), 1024)
        gemm_tile(
            pid - tl.where(in_gv, start_gv, start_gt),
            tl.where(in_gv, dq16, dkv16),
            tl.where(in_gv, wq16, wkv16),
            tl.where(in_gv, grad_video, grad_text),
            tl.where(in_gv, TV, TT), _HIDDEN, depth,
            depth, 1, _HIDDEN, 1, _HIDDEN,
            tl.where(in_gv, split_gv, split_gt), BM, BN, BK,
        )
    elif in_wv | in_wt:
        local = pid - tl.where(in_wv, start_wv, start_wt)
        tiles = tl.where(in_wv, t_wv, t_wt)
        i = local // tiles  # of the pair
        gemm_tile(
            local - i * tiles,
            tl.where(in_wv, tl.where(i == 0, dq16, go16), dkv16 + i * _HIDDEN),
            tl.where(in_wv, tl.where(i == 0, video16, ctx16), text16),
            tl.where(in_wv, tl.where(i == 0, grad_wq, grad_wo), tl.where(i == 0, grad_wk, grad_wv)),
            _HIDDEN, _HIDDEN, tl.where(in_wv, TV, TT),
            1, tl.multiple_of(tl.where(in_wv, _HIDDEN, 2 * _HIDDEN), 1024), _HIDDEN, 1, _HIDDEN,
            tl.where(in_wv, split_wv, split_wt), BM, BN, BK,
        )
    else:
        strip = pid - (t_gv + t_gt + 2 * t_wv + 2 * t_wt)
        cols = strip * SUM_COLS + tl.arange(0, SUM_COLS)
        which = (strip * SUM_COLS) // _HIDDEN  # 0: q, 1: k, 2: v
        out = tl.where(which == 0, grad_bq, tl.where(which == 1, grad_bk, grad_bv)) + cols - which * _HIDDEN
        tl.store(out, column_sums(bias_parts, n_parts, 3 * _HIDDEN, cols, SUM_ROWS, SUM_COLS))


PACK = FastKernel(_pack_kernel)
FORWARD_PRODUCTS = FastKernel(_forward_products_kernel)
ATTENTION = FastKernel(_attention_kernel)
GRADIENT_PRODUCTS = FastKernel(_gradient_products_kernel)


class PackConfig(NamedTuple):
    """grad_output rows per tile and columns per step; Wo^T tile side; flat passes: elements per step, steps."""

    rows: int = 16
    cols: int = 1024
    tile: int = 64
    block: int = 8192
    iters: int = 1
    warps: int = 4


class AttentionConfig(NamedTuple):
    """Video tokens per block; all text tokens in one tile up to one_tile, else bn per step; with one
    tile, programs per SM to aim for when runs of blocks share K and V."""

    bm: int = 128
    bn: int = 128
    warps: int = 8
    stages: int = 2
    one_tile: int = 128
    programs_per_sm: float = 1.0
    split_text: bool = True  # one text tile as a head and a tail (text_tiles)
    # Rows and warps of the blocks when a head's video tokens fit one block of bm (and the text one
    # tile): a program then loops over two half blocks, the second's loads under the first's work.
    lone_block: tuple | None = (64, 4)


class Config(NamedTuple):
    pack: PackConfig = PackConfig()
    # Persistent programs over 128 x 256 tiles (benchmarks/notes/021.md row 24).
    forward: TileConfig = TileConfig(128, 256, 64, 8, 3)
    attention: AttentionConfig = AttentionConfig()
    # 4 warps: 2 programs per SM (8 warps need 144 registers a thread, which allows one)
    gradients: TileConfig = TileConfig(128, 128, 32, 4, 6)
    pdl: bool = True  # launches after the first as programmatic dependent launches (GPU only)
    # Forward tiles when those of `forward` would not fill the GPU once (up to ~2000 video tokens):
    # then each program has one tile, and a half-width tile takes half as long.
    forward_small: TileConfig = TileConfig(128, 128, 64, 8, 3)


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles;
# 64-token attention blocks so that small shapes still give several programs per head.
INTERPRETER_CONFIG = Config(pack=PackConfig(64, 1024, 256, 1 << 20, 1, 4), forward=TileConfig(128, 512, 256, 8, 1),
                            attention=AttentionConfig(64, 64, 4, 1, 128, 2), gradients=TileConfig(512, 512, 256, 8, 1),
                            pdl=False, forward_small=TileConfig(128, 256, 256, 8, 1))
SUM_ROWS, SUM_COLS = 32, 64  # bias gradients: partial sums per step, columns per reducing program
# From this much gradient-product work (FLOP) on, cuBLAS does those products: below it, the host
# time of five torch.mm calls is not hidden (benchmarks/notes/021.md row 28).
CUBLAS_MIN_FLOP = 60e9


def text_tiles(nt, split=True):
    """Widths (head, tail; tail 0: none) of the tiles that hold nt text tokens at once: powers of two
    of at least 16 (what the tensor-core products take), split in two when that pads less."""
    whole = max(16, triton.next_power_of_2(nt))
    if split and whole >= 32:
        tail = max(16, triton.next_power_of_2(nt - whole // 2))
        if whole // 2 + tail < whole:
            return whole // 2, tail
    return whole, 0


def text_video_xattn_backward(go, video, text, wq, bq, wk, bk, wv, bv, wo, scale, *, needs=None,
                              deterministic=False, ranges=None, config=None, sms=None, products=None):
    """The 021 outputs from the official inputs (validated by the caller; the output bias is unused).

    needs: one bool per output (None: all); without input gradients (grad_video, grad_text) or
    without weight gradients (the four grad_W) their products are skipped; the bias gradients are
    column sums taken along the way.

    deterministic: the same outputs bit for bit on every call (no K splits; the attention's partial
    dK/dV are stored per run and added in order instead of by atomics). ranges: a RangeSlots that
    receives the largest |value| of every tensor rounded to fp16. config: shapes of the four
    launches (None: CONFIG on a GPU, INTERPRETER_CONFIG on the CPU); sms: processors to balance the
    products' K splits and the attention's runs over (the GPU's count; on the CPU interpreter, 1).
    products: the gradient products by "triton" (our tiles, launch 4) or "cublas" (five torch.mm on
    our fp16 operands; launch 4 then only sums the bias gradients); None picks by size on a GPU.
    """
    batch, nv, _ = video.shape
    nt = text.shape[1]
    tv, tt = batch * nv, batch * nt
    device = video.device
    cfg = config or (CONFIG if device.type == "cuda" else INTERPRETER_CONFIG)
    pk, at, gr, pdl = cfg.pack, cfg.attention, cfg.gradients, cfg.pdl
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    f16 = lambda *shape: buffers.empty(shape, torch.float16, device)  # noqa: E731
    f32 = lambda *shape: buffers.empty(shape, torch.float32, device)  # noqa: E731
    # The forward products' operands, stacked so that one TMA descriptor each covers them.
    act16, w16 = f16(2 * tv + tt, HIDDEN), f16(4 * HIDDEN, HIDDEN)
    video16, text16, go16 = act16[:tv], act16[tv:tv + tt], act16[tv + tt:]
    wq16, wkv16, wo_t16 = w16[:HIDDEN], w16[HIDDEN:3 * HIDDEN], w16[3 * HIDDEN:]
    ctx16, q16, dc16, dq16 = (f16(tv, HIDDEN) for _ in range(4))
    kv16, dkv16 = f16(tt, 2 * HIDDEN), f16(tt, 2 * HIDDEN)
    go_tiles = triton.cdiv(tv, pk.rows)
    colsum_parts = f32(go_tiles, HIDDEN)
    one_tile = nt <= at.one_tile
    block_rows, block_warps = at.lone_block if one_tile and nv <= at.bm and at.lone_block else (at.bm, at.warps)
    m_blocks = triton.cdiv(nv, block_rows)
    text_tile, text_tail = text_tiles(nt, at.split_text) if one_tile else (at.bn, 0)
    per_program = 1
    if one_tile:  # long runs of blocks (fewer fp32 partial sums) while the grid still fills the GPU
        runs = min(m_blocks, max(1, int(at.programs_per_sm * sms) // (batch * HEADS)))
        per_program = triton.cdiv(m_blocks, runs)
    runs = triton.cdiv(m_blocks, per_program)
    dkv32 = f32((runs if deterministic else 1) * tt if runs > 1 else 1, 2 * HIDDEN)  # unused by lone runs
    arrivals = buffers.empty((batch * HEADS,), torch.int32, device)
    bias_parts = f32(batch * runs, 3 * HIDDEN)
    grad_video, grad_text = f32(batch, nv, HIDDEN), f32(batch, nt, HIDDEN)
    # grad_Wk and grad_Wv are the row blocks of one tensor, which one cuBLAS product writes.
    grad_wq, grad_wo, grad_wkv = f32(HIDDEN, HIDDEN), f32(HIDDEN, HIDDEN), f32(2 * HIDDEN, HIDDEN)
    grad_wk, grad_wv = grad_wkv[:HIDDEN], grad_wkv[HIDDEN:]
    grad_bq, grad_bk, grad_bv, grad_bo = (f32(HIDDEN) for _ in range(4))

    # grad_video, grad_text, grad_Wq, grad_Wo, grad_Wk, grad_Wv as (M, N, K).
    gradient_products = [(tv, HIDDEN, HIDDEN), (tt, HIDDEN, 2 * HIDDEN)] + [(HIDDEN, HIDDEN, tv)] * 2 \
        + [(HIDDEN, HIDDEN, tt)] * 2
    if products is None:
        flop = 2 * sum(m * n * k for m, n, k in gradient_products)
        products = "cublas" if device.type == "cuda" and flop >= CUBLAS_MIN_FLOP else "triton"
    on_cublas = products == "cublas"
    needs = needs or (True,) * 10
    wanted = [any(needs[:2])] * 2 + [any(needs[2::2])] * 4  # input products, weight products
    if on_cublas:  # launch 4 only sums the bias gradients
        splits = [0] * 6
    else:
        splits = [1] * 6 if deterministic else choose_splits(gradient_products, gr.bm, gr.bn, gr.bk, sms)
        splits = [s * w for s, w in zip(splits, wanted)]
    split_gv, split_gt, split_wv, _, split_wt, _ = splits  # 0: skipped
    tiles = [tile_count(m, n, s, gr.bm, gr.bn) for (m, n, _), s in zip(gradient_products, splits)]
    gradient_tiles = sum(tiles)
    # groups: grad_video, grad_text, grad_Wq + grad_Wo, grad_Wk + grad_Wv
    start_gv, start_gt, start_wv, start_wt = longest_first(
        [(tiles[0], gradient_products[0][2], split_gv), (tiles[1], gradient_products[1][2], split_gt),
         (tiles[2] + tiles[3], tv, split_wv), (tiles[4] + tiles[5], tt, split_wt)])
    flat = lambda n: chunks(n, pk.block, pk.iters)  # noqa: E731
    n_weight = flat(HIDDEN * HIDDEN)
    n_pack = (go_tiles + flat(tv * HIDDEN) + flat(tt * HIDDEN) + 3 * n_weight + (HIDDEN // pk.tile) ** 2 + 1
              + (runs > 1 and not deterministic) * flat(tt * 2 * HIDDEN) + 2 * ((split_wv > 1) + (split_wt > 1)) * n_weight
              + (split_gv > 1) * flat(tv * HIDDEN) + (split_gt > 1) * flat(tt * HIDDEN))
    forward_count = lambda t: 2 * tile_count(tv, HIDDEN, 1, t.bm, t.bn) + tile_count(tt, 2 * HIDDEN, 1, t.bm, t.bn)  # noqa: E731
    fw = cfg.forward if forward_count(cfg.forward) >= sms else cfg.forward_small
    forward_programs = min(forward_count(fw), sms)
    attention_programs = batch * HEADS * runs
    ranges = ranges or RangeSlots()
    pack_ranges = ranges.reserve({"grad_output": go_tiles, "video_latents": flat(tv * HIDDEN),
                                  "text_embeddings": flat(tt * HIDDEN), "query_weight": n_weight, "key_weight": n_weight,
                                  "value_weight": n_weight, "output_weight": (HIDDEN // pk.tile) ** 2})
    q_tiles, k_tiles = tile_count(tv, HIDDEN, 1, fw.bm, fw.bn), tile_count(tt, HIDDEN, 1, fw.bm, fw.bn)
    forward_ranges = ranges.reserve({"queries": q_tiles, "keys": k_tiles, "values": k_tiles,
                                     "gradient of attention context": q_tiles})
    gradients = ("gradient of queries", "gradient of keys", "gradient of values")
    attention_ranges = ranges.reserve(dict.fromkeys(gradients, attention_programs), overflow_only=gradients)
    ranges.allocate(device)

    with buffers.on_device(device):
        launches = [
            PACK.prepare(
                (n_pack,),
                go, video, text, wq, wk, wv, wo,
                go16, video16, text16, wq16, wkv16, wo_t16, colsum_parts, ranges.block(pack_ranges),
                dkv32, arrivals, grad_wq, grad_wo, grad_wk, grad_wv,
                grad_video, grad_text,
                tv, tt, batch * HEADS, int(runs > 1 and not deterministic), int(split_wv > 1), int(split_wv > 1), int(split_wt > 1),
                int(split_gv > 1), int(split_gt > 1),
                ROWS=pk.rows, COLS=pk.cols, T=pk.tile, BLOCK=pk.block, ITERS=pk.iters, PDL=pdl, num_warps=pk.warps),
            FORWARD_PRODUCTS.prepare(
                (forward_programs + HIDDEN // SUM_COLS,),
                act16, w16, bq, bk, bv,
                q16, kv16, dc16, colsum_parts, grad_bo, ranges.block(forward_ranges),
                tv, tt, go_tiles, forward_programs,
                BM=fw.bm, BN=fw.bn, BK=fw.bk, SUM_ROWS=SUM_ROWS, SUM_COLS=SUM_COLS, PDL=pdl, num_warps=fw.warps,
                num_stages=fw.stages, launch_pdl=pdl),
            ATTENTION.prepare(
                (attention_programs,),
                q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, arrivals, ranges.block(attention_ranges),
                nv, nt, tt, per_program, float(scale),
                BM=block_rows, BN=text_tile, BN_TAIL=text_tail, ONE_TILE=one_tile, ALONE=runs == 1,
                DETERMINISTIC=deterministic,
                PDL=pdl, num_warps=block_warps, num_stages=at.stages, launch_pdl=pdl),
            GRADIENT_PRODUCTS.prepare(
                (gradient_tiles + 3 * HIDDEN // SUM_COLS,),
                dq16, dkv16, go16, video16, text16, ctx16, wq16, wkv16, bias_parts,
                grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv,
                tv, tt, split_wv, split_wt, split_gv, split_gt, start_gv, start_gt, start_wv, start_wt, batch * runs,
                BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=SUM_ROWS, SUM_COLS=SUM_COLS, PDL=pdl, num_warps=gr.warps,
                num_stages=gr.stages, launch_pdl=pdl),
        ]
        for launch in launches:
            launch()
        if on_cublas:
            for a, b, out, needed in ((dq16, wq16, grad_video.view(tv, HIDDEN), wanted[0]),
                                      (dkv16, wkv16, grad_text.view(tt, HIDDEN), wanted[1]),
                                      (dq16.T, video16, grad_wq, wanted[2]), (go16.T, ctx16, grad_wo, wanted[2]),
                                      (dkv16.T, text16, grad_wkv, wanted[2])):
                if needed:
                    torch.mm(a, b, out_dtype=torch.float32, out=out)
    return grad_video, grad_text, grad_wq, grad_bq, grad_wk, grad_bk, grad_wv, grad_bv, grad_wo, grad_bo
