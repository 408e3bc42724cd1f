"""Training as a user would do it (issue #19): the modules trained with a mean-reduced loss stay on
the fused path; bfloat16 and float16; autocast; the forward's input errors; warnings that point at
the user's line.

Without a GPU the kernels run in the Triton interpreter: shapes are tiny and steps few.
"""

import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err

import backfuse
from backfuse import functional as F
from backfuse import nn as bnn

MODULES = {  # module, axes of the activations
    "072": (bnn.QkvGqa, dict(batch_size=2, seq_len_dec=4, seq_len_enc=3)),
    "021": (bnn.WanXattn, dict(batch_size=1, num_video_tokens=5, num_text_tokens=3)),
    "037": (bnn.Gemma3Core, dict(batch_size=1, seq_len=4)),
}
NOT_DIFFERENTIATED = ("cos", "sin")  # 037's RoPE tables: no gradient
SCALAR_ATTRIBUTES = {"scaling": "scaling", "attn_logit_softcapping": "softcap", "rms_norm_eps": "eps", "scale": "scale"}


def _setup(pid, dtype=torch.float32, seed=0):
    """(problem, module, activations) on DEVICE in `dtype`; activations that get gradients require them."""
    cls, axes = MODULES[pid]
    prob = backfuse.problem(pid)
    torch.manual_seed(seed)
    module = cls(device=DEVICE, dtype=dtype)
    params = {n for n, _ in module.named_parameters()}
    named = dict(zip(prob.input_names, prob.make_inputs(axes, seed=seed, device=DEVICE)))
    acts = [named[s.name].to(dtype).requires_grad_(s.name not in NOT_DIFFERENTIATED)
            for s in prob.forward_inputs if s.name not in params and isinstance(named[s.name], torch.Tensor)]
    return prob, module, acts


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _plain(prob, module, acts, dtype=torch.float64):
    """The problem's plain forward on copies of the module's parameters and the activations in `dtype`:
    (outputs, leaves in the order module parameters then differentiated activations)."""
    params = {n: p.detach().to(dtype).requires_grad_(True) for n, p in module.named_parameters()}
    acts = [a.detach().to(dtype).requires_grad_(a.requires_grad) for a in acts]
    it = iter(acts)
    args = [params[s.name] if s.name in params else getattr(module, SCALAR_ATTRIBUTES[s.name])
            if s.name in SCALAR_ATTRIBUTES else next(it) for s in prob.forward_inputs]
    return _as_tuple(prob.forward(*args)), list(params.values()) + [a for a in acts if a.requires_grad]


def _leaves(module, acts):
    return list(module.parameters()) + [a for a in acts if a.requires_grad]


def _names(prob, module, acts):
    return [n for n, _ in module.named_parameters()] + [
        s.name for s in prob.forward_inputs if s.name in prob.differentiates and not hasattr(module, s.name)]


def _assert_close(names, ours, expected, tol):
    for name, a, b in zip(names, ours, expected):
        if name == "key_bias":  # zero in exact arithmetic: rounding noise, bounded against the other biases
            assert (a.double() - b).abs().max() < 0.05 * expected[names.index("value_bias")].abs().max(), name
        else:
            assert rel_err(a, b) < tol, name


