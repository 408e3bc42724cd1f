"""021's fused kernels against the reference: one text tile (head and tail), text tiles, shared
heads, single tokens, cuBLAS gradient products, needs, deterministic mode.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import pytest
from conftest import DEVICE
from helpers import (
    FP16_REL_ERR,
    NEAR_ZERO,
    assert_official_pass,
    check_beside_busy_stream,
    check_deterministic,
    check_fused,
    check_needs,
    fused_with,
    rel_err,
)

import backfuse
from backfuse.kernels import buffers

SHARED_HEADS = dict(batch_size=1, num_video_tokens=70, num_text_tokens=77)


def test_default_path():
    """Problem.run as users call it; one block per head, its text as a 32-token head and a 16-token
    tail: dK/dV written directly, no partial sums."""
    check_fused(backfuse.problem("021"), dict(batch_size=1, num_video_tokens=37, num_text_tokens=37), seed=7)


@pytest.mark.parametrize("axes", [
    SHARED_HEADS,  # text as head + tail, runs of blocks
    dict(batch_size=1, num_video_tokens=70, num_text_tokens=150),  # text in tiles, one block per run
])
def test_shared_heads_and_text_tiles(axes):
    """Several programs per head (fp32 partial sums, the last to arrive converts) and K splits."""
    check_fused(backfuse.problem("021"), axes, seed=3, fn=fused_with("021", sms=132))


def test_single_tokens():
    prob = backfuse.problem("021")
    check_fused(prob, dict(batch_size=3, num_video_tokens=1, num_text_tokens=2), seed=2, fn=fused_with("021", sms=132))
    # One text token: P = 1, so dS and every gradient through it are rounding noise; the rule still holds.
    x = prob.make_inputs(dict(batch_size=2, num_video_tokens=3, num_text_tokens=1), seed=2, device=DEVICE)
    with buffers.poisoned():
        assert_official_pass(prob, fused_with("021", sms=132)(*x), prob.reference(*x))


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's fp16 products run on the GPU only")
@pytest.mark.parametrize("needs", [None, (False, True, False, False, True, True, True, True, False, False)])
def test_cublas_gradient_products(needs):
    """Gradient products by cuBLAS; our fourth launch then only sums the bias gradients."""
    prob = backfuse.problem("021")
    if needs is None:
        check_fused(prob, dict(batch_size=2, num_video_tokens=70, num_text_tokens=77), seed=13,
                    fn=fused_with("021", sms=132, products="cublas"))
        return
    x = prob.make_inputs(dict(batch_size=1, num_video_tokens=29, num_text_tokens=13), seed=13, device=DEVICE)
    with buffers.poisoned():
        outs = fused_with("021", sms=132, products="cublas", needs=needs)(*x)
    for name, need, o, r in zip(prob.output_names, needs, outs, prob.reference(*x)):
        assert not need or name in NEAR_ZERO or rel_err(o, r) < FP16_REL_ERR, name


@pytest.mark.parametrize("wanted", [("video_latents",), ("query_weight", "value_bias"), ("key_bias", "output_bias")])
def test_backward_computes_only_what_is_needed(wanted):
    check_needs(backfuse.problem("021"), dict(batch_size=1, num_video_tokens=9, num_text_tokens=5), wanted)


def test_deterministic_mode():
    check_deterministic(backfuse.problem("021"), SHARED_HEADS, fused_with("021", sms=132, deterministic=True))


@pytest.mark.skipif(DEVICE != "cuda", reason="PDL and its early-started gradient launch run on the GPU only")
@pytest.mark.parametrize("axes", [SHARED_HEADS, dict(batch_size=2, num_video_tokens=512, num_text_tokens=77)])
def test_gradient_launch_waiting_on_the_attention_survives_a_busy_stream(axes):
    """With PDL the gradient launch starts before the attention ends and its tiles wait on the
    attention's counters (helpers.check_beside_busy_stream)."""
    check_beside_busy_stream("021", axes)
