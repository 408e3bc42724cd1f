"""The one-launch 021 study's launcher: one persistent Triton launch (`kernel.py`) over the task queue
that `plan.plan` lays out; same signature and outputs as `backfuse.ops.wan_xattn.backward`."""

from __future__ import annotations

from backfuse.fp16_guard import RangeSlots
from backfuse.kernels import buffers
from backfuse.kernels.launch import FastKernel
from backfuse.ops.fused import Host, fits_int32
from backfuse.ops.wan_xattn.spec import HIDDEN, PROBLEM

from .kernel import backward_kernel
from .plan import CONFIG, INTERPRETER_CONFIG, plan

KERNEL = FastKernel(backward_kernel, waits_on_peers=True)


def backward(go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale, *, needs=None, deterministic=False, ranges=None,
             config=None, sms=None, profile=None):
    """As `backfuse.ops.wan_xattn.backward.backward` (needs, deterministic, ranges, sms), in one launch;
    config: a `plan.Config`. profile (GPU diagnostics): an int64 tensor of at least 4 * items that
    receives each item's timestamps (`queue.profile_item`)."""
    inputs = (go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale)
    if not fits_int32(go.numel(), 2 * text.numel()):
        return PROBLEM.fp32_backward(*inputs)
    batch, nv, _ = video.shape
    nt = text.shape[1]
    tv, tt = batch * nv, batch * nt
    host = Host(video.device, sms)
    cfg = host.config(config, CONFIG, INTERPRETER_CONFIG)
    # the interpreter runs one program after another: one program does the whole queue there
    p = plan(cfg, dict(batch_size=batch, num_video_tokens=nv, num_text_tokens=nt), host.sms,
             programs=None if host.gpu else 1, needs=needs, deterministic=deterministic)
    f16, f32 = host.f16, host.f32
    ranges = ranges or RangeSlots()
    offset = p.regions.reserve(ranges)
    ranges.allocate(host.device)
    grad_video, grad_text = f32(batch, nv, HIDDEN), f32(batch, nt, HIDDEN)
    args = dict(
        table=buffers.queue_table(p.queue, host.device), counters=buffers.zeroed_counters(host.device, p.queue.slots),
        ranges=ranges.block(offset), profile=ranges.block(offset) if profile is None else profile,
        n_slots=p.queue.slots,
        go=go, video=video, text=text, wq=wq, bq=bq, wk=wk, bk=bk, wv=wv, bv=bv, wo=wo,
        # the forward products' operands, stacked so that one TMA descriptor each covers them
        act16=f16(2 * tv + tt, HIDDEN), w16=f16(4 * HIDDEN, HIDDEN),
        q16=f16(tv, HIDDEN), kv16=f16(tt, 2 * HIDDEN), dc16=f16(tv, HIDDEN), ctx16=f16(tv, HIDDEN),
        dq16=f16(tv, HIDDEN), dkv16=f16(tt, 2 * HIDDEN), dkv32=f32(p.kv_partial_rows, 2 * HIDDEN),
        colsum_parts=f32(p.grad_output_tiles, HIDDEN), bias_parts=f32(p.bias_rows, 3 * HIDDEN),
        grad_video=grad_video, grad_text=grad_text, grad_wq=f32(HIDDEN, HIDDEN), grad_wo=f32(HIDDEN, HIDDEN),
        grad_wk=f32(HIDDEN, HIDDEN), grad_wv=f32(HIDDEN, HIDDEN), grad_bq=f32(HIDDEN), grad_bk=f32(HIDDEN),
        grad_bv=f32(HIDDEN), grad_bo=f32(HIDDEN),
        TV=tv, TT=tt, NV=nv, NT=nt, runs=p.runs, go_tiles=p.grad_output_tiles, bias_rows=p.bias_rows, scale=float(scale))
    pk, fw, at, gr, sums = cfg.pack, p.forward, cfg.attention, cfg.gradients, cfg.sums
    with buffers.on_device(host.device):
        KERNEL.prepare_named(
            (p.queue.programs,), args,
            ROWS=pk.rows, COLS=pk.cols, T=pk.tile, BLOCK=pk.block, ITERS=pk.iters,
            FBM=fw.bm, FBN=fw.bn, FBK=fw.bk, FSTAGES=fw.stages,
            BM=at.bm, BN=p.text_tile, BN_TAIL=p.text_tail, ONE_TILE=p.one_tile, ALONE=p.runs == 1,
            DETERMINISTIC=deterministic,
            GBM=gr.bm, GBN=gr.bn, GBK=gr.bk, GSTAGES=gr.stages, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, GPU=host.gpu,
            PROFILE=profile is not None, num_warps=cfg.warps, num_stages=at.stages)()
    a = args
    return (grad_video, grad_text, a["grad_wq"], a["grad_bq"], a["grad_wk"], a["grad_bk"], a["grad_wv"], a["grad_bv"],
            a["grad_wo"], a["grad_bo"])
