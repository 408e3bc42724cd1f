"""Issue 25's "SM roles instead of warp roles": 072's large cases as two concurrent launches that share
the one-launch kernel's completion counters: a pack kernel on `pack_programs` SMs (the one-launch
kernel's pack partition as a kernel of its own, all its shared memory for copies in flight) and a
product kernel on the other SMs (the one-launch kernel's consumers and loader, without the pack
partition, so its two consumer warpgroups get 240 registers each and 128 x 256 tiles fit). Each
product waits for the pack items it reads through the counters, as in the one-launch kernel.

Against pack + cuBLAS (the plan's path on these cases) and the one-launch kernel, in one call: every
output checked with the official rule (poisoned buffers), then the official-clock time of each.

Why it might win (benchmarks/notes/072.md, "Issue 25, step 1"): the one-launch kernel's products
idle 47 % of its time (tensor pipe 53 % active against cuBLAS's 84-95 %) and read 2.3x cuBLAS's L2
bytes with 128 x 128 tiles; its 16 warps cap the partitions' register pool. Why it might not: the
products already run at the power-limited clock (1.5 GHz), and the pack's DRAM traffic beside them
draws on the same budget. Prediction (written before any run): case 0 (pack + cuBLAS 740 µs) ≈ 650
with 40 pack SMs and 128 x 256 tiles, or the design does not pay.

Deadlock freedom: the product kernel's programs wait on the pack kernel's; the grids together never
exceed the SMs (one program per SM each at most: the product kernel's shared memory admits one per
SM), so every program of both is resident whichever launch the GPU starts first.

`roles_kernel` is the same split in one launch: its first pack_programs programs pack with both
consumer warpgroups (two pack workers per SM, 128 KB of copies in flight, in the products' ring),
the others multiply; one program per SM, every one resident.

    PYTHONPATH=src python3 benchmarks/experiments/sm_roles_072.py [--cases 0,6,7,9] [--pack-programs 24,40,56]
    ... --phases            # also each kernel alone
    ... --one-launch        # roles_kernel instead of the two launches
    ... --two-items         # pack workers with two items in flight (`_pack_two`; prepared in session 20, not run)
    ... --compile-only      # on any machine: every kernel's shared memory, registers, stack, HGMMA

Measured in session 20 (benchmarks/notes/072.md, "Issue 25, step 2"): 0.45-0.86x pack + cuBLAS in
every form.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from backfuse.kernels.gluon.gemm import LOADER_REGS
from backfuse.ops.qkv_gqa import config, gluon_kernels
from backfuse.ops.qkv_gqa.gluon_kernels import Descriptors, Ring, Tiles
from backfuse.ops.qkv_gqa.gluon_pack import (
    HEAD_DIM,
    UNIT,
    UNITS,
    Counters,
    Inputs,
    Operands,
    Outputs,
    PackList,
    RangeBases,
    _fetch_item,
    _finish_item,
    _item,
    _leave,
    _pack,
    _release,
)
from backfuse.ops.qkv_gqa.spec import CROSS_HIDDEN, HIDDEN, KV_OUT, Q_OUT


@gluon.jit
def _pack_two(buf_a, buf_b, inp, ops, outs, counters, lst, rb, first, stride):
    """`_pack` with two items in flight (128 KB of copies): item k + 1's copies fly while item k is
    converted and stored, then item k + 2's are issued into k's slots. Items alternate between the
    two buffers, two per loop step (the commit groups complete in issue order, so waiting until at
    most one group is pending means the older item has landed)."""
    item = first
    m0, src0, dst0, z0, row0, n0, ss0, ds0, s0, h0, slot0, c0 = _item(item, inp, ops, outs, counters, lst, rb)
    _fetch_item(buf_a, m0, src0, row0, n0, ss0, s0, h0)
    m1, src1, dst1, z1, row1, n1, ss1, ds1, s1, h1, slot1, c1 = _item(item + stride, inp, ops, outs, counters, lst,
                                                                         rb)
    _fetch_item(buf_b, m1, src1, row1, n1, ss1, s1, h1)
    while n0 > 0:
        item += 2 * stride
        async_copy.wait_group(1)
        gl.thread_barrier()  # buf_a's item has landed for every thread
        _finish_item(buf_a, m0, dst0, z0, row0, n0, ds0, slot0)
        gl.thread_barrier()
        m2, src2, dst2, z2, row2, n2, ss2, ds2, s2, h2, slot2, c2 = _item(item, inp, ops, outs, counters, lst, rb)
        _fetch_item(buf_a, m2, src2, row2, n2, ss2, s2, h2)
        _release(c0)
        async_copy.wait_group(1)
        gl.thread_barrier()  # buf_b's item has landed
        if n1 > 0:  # an item past the list must not store its (default) range slot
            _finish_item(buf_b, m1, dst1, z1, row1, n1, ds1, slot1)
        gl.thread_barrier()
        m3, src3, dst3, z3, row3, n3, ss3, ds3, s3, h3, slot3, c3 = _item(item + stride, inp, ops, outs, counters,
                                                                             lst, rb)
        _fetch_item(buf_b, m3, src3, row3, n3, ss3, s3, h3)
        if n1 > 0:
            _release(c1)
        m0, src0, dst0, z0, row0, n0, ss0, ds0, s0, h0, slot0, c0 = m2, src2, dst2, z2, row2, n2, ss2, ds2, s2, h2, \
            slot2, c2
        m1, src1, dst1, z1, row1, n1, ss1, ds1, s1, h1, slot1, c1 = m3, src3, dst3, z3, row3, n3, ss3, ds3, s3, h3, \
            slot3, c3
    async_copy.wait_group(0)
    _leave(counters)


@gluon.jit(do_not_specialize=["TD", "TE", "SD", "SE", "dec_chunks", "enc_chunks", "split_wq", "split_wkv", "split_dec",
                               "split_enc", "s1", "s2", "s3", "total", "c_gq", "c_dec", "c_gkv", "c_enc",
                               "no_slots", "r_gq", "r_gk", "r_gv", "r_dec", "r_enc", "r_wq", "r_wk", "r_wv",
                               "e_zwq", "e_zwkv", "e_zdec", "e_zenc", "e_dec", "e_wq", "e_enc", "pack_items"])
def pack_only_kernel(gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
                     grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots, ranges,
                     TD, TE, SD, SE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
                     c_gq, c_dec, c_gkv, c_enc, no_slots, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv,
                     e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc, pack_items, TWO: gl.constexpr):
    """The one-launch kernel's pack partition over this grid's programs (TWO: `_pack_two`, two
    items in flight). Its counters' slot count is given as no_slots = 0, so that its partitions
    counting out (`_leave`) zero nothing: the product kernel's programs may still be waiting on them;
    the caller zeroes the counters before each call."""
    bufs = gl.allocate_shared_memory(gl.float32, [(1 + TWO) * UNITS * UNIT, HEAD_DIM], PACK_SMEM)
    counters = Counters(slots, c_gq, c_dec, c_gkv, c_enc, no_slots)
    inp = Inputs(gq, gk, gv, dec, enc, wq, wk, wv)
    ops = Operands(gq16, gkv16, dec16, enc16, wq16, wkv16)
    outs = Outputs(grad_dec, grad_enc, grad_wq, grad_wk, grad_wv)
    lst = PackList(TD, TE, SD, SE, dec_chunks, enc_chunks, e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc,
                   pack_items)
    rb = RangeBases(ranges, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv)
    if TWO:
        _pack_two(bufs.slice(0, UNITS * UNIT), bufs.slice(UNITS * UNIT, UNITS * UNIT), inp, ops, outs, counters, lst,
                  rb, gl.program_id(0), gl.num_programs(0))
    else:
        _pack(bufs, inp, ops, outs, counters, lst, rb, gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _ring(a_dec, a_wq, b_dec, STAGES: gl.constexpr):
    """The one-launch kernel's ring (gluon_kernels.Ring), allocated and its mbarriers initialised."""
    BK: gl.constexpr = a_dec.block_type.shape[1]
    BM: gl.constexpr = a_dec.block_type.shape[0]
    BN: gl.constexpr = b_dec.block_type.shape[1]
    a_k = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_dec.layout)
    a_m = a_k._reinterpret(gl.float16, [STAGES, BK, BM], a_wq.layout)
    b_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BK, BN], b_dec.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return Ring(a_k, a_m, b_bufs, ready, empty)


