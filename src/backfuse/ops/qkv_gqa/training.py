"""072's training path: cross-attention q, k, v projections with the KV heads repeated to the query
heads (grouped-query attention), forward and backward, at any sizes (`QkvGqaConfig`), on float32,
bfloat16 or float16 tensors.

Forward (cuBLAS; fp16 copies of float32 inputs, fp32 sums, float32 outputs):
    q = dec Wq^T                      -> query_states [B, H, Sd, D] (a view of the product's [B, Sd, H, D])
    k = enc Wk^T, v = enc Wv^T        -> key_states, value_states [B, H, Se, D]: KV head j repeated to
                                         query heads j * G .. j * G + G - 1 (views of [B, Se, H, D])
It saves nothing but the fp16 copies it made of float32 inputs (the backward's operands).

Backward from the three upstream gradients (any strides; `heads_to_tokens_kernel` reads them):
    GQ = grad_query_states token-major; GK, GV = each group's G query heads summed, token-major
    grad_dec = GQ Wq, grad_Wq = GQ^T dec, grad_enc = GK Wk + GV Wv, grad_Wk = GK^T enc, grad_Wv = GV^T enc
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ...kernels import buffers
from ...kernels.schedule import Holds
from ...train import guard as guards
from ...train import plans, steps
from ...train.program import SIZES, Arena, Buffer, Outputs, Phases, Precision, Stack, accumulate, bases, bytes_of, execute, mm
from .spec import QkvGqaConfig

NEEDS = 5  # grad_dec, grad_enc, grad_Wq, grad_Wk, grad_Wv
LABEL = "backfuse.functional.qkv_gqa"
FORWARD_REGIONS = (("decoder_hidden_states", Holds.INPUT), ("encoder_hidden_states", Holds.INPUT),
                   ("q_weight", Holds.INPUT), ("k_weight", Holds.INPUT), ("v_weight", Holds.INPUT))
BACKWARD_REGIONS = (("grad_query_states", Holds.UPSTREAM), ("grad_key_states (head-group sums)", Holds.UPSTREAM),
                    ("grad_value_states (head-group sums)", Holds.UPSTREAM))


@dataclass(frozen=True, eq=False)
class Plan(Precision):
    """One call's shape and options (see `ops/wan_xattn/training.py: Plan`)."""

    batch: int
    sd: int
    se: int
    config: QkvGqaConfig
    io: torch.dtype
    save: bool = True
    sms: int = 0
    deterministic: bool = False
    needs: tuple = (True,) * NEEDS
    own_grads: bool = False  # each parameter gradient in memory of its own (`Outputs.separate`)
    gq_in_place: bool = False  # the products read the queries' upstream gradient where it is (`reads_in_place`)

    @property
    def td(self) -> int:
        return self.batch * self.sd

    @property
    def te(self) -> int:
        return self.batch * self.se

    def reads_in_place(self, gq) -> "Plan":
        """This plan, or its twin that reads gq (grad_query_states [B, H, Sd, D]) in place: where gq is in
        the products' dtype, unguarded, with token-major memory ([B, Sd, H, D], as the forward's own
        output is laid out), so that its token-major view needs no copy (nor the copy's bytes)."""
        if self.guarded or gq.dtype != self.compute:
            return self
        direct = gq.stride() == self.outputs[0][1] or gq.transpose(1, 2).is_contiguous()
        return self._in_place if direct else self

    @functools.cached_property
    def outputs(self) -> tuple:
        """(shape, strides) of query_states, key_states, value_states: [B, H, S, D] laid out token-major
        ([B, S, H, D], as the products write them)."""
        h, d = self.config.heads, self.config.head_dim
        return tuple(((self.batch, h, s, d), (s * h * d, d, h * d, 1)) for s in (self.sd, self.se, self.se))

    @functools.cached_property
    def _in_place(self) -> "Plan":
        return dataclasses.replace(self, gq_in_place=True)

    @functools.cached_property
    def activations(self):
        """The fp16 copies the backward's products read (float32 inputs only)."""
        c, cfg = self.compute, self.config
        if not self.casts:
            return Arena([])
        return Arena([Buffer("dec_c", (self.td, cfg.hidden), c), Buffer("enc_c", (self.te, cfg.cross_hidden), c),
                      Buffer("wq_c", (cfg.q_out, cfg.hidden), c), Buffer("wkv_c", (2 * cfg.kv_out, cfg.cross_hidden), c)])

    @functools.cached_property
    def forward_scratch(self):
        """k, then v, before its repeat (one buffer: k's repeat reads it before v's product writes it)."""
        return Arena([Buffer("kv", (self.te, self.config.kv_out), self.io)])

    @functools.cached_property
    def keys(self):
        """The encoder side's head-group sums GK, GV (float32 inputs: their fp16 copies in one buffer)."""
        c, cfg, n = self.compute, self.config, self.needs
        if not (n[1] or n[3] or n[4]):
            return Arena([])
        if self.casts:
            return Arena([Buffer("gkv", (self.te, 2 * cfg.kv_out), c)])
        return Arena([Buffer("gk", (self.te, cfg.kv_out), c), Buffer("gv", (self.te, cfg.kv_out), c)])

    @property
    def keys_in_grad_dec(self) -> bool:
        """GK, GV live in grad_dec's bytes where grad_dec is needed and holds them: the encoder side then
        runs first, and grad_dec's product, which reads neither, last."""
        return (self.needs[0] and len(self.keys.specs) > 0
                and self.keys.nbytes <= self.td * self.config.hidden * SIZES[self.io])

    @functools.cached_property
    def backward_scratch(self):
        c, cfg, n = self.compute, self.config, self.needs
        # The query side's products finish with GQ before the encoder side's sums are written; where the
        # upstream gradients are scaled (fp16 copies of float32), all three are cast first, side by side.
        queries = [Buffer("gq", (self.td, cfg.q_out), c) if (n[0] or n[2]) and not self.gq_in_place else None]
        keys = () if self.keys_in_grad_dec else self.keys.specs
        sides = [*queries, *keys] if self.casts else [Phases(queries, keys)]
        return Arena([*(self.activations.specs if not self.save else ()), *sides])

    @functools.cached_property
    def weight_grads(self):
        cfg, io, n = self.config, self.io, self.needs
        wk, wv = (Buffer(name, (cfg.kv_out, cfg.cross_hidden), io) for name in ("grad_wk", "grad_wv"))
        if self.casts:  # one product into [grad_wk; grad_wv]
            kv = [Stack("grad_wkv", (wk, wv))] if n[3] or n[4] else []
        else:
            kv = [wk if n[3] else None, wv if n[4] else None]
        return Outputs([Buffer("grad_wq", (cfg.q_out, cfg.hidden), io) if n[2] else None, *kv], separate=self.own_grads)


