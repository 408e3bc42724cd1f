"""A model's projections of one input computed together where some are PEFT LoRA layers: the base products, then
one product for every adapter's A, then each adapter's B added into its projection's output.

For projections i of x (the q, k and v projections of one attention, or its output projection), each a plain
`nn.Linear` (W_i, b_i) or PEFT's LoRA `Linear` around one with a single active adapter (A_i [r_i, in], B_i
[out_i, r_i], scaling s_i):
    y_i = x W_i^T + b_i + s_i (x A_i^T) B_i^T
Forward: y_i = x W_i^T + b_i (one product each), U = x [A_1; A_2; ...]^T (one product for all adapters), y_i +=
s_i U_i B_i^T (one each, into y_i). Backward from dy_i:
    dU_i = s_i dy_i B_i,  grad_B_i = s_i dy_i^T U_i,  grad_[A_1; A_2; ...] = dU^T x
    grad_x = sum_i dy_i W_i + dU [A_1; A_2; ...],  grad_W_i = dy_i^T x,  grad_b_i = sum dy_i
(the base's gradients only where they require one: PEFT freezes them). PEFT's own forward runs, per adapter, its
A and B products, the scaling and the sum as separate operations, each reading or writing a projection-sized
tensor, and as many again backward; here a LoRA projection costs its base product and two small ones each way.
An adapter whose LoRA dropout is in effect reads its own input, D_i(x): the layer's dropout module, called as PEFT
calls it (on x cast to the adapters' dtype, the layers in their order, so the random masks are the layer's own),
outside this computation (autograd takes its backward); its U_i is a product of its own, and grad_A_i = dU_i^T D_i(x),
with dU_i A_i handed back to the dropout.

What PEFT computes: the adapters' products in their own dtype (x cast to it, PEFT's `_cast_input_dtype`), the sum
then cast to the base result's dtype; under autocast every product in the autocast dtype. A LoRA layer is served
only where its forward is that vanilla sum: adapters enabled and not merged, one active adapter (none: the base
alone), the dropout torch's own `nn.Dropout` (or none), no DoRA or other variant, no LoRA bias, plain `nn.Linear`
layers inside without hooks. Otherwise the caller runs the modules themselves (`parts` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import plain_linear, replaced_forward


@dataclass(frozen=True)
class Part:
    """One projection: its base weight and bias, and its adapter's A, B and scaling (None, None, 0.0: none), and
    the adapter's dropout module where dropout is in effect (training, p > 0), else None."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scaling: float = 0.0
    dropout: torch.nn.Dropout | None = None


def parts(name: str, linear, *, bias: bool) -> Part | str:
    """`linear` as a Part (a plain nn.Linear, or PEFT's LoRA Linear whose forward is the vanilla sum), or why not."""
    if type(linear) is torch.nn.Linear:
        reason = plain_linear(name, linear, bias=bias)
        return reason or Part(linear._parameters["weight"], linear._parameters.get("bias"))
    if type(linear).__name__ != "Linear" or type(linear).__module__ != "peft.tuners.lora.layer":
        return plain_linear(name, linear, bias=bias)
    if linear._forward_hooks or linear._forward_pre_hooks or replaced_forward(linear):
        return f"{name} (a LoRA layer) has hooks or its forward replaced"
    if linear.disable_adapters or linear.merged:
        return f"{name}'s adapters are disabled or merged"
    modules = linear._modules  # (read as dicts: this runs at every call of every patched layer)
    base = modules["base_layer"]
    reason = plain_linear(f"{name}.base_layer", base, bias=bias)
    if reason:
        return reason
    weights = base._parameters
    adapters = modules["lora_A"]._modules
    active = [a for a in linear.active_adapters if a in adapters]
    if not active:
        return Part(weights["weight"], weights.get("bias"))
    if len(active) > 1:
        return f"{name} has {len(active)} active adapters"
    key = active[0]
    dropout = modules["lora_dropout"]._modules[key]
    if type(dropout) not in (torch.nn.Identity, torch.nn.Dropout) or dropout._forward_hooks \
            or dropout._forward_pre_hooks or replaced_forward(dropout):
        return f"{name}'s LoRA dropout is not torch's nn.Dropout"
    in_effect = type(dropout) is torch.nn.Dropout and dropout.p > 0 and dropout.training
    if key in linear.__dict__.get("lora_variant", {}) or linear.use_dora.get(key, False):
        return f"{name}'s adapter is a LoRA variant (DoRA or another)"
    a_layer, b_layer = adapters[key], modules["lora_B"]._modules[key]
    for part, layer in (("lora_A", a_layer), ("lora_B", b_layer)):
        reason = plain_linear(f"{name}.{part}", layer, bias=False)
        if reason:
            return reason
    a, b = a_layer._parameters["weight"], b_layer._parameters["weight"]
    if a.dtype != b.dtype or not linear.__dict__.get("cast_input_dtype_enabled", True):
        return f"{name}'s adapter weights in two dtypes, or its input cast turned off"
    return Part(weights["weight"], weights.get("bias"), a, b, float(linear.scaling[key]), dropout if in_effect else None)


