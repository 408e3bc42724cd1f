import os

import pytest
import torch

# Kernel tests on machines without a GPU run the Triton kernels in the interpreter; this must be set
# before triton is first imported (importing backfuse does not import it: a fused call does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import backfuse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=backfuse.PROBLEM_IDS)
def prob(request):
    return backfuse.problem(request.param)
