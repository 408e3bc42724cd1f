"""diffusers' Wan attentions on backfuse's `wan_xattn`.

Both attentions of a Wan transformer block (`WanAttention`s: `attn1`, the self-attention over the video,
and `attn2`, the cross-attention to the text) get a processor that computes the whole attention (q, k, v
projections with biases, RMSNorm of q and k across the heads, softmax(Q K^T / sqrt(head size)) V, the
output projection) as one `F.wan_xattn` call where the projections are plain `nn.Linear` layers; otherwise
(PEFT's LoRA layers, quantized or hooked projections) the projections are the modules' own (PEFT's vanilla LoRA
layers with the plain ones beside them in one computation: `lora.project`) and `F.wan_attention` computes what
lies between them; the self-attention's q and k turned by its rotary embedding
after their norms (`rope=`: diffusers' (cos, sin) tables [1, N, 1, D], pairs as `apply_rotary_emb` turns
them). I2V's cross-attention (`add_k_proj`: the image context's tokens before the text encoder's 512, as diffusers
splits them) attends to the image apart, through its own k, v projections and k norm, and adds it to the text's
before the output projection: the projections are then the modules' own and two `F.wan_attention`s the cores.
Served when: the cross-attention has no rotary embedding, and with image context its image k norm is an RMSNorm
like the text's; the self-attention's rotary embedding is such a pair of tables with a row per
video token, and it is not split across ranks (context parallelism); there is no attention mask; the
projections are not fused by `fuse_projections`; q, k and v have the model width; the output dropout is off
(or the module is in eval mode); and the processor it replaced is diffusers' own `WanAttnProcessor` on an
exact attention backend (not SageAttention's quantized ones). Otherwise the processor it replaced runs, counted by reason
(`backfuse.fallbacks(model)`); what diffusers sets on the module's processor afterwards (its attention
backend, context parallelism) is set on that processor.
"""

from __future__ import annotations

import math
import sys
from collections import Counter

import torch

from .. import functional as F
from ..problem import fused_unusable
from . import PATCHED, fall_back, lora, plain_linear, replaced_forward, unusable_dtype


def _is_wan_attention(module, patched: bool = False) -> bool:
    if type(module).__name__ != "WanAttention" or not type(module).__module__.startswith("diffusers."):
        return False
    return patched == (getattr(module, PATCHED, None) is not None)