def project(x: torch.Tensor, projections: list) -> tuple:
    """(y_1, ...) of the Parts `projections` on x [..., in]: each y_i [..., out_i], as the layers would give them."""
    kind = x.device.type
    tensors = [x]
    for p in projections:
        dropped = None
        if p.dropout is not None:  # (PEFT's input cast, then the layer's own dropout module: its random mask)
            dropped = p.dropout(x if x.dtype == p.a.dtype else x.to(p.a.dtype))
        tensors += [p.weight, p.bias, p.a, p.b, dropped]
    if torch.is_autocast_enabled(kind):  # every product in the autocast dtype, as autocast runs the layers'
        dtype = torch.get_autocast_dtype(kind)
        tensors = [t if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors]
        with torch.autocast(kind, enabled=False):
            return _Project.apply(tuple(p.scaling for p in projections), *tensors)
    return _Project.apply(tuple(p.scaling for p in projections), *tensors)


GROUP = 5  # a projection's tensors in _Project: weight, bias, A, B, its adapter's own input (dropped) or None


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scalings, x, *tensors):
        x2 = x.reshape(-1, x.shape[-1])
        groups = [tensors[i:i + GROUP] for i in range(0, len(tensors), GROUP)]
        ys = [torch.nn.functional.linear(x2, w, bias) for w, bias, *_ in groups]
        adapted = [i for i, g in enumerate(groups) if g[2] is not None]
        shared = [i for i in adapted if groups[i][4] is None]  # adapters reading x: one product for all
        us = {}
        a_cat = None
        if shared:
            a_cat = torch.cat([groups[i][2] for i in shared]) if len(shared) > 1 else groups[shared[0]][2]
            u = x2.to(a_cat.dtype) @ a_cat.T  # (PEFT's input cast to the adapters' dtype: nothing where it is x's)
            at = 0
            for i in shared:
                us[i] = u[:, at:at + groups[i][2].shape[0]]
                at += groups[i][2].shape[0]
        for i in adapted:
            a, b, own = groups[i][2], groups[i][3], groups[i][4]
            if own is not None:
                us[i] = own.reshape(-1, own.shape[-1]) @ a.T
            if b.dtype == ys[i].dtype:
                ys[i].addmm_(us[i], b.T, alpha=scalings[i])
            else:  # the sum in the adapters' dtype, then the base result's, as PEFT's
                ys[i] = torch.addmm(ys[i].to(b.dtype), us[i], b.T, alpha=scalings[i]).to(ys[i].dtype)
        ctx.save_for_backward(x, a_cat, *tensors, *(us[i] for i in adapted))
        ctx.scalings, ctx.adapted, ctx.shared = scalings, adapted, shared
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx, *dys):
        x, a_cat, *saved = ctx.saved_tensors
        tensors, us = saved[:len(saved) - len(ctx.adapted)], dict(zip(ctx.adapted, saved[len(saved) - len(ctx.adapted):]))
        groups = [tensors[i:i + GROUP] for i in range(0, len(tensors), GROUP)]
        needs = ctx.needs_input_grad[2:]
        x2 = x.reshape(-1, x.shape[-1])
        dys = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        grads = [None] * len(tensors)
        grad_x = None
        for i, ((w, bias, *_), dy) in enumerate(zip(groups, dys)):
            if ctx.needs_input_grad[1]:
                grad_x = dy @ w if grad_x is None else grad_x.addmm_(dy, w)
            if needs[GROUP * i]:
                grads[GROUP * i] = dy.T @ x2
            if bias is not None and needs[GROUP * i + 1]:
                grads[GROUP * i + 1] = dy.sum(0)
        if not ctx.adapted:
            return (None, None if grad_x is None else grad_x.view(x.shape), *grads)
        rank = sum(groups[i][2].shape[0] for i in ctx.shared)
        du = torch.empty(rank, x2.shape[0], dtype=a_cat.dtype, device=x.device) if ctx.shared else None  # dU^T, shared
        at = 0
        for i in ctx.adapted:
            a, b, own = groups[i][2], groups[i][3], groups[i][4]
            r, s = a.shape[0], ctx.scalings[i]
            dy = dys[i].to(b.dtype)
            if own is None:
                du_i = torch.addmm(du[at:at + r], b.T, dy.T, beta=0, alpha=s, out=du[at:at + r])
                at += r
            else:
                du_i = torch.mm(b.T, dy.T).mul_(s)
                own2 = own.reshape(-1, own.shape[-1])
                if needs[GROUP * i + 2]:
                    grads[GROUP * i + 2] = du_i @ own2
                if needs[GROUP * i + 4]:
                    grads[GROUP * i + 4] = (du_i.T @ a).view(own.shape)
            if needs[GROUP * i + 3]:
                grads[GROUP * i + 3] = torch.addmm(b, dy.T, us[i], beta=0, alpha=s)
        if ctx.shared:
            if any(needs[GROUP * i + 2] for i in ctx.shared):
                grad_a = du @ x2.to(du.dtype)
                at = 0
                for i in ctx.shared:
                    r = groups[i][2].shape[0]
                    grads[GROUP * i + 2] = grad_a[at:at + r] if needs[GROUP * i + 2] else None
                    at += r
            if ctx.needs_input_grad[1]:
                if du.dtype == grad_x.dtype:
                    grad_x.addmm_(du.T, a_cat)
                else:  # (through PEFT's input cast: the adapters' dtype, then x's)
                    grad_x.add_((du.T @ a_cat).to(grad_x.dtype))
        return (None, None if grad_x is None else grad_x.view(x.shape), *grads)
