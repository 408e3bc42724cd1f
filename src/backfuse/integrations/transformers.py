"""Hugging Face transformers' Gemma 2 and Gemma 3 attention on backfuse's `gemma3_core`.

A patched `Gemma2Attention` / `Gemma3Attention` computes its forward (q, k, v projections, the QK norm
where Gemma 3 has one, RoPE from the model's position embeddings, GQA attention with the layer's soft cap
and scaling, the output projection) on backfuse's ops, with exactly the mask the module's own code would
apply. Everything it decides from is the call's own arguments and the module's
state, so a recomputation (gradient checkpointing, reentrant or not) decides the same:

- `eager` and `sdpa` attention (the model's `config._attn_implementation`): the mask is the one
  transformers built and passed the layer. A 4-dim mask ([B or 1, 1, S, S]: bool for SDPA, 0 / finfo.min
  for eager) goes to the kernels as it is (in one layout a shape: `_one_layout`), so causality, the sliding
  window, padding, packed documents (position ids that restart) and Gemma 3's bidirectional image blocks are
  whatever transformers made of them, as are a module's that is not causal (PaliGemma 2's Gemma 2 layers, whose
  image and prefix see each other both ways; a bidirectional Gemma 3 encoder): the mask alone decides there, for
  the op as for transformers' attention functions. The kernels skip the key blocks it hides from every query of a
  block.
  A caller's own 4-dim mask is served only where the attention function reads it as the op does (bool: visible keys; float: added
  to the logits): eager adds any mask to the logits, so a bool one runs the module's code there. None
  under SDPA is its `is_causal` attention (causal, no window: transformers passes None only where nothing
  else is masked, so the op runs without a window there too); None under eager attends to every key,
  which the op does not take.
- FlashAttention (`flash_attention_2`, `_3`, and any implementation transformers runs through its
  `flash_attention_forward`): the attention that `_flash_attention_forward` computes from the same
  arguments. With no mask: causal within the sliding window where the implementation takes one, one row of
  packed documents where the batch is one row (FlashAttention's varlen kwargs `cu_seq_lens_q/k` where the
  caller passed them as one tensor, else documents starting wherever a position id is the row's least, as
  transformers reads them; computed on the device, no sync); with a [B, S] padding mask: each real query
  sees the real keys before it, padded queries give 0, as unpadding does; FlashAttention counts a sliding
  window over the real tokens only, so on a layer whose window bites the real tokens go first for the
  kernels (a stable sort of the mask, on the device) and back after. Gemma 2's soft cap is served where the
  implementation takes one (elsewhere transformers 5.25 raises, 5.17 drops the cap). Queries in fp32 are served
  in fp32 (transformers passes them on to FlashAttention, which takes half types only).
- projections: plain bias-free `nn.Linear` layers are fused into the call (`F.gemma3_core`); otherwise backfuse
  computes what lies between them (`F.gemma3_attention`: QK norm, RoPE, attention) and the projections are the
  modules' own: PEFT's LoRA layers whose forward is the vanilla sum with the plain ones beside them in one
  computation (`lora.project`: the base products, one product for all adapters' A), any others (quantized
  weights, biases, hooks, parametrizations, DoRA) as the modules run themselves, so an adapter
  trains as it would without backfuse; the QK norms must be the model's own RMSNorm;
- the soft cap the module's code applies (Gemma 2 under eager and FlashAttention; none in Gemma 3, whose
  code passes its config's cap to no attention function, so a cap set there is refused);
- no KV cache (in training the patched model passes use_cache=False unless told otherwise: `wrap_model`),
  attention dropout off (or eval mode), causal attention, no attention weights asked for, activations in float32,
  bfloat16 or float16 (a model in float64 runs its own code).

Otherwise the module runs its own forward, with a warning naming the reason (once per reason), counted
by `backfuse.fallbacks(model)`.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections import Counter

import torch

from .. import functional as F
from ..problem import fused_unusable
from . import PATCHED, fall_back, lora, plain_linear, replaced_forward, unusable_dtype

MODEL_PATCHED = "_backfuse_model_forward"
SERVED = ("eager", "sdpa")  # attention implementations whose masks the kernels take as the module's code applies them


def _is_gemma_attention(module, patched: bool = False) -> bool:
    name = type(module).__name__
    if name not in ("Gemma2Attention", "Gemma3Attention") or not type(module).__module__.startswith("transformers."):
        return False
    return patched == (getattr(module, PATCHED, None) is not None)


def _own_norm(module, name: str) -> str | None:
    """Why the module's QK norm `name` is not the model's own RMSNorm (its class, no hooks, its forward not
    replaced on the instance: Liger Kernel's Gemma norm, the same math, is the one replacement taken), or None."""
    norm = getattr(module, name)
    if type(norm).__module__ != type(module).__module__ or norm._forward_hooks or norm._forward_pre_hooks:
        return f"{name} is a {type(norm).__name__}, not the model's own RMSNorm" + (
            " (it has hooks)" if norm._forward_hooks or norm._forward_pre_hooks else "")
    replaced = replaced_forward(norm)
    if replaced and not _liger_gemma_norm(norm, replaced):
        return f"{name}'s forward is replaced on the module ({replaced})"
    return None


def _liger_gemma_norm(norm, replaced: str) -> bool:
    """Whether a norm's replaced forward is Liger Kernel's RMSNorm set up as Gemma's (weight offset 1, computed
    in fp32 and cast once: `casting_mode="gemma"`, the model's eps), which computes the model's own norm."""
    return (replaced.startswith("liger_kernel.") and getattr(norm, "offset", None) == 1.0
            and getattr(norm, "casting_mode", None) == "gemma"
            and getattr(norm, "variance_epsilon", None) == getattr(norm, "eps", None))


def _served(module, impl, hidden_states, position_embeddings, attention_mask, cache, kwargs) -> str | dict:
    """Why the call must run the module's own code (a str), or how `F.gemma3_core` computes what it computes: the
    op's mask arguments (window, attention_mask, cu_seqlens, cu_seqlens_k), its soft cap, and `rows`: a [B, S] mask whose zero
    rows the module's attention gives as 0 (FlashAttention's padded queries), or None. impl: the model's
    attention implementation."""
    unusable = fused_unusable(hidden_states.device)
    if unusable:
        return f"backfuse's kernels cannot run here: {unusable}"
    if cache is not None:
        return "a KV cache (pass use_cache=False in training)"
    dtype = unusable_dtype("hidden states", hidden_states)
    if dtype:
        return dtype
    flash = False if impl in SERVED else _flash_features(impl)
    if flash is None:
        return f"attention implementation {impl!r} (backfuse serves {', '.join(map(repr, SERVED))} and FlashAttention's)"
    if isinstance(flash, str):
        return flash
    if module.training and module.attention_dropout:
        return "attention dropout"
    # (causality is the flag's only where no 4-dim mask decides: FlashAttention, or SDPA without a mask; a module
    # not causal under a mask transformers built, PaliGemma's prefix, is served by that mask)
    causal = kwargs.get("is_causal") if impl != "eager" and kwargs.get("is_causal") is not None else \
        getattr(module, "is_causal", True)
    if not causal and (flash or attention_mask is None):
        return "bidirectional attention"
    if kwargs.get("output_attentions"):
        return "attention weights asked for (output_attentions)"
    if position_embeddings is None:
        return "no position embeddings"
    cap = _soft_cap(module, impl, flash)
    if isinstance(cap, str):
        return cap
    for name in ("q_norm", "k_norm"):
        if hasattr(module, name):
            reason = _own_norm(module, name)
            if reason:
                return reason
    if flash:
        masks = _flash_masks(module, flash, hidden_states, attention_mask, kwargs)
        return masks if isinstance(masks, str) else dict(masks, softcap=cap)
    if attention_mask is None:
        if impl == "eager":
            return "eager attention without a mask (every key visible)"
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return f"an attention mask of type {type(attention_mask).__name__} (backfuse takes the 4-dim one transformers builds)"
    else:
        b, s = hidden_states.shape[:2]
        if attention_mask.shape[0] not in (1, b) or tuple(attention_mask.shape[1:]) != (1, s, s):
            return f"an attention mask of shape {tuple(attention_mask.shape)} (backfuse takes [{b} or 1, 1, {s}, {s}])"
        reason = _mask_meaning(attention_mask, impl, _query_dtype(hidden_states))
        if reason:
            return reason
    return dict(window=0, attention_mask=_one_layout(attention_mask), cu_seqlens=None, cu_seqlens_k=None, rows=None,
                softcap=cap)


FLASH_UNSUPPORTED = ("block_table", "k_cache", "v_cache", "s_aux")  # paged caches, attention sinks
VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _flash_masks(module, flash: dict, hidden_states, attention_mask, kwargs) -> str | dict:
    """The op's mask arguments for what transformers' `_flash_attention_forward` computes from this call's
    arguments (in its order: a padding mask, then the varlen kwargs, then position ids that pack documents in
    one row), or why backfuse cannot take it."""
    for name in FLASH_UNSUPPORTED:
        if kwargs.get(name) is not None:
            return f"{name} under flash attention (a paged cache or attention sinks)"
    b, s = hidden_states.shape[:2]
    window = module.sliding_window if flash["window_size"] and module.sliding_window else 0
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, s):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            return f"an attention mask of shape {shape} under flash attention (backfuse takes the [{b}, {s}] padding mask)"
        if window and s > window:  # the window counts real tokens only: they go first, in their order
            order, inverse, mask = _real_first(attention_mask)
            return dict(window=window, attention_mask=mask, cu_seqlens=None, cu_seqlens_k=None, rows=mask,
                        order=(order, inverse))
        return dict(window=0, attention_mask=attention_mask.contiguous(), cu_seqlens=None, cu_seqlens_k=None,
                    rows=attention_mask)
    if all(kwargs.get(name) is not None for name in VARLEN):
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        if b != 1:
            return f"cu_seq_lens over a batch of {b} rows (FlashAttention flattens them into one)"
        if cu_k is not cu_q and flash["top_left"]:
            return ("cu_seq_lens_q and cu_seq_lens_k as two tensors under a FlashAttention that aligns causality to "
                    "the first key (backfuse aligns it to the last, as FlashAttention 2.1 and later)")
        return dict(window=window, attention_mask=None, cu_seqlens=cu_q, cu_seqlens_k=cu_k, rows=None)
    positions = kwargs.get("position_ids")
    if b == 1 and s > 1 and isinstance(positions, torch.Tensor) and positions.numel() == s:
        return dict(window=window, attention_mask=None, cu_seqlens=_documents(positions), cu_seqlens_k=None, rows=None)
    return dict(window=window, attention_mask=None, cu_seqlens=None, cu_seqlens_k=None, rows=None)