@gluon.jit(do_not_specialize=["TD", "TE", "SD", "SE", "dec_chunks", "enc_chunks", "split_wq", "split_wkv", "split_dec",
                               "split_enc", "s1", "s2", "s3", "total", "c_gq", "c_dec", "c_gkv", "c_enc", "no_slots", "e_zwq",
                               "e_zwkv", "e_zdec", "e_zenc", "e_dec", "e_wq", "e_enc", "pack_items"])
def products_only_kernel(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc,
                         grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots,
                         TD, TE, SD, SE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3,
                         total, c_gq, c_dec, c_gkv, c_enc, no_slots, e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc,
                         pack_items, STAGES: gl.constexpr):
    """The one-launch kernel's two consumers and loader over this grid's programs (no pack
    partition); counters as for pack_only_kernel (no_slots = 0: nothing is zeroed at the end)."""
    BK: gl.constexpr = a_dec.block_type.shape[1]
    BM: gl.constexpr = a_dec.block_type.shape[0]
    BN: gl.constexpr = b_dec.block_type.shape[1]
    counters = Counters(slots, c_gq, c_dec, c_gkv, c_enc, no_slots)
    d = Descriptors(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc)
    outs = Outputs(grad_dec, grad_enc, grad_wq, grad_wk, grad_wv)
    t = Tiles(TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, gl.program_id(0),
              gl.num_programs(0))
    lst = PackList(TD, TE, SD, SE, dec_chunks, enc_chunks, e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc,
                   pack_items)
    ring = _ring(a_dec, a_wq, b_dec, STAGES)
    gl.warp_specialize([
        (gluon_kernels._consumer, (ring, counters, outs, t, lst, BM, BN, BK, STAGES, 0)),
        (gluon_kernels._second_consumer, (ring, counters, outs, t, lst, BM, BN, BK, STAGES)),
        (gluon_kernels._loader, (d, ring, counters, t, lst, BM, BN, BK, STAGES)),
    ], [4, 1], [240, LOADER_REGS])


