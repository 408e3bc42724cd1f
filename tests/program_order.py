"""Programs of a launch in another order, for the Triton interpreter (`pytest --program-order reverse` or
`shuffle:SEED`). The interpreter runs a launch's programs one after another in grid order, so a kernel whose
result depends on that order (a program reading what an earlier one wrote, without an atomic or a barrier that
makes it so on a GPU) passes there and fails on a GPU, where programs run in any order and at once. Run in
reverse or shuffled, such a kernel gives other results and its tests fail. (What it cannot show: races between
the threads of one program, which the interpreter runs as one.)

It maps the grid index each program is given, launch by launch, through a permutation of the grid: the
interpreter's own loop is unchanged.
"""

from __future__ import annotations

import random


def install(order: str) -> None:
    """order: "reverse", or "shuffle:SEED" (a fresh permutation each launch, from one generator seeded SEED)."""
    import triton.runtime.interpreter as interpreter

    kind, _, seed = order.partition(":")
    if kind not in ("reverse", "shuffle") or (kind == "shuffle" and not seed.isdigit()):
        raise ValueError(f"--program-order must be 'reverse' or 'shuffle:SEED', got {order!r}")
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_program_order", None) is not None:
        return
    builder._program_order = order
    rng = random.Random(int(seed or 0))
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx

    def permuted_dim(self, nx, ny, nz):
        set_dim(self, nx, ny, nz)
        programs = list(range(nx * ny * nz))
        if kind == "reverse":
            programs.reverse()
        else:
            rng.shuffle(programs)
        self._permutation = programs

    def permuted_idx(self, x, y, z):
        _, ny, nz = self.grid_dim
        p = self._permutation[(x * ny + y) * nz + z]
        set_idx(self, p // (ny * nz), p // nz % ny, p % nz)

    builder.set_grid_dim, builder.set_grid_idx = permuted_dim, permuted_idx
