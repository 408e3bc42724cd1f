"""021's fused backward: four Triton launches (`triton_kernels.py`, `triton_attention.py`), the
gradient products by cuBLAS from `cublas_min_flop` on, as `config.plan` lays them out (with
`Plan.branches`, concurrently), beside the launch that then only sums the biases (kernels/branches.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from ...kernels.branches import concurrent
from ...kernels.launch import FastKernel, constexprs_of
from ..fused import FusedPath, cublas_products
from .config import CONFIG, INTERPRETER_CONFIG, plan, size_constexprs
from .spec import PROBLEM, WanXattnConfig
from .triton_attention import attention_kernel
from .triton_kernels import forward_products_kernel, gradient_products_kernel, pack_kernel

PACK = FastKernel(pack_kernel)
FORWARD_PRODUCTS = FastKernel(forward_products_kernel)
ATTENTION = FastKernel(attention_kernel)
GRADIENT_PRODUCTS = FastKernel(gradient_products_kernel)


@functools.cache
def kernel_sizes(sizes: WanXattnConfig) -> dict:
    """Each kernel's constexprs of the operator's sizes (`config.size_constexprs`: those it takes), by
    kernel, worked out once per sizes (a call then only looks them up)."""
    shared = size_constexprs(sizes)
    return {kernel: constexprs_of(kernel.fn, shared) for kernel in (PACK, FORWARD_PRODUCTS, ATTENTION, GRADIENT_PRODUCTS)}


class WanXattn(FusedPath):
    """Inputs (go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale); the output bias is unused.
    products: "triton" (our tiles, launch 4) or "cublas" (five torch.mm on our fp16 operands;
    launch 4 then only sums the bias gradients). deterministic also stores the attention's partial
    dK/dV per run and adds them in order instead of by atomics; the bias gradients are column sums
    taken along the way, so they cost no product of their own."""

    problem = PROBLEM
    configs = (CONFIG, INTERPRETER_CONFIG)

    def indexed(self, inputs):
        go, video, text = inputs[:3]
        return go.numel(), 2 * text.numel()

    def plan(self, cfg, inputs, host, **options):
        batch, nv, _ = inputs[1].shape
        axes = dict(batch_size=batch, num_video_tokens=nv, num_text_tokens=inputs[2].shape[1])
        return plan(cfg, axes, host.sms, gpu=host.gpu, **options)

    def allocate(self, call, inputs):
        host, p = call.host, call.plan
        f16, f32 = host.f16, host.f32
        hidden = p.sizes.hidden
        batch, nv, _ = inputs[1].shape
        nt = inputs[2].shape[1]
        tv, tt = batch * nv, batch * nt
        b = SimpleNamespace(tv=tv, tt=tt)
        # The forward products' operands, stacked so that one TMA descriptor each covers them.
        b.act16, b.w16 = f16(2 * tv + tt, hidden), f16(4 * hidden, hidden)
        b.video16, b.text16, b.go16 = b.act16[:tv], b.act16[tv:tv + tt], b.act16[tv + tt:]
        b.wq16, b.wkv16, b.wo_t16 = b.w16[:hidden], b.w16[hidden:3 * hidden], b.w16[3 * hidden:]
        b.ctx16, b.q16, b.dc16, b.dq16 = (f16(tv, hidden) for _ in range(4))
        b.kv16, b.dkv16 = f16(tt, 2 * hidden), f16(tt, 2 * hidden)
        b.colsum_parts = f32(p.pack.size("grad_output"), hidden)  # one row of column sums per grad_output tile
        b.dkv32 = f32(p.kv_partial_rows, 2 * hidden)  # unused by lone runs
        b.counters = host.i32(p.counters.total)
        b.bias_parts = f32(p.bias_rows, 3 * hidden)
        b.grad_video, b.grad_text = f32(batch, nv, hidden), f32(batch, nt, hidden)
        # grad_Wk and grad_Wv are the row blocks of one tensor, which one cuBLAS product writes.
        b.grad_wq, b.grad_wo, b.grad_wkv = f32(hidden, hidden), f32(hidden, hidden), f32(2 * hidden, hidden)
        b.grad_wk, b.grad_wv = b.grad_wkv[:hidden], b.grad_wkv[hidden:]
        b.grad_bq, b.grad_bk, b.grad_bv, b.grad_bo = (f32(hidden) for _ in range(4))
        return b

    def launches(self, call, inputs, b):
        go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale = inputs
        x = SimpleNamespace(go=go, video=video, text=text, wq=wq, bq=bq, wk=wk, bk=bk, wv=wv, bv=bv, wo=wo)
        cfg, p = call.cfg, call.plan
        tv, tt = p.tv, p.tt
        pk, fw, at, gr, sums, pdl = cfg.pack, p.forward, cfg.attention, cfg.gradients, cfg.sums, p.pdl
        sizes = kernel_sizes(p.sizes)
        # Every runtime argument by the kernel's parameter name: the plan's scalars, the range slots,
        # the official inputs (x) and the call's buffers (b); the operator's sizes as constexprs.
        launches = [
            PACK.prepare_named(
                (p.pack.programs,), p.pack_arguments(), dict(ranges=call.ranges_of(0)), x, b, **sizes[PACK],
                ROWS=pk.rows, COLS=pk.cols, T=pk.tile, BLOCK=pk.block, ITERS=pk.iters, PDL=pdl, num_warps=pk.warps),
            FORWARD_PRODUCTS.prepare_named(
                (p.forward_grid,), p.forward_arguments(), dict(ranges=call.ranges_of(1)), x, b, **sizes[FORWARD_PRODUCTS],
                BM=fw.bm, BN=fw.bn, BK=fw.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl, num_warps=fw.warps,
                num_stages=fw.stages, launch_pdl=pdl),
            ATTENTION.prepare_named(
                (p.attention_programs,), p.attention_arguments(scale), dict(ranges=call.ranges_of(2)), b, **sizes[ATTENTION],
                BM=p.block_rows, BN=p.text_tile, BN_TAIL=p.text_tail, ONE_TILE=p.one_tile, FINISH=p.finish_rows,
                ALONE=p.runs == 1, DETERMINISTIC=p.deterministic, PDL=pdl, num_warps=p.block_warps,
                num_stages=at.stages, launch_pdl=pdl),
            GRADIENT_PRODUCTS.prepare_named(
                (p.gradient_programs,), p.gradient_arguments(), b, **sizes[GRADIENT_PRODUCTS],
                BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl, num_warps=gr.warps,
                num_stages=gr.stages, launch_pdl=pdl),
        ]
        if p.products == "cublas":
            products = cublas_products([
                (b.dq16, b.wq16, b.grad_video.view(tv, p.sizes.hidden), p.wanted[0]),
                (b.dkv16, b.wkv16, b.grad_text.view(tt, p.sizes.hidden), p.wanted[1]),
                (b.dq16.T, b.video16, b.grad_wq, p.wanted[2]), (b.go16.T, b.ctx16, b.grad_wo, p.wanted[2]),
                (b.dkv16.T, b.text16, b.grad_wkv, p.wanted[2])], concurrently=p.branches)
            # The gradient launch then only sums the biases, beside the products (they do not read the sums).
            launches[-1:] = [concurrent([products], [launches[-1]])]
        return launches

    def outputs(self, b):
        return (b.grad_video, b.grad_text, b.grad_wq, b.grad_bq, b.grad_wk, b.grad_bk, b.grad_wv, b.grad_bv,
                b.grad_wo, b.grad_bo)


backward = WanXattn().backward
