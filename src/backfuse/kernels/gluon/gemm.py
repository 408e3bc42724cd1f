"""Persistent, warp-specialized Hopper matrix products in Gluon: C[M, N] (+)= A[M, K] @ B[K, N], fp32 out.

Structure of one program (one per SM, looping over output tiles):
- a loader warp issues TMA copies of A and B tiles into a ring of STAGES shared-memory slots, each
  completing on its slot's `ready` mbarrier;
- CONSUMERS warpgroups (each its BM / CONSUMERS rows of the tile) wait on `ready`, issue async
  wgmma and, once a slot's wgmma has retired, arrive on its `empty` mbarrier so the loader can
  refill it; then they store the fp32 tile (or add it atomically when K is split).

Operands:
- A fp16 is read by wgmma from shared memory, K-major ([BM, BK] tiles of A[M, K]) or M-major
  ([BK, BM] tiles of A^T stored [K, M]); A fp32 is loaded from shared memory into registers,
  rounded to fp16 there, and fed to wgmma from registers: fp32 operands need no conversion pass.
- B fp16 is N-major ([BK, BN] tiles of B[K, N]) or K-major ([BN, BK] tiles of B^T stored [N, K]).
fp32 accumulation throughout; fp32 A is rounded to fp16 exactly as a separate cast would.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def tile_coords(tile, tiles_m, tiles_n, K, splits, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(off_m, off_n, k_lo, k_hi) of output tile `tile`: n fastest, then m, then the K split (each
    split a BK-aligned slice of K)."""
    tn = tile % tiles_n
    tm = (tile // tiles_n) % tiles_m
    split = tile // (tiles_n * tiles_m)
    per_split = ((K + splits - 1) // splits + BK - 1) // BK * BK
    k_lo = split * per_split
    return tm * BM, tn * BN, k_lo, gl.minimum(K, k_lo + per_split)


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, splits,
            A_KMAJOR: gl.constexpr, B_KMAJOR: gl.constexpr,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    total = tiles_m * tiles_n * splits
    it = 0
    for tile in range(pid, total, grid):
        off_m, off_n, k_lo, k_hi = tile_coords(tile, tiles_m, tiles_n, K, splits, BM, BN, BK)
        for k in range(k_lo, k_hi, BK):
            s = it % STAGES
            # A slot's first use waits on the phase before the barrier's first: it passes at once.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            if A_KMAJOR:
                tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(s))
            if B_KMAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
              A_KMAJOR: gl.constexpr, A_REGS: gl.constexpr, B_KMAJOR: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              PART: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Rows [part * ROWS, +ROWS) of every tile, with WARPS warps (ROWS / 16 per warp... in units of
    16 rows per warp of a warpgroup)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BN, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    total = tiles_m * tiles_n * splits
    row0: gl.constexpr = PART * ROWS
    it = 0
    for tile in range(pid, total, grid):
        off_m, off_n, k_lo, k_hi = tile_coords(tile, tiles_m, tiles_n, K, splits, BM, BN, BK)
        acc = gl.zeros([ROWS, BN], gl.float32, layout)
        first = it
        for k in range(k_lo, k_hi, BK):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if A_KMAJOR:
                a_s = a_bufs.index(s).slice(row0, ROWS, dim=0)
            else:
                a_s = a_bufs.index(s).slice(row0, ROWS, dim=1).permute((1, 0))
            b_s = b_bufs.index(s)
            if B_KMAJOR:
                b_s = b_s.permute((1, 0))
            if A_REGS:
                acc = warpgroup_mma(a_s.load(a_layout).to(gl.float16), b_s, acc, is_async=True)
            else:
                acc = warpgroup_mma(a_s, b_s, acc, is_async=True)
            # The previous step's wgmma has retired: its slot may be refilled.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > first)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=it > first)
        rows = off_m + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        ptrs = c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if splits > 1:
            gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        else:
            gl.store(ptrs, acc, mask=mask)


@gluon.jit
def _second_consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
                     A_KMAJOR: gl.constexpr, A_REGS: gl.constexpr, B_KMAJOR: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    _consumer(a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
              A_KMAJOR, A_REGS, B_KMAJOR, BM, BN, BK, STAGES, 1, BM // 2, 4)


@gluon.jit
def gemm_kernel(a_desc, b_desc, c_ptr, stride_cm, M, N, K, splits,
                A_KMAJOR: gl.constexpr, A_REGS: gl.constexpr, B_KMAJOR: gl.constexpr,
                STAGES: gl.constexpr, CONSUMERS: gl.constexpr, num_warps: gl.constexpr):
    """C[M, N] (+)= A[M, K] @ B[K, N] over persistent programs (grid <= tiles); C pre-zeroed if splits > 1.

    CONSUMERS = 1: the default partition (num_warps warps) computes whole tiles; 2: the default
    partition (4 warps) and a second 4-warp partition compute the two row halves, each with its own
    arrivals (the empty barriers count 2), so neither waits for the other's warps.
    """
    if A_KMAJOR:
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
    else:
        BK: gl.constexpr = a_desc.block_type.shape[0]
        BM: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
                         A_KMAJOR, A_REGS, B_KMAJOR, BM, BN, BK, STAGES, 0, BM, num_warps)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, splits,
                       A_KMAJOR, B_KMAJOR, BM, BN, BK, STAGES)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
                         A_KMAJOR, A_REGS, B_KMAJOR, BM, BN, BK, STAGES, 0, BM // 2, num_warps)),
            (_second_consumer, (a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, M, N, K, splits,
                                A_KMAJOR, A_REGS, B_KMAJOR, BM, BN, BK, STAGES)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, splits,
                       A_KMAJOR, B_KMAJOR, BM, BN, BK, STAGES)),
        ], [4, 1], [240, 24])
