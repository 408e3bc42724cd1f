"""021's fused backward: four Triton launches (`triton_kernels.py`, `triton_attention.py`), the
gradient products by cuBLAS from `cublas_min_flop` on, as `config.plan` lays them out."""

from __future__ import annotations

from ...kernels import buffers
from ...kernels.launch import FastKernel
from ...kernels.schedule import flat
from ..prelude import begin, cublas_products, fits_int32
from .config import CONFIG, FORWARD_REGIONS, INTERPRETER_CONFIG, plan
from .spec import HIDDEN, PROBLEM
from .triton_attention import attention_kernel
from .triton_kernels import forward_products_kernel, gradient_products_kernel, pack_kernel

PACK = FastKernel(pack_kernel)
FORWARD_PRODUCTS = FastKernel(forward_products_kernel)
ATTENTION = FastKernel(attention_kernel)
GRADIENT_PRODUCTS = FastKernel(gradient_products_kernel)


def backward(go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale, *, needs=None, deterministic=False, ranges=None,
             config=None, products=None, sms=None):
    """The 021 outputs from the official inputs (validated by the caller; the output bias is unused).

    needs: one bool per output (None: all); without input gradients (grad_video, grad_text) or
    without weight gradients (the four grad_W) their products are skipped; the bias gradients are
    column sums taken along the way.

    deterministic: the same outputs bit for bit on every call (no K splits; the attention's partial
    dK/dV are stored per run and added in order instead of by atomics). ranges: a RangeSlots that
    receives the largest |value| of every tensor rounded to fp16. config: a `config.Config` (None:
    CONFIG on a GPU, INTERPRETER_CONFIG on the CPU); sms: processors to balance the products' K
    splits and the attention's runs over (the GPU's count; on the CPU interpreter, 1).
    products: the gradient products by "triton" (our tiles, launch 4) or "cublas" (five torch.mm on
    our fp16 operands; launch 4 then only sums the bias gradients); None picks by size on a GPU.
    """
    inputs = (go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale)
    if not fits_int32(go.numel(), 2 * text.numel()):
        return PROBLEM.fp32_backward(*inputs)
    batch, nv, _ = video.shape
    nt = text.shape[1]
    tv, tt = batch * nv, batch * nt
    axes = dict(batch_size=batch, num_video_tokens=nv, num_text_tokens=nt)
    call = begin(video.device, sms, config, (CONFIG, INTERPRETER_CONFIG), ranges,
                 lambda cfg, host: plan(cfg, axes, host.sms, gpu=host.gpu, products=products, needs=needs,
                                        deterministic=deterministic))
    host, cfg, p = call.host, call.cfg, call.plan
    f16, f32 = host.f16, host.f32
    # The forward products' operands, stacked so that one TMA descriptor each covers them.
    act16, w16 = f16(2 * tv + tt, HIDDEN), f16(4 * HIDDEN, HIDDEN)
    video16, text16, go16 = act16[:tv], act16[tv:tv + tt], act16[tv + tt:]
    wq16, wkv16, wo_t16 = w16[:HIDDEN], w16[HIDDEN:3 * HIDDEN], w16[3 * HIDDEN:]
    ctx16, q16, dc16, dq16 = (f16(tv, HIDDEN) for _ in range(4))
    kv16, dkv16 = f16(tt, 2 * HIDDEN), f16(tt, 2 * HIDDEN)
    go_tiles = p.pack.size("grad_output")  # one row of column sums each
    colsum_parts = f32(go_tiles, HIDDEN)
    dkv32 = f32(p.kv_partial_rows, 2 * HIDDEN)  # unused by lone runs
    counters = host.i32(p.counters.total)
    bias_parts = f32(batch * p.runs, 3 * HIDDEN)
    grad_video, grad_text = f32(batch, nv, HIDDEN), f32(batch, nt, HIDDEN)
    # grad_Wk and grad_Wv are the row blocks of one tensor, which one cuBLAS product writes.
    grad_wq, grad_wo, grad_wkv = f32(HIDDEN, HIDDEN), f32(HIDDEN, HIDDEN), f32(2 * HIDDEN, HIDDEN)
    grad_wk, grad_wv = grad_wkv[:HIDDEN], grad_wkv[HIDDEN:]
    grad_bq, grad_bk, grad_bv, grad_bo = (f32(HIDDEN) for _ in range(4))

    pk, fw, at, gr, sums, pdl = cfg.pack, p.forward, cfg.attention, cfg.gradients, cfg.sums, p.pdl
    with buffers.on_device(host.device):
        launches = [
            PACK.prepare(
                (p.pack.programs,),
                go, video, text, wq, wk, wv, wo,
                go16, video16, text16, wq16, wkv16, wo_t16, colsum_parts, call.ranges_of(0),
                dkv32, counters, grad_wq, grad_wo, grad_wk, grad_wv, grad_video, grad_text,
                tv, tt, p.counters.total, *p.pack.ends[:-1],
                ROWS=pk.rows, COLS=pk.cols, T=pk.tile, BLOCK=pk.block, ITERS=pk.iters, PDL=pdl, num_warps=pk.warps),
            FORWARD_PRODUCTS.prepare(
                (p.forward_programs + HIDDEN // sums.cols,),
                act16, w16, bq, bk, bv,
                q16, kv16, dc16, colsum_parts, grad_bo, call.ranges_of(1),
                tv, tt, go_tiles, p.forward_programs, *(end for _, end in p.forward_bounds),
                *(p.ranges[1].base(name) for name in FORWARD_REGIONS),
                BM=fw.bm, BN=fw.bn, BK=fw.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl, num_warps=fw.warps,
                num_stages=fw.stages, launch_pdl=pdl),
            ATTENTION.prepare(
                (p.attention_programs,),
                q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, counters, call.ranges_of(2),
                nv, nt, tt, p.per_program, *p.ranges[2].bases, p.counters.done, p.counters.kv_done, float(scale),
                BM=p.block_rows, BN=p.text_tile, BN_TAIL=p.text_tail, ONE_TILE=p.one_tile, FINISH=p.finish_rows,
                ALONE=p.runs == 1,
                DETERMINISTIC=deterministic, PDL=pdl, num_warps=p.block_warps, num_stages=at.stages, launch_pdl=pdl),
            GRADIENT_PRODUCTS.prepare(
                (p.gradient_programs,),
                dq16, dkv16, go16, video16, text16, ctx16, wq16, wkv16, bias_parts, counters,
                grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv,
                tv, tt, p.splits[2], p.splits[4], p.splits[0], p.splits[1], *flat(p.bounds), p.sums_start,
                batch * p.runs, p.counters.done, p.counters.programs, p.counters.kv_done, p.counters.heads,
                BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl, num_warps=gr.warps,
                num_stages=gr.stages, launch_pdl=pdl),
        ]
        for launch in launches:
            launch()
        if p.products == "cublas":
            cublas_products([(dq16, wq16, grad_video.view(tv, HIDDEN), p.wanted[0]),
                             (dkv16, wkv16, grad_text.view(tt, HIDDEN), p.wanted[1]),
                             (dq16.T, video16, grad_wq, p.wanted[2]), (go16.T, ctx16, grad_wo, p.wanted[2]),
                             (dkv16.T, text16, grad_wkv, p.wanted[2])])
    return grad_video, grad_text, grad_wq, grad_bq, grad_wk, grad_bk, grad_wv, grad_bv, grad_wo, grad_bo
