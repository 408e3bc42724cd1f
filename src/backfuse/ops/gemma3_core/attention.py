"""037's attention without its projections: the Gemma attention core on q, k, v that the caller projected
(a model whose projections are not plain nn.Linear layers: LoRA adapters, quantized weights, hooks run as
the model's own modules around it), forward and backward, float32, bfloat16 or float16.

Forward from q [B, S, H * D], k, v [B, S, KV * D] (the raw projections):
    qr, kr = RoPE(RMSNorm(q, k) (1 + w))   (kernels/triton/rope.py; no norm without the weights: Gemma 2)
    A, lse = attention(qr, kr, v)          (kernels/triton/attention.py: causal, window, soft cap, scaling,
                                            a mask, packed documents: `steps.Masking`; cuDNN's where it serves
                                            the call and its shape recurs, as `training.py`'s)
    out = A                                [B, S, H * D] in the inputs' dtype (a copy: the saved A stays ours)
Backward from dA:
    delta = rowsum(dA * A);  dqr, dkr, dv = attention backward;  dq, dk, grad_w = RoPE and RMSNorm backward
Products and sums as `training.py`'s (fp16 copies of float32 inputs under the device-side range guard);
it saves A, lse (and v's fp16 copy of float32 inputs) beside the inputs autograd keeps: qr and kr lie in the
forward's scratch, and the backward norms and turns them again from q and k (`training.Plan.turned_anew`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...kernels import buffers
from ...kernels.graphs import Allocating
from ...kernels.schedule import Holds, cdiv
from ...train import cudnn, steps
from ...train import guard as guards
from ...train.program import Arena, Buffer, Outputs, bases, execute, torch_step
from . import training

NEEDS = 5  # grad_q, grad_k, grad_v, grad_q_norm_w, grad_k_norm_w
LABEL = "backfuse.functional.gemma3_attention"
FORWARD_REGIONS = (("normed, rotated q", Holds.INPUT), ("normed, rotated k", Holds.INPUT), ("v projection", Holds.INPUT))
BACKWARD_REGIONS = (("gradient of attention output", Holds.UPSTREAM), ("gradient of q projection", Holds.VANISHING),
                    ("gradient of k projection", Holds.VANISHING), ("gradient of v projection", Holds.VANISHING))


@dataclass(frozen=True, eq=False)
class Plan(training.Plan):
    """One call's shape and options (`training.Plan`'s); needs: (grad_q, grad_k, grad_v, grad_qnw, grad_knw)."""

    needs: tuple = (True,) * NEEDS

    @functools.cached_property
    def activations(self):
        t, cfg, c, fp32 = self.tokens, self.config, self.compute, torch.float32
        return Arena([*(() if self.turned_anew else self.turned.specs),
                      Buffer("o", (t, cfg.q_out), c), Buffer("lse", (self.batch * cfg.heads, self.seq), fp32),
                      steps.bounds_buffer(self.attention),
                      Buffer("v_c", (t, cfg.kv_out), c) if self.casts else None])

    @functools.cached_property
    def backward_scratch(self):
        t, cfg, c, fp32 = self.tokens, self.config, self.compute, torch.float32
        blocks = cdiv(t, self.norm_backward_tiles[0])
        ours = not self.cudnn  # (cuDNN's backward allocates dQ, dK, dV and needs no delta)
        return Arena([Buffer("da", (t, cfg.q_out), c) if self.casts else None,
                      Buffer("delta", (self.batch * cfg.heads, self.seq), fp32) if ours else None,
                      Buffer("d_rot_q", (t, cfg.q_out), fp32) if ours else None,
                      Buffer("d_rot_k", (t, cfg.kv_out), fp32) if ours else None,
                      *self.split_buffers(self.split),
                      Buffer("parts_q", (cfg.heads * blocks, cfg.head_dim), fp32),
                      Buffer("parts_k", (cfg.kv_heads * blocks, cfg.head_dim), fp32),
                      Buffer("sums_q", (steps.column_sum_parts(cfg.heads * blocks), cfg.head_dim), fp32),
                      Buffer("sums_k", (steps.column_sum_parts(cfg.kv_heads * blocks), cfg.head_dim), fp32),
                      *(() if self.save else self.activations.specs),
                      *(self.turned.specs if self.turned_anew else ())])

    @functools.cached_property
    def weight_grads(self):
        cfg, io, n = self.config, self.io, self.needs
        return Outputs([Buffer("grad_qnw", (cfg.head_dim,), io) if n[3] else None,
                        Buffer("grad_knw", (cfg.head_dim,), io) if n[4] else None], separate=self.own_grads)


def _guard(plan: Plan, direction: str, device, owner: int = 0):
    """The fp16 guard of the forward or the backward (`train/guard.py: of`; None on bfloat16 products)."""
    return guards.of(plan, LABEL, direction, FORWARD_REGIONS if direction == "forward" else BACKWARD_REGIONS, device,
                     owner)


def _norm_and_turn(p: Plan, x, r, eps: float) -> list:
    """The norm and RoPE launches of the inputs x's q and k into r.rot_q, r.rot_k."""
    q, k, v, cos, sin, qnw, knw = x
    return training.norm_and_turn(p, cos, sin, qnw, knw, q.view(p.tokens, -1), k.view(p.tokens, -1), r, eps)


