"""The training benches' own pieces on the CPU (the timing needs a GPU): `bench --dynamic`'s shapes and
steps, `bench --e2e`'s models, `bench --train`'s host floor and alternating groups."""

import functools

import pytest
import torch
from conftest import DEVICE

import backfuse
from backfuse.bench import dynamic, e2e, report, train
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.wan_xattn.spec import WanXattnConfig


def test_dynamic_shapes_are_fixed_by_the_seed_and_hold_the_extremes():
    for key in dynamic.ENTRIES:
        warm, loop = dynamic.shapes(key)
        assert (warm, loop) == dynamic.shapes(key) and len(loop) == dynamic.SHAPES and warm not in loop
        if key.endswith("/packed"):
            totals = [sum(docs) for docs in loop]
            assert {512, 4096} <= set(totals) and all(1 <= len(docs) <= 8 and min(docs) >= 1 for docs in loop)
        elif key.startswith("wan"):
            assert max(v for _, v, _ in loop) == 21 * dynamic.WAN_FRAME and all(1 <= t <= 512 for *_, t in loop)
        else:
            assert {(2, 512), (2, 4096)} <= set(loop) and all(512 <= s <= 4096 for _, s in loop)


@pytest.mark.parametrize("key", ["gemma3-4b", "gemma3-4b/packed", "wan2.1-1.3b"])
def test_dynamic_steps_of_backfuse_and_of_the_model_agree(key):
    """backfuse's step and the model's own (the reference the bench times against) give the same gradients at
    each of a few changing shapes (tiny sizes; packed documents: cu_seqlens against the block-diagonal mask; one
    text token: the video's gradient is 0 but for rounding, the text's is not)."""
    preset = backfuse.presets.get(key.split("/")[0])
    config = WanXattnConfig(64, 2, qk_norm=True) if key.startswith("wan") else Gemma3CoreConfig(64, 2, 1, 32)
    shapes = {"gemma3-4b": [(2, 37), (2, 20)], "gemma3-4b/packed": [(5, 12, 3), (20,)],
              "wan2.1-1.3b": [(1, 40, 7), (1, 24, 1)]}[key]
    cls = backfuse.nn.WanXattn if key.startswith("wan") else backfuse.nn.Gemma3Core
    module = cls(config, device=DEVICE, dtype=torch.bfloat16, **preset.kwargs)
    grads = {}
    for impl in ("backfuse", "eager"):
        calls = dynamic._make_calls(preset, config, key, shapes, DEVICE, 0)
        step = dynamic._stepper(preset, config, key, impl, module)
        for c in calls:
            step(c)
        grads[impl] = [torch.cat([a.grad.float().flatten() for a in c.acts if a.requires_grad]) for c in calls]
    for ours, theirs in zip(grads["backfuse"], grads["eager"]):
        assert (ours - theirs).norm() <= 2e-2 * theirs.norm()