def _count_fused(monkeypatch, prob):
    """Count the fused calls, fail any fp32 fallback, and start without a remembered scale."""
    monkeypatch.setattr(F, "LAST_EXPONENT", {})
    calls, fused = [], prob.fused
    monkeypatch.setattr(prob, "fused", lambda *x, **kw: calls.append(1) or fused(*x, **kw))

    def no_fallback(*x):
        raise AssertionError("fell back to the fp32 reference")

    monkeypatch.setattr(prob, "fp32_backward", no_fallback)
    return calls


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_mean_loss_training_stays_fused(pid, monkeypatch):
    """Two SGD steps with an MSE loss (mean-reduced: every upstream gradient below 2^-12, where the
    guard used to send the call to fp32): the first backward scales them by a power of two (two fused
    calls), the second reuses it (one); gradients match float64 autograd of the plain forward."""
    prob, module, acts = _setup(pid)
    targets = [o.detach() + 0.1 * torch.randn_like(o) for o in _as_tuple(module(*acts))]
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    calls = _count_fused(monkeypatch, prob)
    names = _names(prob, module, acts)
    for step, expected_calls in enumerate((2, 3)):
        opt.zero_grad()
        for a in acts:
            a.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", backfuse.Fp16RangeWarning)
            loss = sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(_as_tuple(module(*acts)), targets))
            loss.backward()
        assert not [w for w in caught if w.category is backfuse.Fp16RangeWarning]
        assert len(calls) == expected_calls, step
        outs, leaves = _plain(prob, module, acts)
        plain_loss = sum(((o - t.double()) ** 2).mean() for o, t in zip(outs, targets))
        expected = torch.autograd.grad(plain_loss, leaves)
        _assert_close(names, [x.grad for x in _leaves(module, acts)], expected, 3e-3)
        opt.step()


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 8e-3), (torch.float16, 3e-3)])  # measured: 2e-3, 6e-4
@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_low_precision_modules(pid, dtype, tol):
    """A module and activations in bfloat16 or float16: output and every gradient in that dtype,
    within the dtype's rounding of float64 autograd of the plain forward at the same (rounded) values.
    (bfloat16 upstream gradients of 1e-6: fp16 would lose them, the power-of-two scale keeps them.)"""
    prob, module, acts = _setup(pid, dtype, seed=1)
    outs = _as_tuple(module(*acts))
    plain, leaves = _plain(prob, module, acts)
    size = 1e-6 if dtype == torch.bfloat16 else 1e-2
    grads = [(size * torch.randn_like(o, dtype=torch.float32)).to(dtype) for o in outs]
    ours = torch.autograd.grad(outs, _leaves(module, acts), grads)
    expected = torch.autograd.grad(plain, leaves, [g.double() for g in grads])
    for o, p in zip(outs, plain):
        assert o.dtype == dtype and rel_err(o, p) < tol
    assert all(g.dtype == dtype for g in ours)
    _assert_close(_names(prob, module, acts), ours, expected, tol)


def test_problem_backward_takes_low_precision_and_run_does_not():
    prob = backfuse.problem("021")
    inputs = prob.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=2, device=DEVICE)
    half = [x.half() if isinstance(x, torch.Tensor) else x for x in inputs]
    with pytest.raises(TypeError, match="'grad_output' must be torch.float32, got torch.float16"):
        prob.run(*half)
    half[3] = inputs[3]  # query_weight stays float32: each gradient comes back in its input's dtype
    needs = [name in ("video_latents", "query_weight") for name in prob.differentiates]
    grad_video, _, grad_wq, *rest = prob.backward(*half, needs=needs)
    assert grad_video.dtype == torch.float16 and grad_wq.dtype == torch.float32 and all(g is None for g in rest)
    refs = prob.reference(*[x.float() if isinstance(x, torch.Tensor) else x for x in half])
    assert rel_err(grad_video, refs[0]) < 4e-3 and rel_err(grad_wq, refs[2]) < 3e-3


def test_autocast_runs_the_ops_in_float32():
    """Under autocast(bfloat16) the op's inputs are cast to float32 and it runs with autocast off: the
    output is the float32 forward (not a bfloat16 one) and the gradients are that function's; a
    bfloat16 activation gets its gradient in bfloat16 through autocast's recorded cast."""
    prob, module, acts = _setup("021", seed=3)
    video = acts[0].detach().bfloat16().requires_grad_(True)
    acts = [video, acts[1]]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = module(*acts)
        upcast = module(video.float(), acts[1])  # the same float32 function, autocast or not
    assert out.dtype == torch.float32 and rel_err(out, upcast) < 1e-6
    plain, leaves = _plain(prob, module, acts)
    assert rel_err(out, plain[0]) < 1e-6  # a bfloat16 forward would be ~1e-2 away
    grad = 1e-3 * torch.randn_like(out)
    ours = torch.autograd.grad(out, _leaves(module, acts), grad)
    expected = torch.autograd.grad(plain, leaves, grad.double())
    assert ours[-2].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in ours[:-2] + ours[-1:])
    _assert_close(_names(prob, module, acts), ours, expected, 3e-3)


