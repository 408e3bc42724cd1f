"""The pieces every operator's `Config` is built from (keyword-built, frozen): the shape of a launch
of product tiles, of a pack launch, and of fixed-order column sums.

An operator's config (`ops/<stem>/config.py`) holds one of these per launch, plus `pdl` and
`cublas_min_flop`; its `plan` turns the config and a shape into the launches.
"""

from __future__ import annotations

from dataclasses import dataclass

# Registers (setmaxnreg) of a Gluon kernel's TMA loader partition: one warp issuing copies.
GLUON_LOADER_REGS = 24
SM90_SHARED_BYTES = 232448  # the most dynamic shared memory one program may take on sm_90 (227 KB)


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    """Shape and schedule of a launch of product tiles: bm x bn outputs per program, bk deep per step."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    """Shape of a pack launch (fp16 copies of the operands, zero fills). Flat passes: `block`
    elements per step, `iters` steps per program. Tile passes, where an operator has them (0: none):
    `rows` tokens per program (`cols` columns per step), `tile` the side of a transposed square tile."""

    block: int
    iters: int = 1
    warps: int = 4
    rows: int = 0
    cols: int = 0
    tile: int = 0


@dataclass(frozen=True, kw_only=True)
class SumConfig:
    """Fixed-order column sums of per-program partial rows: `rows` partial rows per step, `cols`
    columns per reducing program."""

    rows: int
    cols: int
