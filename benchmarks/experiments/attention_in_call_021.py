"""021's attention launch timed like for like (021.md row 37): inside fused calls without PDL (so a
kernel's time is its own, not its wait for the previous one), and the same prepared launch repeated
alone, for the Gluon kernel and the `tl` kernel.

    PYTHONPATH=src python3 benchmarks/experiments/attention_in_call_021.py 8,2,1
"""
import dataclasses
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import backfuse
from backfuse.ops.wan_xattn import backward as B
from backfuse.ops.wan_xattn import config as C

prob = backfuse.problem("021")
captured = []
orig = B._attention
def spy(*a, **k):
    launch = orig(*a, **k)
    captured.append(launch)
    return launch
B._attention = spy
def med(prof, key):
    t = sorted(e.device_time for e in prof.events() if e.name.startswith(key) and e.device_time > 0)
    return t[len(t) // 2] if t else float("nan")
for case in map(int, sys.argv[1].split(",")):
    x = prob.make_inputs(prob.workloads[case].axes, seed=0, device="cuda")
    for name, cfg in [("gluon", dataclasses.replace(C.CONFIG, pdl=False)),
                      ("tl", dataclasses.replace(C.CONFIG, gluon_attention=None, pdl=False))]:
        for _ in range(3):
            prob.fused(*x, config=cfg)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                prob.fused(*x, config=cfg)
            torch.cuda.synchronize()
        in_call = med(prof, "attention_kernel")
        captured.clear()
        prob.fused(*x, config=cfg)
        launch = captured[-1]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                launch()   # dK/dV sums and arrival counters not re-zeroed: the time, not the numbers
            torch.cuda.synchronize()
        print(case, f"{name:6s} in call {in_call:6.1f}  repeated alone {med(prof, 'attention_kernel'):6.1f} us", flush=True)
