"""Launching Triton kernels without the JIT's per-call dispatch.

Triton's `kernel[grid](...)` re-derives the specialization of every argument on each call, which
costs tens of microseconds of host time for kernels with many arguments; the official clock counts
that time whenever a launch waits on the host between two kernels. `FastKernel` keeps the
compiled handle from the first launch and launches it directly afterwards. Integer arguments of
kernels launched this way must be listed in `do_not_specialize`, so their values never select a
different binary; what can still select one (constexprs, launch options, tensor alignment) forms
the lookup key.

What `FastKernel` calls of Triton's launcher (`CompiledKernel.run`'s C entry, `packed_metadata`, the
scratch allocator's context variable in `triton.runtime._allocation`, and for Gluon kernels with host
TMA descriptors the launcher's descriptor wrapper) is Triton 3.6's. Outside `SUPPORTED_TRITON` it
launches through the JIT (`fn[grid](...)`) instead, and warns once at import.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import dataclass

import torch
import triton

from . import buffers

ALIGNMENT = 16  # bytes; Triton specializes pointer arguments on it
SUPPORTED_TRITON = ((3, 6), (3, 7))  # [from, to): the versions whose launcher internals FastKernel uses


def triton_supported(version: str) -> bool:
    """Whether a Triton version string ("3.6.0", "3.6.0+git1234") lies in SUPPORTED_TRITON."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and SUPPORTED_TRITON[0] <= (int(found[1]), int(found[2])) < SUPPORTED_TRITON[1]


def fast_launch_available(version: str) -> bool:
    """triton_supported(version), with a warning when not: kernels then launch through the JIT."""
    if triton_supported(version):
        return True
    low, high = SUPPORTED_TRITON
    warnings.warn(f"backfuse: triton {version} is outside the supported range >={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
                  "kernels launch through triton's JIT (correct, but with more host time per call)", RuntimeWarning,
                  stacklevel=2)
    return False


FAST_LAUNCH = fast_launch_available(triton.__version__)
if FAST_LAUNCH:
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import _allocation
else:
    _allocation = None

# The raw handle of a device's current stream (what Triton's own launcher asks torch for); absent from
# CPU-only builds of torch, where no prepared launch runs.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", lambda device: torch.cuda.current_stream(device).cuda_stream)


def _encode_descriptors(run, args):
    """(launch entry, args) with host TMA descriptors encoded now: Triton 3.6 wraps the launcher of a
    kernel that takes descriptors so that it encodes them (cuTensorMapEncode) on every launch; here
    that happens once, when the launch is prepared, and the wrapped entry is called directly."""
    if not any(isinstance(a, TensorDescriptor) for a in args):
        return run, args
    cells = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__)))
    metas = iter(cells["tensordesc_meta"])
    encoded = []
    for a in args:
        encoded += make_tensordesc_arg(a, next(metas)) if isinstance(a, TensorDescriptor) else [a]
    return cells["launcher"], encoded


