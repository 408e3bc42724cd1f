"""A training call's host side: its buffers carved from one allocation, its launches, and their
execution as a CUDA graph kept for the call's addresses.

A call of a training op (a forward, or its backward) is a `Plan` made once per shape and option set
(`plans`: a dict lookup per call) and, per call, a few allocations (the outputs, the tensors saved for
the backward, scratch) and one of:

    hit:       the executable graph recorded for (plan, these addresses) -> one cuGraphLaunch
    recurring: the third call at these addresses: views of the allocations, every launch prepared,
               recorded, instantiated and launched
    otherwise: the plan's `Template` re-aimed at this call's tensors (no views, no launch prepared), or
               where none is kept yet, the launches prepared and run one by one

(`kernels/graphs.py: replay`). Steady training loops hit from their third to sixth step on; batches of
changing lengths run templates. On the CPU (the Triton interpreter) the launches run one by one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..kernels import buffers, cublas, graphs
from ..kernels.launch import FastKernel, Launch, current_stream

ALIGN = 256  # bytes between the starts of the tensors carved from one allocation

# The products' operand dtype for each input dtype: bfloat16 trains in bfloat16; float32 and float16
# take fp16 operands (fp32 sums), the precision the official suites pass with.
COMPUTE = {torch.float32: torch.float16, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}


SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4, torch.uint8: 1}


class Precision:
    """What a training plan's input dtype (its field `io`) implies; a base of the ops' plans."""

    @functools.cached_property
    def compute(self) -> torch.dtype:
        """The products' operand dtype (`COMPUTE`)."""
        return COMPUTE[self.io]

    @functools.cached_property
    def guarded(self) -> bool:
        """fp16 operands: the range guard watches the call (`train/guard.py`)."""
        return self.compute == torch.float16

    @functools.cached_property
    def casts(self) -> bool:
        """float32 inputs: the call works on fp16 copies of them."""
        return self.io == torch.float32

    @functools.cached_property
    def variants(self) -> dict:
        """This plan with some fields changed, by the changes (`plans.replaced`, `plans.needs_plan`)."""
        return {}


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


@dataclass(frozen=True)
class Stack:
    """One product's result whose row blocks are gradients of their own (`parts`: Buffers of one width and
    dtype, in row order): the product writes the stack, autograd takes the parts."""
    name: str
    parts: tuple

    @property
    def shape(self) -> tuple:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])


class Outputs:
    """A call's parameter gradients: one allocation split into them (they live as long as each other, until
    the optimizer has used them; autograd takes each as the parameter's .grad without a copy), all in
    one dtype; a `Stack`'s parts lie in it row block after row block. `allocate` costs the host one
    allocation, one split and a view per tensor of 2 dims or more. separate: an allocation each, a stack one
    (torch.library's ops may not return tensors that share memory: `own` copies a stack's later parts)."""

    def __init__(self, specs, separate: bool = False):
        items = tuple(s for s in specs if s is not None)
        self.specs = tuple(p for s in items for p in (s.parts if isinstance(s, Stack) else (s,)))
        self.sizes = [math.prod(s.shape) for s in self.specs]
        self.total = max(1, sum(self.sizes))
        self.dtype = self.specs[0].dtype if self.specs else torch.float32
        self.separate = separate
        self.stacks = {s.name: s for s in items if isinstance(s, Stack)}
        self._alone = tuple(s for s in items if not isinstance(s, Stack))

    def allocate(self, device) -> tuple:
        """(the gradients by name, the allocations: what `execute` takes of them)."""
        if not self.specs:
            return SimpleNamespace(), ()
        if self.separate:
            out = {s.name: buffers.empty(s.shape, s.dtype, device) for s in self._alone}
            allocations = list(out.values())
            for stack in self.stacks.values():
                whole = buffers.empty(stack.shape, self.dtype, device)
                out.update(zip((p.name for p in stack.parts), whole.split_with_sizes([p.shape[0] for p in stack.parts])))
                allocations.append(whole)
            return SimpleNamespace(**out), tuple(allocations)
        flat = buffers.empty((self.total,), self.dtype, device)
        parts = flat.split_with_sizes(self.sizes)
        return SimpleNamespace(**{s.name: p if len(s.shape) == 1 else p.view(s.shape)
                                  for s, p in zip(self.specs, parts)}), (flat,)

    def stack(self, w: SimpleNamespace, name: str) -> torch.Tensor:
        """The stack `name` over its parts in w (its first part's memory and the rows after it)."""
        stack = self.stacks[name]
        rows, width = stack.shape
        return getattr(w, stack.parts[0].name).as_strided((rows, width), (width, 1))

    def own(self, w: SimpleNamespace) -> None:
        """Where separate, each stack's later parts copied into memory of their own (after the launches)."""
        if self.separate:
            for stack in self.stacks.values():
                for part in stack.parts[1:]:
                    setattr(w, part.name, getattr(w, part.name).clone())


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor. An `Arena`'s views in them are scratch that lives
    in an output the call writes only after the scratch's last reader: the output's memory, allocated
    anyway, instead of more at the call's peak."""
    return t.view(-1).view(torch.uint8)


