"""021's launch shapes (`Config`), the rules that pick among them, and the plan of one call (`plan`):
pack, forward products, attention, gradient products (or, after cuBLAS's, only the bias sums). The
operator's sizes come from its config (`spec.WanXattnConfig`; the kernels take the benchmark
operator's, `spec.OFFICIAL`), and reach the kernels as constexprs (`size_constexprs`).

Plain Python: a plan can be checked on any machine without launching anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.config import PackConfig, SumConfig, TileConfig, check_rings, check_sizes
from ...kernels.schedule import (
    Holds,
    Layout,
    Region,
    Regions,
    Segment,
    cdiv,
    choose_products,
    choose_splits,
    chunks,
    longest_first,
    next_power_of_2,
    tile_count,
)
from .spec import OFFICIAL, WanXattnConfig


def size_constexprs(sizes: WanXattnConfig) -> dict:
    """The operator's sizes by the constexpr names the kernels read them under (each kernel takes
    those it reads: `kernels.launch.constexprs_of`)."""
    return dict(HIDDEN=sizes.hidden, HEADS=sizes.heads, HEAD_DIM=sizes.head_dim)


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Video tokens per block (bm, at `warps`); all text tokens in one tile up to one_tile, else bn per
    step; with one tile, programs per SM to aim for when runs of blocks share K and V (blocks_per_run)."""

    bm: int = 128
    bn: int = 128
    warps: int = 8
    stages: int = 2
    one_tile: int = 128
    programs_per_sm: float = 1.0
    split_text: bool = True  # one text tile as a head and a tail (text_tiles)
    # Rows and warps of the blocks when a head's video tokens fit one block of bm (video_blocks).
    lone_block: tuple | None = (64, 4)


@dataclass(frozen=True, kw_only=True)
class Config:
    # Pack: grad_output in tiles of `rows` tokens, `cols` columns per step; Wo^T in `tile`-side tiles.
    pack: PackConfig = PackConfig(rows=16, cols=1024, tile=64, block=8192, iters=1, warps=4)
    # Persistent programs over 128 x 256 tiles (benchmarks/notes/021.md row 24).
    forward: TileConfig = TileConfig(bm=128, bn=256, bk=64, warps=8, stages=3)
    # Forward tiles when those of `forward` would not fill the GPU once (forward_tiles).
    forward_small: TileConfig = TileConfig(bm=128, bn=128, bk=64, warps=8, stages=3)
    attention: AttentionConfig = AttentionConfig()
    # 4 warps: 2 programs per SM (8 warps need 144 registers a thread, which allows one)
    gradients: TileConfig = TileConfig(bm=128, bn=128, bk=32, warps=4, stages=6)
    sums: SumConfig = SumConfig(rows=32, cols=64)  # bias gradients from per-program partial rows
    pdl: bool = True  # launches after the first as programmatic dependent launches (GPU only)
    # The five cuBLAS gradient products as branches of the call's graph (kernels/branches.py): measured
    # 1-2 % slower on three of the four cuBLAS cases (they contend for L2 and SMs; notes/021.md row 44).
    branches: bool = False
    # From this much gradient-product work (FLOP) on, cuBLAS does those products (cases 0, 15, 10, 5:
    # 38-93 GFLOP). Launched as one CUDA graph, five torch.mm calls cost no host time on the clock;
    # below ≈ 35 GFLOP our tiles still win (benchmarks/notes/021.md row 42; row 28 had set 60 GFLOP
    # for launches one by one).
    cublas_min_flop: float = 35e9


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles;
# 64-token attention blocks so that small shapes still give several programs per head.
INTERPRETER_CONFIG = Config(
    pack=PackConfig(rows=64, cols=1024, tile=256, block=1 << 20, iters=1, warps=4),
    forward=TileConfig(bm=128, bn=512, bk=256, warps=8, stages=1),
    forward_small=TileConfig(bm=128, bn=256, bk=256, warps=8, stages=1),
    attention=AttentionConfig(bm=64, bn=64, warps=4, stages=1, one_tile=128, programs_per_sm=2),
    gradients=TileConfig(bm=512, bn=512, bk=256, warps=8, stages=1), pdl=False)


