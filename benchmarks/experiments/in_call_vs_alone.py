"""Each kernel of a fused 021 call timed inside the call and repeated alone (PDL off in both, so a
kernel's duration is its own work). Session 23 found the attention 14.8 us in a call and 10.0 alone
(case 8): this separates what the call's order costs each kernel (caches left by the previous
kernel, the attention's last-run hand-off) from its work.

    PYTHONPATH=src python3 benchmarks/experiments/in_call_vs_alone.py --cases 8,2,12

Alone, a launch repeats on the call's buffers: split-K sums and the attention's arrival counters
are not reset, so numbers are wrong and the attention skips its hand-off ("alone"), except in the
"alone, counters zeroed" row, which zeroes the arrivals before each repeat (a memset in between).
"""

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

import backfuse
from backfuse.kernels import launch as L
from backfuse.ops.wan_xattn import config as C

NAMES = ("pack_kernel", "forward_products_kernel", "attention_kernel", "gradient_products_kernel")


def medians(prof):
    times = {}
    for e in prof.events():
        name = e.name.split("(")[0]
        if name in NAMES and e.device_time > 0:
            times.setdefault(name, []).append(e.device_time)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8,2,12")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    prob = backfuse.problem("021")
    cfg = dataclasses.replace(C.CONFIG, pdl=False)
    recorded = []
    prepare = L.FastKernel.prepare

    def spy(self, grid, *a, **meta):
        launch = prepare(self, grid, *a, **meta)
        recorded.append((self.fn.__name__, a, launch))
        return launch

    for case in map(int, args.cases.split(",")):
        x = prob.make_inputs(prob.workloads[case].axes, seed=0, device="cuda")
        for _ in range(3):
            prob.fused(*x, config=cfg)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                prob.fused(*x, config=cfg)
            torch.cuda.synchronize()
        in_call = medians(prof)
        L.FastKernel.prepare = spy
        recorded.clear()
        prob.fused(*x, config=cfg)
        L.FastKernel.prepare = prepare
        torch.cuda.synchronize()
        alone, zeroed = {}, {}
        for name, a, launch in recorded:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    launch()
                torch.cuda.synchronize()
            alone |= medians(prof)
            if name == "attention_kernel":
                arrivals = a[8]
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.reps):
                        arrivals.zero_()
                        launch()
                    torch.cuda.synchronize()
                zeroed = medians(prof)
        print(f"case {case} {prob.workloads[case].axes}", flush=True)
        for name in NAMES:
            z = f"  alone, counters zeroed {zeroed[name]:6.1f}" if name in zeroed else ""
            print(f"  {name:26s} in call {in_call.get(name, float('nan')):6.1f}  alone {alone.get(name, float('nan')):6.1f}{z} us",
                  flush=True)
        print(f"  sum in call {sum(in_call.values()):6.1f}  alone {sum(alone.values()):6.1f} us", flush=True)


if __name__ == "__main__":
    main()
