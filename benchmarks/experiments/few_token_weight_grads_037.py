"""037's weight gradients at few tokens, each product alone: grad_[Wq; Wk; Wv] = G^T X ([5120, 3072] fp32)
and grad_Wo = grad_output^T A ([3072, 3072]), over K = 128-512 tokens. At 128 tokens they are bound by
their fp32 stores (63 and 38 MB): case 8's timeline (runs.md s28-4) has cuBLAS's grad_[Wq; Wk; Wv] at
33.7 µs beside grad_hidden (24.2 µs), 63 MB in ≈ 1.9 TB/s, and grad_Wo at 22.1 µs (1.7 TB/s).

Variants: cuBLAS (`torch.mm(G.T, X, out_dtype=float32)`), our Triton tiles (kernels/triton/gemm.py's
gemm_tile: one program per output tile, pointer loads, A read feature-contiguous), and the Gluon
engine (kernels/gluon/gemm.py: persistent, TMA ring, A M-major), against a plain fill of the same
output (torch's zero_: the store ceiling). Each call writes one of two outputs in turn and reads one
of two input sets; CUDA-graph replays of 20 calls.

Prediction (written before the run): a fill of 63 MB ≈ 17-19 µs (3.3-3.7 TB/s); a product that keeps
its stores streaming reaches within 10 % of it at 128 tokens (≈ 20 µs against cuBLAS's ≈ 25-34), so
−5..10 µs on case 8's tail if cuBLAS alone is as slow as in the call; at 512 tokens (16 GFLOP) cuBLAS
near its 650 TFLOP/s (≈ 25 µs) and ours behind.

    PYTHONPATH=src python3 benchmarks/experiments/few_token_weight_grads_037.py [--tokens 128,256,512]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import replay_us
from triton.experimental.gluon import language as gl

from backfuse.kernels.gluon.gemm import gemm_kernel
from backfuse.kernels.triton.gemm import gemm_tile
from backfuse.ops.gemma3_core.spec import HIDDEN, Q_OUT, QKV

# (BM, BN, BK, warps, stages)
TRITON_TILES = [(128, 128, 64, 4, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 3), (128, 128, 32, 4, 4)]
GLUON_TILES = [(128, 128, 64, 4), (128, 256, 64, 3)]  # (BM, BN, BK, STAGES)


@triton.jit
def weight_grad_kernel(a16, b16, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[M, N] = A^T B for A [K, M], B [K, N] row-major fp16 (one program per tile, unsplit)."""
    gemm_tile(tl.program_id(0), a16, b16, c, M, N, K, 1, M, N, 1, N, 1, BM, BN, BK)


def main():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,256,512")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), flush=True)
    summary = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, m, n in (("grad_[Wq;Wk;Wv]", QKV, HIDDEN), ("grad_Wo", HIDDEN, Q_OUT)):
            a = [torch.randn(tokens, m, device="cuda").half() for _ in range(2)]
            b = [torch.randn(tokens, n, device="cuda").half() for _ in range(2)]
            c = [torch.empty(m, n, device="cuda") for _ in range(2)]
            ref = a[0].float().T @ b[0].float()
            mb = m * n * 4 / 1e6
            rows = [("fill (zero_)", replay_us([lambda i=i: c[i].zero_() for i in range(2)]), True)]

            def check(fn):
                c[0].fill_(float("nan"))
                fn(0)
                torch.cuda.synchronize()
                return ((c[0] - ref).abs().max() / ref.abs().max()).item() < 1e-3

            def cublas(i):
                torch.mm(a[i].T, b[i], out_dtype=torch.float32, out=c[i])
            rows.append(("cuBLAS", replay_us([lambda i=i: cublas(i) for i in range(2)]), check(cublas)))
            for bm, bn, bk, warps, stages in TRITON_TILES:
                def ours(i, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages):
                    weight_grad_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
                        a[i], b[i], c[i], m, n, tokens, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
                rows.append((f"triton {bm}x{bn}x{bk} w{warps} s{stages}",
                             replay_us([lambda i=i: ours(i) for i in range(2)]), check(ours)))
            for bm, bn, bk, stages in GLUON_TILES:
                layout_a = gl.NVMMASharedLayout.get_default_for([bk, bm], gl.float16)
                layout_b = gl.NVMMASharedLayout.get_default_for([bk, bn], gl.float16)
                descs = [(TensorDescriptor.from_tensor(a[i], [bk, bm], layout_a),
                          TensorDescriptor.from_tensor(b[i], [bk, bn], layout_b)) for i in range(2)]
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)

                def engine(i, stages=stages, tiles=tiles):
                    gemm_kernel[(min(sms, tiles),)](*descs[i], c[i], n, m, n, tokens, 1, A_KMAJOR=False,
                                                    A_REGS=False, B_KMAJOR=False, STAGES=stages, num_warps=4,
                                                    maxnreg=168)
                try:
                    rows.append((f"gluon {bm}x{bn}x{bk} s{stages}", replay_us([lambda i=i: engine(i) for i in range(2)]),
                                 check(engine)))
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    print(f"  gluon {bm}x{bn}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            print(f"tokens {tokens} {name} [{m}, {n}] ({mb:.0f} MB out)", flush=True)
            for label, us, ok in rows:
                print(f"  {label:28s} {us:6.1f} us  {mb / us:5.2f} TB/s of output{'' if ok else '  WRONG'}", flush=True)
            best = min((r for r in rows[2:] if r[2]), key=lambda r: r[1])
            summary.append((tokens, name, rows[0][1], rows[1][1], best[0], best[1]))
    print("\nsummary (us): tokens, product: fill | cuBLAS | best of ours")
    for tokens, name, fill, cub, label, us in summary:
        print(f"{tokens:5d} {name:16s} {fill:6.1f} | {cub:6.1f} | {us:6.1f} ({label})")


if __name__ == "__main__":
    main()
