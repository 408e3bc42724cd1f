"""backfuse.patch on tiny random-init models of the real classes (transformers' Gemma 2 and Gemma 3,
diffusers' Wan): the patched model trains as the unpatched one does (every step's loss, the final
parameters), its attention on backfuse's ops with nothing handed back; what a patch does not cover
(an attention mask, a KV cache) runs the model's own code and is counted; unpatch restores it.

Without a GPU backfuse's kernels run in the Triton interpreter: the models are tiny, and the training runs
take 6 steps there (20 on a GPU), every one of them through the same kernels.
"""

import copy
import re
import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err

import backfuse
from backfuse import functional as F

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")
STEPS = 20 if DEVICE == "cuda" else 6  # (each interpreted step of the CPU costs ~1 s a model)
# Loss of every step and the final parameters, patched against unpatched. On float32 backfuse's products take
# fp16 operands (fp32 sums), so its losses follow the float32 model to ~1e-4 (Liger's convergence tests, whose
# kernels keep float32 products, ask 1e-5); AdamW's steps then move a parameter by at most a few learning rates.
TOLERANCE = {torch.float32: dict(loss=2e-4, param=5e-3), torch.bfloat16: dict(loss=2e-2, param=2e-2)}


def _gemma(kind: str, dtype):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, sliding_window=4, max_position_embeddings=32,
                  attn_implementation="eager")
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma3ForCausalLM(config)
    else:
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common))
    return model.to(device=DEVICE, dtype=dtype)


def _wan(dtype):
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                            in_channels=4, out_channels=4, text_dim=24, freq_dim=16, ffn_dim=32,
                                            num_layers=1, rope_max_seq_len=32)
    return model.to(device=DEVICE, dtype=dtype)


def _train(model, step, steps=STEPS):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _gemma_step(dtype):
    # Not the pad token (0, whose embedding is zero: a row whose attention output is all zeros gets a
    # gradient 1e8 times the others' through the post-attention norm, beyond any one fp16 scale)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return lambda model: model(input_ids=ids, labels=ids).loss


def _wan_step(dtype):
    g = torch.Generator().manual_seed(1)
    x, text, target = (torch.randn(s, generator=g).to(DEVICE, dtype) for s in ((1, 4, 2, 4, 4), (1, 5, 24), (1, 4, 2, 4, 4)))
    t = torch.tensor([500], device=DEVICE)
    return lambda model: torch.nn.functional.mse_loss(model(x, t, text, return_dict=False)[0].float(), target.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, attention", [("gemma3", "Gemma3Attention"), ("gemma2", "Gemma2Attention"),
                                             ("wan", "WanAttention")])
def test_patched_model_trains_as_the_model_does(kind, attention, dtype):
    base = _wan(dtype) if kind == "wan" else _gemma(kind, dtype)
    ours = copy.deepcopy(base)
    assert backfuse.patch(ours, quiet=True) == {attention: 2}  # Wan: both attentions of its one block
    step = _wan_step(dtype) if kind == "wan" else _gemma_step(dtype)
    expected = _train(base, step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.BackfuseWarning)  # a fallback would warn
        got = _train(ours, step)
    assert backfuse.fallbacks(ours) == {}
    tol = TOLERANCE[dtype]
    for a, b in zip(got, expected):
        assert abs(a - b) <= tol["loss"] * abs(b), (got, expected)
    for (name, p), q in zip(ours.named_parameters(), base.parameters()):
        assert (p.float() - q.float()).abs().max() <= tol["param"], name


