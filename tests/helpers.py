"""Shared test helpers."""

import torch

from backfuse.bench import check_outputs

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
