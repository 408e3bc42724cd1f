"""The kernels of one training step (forward + backward) of an implementation, with their GPU times, from
the profiler: where a step's GPU time goes. At an official case (`bench --train`'s implementations) or at
a preset layer and token count (`bench --models`' keys and implementations).

    PYTHONPATH=src python3 benchmarks/tools/train_kernels.py 072 0 backfuse_bf16 compile_bf16
    PYTHONPATH=src python3 benchmarks/tools/train_kernels.py gemma3-4b/1x4096/local backfuse compile_bf16
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import backfuse
from backfuse.bench import models
from backfuse.bench.train import Layer


def layer_of(what: str, case: str, impl: str):
    """(title, layer) of an official case ("072", "0") or of a `bench --models` key."""
    if "/" in what:
        for key, preset, local, tokens in models.entries([what.split("/")[0]]):
            if key == what:
                return what, models.ModelLayer(preset, local, tokens, impl, "cuda")
        raise SystemExit(f"no --models key {what!r}; e.g. {models.entries()[0][0]}")
    prob = backfuse.problem(what)
    return f"{prob.id} case {case}", Layer(prob, prob.workloads[int(case)].axes, impl, "cuda")


def idle(spans) -> float:
    """The time (us) between the first kernel's start and the last one's end with no kernel running."""
    spans, gaps = sorted(spans), 0.0
    reach = spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        gaps += max(0.0, start - reach)
        reach = max(reach, end)
    return gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", help="an operator id, or a `bench --models` key (preset/tokens[/local])")
    ap.add_argument("rest", nargs="+", help="the case index (operators only), then implementations")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    case, impls = (None, args.rest) if "/" in args.what else (args.rest[0], args.rest[1:])
    for impl in impls:
        title, layer = layer_of(args.what, case, impl)
        for _ in range(5):
            layer.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer.step()
            torch.cuda.synchronize()
        times = defaultdict(float)
        counts = defaultdict(int)
        spans = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name[:70]] += e.device_time_total / 3
                counts[e.name[:70]] += 1
                spans.append((e.time_range.start, e.time_range.end))
        total = sum(times.values())
        print(f"{title} {impl}: {total / 1e3:.3f} ms of kernels per step, {sum(counts.values()) // 3} kernels, "
              f"GPU idle between them {idle(spans) / 3e3:.3f} ms per step")
        for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {t / 1e3:8.3f} ms  x{counts[name] // 3:<3d} {name}")
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
