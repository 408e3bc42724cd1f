"""Compiling Gluon and Triton kernels for sm_90 on any machine (no GPU needed), and reading what they use.

Gluon has no interpreter: a CPU-only machine (CI) checks these kernels by compiling them for the
H100/H200 target, which catches API breaks, shared-memory overruns and register limits (ptxas
refuses a wgmma accumulator that does not fit under `maxnreg`) before any GPU time is spent. The
Triton interpreter runs a kernel's arithmetic but not its compilation: the shared memory a tile
choice needs on the GPU shows only here (`compile_triton`).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from ..config import SM90_SHARED_BYTES

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = SM90_SHARED_BYTES  # bytes of shared memory one block may use on sm_90
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def descriptor_type(dtype, block, layout=None) -> str:
    """The signature type of a host TensorDescriptor argument with this block (default NVMMA layout)."""
    layout = layout or gl.NVMMASharedLayout.get_default_for(block, dtype)
    name = {gl.float32: "fp32", gl.float16: "fp16"}[dtype]
    return f"tensordesc<{name}[{', '.join(map(str, block))}],{layout!r}>"


@dataclass(frozen=True)
class Usage:
    shared: int  # bytes
    registers: int  # per thread, as compiled
    local: int  # bytes of local memory per thread outside the stack frame
    stack: int  # bytes of stack frame per thread: where ptxas puts register spills
    wgmma: int  # HGMMA instructions in the SASS
    waits: int = 0  # WARPGROUP.DEPBAR instructions: waits for the wgmma in flight

    @property
    def serialized(self) -> bool:
        """ptxas made every wgmma wait for the one before (its C7515 "Potential Performance Loss"): a wait each."""
        return self.wgmma > 0 and self.waits >= self.wgmma

    def __str__(self) -> str:
        return (f"smem {self.shared / 1024:6.1f} KB  regs {self.registers:3d}  local {self.local:4d} B  "
                f"stack {self.stack:4d} B  HGMMA {self.wgmma:3d}{' serialized' if self.serialized else ''}")


def compile_sm90(fn, signature: dict, constexprs: dict, *, num_warps: int, maxnreg: int | None = None):
    """fn compiled for sm_90. signature: name -> type for every non-constexpr argument ('*fp32',
    'i32', descriptor_type(...)); pointers are taken as 16-byte aligned, as the allocator gives them."""
    sig = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=SM90, options=options)


def compile_triton(fn, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int):
    """A Triton kernel compiled for sm_90, as `compile_sm90` (its launch options: warps and pipeline stages)."""
    sig = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if sig[name].startswith("*")}
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=SM90,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def usage(kernel) -> Usage:
    """Shared memory, registers, local memory, stack (spills), wgmma and wgmma-wait counts of a compiled kernel
    (cuobjdump on its cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return Usage(kernel.metadata.shared, int(re.search(r"REG:(\d+)", res).group(1)),
                 int(re.search(r"LOCAL:(\d+)", res).group(1)), int(re.search(r"STACK:(\d+)", res).group(1)),
                 sass.count("HGMMA"), sass.count("WARPGROUP.DEPBAR"))
