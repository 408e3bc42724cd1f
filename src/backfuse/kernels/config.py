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
    """Shape and schedule of a launch of product tiles: bm x bn outputs per program, bk deep per step,
    over a ring of `stages` steps of fp16 operands."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}: a power of two of at least 16 (a tensor-core tile side), "
                                 f"got {value}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"TileConfig.warps: 1, 2, 4, 8 or 16, got {self.warps}")
        if self.stages < 1:
            raise ValueError(f"TileConfig.stages: at least 1, got {self.stages}")

    @property
    def ring_bytes(self) -> int:
        """Shared memory of its operand ring: `stages` steps of an fp16 [bm, bk] and [bk, bn] tile (the
        launch needs at least this much; its epilogue may take more)."""
        return self.stages * (self.bm + self.bn) * self.bk * 2


def check_rings(owner: str, tiles: dict) -> None:
    """Refuse, before anything launches, a launch shape whose operand ring alone exceeds one GPU
    program's shared memory (SM90_SHARED_BYTES: Hopper and Blackwell alike); `tiles` maps each of
    `owner`'s TileConfig fields to its value (None: not used)."""
    for name, tile in tiles.items():
        if tile is not None and tile.ring_bytes > SM90_SHARED_BYTES:
            raise ValueError(f"{owner}.{name}: {tile.stages} stages of {tile.bm} x {tile.bn} x {tile.bk} fp16 tiles need "
                             f"{tile.ring_bytes} bytes of shared memory; a program has {SM90_SHARED_BYTES}")


def check_sizes(owner: str, sizes, official) -> None:
    """Refuse, before anything launches, operator sizes other than the benchmark operator's (`official`,
    its spec's OFFICIAL): `owner`'s fused kernels, their tiles, pack items and splits are made for those."""
    if sizes != official:
        raise ValueError(f"{owner}: the fused kernels take the benchmark operator's sizes {official}, not {sizes}")


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
