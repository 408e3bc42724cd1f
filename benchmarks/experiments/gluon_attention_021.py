"""Issue 23, item 2's missing piece: 021's attention (D = 64, all text tokens in one tile, no mask but
the text's end) as a Hopper Gluon kernel, against a torch fp32 reference for its numbers and today's
`tl` attention launch for its time. A one-launch 021 needs an attention whose items can sit in a
warp-specialized queue; this measures whether Gluon's wgmma form of the item is at least as fast.

Per program: (batch, head, run of 64-token video blocks), one warpgroup (num_warps=4):
- K and V of the head by TMA once: Gluon's tensors and TMA blocks are powers of two, so the text is
  either one tile padded to one (77 tokens: 128) or, as the `tl` kernel does, a head tile and a
  tail (77 = 64 + 16; the tail's dK^T, dV^T come out [64, 16], since wgmma needs 64 rows);
  each block's Q and dC ([64, 64]) by TMA, two slots, the next block's in flight during this one;
- S = Q K^T (wgmma, both from shared memory), P = softmax(S · scale) exact (the row is one tile;
  columns past the text -inf), C = P V (P in registers as the A operand), δ = rowsum(dC ∘ C),
  dP = dC V^T, dS = P (dP − δ) · scale, dQ = dS K (dS in registers);
- P and dS also go to shared memory for dK = dS^T Q and dV = P^T dC (A read transposed from
  there, M = the head tile's text rows);
- C and dQ stored fp16 per block (rows past the batch's video masked); dK, dV added in fp32 into a
  zeroed [text tokens, 2048] buffer by atomics: per run from registers (ACCUMULATE, two more
  [NTP, 64] accumulators live through the loop), or per block (fewer registers, more atomics).
What the `tl` kernel does besides (this one does not): the bias gradients' column sums, the fp16
range slots, the last run's hand-off of dK/dV to fp16 (and fp16 stores when a head has one run), and
text longer than one tile (cases 1, 5, 11: 211-373 tokens). The comparison favours this kernel by
those, so it must win clearly to be worth the one-launch build.

Prediction (written before any run): the `tl` one-tile loop is issue-bound at IPC 1.2 (021.md
row 29), with 255 registers and one 8-warp program per SM; here the products are wgmma from shared
memory, 64-row blocks at 4 warps and ≈ 60 KB of shared memory allow 3 programs per SM, so
latency hides across programs. Expected ≥ 1.3× on the 77-token cases (attention busy: case 8
≈ 15 µs, case 0 ≈ 100 µs in the `tl` launch), or the Gluon attention is no base for a one-launch
021. `tl_attention_us` times the `tl` kernel inside a fused call (PDL included): see below.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_attention_021.py [--cases 8,12,2,13,0,6]
    ... --compile-only      # on any machine: shared memory, registers, stack, HGMMA

Measured (session 23, 021.md row 37): this kernel alone 6.7-11.2 us on cases 8, 12, 2 (per run,
head + tail), which read as 2-2.6x the `tl` attention; but that `tl` figure is its time inside a
fused call with PDL, which counts its wait for the forward. Timed alike (repeated alone), the `tl`
kernel takes 10.0-10.7 us there: this kernel is 0.96-1.5x of it, and with the `tl` kernel's other
duties (bias sums, ranges, the last run's hand-off) it lost in the fused path (commit 2661470).
Compiled, 77 text tokens: head + tail 72 KB of shared memory, 255 registers, 32 bytes of stack with
dK/dV added per block, 184 kept per run; one 128-wide tile 96 KB, 32 and 520 bytes (the two
[128, 64] accumulators over the loop spill). Two programs per SM either way (registers). Every
output is poisoned before the first launch and checked against the fp32 reference.
"""

from __future__ import annotations

import argparse
import math

import torch
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
from backfuse.kernels.gluon.host import fp16_descriptor
from backfuse.ops.wan_xattn.config import text_tiles
from backfuse.ops.wan_xattn.spec import HEAD_DIM, HEADS, HIDDEN

D = gl.constexpr(HEAD_DIM)
_HEADS = gl.constexpr(HEADS)
_HIDDEN = gl.constexpr(HIDDEN)
_KV = gl.constexpr(2 * HIDDEN)  # width of the stacked [K | V] rows
LOG2E = gl.constexpr(1.4426950408889634)
BM_ = 64  # video tokens per block (one warpgroup's wgmma rows)


