"""072's launch shapes (`Config`) and the plan of one call (`plan`): a pack launch that makes every
fp16 operand, then the four products, as one launch of our tiles or as four cuBLAS products.

Plain Python: a plan can be checked on any machine without launching anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.config import PackConfig, TileConfig
from ...kernels.schedule import Layout, Segment, cdiv, choose_products, choose_splits, chunks, longest_first, tile_count
from .spec import CROSS_HIDDEN, HEADS, HIDDEN, KV_HEADS, KV_OUT, Q_OUT


@dataclass(frozen=True, kw_only=True)
class Config:
    # Pack: rows = tokens per head-tile of the layout change and the group sums; flat casts and fills.
    pack: PackConfig = PackConfig(rows=32, block=4096, iters=16, warps=4)
    # Our products' tiles (both operand layouts in one launch; measured: benchmarks/notes/072.md). They
    # run below cublas_min_flop only, where 128 x 128 tiles at 4 warps (2 per SM) beat 128 x 256 by 5%.
    tiles: TileConfig = TileConfig(bm=128, bn=128, bk=32, warps=4, stages=6)
    pdl: bool = True  # the products' launch as a programmatic dependent launch (GPU only)
    # From this much product work (FLOP) on, cuBLAS's products beat ours by more than its three extra
    # launches can cost, even on a slow host: the GPU work then outlasts the launching (measured:
    # benchmarks/notes/072.md). Below it, cuBLAS wins only when the host keeps up.
    cublas_min_flop: float = 100e9


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles.
INTERPRETER_CONFIG = Config(pack=PackConfig(rows=32, block=1 << 20, iters=1, warps=4),
                            tiles=TileConfig(bm=512, bn=512, bk=256, warps=8, stages=1), pdl=False)


@dataclass(frozen=True)
class TilesLaunch:
    """The launch of our product tiles: which groups it runs and where each product's tiles start."""

    programs: int
    weight_grads: bool  # grad_Wq, grad_[Wk; Wv]
    input_grads: bool  # grad_dec, grad_enc
    starts: tuple  # first program of grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc (deepest tiles first)


@dataclass(frozen=True)
class Plan:
    """Every launch of one 072 call."""

    products: str  # "triton" (our tiles) or "cublas"
    pdl: bool
    pack: Layout
    splits: tuple  # K splits of grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc (1 each: unsplit)
    tiles: TilesLaunch | None  # None: cuBLAS makes the products, or no output needs one
    cublas: tuple  # on cuBLAS, which of grad_dec, grad_enc, grad_Wq, grad_[Wk; Wv] run
    ranges: tuple  # Regions of the launches that round to fp16: the pack's only


def product_shapes(axes) -> list:
    """(M, N, K) of grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc."""
    td, te = axes["batch_size"] * axes["seq_len_dec"], axes["batch_size"] * axes["seq_len_enc"]
    return [(Q_OUT, HIDDEN, td), (2 * KV_OUT, CROSS_HIDDEN, te), (td, HIDDEN, Q_OUT), (te, CROSS_HIDDEN, 2 * KV_OUT)]


def pack_layout(cfg: Config, axes, splits) -> Layout:
    """The pack's programs: GQ head-tiles, the GK and GV group sums, the flat casts of dec, enc, Wq,
    Wk and Wv (those converting), then zero fills of the outputs that split-K products accumulate into."""
    batch, sd, se = axes["batch_size"], axes["seq_len_dec"], axes["seq_len_enc"]
    rows = cfg.pack.rows

    def flat(n):
        return chunks(n, cfg.pack.block, cfg.pack.iters)

    split_wq, split_wkv, split_dec, split_enc = (s > 1 for s in splits)
    n_gk = batch * KV_HEADS * cdiv(se, rows)
    return Layout((
        Segment("grad_query_states", batch * HEADS * cdiv(sd, rows)),
        Segment("grad_key_states (head-group sums)", n_gk),
        Segment("grad_value_states (head-group sums)", n_gk),
        Segment("decoder_hidden_states", flat(batch * sd * HIDDEN)),
        Segment("encoder_hidden_states", flat(batch * se * CROSS_HIDDEN)),
        Segment("q_weight", flat(Q_OUT * HIDDEN)),
        Segment("k_weight", flat(KV_OUT * CROSS_HIDDEN)),
        Segment("v_weight", flat(KV_OUT * CROSS_HIDDEN)),
        Segment("zero grad_decoder_hidden_states", split_dec * flat(batch * sd * HIDDEN), ranged=False),
        Segment("zero grad_encoder_hidden_states", split_enc * flat(batch * se * CROSS_HIDDEN), ranged=False),
        Segment("zero grad_q_weight", split_wq * flat(Q_OUT * HIDDEN), ranged=False),
        Segment("zero grad_[k; v]_weight", split_wkv * flat(2 * KV_OUT * CROSS_HIDDEN), ranged=False),
    ))


def plan(cfg: Config, axes, sms: int, *, gpu: bool = True, products: str | None = None, needs=None,
         deterministic: bool = False) -> Plan:
    """The launches of one call at `axes` on `sms` processors.

    needs: one bool per output (None: all); with our tiles the input gradients (grad_dec, grad_enc)
    and the weight gradients go as groups, with cuBLAS per product. deterministic: no K splits (our
    tiles add split partial sums by atomics). products: "triton", "cublas", or None (by size on a
    GPU: `cublas_min_flop`).
    """
    gemms = product_shapes(axes)
    backend = choose_products(products, 2 * sum(m * n * k for m, n, k in gemms), cfg.cublas_min_flop, gpu)
    t = cfg.tiles
    splits = choose_splits(gemms, t.bm, t.bn, t.bk, sms) if backend == "triton" and not deterministic else [1] * 4
    needs = needs or (True,) * 5
    input_grads, weight_grads = any(needs[:2]), any(needs[2:])
    launch = None
    if backend == "triton" and (input_grads or weight_grads):
        tiles = [tile_count(m, n, s, t.bm, t.bn) * (weight_grads if i < 2 else input_grads)
                 for i, ((m, n, _), s) in enumerate(zip(gemms, splits))]
        starts = longest_first([(n, k, s) for n, (_, _, k), s in zip(tiles, gemms, splits)])
        launch = TilesLaunch(sum(tiles), weight_grads, input_grads, tuple(starts))
    pack = pack_layout(cfg, axes, splits)
    return Plan(products=backend, pdl=cfg.pdl and gpu, pack=pack, splits=tuple(splits), tiles=launch,
                cublas=(needs[0], needs[1], needs[2], needs[3] or needs[4]), ranges=(pack.regions,))