def test_what_a_patch_does_not_cover_runs_the_models_own_code():
    """A mask is served (the one transformers built); a KV cache, attention dropout, a projection that is not a
    plain nn.Linear and eager attention without a mask run the module's own code, each with a warning that
    names the reason and points at the caller's line; unpatch restores the module."""
    model = _gemma("gemma3", torch.float32)
    backfuse.patch(model, quiet=True)
    ids = torch.randint(1, 96, (1, 6), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.BackfuseWarning)
        masked = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert backfuse.fallbacks(model) == {}
    model.eval()
    with torch.no_grad(), pytest.warns(backfuse.BackfuseWarning, match="a KV cache") as caught:
        model(input_ids=ids, use_cache=True)
    assert caught[0].filename == __file__  # the user's line, not transformers'
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.warns(backfuse.BackfuseWarning, match="attention dropout"):
        model(input_ids=ids)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda *args: None)
    with pytest.warns(backfuse.BackfuseWarning, match="q_norm is a Gemma3RMSNorm, not the model.s own RMSNorm .it has hooks."):
        model(input_ids=ids)
    counts = backfuse.fallbacks(model)
    assert counts == {"a KV cache (pass use_cache=False in training)": 2, "attention dropout": 2,
                      "q_norm is a Gemma3RMSNorm, not the model's own RMSNorm (it has hooks)": 1}
    model.eval()
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    assert ((plain - masked).abs().max() / masked.abs().max()) < 1e-2
    assert backfuse.unpatch(model) == 2 and backfuse.fallbacks(model) == {}


