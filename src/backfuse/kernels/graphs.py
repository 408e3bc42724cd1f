"""A fused call's launches as one CUDA graph: one host launch, the kernels back to back on the device.

Each launch costs the host 14-40 us (notes/021.md row 36, PROTOCOL.md); where a call's kernels are
shorter than that, the device waits between them, and the official clock counts the wait (it times
from the first kernel's start to the last one's end; host work before the first launch is not
counted). Here the host records the call's prepared launches into a graph (stream capture on a
stream of our own: nothing runs while recording), then launches the graph on the caller's stream:

    capture(launches) -> graph            # each launch records a node; our kernels, cuBLAS's
    exec = update(cached exec, graph)     # new addresses into the nodes (cuGraphExecUpdate), or
                                          # instantiate where none is cached or the topology changed
    cuGraphLaunch(exec, caller's stream)  # PDL launches keep their programmatic edges in the graph

What is cached is the executable graph of a plan (its topology, like a compiled kernel); every call
records its own launches and writes its own addresses into it, so nothing of one call's data or
work carries to the next. Kernels that wait on device counters keep their residency check (it runs
when the launch is prepared).

The driver API comes through ctypes from libcuda (torch exposes capture and replay but not
cuGraphExecUpdate). `enabled(device, launches)` says when a call takes this path: on a CUDA device,
with graphs on (`cuda_graphs`), more than one launch (recording one saves nothing), the caller not
capturing a graph itself (its capture then records our launches), every launch graphable (a first
launch compiles through Triton's JIT, which stays out of captures: `FastKernel.prepare` marks it
`graphable = False`), and libcuda offering the entry points. A capture that fails is undone, warned
about once per plan, and the call runs its launches directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import torch

from .. import callsite
from ..callsite import BackfuseWarning

CAPTURE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: cuBLAS may allocate its workspace while we record
EXECS_KEPT = 64  # executable graphs kept (one per plan and stream, most recently used last)

_enabled = True
_driver = None
FAILED = 0  # what _execs holds for a plan whose recording failed: its calls launch directly
_execs: OrderedDict = OrderedDict()  # _Slot((key, device, stream)) -> CUgraphExec handle, or FAILED
_capture_streams: dict = {}  # (device index, thread, caller's stream) -> torch.cuda.Stream used only for recording
counts: Counter = Counter()  # graphs instantiated, updated and launched, calls launched directly (tests read it)


class GraphWarning(BackfuseWarning):
    """A fused call could not be recorded as a CUDA graph and launched its kernels one by one."""


@contextlib.contextmanager
def cuda_graphs(enabled: bool):
    """Launch fused calls as one CUDA graph each (the default on a GPU) or kernel by kernel inside the block."""
    global _enabled
    saved, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = saved


class _UpdateResult(ctypes.Structure):
    _fields_ = [("result", ctypes.c_int), ("error_node", ctypes.c_void_p), ("error_from_node", ctypes.c_void_p)]


class Driver:
    """The few libcuda entry points a graph needs, each raising RuntimeError with CUDA's message on failure."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        p, u64 = ctypes.c_void_p, ctypes.c_ulonglong
        for name, args in (("cuStreamBeginCapture_v2", [p, ctypes.c_int]), ("cuStreamEndCapture", [p, ctypes.POINTER(p)]),
                           ("cuGraphInstantiateWithFlags", [ctypes.POINTER(p), p, u64]),
                           ("cuGraphExecUpdate_v2", [p, p, ctypes.POINTER(_UpdateResult)]),
                           ("cuGraphLaunch", [p, p]), ("cuGraphDestroy", [p]), ("cuGraphExecDestroy", [p]),
                           ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def check(self, code: int, what: str) -> None:
        if code:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA error {code} ({(msg.value or b'?').decode()})")

    def capture(self, stream: int, record: Callable[[], None]) -> int:
        """The graph that record() builds by launching on `stream` (captured, not run)."""
        self.check(self.lib.cuStreamBeginCapture_v2(stream, CAPTURE_RELAXED), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            record()
        except BaseException:  # end the capture, so that the stream is usable again, and drop its graph
            if self.lib.cuStreamEndCapture(stream, ctypes.byref(graph)) == 0 and graph.value:
                self.destroy_graph(graph.value)
            raise
        self.check(self.lib.cuStreamEndCapture(stream, ctypes.byref(graph)), "cuStreamEndCapture")
        return graph.value

    def instantiate(self, graph: int) -> int:
        exec_ = ctypes.c_void_p()
        self.check(self.lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0), "cuGraphInstantiate")
        return exec_.value

    def update(self, exec_: int, graph: int) -> bool:
        """Whether exec_ took graph's node parameters (false: another topology; exec_ then unchanged)."""
        info = _UpdateResult()
        return self.lib.cuGraphExecUpdate_v2(exec_, graph, ctypes.byref(info)) == 0

    def launch(self, exec_: int, stream: int) -> None:
        self.check(self.lib.cuGraphLaunch(exec_, stream), "cuGraphLaunch")

    def destroy_graph(self, graph: int) -> None:
        self.lib.cuGraphDestroy(graph)

    def destroy_exec(self, exec_: int) -> None:  # one in flight is freed once it completes
        self.lib.cuGraphExecDestroy(exec_)


def driver() -> Driver | None:
    """libcuda's graph entry points, or None where libcuda lacks them (then calls launch directly)."""
    global _driver
    if _driver is None:
        try:
            _driver = Driver(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


def enabled(device: torch.device, launches: Sequence) -> bool:
    """Whether a call on `device` with these prepared launches runs as a graph (see the module's docstring)."""
    return (_enabled and device.type == "cuda" and len(launches) > 1 and not torch.cuda.is_current_stream_capturing()
            and all(getattr(launch, "graphable", True) for launch in launches) and driver() is not None)


class _Slot:
    """A cache key whose hash is computed once (a plan's hash walks every field; the plan object
    itself is the driver's kept one, so equal keys compare by identity first)."""

    __slots__ = ("key", "hash")

    def __init__(self, key):
        self.key, self.hash = key, hash(key)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self.key == other.key


def run(key, device: torch.device, launches: Sequence[Callable[[], None]]) -> None:
    """Run the prepared launches on the current stream as one graph; `key` names the plan they follow
    (equal keys: the same kernels and grids, so a cached executable graph takes the new addresses)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    slot = _Slot((key, index, stream.cuda_stream))
    exec_ = _execs.pop(slot, None)
    if exec_ == FAILED:
        _keep(slot, FAILED)
        counts["direct"] += 1
        return _direct(launches)
    drv = driver()
    # One recording stream per device, thread and caller's stream: two threads' captures must not
    # share a stream, and cuBLAS's workspace is per stream recorded on, so graphs launched on two
    # streams at once must not have been recorded on one.
    where = (index, threading.get_ident(), stream.cuda_stream)
    recorder = _capture_streams.get(where)
    if recorder is None:
        recorder = _capture_streams[where] = torch.cuda.Stream(index)
    torch.cuda.set_stream(recorder)  # what torch launches (cuBLAS) goes to the recording stream too
    try:
        with _pooled(where):
            graph = drv.capture(recorder.cuda_stream, lambda: _direct(launches))
    except Exception as e:  # noqa: BLE001 - any failure to record leaves the direct launches, which raise real errors
        torch.cuda.set_stream(stream)  # the direct launches go to the caller's stream, not the recording one
        if exec_ is not None:
            drv.destroy_exec(exec_)
        _keep(slot, FAILED)
        callsite.warn(f"backfuse: this call's launches could not be recorded as a CUDA graph ({e}); "
                      "calls of this shape launch their kernels one by one", GraphWarning)
        counts["direct"] += 1
        return _direct(launches)
    finally:
        torch.cuda.set_stream(stream)
    try:
        if exec_ is not None:
            if drv.update(exec_, graph):
                counts["updated"] += 1
            else:
                drv.destroy_exec(exec_)
                exec_ = None
        if exec_ is None:
            exec_ = drv.instantiate(graph)
            counts["instantiated"] += 1
    finally:
        drv.destroy_graph(graph)
    _keep(slot, exec_)
    drv.launch(exec_, stream.cuda_stream)
    counts["launched"] += 1


# The training paths' executables, by plan and by every address they read or write (`replay`).
REPLAYS_KEPT = 512  # executable graphs kept (least recently launched out first)
RECORD_AT = 3  # a slot's call at which it is recorded (notes/training.md, session 35)
SEEN_KEPT = 4096  # slots launched directly, with their calls so far
_replays: OrderedDict = OrderedDict()  # (key, addresses, device, stream) -> CUgraphExec handle
_seen: OrderedDict = OrderedDict()  # (key, addresses, device, stream) -> calls so far, none recorded


def replay(key, addresses: tuple, device: torch.device, build: Callable[[], Sequence[Callable[[], None]]],
           direct: Callable[[], None] | None = None) -> None:
    """Run a training call's launches as a CUDA graph kept for these exact addresses, once they recur.

    A training loop calls a layer at the same addresses step after step (the caching allocator hands
    back the blocks the last step freed), so the executable graph recorded for (key, addresses) is
    launched again with nothing recorded or updated: one cuGraphLaunch of host work. `addresses`
    must name every tensor the launches touch (inputs, outputs, scratch); `key` everything else the
    graph depends on (shapes, dtypes, options, the scalars baked into kernel arguments). On a miss
    build() prepares the launches; they are recorded only at the RECORD_AT-th call of the same (key,
    addresses), once it has shown that it recurs: instantiating a graph costs the host 1.2-2.3 ms (H200
    host, Gemma 3 4B's and Wan's calls), more than launching the call directly, and pays back only over
    replays, so a call whose shape or addresses change every step (batches of changing lengths) or come
    back only once launches directly. (Where the step is GPU-bound a graph still saves the gaps between
    kernels: 4 % at Gemma 3 4B's 2 x 4096 tokens.) Both caches are bounded, the least recently used out
    first. Direct launches also where `enabled` says no graph can run (the
    first call of a kernel compiles it), for a key whose recording failed or whose call is one launch (never
recorded, so its later calls take `direct`), and inside `cuda_graphs(False)`
    (a graph kept from before the switch included). `direct`, where given,
    launches a call that is not recorded in place of build()'s launches (the key's template of them:
    `train/program.py: execute`).
    """
    stream = raw_stream(device.index)
    slot = (key, addresses, device.index, stream)
    exec_ = _replays.get(slot) if _enabled else None  # (switched off: kept graphs wait, calls launch directly)
    if exec_ is not None:
        _replays.move_to_end(slot)
        counts["replayed"] += 1
        _driver.launch(exec_, stream)
        return
    counts["missed"] += 1
    calls = _seen.pop(slot, 0) + 1
    recording = (calls >= RECORD_AT and key not in _unrecordable and _enabled and not torch.cuda.is_current_stream_capturing()
                 and driver() is not None)
    launches = list(build()) if recording else None
    if launches is not None and len(launches) < 2:
        # A graph of one launch saves nothing (`enabled`), at any later call too: the key joins those never
        # recorded, so its later calls run `direct` (its template), not build() and prepare its launch again.
        _never_record(key)
        counts["direct"] += 1
        return _direct(launches)
    if launches is None or not enabled(device, launches):
        _seen[slot] = calls
        while len(_seen) > SEEN_KEPT:
            _seen.popitem(last=False)
        counts["direct"] += 1
        if launches is None and direct is not None:
            return direct()
        return _direct(build() if launches is None else launches)
    drv = driver()
    graph = _record(drv, device.index, torch.cuda.current_stream(device.index), launches)
    if graph is None:
        _never_record(key)
        return
    try:
        exec_ = drv.instantiate(graph)
    finally:
        drv.destroy_graph(graph)
    counts["instantiated"] += 1
    _replays[slot] = exec_
    while len(_replays) > REPLAYS_KEPT:
        drv.destroy_exec(_replays.popitem(last=False)[1])
    drv.launch(exec_, stream)
    counts["launched"] += 1


UNRECORDABLE_KEPT = 4096  # keys never recorded, kept (packed batches make one a token and document count)
_unrecordable: OrderedDict = OrderedDict()  # keys whose launches could not be, or need not be, recorded -> None


def _never_record(key) -> None:
    """Later calls of key launch directly (by their template where given), the oldest such key forgotten first."""
    _unrecordable[key] = None
    _unrecordable.move_to_end(key)
    while len(_unrecordable) > UNRECORDABLE_KEPT:
        _unrecordable.popitem(last=False)


def raw_stream(index: int) -> int:
    """The current stream's handle on device `index` (no Python stream object made)."""
    return torch._C._cuda_getCurrentRawStream(index)


def _allocated(index: int) -> int:
    return torch.cuda.memory_stats(index).get("allocation.all.allocated", 0)


_warm_operands: dict = {}  # device index -> the warm-up products' operands (fp16, bf16)


def _recorder(index: int, stream) -> torch.cuda.Stream:
    """Our recording stream for (device, thread, caller's stream), its cuBLAS workspaces taken (`_warm`)."""
    where = (index, threading.get_ident(), stream.cuda_stream)
    recorder = _capture_streams.get(where)
    if recorder is None:
        recorder = _capture_streams[where] = torch.cuda.Stream(index)
    _warm(recorder, index)
    return recorder


def _warm(recorder, index: int) -> None:
    """A product of each form the training paths record, queued on the recording stream before every
    recording (the host does not wait for it): cuBLAS takes a workspace per stream at its first product
    there, which must not happen while a call is recorded, and torch frees every workspace when a capture
    of its own begins (`torch.cuda.graph`, compile's CUDA graphs), so that one taken once may be gone."""
    operands = _warm_operands.get(index)
    if operands is None:
        device = torch.device("cuda", index)
        operands = _warm_operands[index] = [torch.ones(64, 64, dtype=d, device=device) for d in (torch.float16,
                                                                                                torch.bfloat16)]
    with torch.cuda.stream(recorder):
        for a in operands:
            torch.mm(a, a, out_dtype=torch.float32)
            torch.mm(a, a.T)
            torch.addmm(a[0], a, a.T)


def _record(drv, index: int, stream, launches):
    """The graph of the launches recorded on our recording stream for (device, thread, caller's
    stream), or None after a warning and direct launches when recording fails. Recording must not
    allocate: a block taken from torch's caching allocator while recording (a temporary of a torch op)
    would go back to the pool and to other tensors while the graph still uses it, so every buffer is
    made before, and a recording during which a launch allocates is dropped, the launches that may have
    allocated (torch's ops) named in the warning. The allocator's count is read before and after the
    recording and around each `Allocating` step (whose memory comes from the recording's pool), not
    around every launch: one read costs the host ~150 us. (Python's garbage collector is held off
    meanwhile: what it frees is no concern, but it allocates nothing either.)"""
    recorder = _recorder(index, stream)
    pooled = [0]

    def record():
        for launch in launches:
            if isinstance(launch, Allocating):
                before = _allocated(index)
                launch()
                pooled[0] += _allocated(index) - before
            else:
                launch()

    collecting = gc.isenabled()
    gc.disable()
    torch.cuda.set_stream(recorder)
    try:
        start = _allocated(index)
        with _pooled((index, threading.get_ident(), stream.cuda_stream)):
            graph = drv.capture(recorder.cuda_stream, record)
        allocated = _allocated(index) - start - pooled[0]
    except Exception as e:  # noqa: BLE001 - any failure to record leaves the direct launches, which raise real errors
        torch.cuda.set_stream(stream)
        callsite.warn(f"backfuse: this call's launches could not be recorded as a CUDA graph ({e}); "
                      "calls of this shape launch their kernels one by one", GraphWarning)
        counts["direct"] += 1
        _direct(launches)
        return None
    finally:
        torch.cuda.set_stream(stream)
        if collecting:
            gc.enable()
    if allocated:
        drv.destroy_graph(graph)
        ops = sorted({w for w in (getattr(launch, "what", "") for launch in launches) if w.startswith("torch")})
        callsite.warn("backfuse: a launch allocated memory while recorded into a CUDA graph (torch's ops here: "
                      f"{', '.join(ops) or 'none named'}); calls of this shape launch their kernels one by one",
                      GraphWarning)
        counts["direct"] += 1
        _direct(launches)
        return None
    return graph


def _keep(slot, exec_) -> None:
    """Keep slot's executable graph (or FAILED) as the most recently used; drop the oldest past EXECS_KEPT."""
    _execs[slot] = exec_
    while len(_execs) > EXECS_KEPT:
        old = _execs.popitem(last=False)[1]
        if old != FAILED:
            driver().destroy_exec(old)


_pools: dict = {}  # (device index, thread, caller's stream) -> torch.cuda.MemPool of the allocating launches
_recording = threading.local()  # .pool: the pool of the recording under way on this thread (none: absent or None)
_ran: set = set()  # keys of allocating launches run once outside a recording


@contextlib.contextmanager
def _pooled(where):
    """While recording for (device, thread, caller's stream): the allocating launches of this thread take
    their memory from that recording's pool. Per thread: two threads record at once (a stream each), and a
    process-wide slot was left holding one's pool when their recordings interleaved (s51-3), so every later
    direct allocating launch took its memory from that pool while graphs using it could run."""
    pool = _pools.get(where)
    if pool is None:
        pool = _pools[where] = torch.cuda.MemPool()
    saved = getattr(_recording, "pool", None)
    _recording.pool = pool
    try:
        yield
    finally:
        _recording.pool = saved


def pool_bytes() -> int:
    """The bytes the allocating steps' pools hold: memory the recorded graphs keep using, which torch's
    allocated-memory statistics do not show once it is free in the pool."""
    return sum(segment["total_size"] for pool in _pools.values() for segment in pool.snapshot())


def release() -> None:
    """Destroy every kept executable graph and drop the allocating steps' pools (their memory back to torch's
    allocator, to give back with torch.cuda.empty_cache()); later calls record their graphs afresh."""
    drv = driver()
    for cache in (_execs, _replays):
        while cache:
            exec_ = cache.popitem()[1]
            if exec_ != FAILED and drv is not None:
                drv.destroy_exec(exec_)
    _seen.clear()
    if _pools:
        torch.cuda.synchronize()  # the graphs' last launches may still use the pools' memory
        _pools.clear()


class Allocating:
    """A launch step that allocates what it makes (a library's op returning new tensors, as cuDNN's
    attention through PyTorch), then runs the launches that `then(*outputs)` prepares for them.

    Recorded into a graph, the op's allocations come from a memory pool of the recording's own (per
    device, thread and caller's stream: `_pooled`) and go back to it once `then`'s launches are recorded.
    The graph keeps their addresses; nothing but the allocating launches recorded for that stream ever
    takes that memory, and graphs launched on one stream run one after the other, so no two graphs
    using a block run at once, and no tensor outside them gets one. Run directly (not recorded), it
    allocates as any torch op. Its first run for a `key` is direct: a library's first call may build
    plans and synchronize, and `then`'s kernels compile at their first launch."""

    def __init__(self, key, op: Callable[[], tuple], then: Callable[..., Sequence[Callable[[], None]]], what: str):
        self.key, self.op, self.then, self.what = key, op, then, what
        self.graphable = key in _ran

    def __call__(self) -> None:
        pool = getattr(_recording, "pool", None)
        recording = pool is not None
        if recording:
            with torch.cuda.use_mem_pool(pool):
                outputs = self.op()
        else:
            outputs = self.op()
        for launch in self.then(*outputs):
            launch()
        del outputs
        if not recording:
            _ran.add(self.key)


def _direct(launches) -> None:
    for launch in launches:
        launch()
