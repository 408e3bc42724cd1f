"""The one-launch 021 study (benchmarks/notes/021.md, rows 32-35): its launch shape (`Config`), the
rules that pick among tile shapes, and the plan of one call (`plan`): one persistent launch whose
task queue (`backfuse/kernels/queue.py`) holds every unit of work.

Queue order (each item waits only for counts of items before it):
1. conversions: fp16 copies of Wq, video, [Wk; Wv], text, Wo^T (transposed tiles) and grad_output
   (row tiles, with fp32 column sums for grad_bo), each tensor counted on its own counter;
2. zero fills of what later items accumulate into (split-K outputs, the attention's fp32 dK/dV);
3. forward product tiles: Q = video Wq^T + bq, [K | V] = text [Wk; Wv]^T + [bk | bv], dC = grad_output Wo,
   each waiting for its two operands' conversions; then grad_bo's column sums;
4. attention items, one per (batch, head, run of video blocks), after every forward tile;
5. gradient product tiles (deepest K slices first, so that short ones fill the last wave), after the
   attention and the zero fills; then the q/k/v bias gradients' column sums.

Plain Python: a plan can be checked on any machine without launching anything.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from backfuse.kernels.config import PackConfig, SumConfig, TileConfig
from backfuse.kernels.queue import Queue, QueueBuilder
from backfuse.kernels.schedule import Holds, Region, Regions, cdiv, choose_splits, chunks
from backfuse.ops.wan_xattn.config import text_tiles
from backfuse.ops.wan_xattn.spec import HEADS, HIDDEN

W = HIDDEN * HIDDEN  # elements of one weight


class Work(enum.IntEnum):
    """Kinds of queue items and their arguments."""

    GRAD_OUTPUT = 0  # (row tile,): go16 rows and their column sums
    CAST = 1  # (Tensor, chunk, elements): fp16 copy of one chunk
    TRANSPOSE = 2  # (tile,): one square tile of Wo^T
    ZERO = 3  # (Zeroed, chunk, elements)
    FORWARD = 4  # (Product, tile row, tile column, A row, B row, rows): one tile of Q, [K | V] or dC
    OUTPUT_BIAS = 5  # (column strip,): grad_bo from the grad_output tiles' sums
    ATTENTION = 6  # (batch, head, run, first block, end block, arrival counter slot)
    GRADIENT = 7  # (Gradient, tile row, tile column, k_lo / bk, k_hi, accumulate)
    BIAS = 8  # (column strip,): grad_bq, grad_bk, grad_bv from the attention's partial rows


class Tensor(enum.IntEnum):
    """fp32 inputs converted flat to fp16 (CAST items)."""

    VIDEO = 0
    TEXT = 1
    QUERY_WEIGHT = 2
    KEY_WEIGHT = 3
    VALUE_WEIGHT = 4


class Zeroed(enum.IntEnum):
    """Buffers that split-K tiles or the attention's runs add into (ZERO items)."""

    KV_PARTIALS = 0
    GRAD_QUERY_WEIGHT = 1
    GRAD_OUTPUT_WEIGHT = 2
    GRAD_KEY_WEIGHT = 3
    GRAD_VALUE_WEIGHT = 4
    GRAD_VIDEO = 5
    GRAD_TEXT = 6


class Product(enum.IntEnum):
    """Forward products (FORWARD items)."""

    QUERIES = 0
    KEYS_VALUES = 1
    CONTEXT_GRADIENT = 2


