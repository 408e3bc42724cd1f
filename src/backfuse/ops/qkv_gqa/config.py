"""072's launch shapes (`Config`) and the plan of one call (`plan`): a pack launch that makes every
fp16 operand, then the four products, as one launch of our tiles or as four cuBLAS products; or, on
Hopper, one Gluon launch doing both (`GluonLaunch`, ops/qkv_gqa/gluon_kernels.py). The operator's
sizes come from its config (`spec.QkvGqaConfig`; the kernels take the benchmark operator's,
`spec.OFFICIAL`), and reach the kernels as constexprs (`size_constexprs`).

Plain Python: a plan can be checked on any machine without launching anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.config import GLUON_LOADER_REGS, SM90_SHARED_BYTES, PackConfig, TileConfig, check_rings, check_sizes
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
    tile_count,
)
from .spec import OFFICIAL, QkvGqaConfig

# The Gluon kernel's pack items (ops/qkv_gqa/gluon_pack.py): 64 rows x 256 columns, or, for the
# head-group sums, 16 tokens of the 4 query heads of one KV head; counted per 128-token block. The
# pack stages its loads in GLUON_PACK_SLOTS shared slots of GLUON_SUM_ROWS x 256 fp32 (64 KB in flight).
GLUON_TOKEN_BLOCK, GLUON_ITEM_ROWS, GLUON_SUM_ROWS, GLUON_PACK_SLOTS = 128, 64, 16, 4


def gluon_wq_items(sizes: QkvGqaConfig) -> int:
    """The Gluon pack's items of Wq16 (or of zeroing grad_Wq)."""
    return (sizes.q_out // GLUON_ITEM_ROWS) * (sizes.hidden // 256)


def gluon_wkv_items(sizes: QkvGqaConfig) -> int:
    """The Gluon pack's items of [Wk; Wv]16 (or of its zero fill)."""
    return 2 * (sizes.kv_out // GLUON_ITEM_ROWS) * (sizes.cross_hidden // 256)


def size_constexprs(sizes: QkvGqaConfig) -> dict:
    """The operator's sizes by the constexpr names the kernels read them under (each kernel takes
    those it reads: `kernels.launch.constexprs_of`), and the Gluon pack's items of Wk16 (then Wv16's)
    in its [Wk; Wv]16 segment."""
    return dict(HIDDEN=sizes.hidden, CROSS=sizes.cross_hidden, HEADS=sizes.heads, GROUP=sizes.group,
                HEAD_DIM=sizes.head_dim, Q_OUT=sizes.q_out, KV_OUT=sizes.kv_out, KV_ITEMS=gluon_wkv_items(sizes) // 2)


@dataclass(frozen=True, kw_only=True)
class GluonConfig:
    """The one-launch Gluon kernel (sm_90): bm x bn x bk product tiles over a ring of `stages` slots,
    beside a pack partition of `pack_warps` warps. Its warps (2 x 4 consumers, 1 loader, the pack;
    rounded up to whole warpgroups) share the SM's 64K registers: the launch gives each thread
    `maxnreg` (16 warps: 128), then the partitions re-divide that pool (setmaxnreg): the second
    consumer and the pack get `regs` each, the loader 24, the first consumer the rest
    (`first_consumer_regs`). A partition's code may then use more than maxnreg, but ptxas still
    refuses a wgmma accumulator that needs more than it, so tiles stay 128 x 128 (a 64 x 256 fp32
    accumulator per warpgroup needs 154: benchmarks/notes/072.md, issue 25). It runs for product
    work in [min_flop, max_flop). Measured
    (benchmarks/notes/gluon.md, official clock, which since its counters need no memset is the
    kernel's own time): against pack + our Triton products 7-14% faster at 34-43 GFLOP and 2-4% at
    17-21 (session 21, three calls: benchmarks/notes/072.md row 28); against pack + cuBLAS equal at
    135-137 and 3% faster at 172; slower at 9-11 GFLOP (4-6%) and from 252 (3-7%). Below 30 GFLOP
    pack + cuBLAS's products beside each other are 1-3 % faster (session 30: 072.md row 34)."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    stages: int = 4
    pack_warps: int = 4
    maxnreg: int = 128
    regs: int = 144  # 200 / 144 / 144 (first consumer / second / pack): 0.5% faster than 128 (notes/072.md row 25)
    min_flop: float = 30e9
    max_flop: float = 200e9

    @property
    def shared_bytes(self) -> int:
        """Shared memory of a one-launch program: the ring and the pack's slots (GLUON_SUM_ROWS x 256
        fp32 each); the plan refuses a config whose program would not fit (`gluon_launch`).
        (A TMA-store epilogue's 64 KB of staging would leave room for 3 stages only, which lost 7 %:
        benchmarks/notes/072.md row 30.)"""
        ring = self.stages * (self.bm * self.bk + self.bk * self.bn) * 2
        return ring + GLUON_PACK_SLOTS * GLUON_SUM_ROWS * 256 * 4

    @property
    def first_consumer_regs(self) -> int:
        """What the pool leaves the first consumer: with a 4-warp pack the launch has 4 warpgroups
        (the loader's padded), each 128 threads at maxnreg, and the PTX gives the first consumer
        4 maxnreg - 2 regs - 24 (232 at 128, 168 at 160: read in its setmaxnreg instructions)."""
        if self.pack_warps != 4:
            raise ValueError("GluonConfig.first_consumer_regs: known for a 4-warp pack only")
        return 4 * self.maxnreg - 2 * self.regs - GLUON_LOADER_REGS

    def __post_init__(self):
        for name in ("maxnreg", "regs"):
            value = getattr(self, name)
            if value % 8 or not 24 <= value <= 256:
                raise ValueError(f"GluonConfig.{name}: a multiple of 8 in [24, 256] (setmaxnreg), got {value}")
        if self.pack_warps == 4 and not 24 <= self.first_consumer_regs <= 256:
            raise ValueError(f"GluonConfig: regs={self.regs} leaves the first consumer {self.first_consumer_regs} "
                             f"registers of the pool ({self.maxnreg} per thread); expected 24..256")


@dataclass(frozen=True, kw_only=True)
class Config:
    # Pack: rows = tokens per head-tile of the layout change and the group sums; flat casts and fills.
    pack: PackConfig = PackConfig(rows=32, block=4096, iters=16, warps=4)
    # Our products' tiles (both operand layouts in one launch; measured: benchmarks/notes/072.md). They
    # run below cublas_min_flop only, where 128 x 128 tiles at 4 warps (2 per SM) beat 128 x 256 by 5%.
    tiles: TileConfig = TileConfig(bm=128, bn=128, bk=32, warps=4, stages=6)
    pdl: bool = True  # the products' launch as a programmatic dependent launch (GPU only)
    # The four cuBLAS products beside each other, as branches of the call's graph (kernels/branches.py),
    # where the product work is below this: each small product is a latency-bound kernel that leaves
    # SMs idle (case 3: 10.5, 6.6, 11.6, 6.6 us one after another; beside each other 1-7 % faster on
    # cases 1, 3, 12, 13, notes/072.md row 34). A large one fills the GPU alone: beside each other
    # 0-1.4 % slower (row 32).
    branches_below_flop: float = 30e9
    # From this much product work (FLOP) on, cuBLAS's products beat ours by more than its three extra
    # launches can cost, even on a slow host: the GPU work then outlasts the launching (measured:
    # benchmarks/notes/072.md). Below it, cuBLAS wins only when the host keeps up.
    cublas_min_flop: float = 100e9
    gluon: GluonConfig = GluonConfig()


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles.
INTERPRETER_CONFIG = Config(pack=PackConfig(rows=32, block=1 << 20, iters=1, warps=4),
                            tiles=TileConfig(bm=512, bn=512, bk=256, warps=8, stages=1), pdl=False)


@dataclass(frozen=True)
class TilesLaunch:
    """The launch of our product tiles: which groups it runs and each product's programs."""

    programs: int
    weight_grads: bool  # grad_Wq, grad_[Wk; Wv]
    input_grads: bool  # grad_dec, grad_enc
    bounds: tuple  # programs [start, end) of grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc (deepest tiles first)


# The Gluon kernel's completion counters (int32; the launch's last partition leaves them zero): these
# fixed slots, then one slot per GLUON_TOKEN_BLOCK tokens of GQ, dec16, [GK | GV] and enc16 in that
# order (`GluonCounters`). The kernel names the fixed slots by their index here.
GLUON_FIXED_COUNTERS = ("Wq16", "[Wk; Wv]16", "zeroed grad_Wq", "zeroed grad_[Wk; Wv]", "zeroed grad_dec",
                        "zeroed grad_enc", "partitions left")


@dataclass(frozen=True)
class GluonCounters:
    """The first slot of each per-token-block run of counters, and the slot count."""

    gq: int
    dec: int
    gkv: int
    enc: int
    total: int

    @staticmethod
    def of(td: int, te: int) -> "GluonCounters":
        nb_d, nb_e = cdiv(td, GLUON_TOKEN_BLOCK), cdiv(te, GLUON_TOKEN_BLOCK)
        gq = len(GLUON_FIXED_COUNTERS)
        return GluonCounters(gq, gq + nb_d, gq + 2 * nb_d, gq + 2 * nb_d + nb_e, gq + 2 * nb_d + 2 * nb_e)


@dataclass(frozen=True)
class GluonLaunch:
    """The one Gluon launch: tiles of grad_Wq [0, starts[0]), grad_dec [.., starts[1]), grad_[Wk; Wv]
    [.., starts[2]), grad_enc [.., programs_tiles); how many 256-column chunks of dec / enc the pack
    converts (0 when no weight gradient is wanted); its completion counters (per token block and
    weight, and one counting finished partitions; zero at the start, left zero at the end), range
    regions (one slot per converting item) and the pack's item list (the kernel reads its segment
    ends, and waits on a fixed counter until it has counted its segment's items)."""

    starts: tuple
    tiles: int
    dec_chunks: int
    enc_chunks: int
    counters: GluonCounters
    regions: Regions
    items: Layout  # the pack partition's item list, segments in the order it runs them (`gluon_pack_items`)


@dataclass(frozen=True)
class Plan:
    """Every launch of one 072 call, and each launch's runtime scalars by the kernel's parameter
    names (`*_arguments`: the launcher passes them by name)."""

    batch: int
    sd: int  # decoder tokens per batch entry
    se: int  # encoder tokens per batch entry
    sizes: QkvGqaConfig  # the operator's (the benchmark operator's: the plan refuses others)
    products: str  # "triton" (our tiles), "cublas", or "gluon" (one launch, pack included)
    pdl: bool
    branches: bool  # cuBLAS's products beside each other (`Config.branches_below_flop`)
    pack: Layout | None  # None: the Gluon kernel packs
    splits: tuple  # K splits of grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc (1 each: unsplit)
    tiles: TilesLaunch | None  # None: cuBLAS or Gluon makes the products, or no output needs one
    cublas: tuple  # on cuBLAS, which of grad_dec, grad_enc, grad_Wq, grad_[Wk; Wv] run
    ranges: tuple  # Regions of the launches that round to fp16
    gluon: GluonLaunch | None = None

    @property
    def td(self) -> int:
        return self.batch * self.sd

    @property
    def te(self) -> int:
        return self.batch * self.se

    def _split_arguments(self) -> dict:
        return dict(zip(("split_wq", "split_wkv", "split_dec", "split_enc"), self.splits))

    def pack_arguments(self) -> dict:
        return dict(B=self.batch, SD=self.sd, SE=self.se, **self.pack.end_arguments)

    def product_arguments(self) -> dict:
        (start_wq, end_wq), (start_wkv, end_wkv), (start_dec, end_dec), (start_enc, end_enc) = self.tiles.bounds
        return dict(TD=self.td, TE=self.te, **self._split_arguments(), start_wq=start_wq, end_wq=end_wq,
                    start_wkv=start_wkv, end_wkv=end_wkv, start_dec=start_dec, end_dec=end_dec, start_enc=start_enc,
                    end_enc=end_enc)

    def gluon_arguments(self) -> dict:
        g, c = self.gluon, self.gluon.counters
        s1, s2, s3 = g.starts
        bases = dict(zip(("r_gq", "r_gk", "r_gv", "r_dec", "r_enc", "r_wq", "r_wk", "r_wv"), g.regions.bases, strict=True))
        return dict(TD=self.td, TE=self.te, SD=self.sd, SE=self.se, dec_chunks=g.dec_chunks, enc_chunks=g.enc_chunks,
                    **self._split_arguments(), s1=s1, s2=s2, s3=s3, total=g.tiles, c_gq=c.gq, c_dec=c.dec, c_gkv=c.gkv,
                    c_enc=c.enc, n_counters=c.total, **bases, **g.items.end_arguments, pack_items=g.items.programs)


def product_shapes(sizes: QkvGqaConfig, axes) -> list:
    """(M, N, K) of grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc."""
    td, te = axes["batch_size"] * axes["seq_len_dec"], axes["batch_size"] * axes["seq_len_enc"]
    q_out, hidden, kv_out, cross = sizes.q_out, sizes.hidden, sizes.kv_out, sizes.cross_hidden
    return [(q_out, hidden, td), (2 * kv_out, cross, te), (td, hidden, q_out), (te, cross, 2 * kv_out)]


def pack_layout(cfg: Config, sizes: QkvGqaConfig, axes, splits) -> Layout:
    """The pack's programs: GQ head-tiles, the GK and GV group sums, the flat casts of dec, enc, Wq,
    Wk and Wv (those converting), then zero fills of the outputs that split-K products accumulate into."""
    batch, sd, se = axes["batch_size"], axes["seq_len_dec"], axes["seq_len_enc"]
    rows = cfg.pack.rows

    def flat(n):
        return chunks(n, cfg.pack.block, cfg.pack.iters)

    split_wq, split_wkv, split_dec, split_enc = (s > 1 for s in splits)
    hidden, cross, q_out, kv_out = sizes.hidden, sizes.cross_hidden, sizes.q_out, sizes.kv_out
    n_gk = batch * sizes.kv_heads * cdiv(se, rows)
    return Layout((
        Segment("grad_query_states", batch * sizes.heads * cdiv(sd, rows), holds=Holds.UPSTREAM, end="e_gq"),
        Segment("grad_key_states (head-group sums)", n_gk, holds=Holds.UPSTREAM, end="e_gk"),
        Segment("grad_value_states (head-group sums)", n_gk, holds=Holds.UPSTREAM, end="e_gv"),
        Segment("decoder_hidden_states", flat(batch * sd * hidden), end="e_dec"),
        Segment("encoder_hidden_states", flat(batch * se * cross), end="e_enc"),
        Segment("q_weight", flat(q_out * hidden), end="e_wq"),
        Segment("k_weight", flat(kv_out * cross), end="e_wk"),
        Segment("v_weight", flat(kv_out * cross), end="e_wv"),
        Segment("zero grad_decoder_hidden_states", split_dec * flat(batch * sd * hidden), ranged=False, end="e_zdec"),
        Segment("zero grad_encoder_hidden_states", split_enc * flat(batch * se * cross), ranged=False,
                end="e_zenc"),
        Segment("zero grad_q_weight", split_wq * flat(q_out * hidden), ranged=False, end="e_zwq"),
        Segment("zero grad_[k; v]_weight", split_wkv * flat(2 * kv_out * cross), ranged=False),
    ))


def gluon_launch(cfg: GluonConfig, sizes: QkvGqaConfig, axes, splits, needs) -> GluonLaunch:
    """Tile ranges, pack chunks, counters and range regions of the Gluon kernel at `axes` (refusing a
    config whose ring and pack slots exceed one program's shared memory)."""
    if cfg.shared_bytes > SM90_SHARED_BYTES - 1024:  # the mbarriers and alignment take the rest
        raise ValueError(f"GluonConfig: {cfg.stages} stages of {cfg.bm} x {cfg.bn} x {cfg.bk} beside the pack need "
                         f"{cfg.shared_bytes} bytes of shared memory; a program has {SM90_SHARED_BYTES}")
    td, te = axes["batch_size"] * axes["seq_len_dec"], axes["batch_size"] * axes["seq_len_enc"]
    input_grads, weight_grads = any(needs[:2]), any(needs[2:])
    split_wq, split_wkv, split_dec, split_enc = splits
    hidden, cross, q_out, kv_out = sizes.hidden, sizes.cross_hidden, sizes.q_out, sizes.kv_out
    t_wq = cdiv(q_out, cfg.bm) * cdiv(hidden, cfg.bn) * split_wq * weight_grads
    t_dec = cdiv(td, cfg.bm) * cdiv(hidden, cfg.bn) * split_dec * input_grads
    t_wkv = cdiv(2 * kv_out, cfg.bm) * cdiv(cross, cfg.bn) * split_wkv * weight_grads
    t_enc = cdiv(te, cfg.bm) * cdiv(cross, cfg.bn) * split_enc * input_grads

    dec_chunks, enc_chunks = (hidden // 256, cross // 256) if weight_grads else (0, 0)
    sums = _block_items(te, GLUON_SUM_ROWS)
    w = input_grads  # Wq16 and [Wk; Wv]16 feed the input gradients only
    regions = Regions((
        Region("grad_query_states", sizes.heads * _block_items(td, GLUON_ITEM_ROWS), Holds.UPSTREAM),
        Region("grad_key_states (head-group sums)", sizes.kv_heads * sums, Holds.UPSTREAM),
        Region("grad_value_states (head-group sums)", sizes.kv_heads * sums, Holds.UPSTREAM),
        Region("decoder_hidden_states", dec_chunks * _block_items(td, GLUON_ITEM_ROWS)),
        Region("encoder_hidden_states", enc_chunks * _block_items(te, GLUON_ITEM_ROWS)),
        Region("q_weight", w * gluon_wq_items(sizes)),
        Region("k_weight", w * gluon_wkv_items(sizes) // 2),
        Region("v_weight", w * gluon_wkv_items(sizes) // 2),
    ))
    starts = (t_wq, t_wq + t_dec, t_wq + t_dec + t_wkv)
    return GluonLaunch(starts, starts[-1] + t_enc, dec_chunks, enc_chunks, GluonCounters.of(td, te), regions,
                       gluon_pack_items(sizes, td, te, splits, dec_chunks, enc_chunks, input_grads))


def _block_items(t: int, rows: int) -> int:
    """Pack items of `rows` rows over t tokens, counted per GLUON_TOKEN_BLOCK (all full but the last block's)."""
    last = cdiv(t, GLUON_TOKEN_BLOCK) - 1
    return last * (GLUON_TOKEN_BLOCK // rows) + cdiv(t - last * GLUON_TOKEN_BLOCK, rows)


def gluon_pack_items(sizes: QkvGqaConfig, td: int, te: int, splits, dec_chunks: int, enc_chunks: int,
                     pack_weights: bool) -> Layout:
    """The Gluon pack partition's items (64 rows x 256 columns; 16 tokens of one head group for the
    sums), in the order it runs them: zero fills of the outputs that split-K tiles add into, the
    decoder side token block by token block (GQ's 16 heads, then dec16's chunks), Wq16, the encoder
    side block by block ([GK | GV]'s head-group sums, then enc16's chunks), [Wk; Wv]16. The kernel
    takes each segment's end (`end_arguments`) and the item count (`programs`: `pack_items`); a
    fixed counter's target is its segment's size."""
    split_wq, split_wkv, split_dec, split_enc = (s > 1 for s in splits)
    wq_items, wkv_items = gluon_wq_items(sizes), gluon_wkv_items(sizes)
    return Layout((
        Segment("zero grad_q_weight", split_wq * wq_items, ranged=False, end="e_zwq"),
        Segment("zero grad_[k; v]_weight", split_wkv * wkv_items, ranged=False, end="e_zwkv"),
        Segment("zero grad_decoder_hidden_states", split_dec * cdiv(td, GLUON_ITEM_ROWS) * (sizes.hidden // 256),
                ranged=False, end="e_zdec"),
        Segment("zero grad_encoder_hidden_states", split_enc * cdiv(te, GLUON_ITEM_ROWS) * (sizes.cross_hidden // 256),
                ranged=False, end="e_zenc"),
        Segment("decoder side", _block_items(td, GLUON_ITEM_ROWS) * (sizes.heads + dec_chunks), ranged=False,
                end="e_dec"),
        Segment("Wq16", pack_weights * wq_items, ranged=False, end="e_wq"),
        Segment("encoder side", _block_items(te, GLUON_SUM_ROWS) * 2 * sizes.kv_heads
                + _block_items(te, GLUON_ITEM_ROWS) * enc_chunks, ranged=False, end="e_enc"),
        Segment("[Wk; Wv]16", pack_weights * wkv_items, ranged=False),
    ))


def plan(cfg: Config, axes, sms: int, *, sizes: QkvGqaConfig = OFFICIAL, gpu: bool = True, gluon: bool = False,
         products: str | None = None, needs=None, deterministic: bool = False) -> Plan:
    """The launches of one call at `axes` on `sms` processors.

    sizes: the operator's (its `Problem.config`); the kernels are made for the benchmark operator's
    (`spec.OFFICIAL`), and other sizes are refused (a ValueError naming them).

    needs: one bool per output (None: all); with our tiles the input gradients (grad_dec, grad_enc)
    and the weight gradients go as groups, with cuBLAS per product. deterministic: no K splits (our
    tiles add split partial sums by atomics). gluon: the GPU runs the Gluon kernel (Hopper).
    products: "triton", "cublas", "gluon", or None (by size on a GPU: the Gluon kernel's window
    where it runs, else `cublas_min_flop`).
    """
    check_sizes("072 plan", sizes, OFFICIAL)
    if gpu:
        check_rings("072 Config", dict(tiles=cfg.tiles))
    gemms = product_shapes(sizes, axes)
    flop = 2 * sum(m * n * k for m, n, k in gemms)
    # On Hopper, cuBLAS's products beside each other beat our tiles below the Gluon kernel's window too
    # (notes/072.md row 34); elsewhere our tiles stay below cublas_min_flop.
    backend = choose_products(products, flop, 0 if gluon else cfg.cublas_min_flop, gpu,
                              gluon_window=(cfg.gluon.min_flop, cfg.gluon.max_flop) if gluon else None)
    needs = needs or (True,) * 5
    if backend == "gluon":
        g = cfg.gluon
        splits = [1] * 4 if deterministic else choose_splits(gemms, g.bm, g.bn, g.bk, sms)
        launch = gluon_launch(g, sizes, axes, splits, needs)
        return Plan(batch=axes["batch_size"], sd=axes["seq_len_dec"], se=axes["seq_len_enc"], sizes=sizes, products=backend,
                    pdl=False, branches=False, pack=None, splits=tuple(splits), tiles=None, cublas=(False,) * 4,
                    ranges=(launch.regions,), gluon=launch)
    t = cfg.tiles
    splits = choose_splits(gemms, t.bm, t.bn, t.bk, sms) if backend == "triton" and not deterministic else [1] * 4
    input_grads, weight_grads = any(needs[:2]), any(needs[2:])
    launch = None
    if backend == "triton" and (input_grads or weight_grads):
        tiles = [tile_count(m, n, s, t.bm, t.bn) * (weight_grads if i < 2 else input_grads)
                 for i, ((m, n, _), s) in enumerate(zip(gemms, splits))]
        bounds = longest_first([(n, k, s) for n, (_, _, k), s in zip(tiles, gemms, splits)])
        launch = TilesLaunch(sum(tiles), weight_grads, input_grads, bounds)
    pack = pack_layout(cfg, sizes, axes, splits)
    branches = backend == "cublas" and gpu and flop < cfg.branches_below_flop
    return Plan(batch=axes["batch_size"], sd=axes["seq_len_dec"], se=axes["seq_len_enc"], sizes=sizes, products=backend,
                pdl=cfg.pdl and gpu, branches=branches, pack=pack, splits=tuple(splits), tiles=launch,
                cublas=(needs[0], needs[1], needs[2], needs[3] or needs[4]), ranges=(pack.regions,))
