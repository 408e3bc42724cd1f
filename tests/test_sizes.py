"""Each operator's sizes have one source, its spec's frozen config: the Problem's signature, reference
and forward read it (the benchmark operator's, `OFFICIAL`, by default; another config's when given),
and the fused path's plan takes the benchmark operator's only, refusing others by name."""

import importlib
import re

import pytest
import torch
from conftest import DEVICE
from helpers import autograd_backward, rel_err

import backfuse
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.qkv_gqa.spec import QkvGqaConfig
from backfuse.ops.wan_xattn.spec import WanXattnConfig
from backfuse.problem import Tensor

# The benchmark operators' sizes (SOL-ExecBench's definitions), written out here as the check.
OFFICIAL_SIZES = {
    "072": dict(hidden=1536, cross_hidden=1024, heads=16, kv_heads=4, head_dim=256),
    "037": dict(hidden=3072, heads=24, kv_heads=8, head_dim=128, window=0, qk_norm=True),
    "021": dict(hidden=1024, heads=16, qk_norm=False),
}
SMALL = {"072": QkvGqaConfig(64, 32, 4, 2, 16), "037": Gemma3CoreConfig(64, 4, 2, 16), "021": WanXattnConfig(64, 4)}
SMALL_AXES = {"072": dict(batch_size=2, seq_len_dec=5, seq_len_enc=3), "037": dict(batch_size=2, seq_len=5),
              "021": dict(batch_size=2, num_video_tokens=5, num_text_tokens=3)}


def _spec(prob):
    return importlib.import_module(type(prob).__module__)


def _config_module(prob):
    return importlib.import_module(type(prob).__module__.rpartition(".")[0] + ".config")


def _dims(pid, c) -> dict:
    """Each tensor's dims (inputs, then outputs) from config c's fields, as the operator defines them."""
    if pid == "072":
        b, sd, se = "batch_size", "seq_len_dec", "seq_len_enc"
        grads = {n: (b, c.heads, s, c.head_dim) for n, s in (("grad_query_states", sd), ("grad_key_states", se),
                                                              ("grad_value_states", se))}
        fwd = {"decoder_hidden_states": (b, sd, c.hidden), "encoder_hidden_states": (b, se, c.cross_hidden),
               "q_weight": (c.heads * c.head_dim, c.hidden), "k_weight": (c.kv_heads * c.head_dim, c.cross_hidden),
               "v_weight": (c.kv_heads * c.head_dim, c.cross_hidden)}
        return grads | fwd | {"grad_" + n: d for n, d in fwd.items()}
    if pid == "037":
        b, s = "batch_size", "seq_len"
        q_out, kv_out = c.heads * c.head_dim, c.kv_heads * c.head_dim
        params = {"q_weight": (q_out, c.hidden), "k_weight": (kv_out, c.hidden), "v_weight": (kv_out, c.hidden),
                  "o_weight": (c.hidden, q_out), "q_norm_weight": (c.head_dim,), "k_norm_weight": (c.head_dim,)}
        return ({"grad_output": (b, s, c.hidden), "hidden_states": (b, s, c.hidden), "cos": (b, s, c.head_dim),
                 "sin": (b, s, c.head_dim)} | params | {"grad_hidden_states": (b, s, c.hidden)}
                | {"grad_" + n: d for n, d in params.items()})
    b, nv, nt = "batch_size", "num_video_tokens", "num_text_tokens"
    params = {f"{p}_{kind}": (c.hidden, c.hidden) if kind == "weight" else (c.hidden,)
              for p in ("query", "key", "value", "output") for kind in ("weight", "bias")}
    acts = {"video_latents": (b, nv, c.hidden), "text_embeddings": (b, nt, c.hidden)}
    return ({"grad_output": (b, nv, c.hidden)} | acts | params | {"grad_" + n: d for n, d in acts.items()}
            | {"grad_" + n: d for n, d in params.items()})


