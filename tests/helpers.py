"""Shared test helpers."""

import os
import pathlib
import subprocess
import sys

import torch
from conftest import DEVICE

import backfuse
from backfuse.bench import check_outputs
from backfuse.fp16_guard import RangeSlots
from backfuse.kernels import buffers

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_cli(*args, env=None, stdout=subprocess.PIPE, timeout=300):
    """`python -m backfuse ARGS` in a fresh process running this checkout (CLI findings are tested as a user
    meets them); env: variables to set, None as a value unsets one. Returns the CompletedProcess (text)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return subprocess.run([sys.executable, "-m", "backfuse", *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          env=environ, timeout=timeout)


# Small odd shapes per problem (axes in official order).
ODD_AXES = {
    "072": [dict(batch_size=1, seq_len_dec=37, seq_len_enc=19), dict(batch_size=2, seq_len_dec=1, seq_len_enc=77)],
    "037": [dict(batch_size=1, seq_len=37), dict(batch_size=2, seq_len=19)],
    "021": [
        dict(batch_size=1, num_video_tokens=37, num_text_tokens=19),
        dict(batch_size=2, num_video_tokens=61, num_text_tokens=77),
    ],
}


def autograd_backward(prob, inputs, dtype=torch.float64):
    """The outputs in official order, by torch.autograd through the problem's forward in `dtype`."""
    named = dict(zip(prob.input_names, inputs))
    cast = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in named.items()}
    leaves = {k: cast[k].clone().requires_grad_(True) for k in prob.differentiates}
    fwd_names = [n for n in prob.input_names if n not in prob.upstream_grads]
    outs = prob.forward(*[leaves.get(n, cast[n]) for n in fwd_names])
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, [leaves[n] for n in prob.differentiates],
                                [cast[n] for n in prob.upstream_grads])
    return tuple(g.to(torch.float32) for g in grads)


def assert_official_pass(prob, outs, refs, tol=None):
    tol = tol or prob.workloads[0].tolerance
    verdict = check_outputs(outs, refs, tol, prob.output_names)
    assert verdict.passed, verdict.reason


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


FP16_REL_ERR = 2e-3  # fp16 operands with fp32 accumulation land near 3e-4 (021's attention chain: 1e-3)
# Outputs that are zero in exact arithmetic (only rounding noise remains): bounded in absolute terms.
NEAR_ZERO = {"grad_key_bias": 0.05}


def fused_with(pid, **options):
    """The operator's fused kernels (`Problem.fused`: ops/<stem>/backward.py) on the official inputs,
    with options (config, sms, products, deterministic, ...) and whatever the caller adds (ranges, needs)."""
    prob = backfuse.problem(pid)
    return lambda *inputs, **extra: prob.fused(*inputs, **options, **extra)


def check_fused(prob, axes, seed, fn=None, device=None):
    """Run once on poisoned buffers, check against the reference; returns (inputs, outputs).

    fn (default prob.run, whose fp16 range guard fails the test by its warning) takes `ranges`:
    every slot of the range guard must be written and in range (poisoned slots read NaN)."""
    inputs = prob.make_inputs(axes, seed=seed, device=device or DEVICE)
    copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    ranges = RangeSlots()
    with buffers.poisoned():
        outs = fn(*inputs, ranges=ranges) if fn else prob.run(*inputs)
    assert ranges.out_of_range() == []
    refs = prob.reference(*inputs)
    assert_official_pass(prob, outs, refs)
    for name, o, r in zip(prob.output_names, outs, refs):
        assert o.shape == r.shape and o.dtype == torch.float32 and o.is_contiguous(), name
        if name in NEAR_ZERO:
            assert (o - r).abs().max().item() < NEAR_ZERO[name], name
        else:
            assert rel_err(o, r) < FP16_REL_ERR, name
    for name, x, y in zip(prob.input_names, inputs, copies):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"{name} was modified"
    storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    assert not any(o.untyped_storage().data_ptr() in storages for o in outs), "an output aliases an input"
    return inputs, outs


def check_needs(prob, axes, wanted):
    """The official fused kernels skip the products only unwanted outputs need; the wanted outputs still
    match the reference (on poisoned buffers, so a product the skip left out would show)."""
    inputs = prob.make_inputs(axes, seed=6, device=DEVICE)
    needs = [name in wanted for name in prob.differentiates]
    with buffers.poisoned():
        outs = prob.fused(*inputs, needs=needs)
    refs = prob.reference(*inputs)
    for name, need, o, r in zip(prob.output_names, needs, outs, refs):
        if not need:
            continue
        if name in NEAR_ZERO:
            assert (o - r).abs().max().item() < NEAR_ZERO[name], name
        else:
            assert rel_err(o, r) < FP16_REL_ERR, name


