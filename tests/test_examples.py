"""examples/train_tiny.py: every block trains on the fused path (no fp16 range warning) and its losses
follow the plain-PyTorch twin's; run as a user runs it, it prints what its
docstring says and refuses bad arguments in one line."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


@pytest.fixture(scope="module")
def train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pid", ["072", "021", "037"])
def test_train_tiny_stays_fused(train_tiny, pid, capsys):
    history = train_tiny.train(pid, steps=2)
    assert "fp16 range warnings: 0" in capsys.readouterr().out
    assert len(history) == 2 and history[1][1] < history[0][1]  # the twin's loss falls
    assert all(abs(ours - twin) <= 1e-4 * twin for ours, twin in history)


def _example(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it: it sets what it needs
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE.parents[1] / "src")] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=300)


def test_train_tiny_prints_what_its_docstring_says():
    r = _example("--steps", "1", "--blocks", "021")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("021_cross_attention_text_video_conditioning_backward: step, loss (backfuse), loss (plain PyTorch), "
                        "relative difference")
    step, ours, twin, diff = lines[1].split()
    assert step == "0" and abs(float(ours) - float(twin)) <= 1e-4 * float(twin) and float(diff) < 1e-4
    assert lines[2:] == ["  fp16 range warnings: 0"] and r.stderr == ""


@pytest.mark.parametrize("args, words", [(["--blocks", "72"], "argument --blocks: expected comma-separated problem ids "
                                          "from 072, 021, 037, got '72'"),
                                         (["--steps", "0"], "argument --steps: expected a whole number of steps >= 1")])
def test_train_tiny_refuses_bad_arguments(args, words):
    r = _example(*args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


FINETUNE = EXAMPLE.parent / "finetune_gemma3.py"


def test_finetune_example_trains_as_the_unpatched_model():
    """examples/finetune_gemma3.py as a user runs it (Trainer, DataCollatorWithFlattening, LoRA after patch,
    gradient checkpointing; bf16 on a GPU): every call on backfuse's kernels, every step's loss the unpatched
    model's."""
    pytest.importorskip("peft")
    spec = importlib.util.spec_from_file_location("finetune_gemma3", FINETUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ours, handed_back = module.train(steps=2, tokens=128)  # (packed batches of ~4 documents)
    theirs, _ = module.train(steps=2, tokens=128, patched=False)
    assert handed_back == {} and len(ours) == len(theirs) == 2
    tol = 2e-2 if module.DEVICE == "cuda" else 1e-3  # bf16 on a GPU, float32 (fp16 products) on a CPU
    assert all(abs(a - b) <= tol * b for a, b in zip(ours, theirs)), (ours, theirs)
    assert ours[-1] < ours[0]


def test_finetune_example_refuses_a_plot_without_the_comparison():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE.parents[1] / "src")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, str(FINETUNE), "--plot", "x.png"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 2 and "--plot draws both curves: add --compare" in r.stderr and "Traceback" not in r.stderr
