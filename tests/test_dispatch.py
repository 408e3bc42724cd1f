"""How a call reaches the fused kernels: specs, configs and plans import no Triton; on the CPU the
Triton interpreter or the reference; the deterministic flag; the launcher's Triton-version fallback."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import check_fused

import backfuse
from backfuse.kernels import launch
from backfuse.ops.qkv_gqa import backward as qkv_gqa_backward


def _fresh_python(code, env=None):
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=env or dict(os.environ))


def test_specs_configs_and_plans_import_no_triton():
    """What describes an operator (spec), its launch shapes and plans (config), the harness and the
    training API import no Triton: only a fused call does (`Problem.fused`)."""
    _fresh_python(
        "import sys\n"
        "import backfuse, backfuse.problem, backfuse.functional, backfuse.nn, backfuse.bench, backfuse.cli\n"
        "from backfuse.ops.qkv_gqa import config as a, spec\n"
        "from backfuse.ops.gemma3_core import config as b, spec\n"
        "from backfuse.ops.wan_xattn import config as c, spec\n"
        "a.plan(a.CONFIG, backfuse.problem('072').workloads[0].axes, 132)\n"
        "b.plan(b.CONFIG, backfuse.problem('037').workloads[0].axes, 132)\n"
        "c.plan(c.CONFIG, backfuse.problem('021').workloads[0].axes, 132)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n")


def test_the_operator_layer_reaches_no_layer_above_it():
    """problem.py dispatches `Problem.backward` to the training module beside each spec (as `fused` to its backward
    module): the operators' layer never imports the user-facing training API (`backfuse.functional`), which imports
    it."""
    import ast
    import sys

    tree = ast.parse(open(sys.modules["backfuse.problem"].__file__).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert "functional" not in imported and not any("functional" in (n.module or "") for n in ast.walk(tree)
                                                      if isinstance(n, ast.ImportFrom)), imported
    _fresh_python(
        "import sys, torch, backfuse\n"
        "p = backfuse.problem('021')\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "x = p.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=0, device=device)\n"
        "assert all(g is not None for g in p.backward(*x))\n"
        "assert 'backfuse.functional' not in sys.modules\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_on_a_cpu_importing_backfuse_turns_the_interpreter_on():
    """The README's snippets as written on a machine without a GPU: importing backfuse first turns the Triton
    interpreter on, and the kernels run (not the reference)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _fresh_python(
        "import os, sys, torch, backfuse\n"
        "assert os.environ['TRITON_INTERPRET'] == '1' and 'triton' not in sys.modules\n"
        "p = backfuse.problem('072')\n"
        "x = p.make_inputs(dict(batch_size=1, seq_len_dec=3, seq_len_enc=2), seed=0)\n"
        "assert not all(torch.equal(a, b) for a, b in zip(p.run(*x), p.reference(*x)))  # the kernels' fp16 products\n",
        env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_on_a_cpu_without_the_interpreter_backfuse_says_what_to_set():
    """TRITON_INTERPRET=0 (the user's choice, respected): `run` is the reference, with one warning; triton imported
    before backfuse (transformers does it): the training ops refuse in one line, a patched model runs its own
    code with a warning; never a raw Triton error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _fresh_python(
        "import os, sys, warnings, torch\n"
        "os.environ['TRITON_INTERPRET'] = '0'\n"
        "import backfuse\n"
        "p = backfuse.problem('072')\n"
        "x = p.make_inputs(dict(batch_size=1, seq_len_dec=3, seq_len_enc=2), seed=0)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    assert all(torch.equal(a, b) for a, b in zip(p.run(*x), p.reference(*x)))\n"
        "assert len(w) == 1 and 'TRITON_INTERPRET=1' in str(w[0].message) and 'fp32 reference' in str(w[0].message)\n",
        env)
    _fresh_python(
        "import sys, warnings, torch, triton, transformers\n"
        "import backfuse\n"
        "from backfuse import nn as bnn\n"
        "m = bnn.WanXattn()\n"
        "try:\n"
        "    m(torch.randn(1, 3, 1024), torch.randn(1, 2, 1024))\n"
        "except RuntimeError as e:\n"
        "    assert str(e).startswith('backfuse.functional.wan_xattn: on CPU tensors the fused kernels run only in the "
        "Triton interpreter'), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "config = transformers.Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,\n"
        "    num_attention_heads=2, num_key_value_heads=1, head_dim=16, layer_types=['full_attention'])\n"
        "model = transformers.Gemma3ForCausalLM(config)\n"
        "backfuse.patch(model, quiet=True)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()\n"
        "assert any(\"backfuse's kernels cannot run here\" in str(x.message) for x in w), [str(x.message) for x in w]\n",
        env)


@pytest.mark.parametrize("name", ["072", "037", "021"])
def test_every_fused_path_has_one_interface_and_one_driver(name, monkeypatch):
    """Each operator's launcher is a `FusedPath` whose `backward` is the shared driver, and that
    driver sends a call whose element counts pass int32 to the fp32 reference (here with the limit
    lowered, so that a small call crosses it), without planning or launching anything."""
    import importlib

    from backfuse.ops import fused

    prob = backfuse.problem(name)
    module = importlib.import_module(type(prob).__module__.rpartition(".")[0] + ".backward")
    path = module.backward.__self__
    assert isinstance(path, fused.FusedPath) and module.backward.__func__ is fused.FusedPath.backward
    assert path.problem is prob
    x = prob.make_inputs(SMALL[name], seed=0, device=DEVICE)
    monkeypatch.setattr(fused, "INT32_ELEMENTS", min(path.indexed(x)))
    monkeypatch.setattr(path, "plan", lambda *a, **k: pytest.fail("planned past the int32 limit"))
    sentinel = (torch.zeros(1),)
    monkeypatch.setattr(prob, "fp32_backward", lambda *inputs: sentinel)
    assert prob.fused(*x) is sentinel


def test_a_plan_is_made_once_per_shape_and_options(monkeypatch):
    """The driver keeps plans (pure functions of config, host, shapes and options): calls at fresh
    inputs of one shape plan once; another option, SM count or shape plans anew."""
    import collections
    import importlib

    from backfuse.ops import fused

    prob = backfuse.problem("021")
    path = importlib.import_module("backfuse.ops.wan_xattn.backward").backward.__self__
    made, real = [], path.plan
    monkeypatch.setattr(path, "plan", lambda *a, **k: made.append(k) or real(*a, **k))
    monkeypatch.setattr(fused, "_plans", collections.OrderedDict())
    if DEVICE != "cuda":  # the plans are what is counted: each launch prepared as planned, its programs not run
        from backfuse.kernels.launch import FastKernel

        prepare = FastKernel.prepare
        monkeypatch.setattr(FastKernel, "prepare", lambda self, grid, *a, **meta: prepare(self, grid, *a, **meta) and (
            lambda: None))
    other = dict(batch_size=1, num_video_tokens=3, num_text_tokens=2)
    for seed, axes, options, planned in [(0, SMALL["021"], {}, 1), (1, SMALL["021"], {}, 1),
                                         (2, SMALL["021"], dict(deterministic=True), 2), (3, SMALL["021"], dict(sms=7), 3),
                                         (4, other, {}, 4), (5, SMALL["021"], {}, 4)]:
        x = prob.make_inputs(axes, seed=seed, device=DEVICE)
        outs = prob.fused(*x, **options)
        assert len(made) == planned and len(outs) == len(prob.output_names)


@pytest.mark.parametrize("name,products", [("072", "triton"), ("072", "cublas"), ("072", "gluon"), ("037", "triton"),
                                           ("037", "cublas"), ("021", "triton"), ("021", "cublas")])
def test_every_gpu_launch_finds_its_arguments_by_name(name, products, monkeypatch):
    """Each launch of each path as planned for an H200 (132 SMs, Gluon on) gets every runtime argument
    of its kernel by name from the plan, the inputs and the buffers (prepare_named refuses a missing
    or unknown one); nothing is launched (the paths the CPU cannot run: Gluon, cuBLAS, GPU tiles)."""
    import importlib

    from backfuse.fp16_guard import RangeSlots
    from backfuse.kernels.launch import FastKernel
    from backfuse.ops.fused import FusedCall, Host

    prepared = []
    monkeypatch.setattr(FastKernel, "prepare", lambda self, grid, *args, **meta: prepared.append(len(args)))
    prob = backfuse.problem(name)
    path = importlib.import_module(type(prob).__module__.rpartition(".")[0] + ".backward").backward.__self__
    x = prob.make_inputs(MID[name], seed=0, device="cpu")
    host = Host(torch.device("cpu"), sms=132)
    host.gpu = host.gluon = True
    for deterministic in (False, True):
        p = path.plan(path.configs[0], x, host, products=products, needs=None, deterministic=deterministic)
        ranges = RangeSlots()
        call = FusedCall(host, path.configs[0], p, ranges, tuple(r.reserve(ranges) for r in p.ranges))
        ranges.allocate(host.device)
        path.launches(call, x, path.allocate(call, x))
    assert prepared and all(n > 0 for n in prepared)


MID = {"072": dict(batch_size=2, seq_len_dec=300, seq_len_enc=200), "037": dict(batch_size=2, seq_len=300),
       "021": dict(batch_size=2, num_video_tokens=300, num_text_tokens=77)}


SMALL = {"072": dict(batch_size=1, seq_len_dec=2, seq_len_enc=3),
         "037": dict(batch_size=1, seq_len=3),
         "021": dict(batch_size=1, num_video_tokens=2, num_text_tokens=3)}


def test_deterministic_algorithms_flag_reaches_the_kernels(monkeypatch):
    prob = backfuse.problem("072")
    seen = {}
    monkeypatch.setattr(qkv_gqa_backward, "backward", lambda *x, **kw: seen.update(kw) or prob.reference(*x))
    x = prob.make_inputs(dict(batch_size=1, seq_len_dec=2, seq_len_enc=2), seed=0, device=DEVICE)
    torch.use_deterministic_algorithms(True)
    try:
        prob.run(*x)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen.get("deterministic") is True


def test_supported_triton_versions():
    assert launch.triton_supported("3.6.0") and launch.triton_supported("3.6.1+git0123abc")
    assert not any(launch.triton_supported(v) for v in ("3.5.1", "3.7.0", "3.8.0", "4.0.0", "nightly"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.fast_launch_available("3.6.0")
    with pytest.warns(RuntimeWarning, match="outside the supported range >=3.6,<3.7"):
        assert not launch.fast_launch_available("3.8.0")


def test_unsupported_triton_launches_through_the_jit(monkeypatch):
    """Outside the supported range FastKernel launches through `kernel[grid](...)`: still correct
    (on the GPU this is the JIT path with its scratch allocator; on the CPU the interpreter's)."""
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    check_fused(backfuse.problem("021"), dict(batch_size=1, num_video_tokens=9, num_text_tokens=5), seed=1)


def test_launch_handles_are_specific_to_descriptor_blocks():
    """A prepared launch reuses a compiled handle only for the same constexprs, tensor dtypes and
    alignments, and TMA descriptor blocks (a Gluon kernel takes its tile shapes from them)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from backfuse.kernels.launch import specialization

    t = torch.zeros(256, 256, dtype=torch.float16)

    def desc(block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.float16))

    base = specialization((desc([64, 128]), t, 7), dict(STAGES=4))
    assert base == specialization((desc([64, 128]), t, 9), dict(STAGES=4))  # unspecialized ints
    assert base != specialization((desc([64, 256]), t, 7), dict(STAGES=4))
    assert base != specialization((desc([64, 128]), t.float(), 7), dict(STAGES=4))
    assert base != specialization((desc([64, 128]), t[:, 1:], 7), dict(STAGES=4))  # misaligned
    assert base != specialization((desc([64, 128]), t, 7), dict(STAGES=3))


@pytest.mark.parametrize("setup, words", [
    (lambda m: m.setenv("TRITON_INTERPRET", "0"), "on CPU tensors the fused kernels run only in the Triton interpreter"),
    (lambda m: m.setattr("numpy.__version__", "2.4.6"), "the Triton interpreter (TRITON_INTERPRET=1) fails on numpy "
                                                        "2.4.6; it needs numpy < 2.4"),
])
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_fused_says_in_one_line_why_it_cannot_run(monkeypatch, setup, words):
    """Instead of triton's `0 active drivers` or an InterpreterError from deep inside numpy."""
    prob = backfuse.problem("021")
    x = prob.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=0)
    setup(monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        prob.fused(*x)
    assert str(caught.value).startswith(f"{prob.name}.fused: {words}") and "\n" not in str(caught.value)


def test_fused_on_tensors_no_kernel_runs_on():
    prob = backfuse.problem("021")
    x = [t.to("meta") if isinstance(t, torch.Tensor) else t
         for t in prob.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=0)]
    with pytest.raises(RuntimeError, match=r"fused: the fused kernels run on CUDA tensors, or on CPU tensors in the "
                                           r"Triton interpreter, not on meta$"):
        prob.fused(*x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_fused_after_triton_was_imported_without_the_interpreter():
    code = ("import os, torch, triton, backfuse\n"
            "os.environ['TRITON_INTERPRET'] = '1'  # too late: triton's standard library is compiled already\n"
            "p = backfuse.problem('021')\n"
            "x = p.make_inputs(dict(batch_size=1, num_video_tokens=3, num_text_tokens=2), seed=0)\n"
            "try:\n"
            "    p.fused(*x)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env).stdout
    assert out.startswith(f"{backfuse.problem('021').name}.fused: triton was imported before TRITON_INTERPRET=1 was set")


def test_named_launch_arguments():
    """prepare_named: runtime arguments by the kernel's parameter names, from dicts and objects (first
    match wins); a dict key that names no parameter, a missing argument, or a runtime parameter after
    a constexpr is refused with the names."""
    import types

    import triton
    import triton.language as tl

    from backfuse.kernels.launch import FastKernel

    @triton.jit(do_not_specialize=["n"])
    def add_one(x, out, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)

    kernel = FastKernel(add_one)
    x = torch.arange(5, dtype=torch.float32, device=DEVICE)
    out = torch.zeros_like(x)
    kernel.prepare_named((1,), dict(out=out, n=5, x=x), BLOCK=8)()
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    out.zero_()
    buffers = types.SimpleNamespace(x=x, out=out, unrelated=1)  # objects may hold more
    kernel.prepare_named((1,), dict(n=3), buffers, dict(n=5), BLOCK=8)()
    assert out.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0]
    with pytest.raises(TypeError, match=r"unknown arguments \['y'\]"):
        kernel.prepare_named((1,), dict(x=x, out=out, y=1), BLOCK=8)
    with pytest.raises(TypeError, match=r"missing arguments \['n'\]"):
        kernel.prepare_named((1,), buffers, BLOCK=8)
    with pytest.raises(TypeError, match=r"missing arguments \['BLOCK'\]"):
        kernel.prepare_named((1,), dict(x=x, out=out, n=5))


def test_programs_per_sm():
    """CUDA's occupancy limits on an H200's SM (2048 threads, 64 K registers, 228 KB of shared
    memory): registers allocated per warp in units of 256, 1 KB of shared memory reserved per block."""
    from backfuse.kernels.launch import SMLimits

    sm = SMLimits(threads=2048, registers=65536, shared_bytes=233472)
    assert sm.programs_per_sm(warps=4, registers=255, shared_bytes=0) == 2  # 255 -> 256 a thread
    assert sm.programs_per_sm(warps=4, registers=32, shared_bytes=0) == 16  # by threads
    assert sm.programs_per_sm(warps=1, registers=16, shared_bytes=0) == 32  # the block limit
    assert sm.programs_per_sm(warps=8, registers=128, shared_bytes=110 * 1024) == 2  # registers and shared memory
    assert sm.programs_per_sm(warps=8, registers=128, shared_bytes=113 * 1024) == 2  # 2 x (113 + 1) KB = 228 KB
    assert sm.programs_per_sm(warps=8, registers=128, shared_bytes=114 * 1024) == 1
    assert sm.programs_per_sm(warps=16, registers=144, shared_bytes=0) == 0  # 16 x 144 x 32 > 64 K
