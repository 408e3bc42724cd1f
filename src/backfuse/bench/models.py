"""`backfuse bench --models`: one layer's training step at released models' sizes (`backfuse.presets`)
and token counts, bfloat16 as they train, against the layer as the model's own code runs it.

Per preset, layer kind (Gemma: its global and its sliding-window layers) and token count, each
implementation runs groups of steps queued back to back with one synchronization at the end, the
implementations' groups alternating (as `bench --train`; medians over the groups):
    backfuse        the preset's backfuse.nn module
    hf_bf16         the model's attention as transformers / diffusers run it, written here: Gemma 3 and
                    Llama 3.2 Vision with `scaled_dot_product_attention` (grouped heads, causal or the
                    window's mask), Gemma 2 with its eager soft-capped attention (what transformers trains
                    it with: SDPA has no soft cap), Wan with RMSNorm on q and k across the heads and SDPA
    compile_bf16    torch.compile of hf_bf16 (default mode; its compile time is not timed)
and the peak memory of a step of backfuse and of hf_bf16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as tf

from .. import presets
from ..kernels import graphs
from .runner import GROUPS, log
from .train import Steps, _gemma_norm, _rotate_half, peak_mib, plain_072, time_alternating

# Tokens of one call: Gemma (batch, sequence); Wan (batch, video latents, text); Llama 3.2 Vision's
# cross-attention (batch, text, one 560-pixel tile's 1601 vision tokens).
TOKENS = {"037": ((1, 4096), (8, 1024)), "021": ((1, 4680, 512), (1, 32760, 512)), "072": ((1, 4096, 1601),)}
IMPLEMENTATIONS = ("backfuse", "hf_bf16", "compile_bf16")


def entries(names=None) -> list:
    """(key, preset, local, tokens) of every distinct layer and token count of the named presets (all:
    None); key "<preset>/<tokens>" with "/local" for a sliding-window layer, tokens as "1x4096". Left out
    as the same step as one already listed: a preset whose block equals an earlier one's (Wan 2.2 A14B's
    is Wan 2.1 14B's), and a sliding-window layer at a length its window covers (Gemma 2's 4096)."""
    out, seen = [], set()
    for name in names or presets.PRESETS:
        preset = presets.get(name)
        for local in (False, True) if preset.local is not None else (False,):
            config = preset.local if local else preset.config
            for tokens in TOKENS[preset.problem]:
                if local and config.window >= tokens[1]:
                    continue
                if (preset.problem, config, preset.scalars, tokens) in seen:
                    continue
                seen.add((preset.problem, config, preset.scalars, tokens))
                key = f"{name}/{'x'.join(map(str, tokens))}" + ("/local" if local else "")
                out.append((key, preset, local, tokens))
    return out


def model_gemma(x, cos, sin, wq, wk, wv, wo, qnw, knw, *, heads, kv_heads, head_dim, scaling, softcap, eps, window,
                extra_mask=None):
    """Gemma 2 / 3 attention as transformers trains it: projections, the per-head QK norm (Gemma 3;
    qnw None: none), RoPE, then SDPA with grouped heads (causal, or the sliding window's mask) or, with
    a soft cap, the eager attention (fp32 softmax); o_proj. extra_mask: [S, S] bool, what else hides a key
    (packed documents' block-diagonal mask)."""
    b, s, _ = x.shape
    q = tf.linear(x, wq).view(b, s, heads, head_dim).transpose(1, 2)
    k = tf.linear(x, wk).view(b, s, kv_heads, head_dim).transpose(1, 2)
    v = tf.linear(x, wv).view(b, s, kv_heads, head_dim).transpose(1, 2)
    if qnw is not None:
        q, k = _gemma_norm(q, qnw, eps), _gemma_norm(k, knw, eps)
    cos, sin = cos[:, None], sin[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    i = torch.arange(s, device=x.device)
    visible = (i[None] <= i[:, None]) & ((i[:, None] - i[None] < window) if 0 < window < s else True)
    if extra_mask is not None:
        visible = visible & extra_mask
    if softcap:
        g = heads // kv_heads
        w = q @ k.repeat_interleave(g, 1).transpose(2, 3) * scaling
        w = torch.tanh(w / softcap) * softcap
        w = w.masked_fill(~visible, float("-inf"))
        o = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype) @ v.repeat_interleave(g, 1)
    elif 0 < window < s or extra_mask is not None:
        o = tf.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scaling, enable_gqa=True)
    else:
        o = tf.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    return tf.linear(o.transpose(1, 2).reshape(b, s, heads * head_dim), wo)


def model_wan(video, text, wq, bq, wk, bk, wv, bv, wo, bo, nq, nk, *, heads, eps):
    """Wan 2.1 / 2.2 cross-attention as diffusers runs it: projections with biases, RMSNorm on q and on k
    across all heads, SDPA (scale 1 / sqrt(head size)), the output projection."""
    b, nv, hidden = video.shape
    q = tf.rms_norm(tf.linear(video, wq, bq), (hidden,), nq, eps).unflatten(2, (heads, -1)).transpose(1, 2)
    k = tf.rms_norm(tf.linear(text, wk, bk), (hidden,), nk, eps).unflatten(2, (heads, -1)).transpose(1, 2)
    v = tf.linear(text, wv, bv).unflatten(2, (heads, -1)).transpose(1, 2)
    o = tf.scaled_dot_product_attention(q, k, v)
    return tf.linear(o.transpose(1, 2).flatten(2), wo, bo)


def rope_tables(seq: int, head_dim: int, device, dtype, theta: float = 10000.0):
    """cos, sin [1, seq, head_dim] as transformers' rotary embedding makes them (rotate-half layout)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)[None]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def model_function(preset, config, module):
    """The model's own forward of `module`'s layer (its parameters in backfuse's order) as f(*acts, *params)."""
    if preset.problem == "037":
        def f(x, cos, sin, *params):
            wq, wk, wv, wo, *norms = params
            qnw, knw = norms if norms else (None, None)
            return model_gemma(x, cos, sin, wq, wk, wv, wo, qnw, knw, heads=config.heads, kv_heads=config.kv_heads,
                               head_dim=config.head_dim, scaling=module.scaling, softcap=module.softcap or 0.0,
                               eps=module.eps, window=config.window)
    elif preset.problem == "021":
        def f(video, text, *params):
            return model_wan(video, text, *params, heads=config.heads, eps=module.eps)
    else:
        def f(dec, enc, *params):
            return plain_072(dec, enc, *params, heads=config.heads, kv_heads=config.kv_heads, head_dim=config.head_dim)
    return f


def inputs(preset, config, tokens, device, dtype, seed: int = 0) -> list:
    """One call's activations (those differentiated require gradients)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if preset.problem == "037":
        b, s = tokens
        cos, sin = rope_tables(s, config.head_dim, device, dtype)
        x = torch.randn(b, s, config.hidden, device=device, generator=g).to(dtype).requires_grad_()
        return [x, cos, sin]
    b, n1, n2 = tokens
    widths = (config.hidden, config.cross_hidden) if preset.problem == "072" else (config.hidden, config.hidden)
    return [torch.randn(b, n, w, device=device, generator=g).to(dtype).requires_grad_() for n, w in zip((n1, n2), widths)]


class ModelLayer(Steps):
    """One implementation's layer at one preset and token count."""

    def __init__(self, preset, local: bool, tokens, impl: str, device, seed: int = 0):
        from .. import nn as bnn

        torch.manual_seed(seed)
        config = preset.local if local else preset.config
        cls = {"037": bnn.Gemma3Core, "021": bnn.WanXattn, "072": bnn.QkvGqa}[preset.problem]
        module = cls(config, device=device, dtype=torch.bfloat16, **preset.kwargs)
        acts = inputs(preset, config, tokens, device, torch.bfloat16, seed)
        with torch.no_grad():
            outs = module(*acts)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = [torch.randn_like(o) / math.sqrt(o.numel()) for o in outs]
        if impl == "backfuse":
            leaves = list(module.parameters()) + [a for a in acts if a.requires_grad]
            call = lambda: module(*acts)  # noqa: E731
        else:
            params = [p.detach().clone().requires_grad_() for p in module.parameters()]
            leaves = params + [a for a in acts if a.requires_grad]
            fn = model_function(preset, config, module)
            if impl == "compile_bf16":
                # compiled afresh, as the user's own model would be: dynamo keeps what it compiled per code
                # object, so without the reset every layer after the first recompiles `fn` with dynamic
                # shapes, and past the recompile limit runs it eagerly
                torch._dynamo.reset()
                fn = torch.compile(fn)
            call = lambda: fn(*acts, *params)  # noqa: E731
        super().__init__(leaves, call, grads)


def run_entry(preset, local: bool, tokens, device, *, warmup: int, steps: int, groups: int = GROUPS) -> dict:
    """The "models" entry of one preset layer and token count (benchmarks/results schema): the implementations
    timed in alternating groups (`time_alternating`), then backfuse's and the model code's peaks."""
    graphs.release()  # no pool memory of an earlier layer's graphs counted in this one's peak
    layers = {impl: ModelLayer(preset, local, tokens, impl, device) for impl in IMPLEMENTATIONS}
    timed = time_alternating(layers, warmup=warmup, steps=steps, groups=groups)
    entry = {f"{impl}_ms": round(timed[impl][0], 4) for impl in IMPLEMENTATIONS}
    entry["backfuse_peak_mib"] = round(peak_mib(layers["backfuse"], pools=True), 1)
    entry["hf_bf16_peak_mib"] = round(peak_mib(layers["hf_bf16"]), 1)
    entry["host_us"] = round(timed["backfuse"][1], 1)
    del layers
    torch.cuda.empty_cache()
    log(f"    backfuse / compile bf16 {entry['backfuse_ms'] / entry['compile_bf16_ms']:.2f}")
    return entry
