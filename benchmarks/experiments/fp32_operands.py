"""Can a product tile read an fp32 operand and round it itself, instead of reading an fp16 copy that
a separate pass wrote? Standalone products in the layouts 021 uses, each with fp16 or fp32 operands
in memory (`mma_tile` rounds fp32 ones to fp16 as they stream in), next to the cost of the copy the
fp32 read would replace (torch's .half(): one read, one half-size write). TFLOP/s from CUDA-graph replays;
'!' marks a wrong result.

    PYTHONPATH=src python benchmarks/experiments/fp32_operands.py
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from backfuse.kernels.config import TileConfig
from backfuse.kernels.schedule import choose_splits, tile_count
from backfuse.kernels.triton.gemm import gemm_tile

SMS = 132


@triton.jit  # sizes specialized (multiples of 16), so loads along K vectorize as in the operators
def product(a, b, c, M, N, K, sam, sak, sbk, sbn, splits, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    gemm_tile(tl.program_id(0), a, b, c, M, N, K, sam, sak, sbk, sbn, N, splits, BM, BN, BK)


def run(name, m, n, k, a_t, b_t, a32, b32, cfg):
    """C[m, n] = A[m, k] B[k, n]; a_t: A stored [k, m] (feature-contiguous); b_t: B stored [n, k]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn((k, m) if a_t else (m, k), device="cuda", generator=g)
    b = torch.randn((n, k) if b_t else (k, n), device="cuda", generator=g)
    a_ = a.t() if a_t else a
    b_ = b.t() if b_t else b
    expected = a_.half().float() @ b_.half().float()
    a_in = a if a32 else a.half()
    b_in = b if b32 else b.half()
    splits = choose_splits([(m, n, k)], cfg.bm, cfg.bn, cfg.bk, SMS)[0]
    c = torch.zeros(m, n, device="cuda")
    sam, sak = (1, m) if a_t else (k, 1)
    sbk, sbn = (1, k) if b_t else (n, 1)
    grid = (tile_count(m, n, splits, cfg.bm, cfg.bn),)

    def f():
        if splits > 1:
            c.zero_()
        product[grid](a_in, b_in, c, m, n, k, sam, sak, sbk, sbn, splits, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                      num_warps=cfg.warps, num_stages=cfg.stages)

    f()
    ok = torch.allclose(c, expected, rtol=1e-3, atol=1e-2 * k ** 0.5)
    ms = do_bench_cudagraph(f, rep=200)  # in a CUDA graph: the JIT launch costs more host time than these take
    copies = [t for t, is32 in ((a, a32), (b, b32)) if is32]
    copy_ms = sum(do_bench_cudagraph(lambda t=t: t.half(), rep=100) for t in copies)
    return f"{name:34s} A{'32' if a32 else '16'} B{'32' if b32 else '16'} splits {splits}: {ms * 1e3:7.1f} us " \
           f"{2 * m * n * k / ms / 1e9:5.0f} TFLOP/s{'' if ok else ' !'}   copies it replaces: {copy_ms * 1e3:5.1f} us"


if __name__ == "__main__":
    configs = {"fwd 128x128x64 w8 s3": TileConfig(), "grad 128x128x32 w4 s6": TileConfig(bm=128, bn=128, bk=32, warps=4,
                                                                                          stages=6)}
    for cname, cfg in configs.items():
        print(f"== {cname}")
        for tokens in (8192, 4096, 1024):
            # forward: [tokens, 1024] activations times a weight stored [N, K] (Q = video Wq^T)
            for a32 in (False, True):
                print(run(f"X W^T  M={tokens}", tokens, 1024, 1024, False, True, a32, False, cfg), flush=True)
            # weight gradient: dQ^T video, dQ fp16 [tokens, 1024] read feature-contiguous, video fp16 or fp32
            for a32, b32 in ((False, False), (False, True), (True, False)):
                print(run(f"G^T X  K={tokens}", 1024, 1024, tokens, True, False, a32, b32, cfg), flush=True)
