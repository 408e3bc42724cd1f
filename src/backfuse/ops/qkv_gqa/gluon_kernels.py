"""072 in one Gluon launch: the fp16 operand pack and the four products, overlapped on every SM.

Math (072): GQ[t, h*256 + d] = grad_query_states[b, h, s, d] for token t = b*Sd + s; GK[t, j*256 + d]
= sum_{g<4} grad_key_states[b, 4j + g, s, d] (GV likewise); then
grad_Wq = GQ^T dec, grad_dec = GQ Wq, [grad_Wk; grad_Wv] = [GK | GV]^T enc, grad_enc = [GK | GV] [Wk; Wv].

A program (one per SM) runs four partitions at once:
- pack (4 warps, ops/qkv_gqa/gluon_pack.py): converts its share of the fp32 inputs to the fp16
  operand buffers (layout change and head-group sums included), counting finished items per
  128-token block and per weight in global counters (release);
- loader (1 warp): before the TMA copies of a tile's operands, waits (acquire) until the pack
  tiles they read are counted;
- two consumer warpgroups: wgmma over the ring, fp32 stores (atomics for split-K tiles).
Each partition counts itself out at its end; the launch's last one zeroes the counters again, so
calls on a stream share one counter buffer and need no memset (`buffers.zeroed_counters`).
The pack runs in the order the products need it (the decoder side first), so the products start
after the first token block is packed and the pack's memory traffic runs under their compute.
Measured (benchmarks/notes/gluon.md): 7-9% faster than pack + our Triton products at 34-43 GFLOP,
at parity with pack + cuBLAS at 86-172 GFLOP, slower below and above (config.GluonConfig).
"""

# No `from __future__ import annotations`: the aggregates' field annotations must be types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

from ...kernels.gluon.gemm import LOADER_REGS, consume_tile, issue_step, store_tile, tile_coords, wait_count
from .gluon_pack import (
    C_WKV16,
    C_WQ16,
    C_ZERO_DEC,
    C_ZERO_ENC,
    C_ZERO_WKV,
    C_ZERO_WQ,
    ITEM_ROWS,
    TOKEN_BLOCK,
    UNIT,
    UNITS,
    Counters,
    Inputs,
    Operands,
    Outputs,
    PackList,
    RangeBases,
    Sizes,
    _chunks,
    _gkv_items,
    _gq_items,
    _leave,
    _pack,
)


@aggregate
class Tiles:
    """The four products' tiles, in order [grad_Wq | grad_dec | grad_Wkv | grad_enc] (starts 0, s1,
    s2, s3; `total` in all), their token counts and K splits (config.GluonLaunch); a partition takes
    tiles first, first + stride, ..."""

    TD: gl.tensor
    TE: gl.tensor
    split_wq: gl.tensor
    split_wkv: gl.tensor
    split_dec: gl.tensor
    split_enc: gl.tensor
    s1: gl.tensor
    s2: gl.tensor
    s3: gl.tensor
    total: gl.tensor
    first: gl.tensor
    stride: gl.tensor

    @gluon.constexpr_function
    def __init__(self, TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, first, stride):
        self.TD, self.TE = TD, TE
        self.split_wq, self.split_wkv, self.split_dec, self.split_enc = split_wq, split_wkv, split_dec, split_enc
        self.s1, self.s2, self.s3, self.total, self.first, self.stride = s1, s2, s3, total, first, stride


@aggregate
class Ring:
    """The products' shared-memory ring: A's slots K-major (a_k) and the same slots M-major (a_m),
    B's slots, and each slot's `ready` (TMA landed) and `empty` (both consumers done) mbarriers."""

    a_k: gl.shared_memory_descriptor
    a_m: gl.shared_memory_descriptor
    b: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, a_k, a_m, b, ready, empty):
        self.a_k, self.a_m, self.b, self.ready, self.empty = a_k, a_m, b, ready, empty


@aggregate
class Descriptors:
    """fused_kernel's eight TMA descriptors (`descriptor_blocks`): each product's A and B."""

    a_wq: tma.tensor_descriptor
    b_wq: tma.tensor_descriptor
    a_dec: tma.tensor_descriptor
    b_dec: tma.tensor_descriptor
    a_wkv: tma.tensor_descriptor
    b_wkv: tma.tensor_descriptor
    a_enc: tma.tensor_descriptor
    b_enc: tma.tensor_descriptor

    @gluon.constexpr_function
    def __init__(self, a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc):
        self.a_wq, self.b_wq, self.a_dec, self.b_dec = a_wq, b_wq, a_dec, b_dec
        self.a_wkv, self.b_wkv, self.a_enc, self.b_enc = a_wkv, b_wkv, a_enc, b_enc


