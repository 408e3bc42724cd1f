"""037's fused backward: five Triton launches (`triton_kernels.py`), and from `cublas_min_flop` on five
cuBLAS products around them (two forward, three gradient), as `config.plan` lays them out."""

from __future__ import annotations

import contextlib

import torch

from ...kernels import buffers
from ...kernels.launch import FastKernel
from ...kernels.schedule import flat
from ..prelude import begin, cublas_products, fits_int32
from .config import CONFIG, INTERPRETER_CONFIG, plan
from .spec import HEAD_DIM, HEADS, HIDDEN, KV_OUT, PROBLEM, Q_OUT, QK, QKV
from .triton_kernels import (
    attention_backward_kernel,
    attention_forward_kernel,
    forward_products_kernel,
    gradient_products_kernel,
    pack_kernel,
)

PACK = FastKernel(pack_kernel)
FORWARD_PRODUCTS = FastKernel(forward_products_kernel)
ATTENTION_FORWARD = FastKernel(attention_forward_kernel)
ATTENTION_BACKWARD = FastKernel(attention_backward_kernel)
GRADIENT_PRODUCTS = FastKernel(gradient_products_kernel)


@contextlib.contextmanager
def fp32_sums_in_fp16_products():
    """cuBLAS products with fp16 output keep fp32 sums throughout (no fp16 split-K reductions)."""
    matmul = torch.backends.cuda.matmul
    saved, matmul.allow_fp16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction, False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction = saved


