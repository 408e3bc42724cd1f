"""037's fused backward: five Triton launches (`triton_kernels.py`), and from `cublas_min_flop` on five
cuBLAS products around them (two forward, three gradient), as `config.plan` lays them out; with
`Plan.branches` the independent ones run concurrently (kernels/branches.py)."""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

from ...kernels.branches import concurrent
from ...kernels.launch import FastKernel, constexprs_of
from ..fused import FusedPath, cublas_product
from .config import CONFIG, INTERPRETER_CONFIG, plan, size_constexprs
from .spec import PROBLEM, Gemma3CoreConfig
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


@functools.cache
def kernel_sizes(sizes: Gemma3CoreConfig) -> dict:
    """Each kernel's constexprs of the operator's sizes (`config.size_constexprs`: those it takes), by
    kernel, worked out once per sizes (a call then only looks them up)."""
    shared = size_constexprs(sizes)
    return {kernel: constexprs_of(kernel.fn, shared)
            for kernel in (PACK, FORWARD_PRODUCTS, ATTENTION_FORWARD, ATTENTION_BACKWARD, GRADIENT_PRODUCTS)}


@contextlib.contextmanager
def fp32_sums_in_fp16_products():
    """cuBLAS products with fp16 output keep fp32 sums throughout (no fp16 split-K reductions)."""
    matmul = torch.backends.cuda.matmul
    saved, matmul.allow_fp16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction, False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction = saved


def cublas_forward_product(a, b, out):
    """A launch step: out = a @ b by cuBLAS with fp32 sums, in out's dtype."""
    if out.dtype == torch.float32:
        return cublas_product(a, b, out)

    def run():
        with fp32_sums_in_fp16_products():
            torch.mm(a, b, out=out)
    return run


