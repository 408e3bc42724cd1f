"""Issue 24, the backward: 037's attention backward (soft cap, causal, GQA of 3) as a Hopper Gluon
kernel, against a torch fp32 reference for its numbers and today's `tl` backward for its time.

The Gluon kernel, per (batch, KV head, block of 128 keys), the blocks with most queries first:
- a loader warp: K and V of the block by TMA once, then for each of the group's 3 query heads the
  causal query tiles (32 queries, from the block's first key on): q (rot16, scaled by scaling / cap)
  and dA (d_attn16) into a ring of STAGES slots;
- two consumer warpgroups, 64 keys each, keeping their dK and dV in registers over all steps:
  S^T = K q^T and dP^T = V dA^T (wgmma from shared memory), t = tanh(S^T), P^T = exp2(t cap log2 e -
  lse) with the causal mask (lse = +inf past S), dS^T = P^T (dP^T - delta) (1 - t^2);
  dV += P^T dA and dK += dS^T q (P^T, dS^T in fp16 registers as the A operand); dS^T through shared
  memory for dQ^T = K^T dS^T (both operands from shared memory, so the [128, 32] accumulator is 32
  registers), itself through shared memory and added into an fp32 dQ by atomics, 8 queries at a time.
  (64-query tiles with dQ = dS K spilled 150-260 bytes per thread at 240 registers: dK, dV and dQ
  accumulators of 64 registers each; 32-query tiles with dQ^T: no stack.)
- epilogue: dK * cap, dV in fp32 (token-major [tokens, 1024]); dQ * scaling accumulated in
  [tokens, 3072] fp32 (zeroed before the launch).
What the `tl` kernel does besides (and this one does not): the RMSNorm and RoPE backward of dQ and dK
with their norm-weight partial sums, the fp16 range slots. So the comparison favours this kernel by
that epilogue (a pass over dQ, dK: ≈ 10–20 µs at case 5) — the gate asks for a clear margin.

Prediction (written before any run): the `tl` backward reads 80–120 TFLOP/s at S = 128–256 and
≈ 310 at S = 2048 (5 products per block pair, P recomputed by the dQ programs: 7); this kernel does 5
products per block pair once. At case 5 (B = 64, S = 256: 2 · 5 · 64 · 24 · 256² · 128 / 2 ≈ 64 GFLOP
causal) it should take ≤ 330 µs (≈ 200 TFLOP/s) against ≈ 650 µs, ≥ 1.6× at case 13 and case 1,
or the gate fails.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_attention_backward.py [--cases 5,1,13]
    ... --compile-only      # on any machine: shared memory, registers, stack, HGMMA

Measured in session 19 (benchmarks/notes/037.md, "Issue 24: the Gluon backward, first form"):
correct on the first run (dq, dk, dv within 2.2e-4 of fp32), but 0.36-0.57x the `tl` backward: the
fp32 dQ atomics cost 0.8-1.1 ms; without dQ (diagnostic DQ=0) the dK/dV part takes 335 us at
case 5 (154 TFLOP/s for its 4 products) and 325 at case 13 (317). Then written, compiled, not run:
DQ=2, the two warpgroups' partials summed in shared memory (an mbarrier pair between them) and
added 4 columns per vector reduction (REDG.E.ADD.F32x4 in the SASS): 8x fewer reduction
instructions than DQ=1.
"""

from __future__ import annotations

import argparse
import math

import torch
from gluon_attention_forward import _descriptor, _inputs, _rel, _tanh, _us, tl_forward  # a sibling study
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from backfuse.kernels.gluon.gemm import acc_layout
from backfuse.ops.gemma3_core.spec import GROUP, HEAD_DIM, HEADS, KV_HEADS, KV_OUT, Q_OUT

D = gl.constexpr(HEAD_DIM)
_GROUP = gl.constexpr(GROUP)
_KV_HEADS = gl.constexpr(KV_HEADS)
_HEADS = gl.constexpr(HEADS)
_Q_OUT = gl.constexpr(Q_OUT)
_KV_OUT = gl.constexpr(KV_OUT)
LOG2E = gl.constexpr(1.4426950408889634)
BN_ = 128  # keys per program (64 per consumer warpgroup)
BM_ = 32  # queries per step