@gluon.jit
def _product_of(tile, s1, s2, s3):
    return (tile >= s1).to(gl.int32) + (tile >= s2).to(gl.int32) + (tile >= s3).to(gl.int32)


@gluon.jit
def _loader(d, ring, counters, t, lst, sz, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The TMA copies of tiles `t` (this partition's share) into the ring; each tile waits for the
    pack items (list `lst`) it reads: per K step (weight gradients: K is tokens) or once (input
    gradients; a weight's counter reaches its segment's size)."""
    # the operator's sizes (`Sizes`) under their kernel names
    HIDDEN: gl.constexpr = sz.HIDDEN
    CROSS: gl.constexpr = sz.CROSS
    Q_OUT: gl.constexpr = sz.Q_OUT
    KV_OUT: gl.constexpr = sz.KV_OUT
    c = counters.slots
    dec_chunks, enc_chunks = lst.dec_chunks, lst.enc_chunks
    TD, TE, s1, s2, s3 = t.TD, t.TE, t.s1, t.s2, t.s3
    it = 0
    for tile in range(t.first, t.total, t.stride):
        p = _product_of(tile, s1, s2, s3)
        if p == 0:  # grad_Wq = GQ^T dec16: A M-major [tokens, 4096], B [tokens, 1536]
            off_m, off_n, k_lo, k_hi = tile_coords(tile, Q_OUT // BM, HIDDEN // BN, TD, t.split_wq, BM, BN, BK)
            for k in range(k_lo, k_hi, BK):
                block = k // TOKEN_BLOCK
                if (k == k_lo) | (k % TOKEN_BLOCK == 0):
                    wait_count(c + counters.gq + block, _gq_items(block, TD, sz.HEADS))
                    wait_count(c + counters.dec + block, dec_chunks * _chunks(block, TD, ITEM_ROWS))
                issue_step(d.a_wq, d.b_wq, ring.a_m, ring.b, ring.ready, ring.empty, it, k, off_m, k, off_n, STAGES)
                it += 1
        elif p == 1:  # grad_dec = GQ Wq16
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s1, gl.cdiv(TD, BM), HIDDEN // BN, Q_OUT, t.split_dec, BM, BN, BK)
            wait_count(c + C_WQ16, lst.e_wq - lst.e_dec)
            wait_count(c + counters.gq + off_m // TOKEN_BLOCK, _gq_items(off_m // TOKEN_BLOCK, TD, sz.HEADS))
            for k in range(k_lo, k_hi, BK):
                issue_step(d.a_dec, d.b_dec, ring.a_k, ring.b, ring.ready, ring.empty, it, off_m, k, k, off_n, STAGES)
                it += 1
        elif p == 2:  # [grad_Wk; grad_Wv] = [GK | GV]^T enc16
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s2, 2 * KV_OUT // BM, CROSS // BN, TE, t.split_wkv, BM, BN, BK)
            for k in range(k_lo, k_hi, BK):
                block = k // TOKEN_BLOCK
                if (k == k_lo) | (k % TOKEN_BLOCK == 0):
                    wait_count(c + counters.gkv + block, _gkv_items(block, TE, sz.GROUP))
                    wait_count(c + counters.enc + block, enc_chunks * _chunks(block, TE, ITEM_ROWS))
                issue_step(d.a_wkv, d.b_wkv, ring.a_m, ring.b, ring.ready, ring.empty, it, k, off_m, k, off_n, STAGES)
                it += 1
        else:  # grad_enc = [GK | GV] [Wk; Wv]16
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s3, gl.cdiv(TE, BM), CROSS // BN, 2 * KV_OUT, t.split_enc, BM, BN,
                                                   BK)
            wait_count(c + C_WKV16, lst.items - lst.e_enc)
            wait_count(c + counters.gkv + off_m // TOKEN_BLOCK, _gkv_items(off_m // TOKEN_BLOCK, TE, sz.GROUP))
            for k in range(k_lo, k_hi, BK):
                issue_step(d.a_enc, d.b_enc, ring.a_k, ring.b, ring.ready, ring.empty, it, off_m, k, k, off_n, STAGES)
                it += 1
    _leave(counters)


@gluon.jit
def _consumer(ring, counters, outs, t, lst, sz, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, PART: gl.constexpr):
    """Rows [PART * BM/2, +BM/2) of tiles `t` (the loader's); split-K tiles add into outputs that
    the pack zeroed (waited for before the first atomic: the zero fill's counter reaches its
    segment's size in the pack list `lst`)."""
    # the operator's sizes (`Sizes`) under their kernel names
    HIDDEN: gl.constexpr = sz.HIDDEN
    CROSS: gl.constexpr = sz.CROSS
    Q_OUT: gl.constexpr = sz.Q_OUT
    KV_OUT: gl.constexpr = sz.KV_OUT
    ROWS: gl.constexpr = BM // 2
    ROW0: gl.constexpr = PART * ROWS
    c = counters.slots
    TD, TE, s1, s2, s3 = t.TD, t.TE, t.s1, t.s2, t.s3
    it = 0
    for tile in range(t.first, t.total, t.stride):
        p = _product_of(tile, s1, s2, s3)
        if p == 0:
            off_m, off_n, k_lo, k_hi = tile_coords(tile, Q_OUT // BM, HIDDEN // BN, TD, t.split_wq, BM, BN, BK)
            acc, it = consume_tile(ring.a_m, ring.b, ring.ready, ring.empty, it, gl.cdiv(k_hi - k_lo, BK), False, False,
                                   False, ROW0, ROWS, BN, STAGES, 4)
            if t.split_wq > 1:
                wait_count(c + C_ZERO_WQ, lst.e_zwq)
            store_tile(outs.grad_wq, HIDDEN, acc, off_m + ROW0, off_n, Q_OUT, HIDDEN, t.split_wq > 1)
        elif p == 1:
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s1, gl.cdiv(TD, BM), HIDDEN // BN, Q_OUT, t.split_dec, BM, BN, BK)
            acc, it = consume_tile(ring.a_k, ring.b, ring.ready, ring.empty, it, gl.cdiv(k_hi - k_lo, BK), True, False,
                                   False, ROW0, ROWS, BN, STAGES, 4)
            if t.split_dec > 1:
                wait_count(c + C_ZERO_DEC, lst.e_zdec - lst.e_zwkv)
            store_tile(outs.grad_dec, HIDDEN, acc, off_m + ROW0, off_n, TD, HIDDEN, t.split_dec > 1)
        elif p == 2:
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s2, 2 * KV_OUT // BM, CROSS // BN, TE, t.split_wkv, BM, BN, BK)
            acc, it = consume_tile(ring.a_m, ring.b, ring.ready, ring.empty, it, gl.cdiv(k_hi - k_lo, BK), False, False,
                                   False, ROW0, ROWS, BN, STAGES, 4)
            if t.split_wkv > 1:
                wait_count(c + C_ZERO_WKV, lst.e_zwkv - lst.e_zwq)
            # rows below KV_OUT are grad_Wk's, the rest grad_Wv's: one output tensor each
            on_v = off_m >= KV_OUT
            store_tile(gl.where(on_v, outs.grad_wv, outs.grad_wk), CROSS, acc, off_m + ROW0 - on_v.to(gl.int32) * KV_OUT,
                       off_n, KV_OUT, CROSS, t.split_wkv > 1)
        else:
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s3, gl.cdiv(TE, BM), CROSS // BN, 2 * KV_OUT, t.split_enc, BM, BN,
                                                   BK)
            acc, it = consume_tile(ring.a_k, ring.b, ring.ready, ring.empty, it, gl.cdiv(k_hi - k_lo, BK), True, False,
                                   False, ROW0, ROWS, BN, STAGES, 4)
            if t.split_enc > 1:
                wait_count(c + C_ZERO_ENC, lst.e_zenc - lst.e_zdec)
            store_tile(outs.grad_enc, CROSS, acc, off_m + ROW0, off_n, TE, CROSS, t.split_enc > 1)
    _leave(counters)


@gluon.jit
def _second_consumer(ring, counters, outs, t, lst, sz, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr):
    _consumer(ring, counters, outs, t, lst, sz, BM, BN, BK, STAGES, 1)


@gluon.jit(do_not_specialize=["TD", "TE", "SD", "SE", "dec_chunks", "enc_chunks", "split_wq", "split_wkv", "split_dec",
                               "split_enc", "s1", "s2", "s3", "total", "c_gq", "c_dec", "c_gkv", "c_enc", "n_counters",
                               "r_gq", "r_gk", "r_gv", "r_dec", "r_enc", "r_wq", "r_wk", "r_wv", "e_zwq", "e_zwkv",
                               "e_zdec", "e_zenc", "e_dec", "e_wq", "e_enc", "pack_items"])
def fused_kernel(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc,
                 gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
                 grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots, ranges,
                 TD, TE, SD, SE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
                 c_gq, c_dec, c_gkv, c_enc, n_counters, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv,
                 e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc, pack_items,
                 HIDDEN: gl.constexpr, CROSS: gl.constexpr, HEADS: gl.constexpr, GROUP: gl.constexpr,
                 HEAD_DIM: gl.constexpr, Q_OUT: gl.constexpr, KV_OUT: gl.constexpr, KV_ITEMS: gl.constexpr,
                 STAGES: gl.constexpr, PACK_WARPS: gl.constexpr, REGS: gl.constexpr):
    """The five 072 outputs from the official inputs, one persistent launch (counters zero at the
    start; it leaves them zero).

    Descriptors (fp16, over the pack's buffers): a_wq/a_wkv [tokens, 4096 | 2048] in [BK, BM]
    tiles (A M-major), a_dec/a_enc the same buffers in [BM, BK] tiles, b_* the B operands in
    [BK, BN] tiles. dec_chunks / enc_chunks: 256-column pack tiles per row of dec / enc (0 when
    no weight gradient is wanted). Tiles: grad_Wq [0, s1), grad_dec [s1, s2), grad_Wkv [s2, s3),
    grad_enc [s3, total). slots: the completion counters, laid out as config.GluonCounters says
    (its runs start at c_gq, c_dec, c_gkv, c_enc; n_counters slots). r_*: the first range slot of
    each region (the plan's Regions.bases). e_*: the ends of the pack list's segments, pack_items
    its length (config.gluon_pack_items). HIDDEN ... KV_ITEMS: the operator's sizes
    (config.size_constexprs). Inside, they travel as argument packs (`Descriptors`, `Inputs`,
    `Operands`, `Outputs`, `Tiles`, `PackList`, `RangeBases`, `Sizes`, `Ring`). Launched with num_warps=4 (the
    first consumer warpgroup) and the pool's maxnreg; the second consumer and the pack partition
    get REGS registers each (config.GluonConfig).
    """
    counters = Counters(slots, c_gq, c_dec, c_gkv, c_enc, n_counters)
    d = Descriptors(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc)
    inp = Inputs(gq, gk, gv, dec, enc, wq, wk, wv)
    ops = Operands(gq16, gkv16, dec16, enc16, wq16, wkv16)
    outs = Outputs(grad_dec, grad_enc, grad_wq, grad_wk, grad_wv)
    rb = RangeBases(ranges, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv)
    pid, programs = gl.program_id(0), gl.num_programs(0)
    t = Tiles(TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, pid, programs)
    lst = PackList(TD, TE, SD, SE, dec_chunks, enc_chunks, e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc,
                   pack_items)
    sz = Sizes(HIDDEN, CROSS, HEADS, GROUP, HEAD_DIM, Q_OUT, KV_OUT, KV_ITEMS)
    BK: gl.constexpr = a_dec.block_type.shape[1]
    BM: gl.constexpr = a_dec.block_type.shape[0]
    BN: gl.constexpr = b_dec.block_type.shape[1]
    a_k = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_dec.layout)
    a_m = a_k._reinterpret(gl.float16, [STAGES, BK, BM], a_wq.layout)  # the same slots, M-major
    b_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BK, BN], b_dec.layout)
    pack_bufs = gl.allocate_shared_memory(gl.float32, [UNITS * UNIT, HEAD_DIM],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    ring = Ring(a_k, a_m, b_bufs, ready, empty)
    gl.warp_specialize([
        (_consumer, (ring, counters, outs, t, lst, sz, BM, BN, BK, STAGES, 0)),
        (_second_consumer, (ring, counters, outs, t, lst, sz, BM, BN, BK, STAGES)),
        (_loader, (d, ring, counters, t, lst, sz, BM, BN, BK, STAGES)),
        (_pack, (pack_bufs, inp, ops, outs, counters, lst, rb, sz, pid, programs)),
    ], [4, 1, PACK_WARPS], [REGS, LOADER_REGS, REGS])


def descriptor_blocks(bm: int, bn: int, bk: int) -> tuple:
    """(argument, fp16 buffer, block) of fused_kernel's eight TMA descriptors, in argument order: the A
    operands of the weight gradients M-major ([bk, bm] tiles of GQ and [GK | GV]), the B operands
    [bk, bn], the A operands of the input gradients K-major ([bm, bk])."""
    return (("a_wq", "gq16", [bk, bm]), ("b_wq", "dec16", [bk, bn]), ("a_dec", "gq16", [bm, bk]),
            ("b_dec", "wq16", [bk, bn]), ("a_wkv", "gkv16", [bk, bm]), ("b_wkv", "enc16", [bk, bn]),
            ("a_enc", "gkv16", [bm, bk]), ("b_enc", "wkv16", [bk, bn]))
