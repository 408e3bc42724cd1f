"""`pytest --program-order` (tests/program_order.py): the interpreter runs each launch's programs in the order asked,
every program once, each with its own grid index."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {tests!r})
import torch, triton, triton.language as tl
import program_order

program_order.install({order!r})


@triton.jit
def log_order(seen, count):
    slot = tl.atomic_add(count, 1)
    tl.store(seen + slot, tl.program_id(0) * 100 + tl.program_id(1) * 10 + tl.program_id(2))


seen, count = torch.full((24,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
log_order[(2, 3, 4)](seen, count)
print(seen.tolist())
"""


def _order(order: str) -> list:
    script = SCRIPT.format(tests=str(Path(__file__).parent), order=order)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's order (a GPU runs programs in any order)")
def test_programs_run_in_the_order_asked():
    grid = [x * 100 + y * 10 + z for x in range(2) for y in range(3) for z in range(4)]
    assert _order("reverse") == grid[::-1]
    shuffled = _order("shuffle:5")
    assert sorted(shuffled) == grid and shuffled != grid and shuffled == _order("shuffle:5")
    with pytest.raises(AssertionError, match="must be 'reverse' or 'shuffle:SEED'"):
        _order("sideways")