def _guard(plan: Plan, direction: str, device, owner: int = 0):
    """The fp16 guard of the forward or the backward (`train/guard.py: of`; None on bfloat16 products)."""
    return guards.of(plan, LABEL, direction, FORWARD_REGIONS if direction == "forward" else BACKWARD_REGIONS, device,
                     owner)


def _casts(p: Plan, g, x, a) -> list:
    dec, enc, wq, wk, wv = x
    kv_out = p.config.kv_out
    return [steps.cast(dec, a.dec_c, g, "decoder_hidden_states"), steps.cast(enc, a.enc_c, g, "encoder_hidden_states"),
            steps.cast(wq, a.wq_c, g, "q_weight"), steps.cast(wk, a.wkv_c[:kv_out], g, "k_weight"),
            steps.cast(wv, a.wkv_c[kv_out:], g, "v_weight")]


def forward(inputs, plan: Plan):
    """((query_states, key_states, value_states), activations) in the inputs' dtype."""
    dec, enc, wq, wk, wv = inputs
    p, cfg, device = plan, plan.config, dec.device
    g = _guard(p, "forward", device, inputs[2].data_ptr())
    if g is not None:
        g.poll()
    acts, scratch = p.activations, p.forward_scratch
    a_flat, s_flat = acts.allocate(device), scratch.allocate(device)
    q, k, v = [buffers.empty(shape, p.io, device, strides=strides) for shape, strides in p.outputs]

    def build():
        a, s = acts.views(a_flat), scratch.views(s_flat)
        kv_out = cfg.kv_out
        if p.casts:
            launches = _casts(p, g, inputs, a)
            dec_c, enc_c, wq_c, wk_c, wv_c = a.dec_c, a.enc_c, a.wq_c, a.wkv_c[:kv_out], a.wkv_c[kv_out:]
        else:
            launches = []
            dec_c, enc_c, wq_c, wk_c, wv_c = dec.view(p.td, cfg.hidden), enc.view(p.te, cfg.cross_hidden), wq, wk, wv
        launches.append(mm(dec_c, wq_c.T, q.transpose(1, 2).view(p.td, cfg.q_out)))
        for w_c, out in ((wk_c, k), (wv_c, v)):
            launches += [mm(enc_c, w_c.T, s.kv), steps.repeat_heads(s.kv, out.transpose(1, 2).view(p.te, cfg.q_out),
                                                                     cfg.group, cfg.head_dim)]
        if g is not None:
            launches.append(steps.check(g))
        return launches

    execute(("qkv_gqa forward", p), device, bases(*inputs, q, k, v, a_flat, s_flat, *guards.tensors(g)), build)
    if g is not None and device.type != "cuda":
        g.poll()
    return (q, k, v), (a_flat if p.save and p.casts else None)


