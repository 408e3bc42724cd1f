"""backfuse.presets: released models' attention blocks. Their modules build at full size (on the meta
device, so nothing is allocated), with the parameter shapes the published checkpoints hold; every
preset's training plan is one the GPU kernels take (head size, tiles, split) at a real sequence length;
and every preset's layer, at its full width, trains on the fused path as float64 computes it (on a
GPU at the models' token counts, past the sliding window; in the interpreter at a few tokens).
"""

import pytest
import torch
from conftest import DEVICE
from helpers import check_training_step, rel_err, run_cli, training_float64, training_inputs, training_module

from backfuse import nn as bnn
from backfuse import presets
from backfuse.bench import models
from backfuse.ops.gemma3_core import training as gemma_training
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.qkv_gqa import training as qkv_training
from backfuse.ops.qkv_gqa.spec import QkvGqaConfig
from backfuse.ops.wan_xattn import training as wan_training
from backfuse.ops.wan_xattn.spec import WanXattnConfig

MODULES = {"037": bnn.Gemma3Core, "021": bnn.WanXattn, "072": bnn.QkvGqa}
# Checkpoint tensor shapes (rows, columns) as the models publish them, written out here rather than derived
# from the presets: q, k projections of one attention layer.
PUBLISHED = {"gemma3-1b": ((1024, 1152), (256, 1152)), "gemma3-4b": ((2048, 2560), (1024, 2560)),
             "gemma3-27b": ((4096, 5376), (2048, 5376)), "gemma2-9b": ((4096, 3584), (2048, 3584)),
             "wan2.1-1.3b": ((1536, 1536), (1536, 1536)), "wan2.1-14b": ((5120, 5120), (5120, 5120)),
             "llama3.2-vision-11b": ((4096, 4096), (1024, 4096))}


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_builds_at_full_size(name):
    preset = presets.get(name)
    cls = MODULES[preset.problem]
    layers = [cls.from_preset(name, device="meta")]
    if preset.local is not None:
        layers.append(cls.from_preset(name, local=True, device="meta"))
        assert layers[1].config.window > 0 and layers[0].config.window == 0
    params = dict(layers[0].named_parameters())
    q, k = (params[n].shape for n in (("q_weight", "k_weight") if preset.problem != "021" else ("query_weight", "key_weight")))
    if name in PUBLISHED:
        assert (tuple(q), tuple(k)) == PUBLISHED[name]
    assert all(p.device.type == "meta" for layer in layers for p in layer.parameters())


def test_preset_scalars_reach_the_module():
    gemma2 = bnn.Gemma3Core.from_preset("gemma2-27b", device="meta")
    assert gemma2.softcap == 50.0 and gemma2.scaling == pytest.approx(144 ** -0.5) and not gemma2.config.qk_norm
    gemma3 = bnn.Gemma3Core.from_preset("gemma3-27b", local=True, device="meta", eps=1e-5)
    assert gemma3.softcap is None and gemma3.scaling == pytest.approx(168 ** -0.5) and gemma3.eps == 1e-5
    assert gemma3.config.window == 1024 and gemma3.config.qk_norm


def test_preset_errors_name_the_problem():
    with pytest.raises(ValueError, match="no preset 'gemma4'.*gemma3-1b"):
        presets.get("gemma4")
    with pytest.raises(ValueError, match="WanXattnConfig, not a Gemma3CoreConfig"):
        bnn.Gemma3Core.from_preset("wan2.1-14b", device="meta")
    with pytest.raises(ValueError, match="no sliding-window layers"):
        bnn.WanXattn.from_preset("wan2.1-14b", local=True, device="meta")


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_plans_fit_the_gpu_kernels(name):
    preset = presets.get(name)
    for config in filter(None, (preset.config, preset.local)):
        for io in (torch.bfloat16, torch.float32):
            if preset.problem == "072":  # projections and head-group sums only: no attention tiles
                plan = qkv_training.Plan(1, 4096, 1601, config, io, sms=132)
                assert plan.activations.nbytes > 0
                continue
            if preset.problem == "037":
                plan = gemma_training.Plan(1, 8192, config, io, softcap=preset.kwargs["softcap"] or 0.0, sms=132)
            else:
                plan = wan_training.Plan(2, 32760, 512, config, io, sms=132)
            assert plan.tiles.bm > 0 and plan.split >= 1 and plan.activations.nbytes > 0