def execute(key, device: torch.device, tensors: tuple, build) -> None:
    """Run the call's launches (build() returns them, prepared). `tensors` (`bases`) are every tensor they
    touch, or the tensors those are views of. On a GPU: as a graph kept for the tensors' addresses
    (`kernels/graphs.py: replay`), or, where the call launches directly, by the key's `Template` where one
    is kept (the launches of an earlier call re-aimed at these tensors: no views made, no launch
    prepared); on the CPU one by one."""
    if device.type != "cuda":
        for launch in build():
            launch()
        return
    if not getattr(_thread, "context", False):
        _make_context_current()
    addresses = tuple([0 if t is None else t.data_ptr() for t in tensors])
    where = template_slot(key, device.index, addresses)

    def direct():
        template = _templates.get(where)
        if isinstance(template, Template):
            _templates.move_to_end(where)
            return template.run(tensors, addresses)
        launches = build()
        for launch in launches:
            launch()
        if template is not UNTEMPLATABLE:
            made = Template.of(launches, tensors)
            tries = (template or 0) + 1
            if made is NOT_YET:
                made = tries if tries < TEMPLATE_TRIES else UNTEMPLATABLE
            _templates[where] = UNTEMPLATABLE if made is None else made
            while len(_templates) > TEMPLATES_KEPT:
                _templates.popitem(last=False)

    if device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return graphs.replay(key, addresses, device, build, direct)
    graphs.replay(key, addresses, device, build, direct)


def template_slot(key, index: int, addresses: tuple):
    """Where `execute` keeps a key's template: (key, device index), or, for a call with any tensor off 16 bytes,
    a slot of its own for each address modulo 16. A template re-aims Triton binaries without preparing them
    again, and each binary is compiled for its pointers' 16-byte alignment (aligned vector loads), so one
    taken from aligned tensors must not run at a view at an odd offset."""
    if functools.reduce(operator.or_, addresses, 0) & 15:
        return key, index, tuple([a & 15 for a in addresses])
    return key, index


_thread = threading.local()  # .context: execute has made a CUDA context current on this thread


def _make_context_current() -> None:
    """The current device's primary context made current on this thread, once a thread. The autograd engine's
    device threads start without one; where a backward's first launch on such a thread is a cuBLAS product,
    cuBLAS warns and makes it current itself. torch.cuda.set_device forces cudaSetDevice, which makes the
    primary context current (CUDA 12); a device switch after it (`torch.cuda.device`) does the same."""
    torch.cuda.set_device(torch.cuda.current_device())
    _thread.context = True


def bases(*tensors) -> tuple:
    """A call's tensors for `execute`: every tensor its launches read or write, or one those are views of
    (None for an input left out, such as a norm weight the config has none of)."""
    return tensors


TEMPLATES_KEPT = 4096
TEMPLATE_TRIES = 4  # calls of a key that may each fail to give a template before it launches without one
NOT_YET = "not yet"  # a template could not be taken from this call's launches (a kernel compiled; aliasing tensors)
UNTEMPLATABLE = "untemplatable"  # the key's launches include steps a template cannot re-aim
_templates: OrderedDict = OrderedDict()  # (key, device index) -> Template, UNTEMPLATABLE, or the tries so far
_constants: dict = {}  # id -> a persistent tensor launches may read at the same address on every call


def constant(t: torch.Tensor) -> torch.Tensor:
    """t, registered as memory that stays where it is for the process's life (a template keeps its address)."""
    _constants[id(t)] = t
    return t


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


