"""Persistent, warp-specialized Hopper matrix products in Gluon: C[M, N] (+)= A[M, K] @ B[K, N], fp32 out.

Structure of a program (one per SM, looping over output tiles):
- a loader warp issues TMA copies of A and B tiles into a ring of STAGES shared-memory slots, each
  completing on its slot's `ready` mbarrier (`issue_step`);
- two consumer warpgroups, each computing its BM / 2 rows of the tile, wait on `ready`, issue async
  wgmma and, once a slot's wgmma has retired, arrive on the slot's `empty` mbarrier (which counts
  both warpgroups) so the loader can refill it (`consume_tile`); then each stores its fp32 rows, or
  adds them atomically when K is split (`store_tile`; or `emit_tile`, which can stage an unsplit
  tile in shared memory and send it by TMA under the next tile's mainloop).

Operands: A fp16 in shared memory, K-major ([BM, BK] tiles of A[M, K]) or M-major ([BK, BM] tiles
of A^T stored [K, M]); or A fp32, loaded into registers and rounded to fp16 there. B fp16 in shared
memory, N-major ([BK, BN] tiles of B[K, N]) or K-major ([BN, BK] tiles of B^T stored [N, K]).
Accumulation is fp32. benchmarks/notes/gluon.md has the measurements (fp16: 92-98% of cuBLAS; fp32
A in registers: 0.67-0.77 of that, bound by shared-memory bandwidth).

These device functions are the engine's parts; `gemm_kernel` assembles them for one product, and
operators assemble them for several products (and their operand preparation) in one launch.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..config import GLUON_LOADER_REGS

CONSUMER_REGS = gl.constexpr(240)  # registers per thread of the second consumer warpgroup (the first gets the rest)
LOADER_REGS = gl.constexpr(GLUON_LOADER_REGS)


@gluon.constexpr_function
def acc_layout(BN, warps):
    """The wgmma accumulator layout of one consumer: `warps` warps (a warpgroup: 4) along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BN, 16])


@gluon.jit
def tile_coords(tile, tiles_m, tiles_n, K, splits, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(off_m, off_n, k_lo, k_hi) of output tile `tile` of C[M, N] = A[M, K] @ B[K, N]: n fastest,
    then m, then the K split (each split a BK-aligned slice of K; the last may be empty)."""
    tn = tile % tiles_n
    tm = (tile // tiles_n) % tiles_m
    split = tile // (tiles_n * tiles_m)
    per_split = ((K + splits - 1) // splits + BK - 1) // BK * BK
    k_lo = split * per_split
    return tm * BM, tn * BN, k_lo, gl.minimum(K, k_lo + per_split)


@gluon.jit
def wait_count(counter, target):
    """Spin until the int32 at `counter` reaches `target` (acquire, GPU scope), then order this
    thread's later TMA reads of global memory after what the releasing writers stored."""
    seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def issue_step(a_desc, b_desc, a_buf, b_buf, ready, empty, it, a_row, a_col, b_row, b_col, STAGES: gl.constexpr):
    """Loader: ring step `it` (slot it % STAGES) gets A[a_row:, a_col:] and B[b_row:, b_col:] by TMA."""
    s = it % STAGES
    # A slot's first use waits on the phase before the barrier's first one, which passes at once.
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, a_col], bar, a_buf.index(s))
    tma.async_copy_global_to_shared(b_desc, [b_row, b_col], bar, b_buf.index(s))


@gluon.jit
def consume_tile(a_bufs, b_bufs, ready, empty, it, steps, A_KMAJOR: gl.constexpr, A_REGS: gl.constexpr,
                 B_KMAJOR: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr,
                 STAGES: gl.constexpr, WARPS: gl.constexpr):
    """Consumer: sum over `steps` ring steps from `it` of A[ROW0:+ROWS, step] @ B[step, :BN] as an fp32
    [ROWS, BN] tile; returns (tile, next it). Each slot is released once its wgmma has retired."""
    layout: gl.constexpr = acc_layout(BN, WARPS)
    acc = gl.zeros([ROWS, BN], gl.float32, layout)
    for step in range(steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if A_KMAJOR:
            a = a_bufs.index(s).slice(ROW0, ROWS, dim=0)
        else:
            a = a_bufs.index(s).slice(ROW0, ROWS, dim=1).permute((1, 0))
        b = b_bufs.index(s)
        if B_KMAJOR:
            b = b.permute((1, 0))
        if A_REGS:
            a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
            acc = warpgroup_mma(a.load(a_layout).to(gl.float16), b, acc, is_async=True)
        else:
            acc = warpgroup_mma(a, b, acc, is_async=True)
        # The previous step's wgmma has retired: its slot may be refilled.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=step > 0)
        it += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=steps > 0)
    return acc, it


