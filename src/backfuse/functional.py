"""Differentiable training ops on backfuse's fused kernels: forward and backward, any model size the
operator's config takes, float32, bfloat16 or float16 tensors.

    out = F.wan_xattn(video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale, heads=16)
    out = F.gemma3_core(hidden, cos, sin, wq, wk, wv, wo, q_norm_w, k_norm_w, scaling, softcap, eps, window=0)
    q, k, v = F.qkv_gqa(decoder_hidden, encoder_hidden, wq, wk, wv, head_dim=256)

Each is the operator's training path (`ops/<stem>/training.py`): a fused forward that saves what its
backward reads (`save_activations=False`: only the inputs; the backward then recomputes), and a
backward that computes only the gradients autograd asks for. Products run in the inputs' dtype
(bfloat16, float16) or on fp16 copies of float32 inputs, with fp32 sums; each output and gradient
comes back in its input's dtype. Neither direction makes the host wait for the GPU: the fp16 range
guard checks on the device and warns at the op's next call (`backfuse/train/guard.py`).

Under `torch.autocast` an op casts its floating inputs to the autocast dtype (as `F.linear` does;
autograd records the casts, so float32 weights get float32 gradients) and runs in it. Under
`torch.compile` an op is one opaque custom op (`torch.ops.backfuse.<stem>_forward` and `_backward`, at the
overload `OVERLOAD` that names these sources, so compile caches never serve another version's graph)
with the same kernels, saving its activations; eager calls go through `torch.autograd.Function`,
which costs the host less.

Validation: the first call of each shape and dtype checks every input (errors name the input, what
was expected and what was given) and makes the call's plan; later calls of that shape look the plan up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import math
import pathlib

import torch

from . import callsite
from . import problem as _problem
from .ops.gemma3_core.spec import Gemma3CoreConfig
from .ops.qkv_gqa.spec import QkvGqaConfig
from .ops.wan_xattn.spec import WanXattnConfig
from .problem import TRAINING_DTYPES, Tensor, check_real, fused_unusable
from .train import cudnn as _cudnn
from .train import masks as _masks
from .train import plans as _plan_cache


class _Lazy:
    """A training module, imported at its first use (importing backfuse imports no Triton: the Triton
    interpreter must be turned on before triton is first imported); then it takes this object's name."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __getattr__(self, attr):
        module = importlib.import_module(self.module)
        globals()[self.name] = module
        return getattr(module, attr)


_wan = _Lazy("backfuse.ops.wan_xattn.training", "_wan")
_qkv = _Lazy("backfuse.ops.qkv_gqa.training", "_qkv")
_gemma = _Lazy("backfuse.ops.gemma3_core.training", "_gemma")
_steps = _Lazy("backfuse.train.steps", "_steps")

_plans = _plan_cache._plans  # (op, signature, options) -> plan (`train/plans.py`)
_sm_count = _plan_cache.sm_count
_signature = _plan_cache.signature


def _validate(label: str, pid: str, specs, tensors) -> dict:
    """The axes the tensors imply (validated as Problem.validate does: errors name the input), where the
    kernels can run on their device (else a RuntimeError saying in one line why: `fused_unusable`)."""
    axes = _problem(pid).validate(tensors, specs=specs, dtypes=TRAINING_DTYPES, contiguous=False, same_dtype=True,
                                  label=label)
    reason = fused_unusable(tensors[0].device)
    if reason:
        raise RuntimeError(f"{label}: {reason}")
    return axes


def _autocasting(tensors) -> str | None:
    """The first input's device type where autocast is on for it, else None (also where the first input is no
    tensor, or on a device autocast does not know, such as meta: the validation then says what is wrong)."""
    device = getattr(tensors[0], "device", None)
    try:
        return device.type if device is not None and torch.is_autocast_enabled(device.type) else None
    except RuntimeError:
        return None


_NOTHING = contextlib.nullcontext()  # (reusable: entering it does nothing)


def _autocast(tensors) -> tuple:
    """(the floating tensors cast to the autocast dtype where autocast is on for their device, the context the
    op runs in: autocast off there, so that its products run in the dtype its inputs now have)."""
    device = _autocasting(tensors)
    if device is None:
        return tensors, _NOTHING
    dtype = torch.get_autocast_dtype(device)
    return ([t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors],
            torch.autocast(device, enabled=False))


def _finite_floats(*values) -> bool:
    """Whether every value is a finite float: the common case of a call's scalars, taken in one test (not while
    torch.compile traces: there the tests would make it guard on each value, a graph per value)."""
    return not torch.compiler.is_compiling() and all(type(v) is float and -math.inf < v < math.inf for v in values)


def _eps(value, where: str):
    """An RMSNorm's eps: a real number, at least 0 (a negative one makes a small row's norm NaN)."""
    eps = check_real(value, where)
    if isinstance(eps, float) and eps < 0:
        raise ValueError(f"{where} must be >= 0, got {eps}")
    return eps


_contiguous = _plan_cache.contiguous
_needs_plan = _plan_cache.needs_plan


def _attributed(site):
    """Warnings inside point at `site` (none: no warning can come, bfloat16 products)."""
    return _NOTHING if site is None else callsite.attributed_to(site)


def _site(plan):
    """Where a backward's warnings point: the forward's caller (fp16 products only: bfloat16's never warn)."""
    return callsite.user_site() if plan.guarded else None


# ---------------------------------------------------------------- 021 -------------------------------------------
_WAN_LABEL = "backfuse.functional.wan_xattn"


