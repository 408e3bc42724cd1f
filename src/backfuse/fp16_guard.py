"""The fp16 range guard, host side: which tensors a call rounded to fp16, how large they were, and
what happens when one is outside fp16's safe range.

fp16 holds magnitudes up to 65504 and keeps full precision down to 2^-14. A tensor beyond that top
turns into Inf; one whose largest element is tiny sinks into subnormals and silently loses
precision. Every program that converts a tile to fp16 stores that tile's largest |value| in its own
slot (no atomics, so nothing needs zeroing first; the device helper is `kernels/triton/elementwise.py:
max_abs`); the slots of one tensor form a region. The slots live in pinned host memory, which the
kernels write directly: after the last launch the host only waits for the stream (no copy joins the
call's span) and falls back to fp32 when a region is out of range. The rule is per tensor, as
per-tensor scaling would be: a tensor with some small rows is fine as long as its largest element
keeps its rounding error at fp16's usual level. Every region is checked for overflow; underflow only
where a tensor's size follows its inputs' (inputs, their projections and sums): attention gradients
can vanish by cancellation (a saturated softmax, a single key) and are then rounding noise, whose
precision does not matter.

The backward is linear in the upstream gradients, and so is every tensor the kernels form from them
(the upstream gradients themselves, their head-group sums, and every gradient). When only such
tensors are out of range, `scale_exponent` picks a power of two 2^k that brings them all back in
(from the maxima just recorded: multiplying by 2^k is exact and commutes with rounding to fp16), so
the caller can rerun the fused kernels on 2^k times the upstream gradients and divide the outputs
by 2^k instead of falling back to fp32.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from .callsite import BackfuseWarning
from .kernels import buffers
from .kernels.schedule import Holds

FP16_MAX = 65504.0
# Elements a few times smaller than the largest sit below 2^-14, where fp16's absolute spacing
# 2^-24 starts to exceed its usual relative error (2^-11 of the tensor's typical element).
SMALLEST_SAFE_MAX = 2.0**-12


class Fp16RangeWarning(BackfuseWarning):
    """A fused backward met values outside fp16's safe range and recomputed in fp32 instead."""


_enabled = True


@contextlib.contextmanager
def fp16_range_check(enabled: bool):
    """Turn the fused kernels' fp16 range guard on (the default) or off inside the block.

    The guard reads a few hundred bytes back from the GPU at the end of each fused backward (so the
    host waits for the GPU there); off, values beyond 65504 give Inf/NaN and tensors whose largest
    element is below 2^-12 lose precision silently, and tiny or huge upstream gradients are not
    scaled (the scale is chosen from what the guard reads). It is skipped during CUDA-graph capture.
    """
    global _enabled
    saved, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = saved


