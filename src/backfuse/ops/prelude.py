"""The host prelude every operator's fused backward starts with (here, above `kernels/`, since it
also reserves the fp16 range guard's slots): whether its kernels can index the tensors,
the device and its processor count, which config applies, the plan, the fp16-range slots of its
launches, and the call's buffers. Every operator's `backward.py` reads:

    if not fits_int32(...):                     # then the fp32 reference instead
        return PROBLEM.fp32_backward(*inputs)
    call = begin(device, sms, config, (CONFIG, INTERPRETER_CONFIG), ranges,
                 lambda cfg, host: plan(cfg, axes, host.sms, gpu=host.gpu, ...))
    out = call.host.f32(rows, cols)
    ...  launch i gets call.ranges_of(i) for its slots
    cublas_products([(a16, b16, out, needed), ...])   # where the plan says cuBLAS
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fp16_guard import RangeSlots
from ..kernels import buffers
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


def begin(device: torch.device, sms, config, configs: tuple, ranges, make_plan) -> FusedCall:
    """The prelude of a fused call: Host(device, sms); `config`, else configs[0] on a GPU and
    configs[1] (the interpreter's) on the CPU; make_plan(cfg, host); the range slots of every launch
    of the plan reserved in `ranges` (a fresh RangeSlots when None) and allocated."""
    host = Host(device, sms)
    cfg = host.config(config, *configs)
    p = make_plan(cfg, host)
    ranges = ranges or RangeSlots()
    offsets = tuple(r.reserve(ranges) for r in p.ranges)
    ranges.allocate(host.device)
    return FusedCall(host, cfg, p, ranges, offsets)


def cublas_products(products) -> None:
    """out = a @ b by cuBLAS (torch.mm on our fp16 operands, fp32 sums and output) for every
    (a, b, out, needed) that is needed."""
    for a, b, out, needed in products:
        if needed:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