class _Shared:
    """What the layers of one forward derive from one of its tensors (the padding mask, the position ids), made once:
    kept for the last tensor seen while it is alive and unchanged (its version counter). Made afresh under
    torch.compile (which traces the making) and for inference tensors (they count no versions)."""

    def __init__(self, make):
        self.make = make
        self.seen, self.version, self.value = None, -1, None

    def __call__(self, t):
        if torch.compiler.is_compiling() or t.is_inference():
            return self.make(t)
        if self.seen is not None and self.seen() is t and self.version == t._version:
            return self.value
        self.value = self.make(t)
        self.seen, self.version = weakref.ref(t), t._version
        return self.value


def _order_real_first(mask):
    """(order, inverse, mask in that order) of a [B, S] padding mask: each row's real tokens first, in their order,
    then its padding, as FlashAttention's unpadding lines them up; on the device (no sync)."""
    order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)
    return order, torch.argsort(order, dim=1), (mask != 0).gather(1, order)


def _reordered(t, order):
    """t [B or 1, S, ...] with its tokens in `order` [B, S] (a broadcast batch taken per row)."""
    index = order.view(*order.shape, *([1] * (t.dim() - 2))).expand(order.shape[0], -1, *t.shape[2:])
    return t.expand(order.shape[0], *t.shape[1:]).gather(1, index)


