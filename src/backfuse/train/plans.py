"""The training paths' plans, made once per shape and option set and looked up afterwards (a dict lookup per
call: a plan is also what keys a call's CUDA graph, so the same shape must find the same plan object).

Nothing here imports Triton (`backfuse.functional` imports this module).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

PLANS_KEPT = 4096  # plans kept (a training run of changing lengths makes one per length and option set)


class Plans(OrderedDict):
    """The plans by key, at most PLANS_KEPT, the least recently looked up dropped first (a plan dropped
    and made again is another object: the graphs kept for the old one are no longer found, and age out
    of their own bounded cache)."""

    def get(self, key, default=None):
        plan = super().get(key, default)
        if plan is not default:
            self.move_to_end(key)
        return plan

    def __setitem__(self, key, plan):
        super().__setitem__(key, plan)
        while len(self) > PLANS_KEPT:
            self.popitem(last=False)


_plans = Plans()  # (op, signature, options) -> plan
_pending = Plans()  # plan -> [calls, the plan to take at its CUDNN_AFTER-th call] (`recurring`)
CUDNN_AFTER = 64  # calls of a shape before its attention moves to cuDNN's (`recurring`)
_sms: dict = {}  # device -> SM count


def cached(key, make):
    """The plan kept for key, made by make() the first time."""
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = make()
    return plan


def replaced(plan, **changes):
    """plan with changes (dataclasses.replace), one object per (plan, changes), kept in the plan itself (its
    `variants`): it lives as long as the plan does, and a call finds it by one dict lookup of the changes."""
    key = tuple(sorted(changes.items()))
    variant = plan.variants.get(key)
    if variant is None:
        variant = plan.variants[key] = dataclasses.replace(plan, **changes)
    return variant


def recurring(plan, later) -> None:
    """From `plan`'s CUDNN_AFTER-th lookup on (`looked_up`), `later` takes its place (cuDNN's attention: torch
    builds cuDNN's plan for each new shape, ~80 ms of host time a direction, which a shape met a few times,
    as a training loop of changing lengths meets each, never earns back; until then `plan`, our Triton
    attention). Keyed by the plan itself (it hashes by identity: no key tuple hashed again per call)."""
    _pending[plan] = [0, later]


def looked_up(key, plan):
    """plan, or the plan `recurring` set for it (kept for key from then on) once plan has been looked up
    CUDNN_AFTER times."""
    waiting = dict.get(_pending, plan)  # (without moving it to the end: the oldest pending go first)
    if waiting is None:
        return plan
    waiting[0] += 1
    if waiting[0] < CUDNN_AFTER:
        return plan
    del _pending[plan]
    _plans[key] = waiting[1]
    return waiting[1]


def needs_plan(plan, needs: tuple, own: bool = False):
    """plan computing only the gradients flagged in needs; own: each in memory of its own (the custom ops:
    torch.library's contract forbids outputs that alias each other). (`replaced`, with the key a backward's
    call makes: (needs, own).)"""
    variant = plan.variants.get((needs, own))
    if variant is None:
        variant = plan.variants[(needs, own)] = dataclasses.replace(plan, needs=needs, own_grads=own)
    return variant


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


def layout(tensors) -> tuple:
    """`signature` with each tensor's strides: for the tensors a call's kernels read as they are (a mask), whose
    element strides the launches bake in (a template or graph taken from a [B, 1, S, S] mask must not read a
    broadcast or sliced one of the same shape)."""
    return tuple((t.shape, t.stride(), t.dtype, t.get_device()) if isinstance(t, torch.Tensor) else type(t)
                 for t in tensors)


def contiguous(tensors) -> list:
    return [t if t is None else t.contiguous() for t in tensors]