def _wan_plan(tensors, scale, heads, save, eps=1e-6, rope: bool = False):
    """The plan of a wan_xattn call: tensors the 10 inputs, then the norms' weights where there are norms, then
    the RoPE tables where rope."""
    key = ("021", _signature(tensors), heads, save, eps, rope, rope and _cudnn.enabled(),
           torch.are_deterministic_algorithms_enabled())
    plan = _plans.get(key)
    if plan is None:
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"{_WAN_LABEL}: heads must be a positive int, got {heads!r}")
        if not isinstance(tensors[0], torch.Tensor):
            raise TypeError(f"{_WAN_LABEL}: input 'video_latents' must be a torch.Tensor, got {type(tensors[0]).__name__}")
        hidden = tensors[0].shape[-1] if tensors[0].dim() == 3 else None
        if hidden is None or hidden % heads:
            raise ValueError(f"{_WAN_LABEL}: input 'video_latents' must be [batch, tokens, hidden] with hidden a multiple "
                             f"of heads={heads}, got shape {tuple(tensors[0].shape)}")
        norm = len(tensors) - 2 * rope > 10
        try:
            config = WanXattnConfig(hidden, heads, qk_norm=norm)
        except ValueError as e:
            raise ValueError(f"{_WAN_LABEL}: {e}") from None
        b, nv, nt = "batch_size", "num_video_tokens", "num_text_tokens"
        specs = [Tensor("video_latents", (b, nv, hidden)), Tensor("text_embeddings", (b, nt, hidden))] + [
            Tensor(f"{n}_{kind}", (hidden, hidden) if kind == "weight" else (hidden,))
            for n in ("query", "key", "value", "output") for kind in ("weight", "bias")]
        if norm:
            specs += [Tensor("norm_q_weight", (hidden,)), Tensor("norm_k_weight", (hidden,))]
        axes = _validate(_WAN_LABEL, "021", specs, tensors[:len(specs)])
        if rope:
            _check_rope_tables(tensors[len(specs):], axes[nv], axes[nt], hidden // heads, tensors[0].device)
        device = tensors[0].device
        plan = _plans[key] = _wan.Plan(axes[b], axes[nv], axes[nt], config, tensors[0].dtype, save=save,
                                       sms=_sm_count(device), deterministic=key[-1], eps=eps, rope=rope)
        # The self-attention's long context on cuDNN's attention once its shape recurs (a plan per new shape
        # costs ~80 ms a direction); the cross-attention's short text stays on ours.
        if rope and _cudnn.serves(plan.attention, plan.compute, device, plan.deterministic):
            _plan_cache.recurring(plan, dataclasses.replace(plan, cudnn=True))
    return _plan_cache.looked_up(key, plan)


def _check_rope_tables(tables, video_tokens: int, text_tokens: int, head_dim: int, device, label=_WAN_LABEL) -> None:
    """wan_xattn's (or wan_attention's) rope tables: floating [Nv, D] or [1, Nv, 1, D] (diffusers' layout), no
    gradient, on the video's device; the attention a self-attention (its context as long as the video: a row per
    token)."""
    if text_tokens != video_tokens:
        raise ValueError(f"{label}: rope turns a self-attention's queries and keys by their video positions: the "
                         f"context must be the video itself ({video_tokens} tokens), got {text_tokens}")
    for name, t in zip(("rope_cos", "rope_sin"), tables):
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else None
        if shape not in ((video_tokens, head_dim), (1, video_tokens, 1, head_dim)) or not t.is_floating_point():
            what = f"{t.dtype} {shape}" if shape is not None else type(t).__name__
            raise ValueError(f"{label}: input '{name}' must be a floating tensor [{video_tokens}, {head_dim}] or "
                             f"[1, {video_tokens}, 1, {head_dim}] (a row per video token), got {what}")
        if t.device != device:
            raise ValueError(f"{label}: input '{name}' is on {t.device}, its video on {device}")
        if t.requires_grad:
            raise ValueError(f"{label}: input '{name}' requires a gradient, and the RoPE tables take none here "
                             f"(pass it detached)")


class _WanXattn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, heads, save, eps, rope, *tensors):
        plan = _wan_plan(tensors, scale, heads, save, eps, rope)
        tensors = _contiguous(tensors)
        out, acts = _wan.forward(tensors, scale, plan)
        ctx.save_for_backward(*tensors, *([] if acts is None else [acts]))
        ctx.plan, ctx.scale, ctx.site, ctx.count = plan, scale, _site(plan), len(tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        needs = tuple(ctx.needs_input_grad[5:])
        if not any(needs):
            return (None,) * (5 + ctx.count)
        saved = ctx.saved_tensors
        acts = saved[ctx.count] if len(saved) > ctx.count else None
        with _attributed(ctx.site):
            grads = _wan.backward(saved[:ctx.count], grad_out, ctx.scale, _needs_plan(ctx.plan, needs), acts)
        return (None, None, None, None, None, *grads)


def wan_xattn(video, text, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, o_weight, o_bias, scale, *,
              heads: int = 16, norm_q_weight=None, norm_k_weight=None, eps: float = 1e-6, rope=None,
              save_activations: bool = True):
    """Wan-style attention (`ops/wan_xattn/training.py`): video [B, Nv, hidden], text [B, Nt, hidden], the four
    projections' weights [hidden, hidden] and biases [hidden], `heads` heads of hidden / heads; with norm_q_weight
    and norm_k_weight ([hidden] each), q and k RMS-normed across all heads (eps) as Wan 2.1 / 2.2's attentions
    do; softmax(scale * Q K^T) V, no mask -> [B, Nv, hidden]. The text-to-video cross-attention, or with
    rope=(cos, sin) the self-attention (text: the video itself): q and k, after their norms, turned on
    interleaved pairs as diffusers' Wan does (pair i of a head by cos[t, 2i] and sin[t, 2i + 1] at video token t;
    tables [Nv, D] or diffusers' [1, Nv, 1, D], floating, without gradient)."""
    if not (_finite_floats(scale, eps) and eps >= 0.0):
        scale, eps = check_real(scale, f"{_WAN_LABEL}: input 'scale'"), _eps(eps, f"{_WAN_LABEL}: eps")
    if (norm_q_weight is None) != (norm_k_weight is None):
        raise ValueError(f"{_WAN_LABEL}: norm_q_weight and norm_k_weight are both tensors (the q, k norms) or both None")
    if rope is not None and (not isinstance(rope, (tuple, list)) or len(rope) != 2):
        raise ValueError(f"{_WAN_LABEL}: rope must be (cos, sin), two tables, got {type(rope).__name__}")
    norms = [] if norm_q_weight is None else [norm_q_weight, norm_k_weight]
    tables = [] if rope is None else list(rope)  # (never autocast: the tables stay in their own dtype)
    tensors, autocast_off = _autocast([video, text, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, o_weight,
                                       o_bias, *norms])
    if torch.compiler.is_compiling():
        return _FORWARD["wan_xattn"](*tensors, *([None, None] if not norms else []),
                                                    *(tables or [None, None]), scale, heads, eps)[0]
    with autocast_off:
        return _WanXattn.apply(scale, heads, save_activations, eps, bool(tables), *tensors, *tables)


# ------------------------------------------ 021's attention without projections --------------------------------
_WAN_ATTENTION_LABEL = "backfuse.functional.wan_attention"
_wan_attention = _Lazy("backfuse.ops.wan_xattn.attention", "_wan_attention")


def _wan_attention_plan(tensors, scale, heads, save, eps=1e-6, rope: bool = False):
    """The plan of a wan_attention call: tensors q, k, v, the norms' weights, then the RoPE tables where rope."""
    key = ("021 attention", _signature(tensors), heads, save, eps, rope, rope and _cudnn.enabled(),
           torch.are_deterministic_algorithms_enabled())
    plan = _plans.get(key)
    if plan is None:
        label = _WAN_ATTENTION_LABEL
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"{label}: heads must be a positive int, got {heads!r}")
        q = tensors[0]
        hidden = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 3 else None
        if hidden is None or hidden % heads:
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"{label}: input 'query' must be [batch, tokens, hidden] with hidden a multiple of "
                             f"heads={heads}, got {shape}")
        try:
            config = WanXattnConfig(hidden, heads, qk_norm=True)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        b, nv, nt = "batch_size", "num_video_tokens", "num_text_tokens"
        specs = [Tensor("query", (b, nv, hidden)), Tensor("key", (b, nt, hidden)), Tensor("value", (b, nt, hidden)),
                 Tensor("norm_q_weight", (hidden,)), Tensor("norm_k_weight", (hidden,))]
        axes = _validate(label, "021", specs, tensors[:5])
        if rope:
            _check_rope_tables(tensors[5:], axes[nv], axes[nt], hidden // heads, q.device, label)
        plan = _plans[key] = _wan_attention.Plan(axes[b], axes[nv], axes[nt], config, q.dtype, save=save,
                                                 sms=_sm_count(q.device), deterministic=key[-1], eps=eps, rope=rope)
        if rope and _cudnn.serves(plan.attention, plan.compute, q.device, plan.deterministic):
            _plan_cache.recurring(plan, dataclasses.replace(plan, cudnn=True))
    return _plan_cache.looked_up(key, plan)


class _WanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, heads, save, eps, rope, *tensors):
        plan = _wan_attention_plan(tensors, scale, heads, save, eps, rope)
        tensors = _contiguous(tensors)
        out, acts = _wan_attention.forward(tensors, scale, plan)
        ctx.save_for_backward(*tensors, *([] if acts is None else [acts]))
        ctx.plan, ctx.scale, ctx.site, ctx.count = plan, scale, _site(plan), len(tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        needs = tuple(ctx.needs_input_grad[5:10])
        if not any(needs):
            return (None,) * (5 + ctx.count)
        saved = ctx.saved_tensors
        acts = saved[ctx.count] if len(saved) > ctx.count else None
        with _attributed(ctx.site):
            grads = _wan_attention.backward(saved[:ctx.count], grad_out, ctx.scale, _needs_plan(ctx.plan, needs), acts)
        return (None,) * 5 + grads + (None,) * (ctx.count - 5)


def wan_attention(query, key, value, norm_q_weight, norm_k_weight, scale, *, heads: int, eps: float = 1e-6, rope=None,
                  save_activations: bool = True):
    """Wan's attention between its projections (`ops/wan_xattn/attention.py`): query [B, Nv, hidden], key and value
    [B, Nt, hidden] as the q, k, v projections give them with their biases (a model's own modules: LoRA, quantized
    or hooked projections), q and k RMS-normed across all heads (eps) with norm_q_weight and norm_k_weight
    ([hidden] each), `heads` heads of hidden / heads, softmax(scale * Q K^T) V, no mask -> [B, Nv, hidden] (what the
    output projection takes). The cross-attention, or with rope=(cos, sin) the self-attention (key and value: the
    video's): Q and K, after their norms, turned on interleaved pairs as `wan_xattn`'s. The tables get no gradient."""
    if not (_finite_floats(scale, eps) and eps >= 0.0):
        scale, eps = (check_real(scale, f"{_WAN_ATTENTION_LABEL}: input 'scale'"),
                      _eps(eps, f"{_WAN_ATTENTION_LABEL}: eps"))
    if rope is not None and (not isinstance(rope, (tuple, list)) or len(rope) != 2):
        raise ValueError(f"{_WAN_ATTENTION_LABEL}: rope must be (cos, sin), two tables, got {type(rope).__name__}")
    tables = [] if rope is None else list(rope)  # (never autocast: the tables stay in their own dtype)
    tensors, autocast_off = _autocast([query, key, value, norm_q_weight, norm_k_weight])
    if torch.compiler.is_compiling():
        return _FORWARD["wan_attention"](*tensors, *(tables or [None, None]), scale, heads, eps)[0]
    with autocast_off:
        return _WanAttention.apply(scale, heads, save_activations, eps, bool(tables), *tensors, *tables)


# ---------------------------------------------------------------- 072 -------------------------------------------
_QKV_LABEL = "backfuse.functional.qkv_gqa"


def _qkv_plan(tensors, head_dim, save):
    key = ("072", _signature(tensors), head_dim, save, torch.are_deterministic_algorithms_enabled())
    plan = _plans.get(key)
    if plan is None:
        dec, enc, wq, wk, wv = tensors
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"{_QKV_LABEL}: head_dim must be a positive int, got {head_dim!r}")
        for name, w in (("q_weight", wq), ("k_weight", wk)):
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] % head_dim:
                shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise ValueError(f"{_QKV_LABEL}: input '{name}' must be [heads * head_dim, hidden] with head_dim="
                                 f"{head_dim}, got {shape}")
        try:
            config = QkvGqaConfig(wq.shape[1], wk.shape[1], wq.shape[0] // head_dim, wk.shape[0] // head_dim, head_dim)
        except ValueError as e:
            raise ValueError(f"{_QKV_LABEL}: {e}") from None
        b, sd, se = "batch_size", "seq_len_dec", "seq_len_enc"
        specs = [Tensor("decoder_hidden_states", (b, sd, config.hidden)),
                 Tensor("encoder_hidden_states", (b, se, config.cross_hidden)),
                 Tensor("q_weight", (config.q_out, config.hidden)), Tensor("k_weight", (config.kv_out, config.cross_hidden)),
                 Tensor("v_weight", (config.kv_out, config.cross_hidden))]
        axes = _validate(_QKV_LABEL, "072", specs, tensors)
        plan = _plans[key] = _qkv.Plan(axes[b], axes[sd], axes[se], config, dec.dtype, save=save,
                                       sms=_sm_count(dec.device), deterministic=key[-1])
    return plan


class _QkvGqa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, head_dim, save, *tensors):
        plan = _qkv_plan(tensors, head_dim, save)
        tensors = _contiguous(tensors)
        outs, acts = _qkv.forward(tensors, plan)
        ctx.save_for_backward(*tensors, *([] if acts is None else [acts]))
        ctx.plan, ctx.site = plan, _site(plan)
        return outs

    @staticmethod
    def backward(ctx, gq, gk, gv):
        needs = tuple(ctx.needs_input_grad[2:])
        if not any(needs):
            return (None,) * 7
        saved = ctx.saved_tensors
        grads = [g if g is not None else torch.zeros(s, dtype=ctx.plan.io, device=saved[0].device) for g, (s, _) in
                 zip((gq, gk, gv), ctx.plan.outputs)]
        with _attributed(ctx.site):
            out = _qkv.backward(saved[:5], grads, _needs_plan(ctx.plan, needs), saved[5] if len(saved) > 5 else None)
        return (None, None, *out)