def checking(device: torch.device) -> bool:
    """Whether a call on `device` reads its slots now: the guard is on and no CUDA graph is being captured."""
    return _enabled and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class RangeSlots:
    """Slots for the per-program maxima of one call, grouped into named regions (one per tensor).

    An operator reserves one block of regions per launch (`reserve`), allocates once, and passes
    each launch `block(offset)`: that launch's programs store into their own slots of the block.
    """

    def __init__(self):
        self.regions = []  # (name, start, stop, Holds)
        self.size = 0
        self.slots = None
        self.device = None

    def reserve(self, regions) -> int:
        """A block of consecutive regions (`kernels/schedule.py: Region`s: name, slots, Holds; empty
        ones skipped); returns its offset."""
        start = -(-self.size // 4) * 4  # 16-byte aligned, so every block's pointer is too
        at = start
        for r in regions:
            if r.slots:
                self.regions.append((r.name, at, at + r.slots, r.holds))
            at += r.slots
        self.size = at
        return start

    def allocate(self, device) -> None:
        self.device = torch.device(device)
        self.slots = buffers.empty((self.size + 1,), torch.float32, "cpu", pinned=self.device.type == "cuda")

    def block(self, offset: int) -> torch.Tensor:
        return self.slots[offset:]

    def maxima(self) -> list:
        """(region, largest |value|, Holds) of every region; reads the slots (on a GPU this waits for
        the stream)."""
        if not self.regions:
            return []
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        host = self.slots.numpy()
        bounds = [i for _, start, stop, _ in self.regions for i in (start, stop)]
        maxima = np.maximum.reduceat(host, bounds)[::2]  # over [start, stop) of each region
        return [(name, float(m), holds) for (name, _, _, holds), m in zip(self.regions, maxima)]

    def out_of_range(self) -> list:
        """(region, largest |value|) of every region outside fp16's safe range; reads the slots."""
        return outside(self.maxima())


def outside(maxima: list) -> list:
    """(region, largest |value|) of the entries of RangeSlots.maxima() outside fp16's safe range."""
    return [(name, m) for name, m, holds in maxima if not _fits(m, holds.underflow_checked)]


def _fits(m: float, underflow: bool) -> bool:
    return m <= FP16_MAX and not (underflow and 0 < m < SMALLEST_SAFE_MAX)  # NaN fails the first test


def scale_exponent(maxima: list, current: int = 0):
    """The exponent k of the power of two to multiply the upstream gradients by, or None when no
    power of two helps.

    maxima: RangeSlots.maxima() of a call made with the upstream gradients times 2^current. A
    region's Holds says whether its tensor is linear in the upstream gradients (its maximum moves
    with them) and whether it holds the upstream gradients themselves. Every other region must
    already be in range, and the upstream gradients finite (a tensor formed from
    them that is not finite overflowed: only a smaller scale can fit, by how much the next call's
    maxima tell). Among the exponents that
    put every linear region in range, k is 0 when 0 is one of them (no scaling at all), otherwise
    the one nearest to putting the upstream gradients' largest |value| in [1, 2) (where the
    official inputs sit: the largest margin to both ends of fp16's range for them).
    """
    low, high, largest = -math.inf, math.inf, 0.0
    for name, m, holds in maxima:
        underflow = holds.underflow_checked
        if not holds.linear:
            if not _fits(m, underflow):
                return None  # not linear in the upstream gradients: scaling them cannot help
            continue
        if not math.isfinite(m):
            if holds is Holds.UPSTREAM:
                return None  # Inf or NaN in the upstream gradients themselves
            high = min(high, -1)  # formed from finite ones, it overflowed (Inf, or Inf - Inf): scale down
            continue
        if m == 0:
            continue  # zero stays exact at any scale
        high = min(high, _largest_shift(m, FP16_MAX))
        if underflow:
            low = max(low, _smallest_shift(m, SMALLEST_SAFE_MAX))
        if holds is Holds.UPSTREAM:
            largest = max(largest, m)
    if low > high:
        return None  # the linear tensors span more than fp16's safe range: no common scale fits
    if low <= -current <= high:
        return 0
    target = 1 - math.frexp(largest)[1] if largest > 0 else 0  # 2^target * largest in [1, 2)
    return current + int(min(max(target, low), high))


def _largest_shift(m: float, bound: float) -> int:
    """The largest s with m * 2^s <= bound (m > 0)."""
    s = math.floor(math.log2(bound / m))
    while math.ldexp(m, s) > bound:
        s -= 1
    while math.ldexp(m, s + 1) <= bound:
        s += 1
    return s


def _smallest_shift(m: float, bound: float) -> int:
    """The smallest s with m * 2^s >= bound (m > 0)."""
    s = math.ceil(math.log2(bound / m))
    while math.ldexp(m, s) < bound:
        s += 1
    while math.ldexp(m, s - 1) >= bound:
        s -= 1
    return s


def describe(outside: list, shown: int = 3) -> str:
    """'name (largest |value| m), ...' for the first `shown` regions of out_of_range()."""
    text = ", ".join(f"{name} (largest |value| {m:.3g})" for name, m in outside[:shown])
    return text + (f" and {len(outside) - shown} more" if len(outside) > shown else "")
