"""021's Triton kernels but the attention's (`triton_attention.py`): the pack, the forward products
and the gradient products. `backward.py` launches them as `config.plan` says:

1. pack: fp16 copies of every product operand (Wo transposed), column sums of grad_output, zero fills;
2. forward products: Q, [K | V] (bias added) and dC = grad_output Wo, all fp16;
3. attention (`triton_attention.py`): per (batch, head, run of video blocks) C, dQ, dK/dV and the
   q/k/v bias gradients' partial sums;
4. gradient products: grad_Wq, grad_Wo, grad_Wk, grad_Wv, grad_video, grad_text, and the q/k/v bias
   gradients. On the cuBLAS path cuBLAS does these products and launch 4 only sums the biases.
The operator's sizes are constexpr parameters, given by the plan (`config.size_constexprs`): the
model width HIDDEN (the stacked [K | V] rows are 2 HIDDEN wide), HEADS heads of HEAD_DIM features.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.triton.elementwise import cast_chunk, column_sums, max_abs, transpose_tile, zero_chunk
from ...kernels.triton.gemm import gemm_tile, tma_tile
from ...kernels.triton.pdl import after_previous_launch
from ...kernels.triton.queue import wait_at_least


@triton.jit
def _grad_output_tile(go, go16, colsum_parts, tile, TV, ROWS: tl.constexpr, COLS: tl.constexpr, HIDDEN: tl.constexpr):
    """go16 = fp16(grad_output) on ROWS tokens; colsum_parts[tile] = their fp32 column sums (for grad_bo).
    Returns their largest |value|."""
    r = tile * ROWS + tl.arange(0, ROWS)
    ok = r[:, None] < TV
    largest = 0.0
    for c0 in tl.static_range(0, HIDDEN, COLS):
        c = c0 + tl.arange(0, COLS)
        offs = r[:, None].to(tl.int64) * HIDDEN + c[None, :]
        x = tl.load(go + offs, mask=ok, other=0.0)
        tl.store(go16 + offs, x.to(tl.float16), mask=ok)
        tl.store(colsum_parts + tile * HIDDEN + c, tl.sum(x, 0))
        largest = tl.maximum(largest, max_abs(x))
    return largest


@triton.jit(do_not_specialize=["TV", "TT", "n_counters", "e_go", "e_video", "e_text", "e_wq", "e_wk", "e_wv", "e_wo",
                                "e_small", "e_dkv", "e_zwq", "e_zwo", "e_zwk", "e_zwv", "e_zgv"])
def pack_kernel(
    go, video, text, wq, wk, wv, wo,
    go16, video16, text16, wq16, wkv16, wo_t16, colsum_parts, ranges,
    dkv32, counters, grad_wq, grad_wo, grad_wk, grad_wv, grad_video, grad_text,
    TV, TT, n_counters, e_go, e_video, e_text, e_wq, e_wk, e_wv, e_wo, e_small, e_dkv, e_zwq, e_zwo, e_zwk, e_zwv, e_zgv,
    HIDDEN: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """go16 = fp16(grad_output) with per-tile column sums (_grad_output_tile); video16, text16, Wq16,
    [Wk; Wv]16 = fp16 casts; wo_t16 = fp16(Wo^T) in T x T tiles; the attention's n_counters
    counters zeroed (one program: `config.AttentionCounters`); zeros in the attention's fp32 dK/dV and in the split-K products'
    outputs where used. The program segments are `config.pack_layout`'s, in its order; e_* is the
    end of each but the last. Each converting program (before e_wo) stores the largest |value| it
    converted in ranges[pid]."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    W: tl.constexpr = HIDDEN * HIDDEN
    n_video = TV * HIDDEN
    n_text = TT * HIDDEN
    n_dkv = TT * (2 * HIDDEN)  # the stacked [K | V] rows
    largest = 0.0
    if pid < e_go:
        largest = _grad_output_tile(go, go16, colsum_parts, pid, TV, ROWS, COLS, HIDDEN)
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
        largest = transpose_tile(wo, wo_t16, pid - e_wv, HIDDEN, T)
    elif pid < e_small:
        c = tl.arange(0, HIDDEN)
        for c0 in range(0, n_counters, HIDDEN):
            tl.store(counters + c0 + c, tl.zeros((HIDDEN,), dtype=tl.int32), mask=c0 + c < n_counters)
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


