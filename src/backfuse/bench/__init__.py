"""The benchmark harness: official correctness rule, CUPTI-span timing, speed of light, reports.

It knows nothing about any one operator: it drives `backfuse.problem(...)` objects.
"""

from .check import Verdict, check_outputs, matched_ratio
from .impls import IMPLS, implementation
from .runner import CaseResult, reduced_axes, run_problem, to_json
from .sol import GPUS, leaderboard_score, sol_ms
from .timing import time_calls

__all__ = [
    "CaseResult",
    "GPUS",
    "IMPLS",
    "Verdict",
    "check_outputs",
    "implementation",
    "leaderboard_score",
    "matched_ratio",
    "reduced_axes",
    "run_problem",
    "sol_ms",
    "time_calls",
    "to_json",
]
