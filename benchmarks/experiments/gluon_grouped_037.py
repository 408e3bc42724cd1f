"""Issue 23's gate for 037's products on the Gluon engine: one persistent launch doing the three
gradient products of 037's cuBLAS path, against those three cuBLAS launches.

    PYTHONPATH=src python benchmarks/experiments/gluon_grouped_037.py --cases 14,15,3,6,12,10
    PYTHONPATH=src python benchmarks/experiments/gluon_grouped_037.py --compile-only   # any machine

The products, with T tokens and every operand fp16 (the pack's and the attention's buffers):
grad_hidden [T, 3072] = G [T, 5120] @ [Wq; Wk; Wv] [5120, 3072] (A K-major), grad_[Wq; Wk; Wv]
[5120, 3072] = G^T @ X [T, 3072] and grad_Wo [3072, 3072] = grad_output^T @ A [T, 3072] (A M-major:
read from the token-major buffers as [BK, BM] tiles), fp32 sums and outputs, K split into outputs
zeroed first where `schedule.choose_splits` splits. Tiles [grad_hidden | grad_[Wq; Wk; Wv] | grad_Wo]
are walked by persistent programs (program p takes tiles p, p + P, ...), each a loader warp and two
consumer warpgroups sharing one ring, the A slots viewed K-major or M-major per product (as 072's
one-launch kernel does). Built from the engine's parts (`kernels/gluon/gemm.py`).

Why: on 037's cuBLAS path (1024 tokens and more: 12 of 16 cases) the call makes 11 launches, and at
1024 tokens its span follows the host (runs.md 037-s21-backend: 356-512 µs for one case between two
rounds; our 5-launch path stays within 0.1 %). One launch instead of three cuBLAS products is two
launches fewer; the forward's three would be the next two. It pays only if the grouped launch's GPU
time is at most cuBLAS's (which runs each product with its own tile shape).

Prediction (written before any run): the engine measured 92-98 % of cuBLAS on single fp16 products
(notes/gluon.md) and 072's four products at 128 x 256 within 5-8 % of cuBLAS's (072.md, issue 25
step 2); grouped, with no launch gaps and the tail of one product filled by the next: kernel time
within ±5 % of the three cuBLAS kernels' sum at 1024-4096 tokens (≈ 70-280 µs), 128 x 256 tiles
ahead of 128 x 128. The split outputs' zero fill comes from the pack in the library (here a memset,
timed apart).

Measured (runs.md grouped-037, notes/037.md "The gate for 037's products on the Gluon engine"): 22-28 %
slower than cuBLAS's three kernels at every size (1024 tokens: 175 against 137 µs): gate failed.

Then (session 22) two epilogue forms. "tma": each consumer stages its [BM / 2, BN] fp32 rows in a
shared buffer of its own and sends them by an asynchronous TMA store, waited for only before that
buffer is written again (split tiles still add by atomics); predicted 128 x 128 189 -> ≈ 150 µs at
1024 tokens, measured 178.7 (-5 %). "pingpong": each consumer takes whole tiles, alternate ones, and
an mbarrier per consumer orders the mainloops so one epilogue runs under the other mainloop;
predicted at least the TMA-store gain, measured 24-30 % slower than cooperative (runs.md
grouped-037-s22, notes/037.md).

Prints, per case and tile shape: largest relative difference to torch.mm, cuBLAS's three kernels'
summed device time, the grouped kernel's, and each path's span on the official clock.
"""

# No `from __future__ import annotations`: the aggregates' field annotations must be types.
import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

from backfuse.kernels.gluon.gemm import CONSUMER_REGS, LOADER_REGS, consume_tile, emit_tile, issue_step, tile_coords
from backfuse.kernels.schedule import choose_splits, tile_count
from backfuse.ops.gemma3_core import spec
from backfuse.ops.gemma3_core.config import gradient_shapes

