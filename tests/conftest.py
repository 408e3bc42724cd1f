import os

import pytest
import torch

# Kernel tests on machines without a GPU run the Triton kernels in the interpreter; this must be set
# before triton is first imported (importing backfuse does not import it: a fused call does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import fast_interpreter  # noqa: E402  (the interpreter's per-call patching made cheaper, its effect unchanged)

    fast_interpreter.install()

# Under pytest-xdist each worker gets its share of the cores for torch's own threads (no oversubscription).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import backfuse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=backfuse.PROBLEM_IDS)
def prob(request):
    return backfuse.problem(request.param)


KEPT_BETWEEN_TESTS = 4 << 30  # bytes of cached GPU memory a worker keeps from one test to the next


@pytest.fixture(autouse=True)
def _cached_memory_given_back():
    """On a GPU, a test's cached memory beyond KEPT_BETWEEN_TESTS goes back to the device after it: the GPU suite runs
    ten workers on one device, and a worker keeping its largest test's cache (tens of GiB after a 27B preset's float64
    reference) ran the others out of memory (session 43: five tests failed so, each passing alone)."""
    yield
    if DEVICE == "cuda" and torch.cuda.memory_reserved() > KEPT_BETWEEN_TESTS:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------- the GPU suite's record --------------------------------
def pytest_addoption(parser):
    parser.addoption("--memcheck", action="store_true",
                     help="in the Triton interpreter: fail a test whose kernels load, store or add outside the memory "
                          "of their tensor arguments (tests/memcheck.py; slower)")
    parser.addoption("--program-order", metavar="ORDER", default=None,
                     help="in the Triton interpreter: run each launch's programs in another order, 'reverse' or "
                          "'shuffle:SEED' (tests/program_order.py): a kernel whose result depends on the order fails")
    parser.addoption("--gpu-report", metavar="PATH", default=None,
                     help="on a CUDA GPU: write {commit, failed, tests: {nodeid: passed|failed|skipped}, slowest: "
                          "[[nodeid, seconds]]} to PATH (benchmarks/results/gpu-tests.json: what a kernel change must "
                          "show before it lands; the slowest tests, where the suite's device time goes)")


_outcomes: dict = {}
_seconds: dict = {}  # nodeid -> seconds over its phases (setup, call, teardown)
SLOWEST = 30  # tests the report lists by time


def pytest_runtest_logreport(report):
    """Each test's outcome: failed if any phase failed, skipped if skipped, else passed once its call passed."""
    now = _outcomes.get(report.nodeid)
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and now is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and now is None:
        _outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--gpu-report")
    if not path or hasattr(session.config, "workerinput"):  # xdist workers report to the controller
        return
    if not torch.cuda.is_available():
        raise pytest.UsageError("--gpu-report records a GPU run; there is no CUDA GPU here")
    import json

    from backfuse.bench.runner import commit

    doc = {"commit": commit(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "failed": sum(v == "failed" for v in _outcomes.values()), "tests": dict(sorted(_outcomes.items())),
           "slowest": [[k, round(v, 1)] for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]]}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def pytest_configure(config):
    if config.getoption("--memcheck", default=False):
        if torch.cuda.is_available():
            raise pytest.UsageError("--memcheck checks the Triton interpreter's accesses; on a GPU use compute-sanitizer")
        import memcheck

        memcheck.install()
    order = config.getoption("--program-order", default=None)
    if order:
        if torch.cuda.is_available():
            raise pytest.UsageError("--program-order reorders the Triton interpreter's programs; a GPU runs them in any order")
        import program_order

        program_order.install(order)