@triton.jit(do_not_specialize=["TV", "TT", "n_parts", "n_programs", "end_q", "end_kv", "end_dc", "r_q", "r_k", "r_dc"])
def forward_products_kernel(
    act16, w16, bq, bk, bv,
    q16, kv16, dc16, colsum_parts, grad_bo, ranges,
    TV, TT, n_parts, n_programs, end_q, end_kv, end_dc, r_q, r_k, r_dc,
    HIDDEN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Q = video Wq^T + bq, [K | V] = text [Wk; Wv]^T + [bk | bv], dC = grad_output Wo (fp16 out),
    then grad_bo from the pack's column sums. The tiles of Q, [K | V] and dC are [0, end_q),
    [end_q, end_kv) and [end_kv, end_dc) (the plan's forward_bounds). Each tile's largest |value|
    goes to ranges, column tiles outermost within each product, from the slots r_q (Q), r_k (K,
    then V's, which follow K's: its column tiles go on past K's), r_dc (dC): the plan's region bases.

    act16 is [video; text; grad_output] and w16 is [Wq; Wk; Wv; Wo^T], each [rows, 1024] row-major,
    so every product reads row blocks of the same two TMA descriptors (a tile's rows past its
    product's read the next product's rows, which only reach rows it does not store). The first
    n_programs programs loop over all tiles (persistent); the rest sum columns for grad_bo.
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    if pid < n_programs:
        a_desc = tl.make_tensor_descriptor(act16, shape=[2 * TV + TT, HIDDEN], strides=[HIDDEN, 1],
                                           block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(w16, shape=[4 * HIDDEN, HIDDEN], strides=[HIDDEN, 1],
                                           block_shape=[BN, BK])
        for tile in tl.range(pid, end_dc, n_programs, flatten=True):
            on_q = tile < end_q
            on_kv = (tile >= end_q) & (tile < end_kv)
            local = tile - tl.where(on_q, 0, tl.where(on_kv, end_q, end_kv))
            width = tl.where(on_kv, 2 * HIDDEN, HIDDEN)
            rows = tl.where(on_kv, TT, TV)
            off_m = (local // (width // BN)) * BM
            off_n = (local % (width // BN)) * BN
            acc = tma_tile(a_desc, b_desc, tl.where(on_q, 0, tl.where(on_kv, TV, TV + TT)) + off_m,
                           tl.where(on_q, 0, tl.where(on_kv, HIDDEN, 3 * HIDDEN)) + off_n, 0, HIDDEN, BM, BN, BK)
            rn = off_n + tl.arange(0, BN)
            bias = tl.where(on_q, bq + rn, tl.where(rn < HIDDEN, bk + rn, bv + rn - HIDDEN))
            acc += tl.load(bias, mask=on_q | on_kv, other=0.0)[None, :]
            rm = off_m + tl.arange(0, BM)
            out = tl.where(on_q, q16, tl.where(on_kv, kv16, dc16))
            tl.store(out + rm[:, None].to(tl.int64) * width + rn[None, :], acc.to(tl.float16),
                     mask=rm[:, None] < rows)
            row_blocks = (rows + BM - 1) // BM
            slot = tl.where(on_q, r_q, tl.where(on_kv, r_k, r_dc)) + (off_n // BN) * row_blocks + off_m // BM
            tl.store(ranges + slot, max_abs(tl.where(rm[:, None] < rows, acc, 0.0)))
    else:
        cols = (pid - n_programs) * SUM_COLS + tl.arange(0, SUM_COLS)
        tl.store(grad_bo + cols, column_sums(colsum_parts, n_parts, HIDDEN, cols, SUM_ROWS, SUM_COLS))


@triton.jit(do_not_specialize=["TV", "TT", "split_wv", "split_wt", "split_gv", "split_gt", "start_gv", "end_gv",
                                "start_gt", "end_gt", "start_wv", "end_wv", "start_wt", "end_wt", "sums_start", "n_parts",
                                "c_done", "n_done", "c_kv", "n_kv"])
def gradient_products_kernel(
    dq16, dkv16, go16, video16, text16, ctx16, wq16, wkv16, bias_parts, counters,
    grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv,
    TV, TT, split_wv, split_wt, split_gv, split_gt, start_gv, end_gv, start_gt, end_gt, start_wv, end_wv,
    start_wt, end_wt, sums_start, n_parts, c_done, n_done, c_kv, n_kv,
    HIDDEN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Input gradients (A row-major): grad_video = dQ Wq, grad_text = [dK | dV] [Wk; Wv]; then weight
    gradients (A read feature-contiguous): grad_Wq = dQ^T video, grad_Wo = grad_output^T C,
    grad_Wk = dK^T text, grad_Wv = dV^T text. One call site per layout, so one shared-memory ring
    each. K splits (outputs pre-zeroed when split; 0 skips the products): split_gv, split_gt for
    grad_video, grad_text; split_wv for the weight gradients over video tokens, split_wt for those
    over text tokens. The four groups of tiles (grad_video; grad_text; grad_Wq and grad_Wo, the
    pair's halves alike; grad_Wk and grad_Wv) are the programs [start_*, end_*) (the plan's bounds,
    longest tiles first, so that short tiles fill the last wave). From program sums_start on,
    3 * 1024 / SUM_COLS programs sum the attention's bias_parts into grad_bq, grad_bk, grad_bv.

    PDL: launched while the attention runs, this launch does not wait for it to end. Each tile waits
    for what it reads: those of dQ and C for counters[c_done] to reach n_done (every attention
    program's C and dQ stored), those of dK, dV for counters[c_kv] to reach n_kv (every head's dK, dV
    in fp16), the bias sums for both (`config.AttentionCounters`). So the tiles of dQ and C run
    beside the attention's last runs converting dK, dV. The launch can still not wait on anything
    that waits on it: its programs are scheduled only once every attention program has started
    (PDL's rule), after that one's own wait for the forward products."""
    pid = tl.program_id(0)
    in_gv = (pid >= start_gv) & (pid < end_gv)
    in_gt = (pid >= start_gt) & (pid < end_gt)
    in_wv = (pid >= start_wv) & (pid < end_wv)
    in_wt = (pid >= start_wt) & (pid < end_wt)
    if PDL:
        sums = pid >= sums_start
        if in_gv | in_wv | sums:
            wait_at_least(counters + c_done, n_done)
        if in_gt | in_wt | sums:
            wait_at_least(counters + c_kv, n_kv)
    if in_gv | in_gt:
        depth = tl.multiple_of(tl.where(in_gv, HIDDEN, 2 * HIDDEN), 1024)
        gemm_tile(
            pid - tl.where(in_gv, start_gv, start_gt),
            tl.where(in_gv, dq16, dkv16),
            tl.where(in_gv, wq16, wkv16),
            tl.where(in_gv, grad_video, grad_text),
            tl.where(in_gv, TV, TT), HIDDEN, depth,
            depth, 1, HIDDEN, 1, HIDDEN,
            tl.where(in_gv, split_gv, split_gt), BM, BN, BK,
        )
    elif in_wv | in_wt:
        local = pid - tl.where(in_wv, start_wv, start_wt)
        tiles = tl.where(in_wv, end_wv - start_wv, end_wt - start_wt) // 2  # per product of the pair
        i = local // tiles  # of the pair
        gemm_tile(
            local - i * tiles,
            tl.where(in_wv, tl.where(i == 0, dq16, go16), dkv16 + i * HIDDEN),
            tl.where(in_wv, tl.where(i == 0, video16, ctx16), text16),
            tl.where(in_wv, tl.where(i == 0, grad_wq, grad_wo), tl.where(i == 0, grad_wk, grad_wv)),
            HIDDEN, HIDDEN, tl.where(in_wv, TV, TT),
            1, tl.multiple_of(tl.where(in_wv, HIDDEN, 2 * HIDDEN), 1024), HIDDEN, 1, HIDDEN,
            tl.where(in_wv, split_wv, split_wt), BM, BN, BK,
        )
    else:
        strip = pid - sums_start
        cols = strip * SUM_COLS + tl.arange(0, SUM_COLS)
        which = (strip * SUM_COLS) // HIDDEN  # 0: q, 1: k, 2: v
        out = tl.where(which == 0, grad_bq, tl.where(which == 1, grad_bk, grad_bv)) + cols - which * HIDDEN
        tl.store(out, column_sums(bias_parts, n_parts, 3 * HIDDEN, cols, SUM_ROWS, SUM_COLS))
