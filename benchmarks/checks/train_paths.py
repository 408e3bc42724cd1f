"""The training paths on the GPU: correctness against float64 at odd sizes and several configs, graph
replays in a steady loop, a step under set_sync_debug_mode("error"), and the host's time per step with a
profile of where it goes.

    PYTHONPATH=src python3 benchmarks/checks/train_paths.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import time

import torch

import backfuse
from backfuse import nn as bnn
from backfuse.kernels import buffers, graphs
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.qkv_gqa.spec import QkvGqaConfig
from backfuse.ops.wan_xattn.spec import WanXattnConfig

DEV = os.environ.get("DEV", "cuda")


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def rope(batch, seq, d, dtype):
    inv = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat((ang, ang), -1)
    return tuple(t.to(dtype).expand(batch, seq, d).contiguous().to(DEV) for t in (ang.cos(), ang.sin()))


def make(pid, config, dtype, axes, seed=0):
    torch.manual_seed(seed)
    if pid == "021":
        m = bnn.WanXattn(config, device=DEV, dtype=dtype)
        b, nv, nt = axes
        acts = [torch.randn(b, nv, config.hidden, device=DEV, dtype=dtype), torch.randn(b, nt, config.hidden, device=DEV,
                                                                                          dtype=dtype)]
    elif pid == "072":
        m = bnn.QkvGqa(config, device=DEV, dtype=dtype)
        b, sd, se = axes
        acts = [torch.randn(b, sd, config.hidden, device=DEV, dtype=dtype),
                torch.randn(b, se, config.cross_hidden, device=DEV, dtype=dtype)]
    else:
        m = bnn.Gemma3Core(config, softcap=50.0 if config.head_dim == 128 else None, device=DEV, dtype=dtype)
        with torch.no_grad():
            m.q_norm_weight.normal_(0, 0.02)
            m.k_norm_weight.normal_(0, 0.02)
        b, s = axes
        acts = [torch.randn(b, s, config.hidden, device=DEV, dtype=dtype) / math.sqrt(config.hidden),
                *rope(b, s, config.head_dim, dtype)]
    return m, acts


def plain(pid, m, acts):
    """The module's function in float64, by plain PyTorch."""
    from backfuse.bench.train import plain_021, plain_072

    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    a = [x.detach().double().requires_grad_(i == 0 or pid != "037") for i, x in enumerate(acts)]
    c = m.config
    if pid == "021":
        out = plain_021(*a, *p.values(), m.scale, heads=c.heads)
    elif pid == "072":
        out = plain_072(*a, p["q_weight"], p["k_weight"], p["v_weight"], heads=c.heads, kv_heads=c.kv_heads,
                        head_dim=c.head_dim)
    else:
        out = _plain_gemma(a, p, m)
    return out, list(p.values()) + [x for x in a if x.requires_grad]


def _plain_gemma(a, p, m):
    from backfuse.bench.train import plain_037

    c = m.config
    if not c.window:
        return plain_037(*a, *p.values(), m.scaling, m.softcap, m.eps)
    x, cos, sin = a
    b, s, _ = x.shape
    d = c.head_dim
    from backfuse.bench.train import _gemma_norm, _rotate_half

    lin = torch.nn.functional.linear
    q = _gemma_norm(lin(x, p["q_weight"]).view(b, s, c.heads, d).transpose(1, 2), p["q_norm_weight"], m.eps)
    k = _gemma_norm(lin(x, p["k_weight"]).view(b, s, c.kv_heads, d).transpose(1, 2), p["k_norm_weight"], m.eps)
    v = lin(x, p["v_weight"]).view(b, s, c.kv_heads, d).transpose(1, 2)
    q, k = q * cos[:, None] + _rotate_half(q) * sin[:, None], k * cos[:, None] + _rotate_half(k) * sin[:, None]
    k, v = k.repeat_interleave(c.group, 1), v.repeat_interleave(c.group, 1)
    w = q @ k.transpose(2, 3) * m.scaling
    if m.softcap:
        w = torch.tanh(w / m.softcap) * m.softcap
    i, j = torch.arange(s, device=x.device)[:, None], torch.arange(s, device=x.device)[None]
    w = w.masked_fill(~((j <= i) & (i - j < c.window)), float("-inf"))
    return torch.nn.functional.linear((torch.softmax(w, -1) @ v).transpose(1, 2).reshape(b, s, -1), p["o_weight"])


def correctness():
    rows = []
    cases = [
        ("021", WanXattnConfig(), (2, 613, 77)), ("021", WanXattnConfig(1536, 12), (1, 1037, 512)),
        ("072", QkvGqaConfig(), (2, 37, 613)), ("072", QkvGqaConfig(4096, 4096, 32, 8, 128), (1, 77, 129)),
        ("037", Gemma3CoreConfig(), (2, 613)), ("037", Gemma3CoreConfig(2560, 8, 4, 256, window=128), (1, 541)),
    ]
    for pid, config, axes in cases:
        for dtype in (torch.float32, torch.bfloat16):
            m, acts = make(pid, config, dtype, axes)
            for a in acts[:1] if pid == "037" else acts:
                a.requires_grad_(True)
            with buffers.poisoned():
                out = m(*acts)
                outs = out if isinstance(out, tuple) else (out,)
                grads_out = [torch.randn_like(o) for o in outs]
                torch.autograd.backward(outs, grads_out)
            ref, leaves = plain(pid, m, acts)
            refs = ref if isinstance(ref, tuple) else (ref,)
            torch.autograd.backward(refs, [g.double() for g in grads_out])
            ours = [p.grad for p in m.parameters()] + [a.grad for a in (acts[:1] if pid == "037" else acts)]
            errs = [rel(o, r) for o, r in zip(outs, refs)] + [rel(g, leaf.grad) for g, leaf in zip(ours, leaves)
                                                              if leaf.grad.abs().max() > 1e-9]
            bad = any(not math.isfinite(e) or e > (2e-3 if dtype == torch.float32 else 3e-2) for e in errs)
            rows.append(f"{pid} {config} {axes} {str(dtype)[6:]}: worst {max(errs):.1e} {'FAIL' if bad else 'ok'}")
            print(rows[-1], flush=True)


def steady(pid, config, dtype, axes, steps=30):
    m, acts = make(pid, config, dtype, axes)
    for a in acts[:1] if pid == "037" else acts:
        a.requires_grad_(True)
    out = m(*acts)
    grads_out = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]
    leaves = list(m.parameters()) + [a for a in acts if a.requires_grad]

    def step():
        for leaf in leaves:
            leaf.grad = None
        o = m(*acts)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), grads_out)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    before = dict(graphs.counts)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        sync = "no sync"
    except RuntimeError as e:
        sync = f"SYNC: {e}"
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    after = dict(graphs.counts)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"{pid} {str(dtype)[6:]} {axes}: host {1e6 * (issued - t0) / steps:.0f} us/step, wall {1e3 * (t1 - t0) / steps:.3f} "
          f"ms/step, graphs {delta}, {sync}", flush=True)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    correctness()
    for pid, config, axes in (("021", WanXattnConfig(), (1, 512, 77)), ("072", QkvGqaConfig(), (2, 128, 128)),
                              ("037", Gemma3CoreConfig(), (1, 512))):
        for dtype in (torch.float32, torch.bfloat16):
            step = steady(pid, config, dtype, axes)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                step()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    print(backfuse.__version__)


if __name__ == "__main__":
    main()
