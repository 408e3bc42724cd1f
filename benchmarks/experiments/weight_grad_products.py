"""Why was 021's gradient launch slower as persistent TMA programs (benchmarks/notes/021.md row 25)?
The weight-gradient layout on its own: C[1024, 1024] (+)= A^T B with A, B stored [tokens, 1024]
fp16, K = tokens split `s` ways into a pre-zeroed fp32 C by atomics (the operators' split-K), as

- `tile`: one program per (tile, split), pointer loads (kernels/triton/gemm.py's gemm_tile; the operators'
  128 x 128 x 32 tiles at 4 warps, 6 stages);
- `persist`: one program per SM over all (tile, split) pairs, TMA loads of A^T as [BK, BM] blocks;
- cuBLAS (`torch.mm(A.T, B, out_dtype=float32)`, which picks its own split).

Times from CUDA-graph replays include zeroing C (TFLOP/s; '!' marks a wrong result).

    PYTHONPATH=src python benchmarks/experiments/weight_grad_products.py
"""
import torch
import triton
import triton.language as tl
from common import measure, replay_ms, use_torch_allocator

from backfuse.kernels.triton.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def weight_grad_tile(a16, b16, c, K, splits, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    gemm_tile(tl.program_id(0), a16, b16, c, 1024, 1024, K, 1, 1024, 1024, 1, 1024, splits, BM, BN, BK)


@triton.jit
def weight_grad_persistent(a16, b16, c, K, splits, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    da = tl.make_tensor_descriptor(a16, shape=[K, 1024], strides=[1024, 1], block_shape=[BK, BM])
    db = tl.make_tensor_descriptor(b16, shape=[K, 1024], strides=[1024, 1], block_shape=[BK, BN])
    tiles = (1024 // BM) * (1024 // BN) * splits
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        off_m, off_n, k_lo, k_hi = tile_coords(t, 1024, 1024, K, splits, BM, BN, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k_lo, k_hi, BK):
            acc = tl.dot(da.load([k, off_m]).T, db.load([k, off_n]), acc)
        store_tile(c, acc, off_m, off_n, 1024, 1024, 1024, 1, splits > 1, BM, BN)


def run(K):
    a = (torch.randn(K, 1024, device="cuda") / 16).half()
    b = (torch.randn(K, 1024, device="cuda") / 16).half()
    ref = torch.mm(a.T, b, out_dtype=torch.float32)
    c = torch.empty(1024, 1024, device="cuda")
    flop = 2 * 1024 * 1024 * K
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    zero_ms = replay_ms(lambda: c.zero_())
    cublas_ms = replay_ms(lambda: torch.mm(a.T, b, out_dtype=torch.float32, out=c))
    cells = [f"zero C {zero_ms * 1e3:4.1f} us", f"cublas {flop / cublas_ms / 1e9:4.0f}"]

    def variant(name, kernel, grid, splits, **meta):
        def fn():
            c.zero_()
            kernel[grid](a, b, c, K, splits, **meta)

        measure(cells, name, fn, c, ref, flop, atol=1e-2, rtol=1e-2)

    for splits in (2, 4, 8, 16):
        if K // splits < 256:
            continue
        tiles = 64 * splits
        variant(f"s{splits} tile 128x128x32w4s6", weight_grad_tile, (tiles,), splits, BM=128, BN=128, BK=32,
                num_warps=4, num_stages=6)
        for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3)):
            t = (1024 // bm) * (1024 // bn) * splits
            per_sm = 2 if bn == 128 else 1
            variant(f"s{splits} persist {bm}x{bn}x{bk}w{w}s{s}", weight_grad_persistent, (min(t, per_sm * sms),),
                    splits, BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s)
    print(f"K={K}:\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    use_torch_allocator()
    for K in (1024, 4096, 8192, 16384):
        run(K)
