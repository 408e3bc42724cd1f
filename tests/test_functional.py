"""backfuse.functional and backfuse.nn: the training ops' outputs and gradients against float64 autograd
of the plain forward; which gradients come back; torch.compile and checkpointing; the custom ops'
registration; modules, state dicts, sizes and their refusals."""

import math
import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err, stand_in_cudnn, training_inputs, training_module

import backfuse
from backfuse import functional as F
from backfuse import nn as bnn
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.qkv_gqa.spec import QkvGqaConfig
from backfuse.ops.wan_xattn.spec import WanXattnConfig

SHAPES = {
    "072": dict(batch_size=2, seq_len_dec=5, seq_len_enc=3),
    "021": dict(batch_size=1, num_video_tokens=7, num_text_tokens=3),
    "037": dict(batch_size=1, seq_len=5),
}
FUNCTIONS = {"072": F.qkv_gqa, "021": F.wan_xattn, "037": F.gemma3_core}
TOLERANCE = 3e-3  # fp16 operands, fp32 sums: ~1e-3 of float64 on these chains


def _forward_inputs(pid, seed=0, requires_grad=True, narrow=False):
    """(problem, upstream gradients, forward inputs) at SHAPES; narrow: 037's cut to a narrower width (`_narrow_037`)."""
    prob = backfuse.problem(pid)
    inputs = prob.make_inputs(SHAPES[pid], seed=seed, device=DEVICE)
    named = dict(zip(prob.input_names, inputs))
    if narrow and pid == "037":
        named = _narrow_037(named)
    grads = [named[n] for n in prob.upstream_grads]
    fwd = [(v.clone().requires_grad_(requires_grad and n in prob.differentiates) if isinstance(v, torch.Tensor) else v)
           for n, v in named.items() if n not in prob.upstream_grads]
    return prob, grads, fwd


def _backward(outs, grads, leaves):
    outs = outs if isinstance(outs, tuple) else (outs,)
    return torch.autograd.grad(outs, leaves, grads)


def _float64(fwd):
    return [x.detach().double().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in fwd]


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_outputs_and_gradients_match_float64_autograd_of_the_plain_forward(pid):
    prob, grads, fwd = _forward_inputs(pid)
    leaves = [x for x in fwd if isinstance(x, torch.Tensor) and x.requires_grad]
    ours = FUNCTIONS[pid](*fwd)
    exact = _float64(fwd)
    plain = prob.forward(*exact)
    for o, p in zip(ours if isinstance(ours, tuple) else (ours,), plain if isinstance(plain, tuple) else (plain,)):
        assert o.shape == p.shape and o.dtype == torch.float32 and rel_err(o, p) < TOLERANCE
    exact_leaves = [x for x in exact if isinstance(x, torch.Tensor) and x.requires_grad]
    for name, a, b in zip(prob.differentiates, _backward(ours, grads, leaves),
                          _backward(plain, [g.double() for g in grads], exact_leaves)):
        if name == "key_bias":  # zero in exact arithmetic
            assert (a - b).abs().max() < 0.05
        else:
            assert a.dtype == torch.float32 and rel_err(a, b) < TOLERANCE, name


def test_only_requested_gradients_come_back():
    prob, grads, fwd = _forward_inputs("021")
    fwd[0].requires_grad_(False)  # video_latents
    out = F.wan_xattn(*fwd)
    out.backward(grads[0])
    assert fwd[0].grad is None and all(x.grad is not None for x in fwd[1:10])


def test_frozen_weights_skip_weight_gradients():
    prob, grads, fwd = _forward_inputs("021")
    for x in fwd[2:10]:
        x.requires_grad_(False)  # the projections' weights and biases
    ours = torch.autograd.grad(F.wan_xattn(*fwd), fwd[:2], grads)
    exact = _float64(fwd)
    plain = torch.autograd.grad(prob.forward(*exact), exact[:2], [grads[0].double()])
    for a, b in zip(ours, plain):
        assert rel_err(a, b) < TOLERANCE