def check_deterministic(prob, axes, fn):
    """Partial sums stored per program and added in a fixed order: correct, and the same bits twice
    (a real check on the GPU; the interpreter runs programs in order anyway)."""
    inputs, outs = check_fused(prob, axes, seed=8, fn=fn)
    for a, b in zip(outs, fn(*inputs)):
        assert torch.equal(a, b)


def check_beside_busy_stream(pid, axes, seed=21, calls=3, **options):
    """Calls whose later launches start early (PDL) and wait on counters the earlier ones signal still
    complete, right, while another stream keeps the SMs busy; every call starts from counters its pack
    zeroed (`calls` in a row). options: the fused path's (products, ...). GPU only."""
    import time

    prob = backfuse.problem(pid)
    inputs = prob.make_inputs(axes, seed=seed, device=DEVICE)
    refs = prob.reference(*inputs)
    busy = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=DEVICE)
    torch.cuda.synchronize()
    for _ in range(calls):
        with torch.cuda.stream(busy):  # ≈ 40 matrix products of 137 GFLOP each, queued before the call
            for _ in range(40):
                a = torch.tanh(a @ a * 1e-2)
        with buffers.poisoned():
            outs = prob.fused(*inputs, sms=132, **options)
        done = torch.cuda.Event()
        done.record()
        limit = time.monotonic() + 60
        while not done.query():
            assert time.monotonic() < limit, "the call did not finish beside a busy stream"
            time.sleep(0.01)
        assert_official_pass(prob, outs, refs)
    torch.cuda.synchronize()


# ------------------------------------ the training ops at any config, against float64 --------------------------------
def attention64(q, k, v, batch, heads, group, d, scale, cap, causal, window, additive=None):
    """Float64 attention of token-major q [B*Sq, H*D], k, v [B*Sk, KV*D] (soft cap 0: none; window 0: none);
    additive: a [B, 1, Sq, Sk] mask added to the logits after the cap, as eager attention adds it."""
    s_q, s_k = q.shape[0] // batch, k.shape[0] // batch
    qh = q.view(batch, s_q, heads, d).transpose(1, 2)
    kh = k.view(batch, s_k, heads // group, d).transpose(1, 2).repeat_interleave(group, 1)
    vh = v.view(batch, s_k, heads // group, d).transpose(1, 2).repeat_interleave(group, 1)
    i, j = torch.arange(s_q, device=q.device)[:, None], torch.arange(s_k, device=q.device)[None]
    visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i
    if window:
        visible &= i - j < window
    out = []
    step = max(1, 2**27 // (batch * s_q * s_k))  # heads at a time: 1 GiB of float64 logits at most (but one head)
    for h in range(0, heads, step):
        z = qh[:, h:h + step] @ kh[:, h:h + step].transpose(-1, -2) * scale
        if cap:
            z = cap * torch.tanh(z / cap)
        if additive is not None:
            z = z + additive.double()
        out.append(torch.softmax(z.masked_fill(~visible, float("-inf")), -1) @ vh[:, h:h + step])
    return torch.cat(out, 1).transpose(1, 2).reshape(batch * s_q, -1)


def training_module(pid, config, dtype, softcap=None, device=None, **scalars):
    """backfuse.nn's module of operator `pid` at `config`, its norm weights (if any) away from their init."""
    from backfuse import nn as bnn

    device = device or DEVICE
    if pid == "072":
        return bnn.QkvGqa(config, device=device, dtype=dtype)
    if pid == "021":
        m = bnn.WanXattn(config, device=device, dtype=dtype, **scalars)
    else:
        m = bnn.Gemma3Core(config, softcap=softcap, device=device, dtype=dtype, **scalars)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p), alpha=0.05)
    return m


def rope_tables(seq, d, dtype, device=None):
    """Rotate-half RoPE tables cos, sin [1, seq, d] (theta 1e4)."""
    inv = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)
    return (ang.cos().to(dtype)[None].to(device or DEVICE), ang.sin().to(dtype)[None].to(device or DEVICE))


def training_inputs(pid, config, sizes, dtype, device=None):
    """The activations of one call (those that get gradients require them): 072 (batch, Sd, Se), 021
    (batch, Nv, Nt), 037 (batch, S) with RoPE tables [B, S, D]."""
    device = device or DEVICE
    if pid == "037":
        b, s = sizes
        cos, sin = rope_tables(s, config.head_dim, dtype, device)
        x = (torch.randn(b, s, config.hidden, device=device) / config.hidden ** 0.5).to(dtype).requires_grad_()
        return [x, cos.expand(b, s, -1), sin.expand(b, s, -1)]
    b, n1, n2 = sizes
    widths = (config.hidden, config.cross_hidden) if pid == "072" else (config.hidden, config.hidden)
    return [torch.randn(b, n, w, device=device, dtype=dtype, requires_grad=True) for n, w in zip((n1, n2), widths)]


