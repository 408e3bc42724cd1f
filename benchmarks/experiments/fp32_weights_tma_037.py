"""Issue 23, item 3, in the form 037.md row 41 named next: 037's three weight products at few tokens
read the fp32 weights by TMA into shared memory (the Gluon engine's fp32-A path: the consumer
warpgroups load each tile into registers and round it to fp16 for wgmma), so no fp16 copy of any
weight is made. Row 41's pointer-load (cp.async) form streamed at 2.3-2.7 TB/s and still needed
the copy of [Wq; Wk; Wv] that grad_hidden reads; here grad_hidden reads the fp32 weights too.

    out^T[n, t] = sum_k W(n, k) T[t, k]     A = W (fp32, TMA -> registers -> fp16), B = T (fp16, K-major)

    [q | k | v]^T  = Wqkv   . X^T     A K-major  ([5120, 3072] tiles [BM, BK])
    dA^T           = Wo^T   . go^T    A M-major  (Wo [3072 in, 3072 out] tiles [BK, BM])
    grad_hidden^T  = Wqkv^T . G^T     A M-major  (Wqkv [5120, 3072] tiles [BK, BM])

Today (case 8's timeline, runs.md s28-4) the pack reads the 101 MB of fp32 weights and writes 50 MB
of fp16 copies (≈ 31 + 19 µs in two launches), cuBLAS reads the copies. Prediction (written before
the run): each direct product bound by its fp32 weight bytes at ≈ 3.5-4 TB/s once K is split so that
≈ 132 programs stream at once: at 128 tokens [q | k | v] 63 MB ≈ 16-18 µs, dA 38 MB ≈ 10-11, grad_hidden
63 MB ≈ 16-18, against cast + cuBLAS ≈ 33 + 23 and cuBLAS's grad_hidden on the copy ≈ 10-12: the three
≈ 44 against ≈ 66 µs (−20 µs on case 8's chain); at 256 tokens smaller; at 512 tokens (16 GFLOP in
[q | k | v], the engine's fp32-A rate ≈ 450 TFLOP/s: ≈ 36 µs) even or behind.

Each call reads one of four weight sets in turn, so the 101 MB never sit in the 50 MB L2; times are
CUDA-graph replays of 20 calls. Every variant is checked on a poisoned output against fp64 products
of the fp16-rounded operands.

    PYTHONPATH=src python3 benchmarks/experiments/fp32_weights_tma_037.py [--tokens 128,256,512]
    ... --compile-only    # on any machine: the engine's fp32-A variants for sm_90, their resources
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from common import replay_us
from triton.experimental.gluon import language as gl

from backfuse.kernels.gluon.gemm import gemm_kernel
from backfuse.ops.gemma3_core.spec import HIDDEN, Q_OUT, QKV

COPIES = 4
TILES = [(64, 64, 4), (64, 32, 8), (128, 64, 4), (128, 32, 8)]  # (BN, BK, STAGES); BM = 128
SPLITS = (1, 2, 3, 4, 5, 6)
MAXNREG = 168
# name: (M, K, A K-major?)   A is [M, K] or stored [K, M]; B is always the tokens' [T, K] fp16 rows
PRODUCTS = {"[q|k|v]": (QKV, HIDDEN, True), "dA": (Q_OUT, HIDDEN, False), "grad_hidden": (HIDDEN, QKV, False)}


def layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def compile_only():
    from backfuse.kernels.gluon.sm90 import compile_sm90, descriptor_type, usage
    for (bn, bk, stages), a_kmajor in itertools.product(TILES, (True, False)):
        a_block = [128, bk] if a_kmajor else [bk, 128]
        kernel = compile_sm90(gemm_kernel, dict(
            a_desc=descriptor_type(gl.float32, a_block), b_desc=descriptor_type(gl.float16, [bn, bk]),
            c_ptr="*fp32", stride_cm="i32", M="i32", N="i32", K="i32", splits="i32"),
            dict(A_KMAJOR=a_kmajor, A_REGS=True, B_KMAJOR=True, STAGES=stages), num_warps=4, maxnreg=MAXNREG)
        print(f"A {'K' if a_kmajor else 'M'}-major BN {bn:3d} BK {bk} stages {stages}: {usage(kernel)}", flush=True)


def main():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,256,512")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    wqkv = [torch.randn(QKV, HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5 for _ in range(COPIES)]
    wo = [torch.randn(HIDDEN, Q_OUT, device="cuda", generator=gen) * Q_OUT ** -0.5 for _ in range(COPIES)]
    wqkv16, wo16 = torch.empty_like(wqkv[0], dtype=torch.float16), torch.empty_like(wo[0], dtype=torch.float16)
    weights = {"[q|k|v]": wqkv, "dA": wo, "grad_hidden": wqkv}
    summary = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        print(f"\ntokens {tokens}", flush=True)
        acts = {name: torch.randn(tokens, k, device="cuda", generator=gen).half()
                for name, (m, k, _) in PRODUCTS.items()}
        # today: the fp16 copies (contiguous casts: a lower bound on our pack's share) and cuBLAS on them
        cast_qkv = replay_us([lambda w=w: wqkv16.copy_(w) for w in wqkv])
        cast_wo = replay_us([lambda w=w: wo16.copy_(w) for w in wo])
        outs = {name: torch.empty(tokens, m, device="cuda") for name, (m, k, _) in PRODUCTS.items()}
        cublas = {
            "[q|k|v]": replay_us([lambda: torch.mm(acts["[q|k|v]"], wqkv16.T, out_dtype=torch.float32,
                                                   out=outs["[q|k|v]"])]),
            "dA": replay_us([lambda: torch.mm(acts["dA"], wo16, out_dtype=torch.float32, out=outs["dA"])]),
            "grad_hidden": replay_us([lambda: torch.mm(acts["grad_hidden"], wqkv16, out_dtype=torch.float32,
                                                       out=outs["grad_hidden"])]),
        }
        print(f"  casts: Wqkv {cast_qkv:6.1f} us, Wo {cast_wo:6.1f} us; cuBLAS fp16: "
              + ", ".join(f"{k} {v:6.1f}" for k, v in cublas.items()), flush=True)
        best = {}
        for name, (m, k, a_kmajor) in PRODUCTS.items():
            act = acts[name]
            ws = weights[name]
            ref = act.double() @ (ws[0].half().double().T if a_kmajor else ws[0].half().double())  # [T, m]
            ref_t = ref.T.float()
            out_t = torch.empty(m, tokens, device="cuda")
            rows = []
            for (bn, bk, stages), splits in itertools.product(TILES, SPLITS):
                if bn > max(64, triton.next_power_of_2(tokens)):
                    continue
                tiles = triton.cdiv(m, 128) * triton.cdiv(tokens, bn) * splits
                a_block = [128, bk] if a_kmajor else [bk, 128]
                a_descs = [TensorDescriptor.from_tensor(w, a_block, layout(a_block, gl.float32)) for w in ws]
                b_desc = TensorDescriptor.from_tensor(act, [bn, bk], layout([bn, bk], gl.float16))

                def call(a_desc, splits=splits, tiles=tiles, stages=stages):
                    if splits > 1:
                        out_t.zero_()
                    gemm_kernel[(min(sms, tiles),)](a_desc, b_desc, out_t, out_t.stride(0), m, tokens, k, splits,
                                                    A_KMAJOR=a_kmajor, A_REGS=True, B_KMAJOR=True, STAGES=stages,
                                                    num_warps=4, maxnreg=MAXNREG)
                label = f"BN {bn:3d} BK {bk} st {stages} split {splits} ({tiles} tiles)"
                try:
                    out_t.fill_(float("nan"))
                    call(a_descs[0])
                    torch.cuda.synchronize()
                    err = ((out_t - ref_t).abs().max() / ref_t.abs().max()).item()
                    ok = err < 1e-3
                    us = replay_us([lambda d=d: call(d) for d in a_descs]) if ok else float("nan")
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile or launch is a result
                    print(f"  {name:11s} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append((us, label, ok, err))
            rows.sort(key=lambda r: (not r[2], r[0]))
            for us, label, ok, err in rows[:4]:
                gbs = m * k * 4 / us / 1e3
                print(f"  {name:11s} {label:40s} {us:6.1f} us  {gbs:5.0f} GB/s of fp32 weight  "
                      f"err {err:.1e}{'' if ok else '  WRONG'}", flush=True)
            bad = [r for r in rows if not r[2]]
            if bad:
                print(f"  {name:11s} {len(bad)} variants WRONG, e.g. {bad[0][1]} err {bad[0][3]:.1e}")
            best[name] = rows[0][0] if rows and rows[0][2] else float("nan")
        today = cast_qkv + cast_wo + sum(cublas.values())
        direct = sum(best.values())
        summary.append((tokens, today, direct, best, cublas))
        print(f"  sum today (casts + cuBLAS) {today:6.1f} us, direct {direct:6.1f} us", flush=True)
    print("\nsummary (us): tokens | today: casts + cuBLAS [q|k|v], dA, grad_hidden | direct: [q|k|v], dA, "
          "grad_hidden")
    for tokens, today, direct, best, cublas in summary:
        print(f"{tokens:5d} | {today:6.1f}: " + ", ".join(f"{v:5.1f}" for v in cublas.values())
              + f" | {direct:6.1f}: " + ", ".join(f"{v:5.1f}" for v in best.values()))


if __name__ == "__main__":
    main()
