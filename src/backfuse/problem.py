"""What every operator shares: its signature, input validation, official workloads and cost model.

An operator's `spec.py` describes its signature with `Tensor` and `Scalar` entries at the sizes of
its config (`self.config`, a frozen dataclass whose default is the benchmark operator's) and supplies
four pieces of math (`draw`, `reference_math`, `forward`, `macs`); its fused path is the `backward`
function of the `backward.py` beside it. This base class turns that into the public object returned
by `backfuse.problem(...)`. Nothing here imports Triton: the fused path is imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import numbers
import os
import sys
from dataclasses import dataclass
from importlib import resources

import torch

from . import callsite, fp16_guard
from .fp16_guard import FP16_MAX, SMALLEST_SAFE_MAX, Fp16RangeWarning, RangeSlots, describe


@dataclass(frozen=True)
class Tensor:
    """A float32 tensor of an operator's signature; each dim is a constant or an axis name."""

    name: str
    dims: tuple

    def shape(self, axes: dict) -> tuple:
        return tuple(axes[d] if isinstance(d, str) else d for d in self.dims)

    def numel(self, axes: dict) -> int:
        return math.prod(self.shape(axes))


@dataclass(frozen=True)
class Scalar:
    """A Python float argument; `default` is the value the suite uses when a workload omits it; nonzero:
    the operator divides by it."""

    name: str
    default: float | None = None
    nonzero: bool = False


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    ratio: float


@dataclass(frozen=True)
class Workload:
    """One official case: its axes, its tolerance, its scalars, and NVIDIA's published B200 times."""

    uuid: str
    axes: dict
    tolerance: Tolerance
    scalars: dict
    b200_sol_ms: float | None
    b200_baseline_ms: float | None


@contextlib.contextmanager
def fp32_matmul(tf32: bool):
    """Run float32 matrix products in IEEE fp32 (the official reference) or in TF32."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = saved


# The dtypes the training paths (`Problem.backward`, `backfuse.functional`, `backfuse.nn`) take.
TRAINING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtypes_text(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def is_int(value) -> bool:
    """Whether value is an int (not a bool), or a size torch.compile traces symbolically (dynamic shapes)."""
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def check_real(value, where: str) -> float:
    """value as a float, when it is a finite real number (not a bool); else the error `where` starts. A
    number torch.compile traces (a dynamic float) is left as it is: the op gets its value at run time."""
    if torch.compiler.is_compiling():
        return value
    if type(value) is float and math.isfinite(value):  # the common case, without the ABC's isinstance
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    return float(value)


_said: set = set()


def _say_once(message: str) -> None:
    """A BackfuseWarning at the caller's line, the first time this message comes."""
    if message not in _said:
        _said.add(message)
        callsite.warn(message, callsite.BackfuseWarning)


def fused_kernels_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU tensors under the Triton interpreter."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


# Triton 3.6's interpreter turns one-element arrays into Python ints, which numpy 2.4 refuses.
INTERPRETER_NUMPY_BELOW = (2, 4)