HIDDEN = gl.constexpr(spec.HIDDEN)
Q_OUT = gl.constexpr(spec.Q_OUT)
QKV = gl.constexpr(spec.QKV)
# name: (bm, bn, bk, stages, epilogue): "ptr" pointer stores, "tma" staged TMA stores (both
# consumers on one tile, BM / 2 rows each), "pingpong" each consumer whole tiles of its own
EPILOGUES = ("ptr", "tma", "pingpong")
TILES = {"128x256x64 s3": (128, 256, 64, 3, "ptr"), "128x128x64 s4": (128, 128, 64, 4, "ptr"),
         "128x128x64 s4 tma-store": (128, 128, 64, 4, "tma"),
         "128x128x64 s4 pingpong": (128, 128, 64, 4, "pingpong"),
         "128x128x64 s6 pingpong": (128, 128, 64, 6, "pingpong"),
         "128x128x32 s8 pingpong": (128, 128, 32, 8, "pingpong")}


@aggregate
class Group:
    """The tiles [grad_hidden | grad_[Wq; Wk; Wv] | grad_Wo] (starts 0, s1, s2; `total` in all), the
    token count and each product's K splits; a partition takes tiles first, first + stride, ..."""

    T: gl.tensor
    split_gx: gl.tensor
    split_wqkv: gl.tensor
    split_wo: gl.tensor
    s1: gl.tensor
    s2: gl.tensor
    total: gl.tensor
    first: gl.tensor
    stride: gl.tensor

    @gluon.constexpr_function
    def __init__(self, T, split_gx, split_wqkv, split_wo, s1, s2, total, first, stride):
        self.T, self.split_gx, self.split_wqkv, self.split_wo = T, split_gx, split_wqkv, split_wo
        self.s1, self.s2, self.total, self.first, self.stride = s1, s2, total, first, stride


@aggregate
class Descriptors:
    """Each product's A and B: G K-major, [Wq; Wk; Wv], G M-major, X, grad_output M-major, A."""

    a_gx: tma.tensor_descriptor
    b_gx: tma.tensor_descriptor
    a_wqkv: tma.tensor_descriptor
    b_wqkv: tma.tensor_descriptor
    a_wo: tma.tensor_descriptor
    b_wo: tma.tensor_descriptor

    @gluon.constexpr_function
    def __init__(self, a_gx, b_gx, a_wqkv, b_wqkv, a_wo, b_wo):
        self.a_gx, self.b_gx, self.a_wqkv, self.b_wqkv, self.a_wo, self.b_wo = a_gx, b_gx, a_wqkv, b_wqkv, a_wo, b_wo


@aggregate
class Ring:
    """A's slots K-major (a_k) and the same slots M-major (a_m), B's slots, `ready` and `empty`;
    for ping-pong, `turn`: one mbarrier per consumer, arrived on at the end of each of its mainloops."""

    a_k: gl.shared_memory_descriptor
    a_m: gl.shared_memory_descriptor
    b: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, a_k, a_m, b, ready, empty, turn):
        self.a_k, self.a_m, self.b, self.ready, self.empty, self.turn = a_k, a_m, b, ready, empty, turn


@aggregate
class Outputs:
    """The three fp32 outputs, and for the TMA-store epilogue their descriptors ([BM / 2, BN] blocks)."""

    grad_x: gl.tensor
    grad_wqkv: gl.tensor
    grad_wo: gl.tensor
    d_x: tma.tensor_descriptor
    d_wqkv: tma.tensor_descriptor
    d_wo: tma.tensor_descriptor

    @gluon.constexpr_function
    def __init__(self, grad_x, grad_wqkv, grad_wo, d_x, d_wqkv, d_wo):
        self.grad_x, self.grad_wqkv, self.grad_wo = grad_x, grad_wqkv, grad_wo
        self.d_x, self.d_wqkv, self.d_wo = d_x, d_wqkv, d_wo


