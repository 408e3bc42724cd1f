"""072's fused kernels against the reference: odd shapes, K splits, needs, deterministic mode.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import dataclasses

import pytest
import torch
from conftest import DEVICE
from helpers import FP16_REL_ERR, assert_official_pass, check_deterministic, check_fused, check_needs, fused_with, rel_err

import backfuse
from backfuse.ops.qkv_gqa import config

AXES = dict(batch_size=3, seq_len_dec=5, seq_len_enc=13)


@pytest.mark.parametrize("axes", [
    dict(batch_size=1, seq_len_dec=37, seq_len_enc=19),
    dict(batch_size=2, seq_len_dec=1, seq_len_enc=77),
])
def test_odd_shapes(axes):
    check_fused(backfuse.problem("072"), axes, seed=11)


def test_split_k_and_gpu_tiles():
    """Many processors force K splits (atomics into pre-zeroed outputs); the GPU's tile shape (on the
    CPU with the interpreter's pack: its one-program-per-megaelement passes would take a GPU's
    compiler minutes)."""
    cfg = config.CONFIG if DEVICE == "cuda" else dataclasses.replace(config.INTERPRETER_CONFIG, tiles=config.CONFIG.tiles)
    check_fused(backfuse.problem("072"), AXES, seed=5, fn=fused_with("072", config=cfg, sms=132))


@pytest.mark.parametrize("wanted", [("decoder_hidden_states", "encoder_hidden_states"), ("k_weight",)])
def test_backward_computes_only_what_is_needed(wanted):
    check_needs(backfuse.problem("072"), dict(batch_size=1, seq_len_dec=7, seq_len_enc=5), wanted)


def test_deterministic_mode():
    check_deterministic(backfuse.problem("072"), AXES, fused_with("072", deterministic=True, sms=132))


ON_HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernel runs on Hopper GPUs (sm_90) only")


@hopper_only
@pytest.mark.parametrize("axes", [
    dict(batch_size=1, seq_len_dec=1, seq_len_enc=1), dict(batch_size=1, seq_len_dec=37, seq_len_enc=77),
    dict(batch_size=3, seq_len_dec=613, seq_len_enc=5), dict(batch_size=2, seq_len_dec=129, seq_len_enc=255),
    dict(batch_size=8, seq_len_dec=128, seq_len_enc=128),  # an official case the plan gives the Gluon kernel
])
def test_gluon_one_launch(axes):
    """Poisoned buffers, every range slot written, the official rule; K splits as planned."""
    check_fused(backfuse.problem("072"), axes, seed=21, fn=fused_with("072", products="gluon"))


@hopper_only
def test_gluon_deterministic_and_needs():
    axes = dict(batch_size=2, seq_len_dec=256, seq_len_enc=200)
    check_deterministic(backfuse.problem("072"), axes, fused_with("072", products="gluon", deterministic=True))
    prob = backfuse.problem("072")
    inputs = prob.make_inputs(axes, seed=3, device=DEVICE)
    refs = prob.reference(*inputs)
    for needs in ((True, True, False, False, False), (False, False, True, True, True)):
        outs = prob.fused(*inputs, products="gluon", needs=needs)
        for name, need, o, r in zip(prob.output_names, needs, outs, refs):
            if need:
                assert rel_err(o, r) < FP16_REL_ERR, name


@hopper_only
def test_gluon_repeated_calls_are_stable():
    """The counters live on between calls (the kernel leaves them zero): 20 calls give the same bits
    (deterministic mode), calls of other sizes in between (fewer and more counters) stay right, and
    every counter is zero after each call."""
    from backfuse.kernels import buffers

    prob = backfuse.problem("072")
    inputs = prob.make_inputs(dict(batch_size=1, seq_len_dec=300, seq_len_enc=500), seed=4, device=DEVICE)
    first = prob.fused(*inputs, products="gluon", deterministic=True)
    for i in range(20):
        assert all(a.equal(b) for a, b in zip(first, prob.fused(*inputs, products="gluon", deterministic=True)))
        if i % 5 == 0:
            axes = dict(batch_size=1 + i, seq_len_dec=37 * (i + 1), seq_len_enc=77)
            check_fused(prob, axes, seed=i, fn=fused_with("072", products="gluon"))
        torch.cuda.synchronize()
        assert buffers.zeroed_counters(torch.device(DEVICE), 4096).count_nonzero().item() == 0


@hopper_only
def test_gluon_grid_is_resident_and_survives_a_busy_stream():
    """The one-launch kernel's programs wait on each other: a grid the device cannot hold at once is
    refused before launch (here by claiming twice the SMs), and a call made while another stream
    keeps the SMs busy still completes, with the right outputs."""
    import time

    prob = backfuse.problem("072")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    axes = dict(batch_size=2, seq_len_dec=700, seq_len_enc=900)
    inputs = prob.make_inputs(axes, seed=8, device=DEVICE)
    with pytest.raises(RuntimeError, match="could deadlock"):
        prob.fused(*inputs, products="gluon", sms=2 * sms)
    refs = prob.reference(*inputs)
    busy = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=DEVICE)
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(busy):  # ≈ 40 matrix products of 137 GFLOP each, queued before the call
            for _ in range(40):
                a = torch.tanh(a @ a * 1e-2)
        outs = prob.fused(*inputs, products="gluon")
        done = torch.cuda.Event()
        done.record()
        limit = time.monotonic() + 60
        while not done.query():
            assert time.monotonic() < limit, "the one-launch kernel did not finish beside a busy stream"
            time.sleep(0.01)
        assert_official_pass(prob, outs, refs)
    torch.cuda.synchronize()
