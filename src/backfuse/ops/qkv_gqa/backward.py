"""072's fused backward: one pack launch to fp16 operands, then the four products (our tiles in one
launch, or cuBLAS); or, on Hopper, one Gluon launch doing both; as `config.plan` lays them out."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from ...kernels import buffers
from ...kernels.gluon.host import fp16_descriptor
from ...kernels.launch import FastKernel, constexprs_of
from ..fused import FusedPath, cublas_products
from . import gluon_kernels
from .config import CONFIG, INTERPRETER_CONFIG, plan, size_constexprs
from .spec import PROBLEM, QkvGqaConfig
from .triton_kernels import pack_kernel, projection_grads_kernel

PACK = FastKernel(pack_kernel)
PRODUCTS = FastKernel(projection_grads_kernel)
ONE_LAUNCH = FastKernel(gluon_kernels.fused_kernel, waits_on_peers=True)


@functools.cache
def kernel_sizes(sizes: QkvGqaConfig) -> dict:
    """Each kernel's constexprs of the operator's sizes (`config.size_constexprs`: those it takes), by
    kernel, worked out once per sizes (a call then only looks them up)."""
    shared = size_constexprs(sizes)
    return {kernel: constexprs_of(kernel.fn, shared) for kernel in (PACK, PRODUCTS, ONE_LAUNCH)}


class QkvGqa(FusedPath):
    """Inputs (gq, gk, gv, dec, enc, wq, wk, wv). products: "triton" (our tiles), "cublas" (four
    torch.mm on our fp16 operands) or "gluon" (one Hopper launch, pack included). With our tiles the
    input gradients (grad_dec, grad_enc) and the weight gradients are skipped as groups, with
    cuBLAS per product. ranges receives the inputs' and their head-group sums' maxima only."""

    problem = PROBLEM
    configs = (CONFIG, INTERPRETER_CONFIG)

    def indexed(self, inputs):
        return inputs[0].numel(), inputs[1].numel()

    def plan(self, cfg, inputs, host, **options):
        batch, _, sd, _ = inputs[0].shape
        axes = dict(batch_size=batch, seq_len_dec=sd, seq_len_enc=inputs[1].shape[2])
        return plan(cfg, axes, host.sms, gpu=host.gpu, gluon=host.gluon, **options)

    def allocate(self, call, inputs):
        host, p = call.host, call.plan
        f16, f32 = host.f16, host.f32
        hidden, cross, q_out, kv_out = p.sizes.hidden, p.sizes.cross_hidden, p.sizes.q_out, p.sizes.kv_out
        batch, _, sd, _ = inputs[0].shape
        se = inputs[1].shape[2]
        td, te = batch * sd, batch * se
        b = SimpleNamespace(td=td, te=te)
        b.gq16, b.gkv16, b.dec16, b.enc16 = f16(td, q_out), f16(te, 2 * kv_out), f16(td, hidden), f16(te, cross)
        b.wq16, b.wkv16 = f16(q_out, hidden), f16(2 * kv_out, cross)
        b.grad_dec, b.grad_enc = f32(batch, sd, hidden), f32(batch, se, cross)
        b.grad_wq = f32(q_out, hidden)
        if p.products == "gluon":  # grad_Wk and grad_Wv as two tensors; counters the kernel leaves zeroed
            b.grad_wk, b.grad_wv = f32(kv_out, cross), f32(kv_out, cross)
            b.counters = buffers.zeroed_counters(host.device, p.gluon.counters.total)
        else:  # grad_Wk and grad_Wv are the row blocks of one tensor, which one product writes
            b.grad_wkv = f32(2 * kv_out, cross)
            b.grad_wk, b.grad_wv = b.grad_wkv[:kv_out], b.grad_wkv[kv_out:]
        return b

    def launches(self, call, inputs, b):
        # Every runtime argument by the kernel's parameter name: the plan's scalars, the range slots,
        # the official inputs and the call's buffers (b); the operator's sizes as constexprs.
        given = SimpleNamespace(**dict(zip(("gq", "gk", "gv", "dec", "enc", "wq", "wk", "wv"), inputs, strict=True)))
        sizes = kernel_sizes(call.plan.sizes)
        if call.plan.products == "gluon":
            return [self._one_launch(call, given, b, sizes)]
        cfg, p = call.cfg, call.plan
        t, pk = cfg.tiles, cfg.pack
        launches = [PACK.prepare_named(
            (p.pack.programs,), p.pack_arguments(), dict(ranges=call.ranges_of(0)), given, b, **sizes[PACK],
            ROWS=pk.rows, BLOCK=pk.block, ITERS=pk.iters, PDL=p.pdl, num_warps=pk.warps)]
        if p.products == "cublas":
            launches.append(cublas_products([(*product, needed) for product, needed in zip(
                [(b.gq16, b.wq16, b.grad_dec.view(b.td, p.sizes.hidden)),
                 (b.gkv16, b.wkv16, b.grad_enc.view(b.te, p.sizes.cross_hidden)),
                 (b.gq16.T, b.dec16, b.grad_wq), (b.gkv16.T, b.enc16, b.grad_wkv)], p.cublas)],
                concurrently=p.branches))
        elif p.tiles is not None:
            launches.append(PRODUCTS.prepare_named(
                (p.tiles.programs,), p.product_arguments(), b, **sizes[PRODUCTS],
                WEIGHT_GRADS=p.tiles.weight_grads, INPUT_GRADS=p.tiles.input_grads,
                BM=t.bm, BN=t.bn, BK=t.bk, PDL=p.pdl, num_warps=t.warps, num_stages=t.stages, launch_pdl=p.pdl))
        return launches

    @staticmethod
    def _one_launch(call, given, b, sizes):
        """The Gluon path: one launch packs the fp16 operands and runs the four products on every SM
        (its range regions are the plan's one launch's: `p.ranges == (p.gluon.regions,)`)."""
        p, g, host = call.plan, call.cfg.gluon, call.host
        descriptors = {argument: fp16_descriptor(getattr(b, buffer), block)
                       for argument, buffer, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)}
        return ONE_LAUNCH.prepare_named(
            (host.sms,), descriptors, p.gluon_arguments(), dict(slots=b.counters, ranges=call.ranges_of(0)), given, b,
            **sizes[ONE_LAUNCH], STAGES=g.stages, PACK_WARPS=g.pack_warps, REGS=g.regs, num_warps=4, maxnreg=g.maxnreg)

    def outputs(self, b):
        return b.grad_dec, b.grad_enc, b.grad_wq, b.grad_wk, b.grad_wv


backward = QkvGqa().backward
