"""021's attention on Hopper (Gluon, sm_90): launch 3 of four, in place of `triton_attention.py`'s
where the text fits one 64-token head tile and a tail of at most 32 (`config.gluon_text_tiles`) and
the call is not deterministic. Same contract as the `tl` kernel (the plan's grid, range slots, bias
partial rows, arrival counters and dK/dV hand-off); its products are wgmma from shared memory.

Per program (batch b, head h, run of `per_program` blocks of 64 video tokens), one warpgroup:
- K and V of the head by TMA once: a head tile of 64 text tokens and, past 64, a tail of 16 or 32
  (Gluon's tiles are powers of two; 77 = 64 + 16). Text rows past the batch's text are the next
  batch's (or TMA's zeros): their logits are -inf, so they carry no weight;
- each block's Q and dC ([64, 64]) by TMA, two slots, the next block's in flight during this one;
- S = Q K^T, P = softmax(S · scale) exact (the row is one tile), C = P V (P in registers as the
  A operand), δ = rowsum(dC ∘ C), dP = dC V^T, dS = P (dP − δ) · scale, dQ = dS K;
- P and dS also go to shared memory for dK += dS^T Q and dV += P^T dC, summed over the run in
  registers (the tail's transposed: dK^T, dV^T are [64, tail], since wgmma needs 64 rows);
- C and dQ stored fp16 (rows past the batch's video masked: their P rows are zeroed, so they add
  nothing to dK, dV or the sums); the column sums of dQ and its largest |value| kept over the run.
Then, as `attention_item` does: with one run per head (ALONE) dK, dV in fp16 directly; else added in
fp32 into the zeroed dkv32, and the head's last run to arrive converts the sums to fp16. Column
sums of dQ, dK, dV go to the run's row of bias_parts, largest |values| to the range slots.

Measured against the `tl` kernel's one-tile loop (kernel alone, benchmarks/notes/021.md row 37):
1.14-2.6x on the 77-token cases.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...kernels.gluon.gemm import acc_layout
from ...kernels.gluon.pdl import after_previous_launch
from .spec import HEAD_DIM, HEADS, HIDDEN

D = gl.constexpr(HEAD_DIM)
_HEADS = gl.constexpr(HEADS)
_HIDDEN = gl.constexpr(HIDDEN)
_KV = gl.constexpr(2 * HIDDEN)  # width of the stacked [K | V] rows
LOG2E = gl.constexpr(1.4426950408889634)
FINISH_ROWS = gl.constexpr(32)  # text rows per step of the last run's fp32 -> fp16 hand-off


@gluon.jit
def _load_block(q_desc, dc_desc, q_bufs, dc_bufs, bars, i, row, h):
    """Block i's Q and dC into slot i % 2 (landing on bars[i % 2])."""
    s = i % 2
    mbarrier.expect(bars.index(s), q_desc.block_type.nbytes + dc_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, h * D], bars.index(s), q_bufs.index(s))
    tma.async_copy_global_to_shared(dc_desc, [row, h * D], bars.index(s), dc_bufs.index(s))


@gluon.jit
def _abs_max(x, axis: gl.constexpr):
    return gl.max(gl.abs(x), axis=axis)


