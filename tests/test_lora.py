"""PEFT's LoRA layers computed together (`integrations/lora.py`): the same outputs and gradients as the layers'
own forward, in the dtypes PEFT runs them (one dtype; a bf16 model with float32 adapters, PEFT's default; autocast),
with LoRA dropout in effect (the layers' own masks), and refused where their forward is something else (a dropout
other than torch's, DoRA, merged or disabled adapters)."""

import copy

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err

from backfuse.integrations import lora

peft = pytest.importorskip("peft")


class _Projections(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj = torch.nn.Linear(24, 32, bias=bias)
        self.k_proj = torch.nn.Linear(24, 16, bias=bias)
        self.v_proj = torch.nn.Linear(24, 16, bias=bias)


def _adapted(bias=False, dtype=torch.float32, adapter_dtype=True, **config):
    torch.manual_seed(0)
    model = _Projections(bias).to(DEVICE, dtype)
    settings = dict(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"], init_lora_weights=False) | config
    return peft.get_peft_model(model, peft.LoraConfig(**settings), autocast_adapter_dtype=adapter_dtype)


def _inner(model):
    return model.get_base_model()


@pytest.mark.parametrize("setup", ["fp32", "fp32 bias", "bf16 model, fp32 adapters", "bf16", "autocast bf16",
                                   "base trained", "dropout", "dropout bf16 model, fp32 adapters",
                                   "dropout autocast bf16"])
def test_project_computes_what_the_layers_compute(setup):
    """Outputs, x's gradient and the trained parameters' against the layers' own forward; with dropout in effect
    (p = 0.5 on q's adapter, v's without) from the same random state: the layers' own masks."""
    dtype = torch.bfloat16 if "bf16 model" in setup or setup == "bf16" else torch.float32
    dropout = setup.startswith("dropout")
    model = _adapted(bias="bias" in setup, dtype=dtype, adapter_dtype=setup != "bf16",
                     **(dict(lora_dropout=0.5) if dropout else {}))
    if dropout:  # v's adapter without (an adapter reading x beside one reading its own dropped input)
        _inner(model).v_proj.lora_dropout["default"] = torch.nn.Identity()
    if setup == "base trained":
        for p in model.parameters():
            p.requires_grad_(True)
    ours = copy.deepcopy(model)
    x = torch.randn(2, 7, 24, device=DEVICE, dtype=dtype)
    grads = [torch.randn(2, 7, n, device=DEVICE) for n in (32, 16, 16)]
    results = []
    for m, fused in ((model, False), (ours, True)):
        xi = x.clone().requires_grad_()
        names = ("q_proj", "k_proj", "v_proj")
        torch.manual_seed(5)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=setup.endswith("autocast bf16")):
            if fused:
                parts = [lora.parts(n, getattr(_inner(m), n), bias=True) for n in names]
                assert all(isinstance(p, lora.Part) for p in parts), parts
                assert [p.dropout is not None for p in parts] == [dropout, False, False]
                ys = lora.project(xi, parts)
            else:
                ys = [getattr(_inner(m), n)(xi) for n in names]
        torch.autograd.backward(ys, [g.to(y.dtype) for g, y in zip(grads, ys)])
        results.append((ys, xi.grad, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (ys, gx, gp), (ys2, gx2, gp2) = results
    tol = 2e-2 if dtype == torch.bfloat16 or "autocast" in setup else 1e-5
    for y, y2 in zip(ys, ys2):
        assert y.dtype == y2.dtype and y.shape == y2.shape
        assert rel_err(y2, y) < tol
    assert rel_err(gx2, gx) < tol
    assert gp.keys() == gp2.keys() and any("lora_A" in n for n in gp)
    for n in gp:
        assert gp2[n].dtype == gp[n].dtype, n
        assert rel_err(gp2[n], gp[n]) < tol, n
    if dropout:  # the dropout bites: another random state gives another q
        torch.manual_seed(6)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=setup.endswith("autocast bf16")):
            other = _inner(model).q_proj(x)
        assert rel_err(other, ys[0]) > 10 * tol


def test_parts_name_what_they_do_not_compute():
    model = _adapted(lora_dropout=0.1)
    q = _inner(model).q_proj
    model.train()
    assert lora.parts("q_proj", q, bias=True).dropout is q.lora_dropout["default"]  # in effect: the module's own
    model.eval()  # dropout off: x itself
    assert lora.parts("q_proj", q, bias=True).dropout is None
    q.lora_dropout["default"] = torch.nn.AlphaDropout(0.1)
    assert lora.parts("q_proj", q, bias=True) == "q_proj's LoRA dropout is not torch's nn.Dropout"
    q.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert isinstance(lora.parts("k_proj", _inner(model).k_proj, bias=True), lora.Part)  # a plain layer
    dora = _inner(_adapted(use_dora=True)).q_proj
    assert "variant" in lora.parts("q_proj", dora, bias=True)
    model.merge_adapter()
    assert "merged" in lora.parts("q_proj", q, bias=True)
    model.unmerge_adapter()
    with model.disable_adapter():
        assert "disabled" in lora.parts("q_proj", q, bias=True)
    assert isinstance(lora.parts("q_proj", q, bias=True), lora.Part)
    assert "has a bias" in lora.parts("q_proj", _inner(_adapted(bias=True)).q_proj, bias=False)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_patched_gemma_with_lora_computes_its_projections_together(monkeypatch, dropout):
    """PEFT LoRA on q, v (and the MLP) of a patched tiny Gemma 3: the attention's projections go through
    `lora.project` (q, k, v together; o alone), nothing falls back, and the loss and the adapters' gradients are
    the unpatched PEFT model's; with LoRA dropout, from the same random state (the layers' own masks, drawn in
    the model's order)."""
    transformers = pytest.importorskip("transformers")
    import backfuse

    calls = []
    real = lora.project
    monkeypatch.setattr(lora, "project", lambda x, parts: calls.append(len(parts)) or real(x, parts))
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                                        attn_implementation="sdpa")
    torch.manual_seed(0)
    base = transformers.Gemma3ForCausalLM(cfg).to(DEVICE)
    ours = copy.deepcopy(base)
    backfuse.patch(ours, quiet=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"],
                             init_lora_weights=False, lora_dropout=dropout)
    models = []
    for m in (base, ours):
        torch.manual_seed(3)
        models.append(peft.get_peft_model(m, config))
    ids = torch.randint(1, 60, (2, 11), device=DEVICE)
    losses = []
    for m in models:
        torch.manual_seed(4)
        losses.append(m(input_ids=ids, labels=ids, use_cache=False).loss)
    for loss in losses:
        loss.backward()
    assert calls.count(3) == 2 and calls.count(1) == 2  # q, k, v and o in each of the two layers
    assert backfuse.fallbacks(models[1]) == {}
    assert abs(losses[0].item() - losses[1].item()) < 1e-3
    trained = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in models]
    assert trained[0].keys() == trained[1].keys()
    for n, g in trained[0].items():
        assert rel_err(trained[1][n], g) < 3e-2, n
    if dropout:  # the dropout bites: another random state, another loss
        torch.manual_seed(5)
        assert abs(models[0](input_ids=ids, labels=ids, use_cache=False).loss.item() - losses[0].item()) > 1e-3
