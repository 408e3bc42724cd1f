"""The Triton interpreter's per-call patching made cheaper, its effect unchanged (conftest installs it on a CPU).

Before each launch, and again at every call of a @triton.jit helper from inside a kernel, the interpreter patches
`triton.language`'s builtins to interpreted ones (`interpreter._patch_lang`): `_patch_builtin` walks the whole
module with `inspect.getmembers` (a sorted scan of every attribute) to find them. That scan was a third of the
interpreter's time on a Gemma 3 call (thousands of helper calls, ~0.25 ms a scan). Here the scan is done once, on
the untouched modules, and each call then looks up only the names found: the same members are patched, in the
same order, by the interpreter's own `_patch_attr` (a name whose member is no longer a builtin, already patched
in this launch, is passed over, as the scan passed it over). The modules' builtins are fixed at import, and the
interpreter's patches put non-builtins in their place and restore the originals, so no name outside the first
scan ever holds a builtin. A package not scanned at install goes through the interpreter's own code.
"""

from __future__ import annotations

import inspect


def install() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_builtin
    if getattr(original, "_fast", False):
        return
    is_builtin = tl.core.is_builtin
    packages = (tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base)
    names = {id(pkg): (pkg, [name for name, member in inspect.getmembers(pkg) if is_builtin(member)])
             for pkg in packages}

    def _patch_builtin(pkg, builder, scope):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            return original(pkg, builder, scope)
        for name in known[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin._fast = True
    interpreter._patch_builtin = _patch_builtin
