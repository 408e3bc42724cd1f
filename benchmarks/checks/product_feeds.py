"""How to feed our fp16 product tiles on Hopper: pointer loads (cp.async, as kernels/gemm.py does)
against TMA tensor descriptors, with and without Triton's warp specialization, in the three operand
layouts the operators use (A row-major, A feature-contiguous, B transposed), next to cuBLAS.
Standalone products timed with triton.testing.do_bench (TFLOP/s; '!' marks a wrong result).

    PYTHONPATH=src python benchmarks/checks/product_feeds.py
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from backfuse.kernels.gemm import mma_tile

triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def gemm_ptr(a, b, c, M, N, K, sam, sak, sbk, sbn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    nt = tl.cdiv(N, BN)
    off_m = (pid // nt) * BM
    off_n = (pid % nt) * BN
    acc = mma_tile(a, b, off_m, off_n, M, N, 0, K, sam, sak, sbk, sbn, BM, BN, BK)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    tl.store(c + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def gemm_tma(a, b, c, M, N, K, A_T: tl.constexpr, B_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    nt = tl.cdiv(N, BN)
    off_m = (pid // nt) * BM
    off_n = (pid % nt) * BN
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
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    tl.store(c + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


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
        f1 = lambda: gemm_ptr[grid](a, b, c, M, N, K, sam, sak, sbk, sbn, BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s)  # noqa: E731
        f1()
        ok1 = torch.allclose(c, ref, atol=1e-2, rtol=1e-2)
        t1 = do_bench(f1)
        tma = []
        for ws in (False, True):
            def f2(ws=ws):
                gemm_tma[grid](a, b, c, M, N, K, A_T=a_t, B_T=b_t, BM=bm, BN=bn, BK=bk, WS=ws, num_warps=w, num_stages=s)
            try:
                c.fill_(float("nan"))
                f2()
                ok2 = torch.allclose(c, ref, atol=1e-2, rtol=1e-2)
                t2 = do_bench(f2)
                tma.append(f"{flop / t2 / 1e9:4.0f}{'' if ok2 else '!'}")
            except Exception as e:
                tma.append(f"ERR {type(e).__name__}: {str(e)[:120]}")
        cells.append(f"{bm}x{bn}x{bk}w{w}s{s} ptr {flop / t1 / 1e9:4.0f}{'' if ok1 else '!'} tma {tma[0]} ws {tma[1]}")
    print(f"M={M} N={N} K={K} A_T={a_t} B_T={b_t}: " + " | ".join(cells), flush=True)


for M, N, K, a_t, b_t in ((8192, 1024, 1024, False, False), (8192, 1024, 2048, False, False),
                          (1024, 1024, 8192, True, False), (1024, 1024, 4928, True, False),
                          (8192, 1024, 1024, False, True), (1024, 1024, 1024, False, False), (1024, 1024, 1024, True, False)):
    run(M, N, K, a_t, b_t)
