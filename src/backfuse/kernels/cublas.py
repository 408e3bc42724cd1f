"""cuBLAS's GEMM at raw addresses: a product a template re-aims as it re-aims a Triton launch.

A template's product step through torch makes a view per operand and calls `torch.mm(out=)`: ~20 us of host a
call where a re-aimed Triton launch costs ~5 (s53-1, notes/training.md session 53), and a changing-length loop's
step runs ~10 of them. Here the same library is called directly: `cublasGemmEx` through ctypes, on torch's own
handle for the current device and thread (`torch.cuda.current_blas_handle()` sets the current stream on it,
with torch's workspace for that stream and its math mode), at the operands' addresses.

cuBLAS is column-major. A row-major c [M, N] is c^T column-major, so c = a @ b is computed as c^T = b^T a^T: the
library's first operand is b, its second a, m = N, n = M. An operand's memory read as column-major is its
transpose where its unit stride runs along its columns (op N, leading dimension its row stride) and itself where
it runs along its rows (op T, leading dimension its column stride). Products whose operands have no unit stride,
other dtypes, empty ones, or a process where the library cannot be found, are not served (`gemm` returns None)
and stay with torch.
"""

from __future__ import annotations

import ctypes

import torch

OP_N, OP_T = 0, 1  # cublasOperation_t
DATA_TYPES = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}  # cudaDataType: CUDA_R_16F, _16BF, _32F
COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F: fp32 sums
GEMM_DEFAULT = -1  # cublasGemmAlgo_t: the library's heuristic
LIMIT = 2**31 - 1  # cublasGemmEx takes int sizes and leading dimensions


def _column_major(shape, stride):
    """(op, ld) of a 2-d operand [r, c] as the library reads its transpose (module docstring), or None."""
    rows, cols = shape
    if stride[1] == 1 or cols == 1:
        return OP_N, max(stride[0], cols, 1)
    if stride[0] == 1 or rows == 1:
        return OP_T, max(stride[1], rows, 1)
    return None


def arguments(a_shape, a_stride, b_shape, b_stride, c_stride):
    """cublasGemmEx's (transa, transb, m, n, k, lda, ldb, ldc) for row-major c [M, N] = a [M, K] @ b [K, N] from
    the operands' shapes and strides, or None where a layout is not one the library reads."""
    (m_, k), n_ = a_shape, b_shape[1]
    first, second = _column_major(b_shape, b_stride), _column_major(a_shape, a_stride)
    if first is None or second is None or (c_stride[1] != 1 and n_ != 1):
        return None
    (transa, lda), (transb, ldb) = first, second
    ldc = max(c_stride[0], n_, 1)
    if max(m_, n_, k, lda, ldb, ldc) > LIMIT:
        return None
    return transa, transb, n_, m_, k, lda, ldb, ldc


class _Library:
    """libcublas's cublasGemmEx, from the copy torch loaded (None where none is found: torch loads it at its first
    product, and a template is taken only from a call whose products torch ran)."""

    def __init__(self):
        self.gemm = None
        try:
            with open("/proc/self/maps") as maps:
                path = next(line.split()[-1] for line in maps
                            if "libcublas.so" in line and "libcublasLt" not in line)
            gemm = ctypes.CDLL(path).cublasGemmEx
        except (OSError, StopIteration, AttributeError):
            return
        p, i = ctypes.c_void_p, ctypes.c_int
        gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        gemm.restype = i
        self.gemm = gemm
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)


_library = None


def library() -> _Library:
    """The library, kept once found (looked for again while it is not: torch may not have loaded it yet)."""
    global _library
    if _library is None or _library.gemm is None:
        _library = _Library()
    return _library


def gemm(a_shape, a_stride, b_shape, b_stride, c_stride, operands: torch.dtype, out: torch.dtype, accumulate: bool):
    """at(address of a, of b, of c): c = a @ b (+ c where `accumulate`) with fp32 sums, rounded once to `out`, for
    operands of these shapes and strides in `operands` (fp16 or bf16) and c in `out` (the same, or fp32); None
    where cuBLAS at addresses does not serve it (module docstring). The addresses must hold such tensors, on
    the current device."""
    if operands not in (torch.float16, torch.bfloat16) or out not in (operands, torch.float32) or 0 in (
            *a_shape, *b_shape):
        return None
    args = arguments(a_shape, a_stride, b_shape, b_stride, c_stride)
    lib = library()
    if args is None or lib.gemm is None:
        return None
    transa, transb, m, n, k, lda, ldb, ldc = args
    call, handle = lib.gemm, torch.cuda.current_blas_handle
    alpha, beta = ctypes.byref(lib.one), ctypes.byref(lib.one if accumulate else lib.zero)
    dtype, out_dtype = DATA_TYPES[operands], DATA_TYPES[out]

    def at(pa: int, pb: int, pc: int) -> None:
        status = call(handle(), transa, transb, m, n, k, alpha, pb, dtype, lda, pa, dtype, ldb, beta, pc, out_dtype,
                      ldc, COMPUTE_32F, GEMM_DEFAULT)
        if status:
            raise RuntimeError(f"backfuse: cublasGemmEx failed with status {status} ({m} x {n} x {k})")
    return at