@gluon.jit
def _coords(tile, g, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(product, off_m, off_n, k_lo, k_hi) of tile `tile` of the group."""
    if tile < g.s1:
        off_m, off_n, k_lo, k_hi = tile_coords(tile, gl.cdiv(g.T, BM), HIDDEN // BN, QKV, g.split_gx, BM, BN, BK)
        p = 0
    elif tile < g.s2:
        off_m, off_n, k_lo, k_hi = tile_coords(tile - g.s1, QKV // BM, HIDDEN // BN, g.T, g.split_wqkv, BM, BN, BK)
        p = 1
    else:
        off_m, off_n, k_lo, k_hi = tile_coords(tile - g.s2, HIDDEN // BM, Q_OUT // BN, g.T, g.split_wo, BM, BN, BK)
        p = 2
    return p, off_m, off_n, k_lo, k_hi


@gluon.jit
def _loader(d, ring, g, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    it = 0
    for tile in range(g.first, g.total, g.stride):
        p, off_m, off_n, k_lo, k_hi = _coords(tile, g, BM, BN, BK)
        for k in range(k_lo, k_hi, BK):
            if p == 0:
                issue_step(d.a_gx, d.b_gx, ring.a_k, ring.b, ring.ready, ring.empty, it, off_m, k, k, off_n, STAGES)
            elif p == 1:
                issue_step(d.a_wqkv, d.b_wqkv, ring.a_m, ring.b, ring.ready, ring.empty, it, k, off_m, k, off_n, STAGES)
            else:
                issue_step(d.a_wo, d.b_wo, ring.a_m, ring.b, ring.ready, ring.empty, it, k, off_m, k, off_n, STAGES)
            it += 1


@gluon.jit
def _turn_over(ring, PART: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(ring.turn.index(PART))


@gluon.jit
def _consumer(ring, outs, cbufs, g, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              EPILOGUE: gl.constexpr, PART: gl.constexpr):
    """Cooperative ("ptr", "tma"): rows [PART * BM/2, +BM/2) of every tile of the partition.
    Ping-pong: all BM rows of the partition's tiles 2j + PART. Consumer PART starts the mainloop
    of tile j only once the other consumer's mainloop of tile j - 1 is over (`ring.turn`), so the
    mainloops alternate and one consumer's epilogue runs under the other's mainloop (this order
    also keeps each ring wait within one phase of its slot's barrier); the other consumer's ring
    steps are skipped in the count. Split tiles add into zeroed outputs."""
    PINGPONG: gl.constexpr = EPILOGUE == "pingpong"
    ROWS: gl.constexpr = BM if PINGPONG else BM // 2
    ROW0: gl.constexpr = 0 if PINGPONG else PART * ROWS
    cbuf = cbufs.index(PART)
    it = 0
    j = 0  # the partition's tile count so far
    for tile in range(g.first, g.total, g.stride):
        p, off_m, off_n, k_lo, k_hi = _coords(tile, g, BM, BN, BK)
        steps = gl.cdiv(k_hi - k_lo, BK)
        if (not PINGPONG) or (j % 2 == PART):
            if PINGPONG:
                # the other consumer's ((j - 1) // 2)-th mainloop (none before tile 0)
                mbarrier.wait(ring.turn.index(1 - PART), ((j - 1) // 2) & 1, pred=j > 0)
            if p == 0:
                acc, it = consume_tile(ring.a_k, ring.b, ring.ready, ring.empty, it, steps, True, False, False, ROW0,
                                       ROWS, BN, STAGES, 4)
                _turn_over(ring, PART, PINGPONG)
                emit_tile(acc, outs.grad_x, HIDDEN, outs.d_x, cbuf, off_m + ROW0, off_n, g.T, HIDDEN, g.split_gx > 1,
                      EPILOGUE == "tma")
            elif p == 1:
                acc, it = consume_tile(ring.a_m, ring.b, ring.ready, ring.empty, it, steps, False, False, False, ROW0,
                                       ROWS, BN, STAGES, 4)
                _turn_over(ring, PART, PINGPONG)
                emit_tile(acc, outs.grad_wqkv, HIDDEN, outs.d_wqkv, cbuf, off_m + ROW0, off_n, QKV, HIDDEN,
                      g.split_wqkv > 1, EPILOGUE == "tma")
            else:
                acc, it = consume_tile(ring.a_m, ring.b, ring.ready, ring.empty, it, steps, False, False, False, ROW0,
                                       ROWS, BN, STAGES, 4)
                _turn_over(ring, PART, PINGPONG)
                emit_tile(acc, outs.grad_wo, Q_OUT, outs.d_wo, cbuf, off_m + ROW0, off_n, HIDDEN, Q_OUT, g.split_wo > 1,
                      EPILOGUE == "tma")
        else:
            it += steps  # the other consumer's tile: its ring steps
        j += 1
    if EPILOGUE == "tma":
        tma.store_wait(0)


@gluon.jit
def _second_consumer(ring, outs, cbufs, g, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, EPILOGUE: gl.constexpr):
    _consumer(ring, outs, cbufs, g, BM, BN, BK, STAGES, EPILOGUE, 1)


@gluon.jit(do_not_specialize=["T", "split_gx", "split_wqkv", "split_wo", "s1", "s2", "total"])
def grouped_kernel(a_gx, b_gx, a_wqkv, b_wqkv, a_wo, b_wo, grad_x, grad_wqkv, grad_wo, d_x, d_wqkv, d_wo,
                   T, split_gx, split_wqkv, split_wo, s1, s2, total, STAGES: gl.constexpr, EPILOGUE: gl.constexpr):
    """The three gradient products of 037 (module docstring), persistent: grid <= total tiles,
    num_warps=4 (the first consumer warpgroup). d_*: the outputs' descriptors ([BM / 2, BN] fp32
    blocks), read by the "tma" epilogue only. EPILOGUE: one of EPILOGUES."""
    TMA_STORE: gl.constexpr = EPILOGUE == "tma"
    BM: gl.constexpr = a_gx.block_type.shape[0]
    BK: gl.constexpr = a_gx.block_type.shape[1]
    BN: gl.constexpr = b_gx.block_type.shape[1]
    a_k = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_gx.layout)
    a_m = a_k._reinterpret(gl.float16, [STAGES, BK, BM], a_wqkv.layout)  # the same slots, M-major
    b = gl.allocate_shared_memory(gl.float16, [STAGES, BK, BN], b_gx.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if EPILOGUE == "pingpong" else 2)
    # one staging buffer per consumer for the TMA-store epilogue (a single fp32 element without it)
    cbufs = gl.allocate_shared_memory(gl.float32, [2, BM // 2, BN] if TMA_STORE else [2, 1, 1],
                                      d_x.layout if TMA_STORE else gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    ring = Ring(a_k, a_m, b, ready, empty, turn)
    d = Descriptors(a_gx, b_gx, a_wqkv, b_wqkv, a_wo, b_wo)
    outs = Outputs(grad_x, grad_wqkv, grad_wo, d_x, d_wqkv, d_wo)
    g = Group(T, split_gx, split_wqkv, split_wo, s1, s2, total, gl.program_id(0), gl.num_programs(0))
    gl.warp_specialize([
        (_consumer, (ring, outs, cbufs, g, BM, BN, BK, STAGES, EPILOGUE, 0)),
        (_second_consumer, (ring, outs, cbufs, g, BM, BN, BK, STAGES, EPILOGUE)),
        (_loader, (d, ring, g, BM, BN, BK, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def blocks(bm, bn, bk):
    """(argument, block) of the six operand descriptors (fp16), in argument order."""
    return (("a_gx", [bm, bk]), ("b_gx", [bk, bn]), ("a_wqkv", [bk, bm]), ("b_wqkv", [bk, bn]), ("a_wo", [bk, bm]),
            ("b_wo", [bk, bn]))


OUTPUT_DESCRIPTORS = ("d_x", "d_wqkv", "d_wo")  # fp32, [bm / 2, bn] blocks


def grouped(g16, wqkv16, x16, go16, attn16, tiles, sms):
    """(run, outputs): run() makes the three products with one grouped launch (after zeroing the
    outputs that K splits add into)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bm, bn, bk, stages, epilogue = tiles
    t = g16.shape[0]
    splits = choose_splits(gradient_shapes(t), bm, bn, bk, sms)
    counts = [tile_count(m, n, s, bm, bn) for (m, n, _), s in zip(gradient_shapes(t), splits)]
    outs = [torch.empty(t, spec.HIDDEN, device="cuda"), torch.empty(spec.QKV, spec.HIDDEN, device="cuda"),
            torch.empty(spec.HIDDEN, spec.Q_OUT, device="cuda")]
    buffers = {"a_gx": g16, "b_gx": wqkv16, "a_wqkv": g16, "b_wqkv": x16, "a_wo": go16, "b_wo": attn16}
    descs = [TensorDescriptor.from_tensor(buffers[name], block,
                                          gl.NVMMASharedLayout.get_default_for(block, gl.float16))
             for name, block in blocks(bm, bn, bk)]
    out_block = [bm // 2, bn]
    out_descs = [TensorDescriptor.from_tensor(o, out_block, gl.NVMMASharedLayout.get_default_for(out_block, gl.float32))
                 for o in outs]
    total = sum(counts)

    def run():
        for out, s in zip(outs, splits):
            if s > 1:
                out.zero_()
        grouped_kernel[(min(total, sms),)](*descs, *outs, *out_descs, t, *splits, counts[0], counts[0] + counts[1],
                                            total, STAGES=stages, EPILOGUE=epilogue, num_warps=4)

    return run, outs, splits


def _compile_only():
    from backfuse.kernels.gluon.sm90 import compile_sm90, descriptor_type, usage

    for name, (bm, bn, bk, stages, epilogue) in TILES.items():
        sig = {n: descriptor_type(gl.float16, block) for n, block in blocks(bm, bn, bk)}
        sig |= {n: descriptor_type(gl.float32, [bm // 2, bn]) for n in OUTPUT_DESCRIPTORS}
        sig |= {p.name: "i32" if p.do_not_specialize else "*fp32" for p in grouped_kernel.params
                if p.name not in sig and not p.is_constexpr}
        kernel = compile_sm90(grouped_kernel, sig, {"STAGES": stages, "EPILOGUE": epilogue}, num_warps=4)
        print(f"grouped 037 gradient products {name}", usage(kernel), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="14,15,3,6,12,10")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        return _compile_only()
    import backfuse
    from backfuse.bench.timing import time_calls

    op = backfuse.problem("037")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for index in (int(c) for c in args.cases.split(",")):
        axes = op.workloads[index].axes
        t = axes["batch_size"] * axes["seq_len"]
        gen = torch.Generator(device="cuda").manual_seed(index)

        def rand(*shape):
            return (torch.randn(*shape, device="cuda", generator=gen) * 0.1).half()

        g16, wqkv16, x16, go16, attn16 = rand(t, spec.QKV), rand(spec.QKV, spec.HIDDEN), rand(t, spec.HIDDEN), \
            rand(t, spec.HIDDEN), rand(t, spec.Q_OUT)
        ref = [torch.empty(t, spec.HIDDEN, device="cuda"), torch.empty(spec.QKV, spec.HIDDEN, device="cuda"),
               torch.empty(spec.HIDDEN, spec.Q_OUT, device="cuda")]

        def cublas(*_):
            torch.mm(g16, wqkv16, out_dtype=torch.float32, out=ref[0])
            torch.mm(g16.T, x16, out_dtype=torch.float32, out=ref[1])
            torch.mm(go16.T, attn16, out_dtype=torch.float32, out=ref[2])

        cublas()
        tc = time_calls(cublas, [g16])
        line = f"case {index:2d} T={t:5d}: cuBLAS kernels {sum(tc.kernel_ms.values()) * 1e3:7.1f} us, " \
               f"span {tc.median_ms * 1e3:7.1f}"
        for name, tiles in TILES.items():
            run, outs, splits = grouped(g16, wqkv16, x16, go16, attn16, tiles, sms)
            run()
            torch.cuda.synchronize()
            err = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, ref))
            tg = time_calls(lambda *_, run=run: run(), [g16])
            kernel = sum(ms for k, ms in tg.kernel_ms.items() if "grouped" in k) * 1e3
            line += f" | {name} splits {splits}: err {err:.1e}, kernel {kernel:7.1f} us, span {tg.median_ms * 1e3:7.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
