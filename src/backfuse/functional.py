"""Differentiable forwards whose backward is backfuse's (the fused kernels where an operator has them).

Each function is a `torch.library` custom op (`torch.ops.backfuse.<stem>`: `qkv_gqa`, `gemma3_core`,
`wan_xattn`) with a registered
autograd formula, so `torch.compile` keeps it in one graph and activation checkpointing simply
re-runs it. The forward is plain PyTorch; autograd saves only the forward's inputs, and the
backward recomputes what it needs (less memory than autograd through the plain forward, which
keeps the attention probabilities). Gradients of inputs that do not require grad are not
computed: the fused kernels skip their products (e.g. all weight gradients for frozen weights).

Schemas are derived from each operator's input specs, so the ops take exactly the official
forward inputs, in official order. The forward validates them as `Problem.validate` does (errors name
the input, what was expected and what was given), except that it takes any layout (the backward
copies what it saves to contiguous memory) and float32, bfloat16 or float16 tensors of one dtype.

Dtypes: the output has the inputs' dtype; the forward computes in float32 from them (and rounds its
output once), and the backward (`Problem.backward`) converts to float32, accumulates in float32 and
returns each gradient in its input's dtype, so both differentiate the same function. Under
`torch.autocast` the ops are float32 ops (like autocast's own float32 list): their floating inputs are
cast to float32 (recorded by autograd, so gradients flow back to each input in its own dtype) and they
run with autocast off, returning float32.

Upstream gradients too small (or large) for fp16, as a mean-reduced loss gives, are scaled by a power
of two inside `Problem.backward` rather than sent to the fp32 fallback; each op remembers the last
power it used and tries it first on its next backward, so a steady run costs one fused call.
"""

from __future__ import annotations

import torch

from . import callsite
from . import problem as _problem
from .problem import TRAINING_DTYPES, Scalar, check_real

_LIB = torch.library.Library("backfuse", "DEF")  # noqa: TOR901 (the ops are defined below)
# Per op, the power of two (its exponent) its last backward scaled the upstream gradients by: the next
# backward tries it first (tiny gradients stay tiny from step to step).
LAST_EXPONENT: dict = {}


def _forward_specs(prob):
    return [s for s in prob.inputs if s.name not in prob.upstream_grads]


def _schema(specs, outputs: str) -> str:
    args = ", ".join(f"{'float' if isinstance(s, Scalar) else 'Tensor'} {s.name}" for s in specs)
    return f"({args}) -> {outputs}"


