"""Each reference agrees with torch.autograd through the forward pass in float64 on odd shapes."""

import pytest
import torch
from helpers import ODD_AXES, assert_official_pass, autograd_backward, rel_err

import backfuse


@pytest.mark.parametrize("pid,axes", [(pid, a) for pid, cases in ODD_AXES.items() for a in cases])
def test_reference_matches_float64_autograd(pid, axes):
    prob = backfuse.problem(pid)
    inputs = prob.make_inputs(axes, seed=7)
    refs = prob.reference(*inputs)
    expected = autograd_backward(prob, inputs)
    assert_official_pass(prob, refs, expected)
    for name, r, e in zip(prob.output_names, refs, expected):
        assert r.shape == e.shape and r.dtype == torch.float32, name
        # grad_key_bias is zero in exact arithmetic: only rounding noise is left to compare.
        if e.abs().max() > 1e-3:
            assert rel_err(r, e) < 1e-5, name


def test_reference_leaves_tf32_setting_alone(prob):
    before = torch.backends.cuda.matmul.fp32_precision
    inputs = prob.make_inputs(ODD_AXES[prob.id][0], seed=1)
    prob.reference(*inputs)
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_make_inputs_follows_spec(prob):
    axes = ODD_AXES[prob.id][0]
    a = prob.make_inputs(axes, seed=3)
    b = prob.make_inputs(axes, seed=3)
    c = prob.make_inputs(axes, seed=4)
    assert len(a) == len(prob.inputs)
    prob.validate(a)
    for spec, x, y, z in zip(prob.inputs, a, b, c):
        if isinstance(x, torch.Tensor):
            assert x.shape == spec.shape(axes) and x.dtype == torch.float32
            assert torch.equal(x, y)
            if spec.name not in ("cos", "sin"):
                assert not torch.equal(x, z), spec.name
        else:
            assert x == prob.workloads[0].scalars[spec.name]


def test_037_rope_tables_are_real():
    prob = backfuse.problem("037")
    inputs = dict(zip(prob.input_names, prob.make_inputs(dict(batch_size=2, seq_len=5), seed=0)))
    cos, sin = inputs["cos"], inputs["sin"]
    assert torch.allclose(cos[0, 0], torch.ones(128)) and torch.allclose(sin[0, 0], torch.zeros(128))
    assert torch.allclose(cos[1, 3, 1], torch.tensor(3 * 10000 ** (-1 / 64)).cos())
    assert torch.equal(cos[:, :, :64], cos[:, :, 64:])
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos))


def test_input_scales_follow_spec():
    prob = backfuse.problem("072")
    x = dict(zip(prob.input_names, prob.make_inputs(dict(batch_size=2, seq_len_dec=128, seq_len_enc=128), seed=0)))
    assert abs(x["q_weight"].std().item() - 1536**-0.5) < 1e-3
    assert abs(x["grad_key_states"].std().item() - 4096**-0.5) < 1e-3
    prob = backfuse.problem("021")
    x = dict(zip(prob.input_names, prob.make_inputs(dict(batch_size=1, num_video_tokens=64, num_text_tokens=77), seed=0)))
    assert abs(x["key_weight"].std().item() - 1024**-0.5) < 1e-3
    assert abs(x["key_bias"].std().item() - 1) < 0.1 and abs(x["grad_output"].std().item() - 1) < 0.02
