"""037's training path: the Gemma-style attention core (q, k, v projections, per-head QK RMSNorm with
weight 1 + w (Gemma 3; none with `qk_norm=False`, Gemma 2), rotate-half RoPE, causal GQA attention
with an optional soft cap and sliding window, the output projection), forward and backward, at any
sizes (`Gemma3CoreConfig`), on float32, bfloat16 or float16 tensors.

Forward (cuBLAS products in the inputs' dtype, or on fp16 copies of float32 inputs; fp32 sums):
    [q | k | v] = X [Wq; Wk; Wv]^T        (raw q, k kept in fp32 for float32 inputs, as the official path)
    qr, kr = RoPE(RMSNorm(q, k) (1 + w))   (kernels/triton/rope.py)
    A, lse = attention(qr, kr, v)          (kernels/triton/attention.py: causal, window, soft cap, scaling;
                                            a mask, packed documents: `steps.Masking`)
    out = A Wo^T
It saves raw q, k, v, A, lse (and its fp16 copies of float32 inputs): qr and kr lie in its scratch, and the
backward norms and turns them again from raw q and k (`Plan.turned_anew`), as compile's partitioner recomputes
them; save=False: nothing but the inputs (the backward runs the forward's launches again first). Where cuDNN's
attention serves the call (`train/cudnn.py`: bfloat16, no soft cap, no window shorter than the sequence), the attention
forward and backward are cuDNN's, recorded in the call's graph, and A, lse are copied into the saved
activations (A: 2 bytes per element of q, a few µs against the 0.4 ms its backward saves); the RoPE and
norm backward then runs in place in cuDNN's dQ and dK.

Backward from dOut:
    qr, kr = RoPE(RMSNorm(q, k) (1 + w))   (again, from the saved raw q, k)
    dA = dOut Wo, grad_Wo = dOut^T A, delta = rowsum(dA * A)
    dqr, dkr, dv = attention backward;  dq, dk, grad_w = RoPE and RMSNorm backward (G = [dq | dk | dv])
    grad_hidden = G [Wq; Wk; Wv],  grad_[Wq; Wk; Wv] = G^T X
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...kernels import buffers
from ...kernels.graphs import Allocating
from ...kernels.schedule import Holds, cdiv
from ...kernels.triton import rope
from ...train import cudnn, plans, steps
from ...train import guard as guards
from ...train.program import SIZES, Arena, Buffer, Kernel, Outputs, Precision, Stack, accumulate, bases, bytes_of, execute, mm
from .spec import Gemma3CoreConfig

NEEDS = 7  # grad_hidden, grad_Wq, grad_Wk, grad_Wv, grad_Wo, grad_q_norm_w, grad_k_norm_w
LABEL = "backfuse.functional.gemma3_core"
NORM_ROPE = Kernel(rope.norm_rope_kernel)
NORM_ROPE_BACKWARD = Kernel(rope.norm_rope_backward_kernel)
FORWARD_REGIONS = (("hidden_states", Holds.INPUT), ("q_weight", Holds.INPUT), ("k_weight", Holds.INPUT),
                   ("v_weight", Holds.INPUT), ("o_weight", Holds.INPUT), ("normed, rotated q", Holds.INPUT),
                   ("normed, rotated k", Holds.INPUT), ("v projection", Holds.INPUT))
BACKWARD_REGIONS = (("grad_output", Holds.UPSTREAM), ("gradient of attention output", Holds.GRADIENT),
                    ("gradient of q projection", Holds.VANISHING), ("gradient of k projection", Holds.VANISHING),
                    ("gradient of v projection", Holds.VANISHING))
ATTENTION_FORWARD_REGIONS = ("normed, rotated q", "normed, rotated k", "v projection")
ATTENTION_BACKWARD_REGIONS = (None, None, "gradient of v projection")  # dq, dk: fp32, checked after the norm


@dataclass(frozen=True, eq=False)
class Plan(Precision):
    """One call's shape and options (see `ops/wan_xattn/training.py: Plan`); softcap 0: none."""

    batch: int
    seq: int
    config: Gemma3CoreConfig
    io: torch.dtype
    softcap: float = 0.0
    cos_batched: bool = True  # the RoPE tables have a row per token ([B, S, D]), else per position ([1, S, D])
    save: bool = True
    sms: int = 0
    deterministic: bool = False
    cudnn: bool = False  # the attention is cuDNN's (`train/cudnn.py: serves`)
    masking: steps.Masking | None = None  # a mask or packed documents each call passes (`masks`)
    needs: tuple = (True,) * NEEDS
    own_grads: bool = False  # each parameter gradient in memory of its own (`Outputs.separate`)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def attention(self) -> steps.Attention:
        c = self.config
        return steps.Attention(self.batch, self.seq, self.seq, c.heads, c.group, c.head_dim, causal=True,
                               window=c.window, softcap=self.softcap, masking=self.masking)

    @property
    def tiles(self) -> steps.AttentionTiles:
        return steps.attention_tiles(self.config.head_dim, self.sms > 0, softcap=self.softcap != 0.0)

    @property
    def split(self) -> int:
        return self.attention.split(self.tiles, self.sms, self.deterministic) if self.sms else 1

    @property
    def other_split(self) -> int | None:
        """The split on the other side of 1 that another length of this batch takes (`steps.Attention.other_split`;
        None on the CPU and with cuDNN's attention)."""
        if not self.sms or self.cudnn:
            return None
        return self.attention.other_split(self.tiles, self.sms, self.deterministic, tied=True)

    def split_buffers(self, split: int) -> list:
        """The backward's buffers that the split decides: dV's fp32 sums where the key blocks split (dK's are
        fp32 at every split: d_rot_k)."""
        return [Buffer("dv32", (self.tokens, self.config.kv_out), torch.float32)] if split > 1 and not self.cudnn else []

    @property
    def dq_atomic(self) -> bool:
        """dQ (fp32 here) summed by atomics from the key blocks' programs where the tiles say so: the
        interpreter's, and on a GPU the soft cap's, where the dQ programs' recomputed tanh costs more than
        the atomics (`steps.GPU_SOFTCAP_TILES`); never in deterministic mode."""
        return self.tiles.dq_atomic and not self.deterministic

    @property
    def stacked(self) -> bool:
        """The q, k, v projections' gradients side by side in one buffer, G = [dq | dk | dv], and their weights'
        gradients one product G^T X: on float32's fp16 copies, and where all three weight gradients are wanted in
        one allocation and the attention is ours (cuDNN's dQ, dK, dV are tensors of their own). Two products
        fewer a call than one for each weight."""
        return self.casts or (all(self.needs[1:4]) and not self.own_grads and not self.cudnn)

    @property
    def cos_rows(self) -> int:
        return self.tokens if self.cos_batched else self.seq

    @property
    def norm_rows(self) -> int:
        """Tokens per program of the norm and RoPE forward."""
        return 32 if steps.INTERPRETED else max(8, 4096 // self.config.head_dim)

    @property
    def norm_backward_tiles(self) -> tuple:
        """(tokens per program, warps) of the norm and RoPE backward: 32 tokens, 8 warps at head size 256 (62
        against 97 µs at 16 on 4 warps, Gemma 3 4B's q at 8 x 1024 tokens; notes/training.md, session 33)."""
        if steps.INTERPRETED:
            return 32, 4
        return max(32, 4096 // self.config.head_dim), 8 if self.config.head_dim >= 256 else 4

    @property
    def turned_anew(self) -> bool:
        """qr and kr (q and k normed and turned) are not saved: the forward leaves them in its scratch, and the
        backward makes them again from the raw q and k it keeps, one norm and RoPE pass each (two launches; at
        Gemma 3 4B's 2 x 4096 tokens 48 MiB a layer fewer saved: notes/training.md, session 51)."""
        return self.save

    @functools.cached_property
    def turned(self):
        """qr and kr: in the scratches where they are made anew (`turned_anew`), else in the activations."""
        t, cfg, c = self.tokens, self.config, self.compute
        return Arena([Buffer("rot_q", (t, cfg.q_out), c), Buffer("rot_k", (t, cfg.kv_out), c)])

    @functools.cached_property
    def forward_scratch(self):
        return Arena(self.turned.specs if self.turned_anew else [])

    @functools.cached_property
    def activations(self):
        t, cfg, c, fp32 = self.tokens, self.config, self.compute, torch.float32
        specs = [*(() if self.turned_anew else self.turned.specs), Buffer("o", (t, cfg.q_out), c),
                 Buffer("lse", (self.batch * cfg.heads, self.seq), fp32),
                 steps.bounds_buffer(self.attention)]
        if self.casts:  # raw [q | k | v] in fp32 (v's fp16 copy beside), and the fp16 copies of the inputs
            width = cfg.q_out + 2 * cfg.kv_out
            specs += [Buffer("qkv", (t, width), fp32), Buffer("v", (t, cfg.kv_out), c), Buffer("x_c", (t, cfg.hidden), c),
                      Buffer("wqkv_c", (width, cfg.hidden), c), Buffer("wo_c", (cfg.hidden, cfg.q_out), c)]
        else:
            specs += [Buffer("q_raw", (t, cfg.q_out), c), Buffer("k_raw", (t, cfg.kv_out), c),
                      Buffer("v", (t, cfg.kv_out), c)]
        return Arena(specs)

    @functools.cached_property
    def upstream_of_attention(self):
        """dA, the attention output's gradient: in grad_hidden's bytes where `da_in_grad_hidden`."""
        return Arena([Buffer("da", (self.tokens, self.config.q_out), self.compute)])

    @property
    def da_in_grad_hidden(self) -> bool:
        """Whether dA lives in grad_hidden's bytes: grad_hidden is needed and holds it (its products are the
        call's last launches, dA's last reader the attention backward)."""
        return self.needs[0] and self.config.q_out * SIZES[self.compute] <= self.config.hidden * SIZES[self.io]

    @functools.cached_property
    def backward_scratch(self):
        t, cfg, c, fp32 = self.tokens, self.config, self.compute, torch.float32
        blocks = cdiv(t, self.norm_backward_tiles[0])
        ours = not self.cudnn  # cuDNN's backward allocates dQ, dK, dV itself
        specs = [*(() if self.da_in_grad_hidden else self.upstream_of_attention.specs),
                 Buffer("delta", (self.batch * cfg.heads, self.seq), fp32) if ours else None,
                 Buffer("d_rot_q", (t, cfg.q_out), fp32) if ours else None,
                 Buffer("d_rot_k", (t, cfg.kv_out), fp32) if ours else None,
                 *self.split_buffers(self.split),
                 Buffer("parts_q", (cfg.heads * blocks, cfg.head_dim), fp32),
                 Buffer("parts_k", (cfg.kv_heads * blocks, cfg.head_dim), fp32),
                 Buffer("sums_q", (steps.column_sum_parts(cfg.heads * blocks), cfg.head_dim), fp32),
                 Buffer("sums_k", (steps.column_sum_parts(cfg.kv_heads * blocks), cfg.head_dim), fp32)]
        if self.casts:
            specs.append(Buffer("go_c", (t, cfg.hidden), c))
        if self.stacked:
            specs.append(Buffer("g", (t, cfg.q_out + 2 * cfg.kv_out), c))
        elif ours:  # (with cuDNN's attention: in its dQ, dK, dV, the RoPE and norm backward in place)
            specs += [Buffer("gq", (t, cfg.q_out), c), Buffer("gk", (t, cfg.kv_out), c), Buffer("gv", (t, cfg.kv_out), c)]
        if not self.save:
            specs += self.activations.specs
        return Arena([*specs, *(self.turned.specs if self.turned_anew else ())])

    @functools.cached_property
    def weight_grads(self):
        cfg, io, n = self.config, self.io, self.needs
        rows = [(Buffer(name, (r, cfg.hidden), io), need) for name, r, need in
                (("grad_wq", cfg.q_out, n[1]), ("grad_wk", cfg.kv_out, n[2]), ("grad_wv", cfg.kv_out, n[3]))]
        if self.stacked:  # one product G^T X into [grad_wq; grad_wk; grad_wv]
            qkv = [Stack("grad_wqkv", tuple(b for b, _ in rows))] if any(n[1:4]) else []
        else:
            qkv = [b if need else None for b, need in rows]
        return Outputs([*qkv,
                      Buffer("grad_wo", (cfg.hidden, cfg.q_out), io) if n[4] else None,
                      Buffer("grad_qnw", (cfg.head_dim,), io) if n[5] else None,
                      Buffer("grad_knw", (cfg.head_dim,), io) if n[6] else None], separate=self.own_grads)


def _guard(plan: Plan, direction: str, device, owner: int = 0):
    """The fp16 guard of the forward or the backward (`train/guard.py: of`; None on bfloat16 products)."""
    return guards.of(plan, LABEL, direction, FORWARD_REGIONS if direction == "forward" else BACKWARD_REGIONS, device,
                     owner)


def _norm_rope(p: Plan, x, w, cos, sin, out, heads: int, eps: float):
    t = p.tokens
    return NORM_ROPE((cdiv(t, p.norm_rows), heads),
                     dict(x=x, w=cos if w is None else w, cos=cos, sin=sin, out=out, T=t, cos_rows=p.cos_rows,
                          eps=float(eps)),
                     D=p.config.head_dim, LD_X=x.stride(0), LD_OUT=out.stride(0), BT=p.norm_rows,
                     NORM=p.config.qk_norm, num_warps=4)


def _turned(p: Plan, a, s):
    """Where qr and kr lie: the scratch s where they are made anew (`Plan.turned_anew`), else the activations a
    (the backward recomputing its own forward: a is s)."""
    return s if p.turned_anew else a


def norm_and_turn(p: Plan, cos, sin, q_norm_w, k_norm_w, q_raw, k_raw, r, eps: float) -> list:
    """The norm and RoPE launches of raw q and k [tokens, heads * head_dim] into r.rot_q, r.rot_k."""
    cfg = p.config
    cos2, sin2 = cos.view(-1, cfg.head_dim), sin.view(-1, cfg.head_dim)
    return [_norm_rope(p, q_raw, q_norm_w, cos2, sin2, r.rot_q, cfg.heads, eps),
            _norm_rope(p, k_raw, k_norm_w, cos2, sin2, r.rot_k, cfg.kv_heads, eps)]


def _raw(p: Plan, a) -> tuple:
    """The raw q and k projections in the activations a (float32 inputs: columns of the fp32 [q | k | v])."""
    if p.casts:
        qo, ko = p.config.q_out, p.config.kv_out
        return a.qkv[:, :qo], a.qkv[:, qo:qo + ko]
    return a.q_raw, a.k_raw


def _forward_launches(p: Plan, g, x, a, r, scaling: float, eps: float, masks) -> list:
    """The forward up to A and lse from the inputs x (hidden, cos, sin, wq, wk, wv, wo, q_norm_w,
    k_norm_w) and masks (mask, documents: `steps.Masking`'s tensors, None where the plan has none) into the
    activations a and qr, kr into r (`_turned`; with cuDNN's attention: up to qr, kr, v)."""
    hidden, cos, sin, wq, wk, wv, wo, qnw, knw = x
    cfg, t = p.config, p.tokens
    qo, ko = cfg.q_out, cfg.kv_out
    if p.casts:
        launches = [steps.cast(hidden, a.x_c, g, "hidden_states"), steps.cast(wq, a.wqkv_c[:qo], g, "q_weight"),
                    steps.cast(wk, a.wqkv_c[qo:qo + ko], g, "k_weight"), steps.cast(wv, a.wqkv_c[qo + ko:], g, "v_weight"),
                    steps.cast(wo, a.wo_c, g, "o_weight"), mm(a.x_c, a.wqkv_c.T, a.qkv)]
        v_raw = a.qkv[:, qo + ko:]
        launches.append(lambda: a.v.copy_(v_raw))
    else:
        x2 = hidden.view(t, cfg.hidden)
        launches = [mm(x2, wq.T, a.q_raw), mm(x2, wk.T, a.k_raw), mm(x2, wv.T, a.v)]
    launches += norm_and_turn(p, cos, sin, qnw, knw, *_raw(p, a), r, eps)
    if p.masking is not None:
        launches += steps.attention_bounds(p.attention, a.bounds, *masks)
    if not p.cudnn:
        launches += steps.attention_forward(p.attention, p.tiles, r.rot_q, r.rot_k, a.v, a.o, a.lse, scaling, g,
                                            ATTENTION_FORWARD_REGIONS, bounds=getattr(a, "bounds", None), mask=masks[0])
    return launches


def attention_gradients(p: Plan, split: int, s, g, qr, kr, v, da, lse, gv, scaling: float, bounds, mask) -> list:
    """The attention backward's launches at `split` (`steps.attention_backward`) from qr, kr, v, dA and lse: dQ and
    dK (fp32) into s.d_rot_q, s.d_rot_k, dV into gv; where the key blocks split, dV summed in s.dv32 first
    (`Plan.split_buffers`), then copied."""
    t, cfg, att = p.tokens, p.config, p.attention
    if split == 1:
        return steps.attention_backward(att, p.tiles, 1, qr, kr, v, da, lse, s.delta, s.d_rot_q, s.d_rot_k, gv, scaling,
                                        g, ATTENTION_BACKWARD_REGIONS, p.dq_atomic, bounds=bounds, mask=mask)
    return [steps.zero(s.d_rot_k), steps.zero(s.dv32),
            *steps.attention_backward(att, p.tiles, split, qr, kr, v, da, lse, s.delta, s.d_rot_q, s.d_rot_k, s.dv32,
                                      scaling, g, ATTENTION_BACKWARD_REGIONS, p.dq_atomic, bounds=bounds, mask=mask),
            steps.heads_to_tokens(s.dv32.view(t, cfg.kv_heads, cfg.head_dim).permute(1, 0, 2)[None], gv, 1, g,
                                  "gradient of v projection")]


def forward(inputs, scaling: float, eps: float, plan: Plan, masks=(None, None)):
    """(out [B, S, hidden] in the inputs' dtype, activations). inputs: hidden, cos, sin, wq, wk, wv, wo,
    q_norm_w, k_norm_w; masks: (mask, documents) as the plan's masking says (`steps.Masking`)."""
    hidden, wo = inputs[0], inputs[6]
    p, cfg, device = plan, plan.config, hidden.device
    g = _guard(p, "forward", device, inputs[3].data_ptr())
    if g is not None:
        g.poll()
    acts, scratch = p.activations, p.forward_scratch
    a_flat, s_flat = acts.allocate(device), scratch.allocate(device)
    out = buffers.empty(hidden.shape, p.io, device)
    key = ("gemma3_core forward", p, scaling, eps)

    def build():
        a, out2 = acts.views(a_flat), out.view(p.tokens, cfg.hidden)
        r = _turned(p, a, scratch.views(s_flat))
        launches = _forward_launches(p, g, inputs, a, r, scaling, eps, masks)
        if p.cudnn:  # A and lse into the saved activations (cuDNN allocates its own), the output projection
            launches.append(Allocating(
                key, lambda: cudnn.forward(p.attention, r.rot_q, r.rot_k, a.v, scaling),
                lambda o, lse: [lambda: a.o.copy_(o), lambda: a.lse.copy_(lse), mm(o, wo.T, out2)],
                "cuDNN's attention forward"))
        else:
            launches.append(mm(a.o, (a.wo_c if p.casts else wo).T, out2))
        if g is not None:
            launches.append(steps.check(g))
        return launches

    execute(key, device, bases(*inputs, *masks, out, a_flat, s_flat, *guards.tensors(g)), build)
    if g is not None and device.type != "cuda":
        g.poll()
    return out, (a_flat if p.save else None)


def norm_rope_backward(p, g, cos, sin, eps: float, *rows_of) -> list:
    """The norm/RoPE backward launches of the queries and keys (`NORM_ROPE_BACKWARD`): rows_of gives, for each,
    (gradient after RoPE, rows before the norm, norm weight or None, destination, weight-gradient parts, heads,
    guard region). p: a plan with `config`, `tokens`, `cos_rows` and `norm_backward_tiles`."""
    cfg, t = p.config, p.tokens
    cos2, sin2 = cos.view(-1, cfg.head_dim), sin.view(-1, cfg.head_dim)
    ranges, _, checked = steps._guarded(g, cos.device)
    rows, warps = p.norm_backward_tiles
    return [NORM_ROPE_BACKWARD(
        (cdiv(t, rows), heads),
        dict(dout=d_rot, x=raw, w=cos2 if weight is None else weight, cos=cos2, sin=sin2, dx=dst, parts=parts,
             ranges=ranges, T=t, cos_rows=p.cos_rows, eps=float(eps), r_dx=steps._slot(g, region)),
        D=cfg.head_dim, LD_DOUT=d_rot.stride(0), LD_X=raw.stride(0), LD_DX=dst.stride(0), BT=rows, RANGES=checked,
        NORM=cfg.qk_norm, num_warps=warps)
        for d_rot, raw, weight, dst, parts, heads, region in rows_of]


def _gradients_from_attention(p: Plan, g, inputs, a, s, w, grad_hidden, d_rot_q, d_rot_k, gv, eps: float,
                              in_place: bool = False) -> list:
    """The launches from the attention's gradients d_rot_q, d_rot_k and gv (the v projection's) on: the RoPE
    and norm backward into s.gq, s.gk (or s.g's columns where the plan is `stacked`; in_place: into d_rot_q,
    d_rot_k, each program reading its rows before it writes them), the norm weights' gradients and the
    products with the inputs."""
    hidden, cos, sin, wq, wk, wv, wo, qnw, knw = inputs
    cfg, t, n = p.config, p.tokens, p.needs
    qo, ko = cfg.q_out, cfg.kv_out
    q_raw, k_raw = _raw(p, a)
    x_c = a.x_c if p.casts else hidden.view(t, cfg.hidden)
    if in_place:
        gq, gk = d_rot_q, d_rot_k
    else:
        gq, gk = (s.g[:, :qo], s.g[:, qo:qo + ko]) if p.stacked else (s.gq, s.gk)
    launches = norm_rope_backward(p, g, cos, sin, eps,
                                  (d_rot_q, q_raw, qnw, gq, s.parts_q, cfg.heads, "gradient of q projection"),
                                  (d_rot_k, k_raw, knw, gk, s.parts_k, cfg.kv_heads, "gradient of k projection"))
    if n[5]:
        launches += steps.column_sums(s.parts_q, w.grad_qnw, s.sums_q, g, unscale=True)
    if n[6]:
        launches += steps.column_sums(s.parts_k, w.grad_knw, s.sums_k, g, unscale=True)
    gh = grad_hidden.view(t, cfg.hidden) if n[0] else None
    if n[0]:
        launches += [mm(s.g, a.wqkv_c, gh)] if p.casts else [mm(gq, wq, gh), accumulate(gh, gk, wk),
                                                             accumulate(gh, gv, wv)]
    if p.stacked:
        if any(n[1:4]):
            launches.append(mm(s.g.T, x_c, p.weight_grads.stack(w, "grad_wqkv")))
    else:
        for need, grad, name in ((n[1], gq, "grad_wq"), (n[2], gk, "grad_wk"), (n[3], gv, "grad_wv")):
            if need:
                launches.append(mm(grad.T, x_c, getattr(w, name)))
    return launches


def _finish(p: Plan, g, w, grad_hidden) -> list:
    """The scale's undoing on the products that carry it, and the guard's check (none unguarded)."""
    if g is None:
        return []
    stacked = p.weight_grads.stack(w, "grad_wqkv") if "grad_wqkv" in p.weight_grads.stacks else None
    products = [grad_hidden, stacked, getattr(w, "grad_wo", None)] if g.scaled else []
    return [steps.unscale(x, g) for x in products if x is not None] + [steps.check(g)]


def backward(inputs, grad_out, scaling: float, eps: float, plan: Plan, a_flat, masks=(None, None)):
    """(grad_hidden, grad_Wq, grad_Wk, grad_Wv, grad_Wo, grad_q_norm_w, grad_k_norm_w); None where not needed.
    masks: the forward's."""
    hidden, wo = inputs[0], inputs[6]
    p, cfg, device, n = plan, plan.config, hidden.device, plan.needs
    g = _guard(p, "backward", device, inputs[3].data_ptr())
    fg = _guard(p, "forward", device, inputs[3].data_ptr()) if a_flat is None else None
    for each in (g, fg):
        if each is not None:
            each.poll()
    t, qo, ko = p.tokens, cfg.q_out, cfg.kv_out
    acts, scratch, wgrads = p.activations, p.backward_scratch, p.weight_grads
    s_flat, (w, w_bases) = scratch.allocate(device), wgrads.allocate(device)
    grad_hidden = buffers.empty(hidden.shape, p.io, device) if n[0] else None
    go = grad_out.contiguous()
    through_attention = any(n[:4]) or n[5] or n[6]  # (without the QK norm, n[5] and n[6] are False)

    def build():
        s, go2 = scratch.views(s_flat), go.view(t, cfg.hidden)
        a = s if a_flat is None else acts.views(a_flat)
        r = _turned(p, a, s)
        launches = []
        if a_flat is None:
            launches += _forward_launches(p, fg, inputs, a, r, scaling, eps, masks) + (
                [steps.check(fg)] if fg is not None else [])
        elif p.turned_anew and through_attention:  # qr and kr normed and turned again
            cos, sin, qnw, knw = inputs[1], inputs[2], inputs[7], inputs[8]
            launches += norm_and_turn(p, cos, sin, qnw, knw, *_raw(p, a), r, eps)
        if p.casts:
            launches += steps.upstream_casts(g, [(go2, s.go_c, "grad_output", None)])
            go_c, wo_c = s.go_c, a.wo_c
        else:
            go_c, wo_c = go2, wo
        da = (p.upstream_of_attention.views(bytes_of(grad_hidden)) if p.da_in_grad_hidden else s).da
        if p.cudnn:  # cuDNN's attention (its forward first without saved activations), then the rest
            def attention():
                o, lse = cudnn.forward(p.attention, r.rot_q, r.rot_k, a.v, scaling) if a_flat is None else (a.o, a.lse)
                grads = cudnn.backward(p.attention, r.rot_q, r.rot_k, a.v, o, lse, da, scaling) \
                    if through_attention else ()
                return o, grads

            def rest(o, grads):
                after = [mm(go2.T, o, w.grad_wo)] if n[4] else []
                if through_attention:
                    after += _gradients_from_attention(p, g, inputs, a, s, w, grad_hidden, *grads, eps, in_place=True)
                return after

            launches += [mm(go_c, wo_c, da)] if through_attention else []
            launches.append(Allocating(key, attention, rest, "cuDNN's attention backward"))
            return launches + _finish(p, g, w, grad_hidden)
        if n[4]:
            launches.append(mm(go_c.T, a.o, w.grad_wo))
        if through_attention:
            att = p.attention
            gv = s.g[:, qo + ko:] if p.stacked else s.gv
            launches += [mm(go_c, wo_c, da), steps.attention_delta(att, a.o, da, s.delta, g)]
            if p.dq_atomic:
                launches.append(steps.zero(s.d_rot_q))

            def gradients(split, views):
                return attention_gradients(p, split, views, g, r.rot_q, r.rot_k, a.v, da, a.lse, gv, scaling,
                                           getattr(a, "bounds", None), masks[0])
            launches += gradients(p.split, s)
            steps.compile_other_split(p, s, gradients)
            launches += _gradients_from_attention(p, g, inputs, a, s, w, grad_hidden, s.d_rot_q, s.d_rot_k, gv, eps)
        return launches + _finish(p, g, w, grad_hidden)

    key = ("gemma3_core backward", p, scaling, eps)
    execute(key, device, bases(*inputs, *masks, go, grad_hidden, *w_bases, s_flat, a_flat, *guards.tensors(g, fg)),
            build)
    for each in (g, fg):
        if each is not None and device.type != "cuda":
            each.poll()
    wgrads.own(w)
    return (grad_hidden, getattr(w, "grad_wq", None) if n[1] else None, getattr(w, "grad_wk", None) if n[2] else None,
            getattr(w, "grad_wv", None) if n[3] else None, getattr(w, "grad_wo", None), getattr(w, "grad_qnw", None),
            getattr(w, "grad_knw", None))


def problem_backward(problem, inputs, needs: tuple) -> tuple:
    """`Problem.backward` of 037: the official inputs (validated: grad_output, the forward's inputs, scaling, the
    soft cap, eps) at `problem.config`'s sizes, without saved activations."""
    go, *fwd, scaling, cap, eps = inputs
    fwd = plans.contiguous(fwd)
    hidden, cos = fwd[:2]
    deterministic = torch.are_deterministic_algorithms_enabled()
    softcap = abs(float(cap))  # tanh(z / c) c is even in c

    def make():
        plan = Plan(hidden.shape[0], hidden.shape[1], problem.config, hidden.dtype, softcap=softcap,
                    cos_batched=cos.shape[0] != 1 or hidden.shape[0] == 1, save=False, sms=plans.sm_count(hidden.device),
                    deterministic=deterministic)
        return plans.replaced(plan, cudnn=True) if cudnn.serves(plan.attention, plan.compute, hidden.device,
                                                                 deterministic) else plan

    plan = plans.cached(("037 problem", problem.config, plans.signature(fwd), softcap, deterministic, cudnn.enabled()),
                        make)
    return backward(fwd, go, scaling, eps, plans.needs_plan(plan, needs), None)