def test_every_mask_of_one_shape_reaches_the_op_in_one_layout(monkeypatch):
    """transformers builds a batch of unpadded rows' mask as one entry broadcast by stride 0, and a padded batch's
    as a contiguous [B, 1, S, S]: the op takes the first as its [1, 1, S, S] entry and the second as it is (its
    launches, kept per shape and dtype, bake a mask's strides), and both calls give the model's own result."""
    seen = []
    op = F.gemma3_core

    def spy(*args, attention_mask=None, **kwargs):
        if attention_mask is not None:
            seen.append((tuple(attention_mask.shape), attention_mask.is_contiguous()))
        return op(*args, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(F, "gemma3_core", spy)
    base = _gemma("gemma3", torch.float32)
    base.config._attn_implementation = "sdpa"
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    padded = torch.ones(2, 9, dtype=torch.long, device=DEVICE)
    padded[0, :3] = 0
    for mask in (None, padded, None):
        expected = base(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
        keep = slice(None) if mask is None else mask.bool()
        assert (got - expected)[keep].abs().max() <= 2e-3 * expected.abs().max()
    assert backfuse.fallbacks(ours) == {}
    assert set(seen) == {((1, 1, 9, 9), True), ((2, 1, 9, 9), True)}, seen


def test_a_mask_or_soft_cap_the_modules_code_reads_otherwise_runs_that_code():
    """A caller's own 4-dim mask is served only where the attention function reads it as backfuse does: eager
    adds a bool mask to the logits as 0 / 1, so that runs the module's code (and gives its result), while a
    float one is served. A soft cap on Gemma 3 (whose code applies none) and Gemma 2's cap under SDPA (which
    takes none) run the module's code too; an integer mask under SDPA is the module's own error."""
    s = 7
    visible = torch.tril(torch.ones(s, s, dtype=torch.bool, device=DEVICE))
    visible[5:, :3] = False  # a hole no causal mask has
    additive = torch.zeros(s, s, device=DEVICE).masked_fill(~visible, torch.finfo(torch.float32).min)
    ids = torch.randint(1, 96, (1, s), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    base = _gemma("gemma2", torch.float32)
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    for mask, served in ((visible, False), (additive, True)):
        expected = base(input_ids=ids, attention_mask=mask[None, None]).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = ours(input_ids=ids, attention_mask=mask[None, None]).logits
        said = [str(w.message) for w in caught if issubclass(w.category, backfuse.BackfuseWarning)]
        assert (said == []) == served, said
        assert (got - expected).abs().max() <= 2e-3 * expected.abs().max()
    assert backfuse.fallbacks(ours) == {"a torch.bool mask under eager attention (eager adds the mask to the logits as "
                                        "numbers)": 2}
    ours.config._attn_implementation = base.config._attn_implementation = "sdpa"
    try:  # transformers' own answer: an error in newer versions (SDPA takes no soft cap), uncapped in older ones
        expected = base(input_ids=ids).logits
    except ValueError as e:
        expected = e
    with pytest.warns(backfuse.BackfuseWarning, match="Gemma 2's soft cap under 'sdpa' attention"):
        if isinstance(expected, ValueError):
            with pytest.raises(ValueError, match=re.escape(str(expected))):
                ours(input_ids=ids)
        else:
            assert torch.equal(ours(input_ids=ids).logits, expected)
    capped = _gemma("gemma3", torch.float32)
    capped.config._attn_implementation = "sdpa"
    for layer in capped.model.layers:
        layer.self_attn.attn_logit_softcapping = 0.5
    ours = copy.deepcopy(capped)
    backfuse.patch(ours, quiet=True)
    with pytest.warns(backfuse.BackfuseWarning, match="attn_logit_softcapping=0.5 on a Gemma3Attention"):
        got = ours(input_ids=ids).logits
    assert torch.equal(got, capped(input_ids=ids).logits)
    ours = _gemma("gemma3", torch.float32)
    ours.config._attn_implementation = "sdpa"
    backfuse.patch(ours, quiet=True)
    with pytest.warns(backfuse.BackfuseWarning, match="a torch.int64 mask under SDPA"), \
            pytest.raises(RuntimeError, match="attn_mask dtype"):
        ours(input_ids=ids, attention_mask=visible.long()[None, None])


def test_a_patched_model_on_eager_attention_without_a_mask_runs_its_own_code():
    model = _gemma("gemma3", torch.float32)
    backfuse.patch(model, quiet=True)
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 5, 32, device=DEVICE)
    cos, sin = torch.ones(1, 5, 16, device=DEVICE), torch.zeros(1, 5, 16, device=DEVICE)
    with pytest.warns(backfuse.BackfuseWarning, match="eager attention without a mask"):
        attention(x, (cos, sin), None)


def test_patch_refuses_a_model_it_has_nothing_for():
    with pytest.raises(ValueError, match=r"backfuse.patch: Linear has no module backfuse covers; it covers: transformers "
                                         r"Gemma2Attention / Gemma3Attention, diffusers WanAttention"):
        backfuse.patch(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "wan"])
def test_patched_model_compiles_to_one_graph(kind):
    """torch.compile of a patched model: one graph (no break, no recompilation per layer), backfuse's
    custom ops inside, the eager patched model's loss and gradients."""
    model = _wan(torch.float32) if kind == "wan" else _gemma(kind, torch.float32)
    backfuse.patch(model, quiet=True)
    step = _wan_step(torch.float32) if kind == "wan" else _gemma_step(torch.float32)
    eager = step(model)
    eager_grads = torch.autograd.grad(eager, list(model.parameters()), allow_unused=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    loss = step(compiled)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert backfuse.fallbacks(model) == {}
    assert abs(loss.item() - eager.item()) <= 1e-5 * abs(eager.item())
    for a, b in zip(grads, eager_grads):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-4, atol=1e-6))


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "wan"])
def test_a_model_in_float64_runs_its_own_code(kind):
    """A patched model in float64 (as a gradient check runs one): backfuse's ops take float32, bfloat16 and float16,
    so each attention runs the module's own code, with a warning naming the dtype, and the model computes what the
    unpatched one does (it raised a TypeError from inside the op before)."""
    base = _wan(torch.float64) if kind == "wan" else _gemma(kind, torch.float64)
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    if kind == "wan":
        g = torch.Generator().manual_seed(2)
        args = (torch.randn(1, 4, 2, 4, 4, generator=g, dtype=torch.float64).to(DEVICE),
                torch.tensor([500], device=DEVICE), torch.randn(1, 5, 24, generator=g, dtype=torch.float64).to(DEVICE))
        run = lambda m: m(*args, return_dict=False)[0]  # noqa: E731
    else:
        ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        run = lambda m: m(input_ids=ids, use_cache=False).logits  # noqa: E731
    with pytest.warns(backfuse.BackfuseWarning, match=r"hidden states in torch.float64 \(backfuse's ops take "
                                                      r"torch.float32, torch.bfloat16 or torch.float16\)"):
        got = run(ours)
    assert torch.equal(got, run(base))
    assert set(backfuse.fallbacks(ours)) == {"hidden states in torch.float64 (backfuse's ops take torch.float32, "
                                             "torch.bfloat16 or torch.float16)"}


