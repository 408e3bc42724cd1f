"""The fp16 range guard of the training paths, with no host synchronization.

fp16 holds magnitudes up to 65504 at full precision down to 2^-14; the products of a training call
on float32 (or float16) inputs take fp16 operands. Every kernel that rounds a tensor to fp16, or reads
one that cuBLAS rounded, folds the tensor's largest |value| into that tensor's region maximum on the
device. The call's last launch, `guard_check_kernel`, then checks every region against the rule of
`backfuse/fp16_guard.py` (overflow everywhere; underflow where a tensor's size follows its inputs')
and writes what it found into a log in pinned host memory. Nothing is read back during the call: the
host reads the log (a plain memory read) at the start of the op's next call, or in `check_ranges()`,
and warns (`Fp16RangeWarning`) naming the call, the tensor and its largest |value|.

The upstream gradients of a mean-reduced loss are tiny, so every call scales them by a power of two
2^k on the device (exact: it commutes with rounding, and the outputs are divided by 2^k again). k is
chosen there too, from this call's largest |upstream gradient| and from how large the tensors formed from
them were relative to it in the last call (kept per layer): 0 where everything fits with 4 bits to spare
at both ends, else the last call's k where that fits, else the upstream gradients' largest |value| into
[1, 2), within what the others allow. The gradients are read once: cast at the last call's k while their
largest |value| is taken, and cast a second time only where this call's k differs (`steps.upstream_casts`:
a layer's first call, a jump of their size). So a call's graph is the same at every scale, a sudden
change of the gradients' size costs one more read of them, and the host never waits.

A call whose values did not fit (a tensor formed from the upstream gradients jumping by more than the
margin relative to them, or an input fp16 cannot hold) is not recomputed: its outputs stand, and the
warning says which call it was. bfloat16 products, which hold fp32's range, need no guard.

State per op, direction, layer (the address of its first weight: each layer of a model keeps its own
scale, as gradients differ by orders of magnitude between layers) and device: a few float32 on the device (STATE_FIELDS), the
region maxima and their flags, and the log [calls, regions found out of range in all, then per
region: bad calls, last bad call, its largest |value| unscaled]. Calls of one op on two streams at
once share it (their maxima mix, which can only make a warning more likely, never hide one).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import callsite
from ..fp16_guard import FP16_MAX, SMALLEST_SAFE_MAX, Fp16RangeWarning
from ..kernels import buffers
from ..kernels.schedule import Holds

STATE_FIELDS = ("used", "amax", "rho_max", "rho_min", "redo")  # `kernels/triton/passes.py`
MAX_REGIONS = 32
GUARDS_KEPT = 1024  # the most recently used (a model's layers, and the direction of each)

_guards: OrderedDict = OrderedDict()


def flags(holds: Holds, upstream: bool = False) -> int:
    """A region's flags for the check kernel: 1 linear in the upstream gradients, 2 checked for
    underflow, 4 the upstream gradients themselves."""
    return int(holds.linear) | 2 * int(holds.underflow_checked) | 4 * int(upstream or holds is Holds.UPSTREAM)


class Guard:
    """The guard of one op direction (`label`, e.g. 'backfuse.functional.wan_xattn backward') on
    `device`: regions (name, Holds) in index order; scaled: the calls scale their upstream gradients."""

    def __init__(self, label: str, regions: tuple, device: torch.device, scaled: bool):
        if len(regions) > MAX_REGIONS:
            raise ValueError(f"{label}: {len(regions)} range regions, at most {MAX_REGIONS}")
        self.label, self.regions, self.scaled = label, tuple(regions), scaled
        self.index = {name: i for i, (name, _) in enumerate(self.regions)}
        self.maxima = torch.zeros(max(1, len(regions)), dtype=torch.float32, device=device)
        self.flags = torch.tensor([flags(h) for _, h in self.regions] or [0], dtype=torch.int32).to(device)
        self.state = torch.zeros(8, dtype=torch.float32, device=device)
        self.log = buffers.empty((2 + 3 * max(1, len(regions)),), torch.float32, "cpu",
                                 pinned=device.type == "cuda")
        self.log.zero_()
        self._host = self.log.numpy()
        self.seen = [0] * len(self.regions)
        self.seen_total = 0.0

    def slot(self, name: str) -> int:
        return self.index[name]

    def poll(self) -> None:
        """Warn about the regions of calls checked since the last poll that were out of range (reads
        pinned memory the device writes: no synchronization; a call still running is seen later)."""
        host = self._host
        if host[1] == self.seen_total:
            return  # nothing new (one read of host memory: the common case)
        self.seen_total = float(host[1])
        found = []
        for i, (name, holds) in enumerate(self.regions):
            bad = int(host[2 + 3 * i])
            if bad > self.seen[i]:
                found.append((name, holds, bad - self.seen[i], int(host[3 + 3 * i]) + 1, float(host[4 + 3 * i])))
                self.seen[i] = bad
        if found:
            callsite.warn(self.describe(found), Fp16RangeWarning)

    def describe(self, found) -> str:
        parts = []
        for name, holds, count, last, value in found:
            calls = "call" if count == 1 else f"{count} calls, the last"
            parts.append(f"{name} ({calls} {last}: largest |value| {value:.3g})")
        fixable = all(holds.linear for _, holds, *_ in found) and self.scaled
        then = ("the next calls scale the upstream gradients to fit" if fixable else
                "those calls' gradients may hold Inf or lost precision; bfloat16 inputs hold fp32's range")
        return (f"{self.label}: {'; '.join(parts)} outside fp16's safe range [{SMALLEST_SAFE_MAX:g}, {FP16_MAX:g}]; "
                f"{then}")

    @property
    def calls(self) -> int:
        """Calls checked on the device so far (as far as the host sees now)."""
        return int(self._host[0])


def of(plan, label: str, direction: str, regions: tuple, device: torch.device, owner: int = 0) -> Guard | None:
    """The guard of a training call, made on first use (None where the plan's products are bfloat16:
    `Precision.guarded`): label the op's ('backfuse.functional.wan_xattn'), direction 'forward' or 'backward',
    regions that direction's (a module constant: one object for every call); owner what tells a model's layers
    apart (the address of the layer's first weight). The backward of float32 inputs scales its upstream
    gradients (`Guard.scaled`)."""
    if not plan.guarded:
        return None
    scaled = direction == "backward" and plan.casts
    key = (label, direction, device, scaled, owner)  # (cheap to hash: the regions follow from label and direction)
    g = _guards.get(key)
    if g is None or g.regions is not regions:  # (Guard keeps a tuple as it is)
        g = _guards[key] = Guard(f"{label} {direction}", regions, device, scaled)
        while len(_guards) > GUARDS_KEPT:
            _guards.popitem(last=False)
    else:
        _guards.move_to_end(key)
    return g


def tensors(*gs) -> tuple:
    """The memory the guards gs (None: no guard) give a call's launches, for `train/program.py: bases`: a
    graph or template of the call names it, so one taken while another guard stood for the layer (before
    `reset`, or before its guard was evicted) is never launched at the memory of a guard that is gone."""
    out = ()
    for g in gs:
        if g is not None:
            out += (g.maxima, g.flags, g.state, g.log)
    return out


def check_ranges() -> None:
    """Wait for the GPU, then warn about every training call whose fp16 tensors left fp16's safe range
    and that no warning named yet (the ops do this without waiting at their next call)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    for g in _guards.values():
        g.poll()


def reset() -> None:
    """Forget every guard's state (tests: each starts with no exponent chosen and nothing seen)."""
    _guards.clear()
