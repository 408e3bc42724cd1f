"""Session 26: what a fused call as one CUDA graph costs the host. The official clock times the device
from the first kernel's start, so recording the launches, updating the cached executable graph and
launching it cost nothing there; a user's wall clock counts them. Per case and mode (graph, direct):
the host time of the call alone (to its return, the fp16 range guard off so that it does not wait
for the device) and the wall time of a call with its synchronization (the guard on, as users run it),
medians of 30 calls on fresh inputs after 5 warm-up calls.

    PYTHONPATH=src python3 benchmarks/experiments/graph_host_cost.py

Prediction (written before the run): recording costs about what launching did (the same launcher
calls, on a stream that runs nothing), plus an update of ≈ 10-30 us and one graph launch, so the
host time per call is ≈ equal to direct launches or up to ≈ 40 us more; the synchronized wall time of
the small cases falls by the device's former waits (021 case 8: ≈ 20 us) less that extra.
"""

import statistics
import time

import torch

import backfuse

CASES = {"021": [8, 12, 0], "037": [8, 0], "072": [3, 12]}


def median_us(fn, calls=30, warm=5):
    times = []
    for i in range(warm + calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if i >= warm:
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main():
    print(f"{'case':10s} {'mode':7s} {'host us':>8s} {'wall us':>8s}")
    for pid, cases in CASES.items():
        prob = backfuse.problem(pid)
        for i in cases:
            x = prob.make_inputs(prob.workloads[i].axes, seed=1, device="cuda")
            for mode in (True, False):
                with backfuse.cuda_graphs(mode):
                    with backfuse.fp16_range_check(False):
                        host = median_us(lambda: prob.fused(*x))
                    wall = median_us(lambda: (prob.run(*x), torch.cuda.synchronize()))
                print(f"{pid} {i:<6d} {'graph' if mode else 'direct':7s} {host:8.1f} {wall:8.1f}", flush=True)


if __name__ == "__main__":
    main()