def qkv_gqa(decoder_hidden, encoder_hidden, q_weight, k_weight, v_weight, *, head_dim: int = 256,
            save_activations: bool = True):
    """Cross-attention q, k, v projections with grouped KV heads (`ops/qkv_gqa/training.py`):
    (query_states [B, H, Sd, D], key_states and value_states [B, H, Se, D], each KV head repeated to
    its H / KV query heads), H = q_weight rows / head_dim, KV = k_weight rows / head_dim."""
    tensors, autocast_off = _autocast([decoder_hidden, encoder_hidden, q_weight, k_weight, v_weight])
    if torch.compiler.is_compiling():
        return tuple(_FORWARD["qkv_gqa"](*tensors, head_dim)[:3])
    with autocast_off:
        return _QkvGqa.apply(head_dim, save_activations, *tensors)


# ---------------------------------------------------------------- 037 -------------------------------------------
_GEMMA_LABEL = "backfuse.functional.gemma3_core"


def _gemma_scalars(label: str, scaling, softcap, eps) -> tuple:
    """(scaling, the soft cap: 0.0 for None, |softcap| (tanh(z / c) c is even in c), eps), each checked
    (`check_real`, `_eps`)."""
    if _finite_floats(scaling, eps, 0.0 if softcap is None else softcap) and eps >= 0.0:
        return scaling, 0.0 if softcap is None else abs(softcap), eps
    scaling = check_real(scaling, f"{label}: input 'scaling'")
    eps = _eps(eps, f"{label}: input 'rms_norm_eps'")
    softcap = 0.0 if softcap is None else abs(check_real(softcap, f"{label}: input 'attn_logit_softcapping'"))
    return scaling, softcap, eps


