"""Many calls of one official case on the GPU: every output checked, memory must not grow.

    python3 benchmarks/checks/repeat_calls.py 021 6 --calls 200

A race in a cross-program hand-off (atomics, arrival counters) shows as an occasional failing call;
a leak as growing allocated memory; nondeterminism of atomics as a small spread between calls.
"""

import argparse

import torch

import backfuse
from backfuse.bench import check_outputs

ap = argparse.ArgumentParser()
ap.add_argument("problem")
ap.add_argument("case", type=int)
ap.add_argument("--calls", type=int, default=200)
args = ap.parse_args()
prob = backfuse.problem(args.problem)
w = prob.workloads[args.case]
x = prob.make_inputs(w.axes, seed=1, device="cuda")
refs = prob.reference(*x)
first = prob.run(*x)
torch.cuda.synchronize()
allocated = torch.cuda.memory_allocated()
worst, failed, spread = 1.0, 0, 0.0
for _ in range(args.calls):
    outs = prob.run(*x)
    verdict = check_outputs(outs, refs, w.tolerance, prob.output_names)
    worst, failed = min(worst, verdict.min_matched), failed + (not verdict.passed)
    spread = max(spread, max((o - f).abs().max().item() / f.abs().max().clamp_min(1e-30).item()
                             for o, f in zip(outs, first)))
    del outs
torch.cuda.synchronize()
growth = torch.cuda.memory_allocated() - allocated
print(f"{prob.id} case {args.case} {w.axes}: {args.calls} calls, {failed} failed, worst matched {worst:.6f}, "
      f"largest change from the first call {spread:.2e} (relative to max |output|), memory growth {growth} B")
