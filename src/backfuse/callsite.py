"""Where backfuse's warnings point: at the user's line, not at backfuse's or torch's internals; and
their category, BackfuseWarning.

A warning raised inside a fused backward is several frames below the user's code, some of them
torch's (the dispatcher's `torch/_ops.py`, autograd's engine), so no fixed `stacklevel` finds the
user. `warn` attributes a warning to the innermost frame outside backfuse and torch, or to a site
recorded earlier (`attributed_to`): the training ops record their forward's call site, because their
backward may run on an autograd worker thread (CUDA), whose stack holds no user frame at all.
"""

from __future__ import annotations

import contextvars
import os
import sys
import warnings

import torch


class BackfuseWarning(UserWarning):
    """The category of backfuse's own warnings (filter it to silence them all; the test suite makes it an error)."""


_INTERNAL = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))
# The model libraries backfuse patches: a warning from a patched model points past their frames too, at the
# line that called the model (or the training loop's backward).
_LIBRARIES = ("transformers", "diffusers", "peft", "accelerate", "trl")
_SITE = contextvars.ContextVar("backfuse_warning_site", default=None)


def _internal() -> tuple:
    """Directories whose frames are not the user's: backfuse's, torch's, and the model libraries' imported."""
    found = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            found.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return _INTERNAL + tuple(found)


def user_site():
    """(filename, line, module globals) of the innermost frame outside backfuse, torch and the model
    libraries, or None.

    The filename may name no file (`<stdin>`, `<string>`, a notebook cell); warnings prints the
    line's text where `linecache` has it (files, and the cells IPython registers there)."""
    internal = _internal()
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(internal):
            return frame.f_code.co_filename, frame.f_lineno, frame.f_globals
        frame = frame.f_back
    return None


class attributed_to:
    """Warnings raised inside the block point at `site` (a user_site(); None: find it then). (A class: entered
    on every guarded backward, where a generator's context manager costs the host a few times more.)"""

    __slots__ = ("site", "token")

    def __init__(self, site):
        self.site = site

    def __enter__(self):
        self.token = _SITE.set(self.site)

    def __exit__(self, *exc) -> None:
        _SITE.reset(self.token)


def warn(message: str, category: type) -> None:
    """warnings.warn, attributed to the recorded site or else to the innermost user frame.

    The module's globals are not handed to `warn_explicit`: it would ask their `__loader__` for the
    source, and `__main__`'s loader in the REPL, `python -c` and stdin (BuiltinImporter) raises
    ImportError there instead of answering None. Only the warning filters (an "error" filter) may
    turn the warning into an exception."""
    site = _SITE.get() or user_site()
    if site is None:
        warnings.warn(message, category, stacklevel=2)
        return
    filename, line, module_globals = site
    warnings.warn_explicit(message, category, filename, line, module=module_globals.get("__name__", "__main__"),
                           registry=module_globals.setdefault("__warningregistry__", {}))
