"""Where backfuse's time goes when shapes change, and whether graphs and cuDNN's attention pay at a fixed shape.

    PYTHONPATH=src python3 benchmarks/tools/dynamic_study.py loop [ENTRY ...]   # default gemma3-4b wan2.1-1.3b
    PYTHONPATH=src python3 benchmarks/tools/dynamic_study.py fixed
    PYTHONPATH=src python3 benchmarks/tools/dynamic_study.py split [ENTRY ...]  # default packed, gemma3-4b, wan
    PYTHONPATH=src python3 benchmarks/tools/dynamic_study.py host [ENTRY ...]   # default packed, wan
    PYTHONPATH=src python3 benchmarks/tools/dynamic_study.py first [BEFORE ...] ENTRY

loop: `bench --dynamic`'s loop for backfuse, each step timed alone (synchronized) in the first pass (a compile or
a library's plan build shows as a spike), then both passes queued; with CUDA graphs on and off, and with cuDNN's
attention from a shape's first call (`plans.CUDNN_AFTER = 1`) against the default.
fixed: one shape, steps queued after enough warm-up for every plan to settle; graphs on / off, cuDNN's attention
(promoted) / ours.
split: `bench --dynamic`'s three implementations, the second pass queued as the bench queues it (ms and host us a
step), then a second pass at the shapes' tensors made anew (`_Anew`) under the profiler: the GPU's kernel time a
step, kernels a step and the heaviest kernels. A step whose kernel time is near its wall time is GPU-bound; one
whose host time is, host-bound.
host: where backfuse's host time goes in the second pass (each measured pass a second pass at the shapes' tensors
made anew, `_Anew`): the loop as the bench queues it; passes with Python's garbage collector on and off; a pass with
timers around the packed documents, `execute`, `Template.run`, each kind of template step and `torch.empty` (us a
step each, nested where the calls are; the rest is autograd, the functional layer and the bench's step), with the
graph counts over it (replayed, missed, direct, ...), the templates kept by state, and the caching allocator's
cudaMalloc / cudaFree counts; synchronizations (`set_sync_debug_mode("warn")`); a pass under cProfile by own time;
last, one of the loop's shapes replayed (the design's own cost, this process's host).
first: backfuse's first pass of ENTRY after `bench --dynamic`'s whole runs of the BEFORE entries in this process
(as the bench orders them): each step synchronized and timed, the Triton kernels compiled or loaded in each step
(by name, with the specialization's alignment and constexprs where they differ from the kernel's first), and the
pass's heaviest calls under cProfile by cumulative time. A step of hundreds of ms shows what it spent them on.
"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
import warnings
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from backfuse import cudnn_attention, presets
from backfuse import nn as bnn
from backfuse.bench import dynamic
from backfuse.kernels import graphs
from backfuse.train import masks, plans, program


def _setup(key, shape_list):
    preset = presets.get(key.split("/")[0])
    cls = bnn.WanXattn if preset.problem == "021" else bnn.Gemma3Core
    module = cls(preset.config, device="cuda", dtype=torch.bfloat16, **preset.kwargs)
    calls = dynamic._make_calls(preset, preset.config, key, shape_list, "cuda", 0)
    return dynamic._stepper(preset, preset.config, key, "backfuse", module), calls


class _Anew:
    """The loop's 12 shapes' tensors made anew at each call, every set held to the end: a pass at them, then a
    second, is `bench --dynamic`'s second pass (each call its shape's second at its addresses, no graph recorded),
    where passes over the same tensors would record and replay graphs from the third on."""

    def __init__(self, key, shapes):
        self.key, self.shapes, self.held = key, shapes, []
        self.preset = presets.get(key.split("/")[0])

    def second(self, step) -> list:
        """Fresh calls after their untimed first pass (the caller times the next)."""
        calls = dynamic._make_calls(self.preset, self.preset.config, self.key, self.shapes, "cuda",
                                    dynamic.SHAPES * (len(self.held) + 1))
        self.held.append(calls)
        dynamic._loop(step, calls)
        return calls


def loop(keys) -> None:
    default_after = plans.CUDNN_AFTER
    for key in keys:
        warm, shapes = dynamic.shapes(key)
        print(f"{key}: {shapes}")
        for name, on, after in (("graphs, cuDNN after 64", True, default_after), ("no graphs", False, default_after),
                                ("graphs, cuDNN at once", True, 1)):
            plans.CUDNN_AFTER = after
            plans._plans.clear()
            plans._pending.clear()
            graphs.release()
            with graphs.cuda_graphs(on):
                step, (warm_call, *calls) = _setup(key, [warm, *shapes])
                step(warm_call)
                times = []
                for c in calls:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(c)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                second, host = dynamic._loop(step, calls)
                third, host3 = dynamic._loop(step, calls)
            print(f"  {name:24s} 1st synced {sum(times) / len(times):7.2f} ms [{' '.join(f'{t:.0f}' for t in times)}]; "
                  f"2nd {second:.3f} ms (host {host:.0f} us); 3rd {third:.3f} (host {host3:.0f})")
    plans.CUDNN_AFTER = default_after


def fixed() -> None:
    for key, shape in (("gemma3-4b", (2, 4096)), ("gemma3-4b", (2, 1024)), ("gemma3-4b", (2, 512)),
                       ("gemma3-1b", (2, 512)), ("wan2.1-1.3b", (1, 32760, 512)), ("wan2.1-1.3b", (1, 1560, 100))):
        row = []
        for on in (True, False):
            for cudnn in (True, False):
                graphs.release()
                plans._plans.clear()
                plans._pending.clear()
                with graphs.cuda_graphs(on), cudnn_attention(cudnn):
                    step, (call,) = _setup(key, [shape])
                    for _ in range(plans.CUDNN_AFTER + 4):
                        step(call)
                    ms, host = dynamic._loop(step, [call] * 30)
                row.append(f"{'graphs' if on else 'direct'}{'+cudnn' if cudnn else ''} {ms:.3f} ({host:.0f} us)")
        print(f"{key} {shape}: " + "; ".join(row))


def split(keys, top: int = 6) -> None:
    for key in keys:
        preset = presets.get(key.split("/")[0])
        cls = bnn.WanXattn if preset.problem == "021" else bnn.Gemma3Core
        module = cls(preset.config, device="cuda", dtype=torch.bfloat16, **preset.kwargs)
        warm, shapes = dynamic.shapes(key)
        warm_call, *calls = dynamic._make_calls(preset, preset.config, key, [warm, *shapes], "cuda", 0)
        for impl in dynamic.IMPLEMENTATIONS:
            graphs.release()
            step = dynamic._stepper(preset, preset.config, key, impl, module)
            step(warm_call)
            dynamic._loop(step, calls)
            ms, host = dynamic._loop(step, calls)
            again = _Anew(key, shapes).second(step)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                dynamic._loop(step, again)
            by = defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    by[e.name][0] += 1
                    by[e.name][1] += e.device_time / 1e3
            n = len(calls)
            gpu = sum(t for _, t in by.values()) / n
            print(f"{key} {impl}: {ms:.3f} ms a step, host {host:.0f} us, kernels {gpu:.3f} ms "
                  f"({sum(c for c, _ in by.values()) / n:.0f} a step)")
            for name, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
                print(f"    {t / n:7.3f} ms {c / n:5.1f}x  {name[:90]}")
            del step
            torch.cuda.empty_cache()


class _Timers:
    """Wall time and calls of wrapped callables by label, the wrappers undone by `undo`."""

    def __init__(self):
        self.time, self.calls, self._undo = defaultdict(float), Counter(), []

    def wrap(self, owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.time[label] += time.perf_counter() - t0
                self.calls[label] += 1
        setattr(owner, name, timed)
        self._undo.append((owner, name, f))

    def undo(self) -> None:
        for owner, name, f in reversed(self._undo):
            setattr(owner, name, f)
        self._undo.clear()


def _allocator() -> dict:
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def host(keys) -> None:
    for key in keys:
        preset = presets.get(key.split("/")[0])
        warm, shapes = dynamic.shapes(key)
        step, (warm_call, *calls) = _setup(key, [warm, *shapes])
        anew = _Anew(key, shapes)
        graphs.release()
        step(warm_call)
        dynamic._loop(step, calls)
        ms, host_us = dynamic._loop(step, calls)
        print(f"{key}: loop {ms:.3f} ms, host {host_us:.0f} us a step", flush=True)
        collected = {True: [], False: []}
        for i in range(6):  # Python's garbage collector on and off, alternating passes
            on = i % 2 == 0
            calls = anew.second(step)
            (gc.enable if on else gc.disable)()
            collected[on].append(dynamic._loop(step, calls)[1])
        gc.enable()
        print(f"  host us a step, the collector on / off: {statistics.median(collected[True]):.0f} / "
              f"{statistics.median(collected[False]):.0f}", flush=True)
        timers = _Timers()
        timers.wrap(program.Template, "run", "Template.run")
        timers.wrap(masks, "documents", "masks.documents")
        timers.wrap(torch, "empty", "torch.empty")
        training = sys.modules[f"backfuse.ops.{'wan_xattn' if preset.problem == '021' else 'gemma3_core'}.training"]
        timers.wrap(training, "execute", "execute")
        kept = [(t, t.steps) for t in program._templates.values() if isinstance(t, program.Template)]
        for template, steps in kept:
            template.steps = [_timed_step(timers, s, "template step " + getattr(s, "__qualname__", "?").split(".<")[0])
                              for s in steps]
        calls = anew.second(step)
        before, counted = _allocator(), dict(graphs.counts)
        t_ms, t_host = dynamic._loop(step, calls)
        after = _allocator()
        moved = {k: v - counted.get(k, 0) for k, v in graphs.counts.items() if v != counted.get(k, 0)}
        timers.undo()
        for template, steps in kept:
            template.steps = steps
        n = len(calls)
        print(f"  timed pass {t_ms:.3f} ms, host {t_host:.0f} us a step; allocator over the pass: "
              + ", ".join(f"{k} +{after[k] - before[k]}" for k in before))
        kinds = Counter("template" if isinstance(t, program.Template) else str(t) for t in program._templates.values())
        print(f"  graphs over the pass: {moved}; templates kept: {dict(kinds)}")
        for label, t in sorted(timers.time.items(), key=lambda kv: -kv[1]):
            print(f"    {label:34s} {t / n * 1e6:8.1f} us a step ({timers.calls[label] / n:.1f} calls, "
                  f"{t / timers.calls[label] * 1e6:.1f} us each)")
        calls = anew.second(step)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                dynamic._loop(step, calls)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # (torch's notice, once a process, that the debug mode is a prototype is not a synchronization)
        syncs = [str(w.message)[:100] for w in caught if "synchroniz" in str(w.message).lower()
                 and not str(w.message).startswith("Synchronization debug mode is a prototype")]
        print(f"  synchronizations in a pass: {len(syncs)} {syncs[:2]}")
        calls = anew.second(step)
        profiler = cProfile.Profile()
        profiler.enable()
        dynamic._loop(step, calls)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        # last: 72 calls at one shape pass plans.CUDNN_AFTER, which the loop's shapes (at most 3 calls each in
        # bench --dynamic) never reach, and would move that shape's attention to cuDNN for the passes above
        one = [calls[len(calls) // 2]] * len(calls)
        for _ in range(6):
            one_ms, one_host = dynamic._loop(step, one)
        print(f"  one of its shapes replayed: {one_ms:.3f} ms, host {one_host:.0f} us a step", flush=True)
        del step
        torch.cuda.empty_cache()


def first(keys) -> None:
    import triton

    *before, key = keys
    for each in before:
        print(f"{each}: the bench's run", flush=True)
        dynamic.run_entry(each, "cuda")
    compiled = []
    hook = triton.knobs.runtime.jit_post_compile_hook

    def seen(*args, **kwargs):
        compiled.append((getattr(kwargs.get("fn"), "name", "?"), str(kwargs.get("key", ""))[:200]))
        return hook(*args, **kwargs) if hook is not None else None
    triton.knobs.runtime.jit_post_compile_hook = seen
    try:
        graphs.release()
        warm, shapes = dynamic.shapes(key)
        step, (warm_call, *calls) = _setup(key, [warm, *shapes])
        step(warm_call)
        torch.cuda.synchronize()
        print(f"{key}: warm-up compiled or loaded {len(compiled)} kernels; TRITON_CACHE_DIR "
              f"{os.environ.get('TRITON_CACHE_DIR')}", flush=True)
        compiled.clear()
        profiler = cProfile.Profile()
        times, per_step = [], []
        for c, shape in zip(calls, shapes):
            torch.cuda.synchronize()
            profiler.enable()
            t0 = time.perf_counter()
            step(c)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            profiler.disable()
            per_step.append(list(compiled))
            compiled.clear()
        print(f"  first pass synced: {sum(times) / len(times):.2f} ms a step")
        for t, shape, kernels in zip(times, shapes, per_step):
            names = Counter(name for name, _ in kernels)
            print(f"    {t:8.1f} ms {str(shape)[:40]:40s} {dict(names) if names else ''}")
            for name, k in kernels[:4]:
                print(f"        {name}: {k}")
        second, host_us = dynamic._loop(step, calls)
        print(f"  second pass {second:.3f} ms, host {host_us:.0f} us a step")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook
    del step
    torch.cuda.empty_cache()


def _timed_step(timers: _Timers, step, label: str):
    def timed(*args):
        t0 = time.perf_counter()
        step(*args)
        timers.time[label] += time.perf_counter() - t0
        timers.calls[label] += 1
    return timed


if __name__ == "__main__":
    if sys.argv[1:2] == ["fixed"]:
        fixed()
    elif sys.argv[1:2] == ["host"]:
        host(sys.argv[2:] or ["gemma3-4b/packed", "wan2.1-1.3b"])
    elif sys.argv[1:2] == ["first"]:
        first(sys.argv[2:] or ["gemma3-1b", "gemma3-4b", "gemma2-9b", "gemma3-4b/packed"])
    elif sys.argv[1:2] == ["split"]:
        split(sys.argv[2:] or ["gemma3-4b/packed", "gemma3-4b", "wan2.1-1.3b"])
    else:
        loop(sys.argv[2:] or ["gemma3-4b", "wan2.1-1.3b"])