def text_tiles(nt: int, split: bool = True) -> tuple:
    """Widths (head, tail; tail 0: none) of the tiles that hold nt text tokens at once: powers of two
    of at least 16 (what the tensor-core products take), split in two when that pads less."""
    whole = max(16, next_power_of_2(nt))
    if split and whole >= 32:
        tail = max(16, next_power_of_2(nt - whole // 2))
        if whole // 2 + tail < whole:
            return whole // 2, tail
    return whole, 0


def video_blocks(at: AttentionConfig, nv: int, one_tile: bool) -> tuple:
    """(rows, warps) of the attention's blocks of video tokens: lone_block when a head's video
    tokens fit one block of bm and the text one tile (a program then loops over two half blocks,
    the second's loads under the first's work), else (bm, warps)."""
    return at.lone_block if one_tile and nv <= at.bm and at.lone_block else (at.bm, at.warps)


def blocks_per_run(at: AttentionConfig, m_blocks: int, heads: int, sms: int, one_tile: bool) -> int:
    """Blocks of one head per attention program. With one text tile, long runs (fewer fp32 partial
    sums of dK/dV) while the grid still has programs_per_sm programs per SM; else 1."""
    if not one_tile:
        return 1
    runs = min(m_blocks, max(1, int(at.programs_per_sm * sms) // heads))
    return cdiv(m_blocks, runs)


def forward_tiles(cfg: Config, sizes: WanXattnConfig, tv: int, tt: int, sms: int) -> TileConfig:
    """The persistent forward products' tiles: `forward`, or `forward_small` when those would not fill
    the GPU once (up to ~2000 video tokens): then each program has one tile, and a half-width tile
    takes half as long."""
    return cfg.forward if forward_tile_count(cfg.forward, sizes, tv, tt) >= sms else cfg.forward_small


def forward_tile_count(t: TileConfig, sizes: WanXattnConfig, tv: int, tt: int) -> int:
    """Tiles of Q, [K | V] and dC."""
    return 2 * tile_count(tv, sizes.hidden, 1, t.bm, t.bn) + tile_count(tt, 2 * sizes.hidden, 1, t.bm, t.bn)


@dataclass(frozen=True)
class AttentionCounters:
    """The attention's int32 counters, one buffer zeroed by the pack: one per (batch, head) from slot 0,
    counting the head's finished runs (the last converts dK/dV); `done`, counting programs whose C
    and dQ are stored (target: every program); `kv_done`, counting heads whose dK, dV are in fp16
    (target: every head). The gradient launch's tiles wait on the last two."""

    heads: int
    programs: int

    @property
    def done(self) -> int:
        return self.heads

    @property
    def kv_done(self) -> int:
        return self.heads + 1

    @property
    def total(self) -> int:
        return self.heads + 2


@dataclass(frozen=True)
class Plan:
    """Every launch of one 021 call (grids in programs), and each launch's runtime scalars by the
    kernel's parameter names (`*_arguments`: the launcher passes them by name, so what the plan
    decides reaches the kernel once, under the name the kernel reads it by)."""

    batch: int
    nv: int  # video tokens per batch entry
    nt: int  # text tokens per batch entry
    sizes: WanXattnConfig  # the operator's (the benchmark operator's: the plan refuses others)
    products: str  # "triton" (our gradient products) or "cublas"
    deterministic: bool  # the attention's partial dK/dV stored per run and added in order
    pdl: bool
    branches: bool  # Config.branches on a GPU
    pack: Layout
    forward: TileConfig  # the forward products' tiles
    forward_programs: int  # persistent ones (product tiles)
    forward_grid: int  # forward_programs, then the grad_bo sums' programs
    forward_bounds: tuple  # the forward's tiles [start, end) of Q, [K | V] and dC, in its loop's order
    one_tile: bool  # all text tokens in one tile (else text tiles of AttentionConfig.bn)
    text_tile: int
    text_tail: int  # 0: none
    block_rows: int  # video tokens per block
    block_warps: int
    finish_rows: int  # text rows per step of the last run's dK/dV hand-off (one step for one tile)
    per_program: int  # blocks per attention program
    runs: int  # attention programs per head
    attention_programs: int
    counters: AttentionCounters
    kv_partial_rows: int  # of the fp32 dK/dV partial sums (1: unused)
    splits: tuple  # K splits of grad_video, grad_text, grad_Wq, grad_Wo, grad_Wk, grad_Wv (0: skipped/cuBLAS)
    bounds: tuple  # programs [start, end) of grad_video, grad_text, grad_Wq + grad_Wo, grad_Wk + grad_Wv
    sums_start: int  # the first of the bias sums' programs, after every product tile
    gradient_programs: int  # our gradient products' tiles, then the bias sums
    wanted: tuple  # whether each of those six products is needed (cuBLAS runs those)
    ranges: tuple  # Regions of the pack, forward and attention launches

    @property
    def tv(self) -> int:
        return self.batch * self.nv

    @property
    def tt(self) -> int:
        return self.batch * self.nt

    @property
    def bias_rows(self) -> int:
        """Rows of the attention programs' bias partial sums: one per (batch entry, run)."""
        return self.batch * self.runs

    def pack_arguments(self) -> dict:
        return dict(TV=self.tv, TT=self.tt, n_counters=self.counters.total, **self.pack.end_arguments)

    def forward_arguments(self) -> dict:
        (_, end_q), (_, end_kv), (_, end_dc) = self.forward_bounds
        r_q, r_k, r_dc = (self.ranges[1].base(name) for name in FORWARD_REGIONS)
        return dict(TV=self.tv, TT=self.tt, n_parts=self.pack.size("grad_output"), n_programs=self.forward_programs,
                    end_q=end_q, end_kv=end_kv, end_dc=end_dc, r_q=r_q, r_k=r_k, r_dc=r_dc)

    def attention_arguments(self, scale: float) -> dict:
        r_dq, r_dk, r_dv = self.ranges[2].bases
        return dict(NV=self.nv, NT=self.nt, TT=self.tt, per_program=self.per_program, r_dq=r_dq, r_dk=r_dk, r_dv=r_dv,
                    c_done=self.counters.done, c_kv=self.counters.kv_done, scale=float(scale))

    def gradient_arguments(self) -> dict:
        split_gv, split_gt, split_wv, _, split_wt, _ = self.splits
        (start_gv, end_gv), (start_gt, end_gt), (start_wv, end_wv), (start_wt, end_wt) = self.bounds
        return dict(TV=self.tv, TT=self.tt, split_wv=split_wv, split_wt=split_wt, split_gv=split_gv, split_gt=split_gt,
                    start_gv=start_gv, end_gv=end_gv, start_gt=start_gt, end_gt=end_gt, start_wv=start_wv, end_wv=end_wv,
                    start_wt=start_wt, end_wt=end_wt, sums_start=self.sums_start, n_parts=self.bias_rows,
                    c_done=self.counters.done, n_done=self.counters.programs, c_kv=self.counters.kv_done,
                    n_kv=self.counters.heads)


# The forward launch's range regions whose first slots its kernel takes (r_q, r_k, r_dc); the values'
# slots follow the keys' (the kernel's [K | V] column tiles run on past K's).
FORWARD_REGIONS = ("queries", "keys", "gradient of attention context")


def gradient_shapes(sizes: WanXattnConfig, tv: int, tt: int) -> list:
    """(M, N, K) of grad_video, grad_text, grad_Wq, grad_Wo, grad_Wk, grad_Wv."""
    hidden = sizes.hidden
    return [(tv, hidden, hidden), (tt, hidden, 2 * hidden)] + [(hidden, hidden, tv)] * 2 + [(hidden, hidden, tt)] * 2


def pack_layout(cfg: Config, sizes: WanXattnConfig, tv: int, tt: int, splits, zero_kv_partials: bool) -> Layout:
    """The pack's programs: grad_output row tiles, flat casts of video, text, Wq, Wk, Wv, the Wo^T
    tiles (those converting), one program zeroing the attention's counters, then zero fills
    of the attention's fp32 dK/dV and of the split-K products' outputs."""
    pk = cfg.pack

    def flat(n):
        return chunks(n, pk.block, pk.iters)

    split_gv, split_gt, split_wv, _, split_wt, _ = (s > 1 for s in splits)
    hidden = sizes.hidden
    weight = flat(hidden * hidden)
    return Layout((
        Segment("grad_output", cdiv(tv, pk.rows), holds=Holds.UPSTREAM, end="e_go"),
        Segment("video_latents", flat(tv * hidden), end="e_video"),
        Segment("text_embeddings", flat(tt * hidden), end="e_text"),
        Segment("query_weight", weight, end="e_wq"),
        Segment("key_weight", weight, end="e_wk"),
        Segment("value_weight", weight, end="e_wv"),
        Segment("output_weight", (hidden // pk.tile) ** 2, end="e_wo"),
        Segment("zero attention counters", 1, ranged=False, end="e_small"),
        Segment("zero dK/dV partial sums", zero_kv_partials * flat(tt * 2 * hidden), ranged=False, end="e_dkv"),
        Segment("zero grad_query_weight", split_wv * weight, ranged=False, end="e_zwq"),
        Segment("zero grad_output_weight", split_wv * weight, ranged=False, end="e_zwo"),
        Segment("zero grad_key_weight", split_wt * weight, ranged=False, end="e_zwk"),
        Segment("zero grad_value_weight", split_wt * weight, ranged=False, end="e_zwv"),
        Segment("zero grad_video_latents", split_gv * flat(tv * hidden), ranged=False, end="e_zgv"),
        Segment("zero grad_text_embeddings", split_gt * flat(tt * hidden), ranged=False),
    ))


def plan(cfg: Config, axes, sms: int, *, sizes: WanXattnConfig = OFFICIAL, gpu: bool = True,
         products: str | None = None, needs=None, deterministic: bool = False) -> Plan:
    """The launches of one call at `axes` on `sms` processors.

    sizes: the operator's (its `Problem.config`); the kernels are made for the benchmark operator's
    (`spec.OFFICIAL`), and other sizes are refused (a ValueError naming them).

    needs: one bool per output (None: all); without input gradients (grad_video, grad_text) or
    without weight gradients (the four grad_W) their products are skipped; the bias gradients are
    column sums taken along the way. deterministic: no K splits, and the attention's partial dK/dV
    stored per run and added in order instead of by atomics. products: "triton", "cublas", or None
    (by size on a GPU: `cublas_min_flop` of gradient-product work).
    """
    check_sizes("021 plan", sizes, OFFICIAL)
    if gpu:
        check_rings("021 Config", dict(forward=cfg.forward, forward_small=cfg.forward_small, gradients=cfg.gradients))
    hidden, heads = sizes.hidden, sizes.heads
    batch, nv, nt = axes["batch_size"], axes["num_video_tokens"], axes["num_text_tokens"]
    tv, tt = batch * nv, batch * nt
    at, gr = cfg.attention, cfg.gradients
    one_tile = nt <= at.one_tile
    block_rows, block_warps = video_blocks(at, nv, one_tile)
    m_blocks = cdiv(nv, block_rows)
    text_tile, text_tail = text_tiles(nt, at.split_text) if one_tile else (at.bn, 0)
    per_program = blocks_per_run(at, m_blocks, batch * heads, sms, one_tile)
    runs = cdiv(m_blocks, per_program)

    gemms = gradient_shapes(sizes, tv, tt)
    backend = choose_products(products, 2 * sum(m * n * k for m, n, k in gemms), cfg.cublas_min_flop, gpu)
    needs = needs or (True,) * 10
    wanted = (any(needs[:2]),) * 2 + (any(needs[2::2]),) * 4  # input products, weight products
    if backend == "cublas":  # our gradient launch only sums the bias gradients
        splits = [0] * 6
    else:
        splits = [1] * 6 if deterministic else choose_splits(gemms, gr.bm, gr.bn, gr.bk, sms)
        splits = [s * w for s, w in zip(splits, wanted)]  # 0: skipped
    tiles = [tile_count(m, n, s, gr.bm, gr.bn) for (m, n, _), s in zip(gemms, splits)]
    split_gv, split_gt, split_wv, _, split_wt, _ = splits
    bounds = longest_first([(tiles[0], gemms[0][2], split_gv), (tiles[1], gemms[1][2], split_gt),
                            (tiles[2] + tiles[3], tv, split_wv), (tiles[4] + tiles[5], tt, split_wt)])

    fw = forward_tiles(cfg, sizes, tv, tt, sms)
    forward_programs = min(forward_tile_count(fw, sizes, tv, tt), sms)
    attention_programs = batch * heads * runs
    pack = pack_layout(cfg, sizes, tv, tt, splits, runs > 1 and not deterministic)
    q_tiles, k_tiles = tile_count(tv, hidden, 1, fw.bm, fw.bn), tile_count(tt, hidden, 1, fw.bm, fw.bn)
    forward_bounds = ((0, q_tiles), (q_tiles, q_tiles + 2 * k_tiles), (q_tiles + 2 * k_tiles, 2 * q_tiles + 2 * k_tiles))
    ranges = (
        pack.regions,
        Regions((Region(FORWARD_REGIONS[0], q_tiles), Region(FORWARD_REGIONS[1], k_tiles), Region("values", k_tiles),
                 Region(FORWARD_REGIONS[2], q_tiles, Holds.GRADIENT))),
        Regions(tuple(Region(g, attention_programs, Holds.VANISHING)
                      for g in ("gradient of queries", "gradient of keys", "gradient of values"))),
    )
    return Plan(batch=batch, nv=nv, nt=nt, sizes=sizes, products=backend, deterministic=deterministic,
                pdl=cfg.pdl and gpu, branches=cfg.branches and gpu, pack=pack, forward=fw,
                forward_programs=forward_programs, forward_grid=forward_programs + hidden // cfg.sums.cols,
                forward_bounds=forward_bounds,
                one_tile=one_tile, text_tile=text_tile,
                text_tail=text_tail, finish_rows=next_power_of_2(text_tile + text_tail) if one_tile else at.bn,
                block_rows=block_rows, block_warps=block_warps, per_program=per_program, runs=runs,
                attention_programs=attention_programs, counters=AttentionCounters(batch * heads, attention_programs),
                kv_partial_rows=(runs if deterministic else 1) * tt if runs > 1 else 1, splits=tuple(splits),
                bounds=bounds, sums_start=sum(tiles), gradient_programs=sum(tiles) + 3 * hidden // cfg.sums.cols,
                wanted=wanted,
                ranges=ranges)