def test_unused_outputs_get_zero_gradient():
    prob, grads, fwd = _forward_inputs("072")
    q, _, _ = F.qkv_gqa(*fwd)
    (q * grads[0]).sum().backward()
    plain = [x.detach().double().requires_grad_(True) for x in fwd]
    (prob.forward(*plain)[0] * grads[0].double()).sum().backward()
    assert rel_err(fwd[2].grad, plain[2].grad) < TOLERANCE  # q_weight
    assert fwd[3].grad.abs().max() == 0 and fwd[4].grad.abs().max() == 0  # k, v weights reach only k, v


def test_torch_compile_keeps_one_graph_and_checkpointing_works():
    # 021: the operator whose training path the interpreter runs fastest (CI time).
    prob, grads, fwd = _forward_inputs("021")
    leaves = [x for x in fwd if isinstance(x, torch.Tensor) and x.requires_grad]
    eager = _backward(F.wan_xattn(*fwd), grads, leaves)
    compiled = torch.compile(F.wan_xattn, fullgraph=True, backend="aot_eager")
    for a, b in zip(_backward(compiled(*fwd), grads, leaves), eager):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    ckpt = torch.utils.checkpoint.checkpoint(F.wan_xattn, *fwd, use_reentrant=False)
    for a, b in zip(_backward(ckpt, grads, leaves), eager):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_compiled_graphs_name_the_ops_at_the_overload_of_these_sources(tmp_path):
    """Compile caches key a graph by its code: the op's overload, named by a hash of the sources, keeps a graph
    compiled against another backfuse from being served to this one. The hash follows every source's bytes and
    path."""
    assert F.OVERLOAD == "v" + F.code_fingerprint() and len(F.OVERLOAD) == 17
    (tmp_path / "ops").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "ops" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a source")
    first = F.code_fingerprint(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a source")
    assert F.code_fingerprint(tmp_path) == first
    (tmp_path / "ops" / "b.py").write_text("y = 3\n")
    second = F.code_fingerprint(tmp_path)
    (tmp_path / "ops" / "b.py").rename(tmp_path / "ops" / "c.py")
    assert len({first, second, F.code_fingerprint(tmp_path)}) == 3

    _, _, fwd = _forward_inputs("021")
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch.compile(F.wan_xattn, fullgraph=True, backend=backend)(*fwd)
    assert F.custom_op("wan_xattn_forward") in targets
    assert str(F.custom_op("wan_xattn_forward")) == f"backfuse.wan_xattn_forward.{F.OVERLOAD}"


@pytest.mark.parametrize("pid, config, softcap", [("021", WanXattnConfig(64, 4, qk_norm=True), None),
                                                  ("037", Gemma3CoreConfig(64, 4, 2, 16, window=6, qk_norm=False), 30.0)],
                         ids=["wan-qk-norm", "gemma2-no-qk-norm"])
def test_torch_compile_takes_the_model_features(pid, config, softcap):
    """Wan's q/k norm and Gemma 2's missing QK norm (optional inputs of the custom ops) under torch.compile:
    the eager op's gradients."""
    torch.manual_seed(4)
    m = training_module(pid, config, torch.float32, softcap)
    acts = training_inputs(pid, config, (1, 9, 5) if pid == "021" else (1, 11), torch.float32)
    leaves = list(m.parameters()) + [a for a in acts if a.requires_grad]
    grad = torch.randn(acts[0].shape, device=DEVICE)
    eager = torch.autograd.grad(m(*acts), leaves, grad)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(*acts), leaves, grad), eager):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def _op_args(case):
    """(op, args) of a custom op at a small config: the official operators' inputs, 037 with each kind of mask (its
    inputs cut to 2 query heads and 1 KV head of 128 over 256 features: the schema, the fakes' shapes and the
    autograd registration are the same at any width)."""
    pid, _, mask = case.partition("-")
    _, _, fwd = _forward_inputs(pid, narrow=True)
    if pid == "021" and mask == "self":  # the self-attention: the video its own context, norms and RoPE tables
        video, hidden = fwd[0], fwd[0].shape[-1]
        norms = [(1 + 0.1 * torch.randn(hidden, device=DEVICE)).requires_grad_() for _ in range(2)]
        angles = torch.rand(video.shape[1], hidden // 16, device=DEVICE)
        return F.custom_op("wan_xattn_forward"), (video, video, *fwd[2:10], *norms, angles.cos(),
                                                              angles.sin(), fwd[10], 16, 1e-6)
    if pid == "021":
        return F.custom_op("wan_xattn_forward"), (*fwd[:10], None, None, None, None, fwd[10], 16, 1e-6)
    if pid == "072":
        return F.custom_op("qkv_gqa_forward"), (*fwd, 256)
    b, s = fwd[0].shape[:2]
    if mask == "attention":  # the core between the projections: q, k, v as the projections give them
        x, cos, sin, wq, wk, wv, wo, qnw, knw = fwd[:9]
        q, k, v = (torch.nn.functional.linear(x, w).detach().requires_grad_() for w in (wq, wk, wv))
        return F.custom_op("gemma3_attention_forward"), (q, k, v, cos, sin, qnw, knw, None, None, *fwd[9:],
                                                                    0, 0)
    masks = {"": (None, None),
             "padding": (torch.tensor([[0] * 2 + [1] * (s - 2)], device=DEVICE).expand(b, s).contiguous(), None),
             # documents [0, 2) and [2, 5): each query's first visible key, then its last (itself)
             "documents": (None, torch.tensor([[[0, 0, 2, 2, 2]], [[0, 1, 2, 3, 4]]], dtype=torch.int32, device=DEVICE)),
             "additive": (torch.zeros(1, 1, s, s, device=DEVICE).masked_fill(
                 torch.ones(s, s, dtype=torch.bool, device=DEVICE).triu(1), torch.finfo(torch.float32).min), None)}
    return F.custom_op("gemma3_core_forward"), (*fwd[:9], *masks[mask], *fwd[9:], 0, 0)


@pytest.mark.parametrize("case", ["021", "021-self", "072", "037", "037-padding", "037-documents", "037-additive",
                                  "037-attention"])
def test_custom_ops_keep_torch_librarys_contract(case):
    """torch.library.opcheck: the schema (no output aliases an input or another output: the parameter
    gradients each in memory of their own), the fake kernels' shapes and the autograd registration. (Its
    AOT test compares every output bit for bit, the saved-activations blob's alignment gaps too, which hold
    whatever the allocation held: `test_compiled_with_dynamic_shapes_equals_eager` covers that dispatch.)"""
    op, args = _op_args(case)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("masks", ["none", "padding", "documents"])
def test_the_attention_between_the_projections_is_the_fused_ops(masks, dtype):
    """F.gemma3_attention on q, k, v projected outside (as a model's LoRA or quantized projections give them), then
    the output projection: gemma3_core's output and every gradient, the norm weights' and the activations'."""
    torch.manual_seed(2)
    config = Gemma3CoreConfig(64, 4, 2, 16, window=0)
    m = training_module("037", config, dtype, 30.0)
    b, s = (1, 13) if masks == "documents" else (2, 13)
    x, cos, sin = training_inputs("037", config, (b, s), dtype)
    kw = {"none": {}, "padding": dict(attention_mask=torch.tensor([[0] * 3 + [1] * 10, [1] * 9 + [0] * 4], device=DEVICE)),
          "documents": dict(cu_seqlens=torch.tensor([0, 5, 13], dtype=torch.int32, device=DEVICE))}[masks]
    scalars = (m.q_norm_weight, m.k_norm_weight, m.scaling, m.softcap, m.eps)
    leaves = [x, *m.parameters()]
    fused = F.gemma3_core(x, cos, sin, m.q_weight, m.k_weight, m.v_weight, m.o_weight, *scalars, head_dim=16, **kw)
    grad = torch.randn_like(fused)
    expected = torch.autograd.grad(fused, leaves, grad)
    q, k, v = (torch.nn.functional.linear(x, w) for w in (m.q_weight, m.k_weight, m.v_weight))
    a = F.gemma3_attention(q, k, v, cos, sin, *scalars, head_dim=16, **kw)
    assert a.shape == q.shape and a.dtype == dtype
    out = torch.nn.functional.linear(a, m.o_weight)
    tol = 1e-2 if dtype == torch.bfloat16 else TOLERANCE
    assert rel_err(out, fused) < tol
    for got, want in zip(torch.autograd.grad(out, leaves, grad), expected):
        assert rel_err(got, want) < tol


def test_the_attention_between_the_projections_on_cudnn_is_ours(monkeypatch):
    """gemma3_attention's cuDNN form on any machine (`helpers.stand_in_cudnn`: Gemma 3's global layers in bf16 take
    cuDNN's attention once their shape recurs, LoRA users' too): the norm/RoPE launches before an allocating forward,
    their backward after an allocating backward, saved or recomputed, as our attention's output and gradients."""
    from backfuse import cudnn_attention

    config = Gemma3CoreConfig(64, 4, 2, 16, window=0)
    m = training_module("037", config, torch.bfloat16)
    x, cos, sin = training_inputs("037", config, (2, 13), torch.bfloat16)
    q, k, v = (torch.nn.functional.linear(x, w).detach().requires_grad_() for w in (m.q_weight, m.k_weight, m.v_weight))
    leaves = [q, k, v, m.q_norm_weight, m.k_norm_weight]
    grad = torch.randn_like(q)
    results = []
    stand_in_cudnn(monkeypatch)
    try:
        for enabled, save in ((False, True), (True, True), (True, False)):
            with cudnn_attention(enabled):
                a = F.gemma3_attention(q, k, v, cos, sin, m.q_norm_weight, m.k_norm_weight, m.scaling, None, m.eps,
                                       head_dim=16, save_activations=save)
                results.append((a, torch.autograd.grad(a, leaves, grad)))
        assert sum(p.cudnn for key, p in F._plans.items() if key[0] == "037 attention") == 2
    finally:
        for key in [key for key, p in F._plans.items() if getattr(p, "cudnn", False) and key[0] == "037 attention"]:
            del F._plans[key]
    (ours, ours_grads), *cudnn_runs = results
    for a, grads in cudnn_runs:
        assert rel_err(a, ours) < 1e-2
        for got, want in zip(grads, ours_grads):
            assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("pid", ["021", "037"])
def test_compiled_with_dynamic_shapes_equals_eager(pid):
    """torch.compile(dynamic=True): one graph for two lengths (the fakes trace symbolic sizes), and the eager
    op's outputs and gradients at each. 037 at a narrower width (2 query heads and 1 KV head of 128, hidden 256:
    the official draws cut down, `_narrow_037`), the call's sizes all read off its tensors as at the official one."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = FUNCTIONS[pid]
    compiled = torch.compile(fn, dynamic=True, backend="aot_eager")
    for tokens in (5, 9):
        shapes = dict(SHAPES[pid], **({"num_video_tokens": tokens} if pid == "021" else {"seq_len": tokens}))
        prob = backfuse.problem(pid)
        named = dict(zip(prob.input_names, prob.make_inputs(shapes, seed=tokens, device=DEVICE)))
        if pid == "037":
            named = _narrow_037(named)
        fwd = [v.requires_grad_(n in prob.differentiates) if isinstance(v, torch.Tensor) else v for n, v in named.items()
               if n not in prob.upstream_grads]
        leaves = [x for x in fwd if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = [named[n] for n in prob.upstream_grads]
        for a, b in zip(_backward(compiled(*fwd), grads, leaves), _backward(fn(*fwd), grads, leaves)):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def _narrow_037(named, hidden=256, heads=2, kv_heads=1):
    """037's official inputs cut to `heads` query heads and `kv_heads` KV heads (head size 128, the norms' width)
    over the first `hidden` features: the same op, its sizes read off the weights, at a fraction of the work."""
    d = named["q_norm_weight"].shape[0]
    cut = {"grad_output": (..., slice(hidden)), "hidden_states": (..., slice(hidden)),
           "q_weight": (slice(heads * d), slice(hidden)), "k_weight": (slice(kv_heads * d), slice(hidden)),
           "v_weight": (slice(kv_heads * d), slice(hidden)), "o_weight": (slice(hidden), slice(heads * d))}
    return {n: v[cut[n]].contiguous() if n in cut else v for n, v in named.items()}


def test_saving_activations_or_not_gives_the_same_gradients():
    """save_activations=False keeps only the inputs; the backward runs the forward again: the same math."""
    prob, grads, fwd = _forward_inputs("021", seed=3)
    leaves = [x for x in fwd if isinstance(x, torch.Tensor) and x.requires_grad]
    saved = _backward(F.wan_xattn(*fwd), grads, leaves)
    recomputed = _backward(F.wan_xattn(*fwd, save_activations=False), grads, leaves)
    for a, b in zip(saved, recomputed):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cls, keys", [
    (bnn.QkvGqa, {"linear_q.weight": (4096, 1536), "linear_k.weight": (1024, 1024),
                  "linear_v.weight": (1024, 1024)}),
    (bnn.WanXattn, {f"{k}.{kind}": (1024, 1024) if kind == "weight" else (1024,)
                    for k in ("to_q", "to_k", "to_v", "to_out.0") for kind in ("weight", "bias")}),
    (bnn.Gemma3Core, {"q_proj.weight": (3072, 3072), "k_proj.weight": (1024, 3072),
                      "v_proj.weight": (1024, 3072), "o_proj.weight": (3072, 3072),
                      "q_norm.weight": (128,), "k_norm.weight": (128,)}),
])
def test_modules_load_family_state_dicts(cls, keys):
    sd = {"layer." + k: torch.randn(shape) for k, shape in keys.items()}
    scalars = dict(scaling=0.1, softcap=50.0, eps=1e-6) if cls is bnn.Gemma3Core else {}  # else a warning says so
    module = cls.from_state_dict(sd, prefix="layer.", **scalars)
    assert len(list(module.parameters())) == len(keys)
    for (name, _, _), key in zip(module.params(module.config), keys):
        assert torch.equal(getattr(module, name), sd["layer." + key])
    with pytest.raises(RuntimeError, match="missing key"):
        cls.from_state_dict({})


def test_modules_take_other_sizes():
    """A config's sizes decide the parameters' shapes and the state dicts a module takes."""
    wan = bnn.WanXattn(WanXattnConfig(hidden=1536, heads=12))
    assert wan.query_weight.shape == (1536, 1536) and wan.scale == 1 / math.sqrt(128)
    gemma = bnn.Gemma3Core(Gemma3CoreConfig(hidden=2560, heads=8, kv_heads=4, head_dim=256, window=1024), softcap=None)
    assert gemma.q_weight.shape == (2048, 2560) and gemma.k_weight.shape == (1024, 2560) and gemma.softcap is None
    qkv = bnn.QkvGqa(QkvGqaConfig(hidden=4096, cross_hidden=4096, heads=32, kv_heads=8, head_dim=128))
    assert qkv.k_weight.shape == (1024, 4096)
    sd = {n: torch.zeros(p.shape) for n, p in wan.named_parameters()}
    with pytest.raises(ValueError, match=r"'query_weight' has shape \(1536, 1536\), expected \(1024, 1024\)"):
        bnn.WanXattn.from_state_dict(sd)
    assert bnn.WanXattn.from_state_dict(sd, config=wan.config).query_weight.shape == (1536, 1536)


@pytest.mark.parametrize("make, message", [
    (lambda: WanXattnConfig(hidden=1000, heads=16), "WanXattnConfig: hidden 1000 is not a multiple of heads 16"),
    (lambda: WanXattnConfig(hidden=960, heads=2), "WanXattnConfig: head size hidden / heads = 480; the kernels take"),
    (lambda: Gemma3CoreConfig(heads=24, kv_heads=5), "Gemma3CoreConfig: heads 24 is not a multiple of kv_heads 5"),
    (lambda: Gemma3CoreConfig(head_dim=96), "Gemma3CoreConfig: head_dim 96; the kernels take"),
    (lambda: Gemma3CoreConfig(window=-1), "Gemma3CoreConfig.window must be a non-negative int, got -1"),
    (lambda: QkvGqaConfig(heads=16, kv_heads=3), "QkvGqaConfig: heads 16 is not a multiple of kv_heads 3"),
    (lambda: QkvGqaConfig(head_dim=12), "QkvGqaConfig: head_dim must be a multiple of 8, got 12"),
    (lambda: bnn.Gemma3Core(config=WanXattnConfig()), "backfuse.nn.Gemma3Core: config must be a Gemma3CoreConfig"),
])
def test_configs_refuse_sizes_the_kernels_cannot_take(make, message):
    with pytest.raises((ValueError, TypeError)) as caught:
        make()
    assert str(caught.value).startswith(message)


def _wan_diffusers_dict(prefix="blocks.0.attn2."):
    return {f"{prefix}{k}.{kind}": torch.randn((1024, 1024) if kind == "weight" else (1024,))
            for k in ("to_q", "to_k", "to_v", "to_out.0") for kind in ("weight", "bias")}


def test_from_state_dict_is_strict_about_keys():
    """A diffusers Wan 2.2 cross-attention has q/k RMSNorm weights, which 021 has not: unexpected keys
    raise (listed, with why); strict=False warns at the caller and loads the rest; missing keys are
    listed; keys outside the prefix are not ours to judge."""
    sd = _wan_diffusers_dict()
    sd["blocks.0.attn2.norm_q.weight"] = sd["blocks.0.attn2.norm_k.weight"] = torch.ones(1024)
    sd["blocks.0.norm3.weight"] = torch.ones(1024)  # another layer of the block: outside the prefix
    with pytest.raises(RuntimeError, match=r"unexpected key\(s\) .blocks.0.attn2.norm_q.weight. \(this config has no q/k "
                                           r"RMSNorm.*\), 'blocks.0.attn2.norm_k.weight'"):
        bnn.WanXattn.from_state_dict(sd, prefix="blocks.0.attn2.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = bnn.WanXattn.from_state_dict(sd, prefix="blocks.0.attn2.", strict=False); line = _line()  # noqa: E702
    (w,) = caught
    assert "norm_q.weight" in str(w.message) and "norm3" not in str(w.message)
    assert (w.filename, w.lineno) == (__file__, line)
    assert torch.equal(module.key_weight, sd["blocks.0.attn2.to_k.weight"])
    del sd["blocks.0.attn2.to_v.bias"]
    with pytest.raises(RuntimeError, match=r"missing key\(s\) for 'value_bias' \(looked for blocks.0.attn2.value_bias, "
                                           r"blocks.0.attn2.v.bias, blocks.0.attn2.to_v.bias\); unexpected"):
        bnn.WanXattn.from_state_dict(sd, prefix="blocks.0.attn2.")
    with pytest.warns(UserWarning, match="missing parameters keep their initialisation"):
        module = bnn.WanXattn.from_state_dict(sd, prefix="blocks.0.attn2.", strict=False)
    assert module.value_bias.abs().max() == 0  # Wan's initialisation of biases
    with pytest.raises(ValueError, match=r"'blocks.0.attn2.to_q.weight' has shape \(5120, 5120\), expected \(1024, 1024\)"):
        bnn.WanXattn.from_state_dict({**sd, "blocks.0.attn2.to_q.weight": torch.zeros(5120, 5120)},
                                     prefix="blocks.0.attn2.", strict=False)


def test_gemma_from_hugging_face_names_says_which_scalars_it_keeps():
    sd = {"q_proj.weight": torch.randn(3072, 3072), "k_proj.weight": torch.randn(1024, 3072),
          "v_proj.weight": torch.randn(1024, 3072), "o_proj.weight": torch.randn(3072, 3072),
          "q_norm.weight": torch.randn(128), "k_norm.weight": torch.randn(128)}
    with pytest.warns(UserWarning, match=r"kept scaling=0.0883883, softcap=50, eps=1e-06 .*no soft cap: softcap=None"):
        bnn.Gemma3Core.from_state_dict(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = bnn.Gemma3Core.from_state_dict(sd, scaling=1 / 16, softcap=None, eps=1e-5)
        bnn.Gemma3Core.from_state_dict({name: getattr(module, name) for name, _, _ in module.params(module.config)},
                                       softcap=None)  # our names
    assert (module.scaling, module.softcap, module.eps) == (1 / 16, None, 1e-5)


def test_modules_print_their_sizes():
    assert repr(bnn.WanXattn()) == "WanXattn(hidden=1024, heads=16, head_dim=64, scale=0.125)"
    assert repr(bnn.QkvGqa()) == "QkvGqa(hidden=1536, cross_hidden=1024, heads=16, kv_heads=4, head_dim=256)"
    assert repr(bnn.Gemma3Core(softcap=30.0)) == ("Gemma3Core(hidden=3072, heads=24, kv_heads=8, head_dim=128, window=0, "
                                                  "scaling=0.0883883, softcap=30, eps=1e-06)")


def _line():
    import inspect

    return inspect.currentframe().f_back.f_lineno


def test_module_initialisation():
    wan = bnn.WanXattn()
    assert wan.query_bias.abs().max() == 0 and abs(wan.query_weight.std().item() - math.sqrt(2 / 2048)) < 2e-3
    gemma = bnn.Gemma3Core()
    assert gemma.q_norm_weight.abs().max() == 0 and abs(gemma.q_weight.std().item() - 0.02) < 1e-3
    parakeet = bnn.QkvGqa()
    assert parakeet.q_weight.abs().max() <= 1 / math.sqrt(1536)


def test_names_of_earlier_releases_still_work():
    assert (F.cross_attn_qkv_gqa, F.gemma3_attention_core, F.wan_text_video_cross_attention) == (
        F.qkv_gqa, F.gemma3_core, F.wan_xattn)
    assert (bnn.CrossAttnQKVGQA, bnn.Gemma3AttentionCore, bnn.WanTextVideoCrossAttention) == (
        bnn.QkvGqa, bnn.Gemma3Core, bnn.WanXattn)


@pytest.mark.parametrize("make, error, message", [
    (lambda: bnn.WanXattn(dtype=torch.float64), TypeError,
     "backfuse.nn.WanXattn: dtype must be torch.float32, torch.bfloat16 or torch.float16 (what the forward takes), "
     "got torch.float64"),
    (lambda: bnn.QkvGqa(dtype="float32"), TypeError, "backfuse.nn.QkvGqa: dtype must be torch.float32, torch.bfloat16 "
                                                     "or torch.float16 (what the forward takes), got 'float32'"),
    (lambda: bnn.WanXattn(scale="x"), TypeError, "backfuse.nn.WanXattn: scale must be a real number, got str"),
    (lambda: bnn.WanXattn(scale=float("nan")), ValueError, "backfuse.nn.WanXattn: scale must be finite, got nan"),
    (lambda: bnn.Gemma3Core(softcap=True), TypeError, "backfuse.nn.Gemma3Core: softcap must be a real number, got bool"),
    (lambda: bnn.Gemma3Core(softcap=0.0), ValueError,
     "backfuse.nn.Gemma3Core: softcap must be positive, or None for no soft cap, got 0"),
    (lambda: bnn.WanXattn.from_state_dict({n: torch.zeros(shape) for n, shape, _ in
                                           bnn.WanXattn.params(WanXattnConfig())}, scale="x"),
     TypeError, "backfuse.nn.WanXattn: scale must be a real number, got str"),
    (lambda: bnn.QkvGqa(device="gpu"), ValueError, "backfuse.nn.QkvGqa: device must be a torch.device or a name such as "
                                                   "'cpu' or 'cuda', got 'gpu'"),
    (lambda: bnn.QkvGqa(device=f"cuda:{torch.cuda.device_count()}"), ValueError,
     f"backfuse.nn.QkvGqa: device 'cuda:{torch.cuda.device_count()}' is not available"),
])
def test_module_constructors_refuse_what_the_forward_refuses(make, error, message):
    """Refused when built, in the forward's style (the module's name, the argument, expected, got), not at the
    first forward (a bare float() error, a float64 the forward refuses) or inside torch (an AssertionError)."""
    with pytest.raises(error) as caught:
        make()
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_scalars_are_floats_as_printed():
    assert bnn.WanXattn(scale=1).scale == 1.0 and isinstance(bnn.WanXattn(scale=1).scale, float)
    prob, grads, fwd = _forward_inputs("021")
    with pytest.raises(TypeError, match=r"^backfuse.functional.wan_xattn: input 'scale' must be a real number, got str$"):
        F.wan_xattn(*fwd[:-1], "x")


def _small(op: str, device, **over) -> tuple:
    """(args, kwargs) of a small call of a training op, with `over` in place of its tensors or scalars."""
    t = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    if op == "gemma3_core":
        args = dict(hidden=t(1, 5, 64), cos=t(1, 5, 32), sin=t(1, 5, 32), wq=t(64, 64), wk=t(32, 64), wv=t(32, 64),
                    wo=t(64, 64), qnw=t(32), knw=t(32), scaling=0.1, softcap=None, eps=1e-6)
        kwargs = {}
    else:
        args = dict(video=t(1, 7, 64), text=t(1, 3, 64), wq=t(64, 64), bq=t(64), wk=t(64, 64), bk=t(64), wv=t(64, 64),
                    bv=t(64), wo=t(64, 64), bo=t(64), scale=0.125)
        kwargs = dict(heads=2, norm_q_weight=t(64), norm_k_weight=t(64), eps=over.pop("eps", 1e-6))
    args.update(over)
    return list(args.values()), kwargs


@pytest.mark.parametrize("op", ["gemma3_core", "wan_xattn"])
def test_training_ops_refuse_what_they_cannot_take_in_one_line(op):
    """A negative eps, meta tensors and a first input that is no tensor get an error naming the input, not a
    failure inside torch's autocast or a NaN."""
    label = f"backfuse.functional.{op}"
    eps = "input 'rms_norm_eps'" if op == "gemma3_core" else "eps"
    args, kwargs = _small(op, "cpu", eps=-1.0)
    with pytest.raises(ValueError, match=rf"{label}: {eps} must be >= 0, got -1.0"):
        getattr(F, op)(*args, **kwargs)
    args, kwargs = _small(op, "meta")
    with pytest.raises(RuntimeError, match=rf"{label}: the fused kernels run on CUDA tensors, or on CPU tensors in the "
                                           r"Triton interpreter, not on meta"):
        getattr(F, op)(*args, **kwargs)
    args, kwargs = _small(op, "cpu")
    with pytest.raises(TypeError, match=rf"{label}: input '\w+' must be a torch.Tensor, got NoneType"):
        getattr(F, op)(None, *args[1:], **kwargs)