def _gemma_masks(label: str, first: str, attention_mask, cu_seqlens, cu_seqlens_k, hidden) -> tuple:
    """(mask, documents) for the kernels from gemma3_core's attention_mask and cu_seqlens (shapes checked
    here, values never read on the host). A mask the kernels load tile by tile is bool (a copy of an
    integer one: a tokenizer's int64 mask would take 8 bytes of a program's shared memory per element),
    or a float one of 2 or 4 bytes, added to the logits. label, first: the op's and its first input's names
    (hidden: that input), for errors."""
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() == 2 or not attention_mask.is_floating_point():
            if attention_mask.dtype != torch.bool:
                attention_mask = attention_mask != 0
        elif attention_mask.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            attention_mask = attention_mask.float()
    if cu_seqlens is None:
        if cu_seqlens_k is not None:
            raise ValueError(f"{label}: input 'cu_seqlens_k' needs cu_seqlens (the queries' documents)")
        return attention_mask, None
    if attention_mask is not None and attention_mask.dim() == 4:
        raise ValueError(f"{label}: pass cu_seqlens or a 4-dim attention_mask (which holds the documents itself), "
                         "not both")
    if hidden.dim() != 3 or hidden.shape[0] != 1:
        raise ValueError(f"{label}: with cu_seqlens, input '{first}' must be one row of packed "
                         f"documents [1, tokens, ...], got {tuple(hidden.shape)}")
    for name, cu in (("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            continue
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.is_complex() \
                or cu.numel() < 2:
            what = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{label}: input '{name}' must be an integer tensor [documents + 1] (FlashAttention's "
                             f"cumulative document lengths, from 0), got {what}")
        if cu.device != hidden.device:
            raise ValueError(f"{label}: input '{name}' is on {cu.device}, {first} on {hidden.device}")
    if cu_seqlens_k is cu_seqlens:
        cu_seqlens_k = None
    if cu_seqlens_k is not None and cu_seqlens_k.numel() != cu_seqlens.numel():
        raise ValueError(f"{label}: inputs 'cu_seqlens' and 'cu_seqlens_k' must count the same documents, got "
                         f"{cu_seqlens.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    return attention_mask, _masks.documents(cu_seqlens, cu_seqlens_k, hidden.shape[1], _steps.packed_documents)


def _check_mask(label: str, mask, documents, batch: int, seq: int, device):
    """Shape and device of the mask and documents (`masks.documents_from_cu_seqlens`) the kernels take (errors
    name the input)."""
    if mask is not None:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
        ok = shape is not None and (shape == (batch, seq) or (len(shape) == 4 and shape[0] in (1, batch) and shape[1] == 1
                                                               and shape[2:] == (seq, seq)))
        if not ok:
            raise ValueError(f"{label}: input 'attention_mask' must be [batch_size={batch}, seq_len={seq}] (nonzero: "
                             f"a real token) or [{batch} or 1, 1, {seq}, {seq}] (bool: visible; float: added to the "
                             f"logits), got {shape if shape is not None else type(mask).__name__}")
        if mask.device != device:
            raise ValueError(f"{label}: input 'attention_mask' is on {mask.device}, the inputs on {device}")
        if mask.dim() == 2 and mask.is_complex():
            raise ValueError(f"{label}: input 'attention_mask' must be bool, integer or float, got {mask.dtype}")
    if documents is not None and (tuple(documents.shape) != (2, batch, seq) or documents.dtype != torch.int32):
        raise ValueError(f"{label}: the documents' first and last keys must be [2, {batch}, {seq}] int32, got "
                         f"{documents.dtype} {tuple(documents.shape)}")


def _qk_norm(label: str, qnw, knw, head_dim):
    """(whether there is the QK norm, the head size: head_dim, or where None the norm weights' size)."""
    norm = qnw is not None or knw is not None
    if norm and (qnw is None or knw is None):
        raise ValueError(f"{label}: inputs 'q_norm_weight' and 'k_norm_weight' are both tensors (the QK norm) or both "
                         "None (no QK norm, as Gemma 2)")
    if head_dim is None:
        if not norm:
            raise ValueError(f"{label}: without the QK norm's weights, pass head_dim=")
        head_dim = qnw.shape[0] if isinstance(qnw, torch.Tensor) and qnw.dim() == 1 else None
    return norm, head_dim


def _gemma_plan(tensors, softcap, window, save, head_dim=None, mask=None, documents=None):
    masking = _masks.masking_of(mask, documents)
    key = ("037", _signature(tensors), softcap, window, save, head_dim, _cudnn.enabled(),
           torch.are_deterministic_algorithms_enabled(), masking,
           masking and _plan_cache.layout((mask, documents)))
    plan = _plans.get(key)
    if plan is None:
        hidden, cos, sin, wq, wk, wv, wo, qnw, knw = tensors
        norm, head_dim = _qk_norm(_GEMMA_LABEL, qnw, knw, head_dim)
        for name, t, dims in (("q_norm_weight", qnw, 1), ("q_weight", wq, 2), ("k_weight", wk, 2)):
            if (t is not None or name != "q_norm_weight") and (not isinstance(t, torch.Tensor) or t.dim() != dims):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{_GEMMA_LABEL}: input '{name}' must have {dims} dim(s), got {shape}")
        if wq.shape[0] % head_dim or wk.shape[0] % head_dim:
            raise ValueError(f"{_GEMMA_LABEL}: inputs 'q_weight' {tuple(wq.shape)} and 'k_weight' {tuple(wk.shape)} must "
                             f"have a multiple of head_dim={head_dim} rows")
        try:
            config = Gemma3CoreConfig(wq.shape[1], wq.shape[0] // head_dim, wk.shape[0] // head_dim, head_dim, window,
                                      qk_norm=norm)
        except ValueError as e:
            raise ValueError(f"{_GEMMA_LABEL}: {e}") from None
        b, s = "batch_size", "seq_len"
        # RoPE tables per token, or per position for every batch entry ([1, S, D], as transformers makes them)
        tables = "batch_size" if not (isinstance(cos, torch.Tensor) and cos.dim() == 3 and cos.shape[0] == 1) else 1
        specs = [Tensor("hidden_states", (b, s, config.hidden)), Tensor("cos", (tables, s, head_dim)),
                 Tensor("sin", (tables, s, head_dim)), Tensor("q_weight", (config.q_out, config.hidden)),
                 Tensor("k_weight", (config.kv_out, config.hidden)), Tensor("v_weight", (config.kv_out, config.hidden)),
                 Tensor("o_weight", (config.hidden, config.q_out))]
        if norm:
            specs += [Tensor("q_norm_weight", (head_dim,)), Tensor("k_norm_weight", (head_dim,))]
        axes = _validate(_GEMMA_LABEL, "037", specs, tensors[:len(specs)])
        _check_mask(_GEMMA_LABEL, mask, documents, axes[b], axes[s], hidden.device)
        plan = _plans[key] = _gemma.Plan(axes[b], axes[s], config, hidden.dtype, softcap=softcap,
                                         cos_batched=tables != 1 or axes[b] == 1, save=save,
                                         sms=_sm_count(hidden.device), deterministic=key[7], masking=masking)
        if _cudnn.serves(plan.attention, plan.compute, hidden.device, plan.deterministic):
            _plan_cache.recurring(plan, dataclasses.replace(plan, cudnn=True))
    return _plan_cache.looked_up(key, plan)


class _Gemma3Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scaling, softcap, eps, window, save, head_dim, mask, documents, *tensors):
        plan = _gemma_plan(tensors, softcap, window, save, head_dim, mask, documents)
        tensors = _contiguous(tensors)
        out, acts = _gemma.forward(tensors, scaling, eps, plan, (mask, documents))
        ctx.save_for_backward(*tensors, mask, documents, acts)
        ctx.plan, ctx.scalars, ctx.site = plan, (scaling, eps), _site(plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        n = ctx.needs_input_grad[8:]
        needs = (n[0], *n[3:9])  # cos and sin get none
        if not any(needs):
            return (None,) * 17
        saved = ctx.saved_tensors
        with _attributed(ctx.site):
            g = _gemma.backward(saved[:9], grad_out, *ctx.scalars, _needs_plan(ctx.plan, needs), saved[11], saved[9:11])
        return (None,) * 8 + (g[0], None, None, *g[1:])


def gemma3_core(hidden, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight, scaling,
                softcap, eps, *, window: int = 0, head_dim: int | None = None, attention_mask=None, cu_seqlens=None,
                cu_seqlens_k=None, save_activations: bool = True):
    """Gemma's attention core (`ops/gemma3_core/training.py`): hidden [B, S, hidden], RoPE tables cos,
    sin [B, S, D]; per-head QK RMSNorm (weight 1 + w; q_norm_weight and k_norm_weight None: no norm,
    as Gemma 2), RoPE, causal GQA attention at `scaling` with the logits soft-capped at `softcap`
    (None or 0: no cap), each query seeing its `window` latest tokens (0: all earlier ones), output
    projection -> [B, S, hidden]. D = head_dim, by default q_norm_weight's size; heads = q_weight rows
    / D, KV heads = k_weight rows / D. cos and sin get no gradient.

    attention_mask: [B, S], nonzero where a token is real (padding: a query sees only real keys, as
    transformers' 2-dim mask; a query that sees none gets 0); or [B or 1, 1, S, S] as transformers builds
    it for its attention (bool or integer: nonzero where the key is visible; float: added to the logits
    after the cap, -inf or finfo.min hiding the key): it then alone decides what each query sees, the
    causality and window included. cu_seqlens: packed documents in one row (B = 1), FlashAttention's
    [documents + 1] cumulative lengths from 0: a query sees only its own document's keys; cu_seqlens_k: the
    keys' documents where they are not the queries' (FlashAttention's cu_seqlens_k; causality then ends at
    each document's last query and last key together, as FlashAttention aligns it, and the window counts
    back from there), a query in no document seeing no key. Masks and documents are read on the device only
    (the host never waits), and the kernels skip the key blocks no query of a block sees."""
    scaling, softcap, eps = _gemma_scalars(_GEMMA_LABEL, scaling, softcap, eps)
    tensors, autocast_off = _autocast([hidden, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight,
                                       k_norm_weight])
    mask, documents = _gemma_masks(_GEMMA_LABEL, "hidden_states", attention_mask, cu_seqlens, cu_seqlens_k,
                                    tensors[0])
    if torch.compiler.is_compiling():
        return _FORWARD["gemma3_core"](*tensors, mask, documents, scaling, softcap, eps, window,
                                                      head_dim or 0)[0]
    with autocast_off:
        return _Gemma3Core.apply(scaling, softcap, eps, window, save_activations, head_dim, mask, documents, *tensors)


# ------------------------------------------ 037's attention without projections --------------------------------
_ATTENTION_LABEL = "backfuse.functional.gemma3_attention"
_gemma_attention = _Lazy("backfuse.ops.gemma3_core.attention", "_gemma_attention")


def _gemma_attention_plan(tensors, softcap, window, save, head_dim=None, mask=None, documents=None):
    masking = _masks.masking_of(mask, documents)
    key = ("037 attention", _signature(tensors), softcap, window, save, head_dim, _cudnn.enabled(),
           torch.are_deterministic_algorithms_enabled(), masking,
           masking and _plan_cache.layout((mask, documents)))
    plan = _plans.get(key)
    if plan is None:
        q, k, v, cos, sin, qnw, knw = tensors
        norm, head_dim = _qk_norm(_ATTENTION_LABEL, qnw, knw, head_dim)
        for name, t in (("query_states", q), ("key_states", k)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or not isinstance(head_dim, int) or t.shape[2] % head_dim:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{_ATTENTION_LABEL}: input '{name}' must be [batch_size, seq_len, heads * head_dim] "
                                 f"with head_dim={head_dim}, got {shape}")
        try:
            config = Gemma3CoreConfig(q.shape[2], q.shape[2] // head_dim, k.shape[2] // head_dim, head_dim, window,
                                      qk_norm=norm)
        except ValueError as e:
            raise ValueError(f"{_ATTENTION_LABEL}: {e}") from None
        b, s = "batch_size", "seq_len"
        tables = "batch_size" if not (isinstance(cos, torch.Tensor) and cos.dim() == 3 and cos.shape[0] == 1) else 1
        specs = [Tensor("query_states", (b, s, config.q_out)), Tensor("key_states", (b, s, config.kv_out)),
                 Tensor("value_states", (b, s, config.kv_out)), Tensor("cos", (tables, s, head_dim)),
                 Tensor("sin", (tables, s, head_dim))]
        if norm:
            specs += [Tensor("q_norm_weight", (head_dim,)), Tensor("k_norm_weight", (head_dim,))]
        axes = _validate(_ATTENTION_LABEL, "037", specs, tensors[:len(specs)])
        _check_mask(_ATTENTION_LABEL, mask, documents, axes[b], axes[s], q.device)
        plan = _plans[key] = _gemma_attention.Plan(axes[b], axes[s], config, q.dtype, softcap=softcap,
                                                   cos_batched=tables != 1 or axes[b] == 1, save=save,
                                                   sms=_sm_count(q.device), deterministic=key[7], masking=masking)
        if _cudnn.serves(plan.attention, plan.compute, q.device, plan.deterministic):
            _plan_cache.recurring(plan, dataclasses.replace(plan, cudnn=True))
    return _plan_cache.looked_up(key, plan)


class _Gemma3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scaling, softcap, eps, window, save, head_dim, mask, documents, *tensors):
        plan = _gemma_attention_plan(tensors, softcap, window, save, head_dim, mask, documents)
        tensors = _contiguous(tensors)
        out, acts = _gemma_attention.forward(tensors, scaling, eps, plan, (mask, documents))
        ctx.save_for_backward(*tensors, mask, documents, acts)
        ctx.plan, ctx.scalars, ctx.site = plan, (scaling, eps), _site(plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        n = ctx.needs_input_grad[8:]
        needs = (n[0], n[1], n[2], n[5], n[6])  # cos and sin get none
        if not any(needs):
            return (None,) * 15
        saved = ctx.saved_tensors
        with _attributed(ctx.site):
            g = _gemma_attention.backward(saved[:7], grad_out, *ctx.scalars, _needs_plan(ctx.plan, needs), saved[9],
                                          saved[7:9])
        return (None,) * 8 + (g[0], g[1], g[2], None, None, g[3], g[4])


def gemma3_attention(query_states, key_states, value_states, cos, sin, q_norm_weight, k_norm_weight, scaling, softcap,
                     eps, *, window: int = 0, head_dim: int | None = None, attention_mask=None, cu_seqlens=None,
                     cu_seqlens_k=None, save_activations: bool = True):
    """Gemma's attention between its projections (`ops/gemma3_core/attention.py`): query_states [B, S, H * D],
    key_states and value_states [B, S, KV * D] as the q, k, v projections give them (a model's own modules:
    LoRA, quantized or hooked projections), the per-head QK RMSNorm (weight 1 + w; None: none, as Gemma 2),
    RoPE from cos, sin, causal GQA attention at `scaling` with the soft cap, window and masks of
    `gemma3_core` -> the attention output [B, S, H * D] (what o_proj takes). cos and sin get no gradient."""
    scaling, softcap, eps = _gemma_scalars(_ATTENTION_LABEL, scaling, softcap, eps)
    tensors, autocast_off = _autocast([query_states, key_states, value_states, cos, sin, q_norm_weight,
                                       k_norm_weight])
    mask, documents = _gemma_masks(_ATTENTION_LABEL, "query_states", attention_mask, cu_seqlens, cu_seqlens_k,
                                    tensors[0])
    if torch.compiler.is_compiling():
        return _FORWARD["gemma3_attention"](*tensors, mask, documents, scaling, softcap, eps, window,
                                                           head_dim or 0)[0]
    with autocast_off:
        return _Gemma3Attention.apply(scaling, softcap, eps, window, save_activations, head_dim, mask, documents, *tensors)


# ----------------------------------------------------- the ops under torch.compile --------------------------------
def code_fingerprint(root: str | pathlib.Path | None = None) -> str:
    """16 hex digits of SHA-256 over a package's Python sources: each file's path under `root` (default: this
    package), then its bytes, in path order. Any change to a source, a file renamed or added, changes it."""
    root = pathlib.Path(root) if root is not None else pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


# Each op is defined at this overload, not "default". torch.compile's caches (inductor's FX graph cache and
# AOTAutograd's, on disk) key a graph by its code, which names the op's overload but holds nothing of its fake
# implementation: the shapes another backfuse's fake kernels gave would be served to this one. Naming the
# overload by the sources makes a graph compiled against other sources another key.
OVERLOAD = "v" + code_fingerprint()
_LIB = torch.library.Library("backfuse", "DEF")  # noqa: TOR901 (the ops are defined below)
_FORWARD = {}  # stem -> its forward op at OVERLOAD, what the functions above call under torch.compile


def custom_op(name: str) -> torch._ops.OpOverload:
    """The op `backfuse::<name>` at this code's overload (`OVERLOAD`), as compiled graphs name it."""
    return getattr(getattr(torch.ops.backfuse, name), OVERLOAD)


def _register(name: str, tensor_names, scalar_schema: str, n_out: int, forward, backward, fake_forward, grads_of):
    """backfuse::<name>_forward (outputs, then the activations it saves) and backfuse::<name>_backward
    (the gradients of the inputs at grads_of, in that order; empty where not needed: backward returns None
    there), with an autograd formula, for torch.compile: the same training path as the eager ops. A tensor
    name ending in "?" is an optional input (None: the feature it serves is off)."""
    tensors = ", ".join(f"Tensor? {n[:-1]}" if n.endswith("?") else f"Tensor {n}" for n in tensor_names)
    _LIB.define(f"{name}_forward.{OVERLOAD}({tensors}, {scalar_schema}) -> "
                f"({', '.join(['Tensor'] * (n_out + 1))})")
    _LIB.define(f"{name}_backward.{OVERLOAD}(Tensor[] grads, {tensors}, Tensor acts, {scalar_schema}, bool[] needs) "
                "-> Tensor[]")
    count = len(tensor_names)

    def backward_impl(grads, *args):
        return [args[0].new_empty(0) if g is None else g for g in backward(grads, *args)]

    def fake_backward(grads, *args):
        return [torch.empty_like(args[i]) if args[i] is not None and need else args[0].new_empty(0)
                for i, need in zip(grads_of, args[-1])]

    forward_name, backward_name = f"{name}_forward.{OVERLOAD}", f"{name}_backward.{OVERLOAD}"
    _LIB.impl(forward_name, forward, "CompositeExplicitAutograd")
    _LIB.impl(backward_name, backward_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"backfuse::{forward_name}", fake_forward, lib=_LIB)
    torch.library.register_fake(f"backfuse::{backward_name}", fake_backward, lib=_LIB)
    backward_op = custom_op(f"{name}_backward")
    _FORWARD[name] = custom_op(f"{name}_forward")

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:count], output[-1])
        ctx.scalars = inputs[count:]
        ctx.output_like = [(o.shape, o.dtype, o.device) for o in output[:n_out]]

    def formula(ctx, *grads):
        *saved, acts = ctx.saved_tensors
        needs = [bool(ctx.needs_input_grad[i]) for i in grads_of]
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads[:n_out], ctx.output_like)]  # an output unused: zero
        computed = backward_op(grads, *saved, acts, *ctx.scalars, needs)
        result = [None] * (count + len(ctx.scalars))
        for i, g, need in zip(grads_of, computed, needs):
            result[i] = g if need else None
        return tuple(result)

    torch.library.register_autograd(f"backfuse::{forward_name}", formula, setup_context=setup_context, lib=_LIB)


