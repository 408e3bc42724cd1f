"""Training as a user does it: the modules trained with a mean-reduced loss stay accurate with no range
warning; bfloat16 gradients no further from float64 than eager bfloat16's; float16; autocast;
Problem.backward on low-precision inputs; the forward's input errors; warnings that point at the
user's line.

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
from backfuse.bench import train as plain_layers
from backfuse.train import guard

MODULES = {  # module, axes of the activations
    "072": (bnn.QkvGqa, dict(batch_size=2, seq_len_dec=4, seq_len_enc=3)),
    "021": (bnn.WanXattn, dict(batch_size=1, num_video_tokens=5, num_text_tokens=3)),
    "037": (bnn.Gemma3Core, dict(batch_size=1, seq_len=4)),
}
NOT_DIFFERENTIATED = ("cos", "sin")  # 037's RoPE tables: no gradient
SCALAR_ATTRIBUTES = {"scaling": "scaling", "attn_logit_softcapping": "softcap", "rms_norm_eps": "eps", "scale": "scale"}


@pytest.fixture(autouse=True)
def fresh_guards():
    guard.reset()  # each test starts with no exponent chosen and no warning seen


def _setup(pid, dtype=torch.float32, seed=0):
    """(problem, module, activations) on DEVICE in `dtype`; activations that get gradients require them."""
    cls, axes = MODULES[pid]
    prob = backfuse.problem(pid)
    torch.manual_seed(seed)
    module = cls(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm_weight"):
                p.normal_(0, 0.02)
    params = {n for n, _ in module.named_parameters()}
    named = dict(zip(prob.input_names, prob.make_inputs(axes, seed=seed, device=DEVICE)))
    acts = [named[s.name].to(dtype).requires_grad_(s.name not in NOT_DIFFERENTIATED)
            for s in prob.forward_inputs if s.name not in params and isinstance(named[s.name], torch.Tensor)]
    return prob, module, acts


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _args(prob, module, acts, params):
    it = iter(acts)
    return [params[s.name] if s.name in params else getattr(module, SCALAR_ATTRIBUTES[s.name])
            if s.name in SCALAR_ATTRIBUTES else next(it) for s in prob.forward_inputs]


def _plain(prob, module, acts, dtype=torch.float64):
    """The problem's plain forward on copies of the module's parameters and the activations in `dtype`:
    (outputs, leaves in the order module parameters then differentiated activations)."""
    params = {n: p.detach().to(dtype).requires_grad_(True) for n, p in module.named_parameters()}
    acts = [a.detach().to(dtype).requires_grad_(a.requires_grad) for a in acts]
    return _as_tuple(prob.forward(*_args(prob, module, acts, params))), list(params.values()) + [
        a for a in acts if a.requires_grad]


def _eager(prob, module, acts):
    """The layer as eager PyTorch writes it in the module's dtype (`bench/train.py`'s plain layers)."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    acts = [a.detach().clone().requires_grad_(a.requires_grad) for a in acts]
    return _as_tuple(plain_layers.PLAIN[prob.id](*_args(prob, module, acts, params))), list(params.values()) + [
        a for a in acts if a.requires_grad]


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


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_mean_loss_training_stays_accurate(pid):
    """Two SGD steps with an MSE loss (mean-reduced: every upstream gradient below 2^-12, which fp16
    holds poorly): the first backward finds its power-of-two scale on the device, the second keeps it;
    no range warning, and the gradients match float64 autograd of the plain forward."""
    prob, module, acts = _setup(pid)
    targets = [o.detach() + 0.1 * torch.randn_like(o) for o in _as_tuple(module(*acts))]
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    names = _names(prob, module, acts)
    for _ in range(2):
        opt.zero_grad()
        for a in acts:
            a.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("error", backfuse.Fp16RangeWarning)
            outs = _as_tuple(module(*acts))
            loss = sum(torch.nn.functional.mse_loss(o, t) for o, t in zip(outs, targets))
            loss.backward()
            backfuse.check_ranges()
        # The upstream gradients the backward got (from our forward's outputs), differentiated in float64.
        upstream = [2 * (o.detach().double() - t.double()) / o.numel() for o, t in zip(outs, targets)]
        plain, leaves = _plain(prob, module, acts)
        expected = torch.autograd.grad(plain, leaves, upstream)
        _assert_close(names, [x.grad for x in _leaves(module, acts)], expected, 3e-3)
        opt.step()


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_bfloat16_gradients_no_further_from_float64_than_eager_bfloat16(pid):
    """A module and activations in bfloat16: output and every gradient in bfloat16, each at most as far
    from float64 autograd (at the same rounded values) as the layer written plainly in bfloat16 is (a
    quarter more, for the summation orders both leave open, and 1e-3 of the gradient's size)."""
    prob, module, acts = _setup(pid, torch.bfloat16, seed=1)
    outs = _as_tuple(module(*acts))
    grads = [torch.randn_like(o) for o in outs]
    ours = torch.autograd.grad(outs, _leaves(module, acts), grads)
    plain, leaves = _plain(prob, module, acts)
    expected = torch.autograd.grad(plain, leaves, [g.double() for g in grads])
    eager_outs, eager_leaves = _eager(prob, module, acts)
    eager = torch.autograd.grad(eager_outs, eager_leaves, grads)
    assert all(o.dtype == torch.bfloat16 for o in outs) and all(g.dtype == torch.bfloat16 for g in ours)
    for o, e, p in zip(outs, eager_outs, plain):
        assert rel_err(o, p) <= 1.25 * rel_err(e, p) + 1e-3
    for name, a, e, b in zip(_names(prob, module, acts), ours, eager, expected):
        if name != "key_bias":
            assert rel_err(a, b) <= 1.25 * rel_err(e, b) + 1e-3, name


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_float16_modules(pid):
    """float16: products in fp16 on the inputs as they are; output and gradients in float16 within fp16's
    rounding of float64 autograd."""
    prob, module, acts = _setup(pid, torch.float16, seed=2)
    outs = _as_tuple(module(*acts))
    grads = [1e-2 * torch.randn_like(o) for o in outs]
    ours = torch.autograd.grad(outs, _leaves(module, acts), grads)
    plain, leaves = _plain(prob, module, acts)
    expected = torch.autograd.grad(plain, leaves, [g.double() for g in grads])
    for o, p in zip(outs, plain):
        assert o.dtype == torch.float16 and rel_err(o, p) < 3e-3
    assert all(g.dtype == torch.float16 for g in ours)
    _assert_close(_names(prob, module, acts), ours, expected, 3e-3)


