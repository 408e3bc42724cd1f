"""The norm/RoPE kernels against float64, forward and backward: Gemma's per-head norm with rotate-half RoPE, and
RoPE alone (`kernels/triton/rope.py`); Wan's norm across the heads with RoPE on interleaved pairs as diffusers
turns them, and those pairs alone (`passes.py: row_norm_kernel`, through `train/steps.py`; each pair turned by
cos[2i] and sin[2i + 1]: tables whose entries all differ, so reading another entry shows)."""

import pytest
import torch
from conftest import DEVICE

from backfuse.kernels.triton import rope

T, HEADS, D, BT, EPS = 37, 3, 16, 8, 1e-6


def reference(x, w, cos, sin, norm: bool):
    """float64: RoPE(RMSNorm(x) (1 + w)) per head (norm), or RoPE(x); x [T, heads * D]."""
    y = x.view(T, HEADS, D)
    if norm:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + EPS) * (1 + w)
    c, s = cos[:, None, :], sin[:, None, :]
    half = D // 2
    lo, hi = y[..., :half], y[..., half:]
    return torch.cat((lo * c[..., :half] - hi * s[..., :half], hi * c[..., half:] + lo * s[..., half:]), -1).view(T, -1)


@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_kernels_match_float64(norm):
    torch.manual_seed(0)
    x = torch.randn(T, HEADS * D, device=DEVICE).to(torch.bfloat16)
    w = 0.1 * torch.randn(D, device=DEVICE)
    angles = torch.rand(T, D, device=DEVICE) * 6.3  # every entry its own angle
    cos, sin = angles.cos(), (angles + 0.3).sin()
    blocks = (T + BT - 1) // BT
    out = torch.full_like(x, float("nan"))
    rope.norm_rope_kernel[(blocks, HEADS)](x, w, cos, sin, out, T, T, EPS, D=D, LD_X=HEADS * D, LD_OUT=HEADS * D,
                                           BT=BT, NORM=norm)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = reference(x64, w64, cos.double(), sin.double(), norm)
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max()

    g = torch.randn(T, HEADS * D, device=DEVICE).to(torch.bfloat16)
    want.backward(g.double())
    dx = torch.full_like(x, float("nan"))
    parts = torch.full((HEADS * blocks, D), float("nan"), device=DEVICE)
    rope.norm_rope_backward_kernel[(blocks, HEADS)](
        g, x, w, cos, sin, dx, parts, parts, T, T, EPS, 0, D=D, LD_DOUT=HEADS * D, LD_X=HEADS * D, LD_DX=HEADS * D,
        BT=BT, RANGES=False, NORM=norm)
    assert (dx.double() - x64.grad).abs().max() <= 2e-2 * x64.grad.abs().max()
    if norm:
        assert (parts.double().sum(0) - w64.grad).abs().max() <= 1e-3 * w64.grad.abs().max()


def row_reference(x, w, cos, sin, rows: int):
    """float64: RMSNorm across each row's heads times w (w None: no norm), then each head's pairs (2i, 2i + 1) turned
    by cos[2i] and sin[2i + 1] of table row t % rows, as diffusers' `apply_rotary_emb` turns Wan's q and k."""
    t = x.shape[0]
    y = x if w is None else x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w
    y = y.view(t, HEADS, D)
    at = torch.arange(t, device=x.device) % rows
    c, s = cos[at][:, None, 0::2], sin[at][:, None, 1::2]
    lo, hi = y[..., 0::2], y[..., 1::2]
    return torch.stack((lo * c - hi * s, lo * s + hi * c), -1).view(t, HEADS * D)


@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in place"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm and RoPE", "RoPE alone"])
def test_row_norm_with_rope_on_pairs_matches_float64(norm, in_place, tables):
    """Two batch entries of 19 tokens sharing the tables' 19 rows; three heads of 16 (48 columns in a 64-wide
    tile: the masked columns show); the backward's weight gradient summed from its parts. Tables in bfloat16 too:
    a model cast with `.to(torch.bfloat16)` casts diffusers' rotary tables with it."""
    from backfuse.train import steps

    torch.manual_seed(1)
    rows, t = 19, 38
    x = torch.randn(t, HEADS * D, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(HEADS * D, device=DEVICE) if norm else None
    angles = torch.rand(rows, D, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(tables), (angles + 0.3).sin().to(tables)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if norm else None
    want = row_reference(x64, w64, cos.double(), sin.double(), rows)

    out = x.clone() if in_place else torch.full_like(x, float("nan"))
    steps.row_norm(out if in_place else x, w, out, EPS, rope=(cos, sin, D))()
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max()

    g = torch.randn(t, HEADS * D, device=DEVICE).to(torch.bfloat16)
    want.backward(g.double())
    dx = g.clone() if in_place else torch.full_like(x, float("nan"))
    parts = torch.full((steps.row_norm_parts(t), HEADS * D), float("nan"), device=DEVICE) if norm else None
    steps.row_norm_backward(dx if in_place else g, x if norm else None, w, dx, parts, EPS, None, None,
                            rope=(cos, sin, D))()
    assert (dx.double() - x64.grad).abs().max() <= 2e-2 * x64.grad.abs().max()
    if norm:
        assert (parts.double().sum(0) - w64.grad).abs().max() <= 1e-3 * w64.grad.abs().max()