def test_the_official_problem_reads_the_official_config(prob):
    """backfuse.problem's operator holds its spec's OFFICIAL config (the benchmark operator's sizes, its
    config class's defaults), and every input and output shape is the one its fields give."""
    spec = _spec(prob)
    assert prob.config is spec.OFFICIAL and prob.config == type(prob.config)()
    assert {f: getattr(prob.config, f) for f in OFFICIAL_SIZES[prob.id]} == OFFICIAL_SIZES[prob.id]
    dims = _dims(prob.id, prob.config)
    tensors = [s for s in prob.inputs if isinstance(s, Tensor)] + list(prob.outputs)
    assert [t.dims for t in tensors] == [dims[t.name] for t in tensors] and len(tensors) == len(dims)


@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_a_problem_at_other_sizes_draws_and_differentiates_at_them(pid):
    """The same operator at a small config: its signature, inputs, scalar defaults, reference and
    forward at those sizes (the reference against float64 autograd through the forward)."""
    official = backfuse.problem(pid)
    prob = type(official)(SMALL[pid])
    assert prob.config is SMALL[pid] and official.config is _spec(official).OFFICIAL  # the official one unchanged
    assert prob.input_names == official.input_names and prob.output_names == official.output_names
    dims = _dims(pid, SMALL[pid])
    inputs = prob.make_inputs(SMALL_AXES[pid], seed=2)
    prob.validate(inputs)
    for spec, x in zip(prob.inputs, inputs):
        if isinstance(x, torch.Tensor):
            assert spec.dims == dims[spec.name] and x.shape == spec.shape(SMALL_AXES[pid]), spec.name
    scale = [s.default for s in prob.scalar_specs if s.name in ("scale", "scaling")]
    assert scale == ([] if pid == "072" else [pytest.approx(SMALL[pid].head_dim ** -0.5)])
    refs = prob.reference(*inputs)
    for spec, r, e in zip(prob.outputs, refs, autograd_backward(prob, inputs)):
        assert r.shape == spec.shape(SMALL_AXES[pid]), spec.name
        # grad_key_bias is zero in exact arithmetic: only rounding noise is left to compare.
        assert rel_err(r, e) < 1e-5 if e.abs().max() > 1e-3 else r.abs().max() < 1e-5, spec.name


@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_the_fused_path_refuses_other_sizes_by_name(pid):
    """The fused kernels are made for the benchmark operator's sizes: their plan refuses another config
    with a ValueError that names it (Problem.run and Problem.fused reach that plan, which the official
    Problem passes its own config)."""
    official = backfuse.problem(pid)
    config = _config_module(official)
    with pytest.raises(ValueError, match=rf"{pid} plan: the fused kernels take the benchmark operator's sizes "
                                         rf".*, not {type(SMALL[pid]).__name__}\("):
        config.plan(config.CONFIG, official.workloads[0].axes, 132, sizes=SMALL[pid])
    assert config.plan(config.CONFIG, official.workloads[0].axes, 132, sizes=official.config).sizes is official.config
    prob = type(official)(SMALL[pid])
    inputs = prob.make_inputs(SMALL_AXES[pid], seed=0, device=DEVICE)
    for call in (prob.fused, prob.run):
        with pytest.raises(ValueError, match=re.escape(repr(SMALL[pid]))):
            call(*inputs)


@pytest.mark.parametrize("config, words", [
    (Gemma3CoreConfig(window=5), "window 0"), (Gemma3CoreConfig(qk_norm=False), "with the QK norm"),
    (WanXattnConfig(qk_norm=True), "no q/k norm")])
def test_problems_refuse_configs_of_another_operator(config, words):
    """037's operator is causal over every earlier token with the QK norm, 021's has no q/k norm: a
    config with a window or without the norm (037), or with one (021), is not theirs to describe."""
    pid = "037" if isinstance(config, Gemma3CoreConfig) else "021"
    with pytest.raises(ValueError, match=words):
        type(backfuse.problem(pid))(config)