@gluon.jit
def _finish_kv_grads(dkv32, dkv16, h, NT):
    """The head's last run: dK, dV of head h (dkv32, dkv16 at the batch's first row), the runs' fp32
    sums read from L2 (where the atomics added them), to fp16; their column sums and largest |values|."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, FINISH_ROWS, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    sum_dk = gl.zeros([D], gl.float32, gl.SliceLayout(0, layout))
    sum_dv = gl.zeros([D], gl.float32, gl.SliceLayout(0, layout))
    dk_rows = gl.zeros([FINISH_ROWS], gl.float32, gl.SliceLayout(1, layout))
    dv_rows = gl.zeros([FINISH_ROWS], gl.float32, gl.SliceLayout(1, layout))
    for n0 in range(0, NT, FINISH_ROWS):
        rn = n0 + rows
        off = rn[:, None] * _KV + h * D + dims[None, :]
        ok = (rn < NT)[:, None]
        dk = gl.load(dkv32 + off, mask=ok, other=0.0, cache_modifier=".cg")
        dv = gl.load(dkv32 + off + _HIDDEN, mask=ok, other=0.0, cache_modifier=".cg")
        gl.store(dkv16 + off, dk.to(gl.float16), mask=ok)
        gl.store(dkv16 + off + _HIDDEN, dv.to(gl.float16), mask=ok)
        sum_dk += gl.sum(dk, axis=0)
        sum_dv += gl.sum(dv, axis=0)
        dk_rows = gl.maximum(dk_rows, _abs_max(dk, 1))
        dv_rows = gl.maximum(dv_rows, _abs_max(dv, 1))
    return sum_dk, sum_dv, gl.max(dk_rows, axis=0), gl.max(dv_rows, axis=0)


@gluon.jit
def _emit(ptr, offs, ok, x, ALONE: gl.constexpr):
    """A tile of dK or dV: fp16 (ALONE), else added into the fp32 sums."""
    if ALONE:
        gl.store(ptr + offs, x.to(gl.float16), mask=ok)
    else:
        gl.atomic_add(ptr + offs, x, mask=ok, sem="relaxed")


@gluon.jit(do_not_specialize=["NV", "NT", "per_program", "r_dq", "r_dk", "r_dv", "scale"])
def attention_kernel(q_desc, dc_desc, kv_desc, kvt_desc, ctx16, dq16, dkv32, dkv16, bias_parts, arrivals, ranges,
                     NV, NT, per_program, r_dq, r_dk, r_dv, scale,
                     ALONE: gl.constexpr, PDL: gl.constexpr):
    """C (ctx16), dQ (dq16) and dK, dV of 021's attention from q16, dc16 (q_desc, dc_desc: [64, 64]
    blocks of [video tokens, 1024]) and kv16 (kv_desc: [64, 64] blocks of [text tokens, 2048]; kvt_desc
    the tail's [TAIL, 64] blocks, TAIL = 0: none). Grid: batch * 16 heads * runs, batch-major, then
    head, then run; num_warps=4. dkv16 gets dK, dV in fp16, through dkv32 (zeroed; its fp32 sums) when
    runs share a head; arrivals[batch * 16 + head] counts a head's finished runs; bias_parts[batch *
    runs + run] the run's column sums of dQ, dK, dV; ranges[r + pid] the largest |dQ|, |dK|, |dV|
    (dK, dV: 0 but for the run that converts them)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    NTP: gl.constexpr = kv_desc.block_type.shape[0]
    TAIL: gl.constexpr = kvt_desc.block_type.shape[0] if kvt_desc.block_type.shape[0] < NTP else 0
    s_layout: gl.constexpr = acc_layout(NTP, 4)  # [rows, text]
    o_layout: gl.constexpr = acc_layout(D, 4)  # [rows, head dim] and [text, head dim]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    vec: gl.constexpr = gl.SliceLayout(0, o_layout)  # [head dim]
    after_previous_launch(PDL)
    pid = gl.program_id(0)
    m_blocks = gl.cdiv(NV, BM)
    runs = gl.cdiv(m_blocks, per_program)
    bh = pid // runs
    run = pid % runs
    b = bh // _HEADS
    h = bh % _HEADS
    first = run * per_program
    blocks = gl.minimum(per_program, m_blocks - first)

    k_smem = gl.allocate_shared_memory(gl.float16, [NTP, D], kv_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float16, [NTP, D], kv_desc.layout)
    q_bufs = gl.allocate_shared_memory(gl.float16, [2, BM, D], q_desc.layout)
    dc_bufs = gl.allocate_shared_memory(gl.float16, [2, BM, D], dc_desc.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, NTP], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [BM, NTP], p_layout)
    ds_smem = gl.allocate_shared_memory(gl.float16, [BM, NTP], p_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)

    if TAIL:
        t_layout: gl.constexpr = acc_layout(TAIL, 4)  # [rows, tail] and [head dim, tail]
        kt_smem = gl.allocate_shared_memory(gl.float16, [TAIL, D], kvt_desc.layout)
        vt_smem = gl.allocate_shared_memory(gl.float16, [TAIL, D], kvt_desc.layout)
        tt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, TAIL], gl.float16)
        pt_smem = gl.allocate_shared_memory(gl.float16, [BM, TAIL], tt_layout)
        dst_smem = gl.allocate_shared_memory(gl.float16, [BM, TAIL], tt_layout)
        mbarrier.expect(kv_bar, 2 * kv_desc.block_type.nbytes + 2 * kvt_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kvt_desc, [b * NT + NTP, h * D], kv_bar, kt_smem)
        tma.async_copy_global_to_shared(kvt_desc, [b * NT + NTP, _HIDDEN + h * D], kv_bar, vt_smem)
    else:
        mbarrier.expect(kv_bar, 2 * kv_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kv_desc, [b * NT, h * D], kv_bar, k_smem)
    tma.async_copy_global_to_shared(kv_desc, [b * NT, _HIDDEN + h * D], kv_bar, v_smem)
    row0 = b * NV + first * BM
    _load_block(q_desc, dc_desc, q_bufs, dc_bufs, bars, 0, row0, h)

    text = gl.arange(0, NTP, layout=gl.SliceLayout(0, s_layout))
    in_text = text < NT
    dims = gl.arange(0, D, layout=vec)
    text_row0 = (b * NT).to(gl.int64) * _KV  # the batch's first text row: offsets within it fit 32 bits
    text_rows = gl.arange(0, NTP, layout=gl.SliceLayout(1, o_layout))
    kv_offs = text_rows[:, None] * _KV + h * D + dims[None, :]
    kv_ok = (text_rows < NT)[:, None]
    dk = gl.zeros([NTP, D], gl.float32, o_layout)
    dv = gl.zeros([NTP, D], gl.float32, o_layout)
    if TAIL:
        tail = NTP + gl.arange(0, TAIL, layout=gl.SliceLayout(0, t_layout))
        in_tail = tail < NT
        tail_dims = gl.arange(0, D, layout=gl.SliceLayout(1, t_layout))
        kvt_offs = tail[None, :] * _KV + h * D + tail_dims[:, None]
        dkt = gl.zeros([D, TAIL], gl.float32, t_layout)
        dvt = gl.zeros([D, TAIL], gl.float32, t_layout)
    # The column sums of dQ over the run in shared memory, its largest |value| in one register: kept in
    # registers through the loop (16 a thread), the sums made ptxas spill 190 more bytes a thread.
    sum_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    sum_dq = gl.allocate_shared_memory(gl.float32, [D], sum_layout, gl.zeros([D], gl.float32, vec))
    dq_largest = 0.0
    qk_scale = scale * LOG2E
    mbarrier.wait(kv_bar, 0)
    for i in range(blocks):
        gl.thread_barrier()  # every warp is done reading the slot block i - 1 used (its products retired)
        if i + 1 < blocks:
            _load_block(q_desc, dc_desc, q_bufs, dc_bufs, bars, i + 1, row0 + (i + 1) * BM, h)
        s = i % 2
        mbarrier.wait(bars.index(s), (i // 2) & 1)
        q = q_bufs.index(s)
        dc = dc_bufs.index(s)
        rows_s = (first + i) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        valid = rows_s < NV  # rows past the batch's video read the next batch's: kept out of dK, dV

        # P = softmax(Q K^T scale) over the head (and tail) tile, from row maxima of the unscaled
        # logits (scale > 0); rows past the video zeroed
        logits = warpgroup_mma(q, k_smem.permute((1, 0)), gl.zeros([BM, NTP], gl.float32, s_layout), use_acc=False)
        logits = gl.where(in_text[None, :], logits, float("-inf"))
        row_max = gl.max(logits, axis=1)
        if TAIL:
            logits_t = warpgroup_mma(q, kt_smem.permute((1, 0)), gl.zeros([BM, TAIL], gl.float32, t_layout),
                                     use_acc=False)
            logits_t = gl.where(in_tail[None, :], logits_t, float("-inf"))
            row_max = gl.maximum(row_max, gl.convert_layout(gl.max(logits_t, axis=1), gl.SliceLayout(1, s_layout)))
        row_max = row_max * qk_scale
        p = gl.exp2(logits * qk_scale - row_max[:, None])
        row_sum = gl.sum(p, axis=1)
        if TAIL:
            row_max_t = gl.convert_layout(row_max, gl.SliceLayout(1, t_layout))
            p_t = gl.exp2(logits_t * qk_scale - row_max_t[:, None])
            row_sum = row_sum + gl.convert_layout(gl.sum(p_t, axis=1), gl.SliceLayout(1, s_layout))
        inv_sum = gl.where(valid, 1.0 / row_sum, 0.0)
        p = p * inv_sum[:, None]
        p16 = p.to(gl.float16)
        ctx = warpgroup_mma(gl.convert_layout(p16, a_layout), v_smem, gl.zeros([BM, D], gl.float32, o_layout),
                            use_acc=False)
        dp = warpgroup_mma(dc, v_smem.permute((1, 0)), gl.zeros([BM, NTP], gl.float32, s_layout), use_acc=False,
                           is_async=True)
        if TAIL:
            p_t = p_t * gl.convert_layout(inv_sum, gl.SliceLayout(1, t_layout))[:, None]
            pt16 = p_t.to(gl.float16)
            ctx = warpgroup_mma(gl.convert_layout(pt16, a_layout), vt_smem, ctx)
            dp_t = warpgroup_mma(dc, vt_smem.permute((1, 0)), gl.zeros([BM, TAIL], gl.float32, t_layout),
                                 use_acc=False, is_async=True)
        rows_o = (first + i) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
        offs = (b * NV + rows_o)[:, None].to(gl.int64) * _HIDDEN + h * D + dims[None, :]
        ok = (rows_o < NV)[:, None]
        gl.store(ctx16 + offs, ctx.to(gl.float16), mask=ok)
        # dS = P (dP scale - δ scale), δ = rowsum(dC ∘ C)
        scaled_delta = gl.sum(dc.load(o_layout).to(gl.float32) * ctx, axis=1) * scale
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds16 = (p * (dp * scale - gl.convert_layout(scaled_delta, gl.SliceLayout(1, s_layout))[:, None])).to(gl.float16)
        p_smem.store(p16)
        ds_smem.store(ds16)
        if TAIL:
            dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
            dst16 = (p_t * (dp_t * scale - gl.convert_layout(scaled_delta, gl.SliceLayout(1, t_layout))[:, None])
                     ).to(gl.float16)
            pt_smem.store(pt16)
            dst_smem.store(dst16)
        fence_async_shared()
        gl.thread_barrier()  # every warp's P and dS rows are in shared memory before the wgmma reads them
        dq = warpgroup_mma(gl.convert_layout(ds16, a_layout), k_smem, gl.zeros([BM, D], gl.float32, o_layout),
                           use_acc=False, is_async=True)
        if TAIL:
            dq = warpgroup_mma(gl.convert_layout(dst16, a_layout), kt_smem, dq, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q, dk, is_async=True)  # dS^T Q
        dv = warpgroup_mma(p_smem.permute((1, 0)), dc, dv, is_async=True)  # P^T dC
        if TAIL:
            dkt = warpgroup_mma(q.permute((1, 0)), dst_smem, dkt, is_async=True)  # Q^T dS
            dvt = warpgroup_mma(dc.permute((1, 0)), pt_smem, dvt, is_async=True)  # dC^T P
            dq, dk, dv, dkt, dvt = warpgroup_mma_wait(0, deps=(dq, dk, dv, dkt, dvt))
        else:
            dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        gl.store(dq16 + offs, dq.to(gl.float16), mask=ok)
        sum_dq.store(sum_dq.load(vec) + gl.sum(dq, axis=0))
        dq_largest = gl.maximum(dq_largest, gl.max(_abs_max(dq, 1), axis=0))

    dkv16 += text_row0
    dkv32 += text_row0
    target = dkv16 if ALONE else dkv32
    _emit(target, kv_offs, kv_ok, dk, ALONE)
    _emit(target + _HIDDEN, kv_offs, kv_ok, dv, ALONE)
    sum_dk = gl.sum(dk, axis=0)
    sum_dv = gl.sum(dv, axis=0)
    dk_largest = gl.max(_abs_max(dk, 1), axis=0)
    dv_largest = gl.max(_abs_max(dv, 1), axis=0)
    if TAIL:
        _emit(target, kvt_offs, in_tail[None, :], dkt, ALONE)
        _emit(target + _HIDDEN, kvt_offs, in_tail[None, :], dvt, ALONE)
        sum_dk += gl.convert_layout(gl.sum(dkt, axis=1), vec)
        sum_dv += gl.convert_layout(gl.sum(dvt, axis=1), vec)
        dk_largest = gl.maximum(dk_largest, gl.max(_abs_max(dkt, 1), axis=0))
        dv_largest = gl.maximum(dv_largest, gl.max(_abs_max(dvt, 1), axis=0))
    row = bias_parts + (b * runs + run) * (3 * _HIDDEN) + h * D + dims
    gl.store(row, sum_dq.load(vec))
    gl.store(ranges + r_dq + pid, dq_largest)
    if ALONE:
        gl.store(row + _HIDDEN, sum_dk)
        gl.store(row + 2 * _HIDDEN, sum_dv)
        gl.store(ranges + r_dk + pid, dk_largest)
        gl.store(ranges + r_dv + pid, dv_largest)
    else:
        # dK, dV column sums and ranges come from the run that converts the head's sums; the others leave 0.
        gl.store(row + _HIDDEN, gl.zeros([D], gl.float32, vec))
        gl.store(row + 2 * _HIDDEN, gl.zeros([D], gl.float32, vec))
        gl.store(ranges + r_dk + pid, 0.0)
        gl.store(ranges + r_dv + pid, 0.0)
        gl.thread_barrier()  # every warp's atomics issued before the run is counted
        if gl.atomic_add(arrivals + bh, 1, sem="acq_rel") == runs - 1:
            head_dk, head_dv, head_dk_largest, head_dv_largest = _finish_kv_grads(dkv32, dkv16, h, NT)
            gl.store(row + _HIDDEN, gl.convert_layout(head_dk, vec))
            gl.store(row + 2 * _HIDDEN, gl.convert_layout(head_dv, vec))
            gl.store(ranges + r_dk + pid, head_dk_largest)
            gl.store(ranges + r_dv + pid, head_dv_largest)
