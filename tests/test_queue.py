"""The task queue of a persistent launch (`kernels/queue.py`), checked without launching: queue-order
waits, the table the kernel reads, list scheduling that keeps each program's items in queue order,
dropped waits and batched signals, and that a simulated launch of any schedule finishes."""

import enum
import random

import pytest

from backfuse.kernels import queue as q


class Kind(enum.IntEnum):
    MAKE = 0
    USE = 1


def _two_stage(n_make=7, n_use=5):
    """n_make items that count one counter, then n_use items that wait for all of them."""
    b = q.QueueBuilder()
    made = b.counter("made")
    used = b.counter("used")
    for i in range(n_make):
        b.add(Kind.MAKE, (i,), (i,), signal=made[0])
    for i in range(n_use):
        b.add(Kind.USE, (i, 2 * i), waits=[(made[0], b.signals(made[0]))], signal=used[0])
    return b, made, used


def _simulate(queue) -> None:
    """Run a scheduled queue as its programs would (each in its order, waits on counters), one step
    of any unblocked program at a time; fail if no program can move before all are done."""
    counters = [0] * queue.slots
    at = [queue.starts[p] for p in range(queue.programs)]
    rng = random.Random(0)
    while any(at[p] < queue.starts[p + 1] for p in range(queue.programs)):
        movable = [p for p in range(queue.programs) if at[p] < queue.starts[p + 1]
                   and all(counters[s] >= t for s, t in queue.rows[at[p]].waits)]
        assert movable, "deadlock: every unfinished program waits"
        p = rng.choice(movable)
        row = queue.rows[at[p]]
        if row.count:
            counters[row.signal] += row.count
        at[p] += 1
    for c in queue.counters:
        for i in range(c.slots):
            assert counters[c[i]] == sum(item.signal == c[i] for item in queue.items)


def test_waits_must_be_met_by_earlier_items():
    b = q.QueueBuilder()
    made = b.counter("made")
    b.add(Kind.USE, waits=[(made[0], 1)])
    b.add(Kind.MAKE, signal=made[0])
    with pytest.raises(ValueError, match="item 0 .USE. waits for 1 counts"):
        b.build(2, lambda item: 1.0)
    b = q.QueueBuilder()
    b.add(Kind.MAKE, signal=5)
    with pytest.raises(ValueError, match="signals slot 5"):
        b.build(1, lambda item: 1.0)


def test_table_layout():
    b, made, used = _two_stage(3, 2)
    queue = b.build(1, lambda item: 1.0)
    table = queue.table
    assert table[:2] == (0, 5)  # one program: all five rows
    rows = [table[2 + i * q.FIELDS: 2 + (i + 1) * q.FIELDS] for i in range(5)]
    assert rows[0][q.KIND] == Kind.MAKE and rows[0][q.ARG0] == 0 and rows[0][q.RANGE0] == 0
    assert rows[0][q.RANGE0 + 1] == q.NO_SLOT and rows[0][q.SIGNAL] == made[0]
    # one program: the three MAKE items are one run, counted once at its end
    assert [r[q.COUNT] for r in rows[:3]] == [0, 0, 3]
    use = rows[3]
    assert use[q.KIND] == Kind.USE and use[q.ARG0:q.ARG0 + 2] == (0, 0) and use[q.ARG0 + 1 + 1] == 0
    assert (use[q.WAIT0], use[q.WAIT0 + 1]) == (made[0], 3) and use[q.SIGNAL] == used[0]
    # the second USE: its wait was already seen met by this program, so the two USE items are a run too
    assert rows[4][q.WAIT0 + 1] == 0 and (use[q.COUNT], rows[4][q.COUNT]) == (0, 2)
    assert queue.slots == q.FIRST_SLOT + 2


@pytest.mark.parametrize("programs", [1, 2, 3, 8, 64])
def test_schedules_keep_queue_order_and_finish(programs):
    rng = random.Random(programs)
    b = q.QueueBuilder()
    stages = [b.counter(f"stage {s}") for s in range(4)]
    for s, counter in enumerate(stages):
        for i in range(rng.randint(1, 40)):
            waits = [(stages[s - 1][0], b.signals(stages[s - 1][0]))] if s else []
            if s >= 2 and rng.random() < 0.5:
                waits.append((stages[0][0], rng.randint(1, b.signals(stages[0][0]))))
            b.add(Kind.USE if s else Kind.MAKE, (s, i), waits=waits, signal=counter[0])
    queue = b.build(programs, lambda item: 1.0 + item.args[1] % 3)
    assert queue.programs == programs and sorted(queue.order) == list(range(len(queue.items)))
    for p in range(programs):
        mine = queue.order[queue.starts[p]:queue.starts[p + 1]]
        assert list(mine) == sorted(mine)
    assert queue.program_of()[queue.order[0]] == 0
    _simulate(queue)


def test_list_scheduling_balances_by_cost():
    b = q.QueueBuilder()
    done = b.counter("done")
    for cost in (4, 1, 1, 1, 1):
        b.add(Kind.MAKE, (cost,), signal=done[0])
    queue = b.build(2, lambda item: float(item.args[0]))
    assert queue.makespan == 4.0
    assert queue.program_of() == [0, 1, 1, 1, 1]


def test_signals_are_batched_only_over_items_that_do_not_wait():
    b = q.QueueBuilder()
    made, more = b.counter("made"), b.counter("more")
    b.add(Kind.MAKE, signal=made[0])
    b.add(Kind.MAKE, signal=made[0])
    b.add(Kind.USE, waits=[(made[0], 1)], signal=more[0])
    b.add(Kind.USE, waits=[(made[0], 2)], signal=more[0])
    queue = b.build(1, lambda item: 1.0)
    assert [r.count for r in queue.rows] == [0, 2, 1, 1]  # the second USE waits (for 2 > 1 seen): its own count
    assert queue.rows[3].waits == ((made[0], 2),)


def test_counter_slots_are_named_and_bounded():
    b = q.QueueBuilder()
    a, c = b.counter("a", 3), b.counter("c")
    assert (a[0], a[2], c[0]) == (q.FIRST_SLOT, q.FIRST_SLOT + 2, q.FIRST_SLOT + 3)
    with pytest.raises(IndexError, match="counter 'a' has 3 slots"):
        a[3]
    assert b.build(1, lambda item: 1.0).counter("c") == c


def test_items_reject_too_many_fields():
    with pytest.raises(ValueError, match="at most"):
        q.Item(Kind.MAKE, args=tuple(range(q.ARGS + 1))).row()