def _flatten(args) -> tuple:
    """(the launcher's arguments: tensors as addresses; the tensors; what the binary is specific to of
    them: each tensor's dtype and 16-byte alignment, each TMA descriptor's dtype, block shape and shared
    layout, in order), in one pass over the arguments (a prepared launch's host work)."""
    full, tensors, sig = [], [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            address = a.data_ptr()
            full.append(address)
            tensors.append(a)
            sig.append(a.dtype)
            sig.append(address % ALIGNMENT == 0)
        else:
            full.append(a)
            if not isinstance(a, (int, float, bool)) and hasattr(a, "block_shape"):
                sig.append((a.base.dtype, tuple(a.block_shape), repr(a.layout)))
    return full, tensors, tuple(sig)


def specialization(args, meta) -> tuple:
    """What a compiled handle is specific to: the constexprs and options, each tensor's dtype and
    16-byte alignment, each TMA descriptor's dtype, block shape and shared layout (a kernel reads its
    tiles' shapes from its descriptors' types). (With the current device, the key of its handle.)"""
    return tuple(meta.items()), _flatten(args)[2]


def constexprs_of(fn, shared: dict) -> dict:
    """The entries of `shared` that name a parameter of kernel `fn`: an operator's kernels share its
    sizes as constexprs (`ops/<stem>/config.size_constexprs`, by the names they read them under), each
    kernel taking those it reads."""
    return {name: value for name, value in shared.items() if name in fn.arg_names}


@dataclass(frozen=True)
class SMLimits:
    """What one streaming multiprocessor holds at once (CUDA's occupancy limits)."""

    threads: int
    registers: int
    shared_bytes: int
    blocks: int = 32
    register_unit: int = 256  # registers are allocated per warp, in units of this many
    reserved_shared: int = 1024  # bytes of shared memory the driver reserves per block (sm_80 on)

    @classmethod
    def of(cls, device: torch.device) -> SMLimits:
        p = torch.cuda.get_device_properties(device)
        return cls(p.max_threads_per_multi_processor, p.regs_per_multiprocessor, p.shared_memory_per_multiprocessor)

    def programs_per_sm(self, warps: int, registers: int, shared_bytes: int) -> int:
        """How many programs of `warps` warps, `registers` registers a thread and `shared_bytes`
        of shared memory one SM holds at once."""
        per_warp = -(-registers * 32 // self.register_unit) * self.register_unit
        return min(self.threads // (32 * warps), self.registers // per_warp // warps,
                   self.shared_bytes // (shared_bytes + self.reserved_shared), self.blocks)


class _StandIn:
    """What Triton's specialization reads of a pointer argument (its dtype and address), for a meta tensor: its
    offset for an address, so that a view at an odd offset stands for memory as aligned as the real view."""

    __slots__ = ("dtype", "_address")

    def __init__(self, t: torch.Tensor):
        self.dtype, self._address = t.dtype, t.data_ptr()

    def data_ptr(self) -> int:
        return self._address


class FastKernel:
    """A kernel's prepared launches. waits_on_peers: its programs wait on each other (persistent
    programs with device-side completion counters), so every program of a grid must be resident at
    once, or the waiting ones could hold the SMs that the awaited ones need: each launch is checked
    against the compiled kernel's occupancy (threads, registers, shared memory) before it is made."""

    def __init__(self, jit_fn, *, waits_on_peers: bool = False):
        self.fn = jit_fn
        self.params = getattr(jit_fn, "params", None)  # absent under the Triton interpreter
        self.handles = {}
        self.waits_on_peers = waits_on_peers
        self.resident = {}  # specialization key: programs the device holds at once
        self.warmed = set()  # (specialization, device) compiled by `warm`
        self._names = {}  # the constexprs' names given -> the runtime parameters' names, in order

    def __call__(self, grid: tuple, *args, **meta):
        """fn[grid](*args, **meta): positional runtime args, then constexprs and launch options by name."""
        self.prepare(grid, *args, **meta)()

    def prepare_named(self, grid: tuple, *pools, **meta):
        """prepare() with the runtime arguments found by the kernel's parameter names, so that a launcher
        and its kernel agree on names, not on positions; constexprs and options in meta.

        pools: where the values are, first match wins: dicts (by key; a key that names no runtime
        parameter is refused, so that a plan's argument list and its kernel stay in step) and other
        objects (by their attributes, e.g. a call's buffers, which may hold more than one kernel reads)."""
        return self.prepare(grid, *self._named(pools, meta), **meta)

    def warm_named(self, grid: tuple, *pools, **meta) -> None:
        """warm() with the runtime arguments found by name, as prepare_named() finds them."""
        self.warm(grid, *self._named(pools, meta), **meta)

    def _named(self, pools, meta) -> list:
        """The runtime arguments, in order, from pools (`prepare_named`)."""
        names = self._names.get(tuple(meta))
        if names is None:
            names = self._names[tuple(meta)] = tuple(self._runtime_names(meta))
        if len(pools) == 1 and type(pools[0]) is dict:  # the usual call: one dict of exactly the runtime arguments
            pool = pools[0]
            if len(pool) == len(names) and all(n in pool for n in names):
                return [pool[n] for n in names]
        known = set(names)
        merged = {}
        for pool in reversed(pools):  # the first pool's values win
            if isinstance(pool, dict):
                if not pool.keys() <= known:
                    raise TypeError(f"{self.fn.__name__}: unknown arguments {sorted(pool.keys() - known)}")
                merged.update(pool)
            else:
                merged.update(vars(pool))
        missing = [n for n in names if n not in merged]
        if missing:
            raise TypeError(f"{self.fn.__name__}: missing arguments {missing}")
        return [merged[n] for n in names]

    def warm(self, grid: tuple, *args, **meta) -> None:
        """Compile (or load from Triton's cache) the binary that fn[grid](*args, **meta) would launch, and
        launch nothing: a binary that a later call will need, made before a loop that would otherwise make
        it in its midst. A tensor on the meta device stands for CUDA memory of its dtype, 16-byte aligned,
        as a plan's buffers are. Nothing where no argument is a CUDA tensor (the interpreter compiles
        nothing) or where this specialization was warmed before on this device."""
        if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return
        key = specialization(args, meta), torch.cuda.current_device()
        if key in self.warmed:
            return
        self._check_unspecialized(args)
        self.fn.warmup(*[_StandIn(a) if isinstance(a, torch.Tensor) and a.is_meta else a for a in args], grid=grid,
                       **meta)
        self.warmed.add(key)

    def _runtime_names(self, meta) -> list:
        """The kernel's parameters that meta does not give (its runtime arguments), in order; refused
        when one follows a parameter given in meta."""
        names = list(self.fn.arg_names)
        runtime = [n for n in names if n not in meta]
        if runtime != names[:len(runtime)]:
            raise TypeError(f"{self.fn.__name__}: runtime parameters must precede the constexprs, "
                            f"missing {[n for n in runtime if names.index(n) >= len(runtime)]}")
        return runtime

    def prepare(self, grid: tuple, *args, **meta):
        """The launch fn[grid](*args, **meta) as a callable with all host work but the launch done now.
        A callable whose `graphable` is False must run outside CUDA graphs (it compiles, or allocates).

        Preparing every launch of an operator before the first one runs lets them follow each other
        with no host work in between. Tensors go to the launcher as raw addresses, which skips its
        per-pointer attribute queries; the callable keeps the tensors alive. A kernel that needs
        global scratch (TMA descriptors made on the device) gets it allocated here, not by Triton's
        per-launch allocator call (measured: 13-55 us of host time per launch in the official clock).
        """
        full, tensors, sig = _flatten(args)
        if not tensors[0].is_cuda:  # the Triton interpreter
            return lambda: self.fn[grid](*args, **meta)
        key = (tuple(meta.items()), sig), torch.cuda.current_device()
        if self.waits_on_peers:
            self._check_resident(key, grid, args, meta)
        if not FAST_LAUNCH:  # a Triton whose launcher internals we do not know

            def jit_launch():
                with scratch_allocator():
                    self.fn[grid](*args, **meta)

            jit_launch.graphable = False  # allocates its scratch per launch
            return jit_launch
        handle = self.handles.get(key)
        if handle is None:  # first launch of this specialization: through the JIT, which compiles it
            self._check_unspecialized(args)

            def first_launch():
                with scratch_allocator():
                    self.handles.setdefault(key, self.fn[grid](*args, **meta))

            first_launch.graphable = False  # compiles: no CUDA graph records it
            return first_launch
        full += [meta[p.name] for p in self.params[len(args):]]
        grid = tuple(grid) + (1,) * (3 - len(grid))
        device = tensors[0].device.index
        function, packed, launcher = handle.function, handle.packed_metadata, handle.run
        # What the launcher's __call__ does, with the scratch allocated once: Triton 3.6's CudaLauncher.
        run, full = _encode_descriptors(launcher.launch, full)
        cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        scratch = None
        if launcher.global_scratch_size:
            scratch = buffers.empty((grid[0] * grid[1] * grid[2] * launcher.num_ctas * launcher.global_scratch_size,),
                                    torch.int8, tensors[0].device)

        return Launch(run, grid, device, (function, cooperative, pdl, scratch, None, packed, None, None, None), full,
                      args, run is launcher.launch)

    def _check_resident(self, key, grid: tuple, args, meta) -> None:
        """Refuse a grid larger than what the device holds at once (compiling the kernel first if
        this specialization has not been)."""
        if key not in self.resident:
            with scratch_allocator():
                compiled = self.fn.warmup(*args, grid=grid, **meta)
            compiled._init_handles()
            limits = SMLimits.of(torch.cuda.current_device())
            per_sm = limits.programs_per_sm(compiled.metadata.num_warps, compiled.n_regs, compiled.metadata.shared)
            self.resident[key] = (per_sm * torch.cuda.get_device_properties(key[1]).multi_processor_count, per_sm,
                                  compiled)
        resident, per_sm, compiled = self.resident[key]
        programs = math.prod(grid)
        if programs > resident:
            raise RuntimeError(
                f"{self.fn.__name__}: a grid of {programs} programs, but the device holds {resident} at once "
                f"({per_sm} per SM at {compiled.metadata.num_warps} warps, {compiled.n_regs} registers a thread, "
                f"{compiled.metadata.shared} bytes of shared memory); its programs wait on each other, so a larger "
                "grid could deadlock")

    def _check_unspecialized(self, args) -> None:
        for p, a in zip(self.params, args):
            if isinstance(a, int) and not p.do_not_specialize:
                raise TypeError(f"{self.fn.__name__}: integer argument '{p.name}' must be listed in do_not_specialize")


class Launch:
    """A prepared launch: calling it launches the kernel on the stream current then (the caller's, or the one
    a CUDA graph records from). It keeps its arguments (tensors alive). `full` holds the launcher's arguments
    after the grid and launch options: where `plain`, the kernel's own, one for one with `args` (a tensor's
    address in its place), else with TMA descriptors encoded. What lets a call's template aim the same
    launch at other memory (`train/program.py: Template`)."""

    __slots__ = ("run", "grid", "device", "head", "full", "args", "plain", "what")
    graphable = True

    def __init__(self, run, grid, device, head, full, args, plain: bool):
        self.run, self.grid, self.device, self.head, self.full = run, grid, device, head, full
        self.args, self.plain, self.what = args, plain, None

    def __call__(self) -> None:
        self.run(self.grid[0], self.grid[1], self.grid[2], current_stream(self.device), *self.head, *self.full)

    def at(self, full) -> None:
        """This launch with the launcher's arguments `full` instead (other addresses, same kernel and grid)."""
        self.run(self.grid[0], self.grid[1], self.grid[2], current_stream(self.device), *self.head, *full)


def _torch_scratch(size: int, alignment: int, stream):
    return buffers.empty((size,), torch.int8, torch.device("cuda", torch.cuda.current_device()))  # 512-byte aligned


@contextlib.contextmanager
def scratch_allocator():
    """Global scratch for the JIT launches inside (kernels that build TMA tensor descriptors on the
    device write them there), from torch's allocator on the current device and stream. Triton keeps
    its allocator in a context variable; it is set for these launches only and restored after, so a
    caller's own `triton.set_allocator` is left as it was. (Outside SUPPORTED_TRITON, where that
    variable may not exist, through the public `triton.set_allocator`.)"""
    if _allocation is None:
        triton.set_allocator(_torch_scratch)
        yield
        return
    token = _allocation._allocator.set(_torch_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)