def _gemma_norm_forward(self, x):
    """Gemma's RMSNorm as Liger Kernel's Gemma setup computes it (fp32, weight offset 1, cast once)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (y * (self.offset + self.weight.float())).to(x.dtype)


def test_plain_linear_names_what_makes_a_layer_more_than_its_weight():
    """`plain_linear` (read at every call of every patched layer, from the module's dicts): a plain layer passes; a
    parametrized one (its class torch's), hooks, a bias where none is taken, a replaced forward, a weight that is
    not a floating tensor are each named."""
    from torch.nn.utils import parametrize

    from backfuse.integrations import plain_linear

    def linear(bias=False):
        return torch.nn.Linear(4, 4, bias=bias)

    assert plain_linear("q", linear(), bias=False) is None and plain_linear("q", linear(True), bias=True) is None
    assert plain_linear("q", linear(True), bias=False) == "q has a bias"
    parametrized = linear()
    parametrize.register_parametrization(parametrized, "weight", torch.nn.Identity())
    assert "q is a torch ParametrizedLinear, not a plain nn.Linear" in plain_linear("q", parametrized, bias=False)
    hooked = linear()
    hooked.register_forward_pre_hook(lambda m, x: None)
    assert plain_linear("q", hooked, bias=False) == "q has hooks"
    replaced = linear()
    replaced.forward = lambda x: x
    assert "q's forward is replaced on the module" in plain_linear("q", replaced, bias=False)
    quantized = linear()
    quantized.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    assert "not a plain floating tensor" in plain_linear("q", quantized, bias=False)


def test_a_forward_replaced_on_the_module_is_not_the_class_code():
    """A projection whose forward is replaced on the instance (accelerate's offloading hooks, a user's function)
    is not read as a plain nn.Linear: Gemma's runs as the module around backfuse's attention, its replacement
    called. A QK norm's replaced forward runs the module's own code with a warning, except Liger Kernel's
    RMSNorm bound as Gemma's (offset 1, casting "gemma", the model's eps), which computes the model's own norm
    and is served. Wan's norms: the module's own code, with a warning."""
    ids = torch.randint(1, 96, (1, 6), device=DEVICE)
    model = _gemma("gemma3", torch.float32)
    expected = model(input_ids=ids).logits
    backfuse.patch(model, quiet=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert backfuse.integrations.plain_linear("q_proj", q_proj, bias=False) is None
    called = []
    q_proj.forward = lambda x: called.append(1) or torch.nn.functional.linear(x, q_proj.weight)
    assert "q_proj's forward is replaced on the module" in backfuse.integrations.plain_linear("q_proj", q_proj,
                                                                                              bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.BackfuseWarning)
        got = model(input_ids=ids).logits
    assert called and backfuse.fallbacks(model) == {} and torch.allclose(got, expected, rtol=2e-3, atol=2e-3)
    del q_proj.forward

    for layer in model.model.layers:  # as liger_kernel's _patch_rms_norm_module binds its forward
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.offset, norm.casting_mode, norm.variance_epsilon = 1.0, "gemma", norm.eps
            forward = type(_gemma_norm_forward)(_gemma_norm_forward.__code__, globals(), "forward")
            forward.__module__ = "liger_kernel.transformers.rms_norm"
            norm.forward = forward.__get__(norm)
    before = dict(backfuse.fallbacks(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.BackfuseWarning)
        got = model(input_ids=ids).logits
    assert backfuse.fallbacks(model) == before and torch.allclose(got, expected, rtol=2e-3, atol=2e-3)
    model.model.layers[1].self_attn.k_norm.casting_mode = "llama"
    with pytest.warns(backfuse.BackfuseWarning, match="k_norm's forward is replaced on the module"):
        model(input_ids=ids)

    wan = _wan(torch.float32)
    backfuse.patch(wan, quiet=True)
    norm_q = wan.blocks[0].attn2.norm_q
    norm_q.forward = lambda x: torch.nn.RMSNorm.forward(norm_q, x)
    with pytest.warns(backfuse.BackfuseWarning, match="norm_q has hooks or its forward replaced"):
        _wan_step(torch.float32)(wan)


def test_a_wan_processor_backfuse_cannot_vouch_for_runs_its_own_code():
    """A Wan attention is served only where the processor `patch` replaced is diffusers' own on an exact backend:
    a user's processor runs (its result, with a warning); diffusers' backend and context-parallel settings made
    after `patch` reach the replaced processor, and a quantized backend (SageAttention) is not served."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class Scaled(WanAttnProcessor):  # a user's processor: diffusers' computation, then its own change
        def __call__(self, *args, **kwargs):
            return 2 * super().__call__(*args, **kwargs)

    x, t, text = (torch.randn(s, generator=torch.Generator().manual_seed(2)).to(DEVICE)
                  for s in ((1, 4, 2, 4, 4), (1,), (1, 5, 24)))
    t = torch.tensor([500], device=DEVICE)
    base = _wan(torch.float32)
    base.blocks[0].attn2.set_processor(Scaled())
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    with pytest.warns(backfuse.BackfuseWarning, match="the processor it replaced is a .*Scaled, not diffusers' WanAttnProcessor"):
        got = ours(x, t, text, return_dict=False)[0]
    expected = base(x, t, text, return_dict=False)[0]
    assert (got - expected).abs().max() <= 1e-3 * expected.abs().max()  # attn2's doubling (attn1 may be served)
    ours = _wan(torch.float32)
    backfuse.patch(ours, quiet=True)
    attn2 = ours.blocks[0].attn2
    ours.set_attention_backend("_native_math")
    assert attn2.processor.own._attention_backend.value == "_native_math"
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.BackfuseWarning)
        ours(x, t, text)
    attn1 = ours.blocks[0].attn1
    attn1.processor._parallel_config = object()  # as diffusers' context parallelism sets it
    with pytest.warns(backfuse.BackfuseWarning, match="context parallelism"):
        ours(x, t, text)
    attn1.processor._parallel_config = None
    attn2.processor._attention_backend = "sage"
    assert attn2.processor.own._attention_backend == "sage"
    with pytest.warns(backfuse.BackfuseWarning, match="attention backend 'sage' .quantized"), pytest.raises(Exception):
        ours(x, t, text)  # diffusers' own processor: SageAttention is not installed here