def test_forward_validates_its_inputs():
    """Errors name the input, as Problem.validate's do; no kernel runs."""
    wan = bnn.WanXattn(device=DEVICE)
    video, text = torch.randn(1, 18, 1024, device=DEVICE), torch.randn(1, 7, 1024, device=DEVICE)
    with pytest.raises(ValueError, match=r"backfuse.functional.wan_xattn: input 'video_latents' has shape "
                                         r"\(1, 18, 512\), expected \[batch_size=1, num_video_tokens=18, 1024\]"):
        wan(video[..., :512], text)
    with pytest.raises(ValueError, match=r"'text_embeddings' has shape \(2, 7, 1024\).*dim 0 \(batch_size\) is 2 "
                                         r"but 'video_latents' gives batch_size=1"):
        wan(video, text.expand(2, 7, 1024))
    with pytest.raises(TypeError, match=r"'text_embeddings' is torch.bfloat16, but 'video_latents' is torch.float32"):
        wan(video, text.bfloat16())
    with pytest.raises(TypeError, match=r"'video_latents' must be torch.float32, torch.bfloat16 or torch.float16, "
                                        r"got torch.float64"):
        wan(video.double(), text)
    gemma = bnn.Gemma3Core(device=DEVICE)
    hidden, cos, sin = backfuse.problem("037").make_inputs(dict(batch_size=1, seq_len=5), device=DEVICE)[1:4]
    with pytest.raises(ValueError, match=r"'cos' must have 3 dims \[batch_size, seq_len, 128\], got shape \(5, 128\)"):
        gemma(hidden, cos[0], sin)
    parakeet = bnn.QkvGqa(device=DEVICE)
    with pytest.raises(ValueError, match=r"'encoder_hidden_states' has shape \(1, 3, 1536\).*dim 2 must be 1024"):
        parakeet(torch.randn(1, 2, 1536, device=DEVICE), torch.randn(1, 3, 1536, device=DEVICE))
    with pytest.raises(ValueError, match=r"backfuse.functional.qkv_gqa: input 'q_weight' has shape"):
        F.qkv_gqa(torch.randn(1, 2, 1536, device=DEVICE), torch.randn(1, 3, 1024, device=DEVICE), parakeet.k_weight,
                  parakeet.k_weight, parakeet.v_weight)
    wan(video.transpose(1, 2).contiguous().transpose(1, 2), text)  # any layout is fine


def test_fallback_warnings_point_at_the_users_line():
    """A call the guard must send to fp32 (values beyond fp16, not from the upstream gradients) warns
    at the user's line: Problem.run's caller, and for a module the line of its forward call (the
    backward may run on an autograd worker thread with no user frame)."""
    prob = backfuse.problem("021")
    inputs = prob.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=4, device=DEVICE)
    inputs[7] = inputs[7] * 2e5  # value_weight: the values overflow fp16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", backfuse.Fp16RangeWarning)
        prob.run(*inputs); line = _line()  # noqa: E702
        module = bnn.WanXattn(device=DEVICE)
        with torch.no_grad():
            module.value_weight.mul_(2e5)
        out = module(inputs[1], inputs[2]); forward_line = _line()  # noqa: E702
        out.backward(inputs[0])
    sites = [(w.filename, w.lineno) for w in caught if w.category is backfuse.Fp16RangeWarning]
    assert sites == [(__file__, line), (__file__, forward_line)]


def _line():
    import inspect

    return inspect.currentframe().f_back.f_lineno
