"""What the standalone kernel studies in this folder share: the tile bookkeeping and epilogue of
their product kernels, the CUDA-graph timing loop, and one way to run, check and time a variant.

Each study imports it as a sibling (`from common import ...`: run them as
`PYTHONPATH=src python benchmarks/experiments/<study>.py`, which puts this folder on the path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def use_torch_allocator() -> None:
    """Global scratch for kernels that build TMA descriptors on the device, from torch's allocator."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def tile_origin(tile, N, BM: tl.constexpr, BN: tl.constexpr):
    """(off_m, off_n) of output tile `tile` of C[M, N] in BM x BN tiles, n fastest."""
    nt = tl.cdiv(N, BN)
    return (tile // nt) * BM, (tile % nt) * BN


@triton.jit
def bias_fp16_epilogue(c, bias, acc, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """C[off_m:+BM, off_n:+BN] = fp16(acc + bias[None, :]), C row-major [M, N], masked at the edges
    (021's forward epilogue)."""
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    acc += tl.load(bias + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(c + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(tl.float16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def replay_us(calls, reps=20):
    """µs per call from CUDA-graph replays of `reps` calls, call i running calls[i % len(calls)] (several
    calls over different buffers keep operands larger than L2 out of it; no launch overhead)."""
    for call in calls:
        call()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for call in calls:
            call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def replay_ms(fn, reps=20):
    """ms per call of fn from CUDA-graph replays (`replay_us`)."""
    return replay_us([fn], reps) / 1e3


def measure(cells: list, name: str, fn, out: torch.Tensor, ref: torch.Tensor, flop: float, *, timer=replay_ms,
            atol=2e-2, rtol=2e-2) -> float | None:
    """Run `fn` once into `out` (NaN-filled first), check it against `ref`, time it with `timer`;
    append 'name TFLOP/s' to `cells` ('!' marks a wrong result; a variant Triton cannot compile
    is a result too: ERR). Returns the time in ms (None on an error)."""
    try:
        out.fill_(float("nan"))
        fn()
        ok = torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
        ms = timer(fn)
    except Exception as e:  # noqa: BLE001
        cells.append(f"{name} ERR {type(e).__name__}: {str(e)[:80]}")
        return None
    cells.append(f"{name} {flop / ms / 1e9:4.0f}{'' if ok else '!'}")
    return ms