class Gradient(enum.IntEnum):
    """Gradient products (GRADIENT items): C[M, N] (+)= A[M, K] B[K, N]."""

    VIDEO = 0  # dQ Wq: [Tv, 1024, 1024]
    TEXT = 1  # [dK | dV] [Wk; Wv]: [Tt, 1024, 2048]
    QUERY_WEIGHT = 2  # dQ^T video: [1024, 1024, Tv]
    OUTPUT_WEIGHT = 3  # grad_output^T C: [1024, 1024, Tv]
    KEY_WEIGHT = 4  # dK^T text: [1024, 1024, Tt]
    VALUE_WEIGHT = 5  # dV^T text: [1024, 1024, Tt]


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Video tokens per block (bm); all text tokens in one tile up to one_tile, else bn per step; with
    one tile, programs per SM to aim for when runs of blocks share K and V (blocks_per_run)."""

    bm: int = 128
    bn: int = 128
    stages: int = 2
    one_tile: int = 128
    programs_per_sm: float = 1.0
    split_text: bool = True  # one text tile as a head and a tail (text_tiles)


@dataclass(frozen=True, kw_only=True)
class Config:
    warps: int = 8  # of every program of the launch
    programs_per_sm: int = 1  # resident programs per SM (the attention takes 255 registers a thread)
    # Conversions: grad_output in tiles of `rows` tokens, `cols` columns per step; Wo^T in `tile`-side
    # tiles; flat casts and zero fills in chunks of `block` elements (larger chunks spill: row 33).
    pack: PackConfig = PackConfig(rows=16, cols=1024, tile=64, block=8192, iters=1)
    # Forward tiles (benchmarks/notes/021.md row 24), and the narrower ones used when those would not
    # give every program one (forward_tiles).
    forward: TileConfig = TileConfig(bm=128, bn=256, bk=64, stages=3)
    forward_small: TileConfig = TileConfig(bm=128, bn=128, bk=64, stages=3)
    attention: AttentionConfig = AttentionConfig()
    gradients: TileConfig = TileConfig(bm=128, bn=128, bk=32, stages=6)
    sums: SumConfig = SumConfig(rows=32, cols=64)  # bias gradients from per-item partial rows


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles;
# 64-token attention blocks so that small shapes still give several items per head.
INTERPRETER_CONFIG = Config(
    warps=4,
    pack=PackConfig(rows=64, cols=1024, tile=256, block=1 << 20, iters=1),
    forward=TileConfig(bm=128, bn=512, bk=256, stages=1),
    forward_small=TileConfig(bm=128, bn=256, bk=256, stages=1),
    attention=AttentionConfig(bm=64, bn=64, stages=1, one_tile=128, programs_per_sm=2),
    gradients=TileConfig(bm=512, bn=512, bk=256, stages=1))


def blocks_per_run(at: AttentionConfig, m_blocks: int, heads: int, programs: int, one_tile: bool) -> int:
    """Blocks of one head per attention item. With one text tile, long runs (fewer fp32 partial sums of
    dK/dV) while there are still programs_per_sm items per program; else 1."""
    if not one_tile:
        return 1
    runs = min(m_blocks, max(1, int(at.programs_per_sm * programs) // heads))
    return cdiv(m_blocks, runs)


def forward_tiles(cfg: Config, tv: int, tt: int, programs: int) -> TileConfig:
    """The forward products' tiles: `forward`, or `forward_small` when those would not give every
    program one (up to ~2000 video tokens): a half-width tile takes half as long."""
    return cfg.forward if forward_tile_count(cfg.forward, tv, tt) >= programs else cfg.forward_small


def forward_tile_count(t: TileConfig, tv: int, tt: int) -> int:
    """Tiles of Q, [K | V] and dC."""
    return 2 * cdiv(tv, t.bm) * cdiv(HIDDEN, t.bn) + cdiv(tt, t.bm) * cdiv(2 * HIDDEN, t.bn)


# Rough cost of one item, in microseconds of one program (`item_cost`), for the list scheduler: a fixed
# cost per item, fp32-side bytes moved, and tensor-core work. Only ratios matter.
ITEM_US = 1.0
BYTES_PER_US = 30e3  # one program's share of a memory-bound pass
FLOP_PER_US = 4e6  # one program's product tiles


def item_cost(cfg: Config, fw: TileConfig, text_width: int, item) -> float:
    """Estimated microseconds of `item` on one program (fw: the forward tiles; text_width: padded text
    tokens of an attention tile)."""
    kind, a = item.kind, item.args
    if kind in (Work.CAST, Work.ZERO):
        elements = min(cfg.pack.block * cfg.pack.iters, a[2] - a[1] * cfg.pack.block * cfg.pack.iters)
        return ITEM_US + elements * (6 if kind == Work.CAST else 4) / BYTES_PER_US
    if kind == Work.TRANSPOSE:
        return ITEM_US + cfg.pack.tile ** 2 * 6 / BYTES_PER_US
    if kind == Work.GRAD_OUTPUT:
        return ITEM_US + cfg.pack.rows * HIDDEN * 6 / BYTES_PER_US
    if kind == Work.FORWARD:
        return ITEM_US + 2 * fw.bm * fw.bn * HIDDEN / FLOP_PER_US
    if kind == Work.ATTENTION:
        # per block: QK^T, PV, dP, dQ, dK, dV: six [bm, text, 64] products, at a third of the tiles' rate
        return ITEM_US + (a[4] - a[3]) * 6 * 2 * cfg.attention.bm * text_width * 64 * 3 / FLOP_PER_US
    if kind == Work.GRADIENT:
        return ITEM_US + 2 * cfg.gradients.bm * cfg.gradients.bn * (a[4] - a[3] * cfg.gradients.bk) / FLOP_PER_US
    return ITEM_US


def gradient_shapes(tv: int, tt: int) -> list:
    """(M, N, K) of each Gradient product, in Gradient order."""
    return [(tv, HIDDEN, HIDDEN), (tt, HIDDEN, 2 * HIDDEN)] + [(HIDDEN, HIDDEN, tv)] * 2 + [(HIDDEN, HIDDEN, tt)] * 2


@dataclass(frozen=True)
class Plan:
    """One 021 call: the launch's programs, tile shapes and queue, and the attention's shape."""

    forward: TileConfig  # the forward products' tiles
    one_tile: bool  # all text tokens in one tile (else text tiles of AttentionConfig.bn)
    text_tile: int
    text_tail: int  # 0: none
    runs: int  # attention items per head
    kv_partial_rows: int  # of the fp32 dK/dV partial sums (1: unused)
    bias_rows: int  # partial rows of the q/k/v bias gradients (one per attention item)
    grad_output_tiles: int  # rows of grad_output's column sums (one per GRAD_OUTPUT item)
    splits: tuple  # K splits per Gradient product (0: skipped)
    queue: Queue
    regions: Regions  # fp16-range regions of the launch, one per tensor rounded to fp16


def _tiles(m: int, n: int, bm: int, bn: int):
    """(off_m, off_n) of the tiles of an [m, n] output, n fastest."""
    return [(i * bm, j * bn) for i in range(cdiv(m, bm)) for j in range(cdiv(n, bn))]


class _Ranges:
    """fp16-range regions (one per tensor rounded to fp16) laid out one after another."""

    def __init__(self):
        self.list, self.next = [], 0

    def region(self, name: str, slots: int, holds: Holds = Holds.INPUT) -> int:
        """Reserve `slots` slots for tensor `name`; returns the first."""
        self.list.append(Region(name, slots, holds))
        self.next += slots
        return self.next - slots

    def regions(self) -> Regions:
        return Regions(tuple(self.list))


def plan(cfg: Config, axes, sms: int, *, programs: int | None = None, needs=None, deterministic: bool = False) -> Plan:
    """The launch of one call at `axes` on `sms` processors: K splits and attention runs balanced over
    sms * programs_per_sm programs, the queue scheduled over `programs` (default the same; the Triton
    interpreter runs one program after another, so there it is 1).

    needs: one bool per output (None: all); without input gradients (grad_video, grad_text) or
    without weight gradients (the four grad_W) their products are skipped; the bias gradients are
    column sums taken along the way. deterministic: no K splits, and the attention's partial dK/dV
    stored per run and added in order instead of by atomics. Plans are cached: a call at a shape
    seen before reuses its plan (and its queue's device table).
    """
    shape = axes["batch_size"], axes["num_video_tokens"], axes["num_text_tokens"]
    return _plan(cfg, shape, sms, programs or sms * cfg.programs_per_sm,
                 tuple(bool(n) for n in needs) if needs else (True,) * 10, deterministic)


@functools.lru_cache(maxsize=256)
def _plan(cfg: Config, shape: tuple, sms: int, launched: int, needs: tuple, deterministic: bool) -> Plan:
    batch, nv, nt = shape
    tv, tt = batch * nv, batch * nt
    pk, at, gr = cfg.pack, cfg.attention, cfg.gradients
    programs = sms * cfg.programs_per_sm
    one_tile = nt <= at.one_tile
    m_blocks = cdiv(nv, at.bm)
    text_tile, text_tail = text_tiles(nt, at.split_text) if one_tile else (at.bn, 0)
    per_run = blocks_per_run(at, m_blocks, batch * HEADS, programs, one_tile)
    runs = cdiv(m_blocks, per_run)
    shared_heads = runs > 1

    gemms = gradient_shapes(tv, tt)
    wanted = (any(needs[:2]),) * 2 + (any(needs[2::2]),) * 4  # input products, weight products
    splits = [1] * 6 if deterministic else choose_splits(gemms, gr.bm, gr.bn, gr.bk, programs)
    splits = [s * w for s, w in zip(splits, wanted)]
    fw = forward_tiles(cfg, tv, tt, programs)

    q, ranges = QueueBuilder(), _Ranges()
    # one counter per fp16 buffer the conversions fill ([Wk; Wv] is one), then per later stage
    weights = q.counter("converted query weight")
    video, key_values = q.counter("converted video"), q.counter("converted key and value weights")
    text, wo = q.counter("converted text"), q.counter("converted output weight")
    go = q.counter("converted grad_output")
    converted = {Tensor.QUERY_WEIGHT: weights, Tensor.VIDEO: video, Tensor.KEY_WEIGHT: key_values,
                 Tensor.VALUE_WEIGHT: key_values, Tensor.TEXT: text}
    partials_zeroed, outputs_zeroed = q.counter("zeroed dK/dV partial sums"), q.counter("zeroed split-K outputs")
    forward_done, attention_done = q.counter("forward tiles"), q.counter("attention")
    arrivals = q.counter("attention arrivals", batch * HEADS if shared_heads else 0)

    def waits_for(*counters):
        """(slot, every signal so far) of each counter: wait for everything added that counts it."""
        return [(c[0], q.signals(c[0])) for c in counters]

    # 1. conversions, in the order the forward tiles need them
    for t, name, n in ((Tensor.QUERY_WEIGHT, "query_weight", W), (Tensor.VIDEO, "video_latents", tv * HIDDEN),
                       (Tensor.KEY_WEIGHT, "key_weight", W), (Tensor.VALUE_WEIGHT, "value_weight", W),
                       (Tensor.TEXT, "text_embeddings", tt * HIDDEN)):
        n_chunks = chunks(n, pk.block, pk.iters)
        first = ranges.region(name, n_chunks)
        for c in range(n_chunks):
            q.add(Work.CAST, (t, c, n), (first + c,), signal=converted[t][0])
    wo_tiles = (HIDDEN // pk.tile) ** 2
    first = ranges.region("output_weight", wo_tiles)
    for tile in range(wo_tiles):
        q.add(Work.TRANSPOSE, (tile,), (first + tile,), signal=wo[0])
    go_tiles = cdiv(tv, pk.rows)
    first = ranges.region("grad_output", go_tiles, Holds.UPSTREAM)
    for tile in range(go_tiles):
        q.add(Work.GRAD_OUTPUT, (tile,), (first + tile,), signal=go[0])

    # 2. zero fills
    zero = [(Zeroed.KV_PARTIALS, tt * 2 * HIDDEN, shared_heads and not deterministic, partials_zeroed),
            (Zeroed.GRAD_QUERY_WEIGHT, W, splits[Gradient.QUERY_WEIGHT] > 1, outputs_zeroed),
            (Zeroed.GRAD_OUTPUT_WEIGHT, W, splits[Gradient.OUTPUT_WEIGHT] > 1, outputs_zeroed),
            (Zeroed.GRAD_KEY_WEIGHT, W, splits[Gradient.KEY_WEIGHT] > 1, outputs_zeroed),
            (Zeroed.GRAD_VALUE_WEIGHT, W, splits[Gradient.VALUE_WEIGHT] > 1, outputs_zeroed),
            (Zeroed.GRAD_VIDEO, tv * HIDDEN, splits[Gradient.VIDEO] > 1, outputs_zeroed),
            (Zeroed.GRAD_TEXT, tt * HIDDEN, splits[Gradient.TEXT] > 1, outputs_zeroed)]
    for z, n, used, counter in zero:
        for c in range(chunks(n, pk.block, pk.iters) if used else 0):
            q.add(Work.ZERO, (z, c, n), signal=counter[0])

    # 3. forward tiles, each region's slots in tile order
    for product, rows, width, a_row, b_row, operands, regions in (
            (Product.QUERIES, tv, HIDDEN, 0, 0, (video, weights), ("queries",)),
            (Product.KEYS_VALUES, tt, 2 * HIDDEN, tv, HIDDEN, (text, key_values), ("keys", "values")),
            (Product.CONTEXT_GRADIENT, tv, HIDDEN, tv + tt, 3 * HIDDEN, (go, wo), ("gradient of attention context",))):
        holds = Holds.GRADIENT if product == Product.CONTEXT_GRADIENT else Holds.INPUT
        tiles = _tiles(rows, width, fw.bm, fw.bn)
        for r, name in enumerate(regions):  # [K | V]: the K columns' tiles, then the V columns'
            mine = [t for t in tiles if t[1] // HIDDEN == r]
            first = ranges.region(name, len(mine), holds)
            for i, (off_m, off_n) in enumerate(mine):
                q.add(Work.FORWARD, (product, off_m // fw.bm, off_n // fw.bn, a_row + off_m, b_row + off_n, rows), (first + i,),
                      waits_for(*operands), signal=forward_done[0])
    for strip in range(HIDDEN // cfg.sums.cols):
        q.add(Work.OUTPUT_BIAS, (strip,), waits=waits_for(go))

    # 4. attention: one item per (batch, head, run); three regions of one slot per item
    items = [(b, h, run, run * per_run, min((run + 1) * per_run, m_blocks), arrivals[b * HEADS + h] if shared_heads else -1)
             for b in range(batch) for h in range(HEADS) for run in range(runs)]
    firsts = [ranges.region(name, len(items), Holds.VANISHING)
              for name in ("gradient of queries", "gradient of keys", "gradient of values")]
    for i, args in enumerate(items):
        q.add(Work.ATTENTION, args, tuple(f + i for f in firsts), waits_for(forward_done, partials_zeroed),
              signal=attention_done[0])

    # 5. gradient tiles, deepest K slices first
    after_attention = waits_for(attention_done, outputs_zeroed)
    groups = []
    for g in Gradient:
        m, n, k = gemms[g]
        s = splits[g]
        if not s:
            continue
        per_split = cdiv(cdiv(k, s), gr.bk) * gr.bk
        tiles = [(off_m, off_n, lo, min(k, lo + per_split)) for lo in range(0, k, per_split)
                 for off_m, off_n in _tiles(m, n, gr.bm, gr.bn)]
        groups.append((per_split, g, tiles, s > 1))
    for _, g, tiles, accumulate in sorted(groups, key=lambda x: -x[0]):
        for off_m, off_n, lo, hi in tiles:
            q.add(Work.GRADIENT, (g, off_m // gr.bm, off_n // gr.bn, lo // gr.bk, hi, int(accumulate)), waits=after_attention)
    for strip in range(3 * HIDDEN // cfg.sums.cols):
        q.add(Work.BIAS, (strip,), waits=waits_for(attention_done))

    return Plan(forward=fw, one_tile=one_tile, text_tile=text_tile, text_tail=text_tail,
                runs=runs, kv_partial_rows=(runs if deterministic else 1) * tt if shared_heads else 1,
                bias_rows=batch * runs, grad_output_tiles=go_tiles, splits=tuple(splits),
                queue=q.build(launched, functools.partial(item_cost, cfg, fw, text_tile + text_tail)),
                regions=ranges.regions())
