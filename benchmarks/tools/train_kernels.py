"""The kernels of one training step (forward + backward) of an implementation at an official case, with
their GPU times, from the profiler: where a step's GPU time goes.

    PYTHONPATH=src python3 benchmarks/tools/train_kernels.py 072 0 backfuse_bf16 compile_bf16
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import backfuse
from backfuse.bench.train import Layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("case", type=int)
    ap.add_argument("impls", nargs="+")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    prob = backfuse.problem(args.problem)
    for impl in args.impls:
        layer = Layer(prob, prob.workloads[args.case].axes, impl, "cuda")
        for _ in range(5):
            layer.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer.step()
            torch.cuda.synchronize()
        times = defaultdict(float)
        counts = defaultdict(int)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name[:70]] += e.device_time_total / 3
                counts[e.name[:70]] += 1
        total = sum(times.values())
        print(f"{prob.id} case {args.case} {impl}: {total / 1e3:.3f} ms of kernels per step, "
              f"{sum(counts.values()) // 3} kernels")
        for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {t / 1e3:8.3f} ms  x{counts[name] // 3:<3d} {name}")


if __name__ == "__main__":
    main()
