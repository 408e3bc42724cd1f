"""Issue 23, item 3 ("no separate weight conversion where the products are byte-bound"), a form not
yet measured: 037's weight products at few tokens read the fp32 weights themselves, converted to
fp16 in registers and fed to wgmma as its register operand (A), the tokens as the shared-memory
operand (B). Rows 30 and 38 of notes/037.md measured TF32 products from fp32 (half rate, twice the
shared-memory bytes: rejected); gluon.md's gate (b) measured fp32 A in registers at 0.67-0.77 of the
fp16 engine on compute-bound shapes. At 128-512 tokens these products are bound by the weights'
bytes, not by the tensor cores, so neither verdict settles them.

    out[t, n] = sum_k X[t, k] W(n, k)          computed as  out^T = W(fp16) . X^T

    [q | k | v] = X [Wq; Wk; Wv]^T   W(n, k) = Wqkv[n, k]     (K-major rows: [5120, 3072])
    dA          = grad_output Wo     W(n, k) = Wo[k, n]        (N-major: [3072, 3072])

Today (d21a88a) each weight is read in fp32 by the pack, written in fp16, and read again by cuBLAS:
at 128 tokens [Wq; Wk; Wv] costs 63 MB read + 31 MB written + 31 MB read, and dA's Wo 38 + 19 + 19.
Read directly: 63 MB and 38 MB (+ 31 MB written where grad_hidden still needs [Wq; Wk; Wv] in fp16:
`copy`). Prediction (written before any run): bound by the fp32 reads at ≈ 3.5-4 TB/s, [q | k | v]
≈ 17-19 µs (22-26 with the copy) against ≈ 24 (cast) + 10-15 (product) today; dA ≈ 10-11 µs
against ≈ 14 + 7-10. So −10..15 µs on the 128-token chain of case 8 if the pipelined fp32 loads
stream at that rate; at 512 tokens (4 token tiles re-reading each weight tile, from L2 if
neighbours) less or nothing.

    PYTHONPATH=src python3 benchmarks/experiments/fp32_weights_direct_037.py [--tokens 128,256,512]
    ... --compile-only    # on any machine: each variant for sm_90, its resources
"""

import argparse

import torch
import triton
import triton.language as tl
from common import replay_ms

QKV, HIDDEN, Q_OUT = 5120, 3072, 3072