def test_dynamic_rounds_take_the_median_second_pass_at_fresh_addresses(monkeypatch):
    """`run_entry` around the GPU-only loop (stand-ins here): the first pass is the first round's, the second pass
    and its host time the median over the rounds, the implementations' order turns round by round, each round
    makes the loop's 12 shapes anew, and every earlier round's calls are still held when a later round runs (no
    call meets addresses an earlier one had: nothing is recorded that a single round would not record)."""
    import weakref

    class Call:
        def __init__(self, shape):
            self.shape = shape

    made, order, alive = [], [], []
    figures = {"backfuse": [3.0, 1.0, 2.0, 9.0, 1.5], "eager": [4.0] * 5, "compile": [5.0, 6.0, 4.0, 5.0, 7.0]}
    loops = {impl: 0 for impl in dynamic.IMPLEMENTATIONS}

    def make_calls(preset, config, key, shape_list, device, seed):
        calls = [Call(s) for s in shape_list]
        made.append((list(shape_list), [weakref.ref(c) for c in calls]))
        return calls

    def stepper(preset, config, key, impl, module):
        return functools.partial(lambda impl, call: None, impl)

    def loop(step, calls):
        impl = step.args[0]
        loops[impl] += 1
        order.append(impl)
        alive.append(sum(ref() is not None for _, refs in made for ref in refs))
        n = loops[impl]  # first round: first pass (1), second pass (2); round r: passes 2r + 1, 2r + 2
        value = 100.0 + n if n % 2 else figures[impl][n // 2 - 1]
        return value, 10 * value

    monkeypatch.setattr(dynamic, "_make_calls", make_calls)
    monkeypatch.setattr(dynamic, "_stepper", stepper)
    monkeypatch.setattr(dynamic, "_loop", loop)
    monkeypatch.setattr(dynamic.graphs, "release", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    entry = dynamic.run_entry("gemma3-1b", "meta", rounds=5)
    assert entry["rounds"] == 5 and entry["shapes"] == [list(s) for s in dynamic.shapes("gemma3-1b")[1]]
    assert entry["backfuse_first_ms"] == 101.0 and entry["compile_first_ms"] == 101.0
    assert entry["backfuse_second_ms"] == 2.0 and entry["backfuse_host_us"] == 20.0
    assert entry["compile_second_ms"] == 5.0 and entry["eager_second_ms"] == 4.0
    assert entry["backfuse_second_rounds_ms"] == figures["backfuse"]
    impls = list(dynamic.IMPLEMENTATIONS)
    assert order[:6] == [i for i in impls for _ in (0, 1)]
    for r in range(1, 5):  # each later round: both passes of each implementation, the order turned by r
        turned = impls[r % 3:] + impls[:r % 3]
        assert order[6 * r:6 * r + 6] == [i for i in turned for _ in (0, 1)]
    loop = list(dynamic.shapes("gemma3-1b")[1])
    assert len(made) == 5 and made[0][0][1:] == loop and all(shapes == loop for shapes, _ in made[1:])
    assert alive[-1] == 1 + 12 * 5  # the warm-up call and all five rounds' calls, held to the last loop


def test_e2e_models_are_the_released_pattern():
    model = e2e.build("gemma3-1b", device="meta")
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert model.config.num_attention_heads == 4 and model.config.sliding_window == 512
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    two = e2e.build("gemma3-4b", layers=2, device="meta")
    assert two.config.layer_types == ["sliding_attention", "full_attention"]
    assert e2e.build("gemma2-9b", device="meta").config._attn_implementation == "eager"
    wan = e2e.build("wan2.1-1.3b", device="meta")
    assert len(wan.blocks) == 2 and wan.config.num_attention_heads == 12 and wan.config.ffn_dim == 8960
    inputs = e2e.batch("wan2.1-1.3b", e2e.TOKENS["wan2.1-1.3b"], device="cpu")
    frames, height, width = inputs["hidden_states"].shape[2:]
    assert frames * (height // 2) * (width // 2) == e2e.TOKENS["wan2.1-1.3b"][1] == 32760
    assert inputs["encoder_hidden_states"].shape == (1, 512, 4096)


def test_the_host_floor_takes_the_layers_tensors_and_gives_their_gradients():
    prob = backfuse.problem("021")
    layer = train.Layer(prob, prob.workloads[0].axes, "backfuse_bf16", DEVICE)
    floor = train.floor_of(layer)
    floor.step()
    assert all(leaf.grad is not None and leaf.grad.shape == leaf.shape for leaf in layer.leaves)


def test_alternating_groups_warm_each_layer_rotate_the_order_and_take_medians(monkeypatch):
    """`time_alternating`: every layer's warm-up steps first, then each round times one group of every layer
    (after its settling steps), the order rotated by one each round; each figure the median of the layer's
    groups."""

    class Counted(train.Steps):
        def __init__(self, name):
            self.name, self.stepped = name, 0

        def step(self):
            self.stepped += 1

    layers = {name: Counted(name) for name in ("a", "b", "c")}
    made = {"a": iter([5.0, 1.0, 3.0, 100.0, 2.0]), "b": iter([7.0] * 5), "c": iter([1.0, 2.0, 9.0, 9.0, 9.0])}
    order = []

    def timed(layer, *, warmup, steps):
        assert warmup == 2 and layer.stepped >= 4  # warmed before any group; settled in each
        order.append(layer.name)
        value = next(made[layer.name])
        return value, 10 * value

    monkeypatch.setattr(train, "time_steps", timed)
    got = train.time_alternating(layers, warmup=4, steps=20, groups=5, settle=2)
    assert order == list("abc" "bca" "cab" "abc" "bca")
    assert got == {"a": (3.0, 30.0), "b": (7.0, 70.0), "c": (9.0, 90.0)}
    assert all(layer.stepped == 4 for layer in layers.values())  # (the groups' steps: the stand-in's)


def test_a_train_case_and_a_models_entry_record_each_implementations_figures(monkeypatch):
    """`run_case` and `models.run_entry` around the GPU-only steps (stand-ins here): every implementation's ms, the
    host figures (backfuse's and the floor's, by the layer each belongs to), the peaks with backfuse's graph pools
    counted for backfuse's layers only, and the checks."""
    from types import SimpleNamespace

    from backfuse.bench import models

    class Stand(train.Steps):
        def __init__(self, impl):
            self.impl, self.by_name, self.leaves, self.grads = impl, {}, [], []

        def step(self):
            pass

    figures = {"backfuse_fp32": 4.0, "backfuse_bf16": 3.0, "eager_bf16": 6.0, "compile_bf16": 5.0, "floor": 0.5,
               "backfuse": 2.0, "hf_bf16": 8.0}
    peaks = []
    monkeypatch.setattr(train, "Layer", lambda prob, axes, impl, device: Stand(impl))
    monkeypatch.setattr(train, "floor_of", lambda layer: Stand("floor"))
    monkeypatch.setattr(train, "time_steps", lambda layer, *, warmup, steps: (figures[layer.impl], 100 * figures[layer.impl]))
    monkeypatch.setattr(train, "peak_mib", lambda layer, pools=False: peaks.append((layer.impl, pools)) or 10.0)
    monkeypatch.setattr(train, "sync_free", lambda layer: layer.impl.startswith("backfuse"))
    passed = SimpleNamespace(passed=True, reason="")
    monkeypatch.setattr(train, "check_fp32", lambda *a, **k: (passed, passed))
    prob = backfuse.problem("021")
    entry = train.run_case(prob, 0, "cpu", warmup=2, steps=3, groups=3)
    assert {k: entry[k] for k in ("backfuse_fp32_ms", "backfuse_bf16_ms", "eager_bf16_ms", "compile_bf16_ms")} == {
        "backfuse_fp32_ms": 4.0, "backfuse_bf16_ms": 3.0, "eager_bf16_ms": 6.0, "compile_bf16_ms": 5.0}
    assert (entry["host_us"], entry["host_bf16_us"], entry["host_floor_us"]) == (400.0, 300.0, 50.0)
    assert entry["sync_free"] and entry["fp32_forward_passed"] and entry["fp32_backward_passed"]
    assert sorted(peaks) == [("backfuse_bf16", True), ("backfuse_fp32", True), ("eager_bf16", False)]
    peaks.clear()
    monkeypatch.setattr(models, "ModelLayer", lambda preset, local, tokens, impl, device: Stand(impl))
    monkeypatch.setattr(models, "peak_mib", train.peak_mib)  # (the stand-in above)
    monkeypatch.setattr(models.graphs, "release", lambda: None)
    monkeypatch.setattr(models.torch.cuda, "empty_cache", lambda: None)
    entry = models.run_entry(None, False, (1, 64), "cpu", warmup=1, steps=2, groups=3)
    assert entry == {"backfuse_ms": 2.0, "hf_bf16_ms": 8.0, "compile_bf16_ms": 5.0, "backfuse_peak_mib": 10.0,
                     "hf_bf16_peak_mib": 10.0, "host_us": 200.0}
    assert sorted(peaks) == [("backfuse", True), ("hf_bf16", False)]


@pytest.mark.skipif(DEVICE != "cuda", reason="`bench --train` times steps on a GPU")
def test_a_train_case_runs_on_the_gpu():
    """`run_case` itself at 021's smallest official case, two groups of two steps: every figure recorded, the
    checks passed, no step synchronizing."""
    prob = backfuse.problem("021")
    entry = train.run_case(prob, 8, "cuda", warmup=2, steps=2, groups=2)
    assert all(entry[f"{impl}_ms"] > 0 for impl in train.IMPLEMENTATIONS)
    assert all(entry[k] > 0 for k in ("host_us", "host_bf16_us", "host_floor_us", "peak_mib", "eager_bf16_peak_mib"))
    assert entry["sync_free"] and entry["fp32_forward_passed"] and entry["fp32_backward_passed"]


def test_e2e_leaves_liger_out_where_it_has_no_patch_or_is_not_installed(monkeypatch):
    import importlib.util

    assert e2e.run_entry("wan2.1-1.3b", e2e.TOKENS["wan2.1-1.3b"], variants=("liger", "liger_patched")) == {
        "liger_ms": None, "liger_patched_ms": None, "loss": None}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert e2e.run_entry("gemma3-1b", (1, 8), variants=("liger",)) == {"liger_ms": None, "loss": None}


def test_e2e_keeps_each_variant_as_it_is_measured_and_flags_another_first_loss(monkeypatch):
    losses = {"hf": 10.4, "compile": 10.41, "patched": 11.9}
    monkeypatch.setattr(e2e, "run_variant", lambda name, which, tokens, **kw: dict(
        ms=1.0, host_ms=0.5, peak_mib=7.0, loss=losses[which], fallbacks=0))
    seen = []
    entry = e2e.run_entry("gemma3-1b", (1, 8), variants=("hf", "compile", "patched"), progress=lambda e: seen.append(dict(e)))
    assert [sorted(k for k in e if k.endswith("_ms") and not k.endswith("host_ms")) for e in seen] == [
        ["hf_ms"], ["compile_ms", "hf_ms"], ["compile_ms", "hf_ms", "patched_ms"]]
    assert all(e["loss"] == 10.4 for e in seen) and seen[-1] == entry
    assert entry["compile_ms"] == 1.0 and entry["patched_ms"] is None and entry["patched_wrong"] == 11.9


@pytest.mark.skipif(DEVICE == "cuda", reason="the smoke run is the CPU's; the GPU runs the released widths in `bench --e2e`")
def test_e2e_runs_each_family_end_to_end_at_a_tiny_width(monkeypatch):
    """`bench --e2e`'s whole path (transformers' and diffusers' classes built in the released pattern, the batch,
    the loss, patched and not, the first losses compared) on the CPU at tiny widths: what the device's run would
    meet first. Gemma 3 at three layers: `e2e.build`'s pattern cut short (two sliding-window layers, the second
    served as the first was, and the global one), not the released period's six (five sliding)."""
    pytest.importorskip("diffusers")
    monkeypatch.setattr(e2e, "VOCAB", 96)
    monkeypatch.setitem(e2e.MODELS, "tiny-gemma3", ("gemma3", 32, 64, 2, 1, 16, 16, 4))
    monkeypatch.setitem(e2e.MODELS, "tiny-gemma2", ("gemma2", 32, 64, 2, 1, 16, 16, 4))
    monkeypatch.setitem(e2e.WAN, "tiny-wan", (1, 4, 32))
    monkeypatch.setattr(e2e, "WAN_LATENTS", (2, 4, 4))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))  # (no C++ build here)
    variants = ("hf", "compile", "patched", "patched_compile")
    for name, tokens, layers in (("tiny-gemma3", (2, 9), 3), ("tiny-gemma2", (1, 11), 2), ("tiny-wan", (1, 8, 5), 1)):
        entry = e2e.run_entry(name, tokens, layers=layers, variants=variants, warmup=1, steps=1, device="cpu")
        assert all(entry[f"{v}_ms"] is not None for v in variants), entry
        assert not any(k.endswith(("_wrong", "_error", "_fallbacks")) for k in entry), entry
        assert entry["patched_peak_mib"] is None  # (no peak off a GPU)


@pytest.mark.skipif(DEVICE == "cuda", reason="the smoke run is the CPU's")
def test_e2e_lora_steps_train_the_adapters_alone(monkeypatch):
    """`bench --e2e --lora`: PEFT adapters on every linear layer after the patch, the rest frozen; the patched Gemma
    and Wan serve their attentions with them (the projections through `lora.project` around `gemma3_attention`,
    `wan_attention`), at the model's first loss, nothing handed back."""
    pytest.importorskip("peft")
    pytest.importorskip("diffusers")
    monkeypatch.setattr(e2e, "VOCAB", 96)
    monkeypatch.setitem(e2e.MODELS, "tiny-gemma3", ("gemma3", 32, 64, 2, 1, 16, 16, 4))
    monkeypatch.setitem(e2e.WAN, "tiny-wan", (1, 4, 32))
    monkeypatch.setattr(e2e, "WAN_LATENTS", (2, 4, 4))
    model, _ = e2e.variant("tiny-gemma3", "patched", 2, "cpu", lora=4)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained) and any("q_proj" in n for n in trained)
    gemma = e2e.run_entry("tiny-gemma3", (2, 9), layers=2, variants=("hf", "patched"), warmup=1, steps=1, lora=4,
                          device="cpu")
    wan = e2e.run_entry("tiny-wan", (1, 8, 5), layers=1, variants=("hf", "patched"), warmup=1, steps=1, lora=4,
                        device="cpu")
    assert gemma["patched_ms"] is not None and not any(k.endswith(("_wrong", "_fallbacks")) for k in gemma), gemma
    assert wan["patched_ms"] is not None and not any(k.endswith(("_wrong", "_fallbacks")) for k in wan), wan


