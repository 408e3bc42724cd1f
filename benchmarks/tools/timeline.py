"""One call of an official case, traced as the official clock traces it: every device activity
with its start, duration and the idle gap before it, and when the host launched it.

    python3 benchmarks/tools/timeline.py 037 14 [--products cublas] [--direct]

Gaps whose launch came late (host column after the previous activity ended) are host-bound; "api"
is how long the host's launch call took.
"""

import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

import backfuse
from backfuse.bench.timing import CLOSE_API, DEVICE_ACTIVITIES, LAUNCH_ACTIVITIES, OPEN_API, FreshInputs, L2Flush, trace_events

ap = argparse.ArgumentParser()
ap.add_argument("problem")
ap.add_argument("case", type=int)
ap.add_argument("--products", default=None, help="force 'cublas' or 'triton' products")
ap.add_argument("--direct", action="store_true", help="launch each kernel directly (no CUDA graph)")
args = ap.parse_args()
contextlib.ExitStack().enter_context(backfuse.cuda_graphs(not args.direct))  # for the whole script
prob = backfuse.problem(args.problem)
x = prob.make_inputs(prob.workloads[args.case].axes, seed=0, device="cuda")
run = prob.run
if args.products:
    run = lambda *x: prob.fused(*x, products=args.products)  # noqa: E731
flush, fresh = L2Flush(x[0].device), FreshInputs(x, 12)
for _ in range(10):
    run(*fresh())
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):  # the first calls under a new trace pay for its set-up; the last one is shown
        flush()
        inputs = fresh()
        torch.cuda.current_stream().synchronize()
        run(*inputs)
        torch.cuda.synchronize()
events = trace_events(prof)
# The last call opens with the first stream synchronization after the previous device synchronization
# (the call may synchronize its stream itself later, e.g. the fp16 range guard).
syncs = sorted((e for e in events if e.kind == "cuda_runtime" and e.name in (OPEN_API, CLOSE_API)), key=lambda e: e.start_ns)
call_start = max(b.end_ns for a, b in zip(syncs, syncs[1:]) if a.name == CLOSE_API and b.name == OPEN_API)
launch = {e.correlation: e for e in events if e.kind in LAUNCH_ACTIVITIES and e.correlation is not None}
# A graph's kernels have no launch record here (the profiler keeps none of a driver-API cuGraphLaunch):
# they go by their own start.
device = sorted((e for e in events if e.kind in DEVICE_ACTIVITIES
                 and (launch[e.correlation].start_ns if e.correlation in launch else e.start_ns) > call_start),
                key=lambda e: e.start_ns)
t0 = min([device[0].start_ns] + [launch[e.correlation].start_ns for e in device if e.correlation in launch])
print(f"{prob.id} case {args.case} {prob.workloads[args.case].axes}: span "
      f"{(device[-1].end_ns - device[0].start_ns) / 1e3:.1f} us (times in us from the first launch)")
print(f"{'launched':>9s} {'api':>7s} {'start':>9s} {'dur':>8s} {'gap':>7s}  activity")
prev_end = None
for e in device:
    host = launch.get(e.correlation)
    gap = (e.start_ns - prev_end) / 1e3 if prev_end is not None else 0.0
    print(f"{(host.start_ns - t0) / 1e3 if host else float('nan'):9.1f} "
          f"{(host.end_ns - host.start_ns) / 1e3 if host else float('nan'):7.1f} {(e.start_ns - t0) / 1e3:9.1f} "
          f"{(e.end_ns - e.start_ns) / 1e3:8.1f} {gap:7.1f}  {e.name[:70]}")
    prev_end = e.end_ns if prev_end is None else max(prev_end, e.end_ns)
