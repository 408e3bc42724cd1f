"""The dynamic loop's products by cuBLAS called at raw addresses: is torch's dispatch the host time a template's
product step costs, and can the same cuBLAS kernels be had without it?

A template's product step makes three `as_strided` views and calls torch's `mm(out=)` (`train/program.py:
_reproduct`): 19.9 us of host a call where a re-aimed Triton launch costs 4.7 (s53-1, an H100 lease's host). A
Triton product gave that host time back but cost 1.04-2.24x cuBLAS's GPU time (`products_study.py`). Here the
same product is `cublasGemmEx` through ctypes on torch's own handle (`torch.cuda.current_blas_handle()` sets the
current stream and torch's workspace for it), aimed at the operands' addresses: no views, no dispatch.

    PYTHONPATH=src python3 benchmarks/tools/cublas_study.py            # on a GPU: the table below
    python3 benchmarks/tools/cublas_study.py --check                   # on the CPU: the arguments, emulated

For each of Gemma 3 4B's four product forms at the loop's token counts (bf16, and the fp32 path's fp16 operands
into an fp32 product), it prints torch's GPU time and the call's by address (CUDA events), the largest difference
between their results (0: the same kernel's bits), and the host time of a call: the template's views and torch's
product, the handle alone, and the call by address. --check runs the argument mapping (row-major operands at any
of their strides, as a column-major library takes them) through an emulation of cublasGemmEx's semantics on the
CPU, every form at odd token counts, against float64.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

OP_N, OP_T = 0, 1  # cublasOperation_t
DATA_TYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}  # cudaDataType: CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F: fp32 sums
GEMM_DEFAULT = -1  # cublasGemmAlgo_t: the library's heuristic


def _column_major(t: torch.Tensor) -> tuple:
    """(op, ld) of a 2-d operand as the column-major library reads t^T (the swapped product below): a row-major
    t [r, c] (unit stride along c) is t^T column-major with leading dimension t.stride(0): op N; a column-major
    one (unit stride along r) is t itself, ld t.stride(1): op T."""
    rows, cols = t.shape
    if t.stride(1) == 1 or cols == 1:
        return OP_N, max(t.stride(0), cols, 1)
    if t.stride(0) == 1 or rows == 1:
        return OP_T, max(t.stride(1), rows, 1)
    raise ValueError(f"cublas_study: an operand of strides {t.stride()} has no unit stride")


def gemm_arguments(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple:
    """cublasGemmEx's (transa, transb, m, n, k, lda, ldb, ldc) for row-major c [M, N] = a [M, K] @ b [K, N]. The
    library is column-major, and c's row-major memory is c^T column-major, so it computes c^T = b^T a^T: its
    first operand is b, its second a, m = N, n = M."""
    (m_, k), n_ = a.shape, b.shape[1]
    if c.stride(1) != 1 and n_ != 1:
        raise ValueError(f"cublas_study: the output's strides {c.stride()} are not row-major")
    transa, lda = _column_major(b)
    transb, ldb = _column_major(a)
    return transa, transb, n_, m_, k, lda, ldb, max(c.stride(0), n_, 1)


def emulate(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc) -> None:
    """cublasGemmEx's semantics on flat CPU tensors (the operands' memory from their first elements):
    C[m x n] = alpha op(A)[m x k] op(B)[k x n] + beta C, every matrix column-major, op T reading the stored
    matrix transposed."""
    op_a = A.as_strided((m, k), (1, lda) if transa == OP_N else (lda, 1))
    op_b = B.as_strided((k, n), (1, ldb) if transb == OP_N else (ldb, 1))
    out = C.as_strided((m, n), (1, ldc))
    out.copy_(alpha * (op_a.double() @ op_b.double()) + (beta * out.double() if beta else 0))


def flat_from(t: torch.Tensor) -> torch.Tensor:
    """t's memory from its first element on, flat (what a pointer to it addresses)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), (t.untyped_storage().nbytes()
                                                                                          // t.element_size()
                                                                                          - t.storage_offset(),))


class ByAddress:
    """c (+)= a @ b by cublasGemmEx at raw addresses, on torch's cuBLAS handle for the current device and stream."""

    def __init__(self):
        x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        torch.mm(x, x)  # cuBLAS loaded, torch's handle made
        with open("/proc/self/maps") as f:
            path = next(line.split()[-1] for line in f if "libcublas.so" in line and "libcublasLt" not in line)
        self.lib = ctypes.CDLL(path)
        self.path = path
        p, i = ctypes.c_void_p, ctypes.c_int
        self.gemm = self.lib.cublasGemmEx
        self.gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self.gemm.restype = i
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def prepared(self, a, b, c, accumulate: bool):
        """at(address of a, of b, of c): the product at those addresses (a, b, c here give shapes, strides, dtypes)."""
        transa, transb, m, n, k, lda, ldb, ldc = gemm_arguments(a, b, c)
        operands, out = DATA_TYPES[a.dtype], DATA_TYPES[c.dtype]
        alpha, beta = ctypes.byref(self.one), ctypes.byref(self.one if accumulate else self.zero)
        gemm, handle = self.gemm, torch.cuda.current_blas_handle

        def at(pa: int, pb: int, pc: int) -> None:
            status = gemm(handle(), transa, transb, m, n, k, alpha, pb, operands, lda, pa, operands, ldb, beta, pc,
                          out, ldc, COMPUTE_32F, GEMM_DEFAULT)
            if status:
                raise RuntimeError(f"cublasGemmEx: status {status}")
        return at


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


def check() -> None:
    """The argument mapping through `emulate`, every form at odd token counts and narrowed widths, against float64,
    outputs poisoned."""
    for tokens in (1, 37, 130):
        for name, a, b, c, accumulate in forms(tokens, "cpu", torch.float64):
            for cols in (80, 2048):
                x = a if name.startswith("dW") else a[:, :96]
                y = b[:x.shape[1], :cols]
                z = c[:x.shape[0], :cols]
                want = (z.clone() if accumulate else 0) + x @ y
                if not accumulate:
                    z.fill_(float("nan"))
                transa, transb, m, n, k, lda, ldb, ldc = gemm_arguments(x, y, z)
                emulate(transa, transb, m, n, k, 1.0, flat_from(y), lda, flat_from(x), ldb,
                        1.0 if accumulate else 0.0, flat_from(z), ldc)
                err = ((z - want).norm() / want.norm()).item()
                print(f"T {tokens:4d} {name:18s} {tuple(z.shape)} ops {'NT'[transa]}{'NT'[transb]} rel. error {err:.1e}")
                assert err < 1e-12, (tokens, name, cols)
    print("the arguments are right for every form")


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
    by_address = ByAddress()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {by_address.path}")
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
                at = by_address.prepared(a, b, c, accumulate)
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
    parser.add_argument("--check", action="store_true", help="the argument mapping, emulated on the CPU")
    parser.add_argument("--tokens", default="512,2048,8192", help="token counts, comma-separated")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.check or not torch.cuda.is_available():
        check()
    else:
        study([int(t) for t in args.tokens.split(",")], args.json)


if __name__ == "__main__":
    main()
