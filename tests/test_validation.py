"""Bad input to public entry points raises a clear error naming the input, expected and given."""

import pytest
import torch
from helpers import ODD_AXES

import backfuse


def _inputs(prob):
    return prob.make_inputs(ODD_AXES[prob.id][0], seed=0)


@pytest.mark.parametrize("entry", ["run", "reference"])
def test_wrong_argument_count(prob, entry):
    inputs = _inputs(prob)
    with pytest.raises(TypeError, match=rf"takes {len(inputs)} inputs .* got {len(inputs) - 1}"):
        getattr(prob, entry)(*inputs[:-1])


@pytest.mark.parametrize("entry", ["run", "reference"])
def test_wrong_dtype_names_input(prob, entry):
    inputs = _inputs(prob)
    inputs[1] = inputs[1].double()
    with pytest.raises(TypeError, match=rf"'{prob.input_names[1]}' must be torch.float32, got torch.float64"):
        getattr(prob, entry)(*inputs)


def test_not_a_tensor(prob):
    inputs = _inputs(prob)
    inputs[0] = inputs[0].tolist()
    with pytest.raises(TypeError, match=rf"'{prob.input_names[0]}' must be a torch.Tensor, got list"):
        prob.run(*inputs)


def test_wrong_rank(prob):
    inputs = _inputs(prob)
    inputs[0] = inputs[0][0]
    with pytest.raises(ValueError, match=rf"'{prob.input_names[0]}' must have \d dims"):
        prob.run(*inputs)


def test_inconsistent_axis(prob):
    inputs = _inputs(prob)
    inputs[1] = torch.cat([inputs[1], inputs[1]], dim=0)  # batch doubled on one input only
    with pytest.raises(ValueError, match=rf"'{prob.input_names[1]}' has shape .* dim 0 \(batch_size\) is 2 but "):
        prob.run(*inputs)


def test_wrong_constant_dim(prob):
    inputs = _inputs(prob)
    i = next(i for i, s in enumerate(prob.inputs) if getattr(s, "dims", None) and isinstance(s.dims[-1], int))
    inputs[i] = inputs[i][..., :-1].contiguous()
    with pytest.raises(ValueError, match=rf"'{prob.input_names[i]}' has shape .* must be {prob.inputs[i].dims[-1]}"):
        prob.run(*inputs)


def test_non_contiguous(prob):
    inputs = _inputs(prob)
    i = next(i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == x.shape[-2])
    inputs[i] = inputs[i].transpose(-1, -2)
    with pytest.raises(ValueError, match=rf"'{prob.input_names[i]}' must be contiguous"):
        prob.run(*inputs)


def test_mixed_devices(prob):
    inputs = _inputs(prob)
    inputs[2] = inputs[2].to("meta")
    with pytest.raises(ValueError, match=rf"'{prob.input_names[2]}' is on meta"):
        prob.run(*inputs)


def test_bad_scalar():
    prob = backfuse.problem("021")
    inputs = _inputs(prob)
    inputs[-1] = "0.125"
    with pytest.raises(TypeError, match="'scale' must be a real number, got str"):
        prob.run(*inputs)
    inputs[-1] = float("nan")
    with pytest.raises(ValueError, match="'scale' must be finite"):
        prob.run(*inputs)


def test_empty_axis():
    prob = backfuse.problem("072")
    inputs = prob.make_inputs(dict(batch_size=1, seq_len_dec=0, seq_len_enc=3))
    with pytest.raises(ValueError, match="seq_len_dec .* must be at least 1, got 0"):
        prob.run(*inputs)


def test_unknown_problem():
    with pytest.raises(ValueError, match="unknown problem '999'.*072"):
        backfuse.problem("999")
    with pytest.raises(TypeError):
        backfuse.problem(72)


def test_official_names_and_ids():
    for pid in backfuse.PROBLEM_IDS:
        prob = backfuse.problem(pid)
        assert backfuse.problem(prob.name) is prob
        assert prob.name.startswith(pid)
        assert len(prob.workloads) == 16
        for w in prob.workloads:
            assert w.tolerance.ratio == 0.99
            assert set(w.axes) == set(prob.axis_names)
            assert set(w.scalars) == {s.name for s in prob.scalar_specs}