@gluon.jit
def _load_block(q_desc, dc_desc, q_bufs, dc_bufs, bars, i, row, h):
    """Block i's Q and dC into slot i % 2 (landing on bars[i % 2])."""
    s = i % 2
    mbarrier.expect(bars.index(s), q_desc.block_type.nbytes + dc_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, h * D], bars.index(s), q_bufs.index(s))
    tma.async_copy_global_to_shared(dc_desc, [row, h * D], bars.index(s), dc_bufs.index(s))


@gluon.jit
def attention_021_kernel(q_desc, dc_desc, kv_desc, kvt_desc, ctx16, dq16, dkv32, NV, NT, runs, per_program, scale,
                         ACCUMULATE: gl.constexpr, TAIL: gl.constexpr):
    """C (ctx16), dQ (dq16) and dK, dV (added into dkv32, zeroed before) of 021's attention from q16,
    dc16 (q_desc, dc_desc: [64, 64] blocks over [video tokens, 1024]) and kv16 (kv_desc: [NTP, 64]
    blocks over [text tokens, 2048]); grid batch * 16 heads * runs, each run `per_program` blocks
    of 64 video tokens; num_warps=4. ACCUMULATE: dK, dV summed over the run in registers, else
    added per block. TAIL > 0: the text is a head tile of NTP tokens and a tail of TAIL (kvt_desc:
    [TAIL, 64] blocks; 77 = 64 + 16), its dK^T, dV^T ([64, TAIL]: wgmma needs 64 rows) added
    transposed; TAIL = 0: one tile (kvt_desc unused)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    NTP: gl.constexpr = kv_desc.block_type.shape[0]
    s_layout: gl.constexpr = acc_layout(NTP, 4)  # [rows, text]
    o_layout: gl.constexpr = acc_layout(D, 4)  # [rows, head dim] and [text, head dim]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pid = gl.program_id(0)
    run = pid % runs
    b = (pid // runs) // _HEADS
    h = (pid // runs) % _HEADS
    first = run * per_program
    blocks = gl.minimum(per_program, gl.cdiv(NV, BM) - first)

    k_smem = gl.allocate_shared_memory(gl.float16, [NTP, D], kv_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float16, [NTP, D], kv_desc.layout)
    q_bufs = gl.allocate_shared_memory(gl.float16, [2, BM, D], q_desc.layout)
    dc_bufs = gl.allocate_shared_memory(gl.float16, [2, BM, D], dc_desc.layout)
    pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, NTP], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [BM, NTP], pt_layout)
    ds_smem = gl.allocate_shared_memory(gl.float16, [BM, NTP], pt_layout)
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
    text_rows = gl.arange(0, NTP, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    kv_offs = (b * NT + text_rows)[:, None].to(gl.int64) * _KV + h * D + dims[None, :]
    kv_ok = (text_rows < NT)[:, None]
    dk = gl.zeros([NTP, D], gl.float32, o_layout)
    dv = gl.zeros([NTP, D], gl.float32, o_layout)
    if TAIL:
        tail = NTP + gl.arange(0, TAIL, layout=gl.SliceLayout(0, t_layout))
        in_tail = tail < NT
        tail_dims = gl.arange(0, D, layout=gl.SliceLayout(1, t_layout))
        kvt_offs = (b * NT + tail)[None, :].to(gl.int64) * _KV + h * D + tail_dims[:, None]
        dkt = gl.zeros([D, TAIL], gl.float32, t_layout)
        dvt = gl.zeros([D, TAIL], gl.float32, t_layout)
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

        # P = softmax(Q K^T scale) over the head (and tail) tile; rows past the video zeroed
        logits = warpgroup_mma(q, k_smem.permute((1, 0)), gl.zeros([BM, NTP], gl.float32, s_layout), use_acc=False)
        logits = gl.where(in_text[None, :], logits, float("-inf"))
        row_max = gl.max(logits, axis=1)
        if TAIL:
            logits_t = warpgroup_mma(q, kt_smem.permute((1, 0)), gl.zeros([BM, TAIL], gl.float32, t_layout),
                                     use_acc=False)
            logits_t = gl.where(in_tail[None, :], logits_t, float("-inf"))
            row_max = gl.maximum(row_max, gl.convert_layout(gl.max(logits_t, axis=1), gl.SliceLayout(1, s_layout)))
        row_max = row_max * qk_scale  # scale > 0
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
        cols_o = h * D + gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        offs = (b * NV + rows_o)[:, None].to(gl.int64) * _HIDDEN + cols_o[None, :]
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
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q, dk, use_acc=ACCUMULATE, is_async=True)  # dS^T Q
        dv = warpgroup_mma(p_smem.permute((1, 0)), dc, dv, use_acc=ACCUMULATE, is_async=True)  # P^T dC
        if TAIL:
            dkt = warpgroup_mma(q.permute((1, 0)), dst_smem, dkt, use_acc=ACCUMULATE, is_async=True)  # Q^T dS
            dvt = warpgroup_mma(dc.permute((1, 0)), pt_smem, dvt, use_acc=ACCUMULATE, is_async=True)  # dC^T P
            dq, dk, dv, dkt, dvt = warpgroup_mma_wait(0, deps=(dq, dk, dv, dkt, dvt))
        else:
            dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        gl.store(dq16 + offs, dq.to(gl.float16), mask=ok)
        if not ACCUMULATE:
            gl.atomic_add(dkv32 + kv_offs, dk, mask=kv_ok, sem="relaxed")
            gl.atomic_add(dkv32 + kv_offs + _HIDDEN, dv, mask=kv_ok, sem="relaxed")
            if TAIL:
                gl.atomic_add(dkv32 + kvt_offs, dkt, mask=in_tail[None, :], sem="relaxed")
                gl.atomic_add(dkv32 + kvt_offs + _HIDDEN, dvt, mask=in_tail[None, :], sem="relaxed")
    if ACCUMULATE:
        gl.atomic_add(dkv32 + kv_offs, dk, mask=kv_ok, sem="relaxed")
        gl.atomic_add(dkv32 + kv_offs + _HIDDEN, dv, mask=kv_ok, sem="relaxed")
        if TAIL:
            gl.atomic_add(dkv32 + kvt_offs, dkt, mask=in_tail[None, :], sem="relaxed")
            gl.atomic_add(dkv32 + kvt_offs + _HIDDEN, dvt, mask=in_tail[None, :], sem="relaxed")


def text_tiles_of(nt: int, split: bool) -> tuple:
    """(head, tail) text tiles: the `tl` kernel's (`config.text_tiles`: powers of two, 77 = 64 + 16
    when split, else 128), the head at least 64 (dK's wgmma rows)."""
    if not 1 <= nt <= 128:
        raise ValueError(f"gluon_attention_021: text of 1..128 tokens in one tile, got {nt}")
    head, tail = text_tiles(nt, split)
    return (head, tail) if head >= 64 else (64, 0)


def gluon_attention(q16, kv16, dc16, batch, nv, nt, per_program, scale, accumulate, split):
    """A function that launches the Gluon kernel (dkv32 zeroed first), and its outputs (ctx16, dq16,
    dkv32)."""
    ctx16, dq16 = torch.empty_like(q16), torch.empty_like(q16)
    dkv32 = torch.empty(kv16.shape, dtype=torch.float32, device=q16.device)
    runs = math.ceil(math.ceil(nv / BM_) / per_program)
    head, tail = text_tiles_of(nt, split)
    descs = (fp16_descriptor(q16, [BM_, HEAD_DIM]), fp16_descriptor(dc16, [BM_, HEAD_DIM]),
             fp16_descriptor(kv16, [head, HEAD_DIM]), fp16_descriptor(kv16, [tail or head, HEAD_DIM]))

    def launch():
        dkv32.zero_()
        attention_021_kernel[(batch * HEADS * runs,)](*descs, ctx16, dq16, dkv32, nv, nt, runs, per_program, scale,
                                                      ACCUMULATE=accumulate, TAIL=tail, num_warps=4)

    return launch, (ctx16, dq16, dkv32)


def reference(q16, kv16, dc16, batch, nv, nt, scale):
    """(C, dQ, [dK | dV]) in fp32 from the same fp16 operands: the math both kernels approximate."""
    q = q16.float().view(batch, nv, HEADS, HEAD_DIM).transpose(1, 2)
    k = kv16[:, :HIDDEN].float().view(batch, nt, HEADS, HEAD_DIM).transpose(1, 2)
    v = kv16[:, HIDDEN:].float().view(batch, nt, HEADS, HEAD_DIM).transpose(1, 2)
    dc = dc16.float().view(batch, nv, HEADS, HEAD_DIM).transpose(1, 2)
    p = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
    ctx = p @ v
    dp = dc @ v.transpose(-1, -2)
    ds = p * (dp - (dc * ctx).sum(-1, keepdim=True)) * scale
    dq, dk, dv = ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dc

    def tokens(x, n):
        return x.transpose(1, 2).reshape(batch * n, HIDDEN)

    return tokens(ctx, nv), tokens(dq, nv), torch.cat([tokens(dk, nt), tokens(dv, nt)], dim=1)


VARIANTS = ((True, False), (True, True), (False, False), (False, True))  # (split text tile, dK/dV per run)


def _form(split, accumulate):
    return f"{'head + tail' if split else 'one tile   '}, dK/dV per {'run  ' if accumulate else 'block'}"


def tl_attention_us(axes):
    """Device time of today's `tl` attention kernel in one fused 021 call (official inputs)."""
    from torch.profiler import ProfilerActivity, profile

    import backfuse

    prob = backfuse.problem("021")
    x = prob.make_inputs(axes, seed=0, device="cuda")
    for _ in range(3):
        prob.fused(*x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            prob.fused(*x)
        torch.cuda.synchronize()
    times = sorted(e.device_time for e in prof.events() if e.name.startswith("attention_kernel"))
    return times[len(times) // 2] if times else float("nan")


def _us(launch, reps=10):
    """Device time of the Gluon kernel, µs: the median over reps launches, read from the profiler
    (events around host-launched Gluon calls time the host: its launch with four TMA descriptors
    takes longer than the kernel on the small cases)."""
    from torch.profiler import ProfilerActivity, profile

    launch()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            launch()
        torch.cuda.synchronize()
    times = sorted(e.device_time for e in prof.events() if e.name.startswith("attention_021_kernel"))
    return times[len(times) // 2] if times else float("nan")


def _rel(a, r):
    return ((a.float() - r.float()).norm() / r.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8,12,2,13,0,6")
    ap.add_argument("--per-program", default="1,2,4", help="blocks of 64 video tokens per program")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print its resources")
    args = ap.parse_args()
    if args.compile_only:
        from backfuse.kernels.gluon.sm90 import compile_sm90, descriptor_type, usage

        for split, accumulate in VARIANTS:
            head, tail = text_tiles_of(77, split)
            sig = {"q_desc": descriptor_type(gl.float16, [BM_, HEAD_DIM]),
                   "dc_desc": descriptor_type(gl.float16, [BM_, HEAD_DIM]),
                   "kv_desc": descriptor_type(gl.float16, [head, HEAD_DIM]),
                   "kvt_desc": descriptor_type(gl.float16, [tail or head, HEAD_DIM]),
                   "ctx16": "*fp16", "dq16": "*fp16", "dkv32": "*fp32", "NV": "i32", "NT": "i32", "runs": "i32",
                   "per_program": "i32", "scale": "fp32"}
            kernel = compile_sm90(attention_021_kernel, sig, {"ACCUMULATE": accumulate, "TAIL": tail}, num_warps=4)
            print(f"gluon attention 021, 77 text tokens as {_form(split, accumulate)}", usage(kernel), flush=True)
        return
    import backfuse

    prob = backfuse.problem("021")
    scale = HEAD_DIM ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    for index in (int(c) for c in args.cases.split(",")):
        axes = prob.workloads[index].axes
        batch, nv, nt = axes["batch_size"], axes["num_video_tokens"], axes["num_text_tokens"]
        if nt > 128:
            print(f"case {index}: {nt} text tokens, more than one tile: skipped", flush=True)
            continue
        q16 = torch.randn(batch * nv, HIDDEN, device="cuda", generator=gen).half()
        dc16 = (torch.randn(batch * nv, HIDDEN, device="cuda", generator=gen) * 0.1).half()
        kv16 = torch.randn(batch * nt, 2 * HIDDEN, device="cuda", generator=gen).half()
        ref = reference(q16, kv16, dc16, batch, nv, nt, scale)
        t_tl = tl_attention_us(axes)
        print(f"case {index} {axes}: tl attention (with its bias sums and ranges) {t_tl:.1f} us", flush=True)
        for per, (split, accumulate) in [(int(p), v) for p in args.per_program.split(",") for v in VARIANTS]:
            launch, got = gluon_attention(q16, kv16, dc16, batch, nv, nt, per, scale, accumulate, split)
            for out in got[:2]:
                out.fill_(float("nan"))  # poisoned: unwritten elements show
            launch()
            torch.cuda.synchronize()
            errs = "/".join(f"{_rel(a, r):.1e}" for a, r in zip(got, ref))
            bad = sum(int(o.isnan().any().item()) for o in got)
            t = _us(launch)
            form = f"{per} blocks per program, {_form(split, accumulate)}"
            print(f"  {form}: {t:7.1f} us ({t_tl / t:.2f}x tl, kernel only); rel. err. "
                  f"C/dQ/dKV vs fp32 {errs}; outputs with NaN {bad}", flush=True)


if __name__ == "__main__":
    main()
