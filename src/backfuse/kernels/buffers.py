"""Allocation of kernel outputs and scratch, with an optional poison fill for tests."""

from __future__ import annotations

import contextlib

import torch

_poison = False
_zeroed: dict = {}  # (device, stream): int32 slots that stay zero between kernels
_tables: dict = {}  # (device, queue): its int32 table on the device, most recently used last
TABLES_KEPT = 64


@contextlib.contextmanager
def poisoned():
    """Fill every buffer the kernels allocate with NaN (integers: -1), so unwritten elements show."""
    global _poison
    saved, _poison = _poison, True
    try:
        yield
    finally:
        _poison = saved


def empty(shape, dtype, device, pinned: bool = False, strides=None) -> torch.Tensor:
    """pinned: page-locked host memory (device "cpu"), which GPU kernels can write directly; strides: laid out
    with these (dense: a permutation of a contiguous tensor's), else contiguous."""
    if not _poison and not pinned and not torch.are_deterministic_algorithms_enabled():
        if strides is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)
    # Our kernels write every element they later read (the poisoned tests check it), so torch's
    # deterministic-mode fill of fresh memory would only add a kernel per buffer.
    deterministic = torch.utils.deterministic
    fill, deterministic.fill_uninitialized_memory = deterministic.fill_uninitialized_memory, False
    try:
        t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned) if strides is None else \
            torch.empty_strided(shape, strides, dtype=dtype, device=device, pin_memory=pinned)
    finally:
        deterministic.fill_uninitialized_memory = fill
    if _poison:
        t.fill_(float("nan") if t.is_floating_point() else 255 if t.dtype == torch.uint8 else -1)
    return t


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device for the call."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def queue_table(queue, device: torch.device) -> torch.Tensor:
    """A task queue's int32 table (`kernels/queue.py`) on `device`. The table depends only on the plan
    (a function of the shape and the options, like a compiled kernel), and a host-to-device copy per
    call would join the call's span; so the TABLES_KEPT most recently used tables stay on the device.
    It holds no data of any call: no pointers, values or results."""
    if device.type != "cuda":
        return torch.tensor(queue.table, dtype=torch.int32)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    key = (device, queue)
    table = _tables.pop(key, None)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("backfuse: call the operator once at this shape before capturing it in a CUDA graph "
                               "(its task table is uploaded on the first call)")
        table = torch.tensor(queue.table, dtype=torch.int32).to(device)
    _tables[key] = table
    while len(_tables) > TABLES_KEPT:
        _tables.pop(next(iter(_tables)))
    return table


def zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros for a kernel that leaves them zero when it finishes (the Gluon kernels' completion
    counters: their last program resets them), so a call needs no memset launch. One buffer per device
    and stream (kernels on one stream run one after another), grown when a call needs more slots;
    during CUDA graph capture a fresh buffer instead (its zero fill becomes part of the graph). On the
    CPU (the Triton interpreter) a fresh buffer each call."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    slots = _zeroed.get(key)
    if slots is None or slots.numel() < n:
        slots = _zeroed[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return slots[:n]
