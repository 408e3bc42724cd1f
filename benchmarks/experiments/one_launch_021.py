"""Gate of a one-launch 021 (issue 23; benchmarks/notes/021.md rows 32-35): the persistent task-queue
launch of `persistent_021/` against the operator's four launches, on the official clock (median CUPTI
span of 50 calls, L2 flushed, fresh inputs), per case, in one process; and, with --profile, each item
kind's device time inside the persistent launch (global-timer stamps per item).

Also checks, before timing, each variant's outputs against the fp32 reference (official rule,
buffers poisoned), that the counters are left zeroed, and that deterministic mode repeats bit for bit.

    PYTHONPATH=src python3 benchmarks/experiments/one_launch_021.py [--cases 8,12,0] [--profile 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from persistent_021 import launch
from persistent_021 import plan as config

import backfuse
from backfuse.bench import check_outputs, time_calls
from backfuse.kernels import buffers
from backfuse.kernels.config import PackConfig, TileConfig

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default=",".join(map(str, range(16))))
ap.add_argument("--iters", type=int, default=50)
ap.add_argument("--profile", default="", help="cases whose items' device timestamps to summarise per kind")
ap.add_argument("--variants", default="", help="semicolon-separated VARIANTS names (default: all)")
args = ap.parse_args()

prob = backfuse.problem("021")
R = dataclasses.replace
VARIANTS = {
    "one launch": config.CONFIG,
    # row 34: four-warp programs, two per SM (64-row attention blocks, 128 x 128 forward tiles)
    "4 warps 2 per SM": R(config.CONFIG, warps=4, programs_per_sm=2,
                          pack=PackConfig(rows=16, cols=512, tile=64, block=4096, iters=1),
                          forward=TileConfig(bm=128, bn=128, bk=64, stages=3), attention=config.AttentionConfig(bm=64)),
}
if args.variants:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants.split(";")}
fns = {"four launches": lambda *x: prob.fused(*x),
       **{name: (lambda cfg: lambda *x: launch.backward(*x, config=cfg))(cfg) for name, cfg in VARIANTS.items()}}



def profile_case(index: int, name: str) -> None:
    """Per item kind: items, mean wait and work (us), and when the kind's first item started and its
    last ended, relative to the first item's start (one call, after a warm-up call)."""
    w = prob.workloads[index]
    x = prob.make_inputs(w.axes, seed=index, device="cuda")
    cfg = VARIANTS[name]
    p = config.plan(cfg, w.axes, torch.cuda.get_device_properties(0).multi_processor_count)
    prof = torch.zeros(4 * len(p.queue.rows), dtype=torch.int64, device="cuda")
    for _ in range(2):
        launch.backward(*x, config=cfg, profile=prof)
    torch.cuda.synchronize()
    t = prof.view(-1, 4).cpu()
    t0 = int(t[:, 0].min())
    span = (int(t[:, 2].max()) - t0) / 1e3
    print(f"{name}: case {index} {tuple(w.axes.values())}: {len(p.queue.rows)} items, span {span:.1f} us "
          f"(schedule's estimate {p.queue.makespan:.1f}), {len(set(t[:, 3].tolist()))} programs")
    for kind in config.Work:
        sel = torch.tensor([i for i, item in enumerate(p.queue.rows) if item.kind == kind], dtype=torch.long)
        if not len(sel):
            continue
        k = t[sel].double()
        print(f"  {kind.name:12s} {len(sel):5d} items  wait {((k[:, 1] - k[:, 0]).mean() / 1e3):7.2f}  "
              f"work {((k[:, 2] - k[:, 1]).mean() / 1e3):7.2f} us  from {(k[:, 0].min() - t0) / 1e3:7.1f} "
              f"to {(k[:, 2].max() - t0) / 1e3:7.1f} us", flush=True)


for index in (int(c) for c in args.profile.split(",") if c):
    for name in VARIANTS:
        profile_case(index, name)

rows = []
for index in (int(c) for c in args.cases.split(",") if c):
    w = prob.workloads[index]
    x = prob.make_inputs(w.axes, seed=index, device="cuda")
    ref = prob.reference(*x)
    cells = {}
    for name, fn in fns.items():
        with buffers.poisoned():
            verdict = check_outputs(fn(*x), ref, w.tolerance, prob.output_names)
        t = time_calls(fn, x, iters=args.iters)
        cells[name] = (t.median_ms, verdict.passed, t.kernels_per_call[len(t.kernels_per_call) // 2])
        if name == "four launches":
            print(f"case {index} four launches, busy per kernel (us): "
                  + ", ".join(f"{k.split('_kernel')[0][-24:]} {v * 1e3:.1f}" for k, v in t.kernel_ms.items()), flush=True)
        if not verdict.passed:
            print(f"case {index} {name}: FAILED {verdict.reason}", flush=True)
    torch.cuda.synchronize()
    left = [int(v.sum()) for v in buffers._zeroed.values()]
    det = [launch.backward(*x, deterministic=True) for _ in range(2)]
    same = all(torch.equal(a, b) for a, b in zip(*det))
    rows.append((index, w.axes, cells))
    print(f"case {index:2d} {tuple(w.axes.values())}: " + "  ".join(
        f"{n} {ms * 1e3:7.1f} us {'ok' if ok else 'FAIL'} k{k}" for n, (ms, ok, k) in cells.items())
        + f"  counters left {left}  deterministic repeat {'same' if same else 'DIFFERENT'}", flush=True)

print("\nmeans over the cases run (us): arithmetic / geometric")
for name in fns:
    v = [cells[name][0] * 1e3 for _, _, cells in rows]
    print(f"  {name:24s} {sum(v) / len(v):8.1f} / {math.exp(sum(map(math.log, v)) / len(v)):8.1f}")
