"""How a launch's programs map onto the work, decided on the host: tile counts, K splits, the order
of groups of tiles, which product backend runs, and the layout of a pack launch's segments.

Plain Python (no Triton, no torch), so that an operator's plan can be checked without launching.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def chunks(n: int, block: int, iters: int) -> int:
    """Programs a flat pass over n elements needs (a program takes `iters` steps of `block` elements)."""
    return cdiv(n, block * iters)


def tile_count(M: int, N: int, splits: int, BM: int, BN: int) -> int:
    """Programs `gemm_tile` needs for C[M, N] split `splits` ways."""
    return cdiv(M, BM) * cdiv(N, BN) * splits


def choose_splits(gemms, BM: int, BN: int, BK: int, sms: int, *, slices_per_sm: float = 2, min_chunk: int = 512,
                  max_chunk: int = 4096) -> list:
    """K splits per product so that every tile's K slice is near one common length.

    gemms: (M, N, K) per product. The common length is an even share of the total work per SM
    divided by slices_per_sm, kept within [min_chunk, max_chunk] so short slices don't drown in
    pipeline fill; equal slices let one launch of mixed products balance across SMs.
    """
    work = sum(cdiv(m, BM) * cdiv(n, BN) * k for m, n, k in gemms)
    chunk = min(max_chunk, max(min_chunk, int(work // (slices_per_sm * sms))))
    chunk = cdiv(chunk, BK) * BK
    return [max(1, round(k / chunk)) for _, _, k in gemms]


def longest_first(groups) -> tuple:
    """The programs [start, end) of each group of tiles in one launch, the groups ordered by the K
    length of their tiles, longest first (ties keep the given order): programs start in order, so
    the short tiles then fill the last wave instead of long ones trailing it. A kernel reads these
    bounds as they are (it does not recount the tiles); together they cover [0, total tiles).

    groups: (tiles, K, splits) per group; a group's tiles are K / splits deep.
    """
    order = sorted(range(len(groups)), key=lambda g: -cdiv(groups[g][1], max(1, groups[g][2])))
    bounds, first = [None] * len(groups), 0
    for g in order:
        bounds[g] = (first, first + groups[g][0])
        first += groups[g][0]
    return tuple(bounds)


def flat(bounds) -> tuple:
    """((s0, e0), (s1, e1), ...) as (s0, e0, s1, e1, ...): kernel arguments."""
    return tuple(x for pair in bounds for x in pair)


def choose_products(requested: str | None, flop: float, cublas_min_flop: float, gpu: bool, *,
                    gluon_window: tuple | None = None) -> str:
    """The backend of an operator's projection products: `requested` ("triton": our tiles, "cublas":
    torch.mm on our fp16 operands, "gluon": an operator's one-launch Hopper kernel) as given; None:
    on a GPU the Gluon kernel for product work in gluon_window = [low, high) FLOP (where the operator
    has one and the GPU runs it: None otherwise), else cuBLAS from cublas_min_flop (where its faster
    products outweigh its extra launches and their host time), else ours."""
    if requested is not None:
        if requested not in ("triton", "cublas", "gluon"):
            raise ValueError(f"products must be 'triton', 'cublas' or 'gluon', got {requested!r}")
        return requested
    if gpu and gluon_window is not None and gluon_window[0] <= flop < gluon_window[1]:
        return "gluon"
    if gpu and flop >= cublas_min_flop:
        return "cublas"
    return "triton"


class Holds(enum.Enum):
    """What the tensor of a range region is, which decides how the guard treats it."""

    INPUT = "an input, or formed from inputs only"  # must fit as it is: scaling cannot move it
    UPSTREAM = "upstream gradients or their sums"  # linear in them, and what a scale aims at
    GRADIENT = "formed from the upstream gradients"  # linear in them
    VANISHING = "a gradient that can cancel to zero"  # linear; tiny values are noise: overflow checked only

    @property
    def linear(self) -> bool:
        """Whether the tensor moves with the upstream gradients (a power-of-two scale moves it exactly)."""
        return self is not Holds.INPUT

    @property
    def underflow_checked(self) -> bool:
        return self is not Holds.VANISHING


@dataclass(frozen=True)
class Region:
    """The fp16-range slots of one tensor: its name (in messages), slots, and what it holds."""

    name: str
    slots: int
    holds: Holds = Holds.INPUT


@dataclass(frozen=True)
class Regions:
    """A block of fp16-range regions that one launch writes, in slot order. See fp16_guard.RangeSlots."""

    regions: tuple  # of Region

    def __post_init__(self):
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must differ: {names}")

    @property
    def counts(self) -> tuple:
        """((name, slots), ...) in slot order."""
        return tuple((r.name, r.slots) for r in self.regions)

    @property
    def bases(self) -> tuple:
        """Each region's first slot in the block, in slot order: what a kernel that writes several
        regions adds to a slot index (passed as arguments, so no kernel repeats the layout)."""
        starts, at = [], 0
        for r in self.regions:
            starts.append(at)
            at += r.slots
        return tuple(starts)

    def base(self, name: str) -> int:
        """The first slot of the region called `name`."""
        for r, at in zip(self.regions, self.bases):
            if r.name == name:
                return at
        raise KeyError(f"no region {name!r} among {[r.name for r in self.regions]}")

    def reserve(self, ranges) -> int:
        """Reserve the block in a RangeSlots; returns its offset."""
        return ranges.reserve(self.regions)


@dataclass(frozen=True)
class Segment:
    """A run of consecutive programs of a pack launch doing one job. ranged: its programs convert a
    tensor to fp16 and each stores the largest |value| it converted (one range slot per program);
    holds: what that tensor is (`fp16_guard.Holds`); end: the kernel parameter that receives the
    segment's end (every segment but the last names one; the last one's end is the grid)."""

    name: str
    programs: int
    ranged: bool = True
    holds: Holds = Holds.INPUT
    end: str = ""


@dataclass(frozen=True)
class Layout:
    """The programs of a pack launch: segments in program order, the converting (ranged) ones first,
    so that a converting program's range slot is its program id. One list gives the kernel's segment
    boundaries (`ends`, passed as arguments), the grid (`programs`) and the range regions (`regions`)."""

    segments: tuple  # of Segment

    def __post_init__(self):
        names = [s.name for s in self.segments]
        if len(set(names)) != len(names):
            raise ValueError(f"segment names must differ: {names}")
        ranged = [s.ranged for s in self.segments]
        if ranged != sorted(ranged, reverse=True):
            raise ValueError("the converting (ranged) segments must come first")
        ends = [s.end for s in self.segments]
        if any(ends) and (not all(ends[:-1]) or ends[-1] or len(set(ends[:-1])) != len(ends) - 1):
            raise ValueError(f"every segment but the last must name a distinct end parameter, the last none: {ends}")

    @property
    def end_parameters(self) -> tuple:
        """The kernel parameters that take `ends[:-1]`, in that order (the kernel's own order of its
        segment chain; tests/test_plans.py holds each pack kernel's signature against it)."""
        return tuple(s.end for s in self.segments[:-1])

    @property
    def end_arguments(self) -> dict:
        """The kernel's segment-end arguments by parameter name."""
        return dict(zip(self.end_parameters, self.ends[:-1]))

    @property
    def ends(self) -> tuple:
        """The first program after each segment; the kernel takes all but the last, the grid's size."""
        ends, at = [], 0
        for s in self.segments:
            at += s.programs
            ends.append(at)
        return tuple(ends)

    @property
    def programs(self) -> int:
        return sum(s.programs for s in self.segments)

    def size(self, name: str) -> int:
        """Programs of the segment called `name`."""
        return next(s.programs for s in self.segments if s.name == name)

    def end_of(self, name: str) -> int:
        """The first program after the segment called `name` (where a launch of the segments after
        it starts, when the pack runs as two launches)."""
        return next(end for s, end in zip(self.segments, self.ends) if s.name == name)

    @property
    def regions(self) -> Regions:
        return Regions(tuple(Region(s.name, s.programs, s.holds) for s in self.segments if s.ranged))
