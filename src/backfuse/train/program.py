"""A training call's host side: its buffers carved from one allocation, its launches, and their
execution as a CUDA graph kept for the call's addresses.

A call of a training op (a forward, or its backward) is a `Plan` made once per shape and option set
(`plans`: a dict lookup per call) and, per call, a few allocations (the outputs, the tensors saved for
the backward, scratch) and one of:

    hit:  the executable graph recorded for (plan, these addresses) -> one cuGraphLaunch
    miss: views of the allocations, every launch prepared, recorded and instantiated, launched

(`kernels/graphs.py: replay`). Steady training loops hit from their second or third step on. On the
CPU (the Triton interpreter) the launches run one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..kernels import buffers, graphs
from ..kernels.launch import FastKernel

ALIGN = 256  # bytes between the starts of the tensors carved from one allocation

# The products' operand dtype for each input dtype: bfloat16 trains in bfloat16; float32 and float16
# take fp16 operands (fp32 sums), the precision the official suites pass with.
COMPUTE = {torch.float32: torch.float16, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}


SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4, torch.uint8: 1}


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SIZES[self.dtype]


class Arena:
    """Tensors laid out in one allocation: `allocate` makes the allocation (the host's only work for
    them on a graph hit), `views` the named tensors in it (on a miss). An arena's tensors live as long
    as any one of them is referenced. An item may be a `Phases`: groups of tensors that the launches use
    one group after the other, laid out over the same bytes."""

    def __init__(self, specs):
        self.specs, self.offsets, at = [], [], 0
        for item in specs:
            if item is None:
                continue
            groups = item.groups if isinstance(item, Phases) else ([item],)
            end = at
            for group in groups:
                here = at
                for s in group:
                    if s is None:
                        continue
                    self.specs.append(s)
                    self.offsets.append(here)
                    here += -(-s.nbytes // ALIGN) * ALIGN
                end = torch.sym_max(end, here)
            at = end
        self.specs = tuple(self.specs)
        self.nbytes = torch.sym_max(at, ALIGN)  # (sizes torch.compile traces symbolically stay symbolic)
        self._layout = None  # (name, dtype, shape, strides, offset in elements) of each tensor (`views`)

    def allocate(self, device) -> torch.Tensor:
        return buffers.empty((self.nbytes,), torch.uint8, device)

    def views(self, flat: torch.Tensor) -> SimpleNamespace:
        """The named tensors in `flat` (poisoned allocations hold 0xff bytes: NaN in every float dtype): flat
        seen once in each dtype, then one strided view a tensor (a call's host work on a graph miss)."""
        if self._layout is None:
            self._layout = [(s.name, s.dtype, s.shape, _strides(s.shape), at // SIZES[s.dtype])
                            for s, at in zip(self.specs, self.offsets)]
        typed = {}
        out = {}
        for name, dtype, shape, strides, offset in self._layout:
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = flat.view(dtype)
            out[name] = base.as_strided(shape, strides, base.storage_offset() + offset)
        return SimpleNamespace(**out)


def _strides(shape) -> tuple:
    """A contiguous tensor's strides."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step = step * n
    return tuple(reversed(strides))


class Phases:
    """Groups of an arena's tensors over the same bytes: the launches finish with one group (on the
    stream) before they write the next."""

    def __init__(self, *groups):
        self.groups = tuple(tuple(g) for g in groups)


class Outputs:
    """A call's parameter gradients: one allocation split into them (they live as long as each other, until
    the optimizer has used them; autograd takes each as the parameter's .grad without a copy), all in
    one dtype. `allocate` costs the host one allocation, one split and a view per tensor of 2 dims or more.
    separate: an allocation each (torch.library's ops may not return tensors that share memory)."""

    def __init__(self, specs, separate: bool = False):
        self.specs = tuple(s for s in specs if s is not None)
        self.sizes = [math.prod(s.shape) for s in self.specs]
        self.total = max(1, sum(self.sizes))
        self.dtype = self.specs[0].dtype if self.specs else torch.float32
        self.separate = separate

    def allocate(self, device) -> SimpleNamespace:
        if not self.specs:
            return SimpleNamespace()
        if self.separate:
            return SimpleNamespace(**{s.name: buffers.empty(s.shape, s.dtype, device) for s in self.specs})
        parts = buffers.empty((self.total,), self.dtype, device).split_with_sizes(self.sizes)
        return SimpleNamespace(**{s.name: p if len(s.shape) == 1 else p.view(s.shape) for s, p in zip(self.specs, parts)})


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor. An `Arena`'s views in them are scratch that lives
    in an output the call writes only after the scratch's last reader: the output's memory, allocated
    anyway, instead of more at the call's peak."""
    return t.view(-1).view(torch.uint8)


def execute(key, device: torch.device, addresses: tuple, build) -> None:
    """Run the call's launches (build() returns them, prepared): as a graph kept for these addresses on
    a GPU, one by one on the CPU."""
    if device.type == "cuda":
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return graphs.replay(key, addresses, device, build)
        graphs.replay(key, addresses, device, build)
    else:
        for launch in build():
            launch()


def addresses(*tensors) -> tuple:
    """Every tensor's address (0 for an input left out, such as a norm weight the config has none of)."""
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


class Kernel:
    """A Triton kernel launched by parameter name (`FastKernel.prepare_named`)."""

    def __init__(self, fn):
        self.fast = FastKernel(fn)

    def __call__(self, grid, args: dict, **meta):
        return described(self.fast.prepare_named(tuple(grid), args, **meta), self.fast.fn.__name__)


def described(launch, what: str):
    """launch, with `what` it is (named where a CUDA graph could not record it)."""
    try:
        launch.what = what
    except AttributeError:  # a bound method
        pass
    return launch


def _product(a, b, out) -> str:
    return f"torch.mm {tuple(a.shape)} {str(a.dtype)[6:]} x {tuple(b.shape)} -> {str(out.dtype)[6:]}"


def mm(a, b, out):
    """A launch step: out = a @ b by cuBLAS, fp32 sums rounded once to out's dtype (out_dtype where it
    differs from the operands'). On the CPU (the interpreter's runs) the same in fp32 by torch."""
    if not a.is_cuda:
        return lambda: out.copy_(a.float() @ b.float())
    if out.dtype != a.dtype:
        return described(lambda: torch.mm(a, b, out_dtype=out.dtype, out=out), _product(a, b, out))
    return described(lambda: torch.mm(a, b, out=out), _product(a, b, out))


def addmm(bias, a, b, out):
    """A launch step: out = bias + a @ b by cuBLAS (the bias in its epilogue), all in one dtype."""
    if not a.is_cuda:
        return lambda: out.copy_(bias.float() + a.float() @ b.float())
    return described(lambda: torch.addmm(bias, a, b, out=out), "torch.addmm (bias) " + _product(a, b, out))


def accumulate(c, a, b):
    """A launch step: c += a @ b by cuBLAS, all in one dtype."""
    if not a.is_cuda:
        return lambda: c.copy_(c.float() + a.float() @ b.float())
    return described(lambda: torch.addmm(c, a, b, out=c), "torch.addmm (accumulate) " + _product(a, b, c))
