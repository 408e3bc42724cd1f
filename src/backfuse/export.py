"""SOL-ExecBench solution packages: our fused operator as a self-contained set of sources.

The package carries the operator code (`problem.py`, `fp16_guard.py`, `callsite.py`, `ops/`, `kernels/`) under its own top-level
name, so it never picks up (or clashes with) an installed backfuse, and an entry-point file whose
`run` takes the official inputs in order and returns the outputs in order.
"""

from __future__ import annotations

import pathlib

from .problem import Problem

PACKAGE = "backfuse_solution"
ENTRY_FILE = "solution.py"
_ROOT = pathlib.Path(__file__).resolve().parent
_PARTS = ("__init__.py", "problem.py", "fp16_guard.py", "callsite.py", "ops", "kernels")  # what `run` needs; not the harness or CLI

_ENTRY = '''"""SOL-ExecBench entry point for {name} (backfuse {version})."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from {package} import problem as _problem  # noqa: E402

_OPERATOR = _problem("{pid}")


def run(*inputs):
    """The official outputs, in order, from the official inputs, in order."""
    return _OPERATOR.run(*inputs)
'''


def _package_files() -> list:
    files = []
    for part in _PARTS:
        path = _ROOT / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def solution(prob: Problem, *, author: str = "backfuse") -> dict:
    """The solution package (a JSON-ready dict) for one operator."""
    from . import __version__

    sources = [{"path": f"{PACKAGE}/{f.relative_to(_ROOT).as_posix()}", "content": f.read_text()}
               for f in _package_files()]
    entry = _ENTRY.format(name=prob.name, version=__version__, package=PACKAGE, pid=prob.id)
    return {
        "name": f"backfuse_{prob.id}",
        "definition": prob.name,
        "author": author,
        "description": f"backfuse {__version__}: fused Triton backward (fp16 tensor cores, fp32 accumulation) "
                       f"of {prob.name}.",
        "spec": {
            "languages": ["triton"],
            "target_hardware": ["B200", "LOCAL"],
            "entry_point": f"{ENTRY_FILE}::run",
            "dependencies": ["torch", "triton"],
            "destination_passing_style": False,
        },
        "sources": [{"path": ENTRY_FILE, "content": entry}] + sources,
    }