def fused_unusable(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on tensors of `device`, in one line; None when they can."""
    if not fused_kernels_usable(device):
        if device.type != "cpu":
            return f"the fused kernels run on CUDA tensors, or on CPU tensors in the Triton interpreter, not on {device.type}"
        return ("on CPU tensors the fused kernels run only in the Triton interpreter: set TRITON_INTERPRET=1 in the "
                "environment before triton is first imported (importing backfuse first does it where there is no "
                "GPU; transformers and diffusers import triton)")
    if device.type == "cpu":
        import numpy

        language = sys.modules.get("triton.language")
        if language is not None and type(language.sum).__name__ != "InterpretedFunction":
            return ("triton was imported before TRITON_INTERPRET=1 was set, so its standard library is not "
                    "interpreted: set TRITON_INTERPRET=1 in the environment before triton is first imported")
        if tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= INTERPRETER_NUMPY_BELOW:
            below = ".".join(map(str, INTERPRETER_NUMPY_BELOW))
            return (f"the Triton interpreter (TRITON_INTERPRET=1) fails on numpy {numpy.__version__}; it needs numpy < "
                    f"{below} (backfuse's dependencies ask for the tested range: pip install 'numpy<2.3')")
    return None


class Problem:
    """Base of the three operators. Subclasses set the class attributes and the math methods."""

    id: str
    name: str
    workload_file: str
    config: object  # the operator's sizes: its spec's frozen config (default the benchmark operator's, spec.OFFICIAL)
    inputs: tuple  # of Tensor | Scalar, official order, at the config's sizes
    outputs: tuple  # of Tensor, official order
    # Which inputs are upstream gradients, and which forward inputs the outputs differentiate.
    upstream_grads: tuple
    differentiates: tuple

    # ---- the math each operator supplies -------------------------------------------------
    def draw(self, axes: dict, gen: torch.Generator, device) -> list:
        """The tensor inputs in official order, drawn as PROBLEMS.md describes."""
        raise NotImplementedError

    def reference_math(self, *inputs) -> tuple:
        """The backward in plain PyTorch (float32 in, float32 out)."""
        raise NotImplementedError

    def forward(self, *forward_inputs):
        """The forward pass being differentiated (used by tests and training integration)."""
        raise NotImplementedError

    def macs(self, axes: dict) -> int:
        """Multiply-accumulates of the matrix products the backward needs at minimum."""
        raise NotImplementedError

    # ---- the fused path ------------------------------------------------------------------
    def fused(self, *inputs, needs=None, deterministic=False, ranges=None, **options) -> tuple:
        """The fused kernels (no validation): `backward` of the `backward` module beside this
        operator's spec, imported on first use, so that importing a spec imports no Triton. needs
        (one bool per output) lets the kernels skip work for outputs nobody wants (those come back
        as None), deterministic asks for the same bits on every call and ranges (a RangeSlots)
        receives the largest |value| of every tensor the kernels round to fp16; options go to the
        launcher as they are (config, products, sms). The kernels run at this problem's sizes
        (`self.config`): their plan refuses sizes they are not made for (a ValueError naming them).
        On a device where they cannot run (`fused_unusable`), a RuntimeError says why in one line."""
        reason = fused_unusable(next(x for x in inputs if isinstance(x, torch.Tensor)).device)
        if reason:
            raise RuntimeError(f"{self.name}.fused: {reason}")
        package = type(self).__module__.rpartition(".")[0]
        backward = importlib.import_module(package + ".backward").backward
        return backward(*inputs, problem=self, needs=needs, deterministic=deterministic, ranges=ranges, **options)

    def fp32_backward(self, *inputs) -> tuple:
        """reference_math in IEEE fp32 (no validation): the fused path's fallback."""
        with fp32_matmul(tf32=False):
            return tuple(self.reference_math(*inputs))

    # ---- signature -----------------------------------------------------------------------
    @property
    def input_names(self) -> tuple:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple:
        return tuple(spec.name for spec in self.outputs)

    @property
    def scalar_specs(self) -> tuple:
        return tuple(spec for spec in self.inputs if isinstance(spec, Scalar))

    # ---- workloads -----------------------------------------------------------------------
    @functools.cached_property
    def workloads(self) -> tuple:
        text = resources.files("backfuse").joinpath("workloads", self.workload_file).read_text()
        cases = []
        for line in text.splitlines():
            if not line.strip():
                continue
            raw = json.loads(line)
            tol = raw["tolerance"]
            published = raw.get("b200_published", {})
            scalars = {s.name: s.default for s in self.scalar_specs}
            scalars.update(raw.get("scalars", {}))
            cases.append(
                Workload(
                    uuid=raw["uuid"],
                    axes=dict(raw["axes"]),
                    tolerance=Tolerance(tol["max_atol"], tol["max_rtol"], tol["required_matched_ratio"]),
                    scalars=scalars,
                    b200_sol_ms=published.get("sol_ms"),
                    b200_baseline_ms=published.get("baseline_ms"),
                )
            )
        return tuple(cases)

    @property
    def axis_names(self) -> tuple:
        return tuple(self.workloads[0].axes)

    # ---- inputs --------------------------------------------------------------------------
    def make_inputs(self, axes: dict, *, seed: int = 0, device="cpu", scalars: dict | None = None) -> list:
        """Fresh inputs in official order (scalars included) for the given axes."""
        device = torch.device(device)
        missing = [a for a in self.axis_names if a not in axes]
        unknown = [a for a in axes if a not in self.axis_names]
        if missing or unknown:
            found = "; ".join(([f"axes {missing} missing"] if missing else []) + ([f"unknown axes {unknown}"] if unknown else []))
            raise ValueError(f"{self.name}: {found}; expected {list(self.axis_names)}")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        tensors = iter(self.draw(axes, gen, device))
        values = {s.name: s.default for s in self.scalar_specs}
        values.update(scalars or {})
        return [values[spec.name] if isinstance(spec, Scalar) else next(tensors) for spec in self.inputs]

    def validate(self, inputs, *, specs=None, dtypes=(torch.float32,), contiguous=True, same_dtype=False,
                 label=None) -> dict:
        """Check count, types, dtypes, devices, layouts and shapes; return the axes they imply.

        The official entry points check the official inputs as the suite defines them (float32,
        contiguous). The training paths pass `specs` (the forward's inputs), `dtypes` (also bfloat16
        and float16), contiguous=False (they copy as needed), same_dtype (tensors of one dtype, as
        PyTorch's own ops need) and `label` (the name errors start with; default the operator's).
        """
        specs = self.inputs if specs is None else tuple(specs)
        label = label or self.name
        if len(inputs) != len(specs):
            raise TypeError(f"{label} takes {len(specs)} inputs {[s.name for s in specs]}, got {len(inputs)}")
        axes: dict = {}
        bound_by: dict = {}
        device = dtype = None
        for spec, value in zip(specs, inputs):
            if isinstance(spec, Scalar):
                if check_real(value, f"{label}: input '{spec.name}'") == 0 and spec.nonzero:
                    raise ValueError(f"{label}: input '{spec.name}' must be nonzero, got {value}")
                continue
            where = f"{label}: input '{spec.name}'"
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where} must be a torch.Tensor, got {type(value).__name__}")
            if value.dtype not in dtypes:
                raise TypeError(f"{where} must be {dtypes_text(dtypes)}, got {value.dtype}")
            if value.dim() != len(spec.dims):
                raise ValueError(f"{where} must have {len(spec.dims)} dims {self._dims_text(spec)}, got shape {tuple(value.shape)}")
            if device is None:
                device, dtype, first = value.device, value.dtype, spec.name
            elif value.device != device:
                raise ValueError(f"{where} is on {value.device}, but '{first}' is on {device}; all inputs must share a device")
            elif same_dtype and value.dtype != dtype:
                raise TypeError(f"{where} is {value.dtype}, but '{first}' is {dtype}; the tensor inputs must share "
                                f"one dtype (under torch.autocast they are all cast to torch.float32)")
            for i, (want, got) in enumerate(zip(spec.dims, value.shape)):
                if isinstance(want, str):
                    if want not in axes:
                        if got < 1:
                            raise ValueError(f"{where}: axis {want} (dim {i}) must be at least 1, got {got}")
                        axes[want], bound_by[want] = got, spec.name
                    elif axes[want] != got:
                        raise ValueError(
                            f"{where} has shape {tuple(value.shape)}, expected {self._dims_text(spec, axes)}: "
                            f"dim {i} ({want}) is {got} but '{bound_by[want]}' gives {want}={axes[want]}"
                        )
                elif want != got:
                    raise ValueError(
                        f"{where} has shape {tuple(value.shape)}, expected {self._dims_text(spec, axes)}: dim {i} must be {want}"
                    )
            if contiguous and not value.is_contiguous():
                raise ValueError(f"{where} must be contiguous, got strides {value.stride()} for shape {tuple(value.shape)}")
        return axes

    @property
    def forward_inputs(self) -> tuple:
        """The specs of the forward's inputs: the official inputs without the upstream gradients."""
        return tuple(s for s in self.inputs if s.name not in self.upstream_grads)

    @staticmethod
    def _dims_text(spec: Tensor, axes: dict | None = None) -> str:
        axes = axes or {}
        parts = [f"{d}={axes[d]}" if d in axes else str(d) for d in spec.dims]
        return "[" + ", ".join(parts) + "]"

    # ---- the public entry points -----------------------------------------------------------
    def reference(self, *inputs) -> tuple:
        """The official reference: plain PyTorch, float32, TF32 off."""
        self.validate(inputs)
        with fp32_matmul(tf32=False):
            return tuple(self.reference_math(*inputs))

    def run(self, *inputs) -> tuple:
        """The fastest implementation available for the inputs' device (the official interface:
        float32 inputs, float32 outputs).

        When a tensor the fused kernels round to fp16 is outside fp16's safe range (see
        `fp16_range_check`) and that tensor is linear in the upstream gradients (the upstream gradients
        themselves, their sums, the gradients formed from them), the kernels run again on the upstream
        gradients times an exact power of two 2^k that brings every such tensor into range, and the
        outputs are divided by 2^k; otherwise the outputs come from the fp32 reference instead, with an
        Fp16RangeWarning. (The host reads the guard's maxima after the call: this interface waits for
        the GPU, as the benchmark does; the training paths never do.)"""
        self.validate(inputs)
        first = next(x for x in inputs if isinstance(x, torch.Tensor))
        reason = fused_unusable(first.device)
        if reason:
            _say_once(f"{self.name}.run: {reason}; this call is the fp32 reference")
            return self.fp32_backward(*inputs)
        return self._guarded(inputs, fp16_guard.checking(first.device))

    def backward(self, *inputs, needs=None) -> tuple:
        """The training backward from the official inputs (upstream gradients, then the forward's
        inputs): float32, bfloat16 or float16 tensors of one dtype, each gradient in that dtype; only
        the outputs flagged in `needs` (one bool per output; None: all) are computed, the others come
        back as None. It is the training path of `backfuse.functional` without saved activations (the
        forward's launches run again first): products in the inputs' dtype, or on fp16 copies of
        float32 inputs with the device-side fp16 guard; the host never waits for the GPU."""
        self.validate(inputs, dtypes=TRAINING_DTYPES, same_dtype=True)
        if needs is not None and len(needs) != len(self.outputs):
            raise ValueError(f"{self.name}: needs has {len(needs)} flags, expected one per output "
                             f"{list(self.output_names)}")
        reason = fused_unusable(next(x for x in inputs if isinstance(x, torch.Tensor)).device)
        if reason:
            raise RuntimeError(f"{self.name}.backward: {reason}")
        package = type(self).__module__.rpartition(".")[0]  # the training module beside the spec, as `fused`'s
        training = importlib.import_module(package + ".training")
        return training.problem_backward(self, inputs, tuple(bool(n) for n in needs) if needs is not None
                                         else (True,) * len(self.outputs))

    def _guarded(self, inputs, checking) -> tuple:
        """The fused kernels under the fp16 range guard, as `run` describes."""
        extra = {"deterministic": True} if torch.are_deterministic_algorithms_enabled() else {}
        if not checking:
            return self.fused(*inputs, **extra)  # nothing would tell whether a scale fits
        attempt, tried = 0, []
        while True:
            ranges = RangeSlots()
            outs = self.fused(*self._scale_upstream(inputs, attempt), ranges=ranges, **extra)
            maxima = ranges.maxima()
            outside = fp16_guard.outside(maxima)
            if not outside:
                return self._unscale(outs, attempt)
            tried.append(attempt)
            attempt = fp16_guard.scale_exponent(maxima, attempt)
            if attempt is None or attempt in tried or len(tried) == 2:
                break  # at most one rerun, with the exponent the maxima choose
        linear = {name: holds.linear for name, _, holds in maxima}
        unscaled = [(name, m * 2.0 ** -tried[-1] if linear[name] else m) for name, m in outside]
        callsite.warn(f"{self.name}: {describe(unscaled)} outside fp16's safe range [{SMALLEST_SAFE_MAX:g}, "
                      f"{FP16_MAX:g}]; computed in fp32 instead (slower)", Fp16RangeWarning)
        return self.fp32_backward(*inputs)

    def _scale_upstream(self, inputs, exponent: int) -> list:
        """The inputs with the upstream gradients times 2^exponent (fresh tensors: the caller's stay as
        they are; exact, as a power of two)."""
        if not exponent:
            return inputs
        return [x * 2.0**exponent if name in self.upstream_grads else x for name, x in zip(self.input_names, inputs)]

    @staticmethod
    def _unscale(outs, exponent: int) -> tuple:
        if exponent:
            for o in outs:
                o.mul_(2.0**-exponent)  # in place: the outputs are the kernels' fresh buffers
        return tuple(outs)

    # ---- cost model ----------------------------------------------------------------------
    def io_bytes(self, axes: dict) -> int:
        """Fewest bytes a backward moves: every float32 input read once, every output written once."""
        tensors = [s for s in self.inputs if isinstance(s, Tensor)] + list(self.outputs)
        return 4 * sum(spec.numel(axes) for spec in tensors)

    def __repr__(self) -> str:
        return f"<backfuse problem {self.name}>"