def test_problem_backward_takes_low_precision_and_run_does_not():
    prob = backfuse.problem("021")
    inputs = prob.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=2, device=DEVICE)
    half = [x.half() if isinstance(x, torch.Tensor) else x for x in inputs]
    with pytest.raises(TypeError, match="'grad_output' must be torch.float32, got torch.float16"):
        prob.run(*half)
    needs = [name in ("video_latents", "query_weight") for name in prob.differentiates]
    grad_video, _, grad_wq, *rest = prob.backward(*half, needs=needs)
    assert grad_video.dtype == torch.float16 and grad_wq.dtype == torch.float16 and all(g is None for g in rest)
    refs = prob.reference(*[x.float() if isinstance(x, torch.Tensor) else x for x in half])
    assert rel_err(grad_video, refs[0]) < 4e-3 and rel_err(grad_wq, refs[2]) < 4e-3
    half[3] = inputs[3]
    with pytest.raises(TypeError, match=r"input 'query_weight' is torch.float32, but 'grad_output' is torch.float16"):
        prob.backward(*half)


def test_autocast_runs_the_ops_in_the_autocast_dtype():
    """Under autocast(bfloat16) an op casts its inputs to bfloat16, as F.linear does, and runs in it: a
    bfloat16 output; float32 parameters get float32 gradients through autocast's recorded casts."""
    prob, module, acts = _setup("021", seed=3)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = module(*acts)
    assert out.dtype == torch.bfloat16
    plain, leaves = _plain(prob, module, acts)
    assert rel_err(out, plain[0]) < 2e-2
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, _leaves(module, acts), grad)
    expected = torch.autograd.grad(plain, leaves, grad.double())
    assert all(g.dtype == torch.float32 for g in ours)
    _assert_close(_names(prob, module, acts), ours, expected, 3e-2)


def test_forward_validates_its_inputs():
    """Errors name the input, as Problem.validate's do; no kernel runs."""
    wan = bnn.WanXattn(device=DEVICE)
    video, text = torch.randn(1, 18, 1024, device=DEVICE), torch.randn(1, 7, 1024, device=DEVICE)
    with pytest.raises(ValueError, match=r"backfuse.functional.wan_xattn: input 'text_embeddings' has shape "
                                         r"\(1, 7, 1024\), expected \[batch_size=1, num_text_tokens=7, 512\]: dim 2 must be 512"):
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
    with pytest.raises(ValueError, match=r"backfuse.functional.qkv_gqa: input 'v_weight' has shape"):
        F.qkv_gqa(torch.randn(1, 2, 1536, device=DEVICE), torch.randn(1, 3, 1024, device=DEVICE), parakeet.q_weight,
                  parakeet.k_weight, parakeet.q_weight)
    with pytest.raises(ValueError, match=r"backfuse.functional.wan_xattn: WanXattnConfig: head size hidden / heads = "
                                         r"1024; the kernels take"):
        F.wan_xattn(video, text, *(getattr(wan, n) for n, _, _ in wan.params(wan.config)), 0.1, heads=1)
    wan(video.transpose(1, 2).contiguous().transpose(1, 2), text)  # any layout is fine


def test_range_warnings_point_at_the_users_line():
    """A call whose values fp16 cannot hold (a value weight 2e5 times too large: V overflows) warns, naming
    the tensor; on the CPU at the end of the call, at the line of the forward's call (the backward's
    warnings at the forward's line too: a GPU backward runs on an autograd worker thread)."""
    prob = backfuse.problem("021")
    inputs = prob.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=4, device=DEVICE)
    module = bnn.WanXattn(device=DEVICE)
    with torch.no_grad():
        module.value_weight.mul_(2e5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", backfuse.Fp16RangeWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning)  # the interpreter's numpy, on the Inf
        out = module(inputs[1], inputs[2]); forward_line = _line()  # noqa: E702
        backfuse.check_ranges(); check_line = _line()  # noqa: E702
    found = [w for w in caught if w.category is backfuse.Fp16RangeWarning]
    assert found and "values (call 1" in str(found[0].message) and "bfloat16 inputs hold fp32's range" in str(
        found[0].message)
    assert (found[0].filename, found[0].lineno) in ((__file__, forward_line), (__file__, check_line))
    _ = out


def _line():
    import inspect

    return inspect.currentframe().f_back.f_lineno
