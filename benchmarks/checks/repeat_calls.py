"""Many calls of one official case on the GPU: every output checked, memory must not grow, the same
kernels must run every call.

    python3 benchmarks/checks/repeat_calls.py 021 6 --calls 1000 [--deterministic]

A race in a cross-program hand-off (atomics, arrival counters) shows as an occasional failing call;
a leak as growing allocated memory (GPU, and pinned host memory: the fp16 range guard's slots);
nondeterminism of atomics as a small spread between calls, which must be exactly zero under
--deterministic (torch.use_deterministic_algorithms).
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import backfuse
from backfuse.bench import check_outputs

ap = argparse.ArgumentParser()
ap.add_argument("problem")
ap.add_argument("case", type=int)
ap.add_argument("--calls", type=int, default=200)
ap.add_argument("--deterministic", action="store_true")
args = ap.parse_args()
torch.use_deterministic_algorithms(args.deterministic)
prob = backfuse.problem(args.problem)
w = prob.workloads[args.case]
x = prob.make_inputs(w.axes, seed=1, device="cuda")
refs = prob.reference(*x)


def kernels_of_one_call():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = prob.run(*x)
        torch.cuda.synchronize()
    return outs, [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def pinned_bytes():
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


first, kernels = kernels_of_one_call()
torch.cuda.synchronize()
allocated, pinned = torch.cuda.memory_allocated(), pinned_bytes()
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
pinned_growth = pinned_bytes() - pinned
_, last_kernels = kernels_of_one_call()
same = "same kernels every call" if last_kernels == kernels else f"KERNELS DIFFER: {kernels} vs {last_kernels}"
print(f"{prob.id} case {args.case} {w.axes}{' deterministic' if args.deterministic else ''}: {args.calls} calls, "
      f"{failed} failed, worst matched {worst:.6f}, largest change from the first call {spread:.2e} (relative to "
      f"max |output|), memory growth {growth} B (pinned host {pinned_growth} B), {len(kernels)} kernels, {same}")
# (Pinned host memory: torch's host allocator shows a one-off +13 B on torch 2.11; a leak of the
# guard's slots would be at least 16 B a call.)
if failed or growth > 0 or pinned_growth >= 16 * args.calls or last_kernels != kernels or (args.deterministic and spread != 0):
    raise SystemExit(1)
