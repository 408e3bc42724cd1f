"""Timing as SOL-ExecBench does it (PROTOCOL.md).

Each timed call runs after an untimed L2 flush and an untimed copy of its inputs to fresh
addresses. A call's time is the GPU span from the start of its first kernel to the end of its last
one, on any stream, read from CUPTI activity records through torch.profiler (which, like the
official evaluator, also traces runtime and driver API calls, so host launch costs weigh the same).
CUDA events around each call give a cross-check.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import statistics
import tempfile
import warnings
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..callsite import BackfuseWarning

ALIGN = 256  # bytes between successive placements of the inputs
OPEN_API = "cudaStreamSynchronize"  # issued right before each timed call
CLOSE_API = "cudaDeviceSynchronize"  # right after it (the profiler issues some of its own too)
CALL_TAG = "backfuse.timed_call."  # host ranges, only where the trace lacks synchronization records
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_ACTIVITIES = ("cuda_runtime", "cuda_driver")


class L2Flush:
    """Zeroes a buffer of twice the L2 size, evicting whatever the last call left there."""

    def __init__(self, device: torch.device):
        size = 2 * torch.cuda.get_device_properties(device).L2_cache_size
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


class FreshInputs:
    """Copies the inputs into a pool at a new offset on every call (no two calls share addresses)."""

    def __init__(self, inputs: list, calls: int):
        self.inputs = inputs
        self.calls = calls
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        span = sum(_aligned(x.nbytes) for x in tensors)
        self.pool = torch.empty(span + ALIGN * calls, dtype=torch.uint8, device=tensors[0].device)
        self.count = 0

    def __call__(self) -> list:
        offset = ALIGN * (self.count % self.calls)
        self.count += 1
        placed = []
        for x in self.inputs:
            if not isinstance(x, torch.Tensor):
                placed.append(x)
                continue
            view = self.pool[offset : offset + x.nbytes].view(x.dtype).view(x.shape)
            view.copy_(x)
            placed.append(view)
            offset += _aligned(x.nbytes)
        return placed


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class Timing:
    span_ms: list  # CUPTI span per timed call
    event_ms: list  # CUDA-event time per timed call
    kernels_per_call: list  # device activities (kernels, memcpy, memset) per timed call
    launches_per_call: list  # kernel launches per timed call (kernels only)
    kernel_ms: dict  # device activity name -> mean time per call, ms
    busy_ms: list  # per timed call, the time at least one of its device activities ran (span minus idle gaps)

    @property
    def busy_median_ms(self) -> float:
        return statistics.median(self.busy_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.span_ms)

    @property
    def event_median_ms(self) -> float:
        return statistics.median(self.event_ms)


def time_calls(fn, inputs: list, *, warmup: int = 10, iters: int = 50) -> Timing:
    """Warm up, then time `iters` calls of fn on fresh copies of `inputs` with L2 flushed before each.

    Only CUDA activity is traced (kernels, memcpy, memset, runtime and driver API calls), as the
    official evaluator does: tracing host-side operators as well would slow every call. Each call
    sits between a stream synchronization and a device synchronization, whose API records delimit
    it in the trace.
    """
    device = next(x for x in inputs if isinstance(x, torch.Tensor)).device
    flush = L2Flush(device)
    fresh = FreshInputs(inputs, warmup + iters)
    for _ in range(warmup):
        flush()
        fn(*fresh())
    torch.cuda.synchronize(device)

    try:
        return _profiled_calls(fn, flush, fresh, device, iters, annotate=False)
    except MissingCallBoundaries as e:
        # Fall back to host ranges (tracing host operators too, which slows calls a little).
        warnings.warn(f"{e}; delimiting calls by host ranges instead", BackfuseWarning, stacklevel=2)
        return _profiled_calls(fn, flush, fresh, device, iters, annotate=True)


def _profiled_calls(fn, flush, fresh, device, iters: int, *, annotate: bool) -> Timing:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if annotate else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for i, (start, end) in enumerate(events):
            flush()
            args = fresh()
            torch.cuda.current_stream(device).synchronize()
            with record_function(f"{CALL_TAG}{i}") if annotate else contextlib.nullcontext():
                start.record()
                fn(*args)
                end.record()
                torch.cuda.synchronize(device)
    spans, counts, launches, kernel_ms, busy = call_spans(trace_events(prof), iters)
    return Timing(spans, [s.elapsed_time(e) for s, e in events], counts, launches, kernel_ms, busy)


class MissingCallBoundaries(RuntimeError):
    pass


@dataclass(frozen=True)
class TraceEvent:
    kind: str  # Kineto category: kernel, gpu_memcpy, cuda_runtime, user_annotation, ...
    name: str
    start_ns: float
    end_ns: float
    correlation: int | None


def trace_events(prof) -> list:
    """The profiler's events, read from its Chrome trace (a format stable across torch versions)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            raw = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return [
        TraceEvent(e.get("cat", ""), e.get("name", ""), 1e3 * float(e["ts"]), 1e3 * (float(e["ts"]) + float(e.get("dur", 0))),
                   (e.get("args") or {}).get("correlation"))
        for e in raw
        if e.get("ph") == "X"
    ]


