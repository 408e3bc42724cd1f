"""Issue 23, item 3's "no separate weight conversion where the products are byte-bound", for 037's
small cases on its cuBLAS path: the products that read the weights ([q | k | v] = X [Wq; Wk; Wv]^T,
dA = grad_output Wo, grad_hidden = G [Wq; Wk; Wv]) as TF32 cuBLAS products straight from the fp32
inputs, against today's fp16 weight copies (the pack's 100 MB of fp32 read, 50 MB written) and fp16
products on them. The products that read no weight (grad_W = G^T X, grad_Wo = grad_output^T A) are
the same either way and left out.

    PYTHONPATH=src python3 benchmarks/experiments/tf32_weights_037.py [--tokens 128,256,512]

Prediction (written before any run): at 128 tokens these products are bound by the weights' bytes.
fp16: copies 150 MB (≈ 35 µs) + products reading 50 + 31 MB (≈ 19 µs) ≈ 54 µs; TF32: 100 + 63 MB
(≈ 38 µs), −15 µs. At 512 tokens TF32's half rate (≈ 26 GFLOP at ≈ 350 TFLOP/s ≈ 75 µs against
≈ 40 + 35 µs) leaves it even or behind. Errors: TF32 keeps fp16's 10-bit mantissa (cuBLAS may
truncate rather than round: up to 2x fp16's rounding error), against the fp64 products.
Times: whole sequences replayed in a CUDA graph (no host time), best of 5.
"""

import argparse

import torch
from common import replay_ms

Q_OUT, KV_OUT, HIDDEN = 3072, 1024, 3072


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,256,512")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    s = (2 / 3072) ** 0.5
    wq, wk, wv, wo = (torch.randn(n, HIDDEN, device=dev) * s for n in (Q_OUT, KV_OUT, KV_OUT, Q_OUT))
    wqkv16, wo_t16 = torch.empty(Q_OUT + 2 * KV_OUT, HIDDEN, device=dev, dtype=torch.float16), \
        torch.empty(HIDDEN, Q_OUT, device=dev, dtype=torch.float16)
    matmul = torch.backends.cuda.matmul
    print(f"{'tokens':>6} {'variant':<34} {'us':>8} {'err qkv':>9} {'err dA':>9} {'err grad_x':>10}")
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, HIDDEN, device=dev) / HIDDEN ** 0.5
        go = torch.randn(t, HIDDEN, device=dev)
        g = torch.randn(t, Q_OUT + 2 * KV_OUT, device=dev) * 1e-2
        x16, go16, g16 = x.half(), go.half(), g.half()
        qk32, da32, gx32 = (torch.empty(t, n, device=dev) for n in (Q_OUT + 2 * KV_OUT, Q_OUT, HIDDEN))
        da16 = torch.empty(t, Q_OUT, device=dev, dtype=torch.float16)
        w64 = torch.cat([wq, wk, wv]).double()
        ref_qkv, ref_da, ref_gx = x.double() @ w64.T, go.double() @ wo.double(), g.double() @ w64

        def cast():
            wqkv16[:Q_OUT].copy_(wq)
            wqkv16[Q_OUT:Q_OUT + KV_OUT].copy_(wk)
            wqkv16[Q_OUT + KV_OUT:].copy_(wv)
            wo_t16.copy_(wo.T)

        def fp16_products():
            torch.mm(x16, wqkv16.T, out_dtype=torch.float32, out=qk32)
            torch.mm(go16, wo_t16.T, out=da16)
            torch.mm(g16, wqkv16, out_dtype=torch.float32, out=gx32)

        def fp16_path():
            cast()
            fp16_products()

        def tf32_products():
            for w, lo, hi in ((wq, 0, Q_OUT), (wk, Q_OUT, Q_OUT + KV_OUT), (wv, Q_OUT + KV_OUT, Q_OUT + 2 * KV_OUT)):
                torch.mm(x, w.T, out=qk32[:, lo:hi])
            torch.mm(go, wo, out=da32)
            torch.mm(g[:, :Q_OUT], wq, out=gx32)
            gx32.addmm_(g[:, Q_OUT:Q_OUT + KV_OUT], wk).addmm_(g[:, Q_OUT + KV_OUT:], wv)

        matmul.allow_fp16_reduced_precision_reduction = False
        for name, fn, tf32 in (("fp16: cast + products", fp16_path, False), ("fp16: cast only", cast, False),
                               ("fp16: products only", fp16_products, False),
                               ("tf32: products from fp32", tf32_products, True)):
            matmul.allow_tf32 = tf32
            qk32.fill_(float("nan"))
            da32.fill_(float("nan"))
            da16.fill_(float("nan"))
            gx32.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            errs = ("", "", "")
            if fn is not cast:
                errs = (f"{rel_err(qk32, ref_qkv):.2e}", f"{rel_err(da32 if tf32 else da16, ref_da):.2e}",
                        f"{rel_err(gx32, ref_gx):.2e}")
            us = 1e3 * replay_ms(fn)
            print(f"{t:6d} {name:<34} {us:8.1f} {errs[0]:>9} {errs[1]:>9} {errs[2]:>10}")
        # the kernels of one TF32 call (a column-slice output copied through a temporary would show as a copy)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tf32_products()
            torch.cuda.synchronize()
        matmul.allow_tf32 = False
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{t:6d} tf32 kernels: {len(names)}: " + "; ".join(n[:50] for n in names))

if __name__ == "__main__":
    main()