def _wan_tensors(tensors) -> tuple:
    """(the op's tensors as the eager path takes them: the norm weights only where there are norms, the RoPE
    tables only where there is RoPE; rope)."""
    rope = tensors[12] is not None
    return [t for t in tensors if t is not None], rope


def _wan_forward_op(*args):
    *tensors, scale, heads, eps = args
    tensors, rope = _wan_tensors(tensors)
    plan = _wan_plan(tensors, scale, heads, True, eps, rope)
    out, acts = _wan.forward(_contiguous(tensors), scale, plan)
    return out, acts


def _wan_backward_op(grads, *args):
    *tensors, acts, scale, heads, eps, needs = args
    tensors, rope = _wan_tensors(tensors)
    plan = _needs_plan(_wan_plan(tensors, scale, heads, True, eps, rope), tuple(needs), own=True)
    return _wan.backward(_contiguous(tensors), grads[0], scale, plan, acts)[:12]


def _wan_fake_forward(*args):
    *tensors, scale, heads, eps = args
    video, text = tensors[:2]
    config = WanXattnConfig(video.shape[2], heads, qk_norm=tensors[10] is not None)
    plan = _wan.Plan(video.shape[0], video.shape[1], text.shape[1], config, video.dtype, eps=eps,
                     rope=tensors[12] is not None)
    return torch.empty_like(video), video.new_empty((plan.activations.nbytes,), dtype=torch.uint8)