def _define(name: str, pid: str, n_out: int):
    """backfuse::<name> (forward) and backfuse::<name>_backward for operator `pid`; returns the op."""
    prob = _problem(pid)
    specs = _forward_specs(prob)
    grad_specs = [s for s in prob.inputs if s.name in prob.upstream_grads]
    label = f"backfuse.functional.{name}"
    _LIB.define(name + _schema(specs, "Tensor" if n_out == 1 else "(" + ", ".join(["Tensor"] * n_out) + ")"))
    # The backward takes one bool per gradient it could return (autograd's needs_input_grad); an
    # unwanted gradient comes back as an empty tensor and its products are skipped.
    _LIB.define(f"{name}_backward" + _schema(grad_specs + specs, "Tensor[]").replace(") ->", ", bool[] needs) ->"))

    def forward(*inputs):
        prob.validate(inputs, specs=specs, dtypes=TRAINING_DTYPES, contiguous=False, same_dtype=True, label=label)
        dtype = next(x.dtype for x in inputs if isinstance(x, torch.Tensor))
        with torch.no_grad():
            if dtype == torch.float32:
                out = prob.forward(*inputs)
            else:  # computed in float32, rounded once
                out = prob.forward(*(x.float() if isinstance(x, torch.Tensor) else x for x in inputs))
        # custom ops may not return views of their inputs or of each other
        outs = tuple(o.to(dtype, memory_format=torch.contiguous_format) for o in (out if n_out > 1 else (out,)))
        return outs if n_out > 1 else outs[0]

    def backward_impl(*args):
        *inputs, needs = args
        empty = inputs[0].new_empty(0)
        grads, LAST_EXPONENT[name] = prob._backward(inputs, needs, dtypes=TRAINING_DTYPES,
                                                    exponent=LAST_EXPONENT.get(name, 0))
        return [empty if g is None else g for g in grads]

    def backward_fake(*args):
        *inputs, needs = args
        named = dict(zip([s.name for s in grad_specs + specs], inputs))
        return [torch.empty_like(named[n], memory_format=torch.contiguous_format) if need else inputs[0].new_empty(0)
                for n, need in zip(prob.differentiates, needs)]

    _LIB.impl(name, forward, "CompositeExplicitAutograd")
    _LIB.impl(f"{name}_backward", backward_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"backfuse::{name}", forward, lib=_LIB)
    torch.library.register_fake(f"backfuse::{name}_backward", backward_fake, lib=_LIB)
    for device_type in ("cpu", "cuda"):  # float32 ops under autocast: forward and backward see the same inputs
        torch.library.register_autocast(f"backfuse::{name}", device_type, torch.float32, lib=_LIB)
    backward_op = getattr(torch.ops.backfuse, f"{name}_backward")
    tensor_at = [i for i, s in enumerate(specs) if not isinstance(s, Scalar)]
    differentiated_at = [i for i, s in enumerate(specs) if s.name in prob.differentiates]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[i] for i in tensor_at))
        ctx.inputs = [None if isinstance(x, torch.Tensor) else x for x in inputs]  # the scalars
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.output_like = [(o.shape, o.dtype, o.device) for o in outputs]
        # The backward's warnings point at the forward's caller: on a GPU the backward runs on an
        # autograd worker thread, whose stack holds no user frame.
        ctx.site = callsite.user_site()

    def backward(ctx, *grads):
        inputs = list(ctx.inputs)
        for i, t in zip(tensor_at, ctx.saved_tensors):
            inputs[i] = t.contiguous()
        # an output that did not reach the loss has no gradient: it contributes zero
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
                 for g, (shape, dtype, device) in zip(grads, ctx.output_like)]
        needs = [bool(ctx.needs_input_grad[i]) for i in differentiated_at]
        result = [None] * len(specs)
        with callsite.attributed_to(ctx.site):
            computed = backward_op(*grads, *inputs, needs)
        for i, g, need in zip(differentiated_at, computed, needs):
            result[i] = g if need else None
        return tuple(result)

    torch.library.register_autograd(f"backfuse::{name}", backward, setup_context=setup_context, lib=_LIB)
    return getattr(torch.ops.backfuse, name)


_QKV_GQA = _define("qkv_gqa", "072", 3)
_GEMMA3_CORE = _define("gemma3_core", "037", 1)
_WAN_XATTN = _define("wan_xattn", "021", 1)


def qkv_gqa(decoder_hidden, encoder_hidden, q_weight, k_weight, v_weight):
    """Parakeet cross-attention projections: (query_states [B,16,Sd,256], key_states and value_states
    [B,16,Se,256], the 4 KV heads repeated to 16). Backward: the fused 072 kernels."""
    return _QKV_GQA(decoder_hidden, encoder_hidden, q_weight, k_weight, v_weight)


def gemma3_core(hidden, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight, scaling, softcap,
                eps):
    """Gemma 3 attention core (QK RMSNorm with 1 + w, RoPE, soft-capped causal GQA, output
    projection): output [B,S,3072]. Backward: the fused 037 kernels (cos and sin get none)."""
    return _GEMMA3_CORE(hidden, cos, sin, q_weight, k_weight, v_weight, o_weight, q_norm_weight, k_norm_weight,
                        *_reals("gemma3_core", "037", scaling, softcap, eps))


def wan_xattn(video, text, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, o_weight, o_bias, scale):
    """Wan 2.2 text-to-video cross-attention: output [B,Nv,1024]. Backward: the fused 021 kernels."""
    return _WAN_XATTN(video, text, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, o_weight, o_bias,
                      *_reals("wan_xattn", "021", scale))


def _reals(name: str, pid: str, *values) -> list:
    """The scalar inputs as floats (the ops' schemas take floats), refused as the forward's validation words it."""
    specs = [s for s in _problem(pid).inputs if isinstance(s, Scalar)]
    return [check_real(v, f"backfuse.functional.{name}: input '{s.name}'") for s, v in zip(specs, values)]


# The names of earlier releases.
cross_attn_qkv_gqa = qkv_gqa
gemma3_attention_core = gemma3_core
wan_text_video_cross_attention = wan_xattn
