"""021's training path: the fused forward of Wan-style text-to-video cross-attention and its backward,
at any width and head count (`WanXattnConfig`), on float32, bfloat16 or float16 tensors.

Forward (products in the inputs' dtype for bfloat16 and float16; on fp16 copies for float32; fp32 sums):
    Q = video Wq^T + bq, K = text Wk^T + bk, V = text Wv^T + bv      (cuBLAS, the bias in its epilogue)
    with qk_norm: Q, K = RMSNorm(Q) wq_norm, RMSNorm(K) wk_norm        (across all heads, as Wan's norm_q/k)
    with rope: Q, K = RoPE(Q), RoPE(K) on interleaved pairs            (Wan's self-attention: text is the
                                                                       video, cos/sin a row per video token)
    O, lse = attention(Q, K, V) at `scale`, no mask                   (kernels/triton/attention.py)
    out = O Wo^T + bo                                                 (cuBLAS)
It saves Q, K, V, O, lse (and its fp16 copies of float32 inputs) for the backward, or, with
save=False, nothing but the inputs: the backward then runs the forward's launches again first. With
qk_norm it saves, for Q, the projection before the norm and each row's 1 / rms: the attention
kernels norm Q as they load it (one activation of the video's size less than a normed copy); with rope
Q is normed and turned into a copy of its own.

Backward from dOut:
    dC = dOut Wo, grad_Wo = dOut^T O, grad_bo = sum dOut
    delta = rowsum(dC * O); dQ, dK, dV = attention backward (with rope: RoPE's transpose, in place; with
    qk_norm: the norms' backward, in place, and their weights' gradients)
    grad_video = dQ Wq, grad_Wq = dQ^T video, grad_bq = sum dQ
    grad_text = dK Wk + dV Wv, grad_Wk = dK^T text, grad_bk = sum dK, grad_Wv = dV^T text, grad_bv = sum dV
The products of gradients nobody needs are skipped. On fp16 products the upstream gradient is scaled
by the guard's 2^k and the outputs divided by it again (`backfuse/train/guard.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...kernels import buffers
from ...kernels.graphs import Allocating
from ...kernels.schedule import Holds
from ...train import cudnn, plans, steps
from ...train import guard as guards
from ...train.program import Arena, Buffer, Outputs, Precision, Stack, accumulate, addmm, bases, bytes_of, execute, mm
from .spec import WanXattnConfig

NEEDS = 10  # grad_video, grad_text, grad_Wq, grad_bq, grad_Wk, grad_bk, grad_Wv, grad_bv, grad_Wo, grad_bo
# (then with qk_norm grad_norm_q, grad_norm_k)
LABEL = "backfuse.functional.wan_xattn"
FORWARD_REGIONS = (("video_latents", Holds.INPUT), ("text_embeddings", Holds.INPUT),
                   ("query_weight", Holds.INPUT), ("key_weight", Holds.INPUT), ("value_weight", Holds.INPUT),
                   ("output_weight", Holds.INPUT), ("biases", Holds.INPUT),
                   ("queries", Holds.INPUT), ("keys", Holds.INPUT), ("values", Holds.INPUT))
BACKWARD_REGIONS = (("grad_output", Holds.UPSTREAM), ("gradient of attention output", Holds.GRADIENT),
                    ("gradient of queries", Holds.VANISHING), ("gradient of keys", Holds.VANISHING),
                    ("gradient of values", Holds.VANISHING))


@dataclass(frozen=True, eq=False)
class Plan(Precision):
    """One call's shape and options: batch, video and text tokens per entry, the config, the inputs'
    dtype, whether the forward saves its activations, the GPU's SM count (0: the interpreter),
    deterministic (no atomic sums), and (backward) the gradients needed."""

    batch: int
    nv: int
    nt: int
    config: WanXattnConfig
    io: torch.dtype
    save: bool = True
    sms: int = 0
    deterministic: bool = False
    needs: tuple = (True,) * (NEEDS + 2)
    own_grads: bool = False  # each parameter gradient in memory of its own (`Outputs.separate`)
    eps: float = 1e-6  # the q, k norms'
    rope: bool = False  # Q and K turned by RoPE on interleaved pairs after their norms (the self-attention's)
    cudnn: bool = False  # the attention is cuDNN's (`train/cudnn.py: serves`)

    @property
    def norm(self) -> bool:
        return self.config.qk_norm

    @property
    def stacked(self) -> bool:
        """dK and dV side by side in one buffer, [dK | dV] (one zero fill and one cast where the attention sums them
        in fp32, one product for both weights' gradients): on float32's fp16 copies, and on bfloat16 where both
        weight gradients are wanted in one allocation and the attention is ours. (fp16 inputs keep them apart:
        the range guard names which of the two left fp16's range.)"""
        return self.casts or (not self.guarded and self.needs[4] and self.needs[6] and not self.own_grads
                              and not self.cudnn)

    @property
    def q_on_load(self) -> bool:
        """The attention norms Q as it loads it (the rows before the norm and their 1 / rms saved): with the q
        norm and without RoPE, which must turn the normed rows, or cuDNN's attention, which loads Q as it is."""
        return self.norm and not (self.rope or self.cudnn)

    @property
    def turned_anew(self) -> bool:
        """Q and K normed and turned (the self-attention with its norms) are not saved: the forward leaves them in its
        scratch, and the backward norms and turns them again from the rows before the norms (the projections' rows
        it keeps; `attention.py`: the caller's q and k), one row pass each, as compile's partitioner recomputes
        them: two tensors of the video's size fewer saved a call."""
        return self.rope and self.norm and self.save

    @property
    def rows_passed(self) -> bool:
        """dQ and dK pass through a backward over their rows (the norms' and RoPE's, `steps.row_norm_backward`), which
        sums the bias gradients' parts as it writes them (no pass of their own over dQ and dK)."""
        return self.norm or self.rope

    @property
    def tv(self) -> int:
        return self.batch * self.nv

    @property
    def tt(self) -> int:
        return self.batch * self.nt

    @property
    def attention(self) -> steps.Attention:
        return steps.Attention(self.batch, self.nv, self.nt, self.config.heads, 1, self.config.head_dim)

    @property
    def tiles(self) -> steps.AttentionTiles:
        return steps.attention_tiles(self.config.head_dim, self.sms > 0)

    @property
    def split(self) -> int:
        return self.attention.split(self.tiles, self.sms, self.deterministic) if self.sms else 1

    @property
    def other_split(self) -> int | None:
        """The split on the other side of 1 that other lengths of this batch take (`steps.Attention.other_split`;
        None on the CPU and with cuDNN's attention)."""
        if not self.sms or self.cudnn:
            return None
        return self.attention.other_split(self.tiles, self.sms, self.deterministic, tied=False)

    def split_buffers(self, split: int) -> list:
        """The backward's buffers that the split decides: dK's and dV's fp32 sums where the key blocks split
        (side by side where they are stacked)."""
        if split == 1 or self.cudnn:
            return []
        tt, d, fp32 = self.tt, self.config.hidden, torch.float32
        if self.stacked:
            return [Buffer("dkv32", (tt, 2 * d), fp32)]
        return [Buffer("dk32", (tt, d), fp32), Buffer("dv32", (tt, d), fp32)]

    @functools.cached_property
    def activations(self):
        """What the forward leaves for the backward (saved, or the backward's own recomputation)."""
        tv, tt, d, c = self.tv, self.tt, self.config.hidden, self.compute
        turned = not self.turned_anew  # (normed, turned Q and K: saved, or in the scratches)
        specs = [Buffer("q_rstd", (tv,), torch.float32) if self.q_on_load else Buffer("q", (tv, d), c) if turned else None,
                 Buffer("o", (tv, d), c), Buffer("lse", (self.batch * self.config.heads, self.nv), torch.float32)]
        if self.casts:
            specs += [Buffer("kv", (tt, 2 * d), c), Buffer("video_c", (tv, d), c), Buffer("text_c", (tt, d), c),
                      Buffer("wq_c", (d, d), c), Buffer("wkv_c", (2 * d, d), c), Buffer("wo_c", (d, d), c)]
        else:
            specs += [Buffer("k_raw" if self.norm else "k", (tt, d), c), Buffer("v", (tt, d), c)]
        if self.norm:  # the projections before their norms (the norms' backward reads them, and the attention
            # norms Q as it loads it: q_rstd; with rope, normed and turned Q: q), and normed K
            specs += [Buffer("q_raw", (tv, d), c), Buffer("k", (tt, d), c) if turned else None]
        return Arena(specs)

    @functools.cached_property
    def turned(self):
        """Q and K normed and turned, where they are not saved (`turned_anew`)."""
        return Arena([Buffer("q", (self.tv, self.config.hidden), self.compute),
                      Buffer("k", (self.tt, self.config.hidden), self.compute)] if self.turned_anew else [])

    @functools.cached_property
    def forward_scratch(self):
        d, c = self.config.hidden, self.compute
        return Arena([*([Buffer("bq_c", (d,), c), Buffer("bkv_c", (2 * d,), c)] if self.casts else []),
                      *self.turned.specs])

    @functools.cached_property
    def upstream_of_attention(self):
        """dC, the attention output's gradient: in grad_video's bytes where grad_video is needed (its
        product is the call's last, dC's last reader the attention backward), else in the scratch."""
        return Arena([Buffer("dc", (self.tv, self.config.hidden), self.compute)])

    @functools.cached_property
    def backward_scratch(self):
        tv, tt, d, c, fp32 = self.tv, self.tt, self.config.hidden, self.compute, torch.float32
        ours = not self.cudnn  # cuDNN's backward allocates dQ, dK, dV itself (and needs no delta)
        specs = [*(() if self.needs[0] else self.upstream_of_attention.specs),
                 Buffer("delta", (self.batch * self.config.heads, self.nv), fp32) if ours else None,
                 Buffer("dq", (tv, d), c) if ours else None]
        if self.casts:
            specs.append(Buffer("go_c", (tv, d), c))
        if self.stacked:
            specs.append(Buffer("dkv", (tt, 2 * d), c))
        elif ours:
            specs += [Buffer("dk", (tt, d), c), Buffer("dv", (tt, d), c)]
        specs += self.split_buffers(self.split)
        specs += [Buffer(f"parts_{name}", ((steps.row_norm_parts if self.rows_passed and name in ("bq", "bk") else
                                            steps.column_sum_parts)(rows), d), fp32)
                  for name, rows in (("bo", tv), ("bq", tv), ("bk", tt), ("bv", tt))]
        if self.norm:  # the norms' weight gradients: partial rows, then their column sums' parts
            specs += [Buffer(f"parts_n{name}", (steps.row_norm_parts(rows), d), fp32) for name, rows in (("q", tv), ("k", tt))]
            specs += [Buffer(f"sums_n{name}", (steps.column_sum_parts(steps.row_norm_parts(rows)), d), fp32)
                      for name, rows in (("q", tv), ("k", tt))]
        if not self.save:  # the backward's own forward
            specs += self.activations.specs + self.forward_scratch.specs
        return Arena([*specs, *self.turned.specs])

    @functools.cached_property
    def weight_grads(self):
        """The parameters' gradients, in one allocation (they live as long as each other: until the
        optimizer has used them); grad_Wk and grad_Wv as the row blocks of one product where `stacked`."""
        d, io, n = self.config.hidden, self.io, self.needs
        wk, wv = Buffer("grad_wk", (d, d), io), Buffer("grad_wv", (d, d), io)
        stacked = self.stacked
        return Outputs([Buffer("grad_wq", (d, d), io) if n[2] else None, Buffer("grad_bq", (d,), io) if n[3] else None,
                      Stack("grad_wkv", (wk, wv)) if stacked and (n[4] or n[6]) else None,
                      wk if n[4] and not stacked else None,
                      Buffer("grad_bk", (d,), io) if n[5] else None,
                      wv if n[6] and not stacked else None,
                      Buffer("grad_bv", (d,), io) if n[7] else None,
                      Buffer("grad_wo", (d, d), io) if n[8] else None, Buffer("grad_bo", (d,), io) if n[9] else None,
                      Buffer("grad_nq", (d,), io) if self.norm and n[10] else None,
                      Buffer("grad_nk", (d,), io) if self.norm and n[11] else None], separate=self.own_grads)


def _guard(plan: Plan, direction: str, device, owner: int = 0):
    """The fp16 guard of the forward or the backward (`train/guard.py: of`; None on bfloat16 products)."""
    return guards.of(plan, LABEL, direction, FORWARD_REGIONS if direction == "forward" else BACKWARD_REGIONS, device,
                     owner)


def _tables(p: Plan, inputs) -> tuple:
    """(cos, sin) of the inputs' RoPE tables, [Nv, D] each (after the norms' weights), or (None, None)."""
    if not p.rope:
        return None, None
    at = 10 + 2 * p.norm
    return tuple(t.view(p.nv, p.config.head_dim) for t in inputs[at:at + 2])


def _forward_launches(p: Plan, g, x, a, s, scale: float) -> list:
    """The forward up to O and lse, from the inputs x (video, text, wq, bq, wk, bk, wv, bv, wo[, nq, nk][,
    cos, sin]: the inputs without bo) into the activations a and the scratch s (the output weight's fp16
    copy too: the backward reads it)."""
    video, text, wq, bq, wk, bk, wv, bv, wo = x[:9]
    d = p.config.hidden
    q_out = a.q_raw if p.norm else a.q
    if p.casts:
        launches = [steps.cast(video, a.video_c, g, "video_latents"), steps.cast(text, a.text_c, g, "text_embeddings"),
                    steps.cast(wq, a.wq_c, g, "query_weight"), steps.cast(wk, a.wkv_c[:d], g, "key_weight"),
                    steps.cast(wv, a.wkv_c[d:], g, "value_weight"), steps.cast(wo, a.wo_c, g, "output_weight"),
                    steps.cast(bq, s.bq_c, g, "biases"), steps.cast(bk, s.bkv_c[:d], g, "biases"),
                    steps.cast(bv, s.bkv_c[d:], g, "biases"),
                    addmm(s.bq_c, a.video_c, a.wq_c.T, q_out), addmm(s.bkv_c, a.text_c, a.wkv_c.T, a.kv)]
        k_raw, v = a.kv[:, :d], a.kv[:, d:]
    else:
        k_raw = a.k_raw if p.norm else a.k
        launches = [addmm(bq, video.view(p.tv, d), wq.T, q_out), addmm(bk, text.view(p.tt, d), wk.T, k_raw),
                    addmm(bv, text.view(p.tt, d), wv.T, a.v)]
        v = a.v
    t = _turned(p, a, s)
    if p.norm:
        launches += [steps.row_norm(a.q_raw, None, None, p.eps, rstd=a.q_rstd)] if p.q_on_load else []
        launches += _norm_and_turn(p, x[9], x[10], _tables(p, [*x[:9], None, *x[9:]]), a.q_raw, k_raw, t)
    elif p.rope:  # turned in place
        rope = (*_tables(p, [*x[:9], None, *x[9:]]), p.config.head_dim)
        launches += [steps.row_norm(a.q, None, a.q, p.eps, rope=rope), steps.row_norm(k_raw, None, k_raw, p.eps, rope=rope)]
    k = t.k if p.norm else k_raw
    q, q_norm = _queries(p, t, x[9] if p.norm else None)
    if not p.cudnn:  # (cuDNN's attention allocates its outputs: the callers' `Allocating` steps)
        launches += steps.attention_forward(p.attention, p.tiles, q, k, v, a.o, a.lse, scale, g, q_norm=q_norm)
    return launches


def _turned(p: Plan, a, s):
    """Where the normed (and turned) Q and K lie: the scratch s where they are turned anew (`Plan.turned_anew`: s
    holds `Plan.turned`), else the activations a (the backward recomputing its own forward: a is s)."""
    return s if p.turned_anew else a


def _norm_and_turn(p: Plan, nq, nk, tables, q_raw, k_raw, t) -> list:
    """The norms (weights nq, nk) of the projections' rows q_raw, k_raw into t.q (unless the attention norms Q as it
    loads it) and t.k, each with its RoPE turn where the plan has one (tables: `_tables`; one pass over the rows)."""
    rope = (*tables, p.config.head_dim) if p.rope else None
    return (([] if p.q_on_load else [steps.row_norm(q_raw, nq, t.q, p.eps, rope=rope)])
            + [steps.row_norm(k_raw, nk, t.k, p.eps, rope=rope)])


def _keys_values(p: Plan, a, t) -> tuple:
    """(K, V) as the attention reads them (t: `_turned`)."""
    if p.casts:
        d = p.config.hidden
        return (t.k if p.norm else a.kv[:, :d]), a.kv[:, d:]
    return t.k, a.v


def _queries(p: Plan, a, norm_weight) -> tuple:
    """(q, q_norm) of the attention launches: with the q norm applied on load, the rows before it and the
    norm to apply as they are loaded (no normed copy of Q is kept), else Q (a: `_turned`'s)."""
    return (a.q_raw, (a.q_rstd, norm_weight)) if p.q_on_load else (a.q, None)


def forward(inputs, scale: float, plan: Plan):
    """(out, activations): out [B, Nv, hidden] in the inputs' dtype; activations the allocation the
    backward reads (None with save=False). inputs: video, text, wq, bq, wk, bk, wv, bv, wo, bo (then
    with qk_norm the norms' weights nq, nk; then with rope the tables cos, sin)."""
    video, text, wq, bq, wk, bk, wv, bv, wo, bo = inputs[:10]
    device = video.device
    g = _guard(plan, "forward", device, inputs[2].data_ptr())
    if g is not None:
        g.poll()
    acts, scratch = plan.activations, plan.forward_scratch
    a_flat, s_flat = acts.allocate(device), scratch.allocate(device)
    out = buffers.empty(video.shape, plan.io, device)

    key = ("wan_xattn forward", plan, scale)

    def build():
        a, s = acts.views(a_flat), scratch.views(s_flat)
        t = _turned(plan, a, s)
        launches = _forward_launches(plan, g, inputs[:9] + inputs[10:], a, s, scale)
        o2 = out.view(plan.tv, plan.config.hidden)
        if plan.cudnn:  # O and lse into the saved activations (cuDNN allocates its own), the output projection
            launches.append(Allocating(
                key, lambda: cudnn.forward(plan.attention, t.q, *_keys_values(plan, a, t), scale),
                lambda o, lse: [lambda: a.o.copy_(o), lambda: a.lse.copy_(lse), addmm(bo, o, wo.T, o2)],
                "cuDNN's attention forward"))
        elif plan.casts:  # fp32 output: the bias added in fp32
            launches += [mm(a.o, a.wo_c.T, o2), lambda: o2.add_(bo)]
        else:
            launches.append(addmm(bo, a.o, wo.T, o2))
        if g is not None:
            launches.append(steps.check(g))
        return launches

    execute(key, device, bases(*inputs, out, a_flat, s_flat, *guards.tensors(g)), build)
    if g is not None and device.type != "cuda":
        g.poll()  # the interpreter ran it already: warn now
    return out, (a_flat if plan.save else None)


def backward(inputs, grad_out, scale: float, plan: Plan, a_flat):
    """The gradients of the forward's inputs (official output order; None where not needed). a_flat:
    the forward's activations (None: recomputed here)."""
    video, text, wq, bq, wk, bk, wv, bv, wo, bo = inputs[:10]
    device, p, n = video.device, plan, plan.needs
    g = _guard(p, "backward", device, inputs[2].data_ptr())
    fg = _guard(p, "forward", device, inputs[2].data_ptr()) if a_flat is None else None
    for each in (g, fg):
        if each is not None:
            each.poll()
    tv, tt, d = p.tv, p.tt, p.config.hidden
    acts, scratch, wgrads = p.activations, p.backward_scratch, p.weight_grads
    s_flat, (w, w_bases) = scratch.allocate(device), wgrads.allocate(device)
    grad_video = buffers.empty(video.shape, p.io, device) if n[0] else None
    grad_text = buffers.empty(text.shape, p.io, device) if n[1] else None
    go = grad_out.contiguous()
    key = ("wan_xattn backward", p, scale)

    def build():
        s, go2 = scratch.views(s_flat), go.view(tv, d)
        a = s if a_flat is None else acts.views(a_flat)
        launches = []
        if a_flat is None:
            launches += _forward_launches(p, fg, inputs[:9] + inputs[10:], a, s, scale)
            if fg is not None:
                launches.append(steps.check(fg))
        if p.casts:
            launches += steps.upstream_casts(g, [(go2, s.go_c, "grad_output", None)])
            go_c, wq_c, wo_c, video_c, text_c = s.go_c, a.wq_c, a.wo_c, a.video_c, a.text_c
            k_raw, v, dk, dv = a.kv[:, :d], a.kv[:, d:], s.dkv[:, :d], s.dkv[:, d:]
        else:
            go_c, wq_c, wo_c, video_c, text_c = go2, wq, wo, video.view(tv, d), text.view(tt, d)
            k_raw, v = (a.k_raw if p.norm else a.k), a.v
            if p.cudnn:
                dk, dv = None, None  # (cuDNN's: its own tensors)
            else:
                dk, dv = (s.dkv[:, :d], s.dkv[:, d:]) if p.stacked else (s.dk, s.dv)
        t = _turned(p, a, s)
        if p.turned_anew:  # Q and K normed and turned again
            launches += _norm_and_turn(p, inputs[10], inputs[11], _tables(p, inputs), a.q_raw, k_raw, t)
        k = t.k if p.norm else k_raw
        q, q_norm = _queries(p, t, inputs[10] if p.norm else None)
        dc = (p.upstream_of_attention.views(bytes_of(grad_video)) if n[0] else s).dc
        if n[9]:
            launches += steps.column_sums(go_c, w.grad_bo, s.parts_bo, g, unscale=True)

        def after(dq, dk, dv) -> list:
            """From the attention's dQ, dK, dV on: RoPE's and the norms' backward (in place), the bias sums,
            the products with the inputs."""
            launches = []
            rope = (*_tables(p, inputs), p.config.head_dim) if p.rope else None
            bq, bk = (s.parts_bq if n[3] else None), (s.parts_bk if n[5] else None)  # (with `rows_passed`)
            if p.norm:  # RoPE's transpose and the norms' backward, in place: dQ, dK before the turn and the norms
                launches += [steps.row_norm_backward(dq, a.q_raw, inputs[10], dq, s.parts_nq, p.eps, g,
                                                     "gradient of queries", rope=rope, bias_parts=bq),
                             steps.row_norm_backward(dk, k_raw, inputs[11], dk, s.parts_nk, p.eps, g, "gradient of keys",
                                                     rope=rope, bias_parts=bk)]
            elif p.rope:  # RoPE's transpose alone, in place
                launches += [steps.row_norm_backward(dq, None, None, dq, None, p.eps, g, "gradient of queries", rope=rope,
                                                     bias_parts=bq),
                             steps.row_norm_backward(dk, None, None, dk, None, p.eps, g, "gradient of keys", rope=rope,
                                                     bias_parts=bk)]
            if p.norm:  # the norms' weight gradients
                for need, out, parts, sums in ((n[10], "grad_nq", s.parts_nq, s.sums_nq),
                                               (n[11], "grad_nk", s.parts_nk, s.sums_nk)):
                    if need:
                        launches += steps.column_sums(parts, getattr(w, out), sums, g, unscale=True)
            for need, out, x, parts, summed in ((n[3], "grad_bq", dq, s.parts_bq, p.rows_passed),
                                                (n[5], "grad_bk", dk, s.parts_bk, p.rows_passed),
                                                (n[7], "grad_bv", dv, s.parts_bv, False)):
                if need:  # (summed: the row pass summed the parts)
                    launches += (steps.column_finish(parts, getattr(w, out), g, unscale=True) if summed else
                                 steps.column_sums(x, getattr(w, out), parts, g, unscale=True))
            if n[0]:
                launches.append(mm(dq, wq_c, grad_video.view(tv, d)))
            if n[2]:
                launches.append(mm(dq.T, video_c, w.grad_wq))
            if n[1]:
                gt = grad_text.view(tt, d)
                launches += [mm(s.dkv, a.wkv_c, gt)] if p.casts else [mm(dk, wk, gt), accumulate(gt, dv, wv)]
            if p.stacked and (n[4] or n[6]):
                launches.append(mm(s.dkv.T, text_c, wgrads.stack(w, "grad_wkv")))
            if not p.stacked and n[4]:
                launches.append(mm(dk.T, text_c, w.grad_wk))
            if not p.stacked and n[6]:
                launches.append(mm(dv.T, text_c, w.grad_wv))
            return launches

        through_attention = any(n[:8]) or (p.norm and any(n[10:12]))
        if p.cudnn:  # cuDNN's attention (its forward first without saved activations), then the rest
            def attention():
                o, lse = cudnn.forward(p.attention, t.q, k, v, scale) if a_flat is None else (a.o, a.lse)
                return o, (cudnn.backward(p.attention, t.q, k, v, o, lse, dc, scale) if through_attention else ())

            def rest(o, grads):
                return ([mm(go_c.T, o, w.grad_wo)] if n[8] else []) + (after(*grads) if through_attention else [])

            launches += [mm(go_c, wo_c, dc)] if through_attention else []
            launches.append(Allocating(key, attention, rest, "cuDNN's attention backward"))
        else:
            if n[8]:
                launches.append(mm(go_c.T, a.o, w.grad_wo))
            if through_attention:
                att = p.attention
                launches += [mm(go_c, wo_c, dc), steps.attention_delta(att, a.o, dc, s.delta, g)]

                def gradients(split, views) -> list:
                    """dQ, dK, dV at `split`: where the key blocks split, fp32 atomic sums, then their copies in the
                    compute dtype."""
                    if split == 1:
                        return steps.attention_backward(att, p.tiles, 1, q, k, v, dc, a.lse, views.delta, views.dq, dk,
                                                        dv, scale, g, q_norm=q_norm)
                    if p.stacked:
                        return [steps.zero(views.dkv32),
                                *steps.attention_backward(att, p.tiles, split, q, k, v, dc, a.lse, views.delta, views.dq,
                                                          views.dkv32[:, :d], views.dkv32[:, d:], scale, g, q_norm=q_norm),
                                steps.cast(views.dkv32, views.dkv, g, "gradient of keys")]
                    return [steps.zero(views.dk32), steps.zero(views.dv32),
                            *steps.attention_backward(att, p.tiles, split, q, k, v, dc, a.lse, views.delta, views.dq,
                                                      views.dk32, views.dv32, scale, g, q_norm=q_norm),
                            steps.cast(views.dk32, views.dk, g, "gradient of keys"),
                            steps.cast(views.dv32, views.dv, g, "gradient of values")]
                launches += gradients(p.split, s)
                steps.compile_other_split(p, s, gradients)
                launches += after(s.dq, dk, dv)
        if g is not None and g.scaled:
            products = [grad_video, grad_text, getattr(w, "grad_wq", None),
                        wgrads.stack(w, "grad_wkv") if wgrads.stacks else None, getattr(w, "grad_wo", None)]
            launches += [steps.unscale(t, g) for t in products if t is not None]
        if g is not None:
            launches.append(steps.check(g))
        return launches

    execute(key, device, bases(*inputs, go, grad_video, grad_text, *w_bases, s_flat, a_flat, *guards.tensors(g, fg)),
            build)
    for each in (g, fg):
        if each is not None and device.type != "cuda":
            each.poll()
    wgrads.own(w)
    grads = (grad_video, grad_text, getattr(w, "grad_wq", None), getattr(w, "grad_bq", None),
             getattr(w, "grad_wk", None) if n[4] else None, getattr(w, "grad_bk", None),
             getattr(w, "grad_wv", None) if n[6] else None, getattr(w, "grad_bv", None), getattr(w, "grad_wo", None),
             getattr(w, "grad_bo", None))
    return grads + ((getattr(w, "grad_nq", None), getattr(w, "grad_nk", None)) if p.norm else ()) + (
        (None, None) if p.rope else ())  # the RoPE tables take no gradient


def problem_backward(problem, inputs, needs: tuple) -> tuple:
    """`Problem.backward` of 021: the official inputs (validated: grad_output, the forward's inputs, scale) at
    `problem.config`'s sizes, without saved activations (the forward's launches run again first)."""
    go, *fwd, scale = inputs
    fwd = plans.contiguous(fwd)
    video, text = fwd[:2]
    deterministic = torch.are_deterministic_algorithms_enabled()
    plan = plans.cached(("021 problem", problem.config, plans.signature(fwd), deterministic), lambda: Plan(
        video.shape[0], video.shape[1], text.shape[1], problem.config, video.dtype, save=False,
        sms=plans.sm_count(video.device), deterministic=deterministic))
    return backward(fwd, go, scale, plans.needs_plan(plan, needs + (False,) * (len(plan.needs) - len(needs))), None)
