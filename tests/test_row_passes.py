"""The passes whose programs each take a run of rows (`passes.py`: `column_partials_kernel`, `row_norm_backward_kernel`)
against float64: each program reads, sums and writes its own run only, also where the run's length is not a
multiple of the rows a step takes (the last step masked at the run's end, not at the tensor's: session 59 found
both kernels reading past it on the GPU, where runs are long, so that column sums counted rows twice and the in-place
norm backward read rows a neighbour had already overwritten)."""

import pytest
import torch
from conftest import DEVICE

from backfuse.kernels.triton import passes
from backfuse.train import steps

EPS = 1e-6


def norm_reference(x, w, g):
    """(dx, w's gradient) of RMSNorm(x) w across each row, float64, at upstream g."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS) * w64).backward(g.double())
    return x64.grad, w64.grad


@pytest.mark.parametrize("per, bt", [(7, 4), (5, 2), (8, 4)])
def test_row_norm_backward_programs_keep_to_their_rows(per, bt):
    """In place (dx is dy), runs of `per` rows taken `bt` at a time, 38 rows of 48 columns (a 64-wide tile), the weight's
    and the bias's gradients summed from their parts."""
    torch.manual_seed(2)
    t, width = 38, 48
    x = torch.randn(t, width, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(width, device=DEVICE)
    g = torch.randn(t, width, device=DEVICE).to(torch.bfloat16)
    want_dx, want_w = norm_reference(x, w, g)
    n = (t + per - 1) // per
    dx = g.clone()
    parts, bias_parts = (torch.full((n, width), float("nan"), device=DEVICE) for _ in range(2))
    ranges = torch.zeros(4, device=DEVICE)
    passes.row_norm_backward_kernel[(n,)](dx, x, w, dx, parts, bias_parts, ranges, dx, dx, t, 1, EPS, per, -1, W=width,
                                          BW=64, LD_DY=width, LD_X=width, LD_DX=width, BT=bt, RANGES=False, NORM=True,
                                          ROPE=0, BIAS=True)
    assert (dx.double() - want_dx).abs().max() <= 2e-2 * want_dx.abs().max()
    assert (parts.double().sum(0) - want_w).abs().max() <= 1e-3 * want_w.abs().max()
    want_b = want_dx.sum(0)
    assert (bias_parts.double().sum(0) - want_b).abs().max() <= 1e-3 * want_b.abs().max()


@pytest.mark.parametrize("per, rows", [(37, 8), (9, 4), (16, 8)])
def test_column_partials_programs_keep_to_their_rows(per, rows):
    """Runs of `per` rows, `rows` a step: each part the sum of its own run, the parts together the column sums."""
    torch.manual_seed(3)
    r, c = 100, 20
    x = torch.randn(r, c, device=DEVICE).to(torch.bfloat16)
    n = (r + per - 1) // per
    parts = torch.full((n, c), float("nan"), device=DEVICE)
    passes.column_partials_kernel[(n, 1)](x, parts, r, c, per, LD=c, ROWS=rows, COLS=32)
    want = torch.stack([x[i * per:(i + 1) * per].double().sum(0) for i in range(n)])
    assert (parts.double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_row_passes_at_training_lengths():
    """Through `train/steps.py` at lengths whose GPU runs are not whole steps (18200 rows: column sums' runs of 285,
    a step 32; 18720: the norm's runs of 74, a step 16 at this width). On the CPU the interpreter takes one run."""
    torch.manual_seed(4)
    width = 48
    x = torch.randn(18200, width, device=DEVICE).to(torch.bfloat16)
    out = torch.full((width,), float("nan"), device=DEVICE)
    parts = torch.full((steps.column_sum_parts(18200), width), float("nan"), device=DEVICE)
    for launch in steps.column_sums(x, out, parts, None, unscale=False):
        launch()
    want = x.double().sum(0)
    assert (out.double() - want).abs().max() <= 1e-2 * want.abs().max()

    t = 18720
    x = torch.randn(t, width, device=DEVICE).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(width, device=DEVICE)
    g = torch.randn(t, width, device=DEVICE).to(torch.bfloat16)
    want_dx, want_w = norm_reference(x, w, g)
    dx = g.clone()
    parts, bias_parts = (torch.full((steps.row_norm_parts(t), width), float("nan"), device=DEVICE) for _ in range(2))
    steps.row_norm_backward(dx, x, w, dx, parts, EPS, None, None, bias_parts=bias_parts)()
    assert (dx.double() - want_dx).abs().max() <= 2e-2 * want_dx.abs().max()
    assert (parts.double().sum(0) - want_w).abs().max() <= 1e-3 * want_w.abs().max()
    bias = torch.empty(width, device=DEVICE)
    steps.column_finish(bias_parts, bias, None, unscale=False)[0]()
    assert (bias.double() - want_dx.sum(0)).abs().max() <= 1e-3 * want_dx.sum(0).abs().max()
