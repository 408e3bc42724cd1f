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