PACK_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))


@gluon.jit
def _product_share(t, pack_sms):
    """Tiles `t` as the product programs' share: program pid takes tiles pid - pack_sms, + stride..."""
    return Tiles(t.TD, t.TE, t.split_wq, t.split_wkv, t.split_dec, t.split_enc, t.s1, t.s2, t.s3, t.total,
                 gl.program_id(0) - pack_sms, gl.num_programs(0) - pack_sms)


@gluon.jit
def _role_worker(ring, counters, inp, ops, outs, t, lst, rb, pack_sms, BM: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr, TWO: gl.constexpr):
    """A consumer warpgroup of roles_kernel: on the first pack_sms programs it packs (pack worker
    2 * pid + PART of 2 * pack_sms, its 64 KB of copies in flight in the products' ring: A's slots for
    PART 0, the first half of B's for PART 1; TWO: PART 0 keeps two items in flight, in A's slots and
    the first half of B's, PART 1 one in the second half), on the others it is the one-launch
    kernel's consumer."""
    pid = gl.program_id(0)
    if pid < pack_sms:
        if TWO:
            halves = ring.b._reinterpret(gl.float32, [2 * UNITS * UNIT, HEAD_DIM], PACK_SMEM)
            if PART == 0:
                _pack_two(ring.a_k._reinterpret(gl.float32, [UNITS * UNIT, HEAD_DIM], PACK_SMEM),
                          halves.slice(0, UNITS * UNIT), inp, ops, outs, counters, lst, rb, 2 * pid, 2 * pack_sms)
            else:
                _pack(halves.slice(UNITS * UNIT, UNITS * UNIT), inp, ops, outs, counters, lst, rb, 2 * pid + 1,
                      2 * pack_sms)
        else:
            if PART == 0:
                bufs = ring.a_k._reinterpret(gl.float32, [UNITS * UNIT, HEAD_DIM], PACK_SMEM)
            else:
                bufs = ring.b._reinterpret(gl.float32, [2 * UNITS * UNIT, HEAD_DIM], PACK_SMEM).slice(0, UNITS * UNIT)
            _pack(bufs, inp, ops, outs, counters, lst, rb, 2 * pid + PART, 2 * pack_sms)
    else:
        gluon_kernels._consumer(ring, counters, outs, _product_share(t, pack_sms), lst, BM, BN, BK, STAGES, PART)


