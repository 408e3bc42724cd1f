"""On a GPU: compute-sanitizer's memcheck finds no access outside an allocation in the training calls of
`sanitized_calls.py` (every mask form at a length no tile divides, packed documents, Wan's attentions; bf16 and
fp32). The interpreter's counterpart is `pytest --memcheck` (tests/memcheck.py)."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

SANITIZER = shutil.which("compute-sanitizer") or next(
    (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or SANITIZER is None,
                                reason="compute-sanitizer on a CUDA GPU")


def test_training_calls_touch_only_their_allocations():
    script = os.path.join(os.path.dirname(__file__), "sanitized_calls.py")
    done = subprocess.run([SANITIZER, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, script],
                          capture_output=True, text=True, timeout=500)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0 and "ERROR SUMMARY: 0 errors" in done.stdout + done.stderr and "ok" in done.stdout, tail