def _forward_launches(p: Plan, g, x, a, r, scaling: float, eps: float, masks) -> list:
    """The launches from the inputs x (q, k, v, cos, sin, q_norm_w, k_norm_w) to A and lse in the activations a,
    qr and kr in r (`training._turned`)."""
    v, t = x[2], p.tokens
    launches = [steps.cast(v, a.v_c, g, "v projection")] if p.casts else []
    launches += _norm_and_turn(p, x, r, eps)
    if p.masking is not None:
        launches += steps.attention_bounds(p.attention, a.bounds, *masks)
    if not p.cudnn:  # (cuDNN's attention allocates its outputs: the callers' `Allocating` steps)
        launches += steps.attention_forward(p.attention, p.tiles, r.rot_q, r.rot_k, a.v_c if p.casts else v.view(t, -1),
                                            a.o, a.lse, scaling, g, training.ATTENTION_FORWARD_REGIONS,
                                            bounds=getattr(a, "bounds", None), mask=masks[0])
    return launches


def forward(inputs, scaling: float, eps: float, plan: Plan, masks=(None, None)):
    """(A [B, S, H * D] in the inputs' dtype, activations). inputs: q, k, v, cos, sin, q_norm_w, k_norm_w."""
    q = inputs[0]
    p, device = plan, q.device
    g = _guard(p, "forward", device, inputs[0].data_ptr())
    if g is not None:
        g.poll()
    acts, scratch = p.activations, p.forward_scratch
    a_flat, s_flat = acts.allocate(device), scratch.allocate(device)
    out = buffers.empty(q.shape, p.io, device)

    key = ("gemma3_attention forward", p, scaling, eps)
    out2 = out.view(p.tokens, -1)

    def build():
        a = acts.views(a_flat)
        r = training._turned(p, a, scratch.views(s_flat))
        launches = _forward_launches(p, g, inputs, a, r, scaling, eps, masks)
        if p.cudnn:  # A and lse into the saved activations (cuDNN allocates its own), A into the output
            launches.append(Allocating(key, lambda: cudnn.forward(p.attention, r.rot_q, r.rot_k, inputs[2].view(p.tokens, -1),
                                                                  scaling),
                                       lambda o, lse: [lambda: a.o.copy_(o), lambda: a.lse.copy_(lse), lambda: out2.copy_(o)],
                                       "cuDNN's attention forward"))
        else:
            launches.append(torch_step(torch.Tensor.copy_, out2, a.o, label="copy"))
        if g is not None:
            launches.append(steps.check(g))
        return launches

    execute(key, device, bases(*inputs, *masks, out, a_flat, s_flat, *guards.tensors(g)), build)
    if g is not None and device.type != "cuda":
        g.poll()
    return out, (a_flat if p.save else None)


