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
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .kernels import buffers

FP16_MAX = 65504.0
# Elements a few times smaller than the largest sit below 2^-14, where fp16's absolute spacing
# 2^-24 starts to exceed its usual relative error (2^-11 of the tensor's typical element).
SMALLEST_SAFE_MAX = 2.0**-12


class Fp16RangeWarning(UserWarning):
    """A fused backward met values outside fp16's safe range and recomputed in fp32 instead."""


_enabled = True


@contextlib.contextmanager
def fp16_range_check(enabled: bool):
    """Turn the fused kernels' fp16 range guard on (the default) or off inside the block.

    The guard reads a few hundred bytes back from the GPU at the end of each fused backward (so the
    host waits for the GPU there); off, values beyond 65504 give Inf/NaN and tensors whose largest
    element is below 2^-12 lose precision silently. It is skipped during CUDA-graph capture.
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
        self.regions = []  # (name, start, stop, underflow checked)
        self.size = 0
        self.slots = None
        self.device = None

    def reserve(self, counts: dict, *, overflow_only=()) -> int:
        """A block of consecutive regions, {tensor name: slots} (empty ones skipped); returns its
        offset. Regions named in overflow_only can vanish by cancellation: no underflow check."""
        start = -(-self.size // 4) * 4  # 16-byte aligned, so every block's pointer is too
        at = start
        for name, n in counts.items():
            if n:
                self.regions.append((name, at, at + n, name not in overflow_only))
            at += n
        self.size = at
        return start

    def allocate(self, device) -> None:
        self.device = torch.device(device)
        self.slots = buffers.empty((self.size + 1,), torch.float32, "cpu", pinned=self.device.type == "cuda")

    def block(self, offset: int) -> torch.Tensor:
        return self.slots[offset:]

    def out_of_range(self) -> list:
        """(region, largest |value|) of every region outside fp16's safe range; reads the slots."""
        if not self.regions:
            return []
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        host = self.slots.numpy()
        bounds = [i for _, start, stop, _ in self.regions for i in (start, stop)]
        maxima = np.maximum.reduceat(host, bounds)[::2]  # over [start, stop) of each region
        return [(name, float(m)) for (name, _, _, underflow), m in zip(self.regions, maxima)
                if not m <= FP16_MAX or (underflow and 0 < m < SMALLEST_SAFE_MAX)]


def describe(outside: list, shown: int = 3) -> str:
    """'name (largest |value| m), ...' for the first `shown` regions of out_of_range()."""
    text = ", ".join(f"{name} (largest |value| {m:.3g})" for name, m in outside[:shown])
    return text + (f" and {len(outside) - shown} more" if len(outside) > shown else "")
