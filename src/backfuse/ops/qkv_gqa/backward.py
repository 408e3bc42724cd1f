"""072's fused backward: one pack launch to fp16 operands, then the four products (our tiles in one
launch, or cuBLAS); or, on Hopper, one Gluon launch doing both; as `config.plan` lays them out."""

from __future__ import annotations

from ...kernels import buffers
from ...kernels.gluon.host import fp16_descriptor
from ...kernels.launch import FastKernel
from ...kernels.schedule import flat
from ..prelude import begin, cublas_products, fits_int32
from . import gluon_kernels
from .config import CONFIG, INTERPRETER_CONFIG, plan
from .spec import CROSS_HIDDEN, HIDDEN, KV_OUT, PROBLEM, Q_OUT
from .triton_kernels import pack_kernel, projection_grads_kernel

PACK = FastKernel(pack_kernel)
PRODUCTS = FastKernel(projection_grads_kernel)
ONE_LAUNCH = FastKernel(gluon_kernels.fused_kernel, waits_on_peers=True)


def backward(gq, gk, gv, dec, enc, wq, wk, wv, *, needs=None, deterministic=False, ranges=None, config=None,
             products=None, sms=None):
    """The 072 outputs from the official inputs (validated by the caller).

    needs: one bool per output (None: all); the products of outputs not needed are skipped (with
    our products: grad_dec and grad_enc together, and the three weight gradients together).
    deterministic: the same outputs bit for bit on every call (our products without K splits; cuBLAS
    products are reproducible on one GPU model as they are). ranges: a RangeSlots that receives the
    largest |value| of every tensor converted to fp16 (only inputs and their head-group sums here).

    products: "triton" (our tiles), "cublas" (four torch.mm on our fp16 operands) or "gluon" (one
    Hopper launch, pack included; its grad_Wk and grad_Wv are two tensors); None picks by size on a
    GPU. config: a `config.Config` (None: CONFIG on a GPU, INTERPRETER_CONFIG on the CPU);
    sms: processors to balance the K splits over (the GPU's count; on the CPU interpreter, 1).
    """
    inputs = (gq, gk, gv, dec, enc, wq, wk, wv)
    if not fits_int32(gq.numel(), gk.numel()):
        return PROBLEM.fp32_backward(*inputs)
    batch, _, sd, _ = gq.shape
    se = gk.shape[2]
    td, te = batch * sd, batch * se
    call = begin(gq.device, sms, config, (CONFIG, INTERPRETER_CONFIG), ranges,
                 lambda cfg, host: plan(cfg, dict(batch_size=batch, seq_len_dec=sd, seq_len_enc=se), host.sms,
                                        gpu=host.gpu, gluon=host.gluon, products=products, needs=needs,
                                        deterministic=deterministic))
    host, cfg, p = call.host, call.cfg, call.plan
    if p.products == "gluon":
        return _one_launch(inputs, call)
    f16, f32 = host.f16, host.f32
    gq16, gkv16, dec16, enc16 = f16(td, Q_OUT), f16(te, 2 * KV_OUT), f16(td, HIDDEN), f16(te, CROSS_HIDDEN)
    wq16, wkv16 = f16(Q_OUT, HIDDEN), f16(2 * KV_OUT, CROSS_HIDDEN)
    grad_dec, grad_enc = f32(batch, sd, HIDDEN), f32(batch, se, CROSS_HIDDEN)
    # grad_Wk and grad_Wv are the row blocks of one tensor, which one product writes.
    grad_wq, grad_wkv = f32(Q_OUT, HIDDEN), f32(2 * KV_OUT, CROSS_HIDDEN)
    grad_wk, grad_wv = grad_wkv[:KV_OUT], grad_wkv[KV_OUT:]

    if p.products == "cublas":  # operand views made before the first launch, so they add no gaps
        cublas = [(gq16, wq16, grad_dec.view(td, HIDDEN)), (gkv16, wkv16, grad_enc.view(te, CROSS_HIDDEN)),
                  (gq16.T, dec16, grad_wq), (gkv16.T, enc16, grad_wkv)]
    t, pk = cfg.tiles, cfg.pack
    with buffers.on_device(host.device):
        # Every Triton launch prepared before the first runs: no host work between them.
        pack_launch = PACK.prepare(
            (p.pack.programs,),
            gq, gk, gv, dec, enc, wq, wk, wv,
            gq16, gkv16, dec16, enc16, wq16, wkv16, call.ranges_of(0),
            grad_dec, grad_enc, grad_wq, grad_wkv,
            batch, sd, se, *p.pack.ends[:-1],
            ROWS=pk.rows, BLOCK=pk.block, ITERS=pk.iters, PDL=p.pdl, num_warps=pk.warps)
        product_launches = [] if p.tiles is None else [
            PRODUCTS.prepare(
                (p.tiles.programs,),
                gq16, gkv16, dec16, enc16, wq16, wkv16,
                grad_dec, grad_enc, grad_wq, grad_wkv,
                td, te, *p.splits, *flat(p.tiles.bounds),
                WEIGHT_GRADS=p.tiles.weight_grads, INPUT_GRADS=p.tiles.input_grads,
                BM=t.bm, BN=t.bn, BK=t.bk, PDL=p.pdl, num_warps=t.warps, num_stages=t.stages, launch_pdl=p.pdl)]
        pack_launch()
        if p.products == "cublas":
            cublas_products((*product, needed) for product, needed in zip(cublas, p.cublas))
        for launch in product_launches:
            launch()
    return grad_dec, grad_enc, grad_wq, grad_wk, grad_wv


