"""Run one official case of a problem a few times: a target for ncu, nsys or compute-sanitizer.

    ncu --section SpeedOfLight python3 benchmarks/checks/run_case.py 021 0 --calls 2
    compute-sanitizer --tool racecheck python3 benchmarks/checks/run_case.py 021 --axes 2,150,77
"""

import argparse

import torch

import backfuse

ap = argparse.ArgumentParser()
ap.add_argument("problem")
ap.add_argument("case", type=int, nargs="?", default=0, help="official case index")
ap.add_argument("--axes", help="comma-separated axis values instead of an official case")
ap.add_argument("--calls", type=int, default=1)
args = ap.parse_args()
prob = backfuse.problem(args.problem)
axes = prob.workloads[args.case].axes
if args.axes:
    axes = dict(zip(prob.axis_names, (int(v) for v in args.axes.split(","))))
x = prob.make_inputs(axes, seed=0, device="cuda")
for _ in range(args.calls):
    out = prob.run(*x)
torch.cuda.synchronize()
err = max(((o - r).norm() / r.norm().clamp_min(1e-30)).item() for o, r in zip(out, prob.reference(*x)))
print(f"{prob.id} {axes}: {args.calls} call(s), max relative error {err:.2e}")
