"""The dynamic loop's products by cuBLAS against a Triton product launched by address: is the host time a
template saves worth the GPU time a Triton product may lose? (notes/training.md, session 52: a product's
template step costs 36-46 us of host against 8-11 for a Triton launch's, ~30 % of the packed loop's host.)

    PYTHONPATH=src python3 benchmarks/tools/products_study.py            # on a GPU: the table below
    PYTHONPATH=src python3 benchmarks/tools/products_study.py --check    # on the CPU: the kernel in the interpreter

The forms are Gemma 3 4B's, the tokens T the loop's (512-8192): the q projection x Wq^T, the input gradient dq Wq
(and its accumulation dk Wk), and the q/k/v weight gradients dqkv^T x in one product. For each: cuBLAS's time
(`torch.mm`/`addmm` into the output, CUDA events), the Triton product's at a few tile configurations, its error
against an fp32 product, and the host time a call of each costs as a template runs it: three `as_strided` views
and torch's product, against one prepared launch re-aimed at the same addresses (`Launch.at`).

Two kernel families, each at four tiles. With masks that vary along the K loop, or lie along an operand's
contiguous axis at a runtime bound, Triton 3.6 does not pipeline the loop (compiled for sm_90 on the CPU: one
shared stage, no LDGSTS); each family avoids them its own way, and every form compiles to 3-4 stages:
- "tma" (`product_kernel`) reads both operands through TMA descriptors made on the device, so rows and columns
  past the bounds read zeros without masks. Its per-program descriptors live in global scratch that a prepared
  launch keeps: a template shared by two streams would race on it;
- "loads" (`loads_product_kernel`) loads with cp.async, runs the K loop unmasked to the last whole block and
  masks one more step, and drops the masks along M or N where those are multiples of the tile (the model's
  widths; the tokens axis is never an operand's contiguous one in these forms). No scratch.
They are a study's kernels: one moves into `kernels/` only if it wins here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if "--check" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit(do_not_specialize=["M", "N", "K"])
def product_kernel(a, b, c, M, N, K, LDA: tl.constexpr, LDB: tl.constexpr, LDC: tl.constexpr, A_T: tl.constexpr,
                   B_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                   ACC: tl.constexpr):
    """C[M, N] (+ C where ACC) = A[M, K] @ B[K, N] with fp32 sums, rounded once to C's dtype. A is stored
    row-major [M, K] (rows LDA elements apart) or, A_T, as A^T [K, M]; B row-major [K, N] or, B_T, as B^T [N, K];
    C row-major, rows LDC apart. Programs take tiles in groups of GROUP row blocks (each group's B columns stay
    in L2)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    width = GROUP * tiles_n
    first_m = (pid // width) * GROUP
    size = tl.minimum(tiles_m - first_m, GROUP)
    off_m = (first_m + (pid % width) % size) * BM
    off_n = ((pid % width) // size) * BN
    if A_T:
        a_desc = tl.make_tensor_descriptor(a, shape=[K, M], strides=[LDA, 1], block_shape=[BK, BM])
    else:
        a_desc = tl.make_tensor_descriptor(a, shape=[M, K], strides=[LDA, 1], block_shape=[BM, BK])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b, shape=[N, K], strides=[LDB, 1], block_shape=[BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b, shape=[K, N], strides=[LDB, 1], block_shape=[BK, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, K, BK):
        if A_T:
            x = a_desc.load([k, off_m]).T
        else:
            x = a_desc.load([off_m, k])
        if B_T:
            y = b_desc.load([off_n, k]).T
        else:
            y = b_desc.load([k, off_n])
        acc = tl.dot(x, y, acc)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    ptrs = c + rm[:, None].to(tl.int64) * LDC + rn[None, :]
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if ACC:
        acc += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(c.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M", "N", "K"])
def loads_product_kernel(a, b, c, M, N, K, SAM: tl.constexpr, SAK: tl.constexpr, SBK: tl.constexpr,
                         SBN: tl.constexpr, LDC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP: tl.constexpr, ACC: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """`product_kernel`'s product with plain loads (cp.async; no scratch): A [M, K] and B [K, N] at any strides,
    C row-major. EVEN_M, EVEN_N: M, N multiples of BM, BN (the host checks), so no mask lies along an operand's
    contiguous axis where that is M or N (a weight gradient's A^T, B row-major); the K loop runs unmasked to the
    last whole block and masks one more (masks varying along the loop, or along a contiguous axis at a runtime
    bound, keep Triton 3.6 from pipelining it)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    width = GROUP * tiles_n
    first_m = (pid // width) * GROUP
    size = tl.minimum(tiles_m - first_m, GROUP)
    off_m = (first_m + (pid % width) % size) * BM
    off_n = ((pid % width) // size) * BN
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a + rm[:, None].to(tl.int64) * SAM + rk[None, :].to(tl.int64) * SAK
    b_ptrs = b + rk[:, None].to(tl.int64) * SBK + rn[None, :].to(tl.int64) * SBN
    m_ok = (rm[:, None] < M) | EVEN_M
    n_ok = (rn[None, :] < N) | EVEN_N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    main = K - K % BK
    for k in tl.range(0, main, BK):
        if EVEN_M:
            x = tl.load(a_ptrs)
        else:
            x = tl.load(a_ptrs, mask=m_ok, other=0.0)
        if EVEN_N:
            y = tl.load(b_ptrs)
        else:
            y = tl.load(b_ptrs, mask=n_ok, other=0.0)
        acc = tl.dot(x, y, acc)
        a_ptrs += BK * SAK
        b_ptrs += BK * SBK
    if main < K:
        x = tl.load(a_ptrs, mask=m_ok & ((main + rk)[None, :] < K), other=0.0)
        y = tl.load(b_ptrs, mask=((main + rk)[:, None] < K) & n_ok, other=0.0)
        acc = tl.dot(x, y, acc)
    ptrs = c + rm[:, None].to(tl.int64) * LDC + rn[None, :]
    ok = m_ok & n_ok
    if ACC:
        acc += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(c.dtype.element_ty), mask=ok)


CONFIGS = {"128x128x64 w8 s4": (128, 128, 64, 8, 4), "128x256x64 w8 s3": (128, 256, 64, 8, 3),
           "128x128x64 w4 s4": (128, 128, 64, 4, 4), "64x128x64 w4 s4": (64, 128, 64, 4, 4)}


def layout(a, b, c) -> dict:
    """The kernel's layout arguments for the views a [M, K], b [K, N], c [M, N] (each with a unit stride)."""
    a_t, b_t = a.stride(1) != 1, b.stride(1) != 1
    if c.stride(1) != 1 or (a.stride(0) if a_t else a.stride(1)) != 1 or (b.stride(0) if b_t else b.stride(1)) != 1:
        raise ValueError("products_study: each operand needs a unit stride")
    return dict(M=a.shape[0], N=b.shape[1], K=a.shape[1], LDA=a.stride(1) if a_t else a.stride(0),
                LDB=b.stride(1) if b_t else b.stride(0), LDC=c.stride(0), A_T=a_t, B_T=b_t)


def arguments(family: str, a, b, c, accumulate: bool, cfg) -> tuple:
    """(kernel, grid, runtime arguments by name, constexprs and options) of c (+)= a @ b by a kernel family:
    "tma" (`product_kernel`) or "loads" (`loads_product_kernel`)."""
    bm, bn, bk, warps, stages = cfg
    lay = layout(a, b, c)
    grid = (triton.cdiv(lay["M"], bm) * triton.cdiv(lay["N"], bn),)
    runtime = dict(a=a, b=b, c=c, M=lay["M"], N=lay["N"], K=lay["K"])
    meta = dict(LDC=lay["LDC"], BM=bm, BN=bn, BK=bk, GROUP=8, ACC=accumulate, num_warps=warps, num_stages=stages)
    if family == "tma":
        return product_kernel, grid, runtime, dict(meta, LDA=lay["LDA"], LDB=lay["LDB"], A_T=lay["A_T"], B_T=lay["B_T"])
    return loads_product_kernel, grid, runtime, dict(meta, SAM=a.stride(0), SAK=a.stride(1), SBK=b.stride(0),
                                                      SBN=b.stride(1), EVEN_M=lay["M"] % bm == 0,
                                                      EVEN_N=lay["N"] % bn == 0)


def product(family: str, a, b, c, accumulate: bool, cfg) -> None:
    """c (+)= a @ b through the JIT."""
    kernel, grid, runtime, meta = arguments(family, a, b, c, accumulate, cfg)
    kernel[grid](**runtime, **meta)


def forms(tokens: int, device, dtype) -> list:
    """(name, a, b, c, accumulate) at Gemma 3 4B's widths."""
    g = torch.Generator(device).manual_seed(tokens)

    def r(*shape):
        return (torch.randn(*shape, device=device, generator=g) / shape[-1] ** 0.5).to(dtype)
    x, wq, wk, dqkv = r(tokens, 2560), r(2048, 2560), r(1024, 2560), r(tokens, 4096)
    return [("q = x Wq^T", x, wq.T, torch.empty(tokens, 2048, device=device, dtype=dtype), False),
            ("dx = dq Wq", dqkv[:, :2048], wq, torch.empty(tokens, 2560, device=device, dtype=dtype), False),
            ("dx += dk Wk", dqkv[:, 2048:3072], wk, r(tokens, 2560), True),
            ("dWqkv = dqkv^T x", dqkv.T, x, torch.empty(4096, 2560, device=device, dtype=dtype), False)]


def check() -> None:
    """The kernel in the interpreter at odd token counts, every form, against float64 (outputs poisoned)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    for tokens in (1, 37, 130):
        for name, a, b, c, accumulate in forms(tokens, "cpu", torch.float32):
            for rows, cols in ((200, 80), (192, 96)):  # widths off and on the tiles (EVEN_M, EVEN_N)
                x = a[:rows] if name.startswith("dW") else a[:, :96]
                y = b[:x.shape[1], :cols]
                z = c[:x.shape[0], :cols].contiguous()
                want = (z.double() if accumulate else 0) + x.double() @ y.double()
                for family in ("tma", "loads"):
                    got = z.clone() if accumulate else torch.full_like(z, float("nan"))
                    product(family, x, y, got, accumulate, (32, 32, 32, 4, 1))
                    err = ((got.double() - want).norm() / want.norm()).item()
                    print(f"T {tokens:4d} {name:18s} {tuple(got.shape)} {family:5s} rel. error {err:.1e}")
                    assert err < 1e-5, (tokens, name, family)


def gpu_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return spent


def study(token_counts, out_json) -> None:
    from backfuse.kernels.launch import scratch_allocator
    from backfuse.train import program

    kernels = {product_kernel: program.Kernel(product_kernel), loads_product_kernel: program.Kernel(loads_product_kernel)}
    variants = [(family, label) for family in ("tma", "loads") for label in CONFIGS]
    rows = []
    print("| T | form | cuBLAS us | " + " | ".join(f"{f} {c}" for f, c in variants)
          + " | best / cuBLAS | rel. error | host us: views + torch | host us: launch |")
    print("| ---: | --- | ---: | " + " | ".join("---:" for _ in variants) + " | ---: | ---: | ---: | ---: |")
    for tokens in token_counts:
        for name, a, b, c, accumulate in forms(tokens, "cuda", torch.bfloat16):
            addend = c.clone()

            def cublas():
                if accumulate:
                    torch.addmm(c, a, b, out=c)
                else:
                    torch.mm(a, b, out=c)
            times = {"cuBLAS": gpu_us(cublas)}
            with scratch_allocator():
                for family, label in variants:
                    try:
                        times[(family, label)] = gpu_us(lambda f=family, cfg=CONFIGS[label]: product(
                            f, a, b, c, accumulate, cfg))
                    except Exception as e:  # a configuration that does not fit: its cell stays empty
                        print(f"    {family} {label}: {type(e).__name__} {str(e)[:90]}", file=sys.stderr)
            best_us, (family, label) = min((t, k) for k, t in times.items() if k != "cuBLAS")
            c.copy_(addend)
            want = (addend.float() if accumulate else 0) + a.float() @ b.float()
            with scratch_allocator():
                product(family, a, b, c, accumulate, CONFIGS[label])
            err = ((c.float() - want).norm() / want.norm()).item()

            bases = [torch.empty(0, dtype=t.dtype, device="cuda").set_(t.untyped_storage()) for t in (a, b, c)]
            views = [(t.shape, t.stride(), t.storage_offset()) for t in (a, b, c)]

            def template_step():
                x, y, z = (base.as_strided(*v) for base, v in zip(bases, views))
                if accumulate:
                    torch.addmm(z, x, y, out=z)
                else:
                    torch.mm(x, y, out=z)
            fn, grid, runtime, meta = arguments(family, a, b, c, accumulate, CONFIGS[label])
            for _ in range(2):  # the first prepares a compiling launch
                launch = kernels[fn](grid, runtime, **meta)
                launch()
            full = list(launch.full)
            row = dict(tokens=tokens, form=name, us={" ".join(k) if isinstance(k, tuple) else k: round(v, 1)
                                                     for k, v in times.items()},
                       best=f"{family} {label}", ratio=round(best_us / times["cuBLAS"], 3), rel_err=err,
                       host_template_us=round(host_us(template_step), 1),
                       host_launch_us=round(host_us(lambda: launch.at(full)), 1))
            rows.append(row)
            print(f"| {tokens} | {name} | {times['cuBLAS']:.1f} | "
                  + " | ".join(f"{times[v]:.1f}" if v in times else "" for v in variants)
                  + f" | {row['ratio']:.2f} ({row['best']}) | {err:.1e} | {row['host_template_us']} | "
                  f"{row['host_launch_us']} |", flush=True)
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="the kernels in the interpreter (CPU)")
    parser.add_argument("--tokens", default="512,1124,2048,4096,8192", help="token counts, comma-separated")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        check()
    else:
        study([int(t) for t in args.tokens.split(",")], args.json)


if __name__ == "__main__":
    main()
