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

Two more per-operation costs go the same way:
- A @triton.jit helper called inside a kernel patches the language again (`InterpretedFunction.__call__`), though
  the launch under way has patched the same modules: the builtins are no longer builtins, so nothing is found, and
  the tensor and core patches put equivalent closures where the launch's already are (their scope is dropped, never
  restored). Where the helper sees no language module that the launch, or a helper before it in the launch, did
  not patch, that second patch is skipped.
- `_get_np_dtype` builds its table of sixteen dtypes at every call (tens of thousands of calls a Gemma 3 call): the
  answers are looked up once a dtype.
- Every interpreted tensor's shape is a `tl.tuple`, whose type formats its name at construction (hundreds of
  thousands a Gemma 3 call), and nothing reads most of them: the name is formatted when read, the same string.
"""

from __future__ import annotations

import inspect
import threading


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
    _skip_nested_patches(interpreter, tl)
    _np_dtypes_once(interpreter, tl)
    _tuple_names_when_read(tl)


def _skip_nested_patches(interpreter, tl) -> None:
    original = interpreter._patch_lang
    launches = threading.local()  # the language modules patched by this thread's launch under way
    langs_of: dict = {}

    def langs(fn) -> frozenset:
        found = langs_of.get(fn)
        if found is None:
            found = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    class _Kept:
        """The scope of a helper's patch that was not needed: nothing to restore."""

        def restore(self) -> None:
            pass

    def _patch_lang(fn):
        patched = getattr(launches, "langs", None)
        if patched is not None:  # a helper's call inside a launch (launches do not nest)
            if langs(fn) <= patched:
                return _Kept()
            launches.langs = patched | langs(fn)  # (the interpreter never restores a helper's patch)
            return original(fn)
        scope = original(fn)
        launches.langs = langs(fn)
        restore = scope.restore

        def restore_and_end() -> None:
            launches.langs = None
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = _patch_lang


def _np_dtypes_once(interpreter, tl) -> None:
    original = interpreter._get_np_dtype
    uint64 = original(tl.pointer_type(tl.int8))
    table: dict = {}

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return uint64
        found = table.get(tt_dtype)
        if found is None:
            found = table[tt_dtype] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = _get_np_dtype


def _tuple_names_when_read(tl) -> None:
    tuple_type = tl.core.tuple_type

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    def name(self) -> str:
        return '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'

    tuple_type.__init__ = __init__
    tuple_type.name = property(name)
