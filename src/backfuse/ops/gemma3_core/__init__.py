"""Operator 037: `spec` (signature, reference; no Triton), `config` (launch shapes and the plan of a
call), `triton_kernels`, `backward` (the launcher, imported on first use by `Problem.fused`)."""

from .spec import PROBLEM

__all__ = ["PROBLEM"]