def call_spans(events, iters: int) -> tuple:
    """Per timed call: (first device activity start .. last end) in ms, the device activity count and
    the kernel count (its launches: memcpy and memset are not kernels); per activity name, its mean
    time per call in ms; and per call the device's busy time in ms (the union of its activities'
    intervals: the span less the gaps where nothing of the call ran, e.g. waiting on the host).

    Call i runs from the end of the stream synchronization that opens it to the next device
    synchronization (or, in a trace with host ranges, over call i's range). A device
    activity belongs to call i when the API call that launched it (matched by CUPTI correlation id)
    lies between them; one whose launch is not in the trace (the profiler keeps no record of a
    graph launch through the driver API, `cuGraphLaunch`) goes by its own start time, which may
    fall while the host already waits in the closing synchronization: up to that wait's end, when
    the device has finished the call. Flushes and input copies are launched between calls and
    are dropped.
    """
    def api(name):
        return sorted((e for e in events if e.kind == "cuda_runtime" and e.name == name), key=lambda e: e.start_ns)

    closes = api(CLOSE_API)
    close_starts = [e.start_ns for e in closes]
    # A call may synchronize its stream itself (e.g. reading a result back): a call opens with the
    # first stream synchronization after the previous call's device synchronization.
    opens, seen = [], set()
    for o in api(OPEN_API):
        after = bisect.bisect(close_starts, o.start_ns)
        if after not in seen:
            seen.add(after)
            opens.append(o)
    ranges = sorted((e for e in events if e.kind == "user_annotation" and e.name.startswith(CALL_TAG)), key=lambda e: e.start_ns)
    if len(ranges) == iters:  # (opens, last launch, last device activity)
        windows = [(r.start_ns, r.end_ns, r.end_ns) for r in ranges]
    elif len(opens) == iters and all(bisect.bisect(close_starts, o.end_ns) < len(closes) for o in opens):
        windows = [(o.end_ns, closes[j].start_ns, closes[j].end_ns)
                   for o in opens for j in [bisect.bisect(close_starts, o.end_ns)]]
    else:
        raise MissingCallBoundaries(
            f"profiler trace holds {len(opens)} stream synchronizations (expected {iters}), "
            f"{len(closes)} device synchronizations and {len(ranges)} host ranges (expected {iters})"
        )
    opens = [w[0] for w in windows]
    launch_ns = {e.correlation: e.start_ns for e in events if e.kind in LAUNCH_ACTIVITIES and e.correlation is not None}
    first = [None] * iters
    last = [None] * iters
    count = [0] * iters
    launches = [0] * iters
    busy_ns = {}
    intervals = [[] for _ in range(iters)]
    for e in events:
        if e.kind not in DEVICE_ACTIVITIES:
            continue
        launched = launch_ns.get(e.correlation)
        t = e.start_ns if launched is None else launched
        call = bisect.bisect_right(opens, t) - 1
        if call < 0 or t > windows[call][1 if launched is not None else 2]:
            continue
        count[call] += 1
        launches[call] += e.kind == "kernel"
        busy_ns[e.name] = busy_ns.get(e.name, 0) + e.end_ns - e.start_ns
        intervals[call].append((e.start_ns, e.end_ns))
        first[call] = e.start_ns if first[call] is None else min(first[call], e.start_ns)
        last[call] = e.end_ns if last[call] is None else max(last[call], e.end_ns)
    spans = [((last[i] - first[i]) / 1e6 if count[i] else 0.0) for i in range(iters)]
    kernel_ms = {name: ns / 1e6 / iters for name, ns in busy_ns.items()}
    return spans, count, launches, kernel_ms, [_union_ns(i) / 1e6 for i in intervals]


def _union_ns(intervals) -> int:
    """The length of the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total