@gluon.jit
def _block_of(S, n_blocks):
    """(batch, KV head, key block) of this program: the first key blocks (most queries) first."""
    pid = gl.program_id(0)
    per_block = gl.num_programs(0) // n_blocks
    return (pid % per_block) // _KV_HEADS, (pid % per_block) % _KV_HEADS, pid // per_block


@gluon.jit
def _steps(S, block, BN: gl.constexpr, BM: gl.constexpr):
    """Query tiles of one head that see keys of `block`: from the block's first key to S."""
    return gl.cdiv(S - block * BN, BM)


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, S, n_blocks,
            STAGES: gl.constexpr):
    BN: gl.constexpr = k_desc.block_type.shape[0]
    BM: gl.constexpr = q_desc.block_type.shape[0]
    b, kv, block = _block_of(S, n_blocks)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b * S + block * BN, _Q_OUT + kv * D], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b * S + block * BN, kv * D], kv_bar, v_smem)
    steps = _steps(S, block, BN, BM)
    for it in range(_GROUP * steps):
        h = kv * _GROUP + it // steps
        row = b * S + block * BN + (it % steps) * BM
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a slot's first use passes at once
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, h * D], ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [row, h * D], ready.index(s), do_bufs.index(s))


@gluon.jit
def _red_add_v4(ptrs, values, ok):
    """*ptrs += values where ok, four consecutive fp32 per vector reduction (red.global.add.v4.f32,
    sm_90): each thread's elements come in runs of 4 consecutive columns, 16-byte aligned."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $12, 0; @p red.global.add.v4.f32 [$4], {$8, $9, $10, $11}; "
        "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }",
        "=r,=r,=r,=r,l,l,l,l,f,f,f,f,r,r,r,r", [ptrs.to(gl.int64, bitcast=True), values, ok], dtype=gl.int32,
        is_pure=False, pack=4)


@gluon.jit
def _consumer(k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, dq_full, dq_empty,
              lse, delta, dq32, dk32, dv32,
              S, n_blocks, cap, scaling, STAGES: gl.constexpr, PART: gl.constexpr, DQ: gl.constexpr):
    BN: gl.constexpr = k_smem.type.shape[0]
    BM: gl.constexpr = q_bufs.type.shape[1]
    KEYS: gl.constexpr = BN // 2
    st_layout: gl.constexpr = acc_layout(BM, 4)  # [keys, queries]
    kd_layout: gl.constexpr = acc_layout(D, 4)  # [keys, head dim] and [queries, head dim]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kd_layout, k_width=2)
    b, kv, block = _block_of(S, n_blocks)
    key0 = block * BN + PART * KEYS
    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    k = k_smem.slice(PART * KEYS, KEYS, dim=0)  # [keys, D]
    v = v_smem.slice(PART * KEYS, KEYS, dim=0)
    ds = ds_smem.index(PART)  # [keys, queries]
    dq_part = dq_smem.index(PART)  # [D, queries] fp32
    DQ_ROWS: gl.constexpr = 8
    dq_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    dk = gl.zeros([KEYS, D], gl.float32, kd_layout)
    dv = gl.zeros([KEYS, D], gl.float32, kd_layout)
    log2_scale = cap * LOG2E
    steps = _steps(S, block, BN, BM)
    mbarrier.wait(kv_bar, 0)
    for it in range(_GROUP * steps):
        h = kv * _GROUP + it // steps
        m0 = block * BN + (it % steps) * BM
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        q = q_bufs.index(s)  # [queries, D]
        d_attn = do_bufs.index(s)
        zero = gl.zeros([KEYS, BM], gl.float32, st_layout)
        st = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v, d_attn.permute((1, 0)), zero, use_acc=False, is_async=True)
        queries = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, st_layout))
        q_ok = queries < S
        row_lse = gl.load(lse + (b * _HEADS + h) * S + queries, mask=q_ok, other=float("inf"))
        st = warpgroup_mma_wait(1, deps=(st,))
        t = _tanh(st)
        visible = keys[:, None] <= queries[None, :]
        pt = gl.where(visible, gl.exp2(t * log2_scale - row_lse[None, :]), 0.0)
        pt16 = gl.convert_layout(pt.to(gl.float16), a_layout)
        dv = warpgroup_mma(pt16, d_attn, dv, is_async=True)  # beside the softmax's rest
        pt = pt * (1.0 - t * t)
        row_delta = gl.load(delta + (b * _HEADS + h) * S + queries, mask=q_ok, other=0.0)
        dpt, dv = warpgroup_mma_wait(1, deps=(dpt, dv))  # dP^T retired (issued before dV)
        ds16 = (pt * (dpt - row_delta[None, :])).to(gl.float16)  # dS^T / scaling
        ds.store(ds16)
        fence_async_shared()
        dk = warpgroup_mma(gl.convert_layout(ds16, a_layout), q, dk, is_async=True)
        # dQ^T = K^T dS^T: [D, queries], A = K M-major, B = dS^T from shared memory
        dqt = warpgroup_mma(k.permute((1, 0)), ds, gl.zeros([D, BM], gl.float32, st_layout), use_acc=False,
                            is_async=True)
        dv, dk, dqt = warpgroup_mma_wait(0, deps=(dv, dk, dqt))
        mbarrier.arrive(empty.index(s))
        # dQ's partial through shared memory, then added DQ_ROWS queries at a time in a row-major layout
        # (the wgmma layout would hold every address at once). DQ: 0 skips dQ (diagnostic), 1 adds
        # each warpgroup's partial by scalar atomics, 2 sums the two partials first (each warpgroup
        # adds half the rows) and adds 4 columns per vector reduction.
        if DQ == 2:
            mbarrier.wait(dq_empty, (it & 1) ^ 1)  # both warpgroups have read the previous partials
        if DQ > 0:
            dq_part.store(dqt * scaling)
        gl.thread_barrier()  # this warpgroup's stores are visible to its loads
        if DQ == 1:
            for r in gl.static_range(0, BM, DQ_ROWS):
                rows = m0 + r + gl.arange(0, DQ_ROWS, layout=gl.SliceLayout(1, dq_layout))
                cols = h * D + gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
                ptrs = dq32 + (b * S + rows)[:, None].to(gl.int64) * _Q_OUT + cols[None, :]
                gl.atomic_add(ptrs, dq_part.permute((1, 0)).slice(r, DQ_ROWS, dim=0).load(dq_layout),
                              mask=(rows < S)[:, None], sem="relaxed")
            gl.thread_barrier()  # every load is done before the next step's store
        if DQ == 2:
            mbarrier.arrive(dq_full)
            mbarrier.wait(dq_full, it & 1)
            for r0 in gl.static_range(PART * (BM // 2), PART * (BM // 2) + BM // 2, DQ_ROWS):
                rows = m0 + r0 + gl.arange(0, DQ_ROWS, layout=gl.SliceLayout(1, dq_layout))
                cols = h * D + gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
                ptrs = dq32 + (b * S + rows)[:, None].to(gl.int64) * _Q_OUT + cols[None, :]
                both = dq_smem.index(0).permute((1, 0)).slice(r0, DQ_ROWS, dim=0).load(dq_layout) + \
                    dq_smem.index(1).permute((1, 0)).slice(r0, DQ_ROWS, dim=0).load(dq_layout)
                _red_add_v4(ptrs, both, ((rows < S)[:, None] & (cols >= 0)[None, :]).to(gl.int32))
            mbarrier.arrive(dq_empty)
    rows = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kd_layout))
    cols = kv * D + gl.arange(0, D, layout=gl.SliceLayout(0, kd_layout))
    offs = (b * S + rows)[:, None].to(gl.int64) * _KV_OUT + cols[None, :]
    ok = (rows < S)[:, None]
    gl.store(dk32 + offs, dk * cap, mask=ok)
    gl.store(dv32 + offs, dv, mask=ok)


@gluon.jit
def _second_consumer(k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, dq_full, dq_empty,
                     lse, delta, dq32, dk32, dv32,
                     S, n_blocks, cap, scaling, STAGES: gl.constexpr, DQ: gl.constexpr):
    _consumer(k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, dq_full, dq_empty,
              lse, delta, dq32, dk32, dv32,
              S, n_blocks, cap, scaling, STAGES, 1, DQ)


@gluon.jit
def attention_backward_kernel(q_desc, do_desc, k_desc, v_desc, lse, delta, dq32, dk32, dv32, S, n_blocks, cap, scaling,
                              STAGES: gl.constexpr, DQ: gl.constexpr):
    """dQ (added into dq32), dK, dV of 037's attention from rot16 (q_desc: [64, 128] blocks of the q
    heads; k_desc: [128, 128] blocks of the k heads), v16 (v_desc), d_attn16 (do_desc) and the
    forward's lse, delta; grid batch * KV heads * n_blocks, num_warps=4."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    BM: gl.constexpr = q_desc.block_type.shape[0]
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_smem = gl.allocate_shared_memory(gl.float16, [2, BN // 2, BM],
                                        gl.NVMMASharedLayout.get_default_for([BN // 2, BM], gl.float16))
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, D, BM],
                                        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(dq_full, count=2)  # both consumer warpgroups
    mbarrier.init(dq_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups
    gl.warp_specialize([
        (_consumer, (k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, dq_full, dq_empty,
                     lse, delta, dq32, dk32, dv32,
                     S, n_blocks, cap, scaling, STAGES, 0, DQ)),
        (_second_consumer, (k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_smem, kv_bar, ready, empty, dq_full,
                            dq_empty, lse, delta, dq32, dk32,
                            dv32, S, n_blocks, cap, scaling, STAGES, DQ)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, S,
                   n_blocks, STAGES)),
    ], [4, 1], [240, 24])


STAGES_ = 4
DQ_MODES = {2: "two partials summed, vector adds", 1: "per warpgroup, scalar atomics", 0: "skipped (diagnostic)"}


def gluon_backward(rot16, v16, d_attn16, lse, delta, batch, seq, cap, scaling, dq=2):
    """A function that launches the Gluon kernel (dq32 zeroed first; dq: a key of DQ_MODES), and its
    outputs (dq32, dk32, dv32)."""
    tokens = batch * seq
    dq32 = torch.empty(tokens, Q_OUT, dtype=torch.float32, device=rot16.device)
    dk32 = torch.empty(tokens, KV_OUT, dtype=torch.float32, device=rot16.device)
    dv32 = torch.empty_like(dk32)
    n_blocks = math.ceil(seq / BN_)
    descs = (_descriptor(rot16, [BM_, HEAD_DIM]), _descriptor(d_attn16, [BM_, HEAD_DIM]),
             _descriptor(rot16, [BN_, HEAD_DIM]), _descriptor(v16, [BN_, HEAD_DIM]))

    def launch():
        dq32.zero_()
        attention_backward_kernel[(batch * KV_HEADS * n_blocks,)](*descs, lse, delta, dq32, dk32, dv32, seq, n_blocks,
                                                                  cap, scaling, STAGES=STAGES_, DQ=dq, num_warps=4)

    return launch, (dq32, dk32, dv32)


def reference(rot16, v16, d_attn16, batch, seq, cap, scaling):
    """(dq, dk, dv) in fp32 from the same fp16 operands: the exact math the kernel approximates."""
    q = rot16[:, :Q_OUT].float().view(batch, seq, HEADS, HEAD_DIM)
    k = rot16[:, Q_OUT:].float().view(batch, seq, KV_HEADS, HEAD_DIM)
    v = v16.float().view(batch, seq, KV_HEADS, HEAD_DIM)
    do = d_attn16.float().view(batch, seq, HEADS, HEAD_DIM)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    for h in range(HEADS):
        kv = h // GROUP
        t = torch.tanh(torch.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, kv]))
        p = torch.softmax((t * cap).masked_fill(~mask, float("-inf")), dim=-1)
        dp = torch.einsum("bqd,bkd->bqk", do[:, :, h], v[:, :, kv])
        ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * (1 - t * t)  # d logits * (1 - t^2) / cap ... / scaling
        dq[:, :, h] = torch.einsum("bqk,bkd->bqd", ds, k[:, :, kv]) * scaling
        dk[:, :, kv] += torch.einsum("bqk,bqd->bkd", ds, q[:, :, h]) * cap
        dv[:, :, kv] += torch.einsum("bqk,bqd->bkd", p, do[:, :, h])
    return dq.view(batch * seq, -1), dk.view(batch * seq, -1), dv.view(batch * seq, -1)


def tl_backward_us(batch, seq):
    """Device time of today's `tl` attention backward kernel in one fused 037 call (official inputs)."""
    from torch.profiler import ProfilerActivity, profile

    import backfuse

    prob = backfuse.problem("037")
    x = prob.make_inputs(dict(batch_size=batch, seq_len=seq), seed=0, device="cuda")
    for _ in range(3):
        prob.fused(*x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            prob.fused(*x)
        torch.cuda.synchronize()
    times = sorted(e.device_time for e in prof.events() if e.name.startswith("attention_backward_kernel"))
    return times[len(times) // 2] if times else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="5,1,13")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print its resources")
    args = ap.parse_args()
    if args.compile_only:
        from backfuse.kernels.gluon.sm90 import compile_sm90, descriptor_type, usage

        sig = {"q_desc": descriptor_type(gl.float16, [BM_, HEAD_DIM]), "do_desc": descriptor_type(gl.float16, [BM_, HEAD_DIM]),
               "k_desc": descriptor_type(gl.float16, [BN_, HEAD_DIM]), "v_desc": descriptor_type(gl.float16, [BN_, HEAD_DIM]),
               "lse": "*fp32", "delta": "*fp32", "dq32": "*fp32", "dk32": "*fp32", "dv32": "*fp32", "S": "i32",
               "n_blocks": "i32", "cap": "fp32", "scaling": "fp32"}
        for mode, name in DQ_MODES.items():
            kernel = compile_sm90(attention_backward_kernel, sig, {"STAGES": STAGES_, "DQ": mode}, num_warps=4)
            print(f"gluon attention backward, dQ {name:34s}", usage(kernel), flush=True)
        return
    import backfuse

    prob = backfuse.problem("037")
    cap, scaling = 50.0, HEAD_DIM ** -0.5
    for index in (int(c) for c in args.cases.split(",")):
        w = prob.workloads[index]
        batch, seq = w.axes["batch_size"], w.axes["seq_len"]
        rot16, v16, d_attn16 = _inputs(batch, seq, cap)
        forward, (_, lse, delta) = tl_forward(rot16, v16, d_attn16, batch, seq, cap)
        forward()
        ref = reference(rot16, v16, d_attn16, batch, seq, cap, scaling)
        flop = 2 * 5 * batch * HEADS * seq * seq * HEAD_DIM / 2
        t_tl = tl_backward_us(batch, seq)
        print(f"case {index} B={batch} S={seq}: tl backward (with its norm/RoPE epilogue) {t_tl:.1f} us", flush=True)
        for mode, name in DQ_MODES.items():
            launch, got = gluon_backward(rot16, v16, d_attn16, lse, delta, batch, seq, cap, scaling, dq=mode)
            launch()
            errs = "/".join(f"{_rel(a, r):.1e}" for a, r in zip(got, ref))
            t = _us(launch)
            print(f"  dQ {name:34s} {t:7.1f} us ({flop / t / 1e6:4.0f} TFLOP/s, dQ zeroing included) "
                  f"{t_tl / t:.2f}x tl; rel. err. dq/dk/dv vs fp32 {errs}", flush=True)

if __name__ == "__main__":
    main()
