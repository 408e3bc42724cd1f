"""021's attention: per (batch, head, run of blocks of video tokens) C, dQ and the run's share of dK
and dV, and the q/k/v bias gradients' partial sums (`attention_item`). Launch 3 of
`triton_kernels.py`'s four (`attention_kernel`); `backward.py` launches it as `config.plan` says. The
operator's sizes are constexpr parameters (HIDDEN, HEADS, HEAD_DIM: `config.size_constexprs`)."""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.triton.elementwise import max_abs
from ...kernels.triton.pdl import after_previous_launch

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _kv_tile(kv16, h, rn, NT, column0, HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K (column0 = 0) or V (column0 = HIDDEN) of head h for text tokens rn: [BN, 64] fp16 (kv16 at
    the batch's first row; its rows are [K | V], 2 HIDDEN wide)."""
    d = tl.arange(0, HEAD_DIM)
    ptrs = kv16 + rn[:, None] * (2 * HIDDEN) + column0 + h * HEAD_DIM + d[None, :]
    return tl.load(ptrs, mask=rn[:, None] < NT, other=0.0)


@triton.jit
def _finish_kv_grads(dkv32, dkv16, h, NT, TT, runs, BN: tl.constexpr, DETERMINISTIC: tl.constexpr, HIDDEN: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
    """dK, dV of head h (dkv32, dkv16 at the batch's first row): the runs' fp32 sums (read from L2,
    bypassing L1) to fp16, BN text rows a step (the plan's `finish_rows`: one step where the text is
    one tile, since each step is a round trip to L2 on the call's critical path); returns their
    column sums and largest |value|s. DETERMINISTIC: one partial per run, added in run order; else
    one atomic sum."""
    d = tl.arange(0, HEAD_DIM)
    sum_dk = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    sum_dv = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    dk_largest = 0.0
    dv_largest = 0.0
    for n0 in range(0, NT, BN):
        rn = n0 + tl.arange(0, BN)
        kv_off = rn[:, None] * (2 * HIDDEN) + h * HEAD_DIM + d[None, :]
        n_ok = rn[:, None] < NT
        dk = tl.load(dkv32 + kv_off, mask=n_ok, other=0.0, cache_modifier=".cg")
        dv = tl.load(dkv32 + kv_off + HIDDEN, mask=n_ok, other=0.0, cache_modifier=".cg")
        if DETERMINISTIC:
            for run in range(1, runs):
                part = dkv32 + run * (TT * (2 * HIDDEN)).to(tl.int64) + kv_off
                dk += tl.load(part, mask=n_ok, other=0.0, cache_modifier=".cg")
                dv += tl.load(part + HIDDEN, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(dkv16 + kv_off, dk.to(tl.float16), mask=n_ok)
        tl.store(dkv16 + kv_off + HIDDEN, dv.to(tl.float16), mask=n_ok)
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
def _emit_kv_grads(dkv16, dkv32, h, rn, NT, TT, run, dk, dv, ALONE: tl.constexpr, DETERMINISTIC: tl.constexpr,
                   HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """ALONE (every head has one run): the tile's dK, dV in fp16; else runs sharing a head add fp32
    partial sums (DETERMINISTIC: each run stores its own partial, summed in order by the last to
    arrive). dkv16, dkv32 point at the batch's first row.

    A constexpr, not a runtime branch on the run count: a branch made these stores and atomics 4x
    narrower (they then left straight from the products' register layout; 021.md row 29), and
    masks still issue the unused half."""
    d = tl.arange(0, HEAD_DIM)
    off = rn[:, None] * (2 * HIDDEN) + h * HEAD_DIM + d[None, :]
    n_ok = rn[:, None] < NT
    if ALONE:
        tl.store(dkv16 + off, dk.to(tl.float16), mask=n_ok)
        tl.store(dkv16 + off + HIDDEN, dv.to(tl.float16), mask=n_ok)
    elif DETERMINISTIC:
        part = dkv32 + run * (TT * (2 * HIDDEN)).to(tl.int64) + off
        tl.store(part, dk, mask=n_ok)
        tl.store(part + HIDDEN, dv, mask=n_ok)
    else:
        tl.atomic_add(dkv32 + off, dk, mask=n_ok, sem="relaxed")
        tl.atomic_add(dkv32 + off + HIDDEN, dv, mask=n_ok, sem="relaxed")


@triton.jit
def _video_rows(q16, dc16, h, rm, NV, HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Q and dC of head h for video tokens rm ([BM, 64] fp16; q16, dc16 at the batch's first row),
    their offsets and row mask."""
    d = tl.arange(0, HEAD_DIM)
    tok = rm[:, None] * HIDDEN + h * HEAD_DIM + d[None, :]
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


@triton.jit
def _one_tile_run(q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, h, NV, NT, TT, run, first, last, scale, qk_scale,
                  BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr, ALONE: tl.constexpr,
                  DETERMINISTIC: tl.constexpr, HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """All NT text tokens in one tile (a head of BN, and a tail of BN_TAIL when > 0), blocks `first`
    to `last` (exclusive) of BM video tokens of head h: K and V loaded once, P exact from the
    logits, C, δ = rowsum(dC∘C), dS = P(dP − δ)·scale, dQ = dS K per block; dK = dS^T Q and
    dV = P^T dC summed over the run in registers, then emitted (_emit_kv_grads). Returns the column
    sums of dQ, dK, dV and their largest |value|s."""
    rn = tl.arange(0, BN)
    k = _kv_tile(kv16, h, rn, NT, 0, HIDDEN, HEAD_DIM)
    v = _kv_tile(kv16, h, rn, NT, HIDDEN, HIDDEN, HEAD_DIM)
    dk = tl.zeros((BN, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BN, HEAD_DIM), dtype=tl.float32)
    if BN_TAIL:
        rt = BN + tl.arange(0, BN_TAIL)
        kt = _kv_tile(kv16, h, rt, NT, 0, HIDDEN, HEAD_DIM)
        vt = _kv_tile(kv16, h, rt, NT, HIDDEN, HIDDEN, HEAD_DIM)
        dkt = tl.zeros((BN_TAIL, HEAD_DIM), dtype=tl.float32)
        dvt = tl.zeros((BN_TAIL, HEAD_DIM), dtype=tl.float32)
    sum_dq = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    # Row maxima of |dQ| over the run (a whole-tile maximum per step would cost a shared-memory
    # reduction and registers inside the loop).
    dq_rows = tl.zeros((BM,), dtype=tl.float32)
    for block in range(first, last):
        q, dc, tok, m_ok = _video_rows(q16, dc16, h, block * BM + tl.arange(0, BM), NV, HIDDEN, HEAD_DIM)
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
    _emit_kv_grads(dkv16, dkv32, h, rn, NT, TT, run, dk, dv, ALONE, DETERMINISTIC, HIDDEN, HEAD_DIM)
    sum_dk = tl.sum(dk, 0)
    sum_dv = tl.sum(dv, 0)
    dq_largest = tl.max(dq_rows)
    dk_largest = max_abs(dk)
    dv_largest = max_abs(dv)
    if BN_TAIL:
        _emit_kv_grads(dkv16, dkv32, h, rt, NT, TT, run, dkt, dvt, ALONE, DETERMINISTIC, HIDDEN, HEAD_DIM)
        sum_dk += tl.sum(dkt, 0)
        sum_dv += tl.sum(dvt, 0)
        dk_largest = tl.maximum(dk_largest, max_abs(dkt))
        dv_largest = tl.maximum(dv_largest, max_abs(dvt))
    return sum_dq, sum_dk, sum_dv, dq_largest, dk_largest, dv_largest


@triton.jit
def _text_tiles_block(q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, h, NV, NT, TT, run, block, scale, qk_scale,
                      BM: tl.constexpr, BN: tl.constexpr, ALONE: tl.constexpr, DETERMINISTIC: tl.constexpr,
                      HIDDEN: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One block of BM video tokens of head h against text in tiles of BN tokens, in two passes:
    pass 1 the forward (online softmax, base 2) for C and the log-sum-exp, δ = rowsum(dC∘C); pass 2
    recomputes P tile by tile, dS = P(dP − δ)·scale, dQ += dS K, and emits each tile's dK = dS^T Q,
    dV = P^T dC (_emit_kv_grads). Returns the column sums of dQ, dK, dV and their largest |value|s."""
    q, dc, tok, m_ok = _video_rows(q16, dc16, h, block * BM + tl.arange(0, BM), NV, HIDDEN, HEAD_DIM)
    row_max = tl.full((BM,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BM,), dtype=tl.float32)
    ctx = tl.zeros((BM, HEAD_DIM), dtype=tl.float32)
    for n0 in range(0, NT, BN):
        rn = n0 + tl.arange(0, BN)
        k = _kv_tile(kv16, h, rn, NT, 0, HIDDEN, HEAD_DIM)
        v = _kv_tile(kv16, h, rn, NT, HIDDEN, HIDDEN, HEAD_DIM)
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

    dq = tl.zeros((BM, HEAD_DIM), dtype=tl.float32)
    sum_dk = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    sum_dv = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    dk_rows = tl.zeros((BN,), dtype=tl.float32)  # maxima of |dK|, |dV| rows over the text tiles
    dv_rows = tl.zeros((BN,), dtype=tl.float32)
    for n0 in range(0, NT, BN):
        rn = n0 + tl.arange(0, BN)
        k = _kv_tile(kv16, h, rn, NT, 0, HIDDEN, HEAD_DIM)
        v = _kv_tile(kv16, h, rn, NT, HIDDEN, HIDDEN, HEAD_DIM)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.where(rn[None, :] < NT, tl.exp2(s - lse[:, None]), 0.0)
        zero = tl.zeros((BN, HEAD_DIM), dtype=tl.float32)
        ds, dk, dv = _tile_grads(q, dc, v, p, scaled_delta, scale, zero, zero)
        dq = tl.dot(ds, k, dq)
        _emit_kv_grads(dkv16, dkv32, h, rn, NT, TT, run, dk, dv, ALONE, DETERMINISTIC, HIDDEN, HEAD_DIM)
        sum_dk += tl.sum(dk, 0)
        sum_dv += tl.sum(dv, 0)
        dk_rows = tl.maximum(dk_rows, tl.max(tl.abs(dk), 1))
        dv_rows = tl.maximum(dv_rows, tl.max(tl.abs(dv), 1))
    tl.store(dq16 + tok, dq.to(tl.float16), mask=m_ok)
    return tl.sum(dq, 0), sum_dk, sum_dv, max_abs(dq), tl.max(dk_rows), tl.max(dv_rows)


@triton.jit
def attention_item(q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, arrival, done, kv_done, ranges, b, h, run,
                   first, last,
                   slot_dq, slot_dk, slot_dv, NV, NT, TT, runs, scale,
                   BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr, ONE_TILE: tl.constexpr,
                   FINISH: tl.constexpr, ALONE: tl.constexpr, DETERMINISTIC: tl.constexpr, HIDDEN: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """One (batch b, head h, run of video blocks [first, last) of BM tokens): C, dQ and the run's
    share of dK and dV.

    With P known, δ = rowsum(P∘dP) = rowsum(dC∘C), dP = dC V^T, dS = P(dP − δ)·scale, dQ = dS K,
    dK = dS^T Q, dV = P^T dC. Two algorithms: ONE_TILE (all NT text tokens within BN + BN_TAIL;
    77 tokens as 64 + 16, not a padded 128, since every product and every softmax step scales with
    the padded width): _one_tile_run; else (runs of one block) _text_tiles_block. ALONE (one run per
    head: runs == 1) writes dK, dV in fp16; otherwise runs add fp32 partial sums and the last to
    arrive on the head's `arrival` counter converts them (_finish_kv_grads).
    Once C, dQ and this item's bias and range entries are stored, it adds 1 to `done`; once the
    head's dK, dV are in fp16 (with their sums and ranges), the item that wrote them adds 1 to
    `kv_done`: the gradient launch's tiles wait on those instead of this whole launch.
    Column sums of dQ, dK, dV (the bias gradients) go to the run's row b * runs + run of bias_parts
    ([batch * runs, 3 * 1024]), summed later in a fixed order. The largest |value| of the dQ, dK and
    dV this item rounds to fp16 goes to ranges[slot_dq], ranges[slot_dk], ranges[slot_dv] (0 for dK,
    dV left to the head's last run). C needs no check: its rows are convex combinations of V's,
    which the forward tiles check.
    """
    d = tl.arange(0, HEAD_DIM)
    qk_scale = scale * _LOG2E  # softmax in base 2
    # The batch's first rows: offsets within a batch fit 32 bits (one wide multiply-add per address).
    video_row0 = (b * NV).to(tl.int64) * HIDDEN
    q16 += video_row0
    dc16 += video_row0
    ctx16 += video_row0
    dq16 += video_row0
    text_row0 = (b * NT).to(tl.int64) * (2 * HIDDEN)
    kv16 += text_row0
    dkv16 += text_row0
    dkv32 += text_row0
    if ONE_TILE:
        sum_dq, sum_dk, sum_dv, dq_largest, dk_largest, dv_largest = _one_tile_run(
            q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, h, NV, NT, TT, run, first, last, scale, qk_scale,
            BM, BN, BN_TAIL, ALONE, DETERMINISTIC, HIDDEN, HEAD_DIM)
    else:
        sum_dq, sum_dk, sum_dv, dq_largest, dk_largest, dv_largest = _text_tiles_block(
            q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, h, NV, NT, TT, run, first, scale, qk_scale, BM, BN,
            ALONE, DETERMINISTIC, HIDDEN, HEAD_DIM)
    row = bias_parts + (b * runs + run) * (3 * HIDDEN) + h * HEAD_DIM + d
    tl.store(row, sum_dq)
    tl.store(ranges + slot_dq, dq_largest)
    tl.store(ranges + slot_dk, dk_largest if ALONE else 0.0)
    tl.store(ranges + slot_dv, dv_largest if ALONE else 0.0)
    if ALONE:
        tl.store(row + HIDDEN, sum_dk)
        tl.store(row + 2 * HIDDEN, sum_dv)
        tl.debug_barrier()  # every thread's stores before the counts (release)
        tl.atomic_add(done, 1, sem="release")
        tl.atomic_add(kv_done, 1, sem="release")
    else:
        # dK, dV column sums come from the run that converts the head's sums; the others leave 0.
        tl.store(row + HIDDEN, tl.zeros((HEAD_DIM,), dtype=tl.float32))
        tl.store(row + 2 * HIDDEN, tl.zeros((HEAD_DIM,), dtype=tl.float32))
        # Publish this run's sums; the last run of the head to arrive converts them all.
        tl.debug_barrier()
        tl.atomic_add(done, 1, sem="release")
        if tl.atomic_add(arrival, 1, sem="acq_rel") == runs - 1:
            sum_dk, sum_dv, dk_largest, dv_largest = _finish_kv_grads(dkv32, dkv16, h, NT, TT, runs, FINISH,
                                                                      DETERMINISTIC, HIDDEN, HEAD_DIM)
            tl.store(row + HIDDEN, sum_dk)
            tl.store(row + 2 * HIDDEN, sum_dv)
            tl.store(ranges + slot_dk, dk_largest)
            tl.store(ranges + slot_dv, dv_largest)
            tl.debug_barrier()
            tl.atomic_add(kv_done, 1, sem="release")


@triton.jit(do_not_specialize=["NV", "NT", "TT", "per_program", "r_dq", "r_dk", "r_dv", "c_done", "c_kv", "scale"])
def attention_kernel(
    q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, counters, ranges,
    NV, NT, TT, per_program, r_dq, r_dk, r_dv, c_done, c_kv, scale,
    HIDDEN: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr, ONE_TILE: tl.constexpr, FINISH: tl.constexpr,
    ALONE: tl.constexpr, DETERMINISTIC: tl.constexpr, PDL: tl.constexpr,
):
    """attention_item for program (batch, head, run of `per_program` blocks of BM video tokens),
    batch-major then head then run; the head's arrival counter is counters[batch * HEADS + head], the
    launch's `done` and `kv_done` counters[c_done] and counters[c_kv] (`config.AttentionCounters`),
    its range slots ranges[r + pid] past the first slots r_dq, r_dk, r_dv of the dQ, dK, dV regions."""
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    m_blocks = (NV + BM - 1) // BM
    runs = (m_blocks + per_program - 1) // per_program
    bh = pid // runs
    run = pid % runs
    first = run * per_program
    attention_item(q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, counters + bh, counters + c_done,
                   counters + c_kv, ranges, bh // HEADS,
                   bh % HEADS, run, first, tl.minimum(first + per_program, m_blocks), pid + r_dq, pid + r_dk,
                   pid + r_dv, NV, NT, TT, runs, scale, BM, BN, BN_TAIL, ONE_TILE, FINISH, ALONE, DETERMINISTIC, HIDDEN,
                   HEAD_DIM)
