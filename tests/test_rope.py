"""The norm/RoPE kernels (`kernels/triton/rope.py`) against float64, forward and backward: Gemma's per-head
norm with rotate-half RoPE, RoPE alone, and RoPE on interleaved pairs as diffusers' Wan rotates them (each pair
turned by cos[2i] and sin[2i + 1]: tables whose entries all differ, so reading another entry shows)."""

import pytest
import torch
from conftest import DEVICE

from backfuse.kernels.triton import rope

T, HEADS, D, BT, EPS = 37, 3, 16, 8, 1e-6


def reference(x, w, cos, sin, norm: bool, pairs: bool):
    """float64: RoPE(RMSNorm(x) (1 + w)) per head (norm), or RoPE(x); x [T, heads * D]."""
    y = x.view(T, HEADS, D)
    if norm:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + EPS) * (1 + w)
    c, s = cos[:, None, :], sin[:, None, :]
    if pairs:
        lo, hi, c, s = y[..., 0::2], y[..., 1::2], c[..., 0::2], s[..., 1::2]
        return torch.stack((lo * c - hi * s, lo * s + hi * c), -1).view(T, HEADS * D)
    half = D // 2
    lo, hi = y[..., :half], y[..., half:]
    return torch.cat((lo * c[..., :half] - hi * s[..., :half], hi * c[..., half:] + lo * s[..., half:]), -1).view(T, -1)


@pytest.mark.parametrize("norm, pairs", [(True, False), (False, False), (False, True), (True, True)])
def test_norm_rope_kernels_match_float64(norm, pairs):
    torch.manual_seed(0)
    x = torch.randn(T, HEADS * D, device=DEVICE).to(torch.bfloat16)
    w = 0.1 * torch.randn(D, device=DEVICE)
    angles = torch.rand(T, D, device=DEVICE) * 6.3  # every entry its own angle
    cos, sin = angles.cos(), (angles + 0.3).sin()
    blocks = (T + BT - 1) // BT
    out = torch.full_like(x, float("nan"))
    rope.norm_rope_kernel[(blocks, HEADS)](x, w, cos, sin, out, T, T, EPS, D=D, LD_X=HEADS * D, LD_OUT=HEADS * D,
                                           BT=BT, NORM=norm, PAIRS=pairs)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = reference(x64, w64, cos.double(), sin.double(), norm, pairs)
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max()

    g = torch.randn(T, HEADS * D, device=DEVICE).to(torch.bfloat16)
    want.backward(g.double())
    dx = torch.full_like(x, float("nan"))
    parts = torch.full((HEADS * blocks, D), float("nan"), device=DEVICE)
    rope.norm_rope_backward_kernel[(blocks, HEADS)](
        g, x, w, cos, sin, dx, parts, parts, T, T, EPS, 0, D=D, LD_DOUT=HEADS * D, LD_X=HEADS * D, LD_DX=HEADS * D,
        BT=BT, RANGES=False, NORM=norm, PAIRS=pairs)
    assert (dx.double() - x64.grad).abs().max() <= 2e-2 * x64.grad.abs().max()
    if norm:
        assert (parts.double().sum(0) - w64.grad).abs().max() <= 1e-3 * w64.grad.abs().max()
