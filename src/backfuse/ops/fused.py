"""The interface every operator's fused backward implements, and the host work they share (here,
above `kernels/`, since it also reserves the fp16 range guard's slots).

A fused path (`FusedPath`) says four things about its operator: the element counts its kernels
index (`indexed`), the plan of a call (`plan`, at the problem's sizes: `Problem.config`), the buffers
that plan needs (`allocate`), and its launches in order, each prepared before the first runs
(`launches`). `FusedPath.backward` is the one driver:

    if not fits_int32(*path.indexed(inputs)):   # then the fp32 reference instead
        return problem.fp32_backward(*inputs)
    call = begin(...)                           # device, SM count, config, plan (kept per shape), fp16-range slots
    bufs = path.allocate(call, inputs)
    launches = path.launches(call, inputs, bufs)    # Triton launches, cuBLAS products, concurrent steps
    run them: as one CUDA graph on a GPU (kernels/graphs.py), else one by one
    return path.outputs(bufs)

Every operator package's `backward.py` holds one `FusedPath` and exports its `backward`; launch i
of the plan writes the fp16-range slots `call.ranges_of(i)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..fp16_guard import RangeSlots
from ..kernels import branches, buffers, graphs
from ..kernels.launch import FAST_LAUNCH

INT32_ELEMENTS = 2**31  # the kernels count elements in int32


def fits_int32(*counts: int) -> bool:
    """Whether every element count the kernels index (tensors, stacked buffers) stays below 2^31."""
    return max(counts) < INT32_ELEMENTS


class Host:
    """A fused call's device: on a GPU its processor count (what K splits and grids balance over),
    on the CPU (the Triton interpreter) 1; `sms` overrides it (tests force a GPU's splits on the CPU).
    `gluon`: the device runs our Gluon kernels (a Hopper GPU, sm_90, under the Triton they are
    written for; FastKernel launches them)."""

    def __init__(self, device: torch.device, sms: int | None = None):
        self.device = device
        self.gpu = device.type == "cuda"
        if sms is None:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if self.gpu else 1
        self.sms = sms
        self.gluon = self.gpu and FAST_LAUNCH and torch.cuda.get_device_capability(device) == (9, 0)

    def config(self, given, gpu, interpreter):
        """`given`, else the GPU's config on a GPU and the Triton interpreter's on the CPU."""
        return given or (gpu if self.gpu else interpreter)

    def f16(self, *shape) -> torch.Tensor:
        return buffers.empty(shape, torch.float16, self.device)

    def f32(self, *shape) -> torch.Tensor:
        return buffers.empty(shape, torch.float32, self.device)

    def i32(self, *shape) -> torch.Tensor:
        return buffers.empty(shape, torch.int32, self.device)


@dataclass
class FusedCall:
    """One fused call's host side: its device, config and plan, and the fp16-range slots with one
    block per launch the plan lists (`plan.ranges`, in launch order)."""

    host: Host
    cfg: object
    plan: object
    ranges: RangeSlots
    offsets: tuple  # of each launch's block in ranges

    def ranges_of(self, launch: int) -> torch.Tensor:
        """The range slots of the plan's launch `launch`."""
        return self.ranges.block(self.offsets[launch])


PLANS_KEPT = 64
_plans: OrderedDict = OrderedDict()  # what a plan depends on -> the frozen plan, most recently used last


def begin(device: torch.device, sms, config, configs: tuple, ranges, make_plan, plan_key) -> FusedCall:
    """The start of a fused call: Host(device, sms); `config`, else configs[0] on a GPU and
    configs[1] (the interpreter's) on the CPU; make_plan(cfg, host), unless a call with the same
    plan_key (what else the plan depends on: the path, the sizes, the shapes, the options) on the
    same config and host made it already (a plan is a pure function of these, like a compiled kernel
    of its constexprs; it holds no data); the range slots of every launch of the plan reserved in
    `ranges` (a fresh RangeSlots when None) and allocated."""
    host = Host(device, sms)
    cfg = host.config(config, *configs)
    key = (plan_key, cfg, host.sms, host.gpu, host.gluon)
    p = _plans.pop(key, None)
    if p is None:
        p = make_plan(cfg, host)
    _plans[key] = p
    while len(_plans) > PLANS_KEPT:
        _plans.popitem(last=False)
    ranges = ranges or RangeSlots()
    offsets = tuple(r.reserve(ranges) for r in p.ranges)
    ranges.allocate(host.device)
    return FusedCall(host, cfg, p, ranges, offsets)


def cublas_product(a, b, out) -> Callable[[], None]:
    """A launch step: out = a @ b by cuBLAS (torch.mm on our fp16 operands, fp32 sums and output).
    The operand views are made before the call's first launch, so the step adds no host work but
    the product's own."""
    def run():
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    return run


def cublas_products(products, concurrently: bool = False) -> Callable[[], None]:
    """A launch step: `cublas_product` for every (a, b, out, needed) that is needed, one after
    another, or `concurrently` (each its own branch: kernels/branches.py), where they are independent."""
    steps = [cublas_product(a, b, out) for a, b, out, needed in products if needed]
    return branches.concurrent(*([step] for step in steps)) if concurrently else branches.concurrent(steps)


class FusedPath(ABC):
    """One operator's fused backward. `problem`: its `Problem` at the benchmark operator's sizes (the
    default of a call's `problem`); `configs`: (the GPU's config, the Triton interpreter's)."""

    problem = None
    configs: tuple = ()

    @abstractmethod
    def indexed(self, inputs) -> tuple[int, ...]:
        """The element counts the kernels index in int32 (tensors, stacked buffers)."""

    @abstractmethod
    def plan(self, cfg, inputs, host: Host, **options):
        """The frozen plan of a call on `host`; options: sizes (the problem's config; default the
        benchmark operator's), products, needs, deterministic. It may read only the inputs' shapes (the
        driver keeps a plan per config, host, sizes, shapes and options)."""

    @abstractmethod
    def allocate(self, call: FusedCall, inputs) -> SimpleNamespace:
        """Every buffer the plan's launches read or write, outputs included (none written yet)."""

    @abstractmethod
    def launches(self, call: FusedCall, inputs, bufs) -> list[Callable[[], None]]:
        """The call's launches in order, each prepared (no host work left but the launch itself); a
        step may run groups of launches concurrently (`kernels/branches.concurrent`)."""

    @abstractmethod
    def outputs(self, bufs) -> tuple:
        """The official outputs, in order."""

    def backward(self, *inputs, problem=None, needs=None, deterministic=False, ranges=None, config=None, products=None,
                 sms=None):
        """The operator's outputs from the official inputs (validated by the caller).

        problem: the `Problem` whose inputs these are (None: `self.problem`): the plan is made at its
        sizes (`problem.config`), and its fp32 reference is the fallback.

        needs: one bool per output (None: all); the products only unneeded outputs read are skipped.
        deterministic: the same outputs bit for bit on every call (no K splits, no atomics whose
        order varies; cuBLAS products are reproducible on one GPU model as they are). ranges: a
        RangeSlots that receives the largest |value| of every tensor rounded to fp16. config: the
        operator's `config.Config` (None: the GPU's on a GPU, the interpreter's on the CPU).
        products: the projection products' backend as the operator's plan names them (None: by
        size on a GPU). sms: processors to balance K splits and grids over (the GPU's count; on
        the CPU interpreter, 1).
        """
        problem = problem or self.problem
        if not fits_int32(*self.indexed(inputs)):
            return problem.fp32_backward(*inputs)
        device = next(x for x in inputs if isinstance(x, torch.Tensor)).device
        shapes = tuple(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor))
        call = begin(device, sms, config, self.configs, ranges,
                     lambda cfg, host: self.plan(cfg, inputs, host, sizes=problem.config, products=products, needs=needs,
                                                 deterministic=deterministic),
                     (type(self), problem.config, shapes, products, None if needs is None else tuple(needs),
                      deterministic))
        bufs = self.allocate(call, inputs)
        with buffers.on_device(call.host.device):
            launches = list(self.launches(call, inputs, bufs))  # all prepared before the first runs
            if graphs.enabled(call.host.device, launches):
                graphs.run((type(self), call.plan), call.host.device, launches)
            else:
                for launch in launches:
                    launch()
        return self.outputs(bufs)