@triton.jit
def weight_product_kernel(w, x, out, w16, T, N: tl.constexpr, K: tl.constexpr, N_MAJOR: tl.constexpr,
                          BM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                          COPY: tl.constexpr):
    """out[t, n] (+)= sum_k x[t, k] W(n, k) for t < T: W(n, k) = w[n, k] ([N, K] row-major) or, N_MAJOR,
    w[k, n] ([K, N] row-major), read in fp32 and rounded to fp16 in registers. One program per BM
    weight rows, BT tokens (fastest: neighbours share the weight tile in L2) and K slice of K / SPLIT
    (SPLIT > 1: fp32 atomics into a zeroed out). COPY: the fp16 tile also stored to w16 (w's layout),
    by the first token tile only."""
    pid = tl.program_id(0)
    t_tiles = tl.cdiv(T, BT)
    ks = pid % SPLIT
    tile = pid // SPLIT
    t0 = (tile % t_tiles) * BT
    m0 = (tile // t_tiles) * BM
    rm = m0 + tl.arange(0, BM)
    rt = t0 + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BT), tl.float32)
    for k in range(ks * (K // SPLIT), (ks + 1) * (K // SPLIT), BK):
        if N_MAJOR:
            offs = (k + rk)[None, :].to(tl.int64) * N + rm[:, None]
        else:
            offs = rm[:, None].to(tl.int64) * K + (k + rk)[None, :]
        a = tl.load(w + offs).to(tl.float16)
        if COPY:
            if t0 == 0:
                tl.store(w16 + offs, a)
        b = tl.load(x + rt[None, :].to(tl.int64) * K + (k + rk)[:, None], mask=rt[None, :] < T, other=0.0)
        acc = tl.dot(a, b, acc)
    ptrs = out + rt[None, :].to(tl.int64) * N + rm[:, None]
    if SPLIT > 1:
        tl.atomic_add(ptrs, acc, mask=rt[None, :] < T, sem="relaxed")
    else:
        tl.store(ptrs, acc, mask=rt[None, :] < T)


# name: (BM, BT, BK, SPLIT, warps, stages)
VARIANTS = {
    "64x128x64 s1 w4 st4": (64, 128, 64, 1, 4, 4),
    "64x128x64 s2 w4 st4": (64, 128, 64, 2, 4, 4),
    "64x128x64 s3 w4 st4": (64, 128, 64, 3, 4, 4),
    "128x128x64 s2 w8 st3": (128, 128, 64, 2, 8, 3),
    "128x128x32 s3 w8 st5": (128, 128, 32, 3, 8, 5),
    "64x128x32 s2 w4 st6": (64, 128, 32, 2, 4, 6),
}


def grid(tokens, n, bm, bt, split):
    return (triton.cdiv(n, bm) * triton.cdiv(tokens, bt) * split,)


def compile_only():
    from triton.compiler import ASTSource

    from backfuse.kernels.gluon.sm90 import SM90, usage
    sig = {"w": "*fp32", "x": "*fp16", "out": "*fp32", "w16": "*fp16", "T": "i32"} | {
        c: "constexpr" for c in ("N", "K", "N_MAJOR", "BM", "BT", "BK", "SPLIT", "COPY")}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    for n_major in (False, True):
        for name, (bm, bt, bk, split, warps, stages) in VARIANTS.items():
            src = ASTSource(weight_product_kernel, sig, attrs=attrs, constexprs=dict(
                N=QKV, K=HIDDEN, N_MAJOR=n_major, BM=bm, BT=bt, BK=bk, SPLIT=split, COPY=True))
            kernel = triton.compile(src, target=SM90, options=dict(num_warps=warps, num_stages=stages))
            sass_ldgsts = "cp.async" in kernel.asm["ptx"]
            print(f"{'N-major' if n_major else 'K-major'} {name:24s}", usage(kernel), f"cp.async {sass_ldgsts}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="128,256,512")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    wqkv = torch.randn(QKV, HIDDEN, device=dev, generator=gen) * HIDDEN ** -0.5
    wo = torch.randn(HIDDEN, Q_OUT, device=dev, generator=gen) * Q_OUT ** -0.5
    wqkv16, wo16 = torch.empty_like(wqkv, dtype=torch.float16), torch.empty_like(wo, dtype=torch.float16)
    for tokens in (int(t) for t in args.tokens.split(",")):
        x16 = torch.randn(tokens, HIDDEN, device=dev, generator=gen).half()
        go16 = torch.randn(tokens, HIDDEN, device=dev, generator=gen).half()
        print(f"tokens {tokens}", flush=True)
        for what, w, w16, a16, n, n_major, copies in (
                ("[q|k|v]", wqkv, wqkv16, x16, QKV, False, (False, True)),
                ("dA", wo, wo16, go16, Q_OUT, True, (False,))):
            ref = a16.double() @ (w.half().double().T if not n_major else w.half().double())
            out = torch.empty(tokens, n, device=dev)

            def today(w=w, w16=w16, a16=a16, out=out, n_major=n_major):
                w16.copy_(w)
                torch.mm(a16, w16.T if not n_major else w16, out_dtype=torch.float32, out=out)
            cast_ms = replay_ms(lambda w=w, w16=w16: w16.copy_(w))
            ms = replay_ms(today)
            out.fill_(float("nan"))
            today()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            print(f"  {what:8s} cast + cuBLAS          {ms * 1e3:6.1f} us (cast {cast_ms * 1e3:5.1f})  err {err:.1e}", flush=True)
            for name, (bm, bt, bk, split, warps, stages) in VARIANTS.items():
                for copy in copies:
                    def ours(w=w, w16=w16, a16=a16, out=out, n=n, n_major=n_major, copy=copy, bm=bm, bt=bt, bk=bk,
                             split=split, warps=warps, stages=stages):
                        if split > 1:
                            out.zero_()
                        weight_product_kernel[grid(tokens, n, bm, bt, split)](
                            w, a16, out, w16, tokens, N=n, K=HIDDEN, N_MAJOR=n_major, BM=bm, BT=bt, BK=bk, SPLIT=split,
                            COPY=copy, num_warps=warps, num_stages=stages)
                    try:
                        out.fill_(float("nan"))
                        w16.zero_()
                        ours()
                        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                        copied = (not copy) or torch.equal(w16, w.half())
                        ms = replay_ms(ours)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {what:8s} {name:22s} copy={int(copy)} ERR {type(e).__name__}: {str(e)[:100]}")
                        continue
                    print(f"  {what:8s} {name:22s} copy={int(copy)} {ms * 1e3:6.1f} us  err {err:.1e}"
                          f"{'' if copied else '  COPY WRONG'}", flush=True)


if __name__ == "__main__":
    main()
