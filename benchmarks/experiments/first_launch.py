"""Why a call's first launch is slow on the host, and whether host work before it can make it fast.

    PYTHONPATH=src python benchmarks/experiments/first_launch.py [--rounds 3]

Session 22's traces (runs.md timeline-s22) of 021's small cases: the first launch of a call (the
pack) spends 8.5-22.3 µs in its API call, the next ones 4.8-8.0; the forward starts ≈ 8-10 µs after
its API call begins. On case 8 the pack (8.3 µs) is over before the forward has been launched, so
the span waits on the host for 5-12 µs. Host work before the first launch is free on the official
clock (its span opens with the first device activity); if the first launch is slow because the
host thread comes back cold from the harness's stream synchronization, a cheap call into the driver
just before it might shorten that launch.

Variants, each inserted right before the operator's first launch (patched into its first
`FastKernel`'s prepared launch; no device activity):
- "none": as the library does today;
- "query": `torch.cuda.current_stream().query()` (cudaStreamQuery: the driver, the stream's state);
- "query x3": three of them;
- "spin 20us": the host busy for 20 µs in Python (does the core's clock or cache matter?).

Prediction (before the run): "query" shortens the first API call toward the others' 5-8 µs, so on
021 case 8 the span drops by 3-8 µs; cases whose pack outlasts the host's launches (021 case 2, 072
case 3, 037 case 8) do not move. "spin" changes nothing.

Measured (runs.md first-launch-s22, notes/021.md row 36): no variant moves any case beyond the
noise (021 case 8 53.7 / 53.8 / 54.2 / 54.4 µs for none / query / query x3 / spin): not a cold path.

Prints, per case and variant, the median official span over `rounds` alternating timings of 50 calls.
"""

import argparse
import statistics
import time

import torch

import backfuse
from backfuse.bench.timing import time_calls
from backfuse.ops.gemma3_core import backward as b037
from backfuse.ops.qkv_gqa import backward as b072
from backfuse.ops.wan_xattn import backward as b021

FIRST = {"021": b021.PACK, "072": b072.PACK, "037": b037.PACK}


def _spin(us):
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


WARMUPS = {
    "none": None,
    "query": lambda: torch.cuda.current_stream().query(),
    "query x3": lambda: [torch.cuda.current_stream().query() for _ in range(3)],
    "spin 20us": lambda: _spin(20),
}


def patched(kernel, warm):
    """Make kernel.prepare return launches that call warm() first (None: restore)."""
    kernel.__dict__.pop("prepare", None)
    if warm is None:
        return
    original = kernel.prepare

    def prepare(*args, **meta):
        launch = original(*args, **meta)

        def warmed():
            warm()
            launch()

        return warmed

    kernel.prepare = prepare


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="021:8,021:12,021:2,021:13,021:3,072:3,072:12,037:8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for item in args.cases.split(","):
        pid, index = item.split(":")
        prob = backfuse.problem(pid)
        x = prob.make_inputs(prob.workloads[int(index)].axes, seed=0, device="cuda")
        spans = {name: [] for name in WARMUPS}
        for _ in range(args.rounds):
            for name, warm in WARMUPS.items():
                patched(FIRST[pid], warm)
                spans[name].append(time_calls(prob.run, x).median_ms * 1e3)
        patched(FIRST[pid], None)
        cells = "  ".join(f"{name} {statistics.median(v):6.1f}" for name, v in spans.items())
        print(f"{pid} case {index:>2s}: {cells}   (µs; rounds: "
              + "; ".join(f"{n} " + "/".join(f"{s:.1f}" for s in v) for n, v in spans.items()) + ")", flush=True)


if __name__ == "__main__":
    main()
