"""Would 021's gradient launch be shorter on the Gluon engine? Its six products at the small cases'
shapes, on fp16 operands as the fused path has them after the attention:

    grad_video = dQ Wq16            A K-major [TV, 1024],  B N-major [1024, 1024]
    grad_text  = [dK | dV] [Wk; Wv]16   A K-major [TT, 2048],  B N-major [2048, 1024]
    grad_Wq = dQ^T video16, grad_Wo = grad_output^T C     A M-major (K = TV tokens)
    grad_Wk = dK^T text16,  grad_Wv = dV^T text16         A M-major (K = TT tokens)

Our Triton gradient launch does all six (and the bias sums) in one launch: 15.5 µs alone on case 8
(1/512/77) and 16.0 in its call (notes/021.md row 38), ≈ 3.6 GFLOP, ≈ 230 TFLOP/s. The engine
(kernels/gluon/gemm.py: persistent, TMA ring, two consumer warpgroups) reached 630-660 TFLOP/s on
large products (gluon.md's gate). Timed here, each as CUDA-graph replays: the six as engine launches
one after another, the six as engine launches on six streams at once (what one grouped launch of
all their tiles could approach), and cuBLAS's six one after another; K split as the plan would split
our tiles (`choose_splits`, outputs zeroed by memsets inside the timed graph where split).

Prediction (written before the run): at 512 video tokens each engine launch ≈ 3-5 µs (a ramp of
≈ 2 µs and ≤ 1.1 GFLOP at ≈ 500 TFLOP/s), one after another ≈ 20-25 µs; on six streams ≈ 8-10 µs:
a grouped Gluon launch would take ≈ 5-7 µs off the small cases' 16 µs gradient step.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_gradients_021.py [--cases 8,12,2,13]
"""

from __future__ import annotations

import argparse

import torch
import triton
from common import replay_us
from triton.experimental.gluon import language as gl

from backfuse.kernels.gluon.gemm import gemm_kernel
from backfuse.kernels.schedule import choose_splits

H = 1024
BM, BN, BK, STAGES = 128, 128, 64, 4


def main():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    import backfuse
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="8,12,2,13")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), flush=True)
    prob = backfuse.problem("021")

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.float16))

    for case in (int(c) for c in args.cases.split(",")):
        a = prob.workloads[case].axes
        tv, tt = a["batch_size"] * a["num_video_tokens"], a["batch_size"] * a["num_text_tokens"]
        r = lambda *s: (torch.randn(*s, device="cuda") / s[-1] ** 0.25).half()  # noqa: E731
        dq, dkv, go, video, text, ctx = r(tv, H), r(tt, 2 * H), r(tv, H), r(tv, H), r(tt, H), r(tv, H)
        wq, wkv = r(H, H), r(2 * H, H)
        dk, dv = dkv[:, :H], dkv[:, H:]
        # (name, A, A K-major?, B, M, N, K)
        products = [("grad_video", dq, True, wq, tv, H, H), ("grad_text", dkv, True, wkv, tt, H, 2 * H),
                    ("grad_Wq", dq, False, video, H, H, tv), ("grad_Wo", go, False, ctx, H, H, tv),
                    ("grad_Wk", dk, False, text, H, H, tt), ("grad_Wv", dv, False, text, H, H, tt)]
        splits = choose_splits([(m, n, k) for *_, m, n, k in products], BM, BN, BK, sms)
        outs = [torch.empty(m, n, device="cuda") for *_, m, n, _ in products]
        refs = [(op.float() if akm else op.float().T) @ b.float() for (_, op, akm, b, *_) in products]
        flop = sum(2 * m * n * k for *_, m, n, k in products)
        launches = []
        for (name, op, akm, b, m, n, k), split, c in zip(products, splits, outs):
            a_d = desc(op, [BM, BK] if akm else [BK, BM])
            b_d = desc(b, [BK, BN])
            tiles = triton.cdiv(m, BM) * triton.cdiv(n, BN) * split

            def engine(a_d=a_d, b_d=b_d, c=c, m=m, n=n, k=k, split=split, tiles=tiles, akm=akm):
                if split > 1:
                    c.zero_()
                gemm_kernel[(min(sms, tiles),)](a_d, b_d, c, n, m, n, k, split, A_KMAJOR=akm, A_REGS=False,
                                                B_KMAJOR=False, STAGES=STAGES, num_warps=4, maxnreg=168)
            launches.append(engine)

        def cublas():
            for (_, op, akm, b, *_), c in zip(products, outs):
                torch.mm(op if akm else op.T, b, out_dtype=torch.float32, out=c)

        streams = [torch.cuda.Stream() for _ in launches]

        def on_streams():
            start = torch.cuda.Event()
            start.record()
            for s, launch in zip(streams, launches):
                s.wait_event(start)
                with torch.cuda.stream(s):
                    launch()
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)

        def serial():
            for launch in launches:
                launch()

        print(f"case {case} {a}: splits {splits}, {flop / 1e9:.2f} GFLOP", flush=True)
        for label, fn in (("engine, one after another", serial), ("engine, six streams", on_streams),
                          ("cuBLAS, one after another", cublas)):
            for c in outs:
                c.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = max(((c - ref).abs().max() / ref.abs().max()).item() for c, ref in zip(outs, refs))
            us = replay_us([fn])
            print(f"  {label:28s} {us:6.1f} us  {flop / us / 1e6:5.0f} TFLOP/s  err {err:.1e}"
                  f"{'' if err < 1e-3 else '  WRONG'}", flush=True)
        for (name, *_), launch in zip(products, launches):
            print(f"    {name:10s} alone {replay_us([launch]):5.1f} us", flush=True)


if __name__ == "__main__":
    main()