_register("wan_xattn", ["video_latents", "text_embeddings", "query_weight", "query_bias", "key_weight", "key_bias",
                        "value_weight", "value_bias", "output_weight", "output_bias", "norm_q_weight?", "norm_k_weight?",
                        "rope_cos?", "rope_sin?"],
          "float scale, int heads, float eps", 1, _wan_forward_op, _wan_backward_op, _wan_fake_forward,
          range(12))


def _wan_attention_forward_op(*args):
    *tensors, scale, heads, eps = args
    tensors = [t for t in tensors if t is not None]
    plan = _wan_attention_plan(tensors, scale, heads, True, eps, len(tensors) > 5)
    return _wan_attention.forward(_contiguous(tensors), scale, plan)


def _wan_attention_backward_op(grads, *args):
    *tensors, acts, scale, heads, eps, needs = args
    tensors = [t for t in tensors if t is not None]
    plan = _needs_plan(_wan_attention_plan(tensors, scale, heads, True, eps, len(tensors) > 5), tuple(needs), own=True)
    return _wan_attention.backward(_contiguous(tensors), grads[0], scale, plan, acts)


def _wan_attention_fake_forward(*args):
    q, k, v, nq, nk, cos, sin, scale, heads, eps = args
    plan = _wan_attention.Plan(q.shape[0], q.shape[1], k.shape[1], WanXattnConfig(q.shape[2], heads, qk_norm=True),
                               q.dtype, eps=eps, rope=cos is not None)
    return torch.empty_like(q), q.new_empty((plan.activations.nbytes,), dtype=torch.uint8)


