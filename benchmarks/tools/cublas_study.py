"""The dynamic loop's products by cuBLAS called at raw addresses: is torch's dispatch the host time a template's
product step costs, and can the same cuBLAS kernels be had without it?

A template's product step makes three `as_strided` views and calls torch's `mm(out=)` (`train/program.py:
_reproduct`): 19.9 us of host a call where a re-aimed Triton launch costs 4.7 (s53-1, an H100 lease's host). A
Triton product gave that host time back but cost 1.04-2.24x cuBLAS's GPU time (`products_study.py`). Here the
same product is `cublasGemmEx` through ctypes on torch's own handle (`torch.cuda.current_blas_handle()` sets the
current stream and torch's workspace for it), aimed at the operands' addresses: no views, no dispatch
(`backfuse/kernels/cublas.py`, which the templates' plain products now use).

    PYTHONPATH=src python3 benchmarks/tools/cublas_study.py            # on a GPU: the table below

For each of Gemma 3 4B's four product forms at the loop's token counts (bf16, and the fp32 path's fp16 operands
into an fp32 product), it prints torch's GPU time and the call's by address (CUDA events), the largest difference
between their results (0: the same kernel's bits), and the host time of a call: the template's views and torch's
product, the handle alone, and the call by address. (`tests/test_cublas.py` checks the argument mapping on the
CPU, through an emulation of cublasGemmEx's semantics.)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backfuse.kernels import cublas


def forms(tokens: int, device, dtype, out_dtype=None) -> list:
    """(name, a, b, c, accumulate) at Gemma 3 4B's widths (`products_study.forms`' four), c in out_dtype."""
    g = torch.Generator(device).manual_seed(tokens)
    out_dtype = out_dtype or dtype

    def r(*shape, dt=dtype):
        return (torch.randn(*shape, device=device, generator=g) / shape[-1] ** 0.5).to(dt)
    x, wq, wk, dqkv = r(tokens, 2560), r(2048, 2560), r(1024, 2560), r(tokens, 4096)
    return [("q = x Wq^T", x, wq.T, torch.empty(tokens, 2048, device=device, dtype=out_dtype), False),
            ("dx = dq Wq", dqkv[:, :2048], wq, torch.empty(tokens, 2560, device=device, dtype=out_dtype), False),
            ("dx += dk Wk", dqkv[:, 2048:3072], wk, r(tokens, 2560, dt=out_dtype), True),
            ("dWqkv = dqkv^T x", dqkv.T, x, torch.empty(4096, 2560, device=device, dtype=out_dtype), False)]


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


def host_us(fn, calls: int = 300) -> float:
    """The least of three rounds' host time a call, the GPU left to catch up between rounds."""
    best = float("inf")
    for _ in range(3):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def study(token_counts, out_json) -> None:
    x = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)  # torch loads cuBLAS at its first product
    if cublas.library().gemm is None:
        raise SystemExit("cublas_study: no libcublas found among this process's libraries")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    print("| T | form | dtypes | torch us | by address us | max abs diff | host us: views + torch | handle | by address |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens in token_counts:
        for dtype, out_dtype in ((torch.bfloat16, None), (torch.float16, torch.float32)):
            for name, a, b, c, accumulate in forms(tokens, "cuda", dtype, out_dtype):
                mixed = c.dtype != a.dtype
                addend = c.clone()

                def by_torch(x=a, y=b, z=c):
                    if accumulate:
                        torch.addmm(z, x, y, out=z)
                    elif mixed:
                        torch.mm(x, y, out_dtype=z.dtype, out=z)
                    else:
                        torch.mm(x, y, out=z)
                if mixed and accumulate:
                    continue  # the fp32 path accumulates in its operands' dtype (`program.accumulate`)
                at = cublas.gemm(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), c.stride(), a.dtype, c.dtype,
                                 accumulate)
                pointers = (a.data_ptr(), b.data_ptr(), c.data_ptr())
                theirs_us, ours_us = gpu_us(by_torch), gpu_us(lambda: at(*pointers))
                c.copy_(addend)
                by_torch()
                want = c.clone()
                c.copy_(addend)
                at(*pointers)
                diff = (c.float() - want.float()).abs().max().item()

                bases = [torch.empty(0, dtype=t.dtype, device="cuda").set_(t.untyped_storage()) for t in (a, b, c)]
                views = [(t.shape, t.stride(), t.storage_offset()) for t in (a, b, c)]

                def template_step():
                    x, y, z = (base.as_strided(*v) for base, v in zip(bases, views))
                    by_torch(x, y, z)
                row = dict(tokens=tokens, form=name, dtypes=f"{str(a.dtype)[6:]} -> {str(c.dtype)[6:]}",
                           torch_us=round(theirs_us, 1), by_address_us=round(ours_us, 1), max_abs_diff=diff,
                           host_template_us=round(host_us(template_step), 1),
                           host_handle_us=round(host_us(torch.cuda.current_blas_handle), 2),
                           host_by_address_us=round(host_us(lambda: at(*pointers)), 1))
                rows.append(row)
                print(f"| {tokens} | {name} | {row['dtypes']} | {theirs_us:.1f} | {ours_us:.1f} | {diff:.1e} | "
                      f"{row['host_template_us']} | {row['host_handle_us']} | {row['host_by_address_us']} |", flush=True)
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,2048,8192", help="token counts, comma-separated")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublas_study: needs a GPU (tests/test_cublas.py checks the arguments on the CPU)")
    study([int(t) for t in args.tokens.split(",")], args.json)


if __name__ == "__main__":
    main()
