"""Issue 23, item 2's "byte-bound products may read fp32 operands directly (TF32 wgmma)": 021's forward
products X W^T (+ b) read straight from the fp32 inputs with TF32 tensor-core products, so that the
pack (fp32 -> fp16 copies, 8.5-11.5 us on the small cases, first in the chain: 021.md row 38) could
leave the critical path and run beside them. Both operands of X W^T are K-major (X [M, K], W [N, K]),
the layout TF32 wgmma takes from shared memory (gluon.md, session 22). Standalone tiles, one program
per 128 x 128 output tile as the small cases' forward (`forward_small`), fp16 against fp32 operands:

    PYTHONPATH=src python3 benchmarks/experiments/tf32_forward_021.py [--tokens 512,1024,2048,4096]
    ... --tokens 77,154 --n 2048     # the [K | V] product of the text
    ... --compile-only               # on any machine: each variant for sm_90, its resources

Prepared in session 23 after its device time was spent: compiled (each variant 96-128 KB of shared
memory, 109 registers, HGMMA in the SASS), never run.

Prediction (written before any run): on the small cases a forward tile is latency-bound (≈ 10 us
for 128 x 128 x 1024 at fp16, one tile per program, against ≈ 4 us at an SM's share of the fp16
peak); TF32's half rate and twice the bytes per K step make it ≤ 1.4x that, ≈ 12-14 us for 512
tokens, so that without the pack in front (8.5 us alone) the chain shortens by ≈ 5 us. Kernel times
from the profiler, each variant repeated alone; errors against fp64 (fp16 operands' own rounding
included for the fp16 variant).
"""

import argparse

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from backfuse.kernels.launch import FastKernel
from backfuse.kernels.triton.gemm import tma_tile


@triton.jit(do_not_specialize=["M", "N"])
def x_wt_kernel(x, w, bias, out16, M, N, K_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    """out16[M, N] = fp16(x[M, K_DIM] @ w[N, K_DIM]^T + bias), one program per BM x BN tile (n fastest);
    x, w fp16 or fp32 (TF32 products)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    off_m = (pid // tiles_n) * BM
    off_n = (pid % tiles_n) * BN
    a_desc = tl.make_tensor_descriptor(x, shape=[M, K_DIM], strides=[K_DIM, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(w, shape=[N, K_DIM], strides=[K_DIM, 1], block_shape=[BN, BK])
    acc = tma_tile(a_desc, b_desc, off_m, off_n, 0, K_DIM, BM, BN, BK)
    rn = off_n + tl.arange(0, BN)
    acc += tl.load(bias + rn, mask=rn < N, other=0.0)[None, :]
    rm = off_m + tl.arange(0, BM)
    tl.store(out16 + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(tl.float16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


KERNEL = FastKernel(x_wt_kernel)
# name: (operand dtype, BK, warps, stages)
VARIANTS = {"fp16 operands, BK 64, 3 stages": (torch.float16, 64, 8, 3),
            "fp32 operands (TF32), BK 32, 3 stages": (torch.float32, 32, 8, 3),
            "fp32 operands (TF32), BK 32, 4 stages": (torch.float32, 32, 8, 4),
            "fp32 operands (TF32), BK 64, 2 stages": (torch.float32, 64, 8, 2)}


def kernel_us(fn, name, reps=10):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = sorted(e.device_time for e in prof.events() if e.name.startswith(name) and e.device_time > 0)
    return times[len(times) // 2] if times else float("nan")


def compile_only():
    from triton.compiler import ASTSource

    from backfuse.kernels.gluon.sm90 import SM90, usage

    for name, (dtype, bk, warps, stages) in VARIANTS.items():
        p = "*fp16" if dtype == torch.float16 else "*fp32"
        sig = {"x": p, "w": p, "bias": "*fp32", "out16": "*fp16", "M": "i32", "N": "i32"} | \
            {c: "constexpr" for c in ("K_DIM", "BM", "BN", "BK")}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
        src = ASTSource(x_wt_kernel, sig, constexprs=dict(K_DIM=1024, BM=128, BN=128, BK=bk), attrs=attrs)
        kernel = triton.compile(src, target=SM90, options=dict(num_warps=warps, num_stages=stages))
        print(f"{name:40s}", usage(kernel), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024,2048,4096")
    ap.add_argument("--n", type=int, default=1024, help="output features (the [K | V] product: 2048)")
    ap.add_argument("--k", type=int, default=1024, help="depth (037's forward X [Wq; Wk; Wv]^T: 3072, N 5120)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print its resources")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m in (int(t) for t in args.tokens.split(",")):
        K = args.k
        x = torch.randn(m, K, device="cuda", generator=gen)
        w = torch.randn(args.n, K, device="cuda", generator=gen) * K ** -0.5
        b = torch.randn(args.n, device="cuda", generator=gen)
        ref = (x.double() @ w.double().T + b.double())
        copy_us = kernel_us(lambda: (x.half(), w.half()), "", reps=10)  # any kernel: the two casts' median
        print(f"M = {m}, N = {args.n}, K = {K}: {triton.cdiv(m, 128) * triton.cdiv(args.n, 128)} tiles; "
              f"the two fp16 casts (a pack's share) ≈ {copy_us:.1f} us each", flush=True)
        for name, (dtype, bk, warps, stages) in VARIANTS.items():
            xs, ws = x.to(dtype), w.to(dtype)
            out = torch.full((m, args.n), float("nan"), device="cuda", dtype=torch.float16)
            grid = (triton.cdiv(m, 128) * triton.cdiv(args.n, 128),)

            def run(xs=xs, ws=ws, out=out, grid=grid, bk=bk, warps=warps, stages=stages):
                KERNEL(grid, xs, ws, b, out, m, args.n, K_DIM=K, BM=128, BN=128, BK=bk, num_warps=warps, num_stages=stages)

            t = kernel_us(run, "x_wt_kernel")
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"  {name:40s} {t:6.1f} us  rel. err. vs fp64 {err:.1e}  NaN {int(out.isnan().any())}", flush=True)


if __name__ == "__main__":
    main()