def backward(inputs, grads, plan: Plan, a_flat):
    """(grad_dec, grad_enc, grad_Wq, grad_Wk, grad_Wv); None where not needed."""
    dec, enc, wq, wk, wv = inputs
    p = plan.reads_in_place(grads[0])
    cfg, device, n = p.config, dec.device, p.needs
    g = _guard(p, "backward", device, inputs[2].data_ptr())
    if g is not None:
        g.poll()
    fg = _guard(p, "forward", device, inputs[2].data_ptr()) if p.casts and a_flat is None else None
    gq, gk, gv = [t if t.stride(-1) == 1 else t.contiguous() for t in grads]
    acts, scratch, wgrads = p.activations, p.backward_scratch, p.weight_grads
    s_flat, (w, w_bases) = scratch.allocate(device), wgrads.allocate(device)
    grad_dec = buffers.empty(dec.shape, p.io, device) if n[0] else None
    grad_enc = buffers.empty(enc.shape, p.io, device) if n[1] else None
    kv_out = cfg.kv_out

    def build():
        s = scratch.views(s_flat)
        a = s if a_flat is None else acts.views(a_flat)
        launches = []
        if p.casts:
            if a_flat is None:
                launches += _casts(p, fg, inputs, a) + ([steps.check(fg)] if fg is not None else [])
            dec_c, enc_c, wq_c = a.dec_c, a.enc_c, a.wq_c
        else:
            dec_c, enc_c, wq_c = dec.view(p.td, cfg.hidden), enc.view(p.te, cfg.cross_hidden), wq
        queries, keys = [], []  # the two sides' launches
        q_casts, k_casts = [], []  # and the casts of their upstream gradients (`steps.upstream_casts`)
        if n[0] or n[2]:
            if p.gq_in_place:
                gq_t = gq.transpose(1, 2).reshape(p.td, cfg.q_out)
            else:
                gq_t = s.gq
                q_casts.append((gq, s.gq, "grad_query_states", 1))
            if n[0]:
                queries.append(mm(gq_t, wq_c, grad_dec.view(p.td, cfg.hidden)))
            if n[2]:
                queries.append(mm(gq_t.T, dec_c, w.grad_wq))
        if n[1] or n[3] or n[4]:
            k = p.keys.views(bytes_of(grad_dec)) if p.keys_in_grad_dec else s
            gk_c, gv_c = (k.gkv[:, :kv_out], k.gkv[:, kv_out:]) if p.casts else (k.gk, k.gv)
            k_casts += [(gk, gk_c, "grad_key_states (head-group sums)", cfg.group),
                        (gv, gv_c, "grad_value_states (head-group sums)", cfg.group)]
            ge = grad_enc.view(p.te, cfg.cross_hidden) if n[1] else None
            if p.casts:
                if n[1]:
                    keys.append(mm(k.gkv, a.wkv_c, ge))
                if n[3] or n[4]:
                    keys.append(mm(k.gkv.T, enc_c, wgrads.stack(w, "grad_wkv")))
            else:
                if n[1]:
                    keys += [mm(k.gk, wk, ge), accumulate(ge, k.gv, wv)]
                if n[3]:
                    keys.append(mm(k.gk.T, enc_c, w.grad_wk))
                if n[4]:
                    keys.append(mm(k.gv.T, enc_c, w.grad_wv))
        if p.casts:  # one exponent for all three: every cast before any product
            launches += steps.upstream_casts(g, q_casts + k_casts)
        else:
            queries, keys = steps.upstream_casts(g, q_casts) + queries, steps.upstream_casts(g, k_casts) + keys
        launches += keys + queries if p.keys_in_grad_dec else queries + keys
        if g is not None and g.scaled:
            products = [grad_dec, grad_enc, getattr(w, "grad_wq", None),
                        wgrads.stack(w, "grad_wkv") if wgrads.stacks else None]
            launches += [steps.unscale(t, g) for t in products if t is not None]
        if g is not None:
            launches.append(steps.check(g))
        return launches

    # The upstream gradients' strides are the head-group sums' runtime arguments: in the key, so that a graph or
    # template taken at one layout never reads another (the plan names only whether gq is read in place).
    execute(("qkv_gqa backward", p, gq.stride(), gk.stride(), gv.stride()), device,
            bases(*inputs, gq, gk, gv, grad_dec, grad_enc, *w_bases, s_flat, a_flat, *guards.tensors(g, fg)), build)
    for each in (g, fg):
        if each is not None and device.type != "cuda":
            each.poll()
    wgrads.own(w)
    return (grad_dec, grad_enc, getattr(w, "grad_wq", None), getattr(w, "grad_wk", None) if n[3] else None,
            getattr(w, "grad_wv", None) if n[4] else None)


def problem_backward(problem, inputs, needs: tuple) -> tuple:
    """`Problem.backward` of 072: the official inputs (validated: the three upstream gradients, then the forward's
    inputs) at `problem.config`'s sizes, without saved activations."""
    fwd = plans.contiguous(inputs[3:])
    dec, enc = fwd[:2]
    deterministic = torch.are_deterministic_algorithms_enabled()
    plan = plans.cached(("072 problem", problem.config, plans.signature(fwd), deterministic), lambda: Plan(
        dec.shape[0], dec.shape[1], enc.shape[1], problem.config, dec.dtype, save=False, sms=plans.sm_count(dec.device),
        deterministic=deterministic))
    return backward(fwd, list(inputs[:3]), plans.needs_plan(plan, needs), None)
