import os

import pytest
import torch

# Kernel tests on machines without a GPU run the Triton kernels in the interpreter; this must be set
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import backfuse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_configure(config):
    # An unexpected fp32 fallback of the fp16 range guard fails the test. (Named here, not in
    # pyproject.toml: resolving it there would import backfuse before TRITON_INTERPRET is set.)
    config.addinivalue_line("filterwarnings", "error::backfuse.Fp16RangeWarning")


@pytest.fixture(params=backfuse.PROBLEM_IDS)
def prob(request):
    return backfuse.problem(request.param)
