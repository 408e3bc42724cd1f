"""The official correctness rule (PROTOCOL.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..problem import Tolerance


@dataclass(frozen=True)
class Verdict:
    passed: bool
    min_matched: float  # worst fraction of in-tolerance elements over the outputs
    reason: str = ""


def matched_ratio(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> float:
    """Fraction of elements with |out - ref| <= atol + rtol * |ref| (NaN never matches)."""
    ok = (out - ref).abs() <= tol.atol + tol.rtol * ref.abs()
    return ok.double().mean().item()


def check_outputs(outputs, references, tol: Tolerance, names) -> Verdict:
    """Every output needs the required matched ratio, no NaN/Inf, not all zeros, exact shape and dtype."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(references):
        got = len(outputs) if isinstance(outputs, (tuple, list)) else type(outputs).__name__
        return Verdict(False, 0.0, f"expected {len(references)} outputs, got {got}")
    worst = 1.0
    for name, out, ref in zip(names, outputs, references):
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape or out.dtype != ref.dtype:
            got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
            return Verdict(False, 0.0, f"{name}: expected {tuple(ref.shape)} {ref.dtype}, got {got}")
        if not torch.isfinite(out).all():
            return Verdict(False, 0.0, f"{name}: holds NaN or Inf")
        if not out.any():
            return Verdict(False, 0.0, f"{name}: all zeros")
        ratio = matched_ratio(out, ref.to(out.device), tol)
        worst = min(worst, ratio)
        if ratio < tol.ratio:
            return Verdict(False, worst, f"{name}: {ratio:.6f} of elements in tolerance, need {tol.ratio}")
    return Verdict(True, worst)
