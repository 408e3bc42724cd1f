"""021's attention without its projections: Wan's attention core on q, k, v that the caller projected (a model
whose projections are not plain nn.Linear layers: LoRA adapters, quantized weights, hooks run as the model's own
modules around it), forward and backward, float32, bfloat16 or float16.

Forward from q [B, Nv, hidden], k, v [B, Nt, hidden] (the projections with their biases):
    Q, K = RMSNorm(q) wq_norm, RMSNorm(k) wk_norm        (across all heads, as Wan's norm_q / norm_k)
    with rope: Q, K turned on interleaved pairs           (the self-attention: k is the video's, cos/sin a row per
                                                          video token)
    O, lse = attention(Q, K, V) at `scale`, no mask       (ours; cuDNN's for the self-attention in bf16 once its
                                                          shape recurs, as `training.py`'s)
    out = O                                               [B, Nv, hidden] in the inputs' dtype
Backward from dO: delta = rowsum(dO * O); dQ, dK, dV = attention backward; RoPE's transpose and the norms'
backward (their weights' gradients too) from dQ, dK into grad_q, grad_k; grad_v = dV.
fp16 operands for float32 inputs (copies of v, the normed Q and K), under the device-side range guard; it saves
Q (or, where the attention norms Q as it loads it, each row's 1 / rms), K, V's copy, O, lse beside the inputs
autograd keeps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...kernels import buffers
from ...kernels.graphs import Allocating
from ...kernels.schedule import Holds
from ...train import cudnn, steps
from ...train import guard as guards
from ...train.program import Arena, Buffer, Outputs, bases, execute, torch_step
from . import training

NEEDS = 5  # grad_q, grad_k, grad_v, grad_norm_q, grad_norm_k
LABEL = "backfuse.functional.wan_attention"
FORWARD_REGIONS = (("queries", Holds.INPUT), ("keys", Holds.INPUT), ("values", Holds.INPUT))
BACKWARD_REGIONS = (("gradient of attention output", Holds.UPSTREAM), ("gradient of queries", Holds.VANISHING),
                    ("gradient of keys", Holds.VANISHING), ("gradient of values", Holds.VANISHING))


@dataclass(frozen=True, eq=False)
class Plan(training.Plan):
    """One call's shape and options (`training.Plan`'s; the q, k norms always); needs: (grad_q, grad_k, grad_v,
    grad_norm_q, grad_norm_k)."""

    needs: tuple = (True,) * NEEDS

    @property
    def q_on_load(self) -> bool:
        """The attention norms Q as it loads it (reading the caller's q: it must be in the products' dtype)."""
        return not (self.rope or self.cudnn or self.casts)

    @property
    def stacked(self) -> bool:
        return False

    @functools.cached_property
    def activations(self):
        tv, tt, d, c = self.tv, self.tt, self.config.hidden, self.compute
        turned = not self.turned_anew  # (normed, turned Q and K: saved, or in `turned`)
        return Arena([Buffer("q_rstd", (tv,), torch.float32) if self.q_on_load else Buffer("q", (tv, d), c) if turned
                      else None, Buffer("k", (tt, d), c) if turned else None, Buffer("v", (tt, d), c) if self.casts else None,
                      Buffer("o", (tv, d), c), Buffer("lse", (self.batch * self.config.heads, self.nv), torch.float32)])

    @functools.cached_property
    def backward_scratch(self):
        tv, tt, d, c, fp32 = self.tv, self.tt, self.config.hidden, self.compute, torch.float32
        ours = not self.cudnn  # (cuDNN's backward allocates dQ, dK, dV and needs no delta)
        return Arena([Buffer("do", (tv, d), c) if self.casts else None,
                      Buffer("delta", (self.batch * self.config.heads, self.nv), fp32) if ours else None,
                      Buffer("dq", (tv, d), c) if ours else None,
                      *self.split_buffers(self.split),
                      *(Buffer(f"parts_n{name}", (steps.row_norm_parts(rows), d), fp32) for name, rows in
                        (("q", tv), ("k", tt))),
                      *(Buffer(f"sums_n{name}", (steps.column_sum_parts(steps.row_norm_parts(rows)), d), fp32)
                        for name, rows in (("q", tv), ("k", tt))),
                      *(() if self.save else self.activations.specs), *self.turned.specs])

    def split_buffers(self, split: int) -> list:
        """dK and dV, which the split decides: fp32 where the key blocks split (atomic sums), else in the compute
        dtype (dV then only where it is not written into grad_v: float32's casts)."""
        if self.cudnn:
            return []
        dtype, tt, d = torch.float32 if split > 1 else self.compute, self.tt, self.config.hidden
        return [Buffer("dk", (tt, d), dtype), Buffer("dv", (tt, d), dtype) if split > 1 or self.casts else None]

    @functools.cached_property
    def weight_grads(self):
        d, io, n = self.config.hidden, self.io, self.needs
        return Outputs([Buffer("grad_nq", (d,), io) if n[3] else None, Buffer("grad_nk", (d,), io) if n[4] else None],
                       separate=self.own_grads)


def _guard(plan: Plan, direction: str, device, owner: int = 0):
    """The fp16 guard of the forward or the backward (`train/guard.py: of`; None on bfloat16 products)."""
    return guards.of(plan, LABEL, direction, FORWARD_REGIONS if direction == "forward" else BACKWARD_REGIONS, device,
                     owner)


def _tables(p: Plan, inputs) -> tuple:
    """(cos, sin) [Nv, D] of the inputs' RoPE tables, or (None, None)."""
    return tuple(t.view(p.nv, p.config.head_dim) for t in inputs[5:7]) if p.rope else (None, None)


def _operands(p: Plan, inputs, a, t) -> tuple:
    """(q, q_norm, k, v) as the attention reads them (`training._queries`: the caller's q and its norm applied as it
    is loaded, or the normed Q; t: `training._turned`'s)."""
    q, v, nq = inputs[0], inputs[2], inputs[3]
    queries = (q.view(p.tv, -1), (a.q_rstd, nq)) if p.q_on_load else (t.q, None)
    return (*queries, t.k, a.v if p.casts else v.view(p.tt, -1))


def _norms(p: Plan, inputs, a, t) -> list:
    """Q's and K's norms into t (`training._turned`), each turned where the plan has RoPE (one pass over the rows),
    or Q's 1 / rms into a where the attention norms Q as it loads it."""
    q, k, nq, nk = (x.view(-1, x.shape[-1]) if x.dim() == 3 else x for x in (*inputs[:2], *inputs[3:5]))
    rope = (*_tables(p, inputs), p.config.head_dim) if p.rope else None
    return [steps.row_norm(q, None, None, p.eps, rstd=a.q_rstd) if p.q_on_load else
            steps.row_norm(q, nq, t.q, p.eps, rope=rope), steps.row_norm(k, nk, t.k, p.eps, rope=rope)]


def _forward_launches(p: Plan, g, inputs, a, t, scale: float) -> list:
    """The launches from the inputs (q, k, v, norm_q_weight, norm_k_weight[, cos, sin]) to O and lse in the
    activations a, the normed Q and K in t (with cuDNN's attention: to its operands; the caller's `Allocating` step
    runs it)."""
    v = inputs[2].view(-1, inputs[2].shape[-1]) if inputs[2].dim() == 3 else inputs[2]
    launches = ([steps.cast(v, a.v, g, "values")] if p.casts else []) + _norms(p, inputs, a, t)
    if not p.cudnn:
        q_att, q_norm, k_att, v_att = _operands(p, inputs, a, t)
        launches += steps.attention_forward(p.attention, p.tiles, q_att, k_att, v_att, a.o, a.lse, scale, g,
                                            q_norm=q_norm)
    return launches


def forward(inputs, scale: float, plan: Plan):
    """(O [B, Nv, hidden] in the inputs' dtype, activations). inputs: q, k, v, norm_q_weight, norm_k_weight, then
    with rope the tables cos, sin."""
    q = inputs[0]
    p, device = plan, q.device
    g = _guard(p, "forward", device, inputs[3].data_ptr())
    if g is not None:
        g.poll()
    acts, turned = p.activations, p.turned
    a_flat = acts.allocate(device)
    t_flat = turned.allocate(device) if p.turned_anew else None  # (the normed, turned Q and K, not saved)
    out = buffers.empty(q.shape, p.io, device)
    key = ("wan_attention forward", p, scale)

    def build():
        a = acts.views(a_flat)
        t = turned.views(t_flat) if p.turned_anew else a
        launches = _forward_launches(p, g, inputs, a, t, scale)
        o2 = out.view(p.tv, -1)
        if p.cudnn:  # O and lse into the saved activations (cuDNN allocates its own), O into the output
            launches.append(Allocating(key, lambda: cudnn.forward(p.attention, t.q, t.k, inputs[2].view(p.tt, -1), scale),
                                       lambda o, lse: [lambda: a.o.copy_(o), lambda: a.lse.copy_(lse), lambda: o2.copy_(o)],
                                       "cuDNN's attention forward"))
        else:
            launches.append(torch_step(torch.Tensor.copy_, o2, a.o, label="copy"))
        if g is not None:
            launches.append(steps.check(g))
        return launches

    execute(key, device, bases(*inputs, out, a_flat, t_flat, *guards.tensors(g)), build)
    if g is not None and device.type != "cuda":
        g.poll()
    return out, (a_flat if p.save else None)


def backward(inputs, grad_out, scale: float, plan: Plan, a_flat):
    """(grad_q, grad_k, grad_v, grad_norm_q, grad_norm_k); None where not needed. a_flat: the forward's activations
    (None: recomputed here)."""
    q, k, v, nq, nk = inputs[:5]
    p, device, n = plan, q.device, plan.needs
    g = _guard(p, "backward", device, nq.data_ptr())
    fg = _guard(p, "forward", device, nq.data_ptr()) if a_flat is None else None
    for each in (g, fg):
        if each is not None:
            each.poll()
    tv, tt = p.tv, p.tt
    scratch, wgrads = p.backward_scratch, p.weight_grads
    s_flat, (w, w_bases) = scratch.allocate(device), wgrads.allocate(device)
    through = n[0] or n[1] or n[3] or n[4]  # (RoPE's and the norms' backward)
    grads = [buffers.empty(x.shape, p.io, device) if need or (i < 2 and through) else None
             for i, (x, need) in enumerate(zip((q, k, v), n))]
    if grads[2] is None:  # the attention backward writes dV with dQ, dK
        grads[2] = buffers.empty(v.shape, p.io, device)
    gq, gk, gv = (x.view(-1, x.shape[-1]) for x in grads)
    go = grad_out.contiguous().view(tv, -1)
    key = ("wan_attention backward", p, scale)

    def build():
        s = scratch.views(s_flat)
        a = s if a_flat is None else p.activations.views(a_flat)
        t = training._turned(p, a, s)
        launches = []
        if a_flat is None:
            launches += _forward_launches(p, fg, inputs, a, t, scale) + ([steps.check(fg)] if fg is not None else [])
        elif p.turned_anew:  # Q and K normed and turned again
            launches += _norms(p, inputs, a, t)
        d = go
        if p.casts:
            launches += steps.upstream_casts(g, [(go, s.do, "gradient of attention output", None)])
            d = s.do

        def after(dq, dk, dv) -> list:
            """From the attention's dQ, dK, dV on: RoPE's transpose with the norms' backward into grad_q, grad_k
            and their weights' gradients, dV into grad_v where the attention wrote it elsewhere."""
            launches = []
            if through:  # RoPE's transpose (p.rope) and the norms' backward in one pass over the rows
                rope = (*_tables(p, inputs), p.config.head_dim) if p.rope else None
                launches += [steps.row_norm_backward(dq, q.view(tv, -1), nq, gq, s.parts_nq, p.eps, g, "gradient of queries",
                                                     rope=rope),
                             steps.row_norm_backward(dk, k.view(tt, -1), nk, gk, s.parts_nk, p.eps, g, "gradient of keys",
                                                     rope=rope)]
            for need, out, parts, sums in ((n[3], "grad_nq", s.parts_nq, s.sums_nq), (n[4], "grad_nk", s.parts_nk, s.sums_nk)):
                if need:
                    launches += steps.column_sums(parts, getattr(w, out), sums, g, unscale=True)
            if dv is not gv:
                launches.append(steps.cast(dv, gv, g, "gradient of values"))
            return launches

        if p.cudnn:  # cuDNN's attention (its forward first without saved activations), then the rest
            def attention():
                o, lse = cudnn.forward(p.attention, t.q, t.k, v.view(tt, -1), scale) if a_flat is None else (a.o, a.lse)
                return o, cudnn.backward(p.attention, t.q, t.k, v.view(tt, -1), o, lse, d, scale)

            launches.append(Allocating(key, attention, lambda o, grads: after(*grads), "cuDNN's attention backward"))
        else:
            q_att, q_norm, k_att, v_att = _operands(p, inputs, a, t)
            launches.append(steps.attention_delta(p.attention, a.o, d, s.delta, g))

            def gradients(split, views) -> list:
                """dQ, dK, dV at `split` (where the key blocks split: fp32 atomic sums, zeroed first), and on."""
                dv = views.dv if split > 1 or p.casts else gv
                return [*([steps.zero(views.dk), steps.zero(views.dv)] if split > 1 else []),
                        *steps.attention_backward(p.attention, p.tiles, split, q_att, k_att, v_att, d, a.lse, views.delta,
                                                  views.dq, views.dk, dv, scale, g, q_norm=q_norm),
                        *after(views.dq, views.dk, dv)]
            launches += gradients(p.split, s)
            steps.compile_other_split(p, s, gradients)
        if g is not None:
            if g.scaled:  # the upstream scale's undoing on what carries it
                launches += [steps.unscale(x, g) for x in grads if x is not None]
            launches.append(steps.check(g))
        return launches

    execute(key, device, bases(*inputs, go, *grads, *w_bases, s_flat, a_flat,
                               *guards.tensors(g, fg)), build)
    for each in (g, fg):
        if each is not None and device.type != "cuda":
            each.poll()
    return (*(x if need else None for x, need in zip(grads, n[:3])), getattr(w, "grad_nq", None),
            getattr(w, "grad_nk", None))
