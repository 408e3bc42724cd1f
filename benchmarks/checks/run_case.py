"""Run one official case of a problem a few times: a target for ncu, nsys or compute-sanitizer.

    ncu --section SpeedOfLight python3 benchmarks/checks/run_case.py 021 0 --calls 2
    ncu --clock-control none -k regex:fused_kernel -s 2 -c 1 python3 benchmarks/checks/run_case.py 072 0 --calls 3 --products gluon
    compute-sanitizer --tool racecheck python3 benchmarks/checks/run_case.py 021 --axes 2,150,77

After the last call its outputs are checked against the reference with the official rule, so a
profiled run that went wrong says so.
"""

import argparse

import torch

import backfuse
from backfuse.bench import check_outputs

ap = argparse.ArgumentParser()
ap.add_argument("problem")
ap.add_argument("case", type=int, nargs="?", default=0, help="official case index")
ap.add_argument("--axes", help="comma-separated axis values instead of an official case")
ap.add_argument("--calls", type=int, default=1)
ap.add_argument("--products", default=None, help="force a product backend ('cublas', 'triton', 'gluon')")
args = ap.parse_args()
prob = backfuse.problem(args.problem)
w = prob.workloads[args.case]
axes = w.axes
if args.axes:
    axes = dict(zip(prob.axis_names, (int(v) for v in args.axes.split(","))))
x = prob.make_inputs(axes, seed=0, device="cuda")
run = prob.run if args.products is None else (lambda *a: prob.fused(*a, products=args.products))
for _ in range(args.calls):
    out = run(*x)
torch.cuda.synchronize()
ref = prob.reference(*x)
err = max(((o - r).norm() / r.norm().clamp_min(1e-30)).item() for o, r in zip(out, ref))
verdict = check_outputs(out, ref, w.tolerance, prob.output_names)
print(f"{prob.id} {axes}{' products=' + args.products if args.products else ''}: {args.calls} call(s), "
      f"max relative error {err:.2e}, official rule {'passed' if verdict.passed else 'FAILED: ' + verdict.reason}")
