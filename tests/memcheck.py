"""A memory check for the Triton interpreter (`pytest --memcheck`): every load, store and atomic a kernel makes
must touch only the memory of the tensors passed to its launch (each one's whole allocation), as NVIDIA's
compute-sanitizer checks on a GPU. The interpreter reads and writes raw addresses without bounds, so an access
past a tensor reads another allocation's bytes or writes over them without a sign; here it fails the test with
the kernel's name and the first address outside.

Where a masked access is allowed its masked-off lanes are not checked (they touch nothing).
"""

from __future__ import annotations

import inspect

import numpy as np

_launches: list = []  # (kernel name, [(first byte, one past the last)] of its tensor arguments' allocations)


class OutOfBounds(AssertionError):
    pass


def _allocations(values) -> list:
    spans = []
    for v in values:
        if isinstance(v, (tuple, list)):
            spans += _allocations(v)
        elif hasattr(v, "untyped_storage"):
            storage = v.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return spans


def _check(ptrs, mask, what: str) -> None:
    if not _launches or ptrs is None:
        return
    name, spans = _launches[-1]
    addresses = np.asarray(ptrs.data).astype(np.uint64).reshape(-1)
    if mask is not None:
        addresses = addresses[np.asarray(mask.data).astype(bool).reshape(-1)]
    if addresses.size == 0:
        return
    size = np.uint64(_element_bytes(ptrs))
    inside = np.zeros(addresses.shape, dtype=bool)
    for first, end in spans:
        inside |= (addresses >= np.uint64(first)) & (addresses + size <= np.uint64(end))
    if not inside.all():
        bad = int(addresses[~inside][0])
        nearest = min(spans, key=lambda s: min(abs(bad - s[0]), abs(bad - s[1]))) if spans else None
        raise OutOfBounds(f"{name}: a {what} of {int((~inside).sum())} element(s) outside every tensor argument's "
                          f"memory (first at {bad:#x}; nearest argument spans {nearest[0]:#x}..{nearest[1]:#x})"
                          if nearest else f"{name}: a {what} with no tensor argument")


def _element_bytes(ptrs) -> int:
    element = ptrs.get_element_ty()
    return max(1, element.primitive_bitwidth // 8)


def install() -> None:
    """Wrap the interpreter's launches and memory operations (once per process)."""
    import triton.runtime.interpreter as interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if getattr(executor, "_memcheck", False):
        return
    call = executor.__call__

    def checked_call(self, *args, **kwargs):
        _launches.append((getattr(self.fn, "__name__", str(self.fn)), _allocations([*args, *kwargs.values()])))
        try:
            return call(self, *args, **kwargs)
        finally:
            _launches.pop()

    executor.__call__ = checked_call
    executor._memcheck = True

    def wrap(method, what, ptr_at, mask_at=None):
        original = getattr(builder, method)
        names = list(inspect.signature(original).parameters)[1:]  # (after self)

        def argument(args, kwargs, at):
            return args[at] if at < len(args) else kwargs.get(names[at])

        def checked(self, *args, **kwargs):
            _check(argument(args, kwargs, ptr_at), None if mask_at is None else argument(args, kwargs, mask_at), what)
            return original(self, *args, **kwargs)

        setattr(builder, method, checked)

    wrap("create_load", "load", 0)
    wrap("create_masked_load", "load", 0, 1)
    wrap("create_store", "store", 0)
    wrap("create_masked_store", "store", 0, 2)
    wrap("create_atomic_rmw", "atomic", 1, 3)
    wrap("create_atomic_cas", "atomic", 0)