class WanAttnProcessor:
    """The processor `bind` sets on a Wan attention: backfuse where it covers the call, else the processor it
    replaced."""

    def __init__(self, own):
        self.own = own

    # What diffusers sets on a module's processor (`set_attention_backend`, context parallelism) reaches the
    # processor this one replaced, which computes every call backfuse does not serve.
    _attention_backend = property(lambda self: getattr(self.own, "_attention_backend", None),
                                  lambda self, value: setattr(self.own, "_attention_backend", value))
    _parallel_config = property(lambda self: getattr(self.own, "_parallel_config", None),
                                lambda self, value: setattr(self.own, "_parallel_config", value))

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        reason = _own_processor(self.own, encoder_hidden_states is None) or _why_not(
            attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if reason:
            fall_back(attn, reason)
            return self.own(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        head_dim = attn.inner_dim // attn.heads
        norm_q, norm_k = attn.norm_q, attn.norm_k
        eps = norm_q.eps if norm_q.eps is not None else torch.finfo(hidden_states.dtype).eps
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        scale = 1 / math.sqrt(head_dim)
        if _plain_projections(attn) and attn.add_k_proj is None:
            out = F.wan_xattn(hidden_states, context, attn.to_q.weight, attn.to_q.bias, attn.to_k.weight,
                              attn.to_k.bias, attn.to_v.weight, attn.to_v.bias, attn.to_out[0].weight,
                              attn.to_out[0].bias, scale, heads=attn.heads, norm_q_weight=norm_q.weight,
                              norm_k_weight=norm_k.weight, eps=eps, rope=rotary_emb)
            return attn.to_out[1](out)
        # The projections as the modules compute them (`lora.project` where it serves), the cores backfuse's; I2V's
        # image context (its first tokens: all but the text encoder's 512, as diffusers splits it) attended apart
        # through its own k, v projections and k norm, the two attentions summed before the output projection.
        image = None
        if attn.add_k_proj is not None:
            split = context.shape[1] - I2V_TEXT
            image, context = context[:, :split], context[:, split:]
        q, k, v = _project(attn, (("to_q", hidden_states), ("to_k", context), ("to_v", context)))
        a = F.wan_attention(q, k, v, norm_q.weight, norm_k.weight, scale, heads=attn.heads, eps=eps, rope=rotary_emb)
        if image is not None:
            k_image, v_image = _project(attn, (("add_k_proj", image), ("add_v_proj", image)))
            a = a + F.wan_attention(q, k_image, v_image, norm_q.weight, attn.norm_added_k.weight, scale,
                                    heads=attn.heads, eps=eps)
        return attn.to_out[1](_project(attn, (("to_out.0", a),))[0])


def _own_processor(own, self_attention: bool) -> str | None:
    """Why the replaced processor does not compute what backfuse does, or None: it must be diffusers' own
    `WanAttnProcessor` (a custom one computes what its author wrote), its attention backend an exact one
    (SageAttention's quantize Q, K and P), and a self-attention not split across ranks (diffusers' context
    parallelism gathers the other ranks' keys; the cross-attention's text is whole on every rank)."""
    if type(own).__name__ != "WanAttnProcessor" or not type(own).__module__.startswith("diffusers."):
        return f"the processor it replaced is a {type(own).__module__}.{type(own).__name__}, not diffusers' WanAttnProcessor"
    if self_attention and getattr(own, "_parallel_config", None) is not None:
        return "context parallelism (the self-attention's keys are split across ranks)"
    backend = getattr(own, "_attention_backend", None)
    if backend is None:
        registry = getattr(sys.modules.get("diffusers.models.attention_dispatch"), "_AttentionBackendRegistry", None)
        backend = getattr(registry, "_active_backend", None)
    name = getattr(backend, "value", backend)
    if isinstance(name, str) and "sage" in name:
        return f"diffusers' attention backend {name!r} (quantized attention; backfuse's is exact)"
    return None


def _why_not(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb) -> str | None:
    unusable = fused_unusable(hidden_states.device)
    if unusable:
        return f"backfuse's kernels cannot run here: {unusable}"
    dtype = unusable_dtype("hidden states", hidden_states) or unusable_dtype("encoder hidden states",
                                                                             encoder_hidden_states)
    if dtype:
        return dtype
    if attn.add_k_proj is not None:  # I2V: the image context before the text, split as diffusers slices it
        tokens = range(encoder_hidden_states.shape[1]) if encoder_hidden_states is not None else range(0)
        split = len(tokens) - I2V_TEXT
        if not tokens[:split] or not tokens[split:]:
            return "an image or text context of no tokens (I2V)"
        norm = attn.norm_added_k
        if type(norm) is not torch.nn.RMSNorm or norm.weight is None or norm.eps != attn.norm_k.eps:
            return "an image k norm other than RMSNorm with weights and the text's eps"
        if norm._forward_hooks or norm._forward_pre_hooks or replaced_forward(norm):
            return "norm_added_k has hooks or its forward replaced on the module"
        if attn.add_k_proj.out_features != attn.inner_dim or attn.add_v_proj.out_features != attn.inner_dim:
            return "image k, v of another width than q"
    if attention_mask is not None:
        return "an attention mask"
    if encoder_hidden_states is None:  # the self-attention: turned by its rotary embedding, or not served
        head_dim = attn.inner_dim // attn.heads
        tokens = hidden_states.shape[1] if hidden_states.dim() == 3 else None
        if not (isinstance(rotary_emb, (tuple, list)) and len(rotary_emb) == 2 and all(
                isinstance(t, torch.Tensor) and tuple(t.shape) == (1, tokens, 1, head_dim) and not t.requires_grad
                for t in rotary_emb)):
            return "a self-attention without diffusers' rotary tables (cos, sin) [1, tokens, 1, head size]"
    elif rotary_emb is not None:
        return "a rotary embedding on the cross-attention"
    if getattr(attn, "fused_projections", False):
        return "fused projections"
    if attn.kv_inner_dim != attn.inner_dim or attn.to_k.in_features != attn.to_q.in_features:
        return "k, v or the text context of another width than q"
    if attn.to_out[0].out_features != attn.inner_dim or attn.to_q.in_features != attn.inner_dim:
        return "a model width other than heads x head size"
    for name, norm in (("norm_q", attn.norm_q), ("norm_k", attn.norm_k)):
        if type(norm) is not torch.nn.RMSNorm or norm.weight is None:
            return "q, k norms other than RMSNorm with weights"
        if norm._forward_hooks or norm._forward_pre_hooks or replaced_forward(norm):
            return f"{name} has hooks or its forward replaced on the module"
    if attn.training and attn.to_out[1].p:
        return "output dropout"
    return None


I2V_TEXT = 512  # the text encoder's tokens after a Wan I2V cross-attention's image context (diffusers' split)


def _linear(attn, name: str):
    return attn.to_out[0] if name == "to_out.0" else getattr(attn, name)


def _plain_projections(attn) -> bool:
    """Whether to_q, to_k, to_v and to_out.0 are plain nn.Linear layers whose weights `wan_xattn` may read."""
    return all(plain_linear(name, _linear(attn, name), bias=True) is None for name in ("to_q", "to_k", "to_v", "to_out.0"))


def _project(attn, calls) -> list:
    """The projections (name, input) as the modules compute them: those of one input together by `lora.project`
    where each is a plain or a vanilla LoRA layer (not under torch.compile), the others by calling the module."""
    out, groups = {}, {}
    for name, x in calls:
        groups.setdefault(id(x), (x, []))[1].append(name)
    for x, names in groups.values():
        parts = None if torch.compiler.is_compiling() else [lora.parts(n, _linear(attn, n), bias=True) for n in names]
        if parts is not None and not any(isinstance(p, str) for p in parts):
            out.update(zip(names, lora.project(x, parts)))
        else:
            out.update((n, _linear(attn, n)(x)) for n in names)
    return [out[name] for name, _ in calls]


def bind(module) -> None:
    own = module.get_processor() if hasattr(module, "get_processor") else module.processor
    setattr(module, PATCHED, {"processor": own, "fallbacks": Counter()})
    module.set_processor(WanAttnProcessor(own))


def unbind(module) -> None:
    state = getattr(module, PATCHED)
    module.set_processor(state["processor"])
    delattr(module, PATCHED)


KINDS = [("diffusers WanAttention", _is_wan_attention, bind, unbind)]
