"""examples/train_tiny.py: every block trains on the fused path (no fp32 fallback: its warning fails
the test) and its losses follow the plain-PyTorch twin's."""

import importlib.util
import pathlib

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
    assert "fp32 fallbacks: 0" in capsys.readouterr().out
    assert len(history) == 2 and history[1][1] < history[0][1]  # the twin's loss falls
    assert all(abs(ours - twin) <= 1e-4 * twin for ours, twin in history)
