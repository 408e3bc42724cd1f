import os

import pytest
import torch

# Kernel tests on machines without a GPU run the Triton kernels in the interpreter; this must be set
# before triton is first imported (importing backfuse does not import it: a fused call does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker gets its share of the cores for torch's own threads (no oversubscription).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import backfuse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=backfuse.PROBLEM_IDS)
def prob(request):
    return backfuse.problem(request.param)
