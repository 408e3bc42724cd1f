"""`F.wan_attention`: Wan's attention between its projections (q and k RMS-normed across the heads, the
self-attention's RoPE on interleaved pairs, attention) against float64, output and every gradient, in each
training dtype, saved or recomputed, with gradients left out; its custom op under torch.library's checks; and
its input errors."""

import math

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err, stand_in_cudnn
from test_wan_self_attention import diffusers_rope, tables

import backfuse.functional as F

TOL = {torch.float32: 3e-3, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def reference(q, k, v, nq, nk, heads, scale, rope, eps=1e-6):
    """Wan's attention core in float64, as diffusers' processor computes it between its projections."""
    c = q.shape[-1]
    q = torch.nn.functional.rms_norm(q, (c,), nq, eps)
    k = torch.nn.functional.rms_norm(k, (c,), nk, eps)
    q, k, v = (t.unflatten(2, (heads, -1)) for t in (q, k, v))
    if rope is not None:
        q, k = diffusers_rope(q, *rope), diffusers_rope(k, *rope)
    o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale)
    return o.transpose(1, 2).flatten(2)


def _inputs(batch, nv, nt, hidden, dtype, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(batch, nv, hidden, device=DEVICE).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, nt, hidden, device=DEVICE).to(dtype).requires_grad_() for _ in range(2))
    nq, nk = ((1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype).requires_grad_() for _ in range(2))
    return [q, k, v, nq, nk]


def check(batch, nv, nt, hidden, heads, dtype, rope: bool, save=True, wanted=(True,) * 5):
    leaves = _inputs(batch, nv, nt, hidden, dtype, seed=nv + hidden)
    d = hidden // heads
    cos_sin = tables(nv, d, DEVICE) if rope else None
    for t, want in zip(leaves, wanted):
        t.requires_grad_(want)
    out = F.wan_attention(*leaves, 1 / math.sqrt(d), heads=heads, rope=cos_sin, save_activations=save)
    x64 = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    ref = reference(*x64, heads, 1 / math.sqrt(d), None if not rope else tuple(t.double() for t in cos_sin))
    assert out.dtype == dtype and out.shape == (batch, nv, hidden)
    assert rel_err(out.double(), ref) <= TOL[dtype]
    g = torch.randn_like(out)
    chosen = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(out, chosen, g)
    exact = torch.autograd.grad(ref, [t for t in x64 if t.requires_grad], g.double())
    for name, a, b in zip([n for n, w in zip(("q", "k", "v", "nq", "nk"), wanted) if w], got, exact):
        assert a.dtype == dtype, name
        assert rel_err(a.double(), b) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("batch, nv, nt, hidden, heads, rope", [
    (2, 37, 13, 64, 4, False),   # the cross-attention: short text keys
    (1, 29, 29, 96, 3, True),    # the self-attention: the video its own context, turned by RoPE
])
def test_wan_attention_matches_float64(batch, nv, nt, hidden, heads, rope, dtype):
    check(batch, nv, nt, hidden, heads, dtype, rope)


@pytest.mark.parametrize("rope", [False, True])
def test_recomputed_and_gradients_left_out(rope):
    n = 23
    check(1, n, n if rope else 9, 64, 2, torch.bfloat16, rope, save=False)
    check(1, n, n if rope else 9, 64, 2, torch.float32, rope, wanted=(False, False, True, False, True))
    check(1, n, n if rope else 9, 64, 2, torch.float32, rope, wanted=(True, False, False, False, False))


@pytest.mark.skipif(DEVICE != "cuda", reason="cuDNN's attention runs on a GPU")
def test_self_attention_core_on_cudnn_matches_float64(monkeypatch):
    """bfloat16 at head size 128: from its shape's second call the self-attention takes cuDNN's attention."""
    from backfuse.train import plans

    monkeypatch.setattr(plans, "CUDNN_AFTER", 2)
    for save in (True, True, True, False):
        check(1, 300, 300, 256, 2, torch.bfloat16, True, save=save)
    assert any(p.cudnn for k, p in F._plans.items() if k[0] == "021 attention")


def test_the_cudnn_form_with_a_stand_in_core_is_right(monkeypatch):
    """The self-attention core's cuDNN form on any machine (`helpers.stand_in_cudnn`): the norms and RoPE before an
    allocating forward, their backward after an allocating backward, saved or recomputed, against float64."""
    def cudnn_plans():
        return {k for k, p in F._plans.items() if getattr(p, "cudnn", False) and k[0] == "021 attention"}

    stand_in_cudnn(monkeypatch)
    before = cudnn_plans()  # (an earlier test on this worker may have left a real cuDNN plan)
    try:
        check(1, 41, 41, 64, 2, torch.bfloat16, True)
        check(1, 41, 41, 64, 2, torch.bfloat16, True, save=False)
        assert len(cudnn_plans() - before) == 2
    finally:
        for k in cudnn_plans() - before:
            del F._plans[k]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_normed_turned_queries_and_keys_are_made_again_not_saved(dtype):
    """With RoPE (the self-attention) the saved activations hold O and lse: Q and K normed and turned are made
    again in the backward from the caller's q and k (`Plan.turned_anew`), two tensors of the video's size fewer a
    call, and right against float64 all the same (the backward's copies start poisoned)."""
    check(2, 23, 23, 64, 2, dtype, True)
    plans = [p for k, p in F._plans.items() if k[0] == "021 attention" and k[5] and (p.batch, p.nv, p.save) == (2, 23, True)]
    assert plans and all(p.turned_anew for p in plans)
    for p in plans:
        assert not {"q", "k"} & {b.name for b in p.activations.specs}
        assert {b.name for b in p.backward_scratch.specs} >= {"q", "k"}


def test_custom_op_passes_torch_library_checks():
    """torch.library.opcheck on the forward op (schema, fake tensor, autograd registration), both forms."""
    for rope in (False, True):
        q, k, v, nq, nk = _inputs(1, 11, 11 if rope else 5, 32, torch.float32)
        cos, sin = (t.view(11, 16) for t in tables(11, 16, DEVICE)) if rope else (None, None)
        torch.library.opcheck(F.custom_op("wan_attention_forward"), (q, k, v, nq, nk, cos, sin, 0.25, 2, 1e-6),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_wan_attention_names_its_inputs():
    q, k, v, nq, nk = _inputs(1, 8, 5, 32, torch.float32)
    with pytest.raises(ValueError, match="heads must be a positive int"):
        F.wan_attention(q, k, v, nq, nk, 1.0, heads=0)
    with pytest.raises(ValueError, match="input 'value'"):
        F.wan_attention(q, k, v[:, :4], nq, nk, 1.0, heads=2)
    with pytest.raises(ValueError, match="input 'norm_k_weight'"):
        F.wan_attention(q, k, v, nq, nk[:16], 1.0, heads=2)
    with pytest.raises(ValueError, match="wan_attention: rope turns a self-attention's"):
        F.wan_attention(q, k, v, nq, nk, 1.0, heads=2, rope=(torch.ones(8, 16), torch.ones(8, 16)))
