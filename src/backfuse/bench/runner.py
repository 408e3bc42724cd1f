"""Runs named implementations over a problem's official cases: correctness, then timing."""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..problem import Problem
from .check import Verdict, check_outputs
from .impls import fallback, implementation
from .sol import sol_ms
from .timing import time_calls

ROUNDS = 10
WARMUP = 10
ITERS = 50
GROUPS = 5  # `bench --train` / `--models`: timed groups per implementation, alternating (`train.time_alternating`);
# `--dynamic`: rounds of its loop (`dynamic.run_entry`)


def turned(names: list, by: int) -> list:
    """names in round `by`'s order: turned left by `by`, so that none always runs first or after the same one."""
    k = by % len(names)
    return names[k:] + names[:k]


@dataclass
class CaseResult:
    uuid: str
    axes: dict
    passed: bool | None  # None: nothing was checked (the reference itself, or a fallback)
    min_matched: float | None
    reason: str = ""
    latency_ms: float | None = None  # median CUPTI span
    event_ms: float | None = None  # median CUDA-event time (cross-check)
    kernels: int | None = None  # device activities per call (kernels, memcpy, memset)
    launches: int | None = None  # kernel launches per call
    busy_ms: float | None = None  # median time a call keeps the device busy (latency less its idle gaps)
    index: int | None = None  # the case's index among the problem's official workloads
    fallback: str | None = None  # "reference" when the impl ran as the fp32 reference (no fused kernels)


def reduced_axes(axes: dict) -> dict:
    """Small stand-ins for a case's axes, for CPU runs: batch at most 2, other axes 17..47."""
    return {k: (min(v, 2) if k == "batch_size" else (v if v <= 47 else 17 + v % 31)) for k, v in axes.items()}


def smallest_case(problem: Problem) -> int:
    """The official case with the fewest MACs once reduced: a CPU run's default (the interpreter is slow)."""
    return min(range(len(problem.workloads)), key=lambda i: (problem.macs(reduced_axes(problem.workloads[i].axes)), i))


def run_problem(
    problem: Problem,
    impl_names,
    *,
    cases=None,
    device="cuda",
    rounds: int = ROUNDS,
    warmup: int = WARMUP,
    iters: int = ITERS,
    timing: bool = True,
    seed: int = 0,
    progress=None,
) -> dict:
    """{impl: [CaseResult, ...]} over the selected cases (all 16 by default), in the order given.

    On a device other than CUDA the cases run on reduced shapes (`reduced_axes`) and nothing is timed.
    The reference is what the others are checked against, so it is not checked itself, and an impl
    that would only be the fp32 reference on this device (`fallback`) is not run: their results say
    passed=None. progress(index, axes, {impl: CaseResult}, seconds) is called after each case.
    """
    device = torch.device(device)
    reduce = device.type != "cuda"
    timing = timing and device.type == "cuda"
    impls = {name: implementation(problem, name) for name in impl_names}
    fallbacks = {name: fallback(problem, name, device) for name in impls}
    checked = {name: fn for name, fn in impls.items() if name != "reference" and not fallbacks[name]}
    selected = list(range(len(problem.workloads))) if cases is None else list(cases)
    results = {name: [] for name in impls}
    for index in selected:
        started = time.perf_counter()
        workload = problem.workloads[index]
        axes = reduced_axes(workload.axes) if reduce else dict(workload.axes)
        case_seed = seed * 1_000_003 + index * 1000
        verdicts = {name: Verdict(True, 1.0) for name in checked}
        for r in range(rounds if checked else 0):
            inputs = problem.make_inputs(axes, seed=case_seed + r, device=device, scalars=workload.scalars)
            references = problem.reference(*inputs)
            for name, fn in checked.items():
                verdict = check_outputs(fn(*inputs), references, workload.tolerance, problem.output_names)
                verdicts[name] = _worse(verdicts[name], verdict)
                if r == 0:
                    verdicts[name] = _worse(verdicts[name], _unmodified(problem, axes, inputs, case_seed, workload, name))
            del inputs, references
        for name in impls:
            v = verdicts.get(name)
            results[name].append(CaseResult(workload.uuid, dict(axes), v and v.passed, v and v.min_matched,
                                            v.reason if v else "", index=index, fallback=fallbacks[name]))
        if timing:
            inputs = problem.make_inputs(axes, seed=case_seed + rounds, device=device, scalars=workload.scalars)
            for name, fn in impls.items():
                t = time_calls(fn, inputs, warmup=warmup, iters=iters)
                result = results[name][-1]
                result.latency_ms, result.event_ms = t.median_ms, t.event_median_ms
                result.kernels = statistics.median(t.kernels_per_call)
                result.launches = statistics.median_low(t.launches_per_call)
                result.busy_ms = t.busy_median_ms
                if result.kernels == 0 or result.event_ms < 0.9 * result.latency_ms:
                    # The events bracket the whole call, so they can't read much less than its span.
                    log(f"{problem.id} {name} case {index}: CUPTI span {result.latency_ms:.4f} ms over "
                        f"{result.kernels} kernels vs CUDA events {result.event_ms:.4f} ms; timing suspect")
            del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress:
            progress(index, axes, {name: cases[-1] for name, cases in results.items()}, time.perf_counter() - started)
    return results