@gluon.jit
def _role_second_worker(ring, counters, inp, ops, outs, t, lst, rb, pack_sms, BM: gl.constexpr, BN: gl.constexpr,
                        BK: gl.constexpr, STAGES: gl.constexpr, TWO: gl.constexpr):
    _role_worker(ring, counters, inp, ops, outs, t, lst, rb, pack_sms, BM, BN, BK, STAGES, 1, TWO)


@gluon.jit
def _role_loader(d, ring, counters, t, lst, pack_sms, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr):
    if gl.program_id(0) < pack_sms:
        _leave(counters)
    else:
        gluon_kernels._loader(d, ring, counters, _product_share(t, pack_sms), lst, BM, BN, BK, STAGES)


@gluon.jit(do_not_specialize=["TD", "TE", "SD", "SE", "dec_chunks", "enc_chunks", "split_wq", "split_wkv", "split_dec",
                               "split_enc", "s1", "s2", "s3", "total", "c_gq", "c_dec", "c_gkv", "c_enc", "no_slots",
                               "r_gq", "r_gk", "r_gv", "r_dec", "r_enc", "r_wq", "r_wk", "r_wv", "pack_sms",
                               "e_zwq", "e_zwkv", "e_zdec", "e_zenc", "e_dec", "e_wq", "e_enc", "pack_items"])
def roles_kernel(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc,
                 gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
                 grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots, ranges,
                 TD, TE, SD, SE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
                 c_gq, c_dec, c_gkv, c_enc, no_slots, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv, pack_sms,
                 e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc, pack_items, STAGES: gl.constexpr,
                 TWO: gl.constexpr):
    """SM roles in one launch (one program per SM): the first pack_sms programs pack with both
    consumer warpgroups (two pack workers, 128 KB of copies in flight per SM), the others run the
    products with 128 x 256 tiles; counters as for pack_only_kernel (the caller zeroes them)."""
    BK: gl.constexpr = a_dec.block_type.shape[1]
    BM: gl.constexpr = a_dec.block_type.shape[0]
    BN: gl.constexpr = b_dec.block_type.shape[1]
    counters = Counters(slots, c_gq, c_dec, c_gkv, c_enc, no_slots)
    d = Descriptors(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc)
    inp = Inputs(gq, gk, gv, dec, enc, wq, wk, wv)
    ops = Operands(gq16, gkv16, dec16, enc16, wq16, wkv16)
    outs = Outputs(grad_dec, grad_enc, grad_wq, grad_wk, grad_wv)
    rb = RangeBases(ranges, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv)
    t = Tiles(TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, gl.program_id(0), gl.num_programs(0))
    lst = PackList(TD, TE, SD, SE, dec_chunks, enc_chunks, e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc,
                   pack_items)
    ring = _ring(a_dec, a_wq, b_dec, STAGES)
    gl.warp_specialize([
        (_role_worker, (ring, counters, inp, ops, outs, t, lst, rb, pack_sms, BM, BN, BK, STAGES, 0, TWO)),
        (_role_second_worker, (ring, counters, inp, ops, outs, t, lst, rb, pack_sms, BM, BN, BK, STAGES, TWO)),
        (_role_loader, (d, ring, counters, t, lst, pack_sms, BM, BN, BK, STAGES)),
    ], [4, 1], [240, LOADER_REGS])


TILES = {"128x128": config.GluonConfig(bn=128, stages=4), "128x256": config.GluonConfig(bn=256, stages=4)}


def _descriptor(t, block):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.float16))