def backward(inputs, grad_out, scaling: float, eps: float, plan: Plan, a_flat, masks=(None, None)):
    """(grad_q, grad_k, grad_v, grad_q_norm_w, grad_k_norm_w); None where not needed. masks: the forward's."""
    q, k, v, cos, sin, qnw, knw = inputs
    p, cfg, device, n = plan, plan.config, q.device, plan.needs
    g = _guard(p, "backward", device, q.data_ptr())
    fg = _guard(p, "forward", device, q.data_ptr()) if a_flat is None else None
    for each in (g, fg):
        if each is not None:
            each.poll()
    t, att = p.tokens, p.attention
    scratch, wgrads = p.backward_scratch, p.weight_grads
    s_flat, (w, w_bases) = scratch.allocate(device), wgrads.allocate(device)
    through = any(n[:2]) or n[3] or n[4]  # (the RoPE and norm backward)
    grads = [buffers.empty(x.shape, p.io, device) if need or (i < 2 and through) else None
             for i, (x, need) in enumerate(zip((q, k, v), n))]
    if grads[2] is None:  # the attention backward writes dV with dQ, dK
        grads[2] = buffers.empty(v.shape, p.io, device)
    gq, gk, gv = (x.view(t, -1) for x in grads)
    da = grad_out.contiguous().view(t, cfg.q_out)
    key = ("gemma3_attention backward", p, scaling, eps)

    def build():
        s = scratch.views(s_flat)
        a = s if a_flat is None else p.activations.views(a_flat)
        r = training._turned(p, a, s)
        launches = []
        if a_flat is None:
            launches += _forward_launches(p, fg, inputs, a, r, scaling, eps, masks) + (
                [steps.check(fg)] if fg is not None else [])
        elif p.turned_anew:  # qr and kr normed and turned again
            launches += _norm_and_turn(p, inputs, r, eps)
        d = da
        if p.casts:
            launches += steps.upstream_casts(g, [(da, s.da, "gradient of attention output", None)])
            d = s.da
        if p.cudnn:  # cuDNN's attention (its forward first without saved activations), then the rest in place
            vee = v.view(t, -1)

            def attention():
                o, lse = cudnn.forward(att, r.rot_q, r.rot_k, vee, scaling) if a_flat is None else (a.o, a.lse)
                return o, cudnn.backward(att, r.rot_q, r.rot_k, vee, o, lse, d, scaling)

            def rest(o, grads):
                dq, dk, dv = grads
                return [torch_step(torch.Tensor.copy_, gv, dv, label="copy")] + (
                    _norm_rope_backward(p, g, inputs, s, w, dq, dk, gq, gk, eps) if through else [])

            launches.append(Allocating(key, attention, rest, "cuDNN's attention backward"))
            return launches + ([steps.check(g)] if g is not None else [])
        launches.append(steps.attention_delta(att, a.o, d, s.delta, g))
        if p.dq_atomic:
            launches.append(steps.zero(s.d_rot_q))
        vee = a.v_c if p.casts else v.view(t, -1)

        def gradients(split, views):
            return training.attention_gradients(p, split, views, g, r.rot_q, r.rot_k, vee, d, a.lse, gv, scaling,
                                                getattr(a, "bounds", None), masks[0])
        launches += gradients(p.split, s)
        steps.compile_other_split(p, s, gradients)
        if through:
            launches += _norm_rope_backward(p, g, inputs, s, w, s.d_rot_q, s.d_rot_k, gq, gk, eps)
        if g is not None:
            if g.scaled:  # the upstream scale's undoing on what carries it
                launches += [steps.unscale(x, g) for x in grads if x is not None]
            launches.append(steps.check(g))
        return launches

    execute(key, device,
            bases(*inputs, *masks, da, *grads, *w_bases, s_flat, a_flat,
                  *guards.tensors(g, fg)), build)
    for each in (g, fg):
        if each is not None and device.type != "cuda":
            each.poll()
    return (*(x if need else None for x, need in zip(grads, n[:3])), getattr(w, "grad_qnw", None),
            getattr(w, "grad_knw", None))


def _norm_rope_backward(p: Plan, g, inputs, s, w, dq, dk, gq, gk, eps: float) -> list:
    """The RoPE and norm backward from the attention's dQ, dK into grad_q, grad_k, and the norm weights' sums."""
    q, k, v, cos, sin, qnw, knw = inputs
    cfg, t, n = p.config, p.tokens, p.needs
    launches = training.norm_rope_backward(
        p, g, cos, sin, eps, (dq, q.view(t, -1), qnw, gq, s.parts_q, cfg.heads, "gradient of q projection"),
        (dk, k.view(t, -1), knw, gk, s.parts_k, cfg.kv_heads, "gradient of k projection"))
    if n[3]:
        launches += steps.column_sums(s.parts_q, w.grad_qnw, s.sums_q, g, unscale=True)
    if n[4]:
        launches += steps.column_sums(s.parts_k, w.grad_knw, s.sums_k, g, unscale=True)
    return launches