def _documents_of(positions):
    """FlashAttention's cu_seqlens of the documents transformers reads from one row of position ids (a document
    starting wherever the position is the row's least; tokens before the first start one more), as a fixed
    [S + 1] tensor: the starts, then S for the documents that are not there (empty). On the device: no sync."""
    pos = positions.reshape(-1)
    s = pos.numel()
    t = torch.arange(s, device=pos.device)
    firsts = torch.where(pos == pos.min(), t, s)
    firsts[0] = 0
    return torch.cat([firsts.sort().values, firsts.new_full((1,), s)]).to(torch.int32)


_real_first, _documents = _Shared(_order_real_first), _Shared(_documents_of)


_FLASH = {}  # implementation -> (its attention function, what it takes or why not)


def _flash_features(impl):
    """What transformers' FlashAttention path runs for `impl`: the features its kernel takes (transformers'
    `supports_mapping`: window_size, softcap; top_left: causality aligned to the first key, not the last), why
    backfuse cannot tell (a str), or None where `impl` is not run by transformers' `flash_attention_forward`."""
    functions = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    fn = functions.get(impl) if functions is not None and isinstance(impl, str) else None
    known = _FLASH.get(impl)
    if known is not None and known[0] is fn:
        return known[1]
    features = None
    wrapper = getattr(sys.modules.get("transformers.integrations.flash_attention"), "flash_attention_forward", None)
    if fn is not None and fn is wrapper:
        import transformers.modeling_flash_attention_utils as fa

        # (transformers 5.17 marks the implementation loaded before loading it: a failed load is undone, so that the
        # module's own call meets the same error as without backfuse, not functions left from another one)
        loaded_before = getattr(fa, "_loaded_implementation", None)
        try:
            loaded = fa.lazy_import_flash_attention(impl)
            process = loaded[1][0] if isinstance(loaded[1], tuple) else loaded[1]
            supports = process.keywords["supports_mapping"]
            features = {name: bool(supports.get(name)) for name in ("window_size", "softcap")}
            # (FlashAttention before 2.1 aligned causality to a document's first key: transformers' flag for it)
            features["top_left"] = bool(getattr(sys.modules[wrapper.__module__], "_use_top_left_mask", True))
        except Exception as e:  # noqa: BLE001 (what the model's own call would meet: it reports it itself)
            if hasattr(fa, "_loaded_implementation"):
                fa._loaded_implementation = loaded_before
            features = f"flash attention implementation {impl!r} not loadable here ({type(e).__name__}: {e})"
    _FLASH[impl] = (fn, features)
    return features


