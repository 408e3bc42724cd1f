"""Where backfuse's time goes in `bench --dynamic`'s loop: each step timed alone (synchronized), with CUDA graphs
on and off, and the graph cache's counts per pass.

    PYTHONPATH=src python3 benchmarks/tools/dynamic_study.py [ENTRY ...]     # default gemma3-4b wan2.1-1.3b
"""

from __future__ import annotations

import sys
import time

import torch

from backfuse import nn as bnn
from backfuse import presets
from backfuse.bench import dynamic
from backfuse.kernels import graphs


def per_step(step, calls) -> list:
    out = []
    for c in calls:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(c)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(keys) -> None:
    for key in keys:
        preset = presets.get(key.split("/")[0])
        warm, loop = dynamic.shapes(key)
        cls = bnn.WanXattn if preset.problem == "021" else bnn.Gemma3Core
        module = cls(preset.config, device="cuda", dtype=torch.bfloat16, **preset.kwargs)
        warm_call, *calls = dynamic._make_calls(preset, preset.config, key, [warm, *loop], "cuda", 0)
        print(f"{key}: shapes {loop}")
        for on in (True, False):
            graphs.release()
            with graphs.cuda_graphs(on):
                step = dynamic._stepper(preset, preset.config, key, "backfuse", module)
                step(warm_call)
                for name in ("first", "second", "third"):
                    before = dict(graphs.counts)
                    if name == "third":
                        ms, host = dynamic._loop(step, calls)
                        print(f"  graphs {on}: {name} (queued) {ms:.3f} ms, host {host:.0f} us")
                        continue
                    times = per_step(step, calls)
                    counts = {k: v - before.get(k, 0) for k, v in graphs.counts.items() if v - before.get(k, 0)}
                    print(f"  graphs {on}: {name} pass synced mean {sum(times) / len(times):.3f} ms; "
                          + " ".join(f"{t:.1f}" for t in times) + f"; {counts}")
        for impl in ("hf",):
            step = dynamic._stepper(preset, preset.config, key, impl, module)
            step(warm_call)
            times = per_step(step, calls)
            print(f"  {impl}: synced " + " ".join(f"{t:.1f}" for t in times))
            ms, host = dynamic._loop(step, calls)
            print(f"  {impl}: queued {ms:.3f} ms, host {host:.0f} us")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemma3-4b", "wan2.1-1.3b"])
