"""Launch steps whose groups run on concurrent streams: in a call's CUDA graph, its branches.

    step = concurrent([a, b], [c], [d])   # a then b; c; d: three groups that do not depend on each other
    step()                                # a, b on the current stream, c and d on side streams

Group 0 runs on the current stream, every other group on a side stream of its own. Each side starts
after everything launched on the current stream before the step (an event recorded there, waited
on by the side); every launch after the step on the current stream starts after every group has
ended (an event recorded at the end of each side, waited on by the current stream). Under stream
capture (kernels/graphs.py) these events become the graph's fork and join edges; launched directly,
they order the streams the same way. Where one group's kernels leave SMs idle (a product of few
tiles, a latency-bound attention loop, a last partial wave) the other groups' kernels fill them.

Side streams and their events are kept per device, thread, current stream and side: two threads,
or one thread's calls on two streams, never share a side stream (cuBLAS keeps its workspace per
stream, so two graphs running at once must not have been recorded on one), and a step nested in
another's group 0 takes side streams of its own. The same step takes the same side streams on every
call, so a call's graph has the same topology as the last one's (its executable graph is updated,
not instantiated again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

_sides: dict = {}  # (device index, thread, current stream, side) -> (side stream, its fork event, its join event)
_in_use = threading.local()  # .sides: side streams of the current stream taken by the steps running now


def _side(stream: torch.cuda.Stream, index: int):
    key = (stream.device.index, threading.get_ident(), stream.cuda_stream, index)
    side = _sides.get(key)
    if side is None:
        side = _sides[key] = (torch.cuda.Stream(stream.device), torch.cuda.Event(), torch.cuda.Event())
    return side


def concurrent(*groups: Sequence[Callable[[], None]]) -> Callable[[], None]:
    """One launch step running each group's launches in order, the groups concurrently (see the
    module's docstring). Empty groups are dropped; a single group runs on the current stream alone.
    The step is graphable where every launch in it is."""
    groups = [list(g) for g in groups if g]
    if len(groups) <= 1:
        launches = groups[0] if groups else []

        def run():
            for launch in launches:
                launch()
    else:
        def run():
            stream = torch.cuda.current_stream()
            # A step nested in group 0 runs on this stream too: it takes the side streams after ours.
            first = getattr(_in_use, "sides", 0)
            sides = [_side(stream, first + i) for i in range(len(groups) - 1)]
            _in_use.sides = first + len(sides)
            try:
                for _, fork, _ in sides:
                    fork.record(stream)
                for launch in groups[0]:  # the first group (the longest chain) is issued first
                    launch()
                for (side, fork, join), group in zip(sides, groups[1:]):
                    side.wait_event(fork)
                    with torch.cuda.stream(side):
                        for launch in group:
                            launch()
                    join.record(side)
                for _, _, join in sides:
                    stream.wait_event(join)
            finally:
                _in_use.sides = first
    run.graphable = all(getattr(launch, "graphable", True) for group in groups for launch in group)
    return run
