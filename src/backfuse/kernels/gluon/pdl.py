"""Programmatic dependent launch (PDL) for Gluon kernels: `kernels/triton/pdl.py`'s contract (wait for
the previous launch, then let the next one be scheduled), as the PTX both lower to."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def after_previous_launch(PDL: gl.constexpr):
    """First statement of a Gluon kernel launched after another of its operator's (`launch_pdl=True`):
    its programs wait here until the previous kernel has finished and its writes are visible."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; griddepcontrol.launch_dependents; mov.b32 $0, 0;", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