def _one_layout(mask):
    """A 4-dim mask in the one layout its shape has here: a batch broadcast with stride 0 (what transformers builds
    where no row is padded) as its single [1, 1, S, S] entry, any other non-contiguous mask as a contiguous copy.
    The op's kernels read a mask as it lies, with its strides among their arguments; its plans, and the launches
    kept with them, are told apart by the mask's shape and dtype, so masks of one shape reach it in one layout."""
    if mask is None:
        return None
    if mask.shape[0] > 1 and mask.stride(0) == 0:
        mask = mask[:1]
    return mask if mask.is_contiguous() else mask.contiguous()


def _soft_cap(module, impl: str, flash=None):
    """The soft cap the module's own code applies (None, or the cap), or why backfuse cannot know it (a str).
    Gemma 2's attention passes its cap to the attention function: eager applies it, FlashAttention where its
    kernel takes one (otherwise transformers 5.25 raises, 5.17 drops the cap), SDPA does not take one
    (transformers raises, or ignores it in older versions), so eager and FlashAttention are served with a cap.
    Gemma 3's attention keeps `attn_logit_softcapping` from its config but passes it to no attention function (the
    released configs set None): a cap there is refused, not guessed. flash: `_flash_features(impl)` under FlashAttention."""
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        return None
    if type(module).__name__ != "Gemma2Attention":
        return (f"attn_logit_softcapping={cap} on a {type(module).__name__} (its code passes the cap to no attention "
                "function in the transformers versions backfuse knows; not guessed)")
    if flash and not flash["softcap"]:
        return (f"Gemma 2's soft cap under {impl!r}, whose kernel takes none (transformers 5.25 raises, 5.17 drops "
                "the cap)")
    if impl != "eager" and not flash:
        return f"Gemma 2's soft cap under {impl!r} attention (only eager and FlashAttention apply it)"
    return cap


def _mask_meaning(mask, impl: str, dtype) -> str | None:
    """Why a 4-dim mask does not mean to the module's attention function what it means to backfuse's op (bool:
    which keys are visible; float: added to the logits), or None. Eager adds the mask to the logits whatever
    its type, so only a float one is served there; SDPA takes bool, float32 or the query's dtype (else raises)."""
    if impl == "eager" and not mask.is_floating_point():
        return f"a {mask.dtype} mask under eager attention (eager adds the mask to the logits as numbers)"
    if impl == "sdpa" and mask.dtype != torch.bool and mask.dtype not in (torch.float32, dtype):
        return f"a {mask.dtype} mask under SDPA (SDPA takes bool or float masks)"
    return None


def _query_dtype(hidden_states):
    """The dtype the module's attention function sees its query in (autocast's where it is on)."""
    kind = hidden_states.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden_states.dtype


def _plain_projections(module) -> bool:
    """Whether q, k, v and o_proj are plain bias-free nn.Linear layers whose weights the fused op may read
    (else they run as modules around `F.gemma3_attention`)."""
    return all(plain_linear(name, getattr(module, name), bias=False) is None
               for name in ("q_proj", "k_proj", "v_proj", "o_proj"))


