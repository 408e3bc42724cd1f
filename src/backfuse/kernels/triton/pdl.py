"""Programmatic dependent launch (PDL, Hopper) between the launches of one operator."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def after_previous_launch(PDL: tl.constexpr):
    """First statement of every kernel of an operator. A kernel launched with `launch_pdl=True` may
    have its programs scheduled while the previous kernel's last ones still run, which hides the
    launch latency between dependent kernels; they wait here until that kernel has finished and its
    writes are visible. Then each program lets the next kernel's programs be scheduled. An
    operator's first kernel calls this too (its wait is a no-op) but is launched without
    `launch_pdl`: else its programs would wait, and be timed, during whatever ran before the
    operator."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
