"""Host time of a training step on the GPU machine: the floor (autograd.Function, a graph launch, an
allocation) and where backfuse's step spends it (inclusive time of each layer of the call, by
wrapping those functions with timers).

    PYTHONPATH=src python3 benchmarks/tools/train_host.py
    PYTHONPATH=src TRITON_INTERPRET=1 python3 benchmarks/tools/train_host.py --cpu

--cpu (any machine): the host's own work of each op's step on CPU tensors, its launches left out (the ops'
`execute` a no-op; glibc's heap without mmap, whose large buffers cost as little as a caching allocator's),
against `bench --train`'s `host_floor_us` step with the same tensors: what our Python costs beyond an autograd op
that computes nothing, without the launches, the CUDA allocator or the graphs.

Both print, beside the floor, the floor of our design (`_Ideal`): an op that does only what a replayed call of
ours must, so that a bound on host / floor can be checked against what the design itself costs (session 50:
1.29-1.60x the floor on an H100 lease's host).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from backfuse import functional
from backfuse.kernels import graphs
from backfuse.ops.gemma3_core import training as gemma
from backfuse.ops.qkv_gqa import training as qkv
from backfuse.ops.wan_xattn import training as wan

DEV = "cuda"


def per_call_us(fn, calls=200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *xs):
        ctx.save_for_backward(*xs)
        return torch.empty_like(xs[0])

    @staticmethod
    def backward(ctx, g):
        return tuple(torch.empty_like(x) for x in ctx.saved_tensors)


def floors():
    xs = [torch.randn(64, 64, device=DEV, requires_grad=True) for _ in range(10)]
    g = torch.randn(64, 64, device=DEV)

    def step():
        for x in xs:
            x.grad = None
        torch.autograd.backward(Trivial.apply(*xs), g)

    a = torch.randn(16, device=DEV)
    print(f"autograd.Function, 10 inputs, forward + backward: {per_call_us(step):.1f} us")
    print(f"torch.empty: {per_call_us(lambda: torch.empty(1024, device=DEV)):.1f} us")
    print(f"data_ptr: {per_call_us(lambda: a.data_ptr(), 2000):.2f} us")
    print(f"view + slice: {per_call_us(lambda: a[4:8].view(torch.int32), 2000):.2f} us")
    print(f"torch.are_deterministic_algorithms_enabled: {per_call_us(torch.are_deterministic_algorithms_enabled, 2000):.2f} us")
    # one graph of one small kernel, launched through ctypes as the training paths do
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            a.add_(1)
    print(f"torch CUDAGraph.replay: {per_call_us(graph.replay):.1f} us")
    print(f"raw stream handle: {per_call_us(lambda: graphs.raw_stream(0), 2000):.2f} us")


TIMED = [(functional, "_WanXattn"), (wan, "forward"), (wan, "backward"), (qkv, "forward"), (qkv, "backward"),
         (gemma, "forward"), (gemma, "backward"), (wan, "execute"), (qkv, "execute"), (gemma, "execute"),
         (graphs, "replay"), (functional, "_wan_plan"),
         (functional, "_qkv_plan"), (functional, "_gemma_plan")]
totals: dict = {}


def instrument():
    for module, name in TIMED:
        fn = getattr(module, name)
        if isinstance(fn, type):
            for method in ("forward", "backward"):
                _wrap_static(fn, method)
            continue

        def wrapped(*a, _fn=fn, _name=f"{module.__name__.split('.')[-2]}.{name}", **k):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*a, **k)
            finally:
                totals[_name] = totals.get(_name, 0) + time.perf_counter_ns() - t0

        setattr(module, name, wrapped)


def _wrap_static(cls, method):
    fn = getattr(cls, method)

    def wrapped(*a, _fn=fn, _name=f"{cls.__name__}.{method}", **k):
        t0 = time.perf_counter_ns()
        try:
            return _fn(*a, **k)
        finally:
            totals[_name] = totals.get(_name, 0) + time.perf_counter_ns() - t0

    setattr(cls, method, staticmethod(wrapped))


class _Ideal(torch.autograd.Function):
    """The least host work of a replayed training call of ours, beyond `_Floor`'s: the outputs, an activations and
    a scratch arena of the plan's sizes, the weight gradients as one allocation split into them, the call's
    addresses gathered and looked up, and one graph launch a direction (`spec.launch`)."""

    @staticmethod
    def forward(ctx, spec, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.spec = spec
        outs = [tensors[0].new_empty(s) for s in spec.outputs]
        ctx.acts = torch.empty(spec.acts, dtype=torch.uint8, device=tensors[0].device)
        spec.table.get(tuple([t.data_ptr() for t in (*tensors, *outs, ctx.acts)]))
        spec.launch()
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        spec, saved = ctx.spec, ctx.saved_tensors
        scratch = torch.empty(spec.scratch, dtype=torch.uint8, device=saved[0].device)
        flat = torch.empty(spec.weights, dtype=spec.dtype, device=saved[0].device)
        parts = iter(flat.split_with_sizes(spec.weight_sizes))
        out = [None]
        for t, need, weight in zip(saved, ctx.needs_input_grad[1:], spec.is_weight):
            out.append(None if not need else next(parts).view(t.shape) if weight else torch.empty_like(t))
        spec.table.get(tuple([t.data_ptr() for t in (*saved, *grads, scratch, flat, ctx.acts)]))
        spec.launch()
        return tuple(out)


def _graph_launch():
    """A callable launching a recorded one-kernel graph on the current stream (a no-op off the GPU)."""
    if DEV == "cpu":
        return lambda: None
    drv, side, x = graphs.driver(), torch.cuda.Stream(), torch.zeros(16, device=DEV)
    torch.cuda.synchronize()
    before = torch.cuda.current_stream()
    torch.cuda.set_stream(side)
    try:
        graph = drv.capture(side.cuda_stream, lambda: x.add_(1))
    finally:
        torch.cuda.set_stream(before)
    exec_ = drv.instantiate(graph)
    drv.destroy_graph(graph)
    return lambda: drv.launch(exec_, graphs.raw_stream(torch.cuda.current_device()))


def ideal_of(lay):
    """`_Ideal`'s step with a layer's tensors, at the arena sizes of the plan its last step looked up."""
    from backfuse.bench.train import Steps

    lay.step()
    plan = next(reversed(functional._plans.values()))
    tensors = list(lay.by_name.values())
    weight = [isinstance(t, torch.nn.Parameter) for t in tensors]
    spec = SimpleNamespace(outputs=[g.shape for g in lay.grads], acts=max(256, int(plan.activations.nbytes)),
                           scratch=max(256, int(plan.backward_scratch.nbytes)), is_weight=weight,
                           weight_sizes=[t.numel() for t, w in zip(tensors, weight) if w], dtype=tensors[0].dtype,
                           table={}, launch=_graph_launch())
    spec.weights = sum(spec.weight_sizes)
    return Steps(lay.leaves, lambda: _Ideal.apply(spec, *tensors), lay.grads)


def against_floors(calls: int) -> None:
    """Each op's step beside the floor and our design's floor (`_Ideal`), host us, the least of three alternating
    rounds."""
    from backfuse.bench.train import floor_of

    for pid in ("021", "072", "037"):
        for dtype in (torch.float32, torch.bfloat16):
            lay = layer(pid, dtype)
            steps = {"ours": lay, "floor": floor_of(lay), "ideal": ideal_of(lay)}
            best = {name: min(per_call_us(s.step, calls) for _ in range(3)) for name, s in steps.items()}
            ours, floor, ideal = best["ours"], best["floor"], best["ideal"]
            print(f"{pid} {str(dtype)[6:]:8s} step {ours:6.1f} us, floor {floor:5.1f} us: {ours / floor:.2f}x, "
                  f"{ours - floor:5.1f} us over; our design's floor {ideal:6.1f} us: {ideal / floor:.2f}x")


def layer(pid, dtype):
    import backfuse
    from backfuse.bench.train import Layer

    prob = backfuse.problem(pid)
    axes = {"021": prob.workloads[8].axes, "072": prob.workloads[3].axes, "037": prob.workloads[9].axes}[pid]
    return Layer(prob, axes, "backfuse_fp32" if dtype == torch.float32 else "backfuse_bf16", DEV)


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    floors()
    against_floors(100)
    instrument()
    for pid in ("021", "072", "037"):
        lay = layer(pid, torch.float32)
        for _ in range(10):
            lay.step()
        torch.cuda.synchronize()
        totals.clear()
        steps = 100
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            lay.step()
        total = time.perf_counter_ns() - t0
        torch.cuda.synchronize()
        print(f"{pid} float32 instrumented step {total / steps / 1e3:.0f} us: " + ", ".join(
            f"{k} {v / steps / 1e3:.0f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))


def cpu_host(calls: int = 2000):
    for module in (wan, qkv, gemma):
        module.execute = lambda *a, **k: None
    against_floors(calls)


if __name__ == "__main__":
    import sys

    if "--cpu" in sys.argv:
        import os

        # glibc maps and unmaps each buffer over 32 MB (12-36 us; a layer's weight gradients in one allocation are
        # one) where CUDA's caching allocator reuses its blocks: the heap alone, never trimmed, costs ~1 us.
        heap = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
        if any(os.environ.get(k) != v for k, v in heap.items()):
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **heap})
        DEV = "cpu"
        torch.cuda.synchronize = lambda: None
        cpu_host()
    else:
        main()