def _worse(a: Verdict, b: Verdict) -> Verdict:
    return Verdict(a.passed and b.passed, min(a.min_matched, b.min_matched), a.reason or b.reason)


def _unmodified(problem, axes, inputs, case_seed, workload, impl) -> Verdict:
    """Inputs must come back untouched: compare against a fresh draw from the same seed."""
    pristine = problem.make_inputs(axes, seed=case_seed, device=inputs[0].device, scalars=workload.scalars)
    for name, x, y in zip(problem.input_names, inputs, pristine):
        if isinstance(x, torch.Tensor) and not torch.equal(x, y):
            return Verdict(False, 1.0, f"{impl} modified input '{name}'")
    return Verdict(True, 1.0)


def environment() -> dict:
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
    }


def commit() -> str:
    """The commit of the code that runs: BACKFUSE_COMMIT where set (a copy of the tree without .git, as the device
    machine gets), else git's HEAD of the checkout backfuse runs from, "+changes" after it where the package's
    sources differ from it; "unknown" outside a checkout."""
    import subprocess

    if os.environ.get("BACKFUSE_COMMIT"):
        return os.environ["BACKFUSE_COMMIT"]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here)
        if head.returncode != 0:
            return "unknown"
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here).returncode != 0
    except OSError:  # no git
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed else "")


def run_info(device, *, timing: bool, rounds: int, warmup: int = WARMUP, iters: int = ITERS) -> dict:
    """What a run measured, for the top level of a results file (fields added after the first schema).

    shapes: "official" or "reduced" (CPU runs); timed: whether latencies were measured (median CUPTI
    span of `iters` calls after `warmup` untimed ones); rounds: correctness rounds per case;
    triton_interpret: on a CPU, whether the fused kernels ran in the Triton interpreter.
    """
    device = torch.device(device)
    timed = timing and device.type == "cuda"
    info = {"shapes": "official" if device.type == "cuda" else "reduced", "timed": timed, "rounds": rounds}
    if timed:
        info.update(warmup=warmup, iters=iters)
    if device.type == "cpu":
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return info


def to_json(problem: Problem, results: dict) -> dict:
    """One problem's entry of benchmarks/results/*.json: per impl the arithmetic and geometric means of
    the per-case latencies (None unless every case was timed) and the cases, each with its kernel
    launches per call and the device's busy time per call (None where untimed) and passed=None where
    nothing was checked."""
    axes_list = [c.axes for c in next(iter(results.values()))]
    impls = {}
    for name, cases in results.items():
        latencies = [c.latency_ms for c in cases]
        timed = None not in latencies
        impls[name] = {
            "mean_ms": statistics.fmean(latencies) if timed else None,
            "gmean_ms": statistics.geometric_mean(latencies) if timed else None,
            "cases": [
                {
                    "uuid": c.uuid,
                    "axes": c.axes,
                    "latency_ms": c.latency_ms,
                    "launches": c.launches,
                    "busy_ms": c.busy_ms,
                    "passed": c.passed,
                    "min_matched": c.min_matched,
                    **({"index": c.index} if c.index is not None else {}),
                }
                for c in cases
            ],
        }
        fallbacks = {c.fallback for c in cases}
        if fallbacks != {None}:
            impls[name]["fallback"] = "reference"
    return {"sol_h200_mean_ms": statistics.fmean(sol_ms(problem, a) for a in axes_list), "impls": impls}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