def training_call(pid, m, acts, save=True):
    """The module's op through backfuse.functional (save=False: the memory-minimal form)."""
    from backfuse import functional as F

    c, kw = m.config, ({} if save else {"save_activations": False})
    if pid == "037":
        return F.gemma3_core(*acts, m.q_weight, m.k_weight, m.v_weight, m.o_weight, getattr(m, "q_norm_weight", None),
                             getattr(m, "k_norm_weight", None), m.scaling, m.softcap, m.eps, window=c.window,
                             head_dim=c.head_dim, **kw)
    if pid == "021":
        projections = [getattr(m, f"{n}_{kind}") for n in ("query", "key", "value", "output") for kind in ("weight", "bias")]
        norms = dict(norm_q_weight=m.norm_q_weight, norm_k_weight=m.norm_k_weight, eps=m.eps) if c.qk_norm else {}
        return F.wan_xattn(*acts, *projections, m.scale, heads=c.heads, **norms, **kw)
    return F.qkv_gqa(*acts, m.q_weight, m.k_weight, m.v_weight, head_dim=c.head_dim, **kw)


def training_float64(pid, m, acts):
    """The module's function in float64 by plain PyTorch (Hugging Face's Gemma norm; Wan's q, k RMSNorm
    across the heads; the window by mask): (outputs, float64 parameters by name, float64 activations)."""
    from backfuse.bench.train import _gemma_norm, _rotate_half, plain_072

    lin = torch.nn.functional.linear
    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    a = [x.detach().double().requires_grad_(x.requires_grad) for x in acts]
    c = m.config
    if pid == "072":
        return plain_072(*a, *p.values(), heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim), p, a
    if pid == "021":
        video, text = a
        q, k = lin(video, p["query_weight"], p["query_bias"]), lin(text, p["key_weight"], p["key_bias"])
        if c.qk_norm:
            q = torch.nn.functional.rms_norm(q, (c.hidden,), p["norm_q_weight"], m.eps)
            k = torch.nn.functional.rms_norm(k, (c.hidden,), p["norm_k_weight"], m.eps)
        v = lin(text, p["value_weight"], p["value_bias"])
        b, nv, nt = video.shape[0], video.shape[1], text.shape[1]
        o = attention64(q.reshape(b * nv, -1), k.reshape(b * nt, -1), v.reshape(b * nt, -1), b, c.heads, 1, c.head_dim,
                        m.scale, 0.0, False, 0)
        return lin(o.view(b, nv, -1), p["output_weight"], p["output_bias"]), p, a
    x, cos, sin = a
    b, s, _ = x.shape
    d = c.head_dim
    q = lin(x, p["q_weight"]).view(b, s, c.heads, d).transpose(1, 2)
    k = lin(x, p["k_weight"]).view(b, s, c.kv_heads, d).transpose(1, 2)
    if c.qk_norm:
        q, k = _gemma_norm(q, p["q_norm_weight"], m.eps), _gemma_norm(k, p["k_norm_weight"], m.eps)
    v = lin(x, p["v_weight"]).view(b, s, c.kv_heads, d).transpose(1, 2)
    q, k = q * cos[:, None] + _rotate_half(q) * sin[:, None], k * cos[:, None] + _rotate_half(k) * sin[:, None]
    o = attention64(q.transpose(1, 2).reshape(b * s, -1), k.transpose(1, 2).reshape(b * s, -1),
                    v.transpose(1, 2).reshape(b * s, -1), b, c.heads, c.group, d, m.scaling, m.softcap or 0.0, True,
                    c.window)
    return lin(o.view(b, s, -1), p["o_weight"]), p, a


def check_training_step(pid, m, acts, tol, save=True):
    """Forward and backward of the op on poisoned buffers against float64 autograd of the same function:
    output and every gradient in the inputs' dtype within `tol` relative (key_bias, zero in exact
    arithmetic, bounded against value_bias's gradient)."""
    with buffers.poisoned():
        out = training_call(pid, m, acts, save)
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
    ref, params, exact = training_float64(pid, m, acts)
    refs = ref if isinstance(ref, tuple) else (ref,)
    torch.autograd.backward(refs, [g.double() for g in grads])
    for o, r in zip(outs, refs):
        assert o.dtype == acts[0].dtype and rel_err(o, r) < tol
    for (name, p), (_, e) in zip(m.named_parameters(), params.items()):
        if name == "key_bias":
            assert (p.grad.double() - e.grad).abs().max() < 0.05 * params["value_bias"].grad.abs().max(), name
        else:
            assert p.grad.dtype == acts[0].dtype and rel_err(p.grad, e.grad) < tol, name
    for i, (x, e) in enumerate(zip(acts, exact)):
        if x.requires_grad:
            assert rel_err(x.grad, e.grad) < tol, f"activation {i}"


