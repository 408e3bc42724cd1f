"""Official-rule check of each operator at large, odd sizes (the property sweep stops at 300 tokens).

    python3 benchmarks/checks/odd_sizes.py [--rounds 2]

Every size runs `Problem.run` as users call it (so the large ones take the cuBLAS paths) on fresh
inputs and compares with the fp32 reference under the official rule.
"""

import argparse

import torch

import backfuse
from backfuse.bench import check_outputs

SIZES = {  # axes in official order
    "072": [(3, 1001, 1999), (1, 4097, 613), (5, 77, 1)],
    "037": [(1, 613), (3, 1001), (1, 2047), (2, 1537), (5, 333), (7, 129)],
    "021": [(3, 1999, 301), (1, 4097, 373), (5, 513, 78), (2, 1, 300)],
}

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=2)
args = ap.parse_args()
for pid, sizes in SIZES.items():
    prob = backfuse.problem(pid)
    tol = prob.workloads[0].tolerance
    for values in sizes:
        axes = dict(zip(prob.axis_names, values))
        worst, passed = 1.0, True
        for r in range(args.rounds):
            x = prob.make_inputs(axes, seed=1000 + r, device="cuda")
            verdict = check_outputs(prob.run(*x), prob.reference(*x), tol, prob.output_names)
            worst, passed = min(worst, verdict.min_matched), passed and verdict.passed
            if not verdict.passed:
                print(f"  {pid} {axes} round {r}: {verdict.reason}")
        print(f"{pid} {axes}: {'pass' if passed else 'FAIL'}  worst matched {worst:.6f}", flush=True)
        torch.cuda.empty_cache()