def sm_roles(inputs, g: config.GluonConfig, pack_programs: int, sms: int, one_launch: bool = False,
             two_items: bool = False):
    """A function that runs one 072 call (counters zeroed first), and its outputs: the two kernels on
    two streams at once, pack_programs programs of the pack; or (one_launch) roles_kernel, whose first
    pack_programs programs pack. two_items: pack workers keep two items in flight (`_pack_two`; in
    roles_kernel the first consumer's worker)."""
    gq, gk, gv, dec, enc, wq, wk, wv = inputs
    batch, _, sd, _ = gq.shape
    se = gk.shape[2]
    td, te = batch * sd, batch * se
    axes = dict(batch_size=batch, seq_len_dec=sd, seq_len_enc=se)
    splits = config.choose_splits(config.product_shapes(axes), g.bm, g.bn, g.bk, sms - pack_programs)
    launch = config.gluon_launch(g, axes, splits, (True,) * 5)
    f16 = lambda *shape: torch.empty(*shape, dtype=torch.float16, device="cuda")  # noqa: E731
    f32 = lambda *shape: torch.empty(*shape, dtype=torch.float32, device="cuda")  # noqa: E731
    gq16, gkv16, dec16, enc16 = f16(td, Q_OUT), f16(te, 2 * KV_OUT), f16(td, HIDDEN), f16(te, CROSS_HIDDEN)
    wq16, wkv16 = f16(Q_OUT, HIDDEN), f16(2 * KV_OUT, CROSS_HIDDEN)
    grad_dec, grad_enc = f32(batch, sd, HIDDEN), f32(batch, se, CROSS_HIDDEN)
    grad_wq, grad_wk, grad_wv = f32(Q_OUT, HIDDEN), f32(KV_OUT, CROSS_HIDDEN), f32(KV_OUT, CROSS_HIDDEN)
    c = launch.counters
    slots = torch.zeros(c.total, dtype=torch.int32, device="cuda")
    ranges = f32(sum(n for _, n in launch.regions.counts))
    operands = dict(gq16=gq16, gkv16=gkv16, dec16=dec16, enc16=enc16, wq16=wq16, wkv16=wkv16)
    descriptors = [_descriptor(operands[buffer], block)
                   for _, buffer, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)]
    ints = (td, te, launch.dec_chunks, launch.enc_chunks, *splits, *launch.starts, launch.tiles)
    pack_list = (*launch.items.ends[:-1], launch.items.programs)  # the plan's pack item list (its segment ends)
    pack_stream, product_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def pack(programs=pack_programs):
        pack_only_kernel[(programs,)](
            gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
            grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots, ranges, td, te, sd, se, *ints[2:],
            c.gq, c.dec, c.gkv, c.enc, 0, *launch.regions.bases, *pack_list, TWO=two_items, num_warps=4)

    def products(programs=sms - pack_programs):
        products_only_kernel[(programs,)](
            *descriptors, grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots, td, te, sd, se, *ints[2:], c.gq, c.dec,
            c.gkv, c.enc, 0, *pack_list, STAGES=g.stages, num_warps=4)

    def roles():
        slots.zero_()
        roles_kernel[(sms,)](
            *descriptors, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
            grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, slots, ranges, td, te, sd, se, *ints[2:],
            c.gq, c.dec, c.gkv, c.enc, 0, *launch.regions.bases, pack_programs, *pack_list, STAGES=g.stages,
            TWO=two_items, num_warps=4)

    def run():
        if one_launch:
            return roles()
        slots.zero_()
        start = torch.cuda.Event()
        start.record()
        for stream in (pack_stream, product_stream):
            stream.wait_event(start)
        with torch.cuda.stream(product_stream):
            products()
        with torch.cuda.stream(pack_stream):
            pack()
        for stream in (pack_stream, product_stream):
            torch.cuda.current_stream().wait_stream(stream)

    def phases(pack_grid, product_grid, reps=7):
        """Median µs of the pack kernel alone on pack_grid programs, then of the product kernel alone
        on product_grid programs (every counter already met), one after the other on one stream."""
        times = []
        for _ in range(reps):
            slots.zero_()
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            pack(pack_grid)
            e[1].record()
            products(product_grid)
            e[2].record()
            torch.cuda.synchronize()
            times.append((e[0].elapsed_time(e[1]) * 1e3, e[1].elapsed_time(e[2]) * 1e3))
        return tuple(sorted(t[i] for t in times)[reps // 2] for i in range(2))

    return run, phases, (grad_dec, grad_enc, grad_wq, grad_wk, grad_wv)


def _compile_only():
    from backfuse.kernels.gluon.sm90 import compile_sm90, descriptor_type, usage

    def ints_and_pointers(fn, sig):
        for p in fn.params:
            if p.name not in sig and not p.is_constexpr:
                sig[p.name] = "i32" if p.do_not_specialize else \
                    "*fp16" if p.name.endswith("16") else "*i32" if p.name == "slots" else "*fp32"
        return sig

    for two in (False, True):
        kernel = compile_sm90(pack_only_kernel, ints_and_pointers(pack_only_kernel, {}), {"TWO": two}, num_warps=4)
        print(f"pack only{', two items in flight' if two else ''}", usage(kernel), flush=True)
    for name, g in TILES.items():
        sig = {n: descriptor_type(gl.float16, block) for n, _, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)}
        kernel = compile_sm90(products_only_kernel, ints_and_pointers(products_only_kernel, sig),
                              {"STAGES": g.stages}, num_warps=4)
        print(f"products only {name}", usage(kernel), flush=True)
    g = TILES["128x256"]
    sig = {n: descriptor_type(gl.float16, block) for n, _, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)}
    for two in (False, True):
        kernel = compile_sm90(roles_kernel, ints_and_pointers(roles_kernel, sig), {"STAGES": g.stages, "TWO": two},
                              num_warps=4)
        print(f"roles in one launch 128x256{', two items in flight' if two else ''}", usage(kernel), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="0,6,7,9")
    ap.add_argument("--pack-programs", default="24,40,56")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--one-launch", action="store_true",
                    help="roles_kernel instead: SM roles in one launch, 128 x 256 tiles, the pack on --pack-programs SMs")
    ap.add_argument("--two-items", action="store_true", help="pack workers keep two items in flight (_pack_two)")
    ap.add_argument("--phases", action="store_true",
                    help="also time each kernel alone: the pack on 1/3, 2/3 and all of the SMs, the products after it")
    args = ap.parse_args()
    if args.compile_only:
        return _compile_only()
    import backfuse
    from backfuse.bench.check import check_outputs
    from backfuse.bench.timing import time_calls

    op = backfuse.problem("072")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for index in (int(c) for c in args.cases.split(",")):
        w = op.workloads[index]
        inputs = op.make_inputs(w.axes, seed=index, device="cuda")
        ref = op.reference(*inputs)
        cublas = time_calls(lambda *x: op.fused(*x, products="cublas"), inputs).median_ms * 1e3
        one = time_calls(lambda *x: op.fused(*x, products="gluon"), inputs).median_ms * 1e3
        print(f"case {index} {w.axes}: pack + cuBLAS {cublas:.1f} us, one launch {one:.1f} us", flush=True)
        if args.one_launch:
            for pack_programs in (int(p) for p in args.pack_programs.split(",")):
                run, _, outs = sm_roles(inputs, TILES["128x256"], pack_programs, sms, one_launch=True,
                                        two_items=args.two_items)
                run()
                torch.cuda.synchronize()
                v = check_outputs(outs, ref, w.tolerance, op.output_names)
                t = time_calls(lambda *x, run=run: run(), inputs).median_ms * 1e3
                print(f"  SM roles in one launch 128x256, {pack_programs:3d} pack SMs: {t:7.1f} us "
                      f"({cublas / t:.2f}x pack + cuBLAS) {'passed' if v.passed else 'FAILED ' + v.reason}", flush=True)
            continue
        for name, g in TILES.items():
            for pack_programs in (int(p) for p in args.pack_programs.split(",")):
                run, phases, outs = sm_roles(inputs, dataclasses.replace(g), pack_programs, sms, two_items=args.two_items)
                run()
                torch.cuda.synchronize()
                v = check_outputs(outs, ref, w.tolerance, op.output_names)
                t = time_calls(lambda *x, run=run: run(), inputs).median_ms * 1e3
                print(f"  SM roles {name}, {pack_programs:3d} pack SMs: {t:7.1f} us ({cublas / t:.2f}x pack + cuBLAS) "
                      f"{'passed' if v.passed else 'FAILED ' + v.reason}", flush=True)
                if args.phases:
                    for grid in (pack_programs, sms):
                        p_us, m_us = phases(grid, sms - pack_programs)
                        print(f"    alone: pack on {grid:3d} programs {p_us:7.1f} us; then products on "
                              f"{sms - pack_programs} {m_us:7.1f} us", flush=True)
                    if pack_programs == int(args.pack_programs.split(",")[-1]):
                        p_us, m_us = phases(sms, sms)
                        print(f"    alone: products on all {sms} SMs {m_us:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
