"""Gate for the Gluon product engine (issue: Gluon engine): one GPU call, a table of TFLOP/s.

(a) the engine on fp16 operands against cuBLAS fp16 (`torch.mm(..., out_dtype=float32)`);
(b) the engine on an fp32 A operand (rounded to fp16 in registers) against a cast pass + cuBLAS.
Shapes: 072 case 8 and case 6 grad_dec (A [tokens, 4096] @ Wq [4096, 1536]), 072 case 6 grad_Wq
(GQ^T @ dec: A M-major), 037 case 5 qkv (X @ Wqkv^T: B K-major), 8192^3. Every variant is first
checked against fp32 products of the fp16-rounded operands on poisoned outputs. (Its first run,
session 16, also had one-consumer variants; the engine lost that option after them, session 22
brought this script up to the engine's current arguments.)

    PYTHONPATH=src python3 benchmarks/experiments/gluon_gate.py [--quick]
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from backfuse.kernels.gluon.gemm import gemm_kernel

SMS = torch.cuda.get_device_properties(0).multi_processor_count


def desc(t, block):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, {
        torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]))


def engine(a, b, c, *, a_kmajor, b_kmajor, bm, bn, bk, stages, splits=1, maxnreg=168):
    """c (+)= op(a) @ op(b): a is [M, K] (a_kmajor) or [K, M]; b is [K, N] or [N, K] (b_kmajor)."""
    M, K = a.shape if a_kmajor else a.shape[::-1]
    N = b.shape[0] if b_kmajor else b.shape[1]
    a_d = desc(a, [bm, bk] if a_kmajor else [bk, bm])
    b_d = desc(b, [bn, bk] if b_kmajor else [bk, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn) * splits

    def run():
        if splits > 1:
            c.zero_()
        gemm_kernel[(min(SMS, tiles),)](a_d, b_d, c, c.stride(0), M, N, K, splits,
                                        A_KMAJOR=a_kmajor, A_REGS=a.dtype == torch.float32, B_KMAJOR=b_kmajor,
                                        STAGES=stages, num_warps=4, maxnreg=maxnreg)
    return run


def main(quick: bool) -> None:
    torch.manual_seed(0)
    shapes = {  # name: (M, K, N, a_kmajor, b_kmajor)
        "072c8 grad_dec": (4096, 4096, 1536, True, False),
        "072c6 grad_dec": (16384, 4096, 1536, True, False),
        "072c6 grad_Wq": (4096, 16384, 1536, False, False),
        "037c5 qkv": (16384, 3072, 5120, True, True),
        "8192^3": (8192, 8192, 8192, True, False),
    }
    tiles = [(128, 256, 64, 4), (128, 256, 64, 3), (128, 128, 64, 4)]  # (bm, bn, bk, stages)
    tiles32 = [(128, 256, 64, 3), (128, 256, 32, 6), (128, 128, 64, 4)]
    rows = []
    for name, (M, K, N, akm, bkm) in shapes.items():
        if quick and name != "072c8 grad_dec":
            continue
        a32 = torch.randn((M, K) if akm else (K, M), device="cuda") / K ** 0.25
        b16 = (torch.randn((N, K) if bkm else (K, N), device="cuda") / K ** 0.25).half()
        a16 = a32.half()
        op_a = a16.float() if akm else a16.float().T
        op_b = b16.float().T if bkm else b16.float()
        ref = op_a @ op_b
        c = torch.empty(M, N, device="cuda")
        flop = 2 * M * N * K

        def mm16():
            torch.mm(a16 if akm else a16.T, b16.T if bkm else b16, out_dtype=torch.float32, out=c)

        def pack_mm():
            a = a32.half()
            torch.mm(a if akm else a.T, b16.T if bkm else b16, out_dtype=torch.float32, out=c)

        variants = [("cublas fp16", mm16), ("cast + cublas (fp32 A)", pack_mm)]
        for bm, bn, bk, st in tiles:
            variants.append((f"gluon fp16 {bm}x{bn}x{bk} s{st}",
                             engine(a16, b16, c, a_kmajor=akm, b_kmajor=bkm, bm=bm, bn=bn, bk=bk, stages=st)))
        for bm, bn, bk, st in tiles32:
            variants.append((f"gluon fp32A {bm}x{bn}x{bk} s{st}",
                             engine(a32, b16, c, a_kmajor=akm, b_kmajor=bkm, bm=bm, bn=bn, bk=bk, stages=st)))
        for label, fn in variants:
            try:
                c.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = ((c - ref).abs().max() / ref.abs().max()).item()
                ok = err < 1e-3 and not c.isnan().any().item()
                ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") if ok else float("nan")
            except Exception as e:  # a variant that does not compile or launch: report, go on
                err, ok, ms = float("nan"), False, float("nan")
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            rows.append((name, label, ok, err, ms, flop / ms / 1e9 if ok else float("nan")))
            print(f"{name:16s} {label:34s} {'ok ' if ok else 'BAD'} err {err:8.1e} {ms * 1e3:9.1f} us "
                  f"{rows[-1][-1]:6.0f} TFLOP/s", flush=True)
    # split-K with atomics: correctness at a short grid
    a16 = torch.randn(16384, 1024, device="cuda").half()
    b16 = torch.randn(16384, 1024, device="cuda").half()
    c = torch.empty(1024, 1024, device="cuda")
    ref = a16.float().T @ b16.float()
    for a, label in ((a16, "fp16"), (a16.float(), "fp32A")):
        engine(a, b16, c, a_kmajor=False, b_kmajor=False, bm=128, bn=256, bk=64, stages=3, splits=4)()
        torch.cuda.synchronize()
        print(f"split-K 4 {label} M-major A: rel err {((c - ref).abs().max() / ref.abs().max()).item():.1e}")
    print("\nsummary (TFLOP/s)")
    for name in dict.fromkeys(r[0] for r in rows):
        best = {k: max((r[5] for r in rows if r[0] == name and r[1].startswith(k) and r[2]), default=float("nan"))
                for k in ("cublas fp16", "cast + cublas", "gluon fp16", "gluon fp32A")}
        print(f"{name:16s} " + "  ".join(f"{k} {v:5.0f}" for k, v in best.items()))


if __name__ == "__main__":
    main("--quick" in sys.argv)