def _projections(module, names) -> list | None:
    """The projections `names` as `lora.Part`s where each is a plain or a vanilla LoRA layer (and not under
    torch.compile, which fuses PEFT's own operations), else None: the modules run themselves."""
    if torch.compiler.is_compiling():
        return None
    found = [lora.parts(name, getattr(module, name), bias=False) for name in names]
    return None if any(isinstance(p, str) for p in found) else found


def bind(module) -> None:
    """Replace one Gemma attention module's forward with backfuse's (its own kept for the fallback)."""
    own = module.forward
    state = {"forward": own, "fallbacks": Counter()}
    setattr(module, PATCHED, state)
    eps = getattr(module.config, "rms_norm_eps", 1e-6)

    def forward(hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values", args[0] if args else None))
        impl = getattr(module.config, "_attn_implementation", None)  # (read once: transformers' config reads cost)
        served = _served(module, impl, hidden_states, position_embeddings, attention_mask, cache, kwargs)
        if isinstance(served, str):
            fall_back(module, served)
            return own(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        cos, sin = position_embeddings
        order, inverse = served.get("order") or (None, None)
        if order is not None:  # (FlashAttention's window over the real tokens: they go first, and back after)
            cos, sin = _reordered(cos, order), _reordered(sin, order)
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        norms = (None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight)
        scalars = (module.scaling, served["softcap"], getattr(q_norm, "eps", eps))
        masks = {name: served[name] for name in ("window", "attention_mask", "cu_seqlens", "cu_seqlens_k")}
        rows = served["rows"]  # FlashAttention's padded queries, whose attention is 0
        if _plain_projections(module):
            x = hidden_states if order is None else _reordered(hidden_states, order)
            out = F.gemma3_core(x, cos, sin, module.q_proj.weight, module.k_proj.weight, module.v_proj.weight,
                                module.o_proj.weight, *norms, *scalars, head_dim=module.head_dim, **masks)
            out = out if rows is None else out * rows[..., None].to(out.dtype)  # (o_proj has no bias)
            return (out if order is None else _reordered(out, inverse)), None
        # The projections as the modules compute them (in the tokens' own order, as a LoRA dropout draws its mask),
        # the attention between them backfuse's: PEFT's LoRA layers and plain ones together (`lora.project`),
        # others (quantized weights, hooks, DoRA) as the modules run.
        qkv = _projections(module, ("q_proj", "k_proj", "v_proj"))
        q, k, v = (lora.project(hidden_states, qkv) if qkv is not None else
                   (module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)))
        if order is not None:
            q, k, v = (_reordered(t, order) for t in (q, k, v))
        a = F.gemma3_attention(q, k, v, cos, sin, *norms, *scalars, head_dim=module.head_dim, **masks)
        a = a if rows is None else a * rows[..., None].to(a.dtype)
        a = a if order is None else _reordered(a, inverse)
        o = _projections(module, ("o_proj",))
        return (lora.project(a, o)[0] if o is not None else module.o_proj(a)), None

    module.forward = forward


def unbind(module) -> None:
    state = getattr(module, PATCHED)
    module.forward = state["forward"]
    delattr(module, PATCHED)


def _outermost_model(model):
    """The outermost transformers model in `model` whose forward takes use_cache (`model` itself, or the one a
    wrapper such as PEFT's holds)."""
    for m in model.modules():
        if getattr(m, MODEL_PATCHED, None) is not None:
            return m
        if type(m).__module__.startswith("transformers.") and "use_cache" in _parameters(type(m).forward):
            return m
    return None


def _parameters(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def wrap_model(model) -> None:
    """In training mode the patched model passes use_cache=False unless its caller said otherwise (a KV
    cache is what generation needs, not training, and the module's own code would fill it)."""
    target = _outermost_model(model)
    if target is None or getattr(target, MODEL_PATCHED, None) is not None:
        return
    own = target.forward

    def forward(*args, **kwargs):
        if target.training and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return own(*args, **kwargs)

    setattr(target, MODEL_PATCHED, own)
    target.forward = forward


def unwrap_model(model) -> None:
    for m in model.modules():
        own = getattr(m, MODEL_PATCHED, None)
        if own is not None:
            m.forward = own
            delattr(m, MODEL_PATCHED)


KINDS = [("transformers Gemma2Attention / Gemma3Attention", _is_gemma_attention, bind, unbind)]