@pytest.mark.parametrize("text, lora", [(512, False), (300, False), (512, True)])
def test_wan_i2v_attends_to_the_image_apart(text, lora):
    """Wan I2V: the cross-attention's context is the image's tokens, then the text encoder's (diffusers splits off the
    last 512, so a shorter text moves the split: 300 text tokens take part of the image's). The patched model
    serves both attentions, the image's through its own k, v projections and k norm summed with the text's before the
    output projection (with PEFT LoRA on q and the image's k too, as the modules compute them), and gives the
    unpatched model's output and gradients."""
    torch.manual_seed(0)
    base = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                           in_channels=4, out_channels=4, text_dim=24, freq_dim=16, ffn_dim=32,
                                           num_layers=1, rope_max_seq_len=32, image_dim=20,
                                           added_kv_proj_dim=32).to(DEVICE)
    ours = copy.deepcopy(base)
    assert backfuse.patch(ours, quiet=True) == {"WanAttention": 2}
    if lora:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "add_k_proj"], init_lora_weights=False)
        for m in (base, ours):
            torch.manual_seed(3)
            peft.inject_adapter_in_model(config, m)
    g = torch.Generator().manual_seed(1)
    x, context, image = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((1, 4, 2, 4, 4), (1, text, 24), (1, 7, 20)))
    results = []
    for model in (base, ours):
        out = model(x, torch.tensor([500], device=DEVICE), context, encoder_hidden_states_image=image, return_dict=False)[0]
        (out * torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)).sum().backward()
        results.append(out)
    assert backfuse.fallbacks(ours) == {}
    assert rel_err(results[1], results[0]) < 3e-3
    theirs = dict(base.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is not None or theirs[name].grad is not None:
            assert rel_err(p.grad, theirs[name].grad) < 3e-2, name


def _flash_batch(kind: str, seq: int = 11) -> dict:
    """A batch as collators make it for FlashAttention: padding (left, right, holes no collator makes), or one row
    of packed documents by position ids restarting or by the varlen kwargs: one tensor for both, the two tensors
    of transformers' `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`, or keys' documents that are
    not the queries' (FlashAttention aligns their causality to each document's end)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 96, (2, seq), generator=g)
    if kind == "collator":
        lengths = [seq // 3 + 1, 2, seq - 3]
        features = [{"input_ids": ids.flatten()[sum(lengths[:i]):sum(lengths[:i + 1])].tolist()} for i in range(3)]
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
        assert batch["cu_seq_lens_q"] is not batch["cu_seq_lens_k"]
        return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    mask = torch.ones_like(ids)
    if kind == "left":
        mask[1, :4] = 0
    elif kind == "right":
        mask[1, seq - 4:] = 0
    elif kind == "holes":
        mask[1, 3:6] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, labels=labels, attention_mask=mask)
    if kind in ("packed", "varlen", "apart"):
        flat = ids.reshape(1, -1)[:, :2 * seq - 3]
        lengths = [seq // 3 + 1, 2, flat.shape[1] - seq // 3 - 3]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = flat.clone()
        labels[0, positions[0] == 0] = -100
        batch = dict(input_ids=flat, labels=labels, position_ids=positions)
        if kind == "varlen":  # one tensor for both, as a caller computing them once passes them
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        if kind == "apart":  # the second document's keys start 2 later and its queries end 3 sooner than its keys
            n = flat.shape[1]
            cu_q, cu_k = [0, lengths[0], n - 3, n - 3], [0, lengths[0] + 2, n - 1, n]
            batch.update(cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32), max_length_q=n,
                         cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32), max_length_k=n)
            labels[0, n - 3:] = -100  # queries in no document: FlashAttention leaves their rows unwritten
    elif kind == "none":
        del batch["attention_mask"]
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("kind", ["gemma3", "gemma2"])
@pytest.mark.parametrize("batch", ["none", "left", "right", "holes", "packed", "varlen", "collator", "apart"])
def test_a_flash_attention_model_is_served_as_flash_attention_computes(monkeypatch, kind, batch):
    """A model set to FlashAttention (transformers' own FlashAttention path, its kernel a float64 stand-in): the
    patched model serves every layer and gives the unpatched model's loss and gradients. Its window counts the real
    tokens only (holes in a padding mask move it: the real tokens go first for the kernels and back after), padded
    queries give 0 (their rows reach the loss under left padding), packed documents come from position ids or the
    varlen kwargs (one tensor or two, with the same documents or not), and Gemma 2's soft cap is applied."""
    from helpers import stand_in_flash_attention

    flash = stand_in_flash_attention(monkeypatch)
    base = flash(_gemma(kind, torch.float32))
    if kind == "gemma2":  # logits of a few units (random init's are ~1e-3), and a cap that bites at them
        with torch.no_grad():
            for layer in base.model.layers:
                layer.self_attn.q_proj.weight.mul_(40)
                layer.self_attn.k_proj.weight.mul_(40)
                layer.self_attn.attn_logit_softcapping = 1.0
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    data = _flash_batch(batch)
    losses = []
    for model in (base, ours):
        model.train()
        loss = model(**data, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert backfuse.fallbacks(ours) == {}
    assert abs(losses[1] - losses[0]) <= 1e-3 * abs(losses[0]), losses
    theirs = dict(base.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name].grad
        assert (p.grad - q).abs().max() <= 3e-2 * q.abs().max().clamp_min(1e-6), name


@pytest.mark.parametrize("impl", ["eager", "sdpa", "flash"])
@pytest.mark.parametrize("batch", ["left", "packed"])
def test_a_patched_model_serves_inference_mode(monkeypatch, impl, batch):
    """Under torch.inference_mode, on inputs made there (inference tensors count no versions, so what a forward's
    layers share from its padding mask or position ids is made afresh): the patched model serves every layer and
    gives the unpatched model's logits."""
    from helpers import stand_in_flash_attention

    base = _gemma("gemma3", torch.float32)
    if impl == "flash":
        base = stand_in_flash_attention(monkeypatch)(base)
    else:
        base.config._attn_implementation_internal = impl
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    with torch.inference_mode():
        data = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _flash_batch(batch).items()
                if k != "labels"}
        assert data["input_ids"].is_inference()
        expected, got = (m.eval()(**data, use_cache=False).logits for m in (base, ours))
    assert backfuse.fallbacks(ours) == {}
    real = data["attention_mask"].bool() if "attention_mask" in data else torch.ones_like(data["input_ids"], dtype=torch.bool)
    assert (got - expected)[real].abs().max() <= 1e-3 * expected.abs().max()


def test_paligemma_2s_prefix_is_served_by_the_mask_transformers_builds():
    """PaliGemma 2 (a SigLIP tower before a Gemma 2, released for fine-tuning): its attention modules are not causal,
    and the 4-dim mask transformers builds (the image and the prefix see each other both ways, the suffix is causal,
    padding) alone decides what each query sees. The patched model serves every call with that mask (Gemma 2's soft
    cap included) and trains as the unpatched one: loss and every gradient."""
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, sliding_window=4, max_position_embeddings=64, model_type="gemma2")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4, model_type="siglip_vision_model")
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=95, projection_dim=32,
                                          attn_implementation="eager")
    torch.manual_seed(0)
    base = transformers.PaliGemmaForConditionalGeneration(config).to(DEVICE)
    ours = copy.deepcopy(base)
    assert backfuse.patch(ours, quiet=True) == {"Gemma2Attention": 2}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 90, (2, 24), generator=g)
    ids[:, :16] = 95  # the image's tokens
    suffix = torch.zeros_like(ids)
    suffix[:, 20:] = 1
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    batch = dict(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g), token_type_ids=suffix,
                 attention_mask=mask, labels=ids.masked_fill((suffix == 0) | (mask == 0), -100))
    losses = []
    for model in (base, ours):
        model.train()
        loss = model(**{k: v.to(DEVICE) for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert backfuse.fallbacks(ours) == {}
    assert abs(losses[1] - losses[0]) <= 1e-3 * abs(losses[0]), losses
    theirs = dict(base.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name].grad
        assert (p.grad is None) == (q is None), name  # (the tower's last norm takes no part)
        assert q is None or (p.grad - q).abs().max() <= 3e-2 * q.abs().max().clamp_min(1e-6), name


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_bidirectional_gemma_3_is_served_where_its_mask_decides(impl):
    """Gemma 3 as an encoder (`use_bidirectional_attention`, as EmbeddingGemma): the 4-dim mask transformers passes
    (padding; the window both ways) alone decides, and the patched model serves the call, giving the unpatched
    hidden states and gradients. Without a mask (a module called alone) SDPA would attend both ways by the module's
    flag: that is refused."""
    config = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                           max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                                           use_bidirectional_attention=True, attn_implementation=impl)
    torch.manual_seed(0)
    base = transformers.Gemma3TextModel(config).to(DEVICE)
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    ids = torch.randint(1, 90, (2, 11), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    outs = []
    weights = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE) * mask[..., None]
    for model in (base, ours):
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * weights).sum().backward()  # (a loss that reads the real tokens' states in every direction)
        outs.append(out)
    assert backfuse.fallbacks(ours) == {}
    real = mask.bool()
    assert rel_err(outs[1][real], outs[0][real]) < 3e-3
    theirs = dict(base.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, theirs[name].grad) < 3e-2, name
    if impl == "sdpa":  # no mask: SDPA attends both ways by the module's flag, which the op does not
        attention = ours.layers[1].self_attn
        x = torch.randn(2, 11, 32, device=DEVICE)
        turns = (torch.ones(2, 11, 16, device=DEVICE), torch.zeros(2, 11, 16, device=DEVICE))  # (RoPE turning nothing)
        with pytest.warns(backfuse.BackfuseWarning, match="bidirectional attention"):
            attention(x, turns, None)