def backward(go, x, cos, sin, wq, wk, wv, wo, q_norm_w, k_norm_w, scaling, cap, eps, *, needs=None,
             deterministic=False, ranges=None, config=None, products=None, sms=None):
    """The 037 outputs from the official inputs (validated by the caller).

    needs: one bool per output (None: all); grad_hidden's product, the three projection weights'
    products and grad_Wo's product are skipped when nobody needs them.
    deterministic: the same outputs bit for bit on every call (no K splits; nothing else uses
    atomics; cuBLAS products are reproducible on one GPU model as they are). ranges: a RangeSlots that
    receives the largest |value| of every tensor rounded to fp16. config: a `config.Config` (None:
    CONFIG on a GPU, INTERPRETER_CONFIG on the CPU). products: the projection products as our tiles
    ("triton") or as torch.mm on our fp16 operands ("cublas": our forward products launch then only
    norms and rotates); None picks by size on a GPU. sms: processors to balance the products' K
    splits over (the GPU's count; on the CPU, 1).
    """
    inputs = (go, x, cos, sin, wq, wk, wv, wo, q_norm_w, k_norm_w, scaling, cap, eps)
    batch, seq, _ = x.shape
    tokens = batch * seq
    if not fits_int32(tokens * QKV):
        return PROBLEM.fp32_backward(*inputs)
    call = begin(x.device, sms, config, (CONFIG, INTERPRETER_CONFIG), ranges,
                 lambda cfg, host: plan(cfg, dict(batch_size=batch, seq_len=seq), host.sms, gpu=host.gpu,
                                        products=products, needs=needs, deterministic=deterministic))
    host, cfg, p = call.host, call.cfg, call.plan
    f16, f32 = host.f16, host.f32
    go16, x16, d_attn16, attn16 = (f16(tokens, HIDDEN) for _ in range(4))
    qk32, v16, rot16, g16 = f32(tokens, p.qk_width), f16(tokens, KV_OUT), f16(tokens, QK), f16(tokens, QKV)
    wqkv16, wo_t16 = f16(QKV, HIDDEN), f16(HIDDEN, Q_OUT)
    lse, delta = f32(batch * HEADS * seq), f32(batch * HEADS * seq)
    q_norm_parts, k_norm_parts = f32(p.q_programs, HEAD_DIM), f32(p.kv_slots, HEAD_DIM)
    # the split programs' fp32 dK, dV partials (a placeholder when unsplit); the attention backward's counters
    kv_parts = f32(p.head_split * tokens if p.head_split > 1 else 1, 2 * KV_OUT)
    counters = host.i32(p.counters)
    grad_x = f32(batch, seq, HIDDEN)
    # grad_Wq, grad_Wk, grad_Wv are row blocks of one tensor, which one product writes.
    grad_wqkv, grad_wo = f32(QKV, HIDDEN), f32(HIDDEN, Q_OUT)
    grad_wq, grad_wk, grad_wv = grad_wqkv[:Q_OUT], grad_wqkv[Q_OUT:QK], grad_wqkv[QK:]
    grad_q_norm_w, grad_k_norm_w = f32(HEAD_DIM), f32(HEAD_DIM)

    # cap tanh(z / cap) depends on |cap| only; the kernels take cap > 0.
    cap = abs(float(cap))
    # cuBLAS products: operand views made before the first launch, so they add no gaps. The forward
    # ones write [q | k | v] in fp32 (launch 2 copies v to fp16) and dA in fp16 (its fp32 sums
    # rounded once, as our tiles do).
    cublas_forward = [(x16, wqkv16.T, qk32), (go16, wo_t16.T, d_attn16)]
    cublas_gradients = [(g16, wqkv16, grad_x.view(tokens, HIDDEN)), (g16.T, x16, grad_wqkv), (go16.T, attn16, grad_wo)]
    pk, fw, at, gr, sums, pdl = cfg.pack, p.forward, cfg.attention, cfg.gradients, cfg.sums, p.pdl

    with buffers.on_device(host.device):
        pack = PACK.prepare(
            (p.pack.programs,),
            go, x, wq, wk, wv, wo,
            go16, x16, wqkv16, wo_t16, call.ranges_of(0), grad_x, grad_wqkv, grad_wo, counters,
            tokens, p.counters, *p.pack.ends[:-1],
            TILE=pk.tile, BLOCK=pk.block, ITERS=pk.iters, PDL=pdl, num_warps=pk.warps)
        launches = [
            FORWARD_PRODUCTS.prepare(
                (p.forward_programs,),
                x16, go16, wqkv16, wo_t16, cos, sin, q_norm_w, k_norm_w,
                qk32, v16, rot16, d_attn16, call.ranges_of(1),
                tokens, p.forward_bounds[0][1], float(eps), float(scaling) / cap,
                BM=fw.bm, BK=fw.bk, PRODUCTS=p.products == "triton", QK_WIDTH=p.qk_width, PDL=pdl, num_warps=fw.warps,
                num_stages=fw.stages, launch_pdl=pdl),
            ATTENTION_FORWARD.prepare(
                (p.attention_forward_programs,),
                rot16, v16, d_attn16, attn16, lse, delta, call.ranges_of(2),
                seq, cap,
                BM=at.fwd_bm, BN=p.attention_forward_keys, APPROX_TANH=at.approx_tanh, PDL=pdl,
                num_warps=at.fwd_warps, num_stages=at.fwd_stages, launch_pdl=pdl),
            ATTENTION_BACKWARD.prepare(
                (p.attention_backward_programs,),
                rot16, qk32, v16, d_attn16, lse, delta, cos, sin, q_norm_w, k_norm_w,
                g16, q_norm_parts, k_norm_parts, call.ranges_of(3), kv_parts, counters,
                seq, p.kv_programs, p.done, *p.ranges[3].bases, float(scaling), cap, float(eps),
                KV_BN=p.kv_bn, KV_BM=at.kv_bm, Q_BM=at.q_bm, Q_BN=at.q_bn, HEAD_SPLIT=p.head_split,
                QK_WIDTH=p.qk_width, APPROX_TANH=at.approx_tanh, PDL=pdl, num_warps=at.warps, num_stages=at.stages,
                launch_pdl=pdl),
            GRADIENT_PRODUCTS.prepare(
                (p.gradient_programs,),
                g16, wqkv16, x16, go16, attn16, q_norm_parts, k_norm_parts, counters,
                grad_x, grad_wqkv, grad_wo, grad_q_norm_w, grad_k_norm_w,
                tokens, *p.splits, *flat(p.gradient_bounds), p.sums_start, p.done, p.kv_programs + p.q_programs,
                p.q_programs, p.kv_slots,
                BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl, num_warps=gr.warps,
                num_stages=gr.stages, launch_pdl=pdl),
        ]
        pack()
        if p.products == "cublas":
            with fp32_sums_in_fp16_products():
                for a, b, out in cublas_forward:
                    if out.dtype == torch.float32:
                        torch.mm(a, b, out_dtype=torch.float32, out=out)
                    else:
                        torch.mm(a, b, out=out)
        for launch in launches:
            launch()
        if p.products == "cublas":
            cublas_products((*product, needed) for product, needed in zip(cublas_gradients, p.wanted))
    return grad_x, grad_wq, grad_wk, grad_wv, grad_wo, grad_q_norm_w, grad_k_norm_w