def test_e2e_records_a_failing_variant_and_runs_the_next(monkeypatch):
    def run(name, which, tokens, **kw):
        if which == "compile":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return dict(ms=1.0, host_ms=0.5, peak_mib=7.0, loss=10.4, fallbacks=0)

    monkeypatch.setattr(e2e, "run_variant", run)
    entry = e2e.run_entry("gemma3-1b", (1, 8), variants=("hf", "compile", "patched"))
    assert entry["compile_ms"] is None and entry["compile_error"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert entry["hf_ms"] == entry["patched_ms"] == 1.0
    assert "| failed |" in report.e2e_table({"gemma3-1b/1x8": entry})


@pytest.mark.parametrize("kernel, kind", [
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "products"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "products"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "products"),
    ("triton_tem_fused_addmm_3", "products"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("attention_backward_kernel", "attention"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_0", "rest"),
    ("triton_per_fused_add_mean_mul_pow_rsqrt_5", "rest"),
    ("norm_rope_kernel", "rest"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "rest"),
])
def test_e2e_splits_kernels_by_what_they_compute(kernel, kind):
    assert e2e.kind_of(kernel) == kind



def test_e2e_kernel_split_sums_and_names_each_kind(monkeypatch):
    """The split from a profile's kernels (a stand-in profiler on any machine): each kind's time a step, its costliest
    kernels first and at most TOP of them (names cut to 80 characters), the CPU's events left out."""
    import types

    import torch.profiler

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    long_name = "nvjet_tst_" + "x" * 100
    kernels = ([(f"triton_poi_fused_{i}", 10.0 * (i + 1)) for i in range(7)] + [(long_name, 400.0), ("nvjet_small", 40.0)]
               + [("attention_backward_kernel", 300.0), ("elsewhere", 9999.0)])

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [types.SimpleNamespace(name=n, device_time_total=us, device_type=cpu if n == "elsewhere" else cuda)
                    for n, us in kernels]

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    split = e2e.kernel_split(lambda: None, steps=2)
    assert split["products_ms"] == 0.22 and split["attention_ms"] == 0.15 and split["rest_ms"] == 0.14
    assert split["products_top"] == [[long_name[:80], 0.2], ["nvjet_small", 0.02]]
    assert split["attention_top"] == [["attention_backward_kernel", 0.15]]
    assert [n for n, _ in split["rest_top"]] == [f"triton_poi_fused_{i}" for i in (6, 5, 4, 3, 2)]
    assert split["kernels"] == 5


@pytest.mark.skipif(DEVICE != "cuda", reason="the profiler's kernels exist on a GPU")
def test_e2e_kernel_split_finds_a_steps_products_and_attention():
    a = torch.randn(256, 256, device=DEVICE, requires_grad=True)
    q = torch.randn(1, 2, 128, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)

    def step():
        (a @ a).sum().backward()
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()

    split = e2e.kernel_split(step, steps=2)
    assert split["products_ms"] > 0 and split["attention_ms"] > 0 and split["rest_ms"] > 0 and split["kernels"] >= 4
    for kind in e2e.KINDS:  # each kind's costliest kernels, named, adding up to at most the kind's time
        top = split[f"{kind}_top"]
        assert 1 <= len(top) <= e2e.TOP and all(len(name) <= 80 for name, _ in top)
        assert sum(ms for _, ms in top) <= split[f"{kind}_ms"] + 1e-3 * len(top)
