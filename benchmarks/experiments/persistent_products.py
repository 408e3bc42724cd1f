"""Would persistent product programs beat one program per tile? Standalone products in the shapes
the operators use, C = A B + bias written fp16 (021's forward epilogue), timed with CUDA-graph
replays of 20 products (TFLOP/s; '!' marks a wrong result):

- `tile`: one program per output tile (what the operators launch; kernels/triton/gemm.py's mma_tile);
- `persist`: one program per SM slot looping over tiles, the tile and K loops flattened
  (`tl.range(..., flatten=True)`), so that the next tile's first loads are in flight during the
  current tile's epilogue;
- `persist_tma`: the same with TMA tensor-descriptor loads;
- cuBLAS (`torch.addmm`, fp16).

    PYTHONPATH=src python benchmarks/experiments/persistent_products.py
"""
import torch
import triton
import triton.language as tl
from common import bias_fp16_epilogue, measure, replay_ms, tile_origin, use_torch_allocator

from backfuse.kernels.triton.gemm import mma_tile


@triton.jit
def gemm_tile(a16, b16, bias, c, M, N, K, sam, sak, sbk, sbn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    off_m, off_n = tile_origin(tl.program_id(0), N, BM, BN)
    acc = mma_tile(a16, b16, off_m, off_n, M, N, 0, K, sam, sak, sbk, sbn, BM, BN, BK)
    bias_fp16_epilogue(c, bias, acc, off_m, off_n, M, N, BM, BN)


@triton.jit
def gemm_persistent(a16, b16, bias, c, M, N, K, sam, sak, sbk, sbn, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, STAGES: tl.constexpr):
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    rk = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True, num_stages=STAGES):
        off_m, off_n = tile_origin(tile, N, BM, BN)
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            kk = ks * BK + rk
            x = tl.load(a16 + rm[:, None].to(tl.int64) * sam + kk[None, :] * sak,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            y = tl.load(b16 + kk[:, None].to(tl.int64) * sbk + rn[None, :] * sbn,
                        mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(x, y, acc)
        bias_fp16_epilogue(c, bias, acc, off_m, off_n, M, N, BM, BN)


@triton.jit
def gemm_persistent_tma(a16, b16, bias, c, M, N, K, B_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    n_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    da = tl.make_tensor_descriptor(a16, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if B_T:
        db = tl.make_tensor_descriptor(b16, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        db = tl.make_tensor_descriptor(b16, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True, num_stages=STAGES,
                         warp_specialize=WS):
        off_m, off_n = tile_origin(tile, N, BM, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            x = da.load([off_m, ks * BK])
            if B_T:
                y = db.load([off_n, ks * BK]).T
            else:
                y = db.load([ks * BK, off_n])
            acc = tl.dot(x, y, acc)
        bias_fp16_epilogue(c, bias, acc, off_m, off_n, M, N, BM, BN)


def run(M, N, K, b_t):
    a = torch.randn(M, K, device="cuda").half()
    b = torch.randn((N, K) if b_t else (K, N), device="cuda").half()
    bias = torch.randn(N, device="cuda")
    B = b.T if b_t else b
    sbk, sbn = B.stride()
    ref = (torch.mm(a, B, out_dtype=torch.float32) + bias).half()
    c = torch.empty(M, N, device="cuda", dtype=torch.float16)
    flop = 2 * M * N * K
    cells = [f"cublas {flop / replay_ms(lambda: torch.addmm(bias.half(), a, B, out=c)) / 1e9:4.0f}"]
    for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4)):
        shape = f"{bm}x{bn}x{bk}w{w}s{s}"
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        measure(cells, f"tile {shape}", lambda: gemm_tile[(tiles,)](a, b, bias, c, M, N, K, K, 1, sbk, sbn, BM=bm,
                                                                    BN=bn, BK=bk, num_warps=w, num_stages=s), c, ref, flop)
        progs = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count)
        measure(cells, f"persist {shape}", lambda: gemm_persistent[(progs,)](a, b, bias, c, M, N, K, K, 1, sbk, sbn,
                                                                            BM=bm, BN=bn, BK=bk, STAGES=s, num_warps=w),
                c, ref, flop)
        for ws in (False, True):
            measure(cells, f"tma{'_ws' if ws else ''} {shape}",
                    lambda ws=ws: gemm_persistent_tma[(progs,)](a, b, bias, c, M, N, K, B_T=b_t, BM=bm, BN=bn, BK=bk,
                                                                STAGES=s, WS=ws, num_warps=w), c, ref, flop)
    print(f"M={M} N={N} K={K} B_T={b_t}:\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    use_torch_allocator()
    # 021 forward (x W^T + b; 8192 / 2048 / 16384 tokens), 072 grad_dec (GQ Wq: K 4096), 037 small-case forward.
    for M, N, K, b_t in ((8192, 1024, 1024, True), (2048, 1024, 1024, True), (8192, 1024, 1024, False),
                         (8192, 1536, 4096, False), (512, 5120, 3072, True), (16384, 1024, 1024, True)):
        run(M, N, K, b_t)
