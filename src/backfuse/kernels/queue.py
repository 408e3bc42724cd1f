"""The task queue of a persistent launch: every unit of work of one call, what each waits for and
what it signals, and which program does it in which order. Planned on the host (plain Python,
checked without launching), read by the kernel as one int32 table; the kernel decides nothing the
plan decides.

Items are listed in queue order; an item only waits for counts of items before it (`check`). The
host assigns them to programs by list scheduling (`schedule`: in queue order, each to the program
that frees up first, by an estimate of every item's cost), so that each program's items stay in
queue order. Then, with every program resident at once, the launch cannot deadlock: the earliest
unfinished item's program has finished everything before it, and so has every program it waits
for. (Taking items from a shared atomic head instead costs a round trip to L2 per item: measured,
benchmarks/notes/021.md.) The kernel walks its program's slice of the table:

    header: programs + 1 row offsets;  then one FIELDS-wide row per item, program after program.

An item waits until each of its (counter, target) pairs has been counted up to target, does its
work, then adds `count` to its signal counter (runs of consecutive items of one program that signal
the same counter and wait for nothing add their count once, at the end of the run; waits a program
has already seen met are dropped). Counters live in a buffer that starts zeroed; the last program
to leave zeroes it again, so calls on one stream share it without a memset
(`buffers.zeroed_counters`). Slot layout: LEFT (programs that have left), then each named counter's
slots in the order they were added.
"""

from __future__ import annotations

import bisect
import enum
import functools
import heapq
from dataclasses import dataclass, field, replace

# One int32 row per item; the kernel reads fields at these offsets (kernels/triton/queue.py imports them).
ARGS = 6  # arguments of an item, meaning set by its kind
RANGES = 3  # fp16-range slots an item may store its largest |value| in (-1: none)
WAITS = 2  # (counter, target) pairs an item waits for (target 0: none)
KIND, ARG0 = 0, 1
RANGE0 = ARG0 + ARGS
WAIT0 = RANGE0 + RANGES  # counter slot, then target, per wait
SIGNAL = WAIT0 + 2 * WAITS  # counter slot added to when the item is done (-1: none)
COUNT = SIGNAL + 1  # what it adds (0: nothing; a run's last item adds for the run)
FIELDS = 16  # row width (COUNT + 1 rounded up to a 64-byte row)
LEFT = 0  # fixed counter slot
FIRST_SLOT = 1  # of the named counters
NO_SLOT = -1

assert COUNT < FIELDS


@dataclass(frozen=True)
class Item:
    """One unit of work: its kind (an operator's `enum.IntEnum`), up to ARGS integer arguments, up to
    RANGES fp16-range slots, up to WAITS (counter slot, target) pairs, the counter slot it signals
    and by how much."""

    kind: enum.IntEnum
    args: tuple = ()
    ranges: tuple = ()
    waits: tuple = ()
    signal: int = NO_SLOT
    count: int = 1

    def row(self) -> list:
        if len(self.args) > ARGS or len(self.ranges) > RANGES or len(self.waits) > WAITS:
            raise ValueError(f"{self.kind.name}: at most {ARGS} args, {RANGES} ranges and {WAITS} waits, got {self}")
        waits = [x for w in self.waits for x in w] + [0, 0] * (WAITS - len(self.waits))
        row = ([int(self.kind)] + list(self.args) + [0] * (ARGS - len(self.args))
               + list(self.ranges) + [NO_SLOT] * (RANGES - len(self.ranges)) + waits
               + [self.signal, self.count if self.signal != NO_SLOT else 0])
        return row + [0] * (FIELDS - len(row))


@dataclass(frozen=True)
class Counter:
    """A named run of counter slots: `first` is its first slot."""

    name: str
    first: int
    slots: int

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.slots:
            raise IndexError(f"counter {self.name!r} has {self.slots} slots, asked for {i}")
        return self.first + i


@dataclass(frozen=True, eq=False)
class Queue:
    """The items of one launch in queue order, its counters, and the schedule: program p does items
    order[starts[p]:starts[p + 1]] (as rows `rows`, waits pruned and signals batched). Compared and
    hashed by identity: plans are cached, and a queue keys its device table (`buffers.queue_table`)."""

    items: tuple
    counters: tuple  # of Counter, in slot order after LEFT
    starts: tuple  # programs + 1 offsets into order
    order: tuple  # item indices, program after program
    rows: tuple  # the scheduled Item of each entry of order
    makespan: float  # of the schedule, in the cost estimate's unit

    @property
    def programs(self) -> int:
        return len(self.starts) - 1

    @property
    def slots(self) -> int:
        """Counter slots the launch uses, LEFT included."""
        return FIRST_SLOT + sum(c.slots for c in self.counters)

    def counter(self, name: str) -> Counter:
        return next(c for c in self.counters if c.name == name)

    def of(self, kind) -> list:
        """Items of `kind`, in queue order."""
        return [item for item in self.items if item.kind == kind]

    def program_of(self) -> list:
        """The program of each item, in queue order."""
        program = [0] * len(self.items)
        for p in range(self.programs):
            for k in range(self.starts[p], self.starts[p + 1]):
                program[self.order[k]] = p
        return program

    @functools.cached_property
    def table(self) -> tuple:
        """The int32 table the kernel reads: the header of row offsets, then the rows."""
        return tuple(self.starts) + tuple(x for item in self.rows for x in item.row())


