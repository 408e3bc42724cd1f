"""`F.wan_xattn` with rope: Wan's self-attention (the video its own context; q and k RMS-normed across the
heads, then turned on interleaved pairs as diffusers' `apply_rotary_emb` turns them), against float64, forward
and every gradient, on poisoned outputs; and its input errors."""

import math

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err, stand_in_cudnn

import backfuse.functional as F

TOL = {torch.float32: 3e-3, torch.bfloat16: 3e-2}


def diffusers_rope(x, cos, sin):
    """diffusers' WanAttnProcessor's apply_rotary_emb: x [B, N, H, D], cos/sin [1, N, 1, D]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out


def reference(x, p, heads, cos, sin, norm: bool, eps=1e-6):
    """Wan's self-attention in float64, as diffusers computes it (non-causal, scale 1 / sqrt(D))."""
    b, n, c = x.shape
    q = x @ p["wq"].T + p["bq"]
    k = x @ p["wk"].T + p["bk"]
    v = x @ p["wv"].T + p["bv"]
    if norm:
        q = torch.nn.functional.rms_norm(q, (c,), p["nq"], eps)
        k = torch.nn.functional.rms_norm(k, (c,), p["nk"], eps)
    q, k, v = (t.unflatten(2, (heads, -1)) for t in (q, k, v))
    q, k = diffusers_rope(q, cos, sin), diffusers_rope(k, cos, sin)
    o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    return o.transpose(1, 2).flatten(2) @ p["wo"].T + p["bo"]


def tables(n, d, device):
    """diffusers-shaped tables [1, N, 1, D] whose entries all differ (reading another one shows)."""
    angles = torch.rand(1, n, 1, d, device=device, dtype=torch.float64) * 6.3
    return angles.cos().float(), (angles + 0.4).sin().float()


@pytest.mark.parametrize("batch, n, hidden, heads", [(1, 37, 64, 4), (2, 20, 96, 3)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_self_attention_matches_float64(batch, n, hidden, heads, norm, dtype):
    check(batch, n, hidden, heads, norm, dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="cuDNN's attention runs on a GPU")
def test_self_attention_on_cudnn_matches_float64(monkeypatch):
    """bfloat16 at head size 128: from its shape's second call the plan takes cuDNN's attention (its forward
    and backward in the call's launches), still right against float64."""
    from backfuse.train import plans

    monkeypatch.setattr(plans, "CUDNN_AFTER", 2)
    for _ in range(3):
        check(1, 300, 256, 2, True, torch.bfloat16)
    assert any(p.cudnn for k, p in F._plans.items() if k[0] == "021" and k[5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_normed_turned_queries_and_keys_are_made_again_not_saved(dtype):
    """With its norms the self-attention saves the projections' rows, V, O and lse: Q and K normed and turned are
    made again in the backward from the rows (`Plan.turned_anew`), as compile's partitioner recomputes them, two
    tensors of the video's size fewer a call; the backward's copies start poisoned (`check` is right against
    float64 all the same)."""
    check(1, 29, 64, 4, True, dtype)
    plans = [p for k, p in F._plans.items() if k[0] == "021" and k[5] and (p.batch, p.nv, p.save) == (1, 29, True)]
    assert plans and all(p.turned_anew for p in plans)
    for p in plans:
        saved = {b.name: b.nbytes for b in p.activations.specs}
        assert not {"q", "k"} & set(saved) and "q_raw" in saved
        assert {b.name for b in p.backward_scratch.specs} >= {"q", "k"}


def check(batch, n, hidden, heads, norm, dtype):
    """One call's output and every gradient against float64."""
    torch.manual_seed(n + hidden)
    d = hidden // heads
    x = (torch.randn(batch, n, hidden, device=DEVICE) / math.sqrt(hidden)).to(dtype).requires_grad_()
    p = {name: (torch.randn(hidden, hidden, device=DEVICE) / math.sqrt(hidden)).to(dtype).requires_grad_()
         for name in ("wq", "wk", "wv", "wo")}
    p |= {name: (0.1 * torch.randn(hidden, device=DEVICE)).to(dtype).requires_grad_() for name in ("bq", "bk", "bv", "bo")}
    if norm:
        p |= {name: (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype).requires_grad_() for name in ("nq", "nk")}
    cos, sin = tables(n, d, DEVICE)
    norms = dict(norm_q_weight=p["nq"], norm_k_weight=p["nk"]) if norm else {}
    out = F.wan_xattn(x, x, p["wq"], p["bq"], p["wk"], p["bk"], p["wv"], p["bv"], p["wo"], p["bo"], 1 / math.sqrt(d),
                      heads=heads, rope=(cos, sin), **norms)
    leaves = [x, *p.values()]
    x64 = [t.detach().double().requires_grad_() for t in leaves]
    want = reference(x64[0], dict(zip(p, x64[1:])), heads, cos.double(), sin.double(), norm)
    assert rel_err(out.double(), want) <= TOL[dtype]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    wanted = torch.autograd.grad(want, x64, g.double())
    for name, a, b in zip(["x", *p], got, wanted):
        assert rel_err(a.double(), b) <= TOL[dtype], name


def test_rope_tables_are_checked():
    x = torch.randn(1, 8, 32, device=DEVICE)
    w = [torch.randn(32, 32, device=DEVICE) if i % 2 == 0 else torch.zeros(32, device=DEVICE) for i in range(8)]
    cos = torch.ones(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="input 'rope_cos' must be a floating tensor \\[8, 16\\]"):
        F.wan_xattn(x, x, *w, 1.0, heads=2, rope=(cos[:, :4], cos))
    with pytest.raises(ValueError, match="the context must be the video itself \\(8 tokens\\), got 5"):
        F.wan_xattn(x, x[:, :5], *w, 1.0, heads=2, rope=(cos, cos))
    with pytest.raises(ValueError, match="input 'rope_sin' requires a gradient"):
        F.wan_xattn(x, x, *w, 1.0, heads=2, rope=(cos, cos.clone().requires_grad_()))
    with pytest.raises(ValueError, match="rope must be \\(cos, sin\\)"):
        F.wan_xattn(x, x, *w, 1.0, heads=2, rope=cos)


def test_the_cudnn_form_with_a_stand_in_core_is_right(monkeypatch):
    """The self-attention's cuDNN form on any machine (`helpers.stand_in_cudnn`): its launches around the core (the
    output projection after an allocating forward; RoPE's and the norms' backward, the bias sums and products after
    an allocating backward) against float64."""
    stand_in_cudnn(monkeypatch)

    def cudnn_plans():
        return {k for k, p in F._plans.items() if getattr(p, "cudnn", False) and k[0] == "021" and k[5]}

    before = cudnn_plans()  # (test_self_attention_on_cudnn_matches_float64 on this worker leaves a real cuDNN plan)
    try:
        check(1, 41, 64, 2, True, torch.bfloat16)
        check(1, 41, 64, 2, False, torch.bfloat16)
        assert len(cudnn_plans() - before) == 2
    finally:
        for k in cudnn_plans() - before:
            del F._plans[k]
