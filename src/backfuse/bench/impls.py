"""Named implementations that `backfuse bench` runs side by side."""

from __future__ import annotations

import torch

from ..problem import Problem, fp32_matmul, fused_kernels_usable

IMPLS = ("reference", "reference_tf32", "torch_compile", "backfuse")


def implementation(problem: Problem, name: str):
    """A callable taking the official inputs and returning the outputs, for the named impl."""
    if name == "reference":
        return problem.reference
    if name == "backfuse":
        return problem.run
    if name == "reference_tf32":
        return _with_precision(problem, problem.reference_math, tf32=True)
    if name == "torch_compile":
        # One compiled graph per problem; dynamo marks axes dynamic after the first recompile.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return _with_precision(problem, torch.compile(problem.reference_math), tf32=False)
    raise ValueError(f"unknown implementation {name!r}; expected one of {list(IMPLS)}")


def fallback(problem: Problem, name: str, device) -> str | None:
    """"reference" when the named impl on this device is really the fp32 reference, else None.

    `backfuse` runs the fused kernels on CUDA tensors, and on CPU tensors only under
    TRITON_INTERPRET=1 (set before triton is first imported); elsewhere `problem.run` is the reference.
    `reference_tf32` is the reference itself off a CUDA GPU (the CPU has no TF32).
    """
    if name == "reference_tf32":
        return "reference" if torch.device(device).type != "cuda" else None
    if name != "backfuse":
        return None
    if not fused_kernels_usable(torch.device(device)):
        return "reference"
    return None


def _with_precision(problem: Problem, math_fn, *, tf32: bool):
    def run(*inputs):
        problem.validate(inputs)
        with fp32_matmul(tf32=tf32):
            return tuple(math_fn(*inputs))

    return run