class Template:
    """A key's launches as re-aimed steps: each tensor a launch reads is found inside one of the call's
    tensors (`bases`) at an offset that the key fixes (the plan's arena layout, the views of the inputs), so
    another call of the key runs the same kernels and products at its own tensors' addresses plus those
    offsets, without making views or preparing launches. It keeps no tensor of the call it was taken from
    (only addresses' offsets, and `constant` tensors). As a CUDA graph's replay, it relies on `execute`'s
    contract: the key names everything but the tensors' addresses that the launches depend on."""

    def __init__(self, steps):
        self.steps = steps

    def run(self, tensors, addresses) -> None:
        views = {}  # this call's views, made once and shared by its products (`_reproduct`)
        for step in self.steps:
            step(tensors, addresses, views)

    @classmethod
    def of(cls, launches, tensors):
        """The template of a call's launches and tensors; NOT_YET where this call cannot give one (a launch
        compiled its kernel; two of the call's tensors overlap, so a view's base is ambiguous); None
        where the key's launches never can (a step other than a Triton launch or a product)."""
        spans = sorted((t.data_ptr(), t.data_ptr() + _extent(t), i) for i, t in enumerate(tensors) if t is not None)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return NOT_YET

        def locate(t):
            p, e = t.data_ptr(), t.data_ptr() + _extent(t)
            for start, end, i in spans:
                if start <= p and e <= end:
                    return i, p - start
            return None

        steps = []
        for launch in launches:
            if isinstance(launch, Launch):
                if not launch.plain:
                    return None
                slots = []
                for pos, a in enumerate(launch.args):
                    if isinstance(a, torch.Tensor):
                        found = locate(a)
                        if found is None:
                            if id(a) not in _constants:
                                return None
                        else:
                            slots.append((pos, *found))
                steps.append(_relaunch(launch, tuple(slots)))
            elif isinstance(launch, Product):
                refs = []
                for t in (*launch.operands, *(() if launch.out is None else (launch.out,))):
                    found = locate(t)
                    if found is None or found[1] % t.element_size() or (
                            t.dtype != tensors[found[0]].dtype and not tensors[found[0]].is_contiguous()):
                        return None
                    refs.append((found[0], found[1] // t.element_size(), t.dtype, tuple(t.shape), t.stride()))
                steps.append(_reproduct(launch, tuple(refs)))
            elif not getattr(launch, "graphable", True):
                return NOT_YET  # a first launch (compiling) or a library's first call
            else:
                return None
        return cls(steps)


def _relaunch(launch, slots):
    run, grid, device, head, full = launch.run, launch.grid, launch.device, launch.head, list(launch.full)
    for pos, _, _ in slots:
        full[pos] = 0  # no address of the call the template was taken from

    def step(tensors, addresses, views):
        args = full.copy()
        for pos, i, offset in slots:
            args[pos] = addresses[i] + offset
        run(grid[0], grid[1], grid[2], current_stream(device), *head, *args)
    return step


def _reproduct(product, refs):
    """A product's template step. A plain product (c = a @ b, or c += a @ b) runs by cuBLAS at the refs' addresses
    in this call's tensors (`kernels/cublas.py`: no view made, no torch dispatch); any other, or one cuBLAS at
    addresses does not serve, as views at the refs' offsets and torch's call. A call's views are shared by its
    products (`views`: by ref, and each base seen in another dtype by (base, dtype)), so an operand that several
    products read, or an arena read in another dtype, is made once a call."""
    direct = _by_address(product, refs)
    if direct is not None:
        return direct
    fn, out_dtype, has_out = product.fn, product.out_dtype, product.out is not None
    operand_refs, out_ref = (refs[:-1], refs[-1]) if has_out else (refs, None)

    def view(tensors, views, ref):
        made = views.get(ref)
        if made is None:
            i, offset, dtype, shape, stride = ref
            base = tensors[i]
            if base.dtype != dtype:
                typed = views.get((i, dtype))
                if typed is None:
                    typed = views[(i, dtype)] = base.view(-1).view(dtype)
                base = typed
            made = views[ref] = base.as_strided(shape, stride, base.storage_offset() + offset)
        return made

    def step(tensors, addresses, views):
        operands = [view(tensors, views, ref) for ref in operand_refs]
        if not has_out:
            return fn(*operands)
        out = view(tensors, views, out_ref)
        if out_dtype is None:
            fn(*operands, out=out)
        else:
            fn(*operands, out_dtype=out_dtype, out=out)
    return step


def _by_address(product, refs):
    """The template step of a plain product by cuBLAS at addresses, or None (a bias, a fill or copy, a layout or
    dtype `cublas.gemm` does not serve, or deterministic mode: there a plan's products stay torch's in every path,
    graph, template or direct, and every plan key holds the mode)."""
    if product.out is None or not cublas_products or torch.are_deterministic_algorithms_enabled():
        return None
    if product.fn is torch.mm:
        (a, b), accumulate, (ra, rb, rc) = product.operands, False, refs
    elif product.fn is torch.addmm and product.operands[0] is product.out:
        (_, a, b), accumulate, (_, ra, rb, rc) = product.operands, True, refs
    else:
        return None
    at = cublas.gemm(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), product.out.stride(), a.dtype,
                     product.out.dtype, accumulate)
    if at is None:
        return None
    (ia, oa), (ib, ob), (ic, oc) = ((r[0], r[1] * SIZES[r[2]]) for r in (ra, rb, rc))

    def step(tensors, addresses, views):
        at(addresses[ia] + oa, addresses[ib] + ob, addresses[ic] + oc)
    return step


cublas_products = True  # templates' plain products by cuBLAS at addresses (False: torch's; tests compare the two)


class Kernel:
    """A Triton kernel launched by parameter name (`FastKernel.prepare_named`); inside `compiling_only`, compiled
    and not launched."""

    def __init__(self, fn):
        self.fast = FastKernel(fn)

    def __call__(self, grid, args: dict, **meta):
        if _compiling_only.get():
            self.fast.warm_named(tuple(grid), args, **meta)
            return _nothing
        return described(self.fast.prepare_named(tuple(grid), args, **meta), self.fast.fn.__name__)


_compiling_only = contextvars.ContextVar("compiling_only", default=False)


def _nothing() -> None:
    pass


@contextlib.contextmanager
def compiling_only():
    """Inside, a `Kernel` call compiles the binary it would launch (`FastKernel.warm`: tensors on the meta device
    stand for buffers a plan lacks) and returns a launch that does nothing: the kernels that another length
    of a plan's topology will need, made at its first call, not in the midst of a loop."""
    token = _compiling_only.set(True)
    try:
        yield
    finally:
        _compiling_only.reset(token)


def described(launch, what: str):
    """launch, with `what` it is (named where a CUDA graph could not record it)."""
    try:
        launch.what = what
    except AttributeError:  # a bound method
        pass
    return launch


class Product:
    """A launch step by torch: fn(*operands, out=out) (cuBLAS's products; with out_dtype where it is not None),
    or fn(*operands) where out is None (an in-place fill or copy: `torch_step`); `what` names it where a CUDA
    graph could not record it."""

    __slots__ = ("fn", "operands", "out", "out_dtype", "label")
    graphable = True

    def __init__(self, fn, operands, out, out_dtype, label: str):
        self.fn, self.operands, self.out, self.out_dtype, self.label = fn, operands, out, out_dtype, label

    def __call__(self) -> None:
        if self.out is None:
            self.fn(*self.operands)
        elif self.out_dtype is None:
            self.fn(*self.operands, out=self.out)
        else:
            self.fn(*self.operands, out_dtype=self.out_dtype, out=self.out)

    @property
    def what(self) -> str:
        if self.out is None:
            return f"{self.label} {tuple(self.operands[0].shape)}"
        a, b = self.operands[-2:]
        return (f"{self.label} {tuple(a.shape)} {str(a.dtype)[6:]} x {tuple(b.shape)} -> "
                f"{str(self.out.dtype)[6:]}")


def torch_step(fn, *tensors, label: str) -> Product:
    """A launch step fn(*tensors) by torch, in place (a fill, a copy, a bias added), that a template can re-aim."""
    return Product(fn, tensors, None, None, label)


def mm(a, b, out):
    """A launch step: out = a @ b by cuBLAS, fp32 sums rounded once to out's dtype (out_dtype where it
    differs from the operands'). On the CPU (the interpreter's runs) the same in fp32 by torch."""
    if not a.is_cuda:
        return lambda: out.copy_(a.float() @ b.float())
    return Product(torch.mm, (a, b), out, out.dtype if out.dtype != a.dtype else None, "torch.mm")


def addmm(bias, a, b, out):
    """A launch step: out = bias + a @ b by cuBLAS (the bias in its epilogue), all in one dtype."""
    if not a.is_cuda:
        return lambda: out.copy_(bias.float() + a.float() @ b.float())
    return Product(torch.addmm, (bias, a, b), out, None, "torch.addmm (bias)")


def accumulate(c, a, b):
    """A launch step: c += a @ b by cuBLAS, all in one dtype."""
    if not a.is_cuda:
        return lambda: c.copy_(c.float() + a.float() @ b.float())
    return Product(torch.addmm, (c, a, b), c, None, "torch.addmm (accumulate)")