class Gemma3Core(FusedPath):
    """Inputs (go, x, cos, sin, wq, wk, wv, wo, q_norm_w, k_norm_w, scaling, cap, eps).
    products: the projection products as our tiles ("triton") or as torch.mm on our fp16 operands
    ("cublas": our forward products launch then only norms and rotates). Nothing but K splits uses
    atomics, so deterministic means no K splits."""

    problem = PROBLEM
    configs = (CONFIG, INTERPRETER_CONFIG)

    def indexed(self, inputs):
        batch, seq, _ = inputs[1].shape
        qkv = sum(w.shape[0] for w in inputs[4:7])  # G's width: [Wq; Wk; Wv]'s rows
        return (batch * seq * qkv,)

    def plan(self, cfg, inputs, host, **options):
        batch, seq, _ = inputs[1].shape
        return plan(cfg, dict(batch_size=batch, seq_len=seq), host.sms, gpu=host.gpu, **options)

    def allocate(self, call, inputs):
        host, p, c = call.host, call.plan, call.plan.sizes
        f16, f32 = host.f16, host.f32
        batch, seq, _ = inputs[1].shape
        tokens = batch * seq
        b = SimpleNamespace(tokens=tokens)
        b.go16, b.x16, b.d_attn16, b.attn16 = (f16(tokens, c.hidden) for _ in range(4))
        b.qk32, b.v16, b.rot16, b.g16 = f32(tokens, p.qk_width), f16(tokens, c.kv_out), f16(tokens, c.qk), f16(tokens, c.qkv)
        b.wqkv16, b.wo_t16 = f16(c.qkv, c.hidden), f16(c.hidden, c.q_out)
        b.lse, b.delta = f32(batch * c.heads * seq), f32(batch * c.heads * seq)
        b.q_norm_parts, b.k_norm_parts = f32(p.q_programs, c.head_dim), f32(p.kv_slots, c.head_dim)
        # the split programs' fp32 dK, dV partials (a placeholder when unsplit); the attention backward's counters
        b.kv_parts = f32(p.head_split * tokens if p.head_split > 1 else 1, 2 * c.kv_out)
        b.counters = host.i32(p.counters)
        b.grad_x = f32(batch, seq, c.hidden)
        # grad_Wq, grad_Wk, grad_Wv are row blocks of one tensor, which one product writes.
        b.grad_wqkv, b.grad_wo = f32(c.qkv, c.hidden), f32(c.hidden, c.q_out)
        b.grad_wq, b.grad_wk, b.grad_wv = b.grad_wqkv[:c.q_out], b.grad_wqkv[c.q_out:c.qk], b.grad_wqkv[c.qk:]
        b.grad_q_norm_w, b.grad_k_norm_w = f32(c.head_dim), f32(c.head_dim)
        return b

    def launches(self, call, inputs, b):
        go, x, cos, sin, wq, wk, wv, wo, q_norm_w, k_norm_w, scaling, cap, eps = inputs
        given = SimpleNamespace(go=go, x=x, cos=cos, sin=sin, wq=wq, wk=wk, wv=wv, wo=wo, q_norm_w=q_norm_w,
                                k_norm_w=k_norm_w)
        cfg, p = call.cfg, call.plan
        # cap tanh(z / cap) depends on |cap| only; the kernels take cap > 0.
        cap = abs(float(cap))
        pk, fw, at, gr, sums, pdl = cfg.pack, p.forward, cfg.attention, cfg.gradients, cfg.sums, p.pdl
        sizes = kernel_sizes(p.sizes)
        # Every runtime argument by the kernel's parameter name: the plan's scalars, the range slots,
        # the official inputs and the call's buffers (b); the operator's sizes as constexprs.
        packs = [PACK.prepare_named(
            (programs,), p.pack_arguments(), dict(first=first, ranges=call.ranges_of(0)), given, b, **sizes[PACK],
            TILE=pk.tile, BLOCK=pk.block, ITERS=pk.iters, PDL=pdl, num_warps=pk.warps) for first, programs in p.pack_parts]
        forward_launch, attention_forward, attention_backward, gradient_launch = (
            FORWARD_PRODUCTS.prepare_named(
                (p.forward_programs,), p.forward_arguments(scaling, cap, eps), dict(ranges=call.ranges_of(1)), given, b,
                **sizes[FORWARD_PRODUCTS],
                BM=fw.bm, BK=fw.bk, PRODUCTS=p.products == "triton", QK_WIDTH=p.qk_width, PDL=pdl, num_warps=fw.warps,
                num_stages=fw.stages, launch_pdl=pdl),
            ATTENTION_FORWARD.prepare_named(
                (p.attention_forward_programs,), p.attention_forward_arguments(cap), dict(ranges=call.ranges_of(2)), b,
                **sizes[ATTENTION_FORWARD],
                BM=at.fwd_bm, BN=p.attention_forward_keys, APPROX_TANH=at.approx_tanh, PDL=pdl,
                num_warps=at.fwd_warps, num_stages=at.fwd_stages, launch_pdl=pdl),
            ATTENTION_BACKWARD.prepare_named(
                (p.attention_backward_programs,), p.attention_backward_arguments(scaling, cap, eps),
                dict(ranges=call.ranges_of(3)), given, b, **sizes[ATTENTION_BACKWARD],
                KV_BN=p.kv_bn, KV_BM=at.kv_bm, Q_BM=at.q_bm, Q_BN=at.q_bn, HEAD_SPLIT=p.head_split,
                QK_WIDTH=p.qk_width, APPROX_TANH=at.approx_tanh, PDL=pdl, num_warps=at.warps, num_stages=at.stages,
                launch_pdl=pdl),
            GRADIENT_PRODUCTS.prepare_named(
                (p.gradient_programs,), p.gradient_arguments(), b, **sizes[GRADIENT_PRODUCTS],
                BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl, num_warps=gr.warps,
                num_stages=gr.stages, launch_pdl=pdl),
        )
        if p.products == "triton":
            return [*packs, forward_launch, attention_forward, attention_backward, gradient_launch]
        # cuBLAS writes [q | k | v] in fp32 (launch 2 copies v to fp16) and dA in fp16 (its fp32 sums
        # rounded once, as our tiles do).
        qkv = cublas_forward_product(b.x16, b.wqkv16.T, b.qk32)
        d_attn = cublas_forward_product(b.go16, b.wo_t16.T, b.d_attn16)
        grad_x, grad_wqkv, grad_wo = ([cublas_product(*product)] if needed else [] for product, needed in zip(
            [(b.g16, b.wqkv16, b.grad_x.view(p.tokens, p.sizes.hidden)), (b.g16.T, b.x16, b.grad_wqkv),
             (b.go16.T, b.attn16, b.grad_wo)], p.wanted))
        if not p.branches:
            return [*packs, qkv, d_attn, forward_launch, attention_forward, attention_backward, gradient_launch,
                    *grad_x, *grad_wqkv, *grad_wo]
        # grad_output's and Wo's copies and dA beside the other copies, [q | k | v] and its norms (the
        # attention forward reads both); grad_Wo, which reads only A and grad_output, beside the
        # attention backward and the products of G; the norm-weight sums (the gradient launch: what
        # they read the attention backward wrote, and nothing reads them) beside the products of G.
        d_attn_pack, pack = packs
        return [concurrent([pack, qkv, forward_launch], [d_attn_pack, d_attn]), attention_forward,
                concurrent([attention_backward, concurrent(grad_x, grad_wqkv, [gradient_launch])], grad_wo)]

    def outputs(self, b):
        return b.grad_x, b.grad_wq, b.grad_wk, b.grad_wv, b.grad_wo, b.grad_q_norm_w, b.grad_k_norm_w


backward = Gemma3Core().backward
