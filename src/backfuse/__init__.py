"""backfuse: fused backward kernels for three attention blocks (SOL-ExecBench 072, 037, 021)."""

import os as _os
import sys as _sys


def _interpreter_without_a_gpu() -> None:
    """Without a CUDA GPU backfuse's kernels run in the Triton interpreter, which must be on before triton
    is first imported: importing backfuse turns it on (TRITON_INTERPRET=1) where no CUDA device is there,
    triton is not imported yet and the user did not set TRITON_INTERPRET. Where triton came first (some
    libraries import it), the ops say in one line what to set (`problem.fused_unusable`)."""
    if "TRITON_INTERPRET" in _os.environ or "triton" in _sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["TRITON_INTERPRET"] = "1"


_interpreter_without_a_gpu()

from .callsite import BackfuseWarning  # noqa: E402
from .fp16_guard import Fp16RangeWarning, fp16_range_check  # noqa: E402
from .kernels.graphs import GraphWarning, cuda_graphs  # noqa: E402
from .ops import PROBLEMS  # noqa: E402
from .problem import Problem  # noqa: E402

__version__ = "0.1.0"
__all__ = ["PROBLEM_IDS", "BackfuseWarning", "Fp16RangeWarning", "GraphWarning", "Problem", "check_ranges", "cuda_graphs",
           "cudnn_attention", "fallbacks", "fp16_range_check", "patch", "problem", "unpatch"]

PROBLEM_IDS = tuple(PROBLEMS)


def patch(model, *, quiet: bool = False) -> dict:
    """Put backfuse into a Hugging Face transformers Gemma 2 / Gemma 3 or diffusers Wan model: every
    attention module it covers runs backfuse's training ops (`backfuse/integrations`); returns
    {module class: count}, printed in one line unless quiet."""
    from .integrations import patch as patch_model

    return patch_model(model, quiet=quiet)


def unpatch(model) -> int:
    """The patched modules' own code again; returns how many were patched."""
    from .integrations import unpatch as unpatch_model

    return unpatch_model(model)


def fallbacks(model) -> dict:
    """{reason: calls} that the patched modules of `model` handed back to their own code."""
    from .integrations import fallbacks as counted

    return counted(model)


def cudnn_attention(enabled: bool):
    """A context manager: inside it, training calls planned for bfloat16 attentions on a GPU use cuDNN's
    attention where it serves them (True, the default) or backfuse's Triton attention (False)
    (`backfuse/train/cudnn.py`)."""
    from .train.cudnn import cudnn_attention as switch

    return switch(enabled)


def check_ranges() -> None:
    """Wait for the GPU, then warn about every training call whose fp16 tensors left fp16's safe range that
    no warning named yet (the training ops do this without waiting, at their next call)."""
    from .train.guard import check_ranges as check

    check()


def problem(pid: str) -> Problem:
    """The operator for an id ("072", "037", "021") or its official name."""
    if not isinstance(pid, str):
        raise TypeError(f"problem id must be a str, got {type(pid).__name__}")
    for p in PROBLEMS.values():
        if pid in (p.id, p.name):
            return p
    known = ", ".join(f"{p.id} ({p.name})" for p in PROBLEMS.values())
    raise ValueError(f"unknown problem {pid!r}; expected one of: {known}")