_register("wan_attention", ["query", "key", "value", "norm_q_weight", "norm_k_weight", "rope_cos?", "rope_sin?"],
          "float scale, int heads, float eps", 1, _wan_attention_forward_op, _wan_attention_backward_op,
          _wan_attention_fake_forward, range(5))


def _qkv_forward_op(*args):
    *tensors, head_dim = args
    plan = _qkv_plan(tensors, head_dim, True)
    (q, k, v), acts = _qkv.forward(_contiguous(tensors), plan)
    return q, k, v, acts if acts is not None else tensors[0].new_empty(0, dtype=torch.uint8)


def _qkv_backward_op(grads, *args):
    *tensors, acts, head_dim, needs = args
    plan = _needs_plan(_qkv_plan(tensors, head_dim, True), tuple(needs), own=True)
    return _qkv.backward(_contiguous(tensors), list(grads), plan, acts if acts.numel() else None)


def _qkv_fake_forward(*args):
    dec, enc, wq, wk, wv, head_dim = args
    heads = wq.shape[0] // head_dim
    q = dec.new_empty((dec.shape[0], dec.shape[1], heads, head_dim)).transpose(1, 2)  # as the eager op's views
    k, v = (dec.new_empty((dec.shape[0], enc.shape[1], heads, head_dim)).transpose(1, 2) for _ in range(2))
    plan = _qkv.Plan(dec.shape[0], dec.shape[1], enc.shape[1],
                     QkvGqaConfig(wq.shape[1], wk.shape[1], heads, wk.shape[0] // head_dim, head_dim), dec.dtype)
    return q, k, v, dec.new_empty((plan.activations.nbytes if plan.casts else 0,), dtype=torch.uint8)


_register("qkv_gqa", ["decoder_hidden_states", "encoder_hidden_states", "q_weight", "k_weight", "v_weight"],
          "int head_dim", 3, _qkv_forward_op, _qkv_backward_op, _qkv_fake_forward, range(5))


def _gemma_forward_op(*args):
    *tensors, mask, documents, scaling, softcap, eps, window, head_dim = args
    plan = _gemma_plan(tensors, softcap, window, True, head_dim or None, mask, documents)
    return _gemma.forward(_contiguous(tensors), scaling, eps, plan, (mask, documents))


def _gemma_backward_op(grads, *args):
    *tensors, mask, documents, acts, scaling, softcap, eps, window, head_dim, needs = args
    plan = _needs_plan(_gemma_plan(tensors, softcap, window, True, head_dim or None, mask, documents), tuple(needs), own=True)
    return _gemma.backward(_contiguous(tensors), grads[0], scaling, eps, plan, acts, (mask, documents))


def _gemma_fake_forward(*args):
    hidden, cos, sin, wq, wk, wv, wo, qnw, knw, mask, documents, scaling, softcap, eps, window, head_dim = args
    d = head_dim or qnw.shape[0]
    config = Gemma3CoreConfig(wq.shape[1], wq.shape[0] // d, wk.shape[0] // d, d, window, qk_norm=qnw is not None)
    plan = _gemma.Plan(hidden.shape[0], hidden.shape[1], config, hidden.dtype, masking=_masks.masking_of(mask, documents))
    return torch.empty_like(hidden), hidden.new_empty((plan.activations.nbytes,), dtype=torch.uint8)


_register("gemma3_core", ["hidden_states", "cos", "sin", "q_weight", "k_weight", "v_weight", "o_weight",
                          "q_norm_weight?", "k_norm_weight?", "attention_mask?", "documents?"],
          "float scaling, float softcap, float eps, int window, int head_dim", 1, _gemma_forward_op, _gemma_backward_op,
          _gemma_fake_forward, [0, 3, 4, 5, 6, 7, 8])


def _attention_forward_op(*args):
    *tensors, mask, documents, scaling, softcap, eps, window, head_dim = args
    plan = _gemma_attention_plan(tensors, softcap, window, True, head_dim or None, mask, documents)
    return _gemma_attention.forward(_contiguous(tensors), scaling, eps, plan, (mask, documents))


def _attention_backward_op(grads, *args):
    *tensors, mask, documents, acts, scaling, softcap, eps, window, head_dim, needs = args
    plan = _needs_plan(_gemma_attention_plan(tensors, softcap, window, True, head_dim or None, mask, documents),
                       tuple(needs), own=True)
    return _gemma_attention.backward(_contiguous(tensors), grads[0], scaling, eps, plan, acts, (mask, documents))


def _attention_fake_forward(*args):
    q, k, v, cos, sin, qnw, knw, mask, documents, scaling, softcap, eps, window, head_dim = args
    d = head_dim or qnw.shape[0]
    config = Gemma3CoreConfig(q.shape[2], q.shape[2] // d, k.shape[2] // d, d, window, qk_norm=qnw is not None)
    plan = _gemma_attention.Plan(q.shape[0], q.shape[1], config, q.dtype, masking=_masks.masking_of(mask, documents))
    return torch.empty_like(q), q.new_empty((plan.activations.nbytes,), dtype=torch.uint8)


_register("gemma3_attention", ["query_states", "key_states", "value_states", "cos", "sin", "q_norm_weight?",
                               "k_norm_weight?", "attention_mask?", "documents?"],
          "float scaling, float softcap, float eps, int window, int head_dim", 1, _attention_forward_op,
          _attention_backward_op, _attention_fake_forward, [0, 1, 2, 5, 6])


# The names of earlier releases.
cross_attn_qkv_gqa = qkv_gqa
gemma3_attention_core = gemma3_core
wan_text_video_cross_attention = wan_xattn

