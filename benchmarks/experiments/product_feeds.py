"""How to feed our fp16 product tiles on Hopper: pointer loads (cp.async, as kernels/triton/gemm.py does)
against TMA tensor descriptors, with and without Triton's warp specialization, in the three operand
layouts the operators use (A row-major, A feature-contiguous, B transposed), next to cuBLAS.
Standalone products timed with triton.testing.do_bench (TFLOP/s; '!' marks a wrong result).

    PYTHONPATH=src python benchmarks/experiments/product_feeds.py
"""
import torch
import triton
import triton.language as tl
from common import measure, tile_origin, use_torch_allocator
from triton.testing import do_bench

from backfuse.kernels.triton.gemm import mma_tile, store_tile


@triton.jit
def gemm_ptr(a, b, c, M, N, K, sam, sak, sbk, sbn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    off_m, off_n = tile_origin(tl.program_id(0), N, BM, BN)
    acc = mma_tile(a, b, off_m, off_n, M, N, 0, K, sam, sak, sbk, sbn, BM, BN, BK)
    store_tile(c, acc, off_m, off_n, M, N, N, 1, False, BM, BN)


@triton.jit
def gemm_tma(a, b, c, M, N, K, A_T: tl.constexpr, B_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, WS: tl.constexpr):
    off_m, off_n = tile_origin(tl.program_id(0), N, BM, BN)
    if A_T:
        da = tl.make_tensor_descriptor(a, shape=[K, M], strides=[M, 1], block_shape=[BK, BM])
    else:
        da = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if B_T:
        db = tl.make_tensor_descriptor(b, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        db = tl.make_tensor_descriptor(b, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=WS):
        if A_T:
            x = da.load([k, off_m]).T
        else:
            x = da.load([off_m, k])
        if B_T:
            y = db.load([off_n, k]).T
        else:
            y = db.load([k, off_n])
        acc = tl.dot(x, y, acc)
    store_tile(c, acc, off_m, off_n, M, N, N, 1, False, BM, BN)


def run(M, N, K, a_t, b_t):
    a = torch.randn((K, M) if a_t else (M, K), device="cuda").half()
    b = torch.randn((N, K) if b_t else (K, N), device="cuda").half()
    A = a.T if a_t else a
    B = b.T if b_t else b
    ref = torch.mm(A, B, out_dtype=torch.float32)
    flop = 2 * M * N * K
    cells = [f"cublas {flop / do_bench(lambda: torch.mm(A, B, out_dtype=torch.float32)) / 1e9:5.0f}"]
    for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 32, 4, 6)):
        c = torch.empty(M, N, device="cuda")
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        sam, sak = A.stride()
        sbk, sbn = B.stride()
        shape = f"{bm}x{bn}x{bk}w{w}s{s}"
        measure(cells, f"{shape} ptr", lambda: gemm_ptr[grid](a, b, c, M, N, K, sam, sak, sbk, sbn, BM=bm, BN=bn, BK=bk,
                                                              num_warps=w, num_stages=s),
                c, ref, flop, timer=do_bench, atol=1e-2, rtol=1e-2)
        for ws in (False, True):
            measure(cells, f"{shape} tma{' ws' if ws else ''}",
                    lambda ws=ws: gemm_tma[grid](a, b, c, M, N, K, A_T=a_t, B_T=b_t, BM=bm, BN=bn, BK=bk, WS=ws,
                                                 num_warps=w, num_stages=s),
                    c, ref, flop, timer=do_bench, atol=1e-2, rtol=1e-2)
    print(f"M={M} N={N} K={K} A_T={a_t} B_T={b_t}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    use_torch_allocator()
    for M, N, K, a_t, b_t in ((8192, 1024, 1024, False, False), (8192, 1024, 2048, False, False),
                              (1024, 1024, 8192, True, False), (1024, 1024, 4928, True, False),
                              (8192, 1024, 1024, False, True), (1024, 1024, 1024, False, False),
                              (1024, 1024, 1024, True, False)):
        run(M, N, K, a_t, b_t)
