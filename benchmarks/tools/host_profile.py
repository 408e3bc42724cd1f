"""The host's time in a training step, by function (cProfile): direct launches (CUDA graphs off), and a call
recorded into a graph each time (the cost of a recording), at a preset's block and tokens.

    PYTHONPATH=src python3 benchmarks/tools/host_profile.py gemma3-4b 2x1024 [wan2.1-1.3b 1x1560x100 ...]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from backfuse import nn as bnn
from backfuse import presets
from backfuse.bench import dynamic
from backfuse.kernels import graphs


def main(args) -> None:
    for name, tokens in zip(args[::2], args[1::2]):
        shape = tuple(int(t) for t in tokens.split("x"))
        preset = presets.get(name)
        cls = bnn.WanXattn if preset.problem == "021" else bnn.Gemma3Core
        module = cls(preset.config, device="cuda", dtype=torch.bfloat16, **preset.kwargs)
        (call,) = dynamic._make_calls(preset, preset.config, name, [shape], "cuda", 0)
        step = dynamic._stepper(preset, preset.config, name, "backfuse", module)
        for label, on, fresh in (("direct", False, False), ("recorded every call", True, True)):
            with graphs.cuda_graphs(on):
                for _ in range(3):
                    step(call)
                torch.cuda.synchronize()
                prof = cProfile.Profile()
                t0 = time.perf_counter()
                for _ in range(20):
                    if fresh:  # every kept graph dropped, its call due to be recorded again
                        for slot, exec_ in list(graphs._replays.items()):
                            graphs.driver().destroy_exec(exec_)
                            graphs._seen[slot] = graphs.RECORD_AT - 1
                        graphs._replays.clear()
                    prof.enable()
                    step(call)
                    prof.disable()
                torch.cuda.synchronize()
            print(f"== {name} {shape} {label}: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms a step")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    t0 = time.perf_counter()
    for _ in range(100):
        torch.cuda.memory_stats(0)
    print(f"memory_stats: {(time.perf_counter() - t0) * 1e4:.1f} us a call")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemma3-4b", "2x1024", "wan2.1-1.3b", "1x1560x100"])
