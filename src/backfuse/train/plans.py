"""The training paths' plans, made once per shape and option set and looked up afterwards (a dict lookup per
call: a plan is also what keys a call's CUDA graph, so the same shape must find the same plan object).

Nothing here imports Triton (`backfuse.functional` imports this module).
"""

from __future__ import annotations

import dataclasses

import torch

_plans: dict = {}  # (op, signature, options) -> plan
_sms: dict = {}  # device -> SM count


def cached(key, make):
    """The plan kept for key, made by make() the first time."""
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = make()
    return plan


def replaced(plan, **changes):
    """plan with changes (dataclasses.replace), one object per (plan, changes)."""
    return cached((id(plan), tuple(sorted(changes.items()))), lambda: dataclasses.replace(plan, **changes))


def needs_plan(plan, needs: tuple, own: bool = False):
    """plan computing only the gradients flagged in needs; own: each in memory of its own (the custom ops:
    torch.library's contract forbids outputs that alias each other)."""
    return replaced(plan, needs=needs, own_grads=own)


def sm_count(device: torch.device) -> int:
    """The device's SM count (0 off a GPU: the plans' sign for the interpreter's tiles)."""
    if device.type != "cuda":
        return 0
    n = _sms.get(device)
    if n is None:
        n = _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def signature(tensors) -> tuple:
    """What a plan depends on, as cheaply as the host can read it: each input's shape, dtype and device index."""
    return tuple((t.shape, t.dtype, t.get_device()) if isinstance(t, torch.Tensor) else type(t) for t in tensors)


def contiguous(tensors) -> list:
    return [t if t is None else t.contiguous() for t in tensors]
