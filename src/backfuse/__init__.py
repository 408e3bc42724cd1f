"""backfuse: fused backward kernels for three attention blocks (SOL-ExecBench 072, 037, 021)."""

from .callsite import BackfuseWarning
from .fp16_guard import Fp16RangeWarning, fp16_range_check
from .kernels.graphs import GraphWarning, cuda_graphs
from .ops import PROBLEMS
from .problem import Problem

__version__ = "0.1.0"
__all__ = ["PROBLEM_IDS", "BackfuseWarning", "Fp16RangeWarning", "GraphWarning", "Problem", "check_ranges", "cuda_graphs",
           "fp16_range_check", "problem"]

PROBLEM_IDS = tuple(PROBLEMS)


def check_ranges() -> None:
    """Wait for the GPU, then warn about every training call whose fp16 tensors left fp16's safe range that
    no warning named yet (the training ops do this without waiting, at their next call)."""
    from .train.guard import check_ranges as check

    check()


def problem(pid: str) -> Problem:
    """The operator for an id ("072", "037", "021") or its official name."""
    if not isinstance(pid, str):
        raise TypeError(f"problem id must be a str, got {type(pid).__name__}")
    for p in PROBLEMS.values():
        if pid in (p.id, p.name):
            return p
    known = ", ".join(f"{p.id} ({p.name})" for p in PROBLEMS.values())
    raise ValueError(f"unknown problem {pid!r}; expected one of: {known}")