@gluon.jit
def store_tile(c_ptr, stride_cm, acc, off_m, off_n, M, N, accumulate):
    """C[off_m:+rows, off_n:+cols] = acc (or += atomically when `accumulate`), masked at M and N."""
    layout: gl.constexpr = acc.type.layout
    rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if accumulate:
        gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        gl.store(ptrs, acc, mask=mask)


@gluon.jit
def emit_tile(acc, c_ptr, stride_cm, c_desc, c_buf, off_m, off_n, M, N, accumulate, TMA_STORE: gl.constexpr):
    """A consumer's epilogue: C[off_m:+rows, off_n:+cols] = acc, or += atomically when `accumulate`
    (`store_tile`). With TMA_STORE an unsplit tile is staged in the consumer's own shared buffer
    `c_buf` and sent by an asynchronous TMA store through `c_desc` (which clips at M and N), so the
    store overlaps the next tile's mainloop; it is waited for only before `c_buf` is written again
    (and once more before the partition ends: `tma.store_wait(0)`)."""
    if TMA_STORE:
        if accumulate:
            store_tile(c_ptr, stride_cm, acc, off_m, off_n, M, N, True)
        else:
            tma.store_wait(0)
            c_buf.store(acc)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_buf)
    else:
        store_tile(c_ptr, stride_cm, acc, off_m, off_n, M, N, accumulate)


@gluon.jit
def _gemm_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, splits, A_KMAJOR: gl.constexpr,
                 B_KMAJOR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    it = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n * splits, gl.num_programs(0)):
        off_m, off_n, k_lo, k_hi = tile_coords(tile, tiles_m, tiles_n, K, splits, BM, BN, BK)
        for k in range(k_lo, k_hi, BK):
            if A_KMAJOR:
                if B_KMAJOR:
                    issue_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, off_m, k, off_n, k, STAGES)
                else:
                    issue_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, off_m, k, k, off_n, STAGES)
            else:
                if B_KMAJOR:
                    issue_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, k, off_m, off_n, k, STAGES)
                else:
                    issue_step(a_desc, b_desc, a_bufs, b_bufs, ready, empty, it, k, off_m, k, off_n, STAGES)
            it += 1


@gluon.jit
def _gemm_consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits, A_KMAJOR: gl.constexpr,
                   A_REGS: gl.constexpr, B_KMAJOR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr):
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    it = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n * splits, gl.num_programs(0)):
        off_m, off_n, k_lo, k_hi = tile_coords(tile, tiles_m, tiles_n, K, splits, BM, BN, BK)
        acc, it = consume_tile(a_bufs, b_bufs, ready, empty, it, gl.cdiv(k_hi - k_lo, BK), A_KMAJOR, A_REGS,
                               B_KMAJOR, PART * (BM // 2), BM // 2, BN, STAGES, 4)
        store_tile(c_ptr, stride_cm, acc, off_m + PART * (BM // 2), off_n, M, N, splits > 1)


@gluon.jit
def _gemm_second_consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits, A_KMAJOR: gl.constexpr,
                          A_REGS: gl.constexpr, B_KMAJOR: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                          BK: gl.constexpr, STAGES: gl.constexpr):
    _gemm_consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits, A_KMAJOR, A_REGS, B_KMAJOR,
                   BM, BN, BK, STAGES, 1)


@gluon.jit
def gemm_kernel(a_desc, b_desc, c_ptr, stride_cm, M, N, K, splits,
                A_KMAJOR: gl.constexpr, A_REGS: gl.constexpr, B_KMAJOR: gl.constexpr, STAGES: gl.constexpr):
    """C[M, N] (+)= A[M, K] @ B[K, N] over persistent programs (grid <= tiles); C pre-zeroed if splits > 1.

    A (a_desc): [M, K] tiles [BM, BK] if A_KMAJOR, else [K, M] tiles [BK, BM]; fp16, or fp32 with
    A_REGS (rounded to fp16 in registers). B (b_desc): [K, N] tiles [BK, BN], or [N, K] tiles
    [BN, BK] if B_KMAJOR; fp16. Launched with num_warps=4 (the first consumer warpgroup).
    """
    BM: gl.constexpr = a_desc.block_type.shape[0 if A_KMAJOR else 1]
    BK: gl.constexpr = a_desc.block_type.shape[1 if A_KMAJOR else 0]
    BN: gl.constexpr = b_desc.block_type.shape[0 if B_KMAJOR else 1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_gemm_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
                          A_KMAJOR, A_REGS, B_KMAJOR, BM, BN, BK, STAGES, 0)),
        (_gemm_second_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
                                 A_KMAJOR, A_REGS, B_KMAJOR, BM, BN, BK, STAGES)),
        (_gemm_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, splits, A_KMAJOR, B_KMAJOR,
                        BM, BN, BK, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
