"""Host-side pieces the Gluon launchers share."""

from __future__ import annotations


def fp16_descriptor(t, block):
    """A host TMA descriptor of fp16 tensor t in tiles of `block`, in the default NVMMA shared layout
    (the one the kernels allocate their tiles in: `descriptor.layout`)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.float16))
