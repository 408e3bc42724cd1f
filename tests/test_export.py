"""SOL-ExecBench solution packages, loaded the way the evaluator loads them."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE
from helpers import assert_official_pass

import backfuse
from backfuse.cli import main
from backfuse.export import ENTRY_FILE, PACKAGE

# Runs in a fresh interpreter with the installed backfuse made unimportable: the package must
# stand on its own sources.
LOADER = """
import importlib.util, sys, torch
sys.modules["backfuse"] = None
spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
inputs = torch.load(sys.argv[2])
torch.save(list(module.run(*inputs)), sys.argv[3])
"""


@pytest.mark.parametrize("pid, axes", [
    ("072", dict(batch_size=1, seq_len_dec=5, seq_len_enc=3)),
    ("021", dict(batch_size=1, num_video_tokens=5, num_text_tokens=3)),
    ("037", dict(batch_size=1, seq_len=5)),
])
def test_exported_solution_runs_standalone(tmp_path, pid, axes):
    out_json = tmp_path / "solution.json"
    assert main(["export", pid, "-o", str(out_json)]) == 0
    doc = json.loads(out_json.read_text())
    prob = backfuse.problem(pid)
    assert doc["definition"] == prob.name
    assert doc["spec"]["entry_point"] == f"{ENTRY_FILE}::run"
    assert doc["spec"]["target_hardware"] == ["B200", "LOCAL"]
    assert doc["spec"]["destination_passing_style"] is False
    paths = [s["path"] for s in doc["sources"]]
    assert ENTRY_FILE in paths and all(p == ENTRY_FILE or p.startswith(PACKAGE + "/") for p in paths)
    assert not any("/bench/" in p or p.endswith("cli.py") for p in paths)

    folder = tmp_path / "unpacked"
    for source in doc["sources"]:
        target = folder / source["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source["content"])
    inputs = prob.make_inputs(axes, seed=4, device=DEVICE)
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", LOADER, str(folder / ENTRY_FILE), str(tmp_path / "inputs.pt"),
                    str(tmp_path / "outputs.pt")], check=True, timeout=600, cwd=tmp_path, env=dict(os.environ))
    outs = torch.load(tmp_path / "outputs.pt")
    assert_official_pass(prob, outs, prob.reference(*inputs))