def _flash_attend(q, k, v, scale, causal, window, softcap):
    """One sequence as FlashAttention computes it: q [Sq, H, D], k, v [Sk, KV, D]; causality aligned to the last
    key, window (left, right) in positions (-1: none), the logits soft-capped before the mask; a query that sees
    no key gets 0."""
    sq, heads, d = q.shape
    sk = k.shape[0]
    k, v = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
    z = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * (scale or d ** -0.5)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i
    if window[0] >= 0:
        visible &= j >= i - window[0]
    if window[1] >= 0:
        visible &= j <= i + window[1]
    p = torch.softmax(z.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v.double()).to(q.dtype)


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return torch.stack([_flash_attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap)
                        for b in range(q.shape[0])])


def _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            deterministic=False, return_attn_probs=False, block_table=None):
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for a, b, c, e in zip(cq, cq[1:], ck, ck[1:]):
        out[a:b] = _flash_attend(q[a:b], k[c:e], v[c:e], softmax_scale, causal, window_size, softcap)
    return out


def stand_in_flash_attention(monkeypatch, softcap: bool = True):
    """FlashAttention's functions (flash_attn_func, flash_attn_varlen_func, by its documented rules, in float64)
    where transformers imports them, so a model set to `flash_attention_2` runs transformers' own FlashAttention
    path (unpadding, packed documents from position ids or cu_seq_lens, the window, the soft cap) without the
    package; softcap=False: a kernel that takes no soft cap. Returns flash(model): the model set to it."""
    import transformers.modeling_flash_attention_utils as fa

    from backfuse.integrations import transformers as hf

    varlen = _flash_attn_varlen_func
    if not softcap:
        def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                   causal=False, window_size=(-1, -1), deterministic=False):
            return _flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    functions = (_flash_attn_func, varlen, None, fa._pad_input, fa._unpad_input)
    if not hasattr(fa, "_flash_with_kvcache_fn"):  # (transformers versions without the paged function)
        functions = functions[:2] + functions[3:]
    monkeypatch.setattr(fa, "_lazy_imports", lambda *a, **k: functions)
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_process_flash_kwargs_fn"):
        if hasattr(fa, name):
            monkeypatch.setattr(fa, name, None)
    monkeypatch.setattr(hf, "_FLASH", {})

    def flash(model):
        model.config._attn_implementation_internal = "flash_attention_2"
        return model

    return flash

def stand_in_cudnn(monkeypatch):
    """cuDNN's attention ops (`train/cudnn.py`) stood in for by plain PyTorch on the same token-major rows and views,
    served for every call from its first (CUDNN_AFTER 1): the launches a training op runs around cuDNN's core
    (allocating forward and backward steps, what reads their outputs) on any machine."""
    from backfuse.train import cudnn, plans

    def heads(a, *rows):
        return [cudnn._heads(t, a.batch, t.shape[0] // a.batch, a.head_dim).float() for t in rows]

    def logits(a, qh, kh, scale):
        z = qh @ kh.repeat_interleave(a.group, 1).transpose(-1, -2) * scale
        if a.causal:
            i = torch.arange(z.shape[-1], device=z.device)
            z = z.masked_fill(i[None] > i[:, None], float("-inf"))
        return z

    def forward(a, q, k, v, scale):
        qh, kh, vh = heads(a, q, k, v)
        z = logits(a, qh, kh, scale)
        o = z.softmax(-1) @ vh.repeat_interleave(a.group, 1)
        return cudnn._rows(o.to(q.dtype)), z.logsumexp(-1).view(a.batch * a.heads, -1)

    def backward(a, q, k, v, o, lse, do, scale):
        with torch.enable_grad():  # (called inside the op's backward)
            qh, kh, vh = (t.requires_grad_() for t in heads(a, q, k, v))
            z = logits(a, qh, kh, scale)
            out = z.softmax(-1) @ vh.repeat_interleave(a.group, 1)
            # cuDNN's backward reads the forward's O and lse: they must be the ones this call's forward made
            assert torch.allclose(lse.view(z.shape[:-1]), z.logsumexp(-1), atol=1e-2), "lse is not the forward's"
            assert torch.allclose(heads(a, o)[0], out, atol=3e-2), "O is not the forward's"
            grads = torch.autograd.grad(out, (qh, kh, vh), heads(a, do)[0])
        return tuple(cudnn._rows(g.to(q.dtype)) for g in grads)

    monkeypatch.setattr(cudnn, "forward", forward)
    monkeypatch.setattr(cudnn, "backward", backward)
    enabled = cudnn.enabled
    monkeypatch.setattr(cudnn, "serves", lambda a, *args: enabled() and a.masking is None and a.softcap == 0.0)
    monkeypatch.setattr(plans, "CUDNN_AFTER", 1)
