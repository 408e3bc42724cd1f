"""Hugging Face transformers' Gemma 2 and Gemma 3 attention on backfuse's `gemma3_core`.

A patched `Gemma2Attention` / `Gemma3Attention` computes its whole forward (q, k, v projections, the QK
norm where Gemma 3 has one, RoPE from the model's position embeddings, causal attention with the
layer's sliding window, soft cap and scaling, the output projection) as one `F.gemma3_core` call, when:

- the model's caller passed no attention mask (the mask transformers builds is then exactly the causal
  or sliding-window one, which the op applies itself) — `wrap_model` records this per call;
- there is no KV cache (in training the wrapped model passes `use_cache=False` unless told otherwise);
- attention dropout is off (or the module is in eval mode), the projections have no biases, and the
  attention is causal.

Otherwise the module runs its own forward, counted by reason (`backfuse.fallbacks(model)`).
"""

from __future__ import annotations

import contextvars
import inspect
from collections import Counter

import torch

from .. import functional as F
from . import PATCHED, fall_back

# Whether the innermost wrapped model call had no attention mask from its caller: per thread and task in
# eager code (a ContextVar), and in a dict that torch.compile can trace (it cannot trace a ContextVar) for
# the calls compiled code makes.
_plain_causal = contextvars.ContextVar("backfuse_plain_causal", default=False)
_COMPILED = {"plain_causal": False}


def _no_caller_mask() -> bool:
    return _COMPILED["plain_causal"] if torch.compiler.is_compiling() else _plain_causal.get()
MODEL_PATCHED = "_backfuse_model_forward"


def _is_gemma_attention(module, patched: bool = False) -> bool:
    name = type(module).__name__
    if name not in ("Gemma2Attention", "Gemma3Attention") or not type(module).__module__.startswith("transformers."):
        return False
    return patched == (getattr(module, PATCHED, None) is not None)


def bind(module) -> None:
    """Replace one Gemma attention module's forward with backfuse's (its own kept for the fallback)."""
    own = module.forward
    state = {"forward": own, "fallbacks": Counter()}
    setattr(module, PATCHED, state)
    config = module.config
    softcap = getattr(module, "attn_logit_softcapping", None)
    eps = getattr(config, "rms_norm_eps", 1e-6)

    def forward(hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values", args[0] if args else None))
        reason = None
        if cache is not None:
            reason = "a KV cache (pass use_cache=False in training)"
        elif not _no_caller_mask():
            reason = "an attention mask from the caller (padding or packing), or a call outside the patched model"
        elif module.training and module.attention_dropout:
            reason = "attention dropout"
        elif module.q_proj.bias is not None:
            reason = "biases on the projections"
        elif not getattr(module, "is_causal", True):
            reason = "bidirectional attention"
        elif position_embeddings is None:
            reason = "no position embeddings"
        if reason:
            fall_back(module, reason)
            return own(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        cos, sin = position_embeddings
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        out = F.gemma3_core(hidden_states, cos, sin, module.q_proj.weight, module.k_proj.weight, module.v_proj.weight,
                            module.o_proj.weight, None if q_norm is None else q_norm.weight,
                            None if k_norm is None else k_norm.weight, module.scaling, softcap,
                            getattr(q_norm, "eps", eps), window=module.sliding_window or 0, head_dim=module.head_dim)
        return out, None

    module.forward = forward


def unbind(module) -> None:
    state = getattr(module, PATCHED)
    module.forward = state["forward"]
    delattr(module, PATCHED)


def wrap_model(model) -> None:
    """The patched model's own forward records whether its caller passed an attention mask, and in
    training mode passes use_cache=False unless the caller said otherwise."""
    if getattr(model, MODEL_PATCHED, None) is not None or not type(model).__module__.startswith("transformers."):
        return
    own = model.forward
    try:
        signature = inspect.signature(own)
    except (TypeError, ValueError):
        signature = None

    def forward(*args, **kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and signature is not None and args:
            try:
                mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
            except TypeError:
                mask = None
        if model.training and "use_cache" not in kwargs and signature is not None and "use_cache" in signature.parameters:
            kwargs["use_cache"] = False
        before = _COMPILED["plain_causal"]
        _COMPILED["plain_causal"] = mask is None
        token = None if torch.compiler.is_compiling() else _plain_causal.set(mask is None)
        try:
            return own(*args, **kwargs)
        finally:
            _COMPILED["plain_causal"] = before
            if token is not None:
                _plain_causal.reset(token)

    setattr(model, MODEL_PATCHED, own)
    model.forward = forward


def unwrap_model(model) -> None:
    own = getattr(model, MODEL_PATCHED, None)
    if own is not None:
        model.forward = own
        delattr(model, MODEL_PATCHED)


KINDS = [("transformers Gemma2Attention / Gemma3Attention", _is_gemma_attention, bind, unbind)]
