"""What the backward's options cost or save, on the official clock: all outputs; input gradients
only (frozen weights); weight gradients only (frozen inputs); deterministic mode; the fp16 range
guard turned off.

    python3 benchmarks/experiments/option_timing.py 021 1 6 072 0 6
"""

import argparse

import torch

import backfuse
from backfuse.bench import time_calls

ap = argparse.ArgumentParser()
ap.add_argument("cases", nargs="+", help="PROBLEM CASE... groups, e.g. 021 1 6 072 0")
args = ap.parse_args()
pid = None
for token in args.cases:
    if len(token) == 3 and token.isdigit() and token in backfuse.PROBLEM_IDS:
        pid = token
        continue
    prob = backfuse.problem(pid)
    w = prob.workloads[int(token)]
    x = prob.make_inputs(w.axes, seed=0, device="cuda")
    n_inputs = 2  # both operators differentiate two activations first, then parameters
    cells = []
    for label, needs in (("all", None), ("inputs only", [i < n_inputs for i in range(len(prob.outputs))]),
                         ("weights only", [i >= n_inputs for i in range(len(prob.outputs))])):
        t = time_calls(lambda *a, needs=needs: prob.backward(*a, needs=needs), x)
        cells.append(f"{label} {t.median_ms:.4f}")
    torch.use_deterministic_algorithms(True)
    cells.append(f"deterministic {time_calls(prob.run, x).median_ms:.4f}")
    torch.use_deterministic_algorithms(False)
    with backfuse.fp16_range_check(False):
        cells.append(f"no range check {time_calls(prob.run, x).median_ms:.4f}")
    print(f"{pid} case {token} {w.axes}: " + "  ".join(cells), flush=True)
