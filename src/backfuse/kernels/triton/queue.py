"""The device side of a task queue (`kernels/queue.py`): this program's rows of the table, each item's
fields, waiting for its counters, signalling its own, and leaving the counters zeroed. A persistent
kernel's loop:

    first, end, rows = my_items(table)
    for k in range(first, end):
        row = rows + k * FIELDS
        wait_for(row, counters, GPU)
        ... dispatch on field(row, KIND) ...
        signal(row, counters)
    leave(counters, n_slots)

Ordering: a signalling program's stores come before its count (a CTA barrier, then a release add
at GPU scope); a waiting program's loads come after the count it saw (acquire, then on a GPU a
proxy fence, so that TMA reads, which do not go through the generic proxy, see those stores too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import queue as q

FIELDS = tl.constexpr(q.FIELDS)
KIND = tl.constexpr(q.KIND)
ARG0 = tl.constexpr(q.ARG0)
RANGE0 = tl.constexpr(q.RANGE0)
WAIT0 = tl.constexpr(q.WAIT0)
WAITS = tl.constexpr(q.WAITS)
SIGNAL = tl.constexpr(q.SIGNAL)
COUNT = tl.constexpr(q.COUNT)
LEFT = tl.constexpr(q.LEFT)


@triton.jit
def my_items(table):
    """(first, end, rows): this program's items are rows + k * FIELDS for k in [first, end)."""
    pid = tl.program_id(0)
    return tl.load(table + pid), tl.load(table + pid + 1), table + tl.num_programs(0) + 1


@triton.jit
def field(row, at):
    """Field `at` of an item's row (KIND, ARG0 + i, RANGE0 + i)."""
    return tl.load(row + at)


@triton.jit
def wait_at_least(counter, target):
    """Spin until the int32 at `counter` reaches `target` (acquire, GPU scope)."""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")


@triton.jit(noinline=True)
def wait_for(row, counters, GPU: tl.constexpr):
    """Spin until each of the item's counters has reached its target (acquire at GPU scope).
    Not inlined: inlined, its spin loops cost the attention ≈ 250 more bytes of register spills per
    thread (ptxas; `benchmarks/tools/compile_sm90.py`)."""
    for w in tl.static_range(WAITS):
        slot = tl.load(row + WAIT0 + 2 * w)
        target = tl.load(row + WAIT0 + 2 * w + 1)
        if target > 0:
            wait_at_least(counters + slot, target)
    if GPU:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def signal(row, counters):
    """Add the item's count to its signal counter, after every thread's stores (release, GPU scope)."""
    count = tl.load(row + COUNT)
    if count > 0:
        tl.debug_barrier()
        tl.atomic_add(counters + tl.load(row + SIGNAL), count, sem="release")


@triton.jit
def clock():
    """The GPU's global nanosecond timer (for PROFILE runs: `profile_item`)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def profile_item(profile, item, started, waited):
    """profile[item] = (started, waits met, done, program) in ns of the global timer (diagnostics only;
    item: the row's index in the table)."""
    done = clock()
    tl.store(profile + 4 * item, started)
    tl.store(profile + 4 * item + 1, waited)
    tl.store(profile + 4 * item + 2, done)
    tl.store(profile + 4 * item + 3, tl.program_id(0).to(tl.int64))


@triton.jit
def leave(counters, n_slots, BLOCK: tl.constexpr = 256):
    """This program has done its items; the last to leave zeroes all n_slots counter slots for the next
    launch on the stream (every other program is past its last use of them by then)."""
    tl.debug_barrier()
    if tl.atomic_add(counters + LEFT, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for s0 in range(0, n_slots, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            tl.store(counters + s, tl.zeros((BLOCK,), dtype=tl.int32), mask=s < n_slots)
