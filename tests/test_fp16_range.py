"""The fp16 range guard: values fp16 cannot hold (inputs or intermediates) send a call to fp32.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import numpy as np
import pytest
import torch
from conftest import DEVICE
from helpers import assert_official_pass, rel_err

import backfuse
from backfuse.bench import check_outputs
from backfuse.fp16_guard import FP16_MAX, SMALLEST_SAFE_MAX, RangeSlots

SMALL_AXES = {
    "072": dict(batch_size=1, seq_len_dec=7, seq_len_enc=5),
    "037": dict(batch_size=1, seq_len=5),
    "021": dict(batch_size=1, num_video_tokens=9, num_text_tokens=5),
}


def _scaled(prob, inputs, factor, names=None):
    """The inputs with the named tensors (default: all) multiplied by factor."""
    return [x * factor if isinstance(x, torch.Tensor) and (names is None or n in names) else x
            for n, x in zip(prob.input_names, inputs)]


def _guarded_run(prob, inputs):
    """prob.run under the guard; returns the outputs and the warning's text."""
    with pytest.warns(backfuse.Fp16RangeWarning) as caught:
        outs = prob.run(*inputs)
    return outs, " ".join(str(w.message) for w in caught if w.category is backfuse.Fp16RangeWarning)


@pytest.mark.parametrize("factor", [1e6, 1e-6])
def test_inputs_beyond_fp16_fall_back_to_fp32(prob, factor):
    """Every input times 1e6 (fp16 overflows) or 1e-6 (fp16 subnormals): the guard notices and the
    outputs match the fp32 reference, under the official rule and in relative terms.

    (037 at 1e6: the logits saturate the soft cap, 1 - tanh^2 is exactly 0, and with it every
    gradient through q and k, in the reference too; the official rule fails all-zero outputs, so
    those are checked to be zero.)"""
    inputs = _scaled(prob, prob.make_inputs(SMALL_AXES[prob.id], seed=1, device=DEVICE), factor)
    outs, message = _guarded_run(prob, inputs)
    refs = prob.reference(*inputs)
    zero = [r.abs().max() == 0 for r in refs]
    kept = [i for i, z in enumerate(zero) if not z]
    verdict = check_outputs([outs[i] for i in kept], [refs[i] for i in kept], prob.workloads[0].tolerance,
                            [prob.output_names[i] for i in kept])
    assert verdict.passed, verdict.reason
    for name, o, r, z in zip(prob.output_names, outs, refs, zero):
        assert torch.isfinite(o).all() and (o.abs().max() == 0 if z else rel_err(o, r) < 1e-5), name
    assert any(name in message for name in prob.input_names)


@pytest.mark.parametrize("pid, names, culprit", [
    # Each query head's gradient is below 65504, the sums over its group of 4 heads are not.
    ("072", ("grad_key_states",), "grad_key_states (head-group sums)"),
    # Inputs within range whose products are not: the projections overflow.
    ("037", ("hidden_states", "v_weight"), "v projection"),
    ("021", ("value_weight",), "values"),
])
def test_intermediates_beyond_fp16_fall_back_to_fp32(pid, names, culprit):
    prob = backfuse.problem(pid)
    inputs = prob.make_inputs(SMALL_AXES[pid], seed=2, device=DEVICE)
    if pid == "072":
        inputs[1] = torch.full_like(inputs[1], 30000.0)
    else:
        inputs = _scaled(prob, inputs, 2e3 if pid == "037" else 2e5, names)
    assert max(x.abs().max().item() for x in inputs if isinstance(x, torch.Tensor)) < FP16_MAX
    needs = [i == 0 for i in range(len(prob.outputs))]  # the first output only: no weight products to run
    with pytest.warns(backfuse.Fp16RangeWarning) as caught:
        first = prob.backward(*inputs, needs=needs)[0]
    assert any(culprit in str(w.message) for w in caught)
    ref = prob.reference(*inputs)[0]
    assert torch.isfinite(first).all() and rel_err(first, ref) < 1e-5


def test_vanishing_attention_gradients_are_not_underflow():
    """One text token: P = 1, so dS, dQ and dK are rounding noise (zero in exact arithmetic); tiny
    gradients like these keep the fast path (an Fp16RangeWarning fails the test)."""
    prob = backfuse.problem("021")
    x = prob.make_inputs(dict(batch_size=2, num_video_tokens=3, num_text_tokens=1), seed=2, device=DEVICE)
    assert_official_pass(prob, prob.run(*x), prob.reference(*x))


def test_guard_can_be_turned_off():
    """Off, fp16's overflow shows as Inf/NaN: the guard is what keeps the outputs right."""
    prob = backfuse.problem("072")
    inputs = _scaled(prob, prob.make_inputs(SMALL_AXES["072"], seed=3, device=DEVICE), 1e6)
    with backfuse.fp16_range_check(False):
        outs = prob.run(*inputs)
    assert not all(torch.isfinite(o).all() for o in outs)


def test_range_slots_reduce_per_region():
    ranges = RangeSlots()
    first = ranges.reserve({"a": 3, "unused": 0, "b": 2})
    second = ranges.reserve({"c": 1, "d": 2, "e": 1, "f": 1}, overflow_only=("e", "f"))
    assert (first, second) == (0, 8)  # blocks start 16-byte aligned
    ranges.allocate("cpu")
    ranges.slots.fill_(float("nan"))  # slots between blocks are never read
    ranges.block(first)[:5] = torch.tensor([1.0, 70000.0, 2.0, 0.0, 1e-5])
    ranges.block(second)[:5] = torch.tensor([0.0, 1.0, float("nan"), 1e-9, 1e5])
    outside = dict(ranges.out_of_range())  # an all-zero region ("c") is exact in fp16 and passes
    assert list(outside) == ["a", "b", "d", "f"]  # "e" is tiny, but checked for overflow only
    assert outside["a"] == 70000 and outside["b"] == pytest.approx(1e-5) and np.isnan(outside["d"])
    assert 1e-5 < SMALLEST_SAFE_MAX