def _one_launch(inputs, call):
    """The Gluon path: one launch packs the fp16 operands and runs the four products on every SM
    (its range regions are the plan's one launch's: `p.ranges == (p.gluon.regions,)`)."""
    p, g, host = call.plan, call.cfg.gluon, call.host
    gq, gk, gv, dec, enc, wq, wk, wv = inputs
    batch, _, sd, _ = gq.shape
    se = gk.shape[2]
    td, te = batch * sd, batch * se
    f16, f32 = host.f16, host.f32
    gq16, gkv16, dec16, enc16 = f16(td, Q_OUT), f16(te, 2 * KV_OUT), f16(td, HIDDEN), f16(te, CROSS_HIDDEN)
    wq16, wkv16 = f16(Q_OUT, HIDDEN), f16(2 * KV_OUT, CROSS_HIDDEN)
    grad_dec, grad_enc = f32(batch, sd, HIDDEN), f32(batch, se, CROSS_HIDDEN)
    grad_wq, grad_wk, grad_wv = f32(Q_OUT, HIDDEN), f32(KV_OUT, CROSS_HIDDEN), f32(KV_OUT, CROSS_HIDDEN)
    operands = dict(gq16=gq16, gkv16=gkv16, dec16=dec16, enc16=enc16, wq16=wq16, wkv16=wkv16)
    descriptors = [fp16_descriptor(operands[buffer], block)
                   for _, buffer, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)]
    c = p.gluon.counters
    counters = buffers.zeroed_counters(host.device, c.total)
    with buffers.on_device(host.device):
        launch = ONE_LAUNCH.prepare(
            (host.sms,),
            *descriptors, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
            grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, counters, call.ranges_of(0),
            td, te, sd, se, p.gluon.dec_chunks, p.gluon.enc_chunks, *p.splits, *p.gluon.starts, p.gluon.tiles,
            c.gq, c.dec, c.gkv, c.enc, c.total, *p.gluon.regions.bases,
            STAGES=g.stages, PACK_WARPS=g.pack_warps, REGS=g.regs, num_warps=4, maxnreg=g.maxnreg)
        launch()
    return grad_dec, grad_enc, grad_wq, grad_wk, grad_wv