# Tokens of one call, two per operator on a GPU (`bench --models`' counts): (batch, sequence) for Gemma, (batch,
# video, text) for Wan, (batch, decoder, encoder) for Llama 3.2 Vision's cross-attention (a 560-pixel tile's 1601
# vision tokens).
TOKENS = {"037": ((1, 4096), (8, 1024)), "021": ((1, 4680, 512), (1, 32760, 512)),
          "072": ((1, 4096, 1601), (4, 1024, 1601))} if DEVICE == "cuda" else {
    "037": ((1, 6),), "021": ((1, 5, 3),), "072": ((1, 3, 5),)}


@pytest.mark.parametrize("count", [0, 1], ids=["tokens0", "tokens1"])
@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_layers_train_as_float64_computes_them(name, local, count):
    """bfloat16, as these models train: output and every gradient within bf16's rounding of float64, at each
    of the operator's token counts (on a GPU every preset's block, global and sliding, forward and backward:
    a kernel change that breaks one shows here)."""
    preset = presets.get(name)
    config = preset.local if local else preset.config
    if config is None:
        pytest.skip(f"{name} has no sliding-window layers")
    if local and DEVICE != "cuda":
        pytest.skip("in the interpreter the few tokens are all inside the window: the global layer's test")
    if count >= len(TOKENS[preset.problem]):
        pytest.skip("one token count in the interpreter")
    torch.manual_seed(0)
    scalars = dict(preset.kwargs)
    softcap = scalars.pop("softcap", None)
    m = training_module(preset.problem, config, torch.bfloat16, softcap, **scalars)
    check_training_step(preset.problem, m, training_inputs(preset.problem, config, TOKENS[preset.problem][count],
                                                           torch.bfloat16), 3e-2)


@pytest.mark.parametrize("pid, config, softcap, sizes", [
    ("037", Gemma3CoreConfig(64, 4, 2, 16, window=5), None, (2, 9)),                # Gemma 3: QK norm, window mask
    ("037", Gemma3CoreConfig(64, 4, 2, 16, window=0), None, (1, 7)),                # Gemma 3's global layers: causal
    ("037", Gemma3CoreConfig(64, 4, 2, 16, window=4, qk_norm=False), 30.0, (2, 9)),  # Gemma 2: eager, soft cap
    ("021", WanXattnConfig(64, 4, qk_norm=True), None, (2, 7, 5)),
    ("072", QkvGqaConfig(48, 32, 4, 2, 16), None, (2, 5, 3)),
], ids=["gemma3-local", "gemma3-global", "gemma2", "wan", "llama-vision"])
def test_bench_models_baselines_compute_the_same_function(pid, config, softcap, sizes):
    """`bench --models` times the model's own attention code (written in bench/models.py): in float64 it
    is the function backfuse's op computes (the float64 computation the op is tested against)."""
    torch.manual_seed(5)
    m = training_module(pid, config, torch.float32, softcap, device="cpu").double()
    acts = training_inputs(pid, config, sizes, torch.float64, device="cpu")
    preset = presets.Preset("test", pid, config)
    ours = models.model_function(preset, config, m)(*acts, *m.parameters())
    expected, _, _ = training_float64(pid, m, acts)
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), expected if isinstance(expected, tuple) else (expected,)):
        assert rel_err(a, b) < 1e-6  # (Gemma 2's eager softmax runs in float32, as transformers' does)


def test_bench_models_refuses_what_it_cannot_run():
    r = run_cli("bench", "--models", "gemma4")
    assert r.returncode == 2 and "--models: no preset 'gemma4'; there are gemma3-1b" in r.stderr
    r = run_cli("bench", "--models", "gemma3-4b", "--cases", "0")
    assert r.returncode == 2 and "--models runs its own selection" in r.stderr
