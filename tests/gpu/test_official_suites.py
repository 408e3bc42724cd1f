"""On a GPU: every official case of the three operators passes the official rule (`backfuse bench`'s check, one
round of fresh inputs per case, no timing), the fused kernels at the official shapes. In the interpreter the
harness's own tests check reduced shapes (test_harness.py)."""

import pytest
import torch

import backfuse
from backfuse.bench.runner import run_problem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the official shapes run on a GPU")


@pytest.mark.parametrize("pid", backfuse.PROBLEM_IDS)
def test_every_official_case_passes(pid):
    results = run_problem(backfuse.problem(pid), ["reference", "backfuse"], device="cuda", rounds=1, timing=False)
    failed = [(r.index, r.reason) for r in results["backfuse"] if not r.passed]
    assert len(results["backfuse"]) == 16 and not failed, failed
