"""072's Triton kernels: the pack (every fp16 operand of the products, the zero fills) and the
four products' tiles. Launched by `backward.py` as `config.plan` says; the operator's sizes are
constexpr parameters (HIDDEN, CROSS: the decoder's and encoder's widths; HEADS query heads, GROUP per
KV head, HEAD_DIM; Q_OUT, KV_OUT: the q and the k / v projections' widths), by `config.size_constexprs`."""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.triton.elementwise import cast_chunk, max_abs, zero_chunk
from ...kernels.triton.gemm import gemm_tile
from ...kernels.triton.pdl import after_previous_launch


@triton.jit
def _gq_tile(gq, gq16, tile, SD, ROWS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, Q_OUT: tl.constexpr):
    """GQ[b*Sd + s, h*256 + d] = fp16(grad_query_states[b, h, s, d]) for ROWS tokens of one head;
    returns their largest |value|."""
    s_blocks = (SD + ROWS - 1) // ROWS
    b = tile // (HEADS * s_blocks)
    h = (tile // s_blocks) % HEADS
    s = (tile % s_blocks) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    rows_ok = s[:, None] < SD
    src = gq + ((b * HEADS + h).to(tl.int64) * SD + s[:, None]) * HEAD_DIM + d[None, :]
    dst = gq16 + (b.to(tl.int64) * SD + s[:, None]) * Q_OUT + h * HEAD_DIM + d[None, :]
    x = tl.load(src, mask=rows_ok, other=0.0)
    tl.store(dst, x.to(tl.float16), mask=rows_ok)
    return max_abs(x)


@triton.jit
def _group_sum_tile(g, gkv16, tile, SE, column0, ROWS: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, KV_OUT: tl.constexpr):
    """GK[b*Se + s, j*256 + d] = fp16(sum over g < 4 of grad[b, 4j + g, s, d]), at column0 of [GK | GV];
    returns the sums' largest |value|."""
    s_blocks = (SE + ROWS - 1) // ROWS
    b = tile // (KV_OUT // HEAD_DIM * s_blocks)
    j = (tile // s_blocks) % (KV_OUT // HEAD_DIM)
    s = (tile % s_blocks) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    rows_ok = s[:, None] < SE
    acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
    for q_head in tl.static_range(GROUP):
        head = b * HEADS + j * GROUP + q_head
        acc += tl.load(g + (head.to(tl.int64) * SE + s[:, None]) * HEAD_DIM + d[None, :], mask=rows_ok)
    dst = gkv16 + (b.to(tl.int64) * SE + s[:, None]) * (2 * KV_OUT) + column0 + j * HEAD_DIM + d[None, :]
    tl.store(dst, acc.to(tl.float16), mask=rows_ok)
    return max_abs(acc)


@triton.jit(do_not_specialize=["B", "SD", "SE", "e_gq", "e_gk", "e_gv", "e_dec", "e_enc", "e_wq", "e_wk", "e_wv",
                                "e_zdec", "e_zenc", "e_zwq"])
def pack_kernel(
    gq, gk, gv, dec, enc, wq, wk, wv,
    gq16, gkv16, dec16, enc16, wq16, wkv16, ranges,
    grad_dec, grad_enc, grad_wq, grad_wkv,
    B, SD, SE,
    e_gq, e_gk, e_gv, e_dec, e_enc, e_wq, e_wk, e_wv, e_zdec, e_zenc, e_zwq,
    HIDDEN: tl.constexpr, CROSS: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    Q_OUT: tl.constexpr, KV_OUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every fp16 operand of the four products, and the zeroed outputs that split-K accumulates into.

    GQ = fp16(grad_query_states) token-major [B*Sd, 4096]; [GK | GV] = fp16 of the 4-head group sums
    of grad_key/value_states, token-major [B*Se, 2048]; dec16, enc16, Wq16 = fp16 casts; [Wk; Wv]16
    stacked; grad_dec, grad_enc, grad_Wq, grad_[Wk; Wv] = 0 where their product is split. The program
    segments are `config.pack_layout`'s, in its order; e_* is the end of each but the last. Each
    converting program (before e_wv) stores the largest |value| it converted in ranges[pid].
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    n_dec = B * SD * HIDDEN
    n_enc = B * SE * CROSS
    n_wq = Q_OUT * HIDDEN
    n_wk = KV_OUT * CROSS
    largest = 0.0
    if pid < e_gq:
        largest = _gq_tile(gq, gq16, pid, SD, ROWS, HEADS, HEAD_DIM, Q_OUT)
    elif pid < e_gk:
        largest = _group_sum_tile(gk, gkv16, pid - e_gq, SE, 0, ROWS, HEADS, GROUP, HEAD_DIM, KV_OUT)
    elif pid < e_gv:
        largest = _group_sum_tile(gv, gkv16, pid - e_gk, SE, KV_OUT, ROWS, HEADS, GROUP, HEAD_DIM, KV_OUT)
    elif pid < e_dec:
        largest = cast_chunk(dec, dec16, n_dec, pid - e_gv, BLOCK, ITERS)
    elif pid < e_enc:
        largest = cast_chunk(enc, enc16, n_enc, pid - e_dec, BLOCK, ITERS)
    elif pid < e_wq:
        largest = cast_chunk(wq, wq16, n_wq, pid - e_enc, BLOCK, ITERS)
    elif pid < e_wk:
        largest = cast_chunk(wk, wkv16, n_wk, pid - e_wq, BLOCK, ITERS)
    elif pid < e_wv:
        largest = cast_chunk(wv, wkv16 + n_wk, n_wk, pid - e_wk, BLOCK, ITERS)
    elif pid < e_zdec:
        zero_chunk(grad_dec, n_dec, pid - e_wv, BLOCK, ITERS)
    elif pid < e_zenc:
        zero_chunk(grad_enc, n_enc, pid - e_zdec, BLOCK, ITERS)
    elif pid < e_zwq:
        zero_chunk(grad_wq, n_wq, pid - e_zenc, BLOCK, ITERS)
    else:
        zero_chunk(grad_wkv, 2 * n_wk, pid - e_zwq, BLOCK, ITERS)
    if pid < e_wv:
        tl.store(ranges + pid, largest)


@triton.jit(do_not_specialize=["TD", "TE", "split_wq", "split_wkv", "split_dec", "split_enc", "start_wq", "end_wq",
                                "start_wkv", "end_wkv", "start_dec", "end_dec", "start_enc", "end_enc"])
def projection_grads_kernel(
    gq16, gkv16, dec16, enc16, wq16, wkv16,
    grad_dec, grad_enc, grad_wq, grad_wkv,
    TD, TE,
    split_wq, split_wkv, split_dec, split_enc,
    start_wq, end_wq, start_wkv, end_wkv, start_dec, end_dec, start_enc, end_enc,
    HIDDEN: tl.constexpr, CROSS: tl.constexpr, Q_OUT: tl.constexpr, KV_OUT: tl.constexpr,
    WEIGHT_GRADS: tl.constexpr,
    INPUT_GRADS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Tiles of the four products: grad_Wq, grad_[Wk; Wv] (WEIGHT_GRADS), grad_dec, grad_enc (INPUT_GRADS).

    With GQ [TD, 4096] and [GK | GV] [TE, 2048] in fp16: grad_Wq = GQ^T dec, grad_[Wk; Wv] =
    [GK | GV]^T enc, grad_dec = GQ Wq, grad_enc = [GK | GV] [Wk; Wv]. The weight gradients read
    their A operand transposed (feature-contiguous), the input gradients row-major; Triton gives
    each layout its own shared-memory ring, so one launch of both needs a smaller ring. Each
    product's tiles are the programs [start_*, end_*) (the plan's bounds, deepest first:
    schedule.longest_first); split_* > 1 adds K slices by atomics into pre-zeroed outputs.
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    if WEIGHT_GRADS:
        # One call site for both (so they share one shared-memory ring); operands by select.
        on_q = (pid >= start_wq) & (pid < end_wq)
        if on_q | ((pid >= start_wkv) & (pid < end_wkv)):
            width = tl.multiple_of(tl.where(on_q, HIDDEN, CROSS), 256)
            gemm_tile(
                pid - tl.where(on_q, start_wq, start_wkv),
                tl.where(on_q, gq16, gkv16),
                tl.where(on_q, dec16, enc16),
                tl.where(on_q, grad_wq, grad_wkv),
                tl.multiple_of(tl.where(on_q, Q_OUT, 2 * KV_OUT), 256), width, tl.where(on_q, TD, TE),
                1, tl.multiple_of(tl.where(on_q, Q_OUT, 2 * KV_OUT), 256), width, 1, width,
                tl.where(on_q, split_wq, split_wkv), BM, BN, BK,
            )
    if INPUT_GRADS:
        on_dec = (pid >= start_dec) & (pid < end_dec)
        if on_dec | ((pid >= start_enc) & (pid < end_enc)):
            width = tl.multiple_of(tl.where(on_dec, HIDDEN, CROSS), 256)
            depth = tl.multiple_of(tl.where(on_dec, Q_OUT, 2 * KV_OUT), 256)
            gemm_tile(
                pid - tl.where(on_dec, start_dec, start_enc),
                tl.where(on_dec, gq16, gkv16),
                tl.where(on_dec, wq16, wkv16),
                tl.where(on_dec, grad_dec, grad_enc),
                tl.where(on_dec, TD, TE), width, depth,
                depth, 1, width, 1, width,
                tl.where(on_dec, split_dec, split_enc), BM, BN, BK,
            )
