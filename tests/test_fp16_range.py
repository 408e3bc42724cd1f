"""The fp16 range guards. The official interface's (`Problem.run`): values fp16 cannot hold (inputs or
intermediates) send a call to fp32, unless they are linear in the upstream gradients: then the upstream
gradients are scaled by a power of two. The training paths' (`backfuse/train/guard.py`): the same rule
checked on the device, a power-of-two scale chosen there, and a warning naming the call instead of a
fallback.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import contextlib
import warnings

import numpy as np
import pytest
import torch
from conftest import DEVICE
from helpers import FP16_REL_ERR, NEAR_ZERO, assert_official_pass, rel_err

import backfuse
from backfuse.bench import check_outputs
from backfuse.fp16_guard import FP16_MAX, SMALLEST_SAFE_MAX, RangeSlots, scale_exponent
from backfuse.kernels.schedule import Holds, Region
from backfuse.train import guard

SMALL_AXES = {
    "072": dict(batch_size=1, seq_len_dec=7, seq_len_enc=5),
    "037": dict(batch_size=1, seq_len=5),
    "021": dict(batch_size=1, num_video_tokens=9, num_text_tokens=5),
}


def _scaled(prob, inputs, factor, names=None):
    """The inputs with the named tensors (default: all) multiplied by factor."""
    return [x * factor if isinstance(x, torch.Tensor) and (names is None or n in names) else x
            for n, x in zip(prob.input_names, inputs)]


# For tests whose kernels overflow fp16 on purpose (the guard is what notices): the Triton interpreter's numpy
# warnings about it (overflow in casts, NaN in products and reductions) are expected. On a GPU there are none.
OVERFLOWS = pytest.mark.filterwarnings(r"ignore::RuntimeWarning:(triton|numpy)\.")


@contextlib.contextmanager
def _falls_back():
    """Records the block's warnings, which must be Fp16RangeWarnings (at least one); unlike pytest.warns,
    it does not re-emit the others, which the filters in force (OVERFLOWS, pyproject's) have already judged."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", backfuse.Fp16RangeWarning)
        yield caught
    assert caught and all(w.category is backfuse.Fp16RangeWarning for w in caught), [str(w.message) for w in caught]


def _guarded_run(prob, inputs):
    """prob.run under the guard; returns the outputs and the warning's text."""
    with _falls_back() as caught:
        outs = prob.run(*inputs)
    return outs, " ".join(str(w.message) for w in caught)


@OVERFLOWS
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


@OVERFLOWS
@pytest.mark.parametrize("pid, names, culprit", [
    # Each query head's gradient is below 65504, the sums over its group of 4 heads are not; alone,
    # a scale of 1/2 would fix that (test_upstream_gradients_beyond_fp16_are_scaled), but
    # grad_query_states is tiny: no one power of two fits both.
    ("072", ("grad_key_states",), "grad_key_states (head-group sums)"),
    # Inputs within range whose products are not: the projections overflow.
    ("037", ("hidden_states", "v_weight"), "v projection"),
    ("021", ("value_weight",), "values"),
])
def test_intermediates_beyond_fp16_fall_back_to_fp32(pid, names, culprit):
    prob = backfuse.problem(pid)
    inputs = prob.make_inputs(SMALL_AXES[pid], seed=2, device=DEVICE)
    if pid == "072":
        inputs[0], inputs[1] = inputs[0] * 1e-6, torch.full_like(inputs[1], 30000.0)
    else:
        inputs = _scaled(prob, inputs, 2e3 if pid == "037" else 2e5, names)
    assert max(x.abs().max().item() for x in inputs if isinstance(x, torch.Tensor)) < FP16_MAX
    with _falls_back() as caught:
        first = prob.run(*inputs)[0]
    assert any(culprit in str(w.message) for w in caught)
    ref = prob.reference(*inputs)[0]
    assert torch.isfinite(first).all() and rel_err(first, ref) < 1e-5


def test_vanishing_attention_gradients_are_not_underflow():
    """One text token: P = 1, so dS, dQ and dK are rounding noise (zero in exact arithmetic); tiny
    gradients like these keep the fast path (an Fp16RangeWarning fails the test)."""
    prob = backfuse.problem("021")
    x = prob.make_inputs(dict(batch_size=2, num_video_tokens=3, num_text_tokens=1), seed=2, device=DEVICE)
    assert_official_pass(prob, prob.run(*x), prob.reference(*x))


@OVERFLOWS
def test_guard_can_be_turned_off():
    """Off, fp16's overflow shows as Inf/NaN: the guard is what keeps the outputs right."""
    prob = backfuse.problem("072")
    inputs = _scaled(prob, prob.make_inputs(SMALL_AXES["072"], seed=3, device=DEVICE), 1e6)
    with backfuse.fp16_range_check(False):
        outs = prob.run(*inputs)
    assert not all(torch.isfinite(o).all() for o in outs)


def test_range_slots_reduce_per_region():
    ranges = RangeSlots()
    first = ranges.reserve([Region("a", 3), Region("unused", 0), Region("b", 2)])
    second = ranges.reserve([Region("c", 1), Region("d", 2), Region("e", 1, Holds.VANISHING),
                             Region("f", 1, Holds.VANISHING)])
    assert (first, second) == (0, 8)  # blocks start 16-byte aligned
    ranges.allocate("cpu")
    ranges.slots.fill_(float("nan"))  # slots between blocks are never read
    ranges.block(first)[:5] = torch.tensor([1.0, 70000.0, 2.0, 0.0, 1e-5])
    ranges.block(second)[:5] = torch.tensor([0.0, 1.0, float("nan"), 1e-9, 1e5])
    outside = dict(ranges.out_of_range())  # an all-zero region ("c") is exact in fp16 and passes
    assert list(outside) == ["a", "b", "d", "f"]  # "e" is tiny, but checked for overflow only
    assert outside["a"] == 70000 and outside["b"] == pytest.approx(1e-5) and np.isnan(outside["d"])
    assert 1e-5 < SMALLEST_SAFE_MAX


def _counting_fused(monkeypatch, prob):
    """Patch prob.fused to count its calls; returns the list of exponents seen (1 entry per call)."""
    calls, fused = [], prob.fused
    monkeypatch.setattr(prob, "fused", lambda *x, **kw: calls.append(1) or fused(*x, **kw))
    return calls


def _check_close(prob, outs, refs, factor=1.0):
    """As close as the fused kernels are on ordinary inputs; `factor`: how the upstream gradients were
    scaled (the absolute bound of outputs that are zero in exact arithmetic scales with them)."""
    for name, o, r in zip(prob.output_names, outs, refs):
        assert torch.isfinite(o).all(), name
        if name in NEAR_ZERO:
            assert (o - r).abs().max() < NEAR_ZERO[name] * factor, name
        else:
            assert rel_err(o, r) < FP16_REL_ERR, name


@pytest.mark.parametrize("factor", [1e-6])
def test_tiny_upstream_gradients_are_scaled_not_sent_to_fp32(prob, monkeypatch, factor):
    """Upstream gradients below 2^-12 (a mean-reduced loss): the fused kernels run again on 2^k times
    them and the outputs are divided by 2^k; no fp32 fallback (its warning would fail the test), the
    caller's tensors untouched, the result as accurate as on inputs of ordinary size."""
    inputs = _scaled(prob, prob.make_inputs(SMALL_AXES[prob.id], seed=3, device=DEVICE), factor, prob.upstream_grads)
    copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    calls = _counting_fused(monkeypatch, prob)
    outs = prob.run(*inputs)
    assert len(calls) == 2
    _check_close(prob, outs, prob.reference(*inputs), factor)
    assert all(torch.equal(x, y) for x, y in zip(inputs, copies) if isinstance(x, torch.Tensor))


@OVERFLOWS
def test_upstream_gradients_beyond_fp16_are_scaled(monkeypatch):
    """072: grad_key_states = 30000 everywhere (head-group sums 120000, beyond 65504): scaled down, in
    a second fused call."""
    prob = backfuse.problem("072")
    inputs = prob.make_inputs(SMALL_AXES["072"], seed=2, device=DEVICE)
    inputs[1] = torch.full_like(inputs[1], 30000.0)
    calls = _counting_fused(monkeypatch, prob)
    outs = prob.run(*inputs)
    assert len(calls) == 2
    _check_close(prob, outs, prob.reference(*inputs))


@pytest.fixture
def fresh_guards():
    guard.reset()
    yield
    guard.reset()


def _train_step(pid, factor, seed=5, inputs=None):
    """Problem.backward (the training path) on the suite's inputs with the upstream gradients times factor."""
    prob = backfuse.problem(pid)
    inputs = inputs or _scaled(prob, prob.make_inputs(SMALL_AXES[pid], seed=seed, device=DEVICE), factor,
                               prob.upstream_grads)
    return prob, inputs, prob.backward(*inputs)


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_training_guard_scales_tiny_upstream_gradients(pid, fresh_guards):
    """Upstream gradients of 1e-7 (fp16 subnormals): the first cast, at the last call's exponent (none yet: 0),
    finds them too small, and the second casts them again at 2^k, so the gradients are as accurate as at
    ordinary sizes, with no warning (which would fail the test)."""
    prob, inputs, outs = _train_step(pid, 1e-7)
    _check_close(prob, outs, prob.reference(*inputs), 1e-7)
    (g,) = [g for g in guard._guards.values() if g.label.endswith("backward")]
    assert g.state[0].item() > 0  # the exponent this call scaled by


@OVERFLOWS
@pytest.mark.parametrize("pid", ["021", "072"])
def test_training_guard_follows_a_sudden_change_of_the_gradients(pid, fresh_guards):
    """A call at ordinary sizes, then upstream gradients 1e6 times larger, then 1e-6 times as large, twice:
    each call is accurate, with no warning, and casts its upstream gradients a second time (state[4], redo)
    only where their size jumped (072: one exponent for its three)."""
    prob, inputs, outs = _train_step(pid, 1.0)
    _check_close(prob, outs, prob.reference(*inputs))
    (g,) = [g for g in guard._guards.values() if g.label.endswith("backward")]
    redone = [g.state[4].item()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.Fp16RangeWarning)
        for factor in (1e6, 1e-6, 1e-6):
            scaled = _scaled(prob, inputs, factor, prob.upstream_grads)
            _check_close(prob, prob.backward(*scaled), prob.reference(*scaled), factor)
            redone.append(g.state[4].item())
    assert redone == [0.0, 1.0, 1.0, 0.0]


@OVERFLOWS
def test_training_guard_names_inputs_fp16_cannot_hold(fresh_guards):
    """A value weight 2e5 times too large (V overflows fp16; no scale of the upstream gradients helps): the
    forward's check names the tensor; bfloat16 inputs, with fp32's range, need no guard and warn nothing."""
    prob = backfuse.problem("021")
    inputs = prob.make_inputs(SMALL_AXES["021"], seed=2, device=DEVICE)
    inputs = _scaled(prob, inputs, 2e5, ("value_weight",))
    with _falls_back() as caught:
        prob.backward(*inputs)
        backfuse.check_ranges()  # on a GPU the op reads its log at its next call; this reads it now
    assert any("values (call 1" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.Fp16RangeWarning)
        outs = prob.backward(*[x.bfloat16() if isinstance(x, torch.Tensor) else x for x in inputs])
    ref = prob.reference(*inputs)
    assert torch.isfinite(outs[0]).all() and rel_err(outs[0], ref[0]) < 3e-2


def test_scale_exponent_rules():
    holds = {"g": Holds.UPSTREAM, "gradient of x": Holds.GRADIENT, "s": Holds.VANISHING}  # others: inputs

    def pick(maxima, current=0):
        rows = [(name, m, holds.get(name, Holds.INPUT)) for name, m in maxima.items()]
        return scale_exponent(rows, current)

    assert pick({"g": 1e-6, "w": 0.5}) == 20  # the largest upstream value to [1, 2): 1e-6 * 2^20 = 1.05
    assert 1 <= 1e-6 * 2**20 < 2
    assert pick({"g": 3e5}) == -18  # too large: down to [1, 2) as well
    assert pick({"g": 1e-6, "gradient of x": 1.0}) == 15  # the aim (20) would overflow x: 2^15 <= 65504 < 2^16
    assert pick({"g": 1e-6, "gradient of x": 7e4}) is None  # needs k >= 8 and k <= -1
    assert pick({"g": 1e-6, "s": 1e-30}) == 20  # overflow-only regions only bound from above
    assert pick({"g": 1e-6, "w": 1e-6}) is None  # a tiny weight: scaling the upstream gradients cannot help
    assert pick({"g": float("inf")}) is None and pick({"g": float("nan")}) is None
    assert pick({"g": 1e-6, "gradient of x": float("nan")}) is None  # overflowed unscaled: only k < 0, but g needs 8
    assert pick({"g": 2.0**24, "gradient of x": float("inf")}, current=24) == 0  # the last scale overflowed
    assert pick({"g": 0.0, "gradient of x": 1e-9}) == 18  # no upstream value to aim at: the nearest fit
    assert 1e-9 * 2**17 < SMALLEST_SAFE_MAX <= 1e-9 * 2**18
    assert pick({"g": 2.0**19}, current=20) == 0  # measured at 2^20, too large there; unscaled it fits
    assert pick({"g": 1e-6 * 2**40}, current=40) == 20  # measured at 2^40: back to 2^20