def test_what_flash_attention_takes_otherwise_runs_the_modules_code(monkeypatch):
    """Under FlashAttention: the varlen kwargs as two tensors where transformers' FlashAttention aligns causality to
    a document's first key (before FlashAttention 2.1), Gemma 2's soft cap on a kernel that takes none (transformers
    raises), and an implementation transformers cannot load run the module's own code, each with a warning naming
    it."""
    import transformers.integrations.flash_attention as fa_path
    from helpers import stand_in_flash_attention

    from backfuse.integrations import transformers as hf

    flash = stand_in_flash_attention(monkeypatch)
    model = flash(_gemma("gemma3", torch.float32))
    backfuse.patch(model, quiet=True)
    monkeypatch.setattr(fa_path, "_use_top_left_mask", True)
    monkeypatch.setattr(hf, "_FLASH", {})
    with pytest.warns(backfuse.BackfuseWarning, match="aligns causality to the first key"):
        model(**_flash_batch("collator"), use_cache=False)
    assert backfuse.fallbacks(model)
    monkeypatch.setattr(fa_path, "_use_top_left_mask", False)
    monkeypatch.setattr(hf, "_FLASH", {})

    # Gemma 2's cap on a kernel that takes none: transformers 5.25 raises, 5.17 (the device's) drops the cap and
    # runs; the patched model does what the module's own code does with the transformers installed.
    flash = stand_in_flash_attention(monkeypatch, softcap=False)
    base = flash(_gemma("gemma2", torch.float32))
    model = copy.deepcopy(base)
    backfuse.patch(model, quiet=True)
    batch = _flash_batch("none")
    try:
        own = base(**batch, use_cache=False).logits
    except ValueError as e:
        assert "softcap" in str(e)
        own = None
    with pytest.warns(backfuse.BackfuseWarning, match="Gemma 2's soft cap under 'flash_attention_2', whose kernel takes "
                                                      "none"):
        if own is None:
            with pytest.raises(ValueError, match="softcap"):
                model(**batch, use_cache=False)
        else:
            assert torch.equal(model(**batch, use_cache=False).logits, own)

    import transformers.modeling_flash_attention_utils as fa

    def missing(*args, **kwargs):
        raise ImportError("no flash_attn here")

    monkeypatch.setattr(fa, "_lazy_imports", missing)
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    monkeypatch.setattr(hf, "_FLASH", {})
    model = flash(_gemma("gemma3", torch.float32))
    backfuse.patch(model, quiet=True)
    with pytest.warns(backfuse.BackfuseWarning, match="'flash_attention_2' not loadable here"), \
            pytest.raises(ImportError, match="no flash_attn here"):
        model(**_flash_batch("none"), use_cache=False)
