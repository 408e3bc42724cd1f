"""Calls of one official case and nothing else, for a profiler or checker wrapped around it.

    ncu --clock-control none -k regex:fused_kernel -s 2 -c 1 python3 benchmarks/tools/calls.py 072 0 --products gluon
    compute-sanitizer --tool racecheck python3 benchmarks/tools/calls.py 037 9 --calls 1

The inputs are made once (seed 0); every call's outputs are checked against the reference with the
official rule after the last call, so a profiled run that went wrong says so.
"""

from __future__ import annotations

import argparse

import torch

import backfuse
from backfuse.bench import check_outputs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problem")
    ap.add_argument("case", type=int)
    ap.add_argument("--products", default=None, help="force a product backend ('cublas', 'triton', 'gluon')")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    prob = backfuse.problem(args.problem)
    w = prob.workloads[args.case]
    x = prob.make_inputs(w.axes, seed=0, device="cuda")
    kw = {"products": args.products} if args.products else {}
    for _ in range(args.calls):
        out = prob.fused(*x, **kw)
    torch.cuda.synchronize()
    verdict = check_outputs(out, prob.reference(*x), w.tolerance, prob.output_names)
    print(f"{prob.id} case {args.case} {w.axes} {kw or ''}: {args.calls} calls, last "
          f"{'passed' if verdict.passed else 'FAILED ' + verdict.reason}", flush=True)


if __name__ == "__main__":
    main()