def check(items, slots: int) -> None:
    """Every wait is met by items earlier in the queue and every counter slot an item names exists;
    else ValueError naming the item."""
    signalled = [0] * slots
    for i, item in enumerate(items):
        for slot, target in item.waits:
            if not FIRST_SLOT <= slot < slots:
                raise ValueError(f"item {i} ({item.kind.name}) waits on slot {slot}, outside [{FIRST_SLOT}, {slots})")
            if signalled[slot] < target:
                raise ValueError(f"item {i} ({item.kind.name}) waits for {target} counts of slot {slot}, but "
                                 f"only {signalled[slot]} items before it signal it")
        if item.signal != NO_SLOT:
            if not FIRST_SLOT <= item.signal < slots:
                raise ValueError(f"item {i} ({item.kind.name}) signals slot {item.signal}, outside [{FIRST_SLOT}, {slots})")
            signalled[item.signal] += item.count


def schedule(items, programs: int, cost) -> tuple:
    """(per-program lists of item indices, makespan): items in queue order, each to the program free
    first (lowest index on ties), starting when it is free and its waits are met, by cost(item)."""
    done = {}  # counter slot: sorted finish times of the items that signal it
    free = [(0.0, p) for p in range(programs)]
    lists = [[] for _ in range(programs)]
    makespan = 0.0
    for i, item in enumerate(items):
        at, p = heapq.heappop(free)
        ready = max([done[slot][target - 1] for slot, target in item.waits], default=0.0)
        end = max(at, ready) + cost(item)
        lists[p].append(i)
        heapq.heappush(free, (end, p))
        if item.signal != NO_SLOT:
            bisect.insort(done.setdefault(item.signal, []), end)
        makespan = max(makespan, end)
    return lists, makespan


def _program_rows(items, mine) -> list:
    """A program's items with the waits it has already seen met dropped, and each run of consecutive
    items that signal one counter (and, after the first, wait for nothing) counted once, at its end."""
    seen = {}
    rows = []
    for i in mine:
        item = items[i]
        waits = tuple((s, t) for s, t in item.waits if seen.get(s, 0) < t)
        for s, t in waits:
            seen[s] = t
        rows.append(replace(item, waits=waits))
    k = 0
    while k < len(rows):
        end = k
        while (end + 1 < len(rows) and rows[end + 1].signal == rows[k].signal != NO_SLOT and not rows[end + 1].waits):
            end += 1
        for j in range(k, end):
            rows[j] = replace(rows[j], count=0)
        rows[end] = replace(rows[end], count=end - k + 1)
        k = end + 1
    return rows


@dataclass
class QueueBuilder:
    """Builds a Queue: counters first (`counter`), then items in queue order (`add`), then `build`."""

    items: list = field(default_factory=list)
    counters: list = field(default_factory=list)

    def counter(self, name: str, slots: int = 1) -> Counter:
        first = FIRST_SLOT + sum(c.slots for c in self.counters)
        c = Counter(name, first, max(0, slots))
        self.counters.append(c)
        return c

    def add(self, kind, args=(), ranges=(), waits=(), signal=NO_SLOT) -> None:
        self.items.append(Item(kind, tuple(args), tuple(ranges), tuple((s, t) for s, t in waits if t > 0), signal))

    def signals(self, slot: int) -> int:
        """Items added so far that signal `slot` (the target that waits for all of them)."""
        return sum(item.signal == slot for item in self.items)

    def build(self, programs: int, cost) -> Queue:
        """The queue scheduled over `programs` programs by cost(item) (any unit)."""
        items = tuple(self.items)
        slots = FIRST_SLOT + sum(c.slots for c in self.counters)
        check(items, slots)
        lists, makespan = schedule(items, programs, cost)
        starts, order, rows = [0], [], []
        for mine in lists:
            order += mine
            rows += _program_rows(items, mine)
            starts.append(len(order))
        return Queue(items, tuple(self.counters), tuple(starts), tuple(order), tuple(rows), makespan)
