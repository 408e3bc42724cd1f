"""Issue 23: can a persistent `tl` program (one per SM, as 021's forward launch is) convert fp32 to fp16
at the bandwidth of the pack's own launch? 021's small cases sit 10-16 % idle (notes/021.md, session
25: 7-10 us per call between the pack and the forward, waiting on the host); the pack's work inside the
forward's persistent launch would remove that gap, but rows 33-34 measured persistent programs that
convert one 32 KB chunk at a time 3x slower than the pack's launch of many small programs. The
question is whether several TMA copies in flight per program close it:

    PYTHONPATH=src python3 benchmarks/experiments/persistent_cast.py [--rows 4480,16384,65536]
    ... --compile-only      # on any machine: each variant for sm_90, its resources

Variants, each over a [rows, 1024] fp32 matrix into fp16 (rows 4480: 021 case 8's pack, ≈ 4.6 M
elements), L2 flushed before every call, kernel time from the profiler:
- the pack's way: one program per 8192-element chunk, 4 warps (`cast_chunk`);
- persistent, pointer loads: one program per SM, 8 warps, walking chunks (what rows 33-34 measured);
- persistent, TMA: one program per SM, 8 warps, [32, 256] or [64, 256] blocks loaded through a tensor
  descriptor in a loop that Triton pipelines (`tl.range(..., num_stages=S)`: S - 1 copies in flight, as
  many 32 or 64 KB buffers: 32-192 KB), stored by pointer.

Prediction (written before any run): the pack's way ≈ 3.5-3.8 TB/s at 64 K rows (the pack measured
3.8 TB/s, 072.md row 3) and less at 4480 rows (its ramp); persistent pointer loads ≈ 1-1.5 TB/s (one
chunk in flight per SM); persistent TMA with 4 stages ≥ 3 TB/s. If the TMA form reaches the pack's
launch, the pack can move into 021's forward launch (one launch fewer, the idle gap gone); if not,
it stays a launch of its own.

Prepared in session 25 after its device time was spent: compiled, never run.
"""

import argparse

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from backfuse.kernels.launch import FastKernel
from backfuse.kernels.triton.elementwise import cast_chunk

WIDTH = 1024  # 021's hidden size: every tensor its pack converts is [rows, 1024]
COLS = tl.constexpr(WIDTH)


@triton.jit(do_not_specialize=["n"])
def chunk_cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst = fp16(src) over n elements, one BLOCK-element chunk per program (the pack's way)."""
    cast_chunk(src, dst, n, tl.program_id(0), BLOCK, 1)


@triton.jit(do_not_specialize=["n", "n_programs"])
def persistent_pointer_kernel(src, dst, n, n_programs, BLOCK: tl.constexpr):
    """dst = fp16(src), each of n_programs programs walking chunks pid, pid + n_programs, ..."""
    for chunk in range(tl.program_id(0), tl.cdiv(n, BLOCK), n_programs):
        cast_chunk(src, dst, n, chunk, BLOCK, 1)


@triton.jit(do_not_specialize=["rows", "n_programs"])
def persistent_tma_kernel(src, dst, rows, n_programs, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
    """dst = fp16(src) for [rows, COLS] row-major matrices, each of n_programs programs walking [BR, BC]
    blocks loaded by TMA, STAGES deep."""
    desc = tl.make_tensor_descriptor(src, shape=[rows, COLS], strides=[COLS, 1], block_shape=[BR, BC])
    per_row: tl.constexpr = COLS // BC
    r = tl.arange(0, BR)
    c = tl.arange(0, BC)
    for block in tl.range(tl.program_id(0), tl.cdiv(rows, BR) * per_row, n_programs, num_stages=STAGES):
        r0 = (block // per_row) * BR
        c0 = (block % per_row) * BC
        x = desc.load([r0, c0])
        rr = r0 + r
        tl.store(dst + rr[:, None].to(tl.int64) * COLS + c0 + c[None, :], x.to(tl.float16), mask=rr[:, None] < rows)


# name: (kernel, warps, constexprs, persistent)
VARIANTS = {"pack's way: 8192-element programs, 4 warps": (chunk_cast_kernel, 4, dict(BLOCK=8192), False),
            "persistent, pointer loads, 8 warps": (persistent_pointer_kernel, 8, dict(BLOCK=8192), True),
            "persistent, TMA [32, 256], 2 stages": (persistent_tma_kernel, 8, dict(BR=32, BC=256, STAGES=2), True),
            "persistent, TMA [32, 256], 4 stages": (persistent_tma_kernel, 8, dict(BR=32, BC=256, STAGES=4), True),
            "persistent, TMA [32, 256], 6 stages": (persistent_tma_kernel, 8, dict(BR=32, BC=256, STAGES=6), True),
            "persistent, TMA [64, 256], 4 stages": (persistent_tma_kernel, 8, dict(BR=64, BC=256, STAGES=4), True)}
SCALARS = {chunk_cast_kernel: {"n": "i32"}, persistent_pointer_kernel: {"n": "i32", "n_programs": "i32"},
           persistent_tma_kernel: {"rows": "i32", "n_programs": "i32"}}


def compile_only():
    import re
    import subprocess
    import tempfile

    from triton.compiler import ASTSource

    from backfuse.kernels.gluon.sm90 import _CUOBJDUMP, SM90, usage

    for name, (fn, warps, constexprs, _) in VARIANTS.items():
        sig = {"src": "*fp32", "dst": "*fp16"} | SCALARS[fn] | {k: "constexpr" for k in constexprs}
        src = ASTSource(fn, sig, constexprs=constexprs, attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
        kernel = triton.compile(src, target=SM90, options=dict(num_warps=warps, num_stages=constexprs.get("STAGES", 1)))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([_CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        tma = len(re.findall(r"UTMALDG", sass))
        print(f"{name:42s}", usage(kernel), f" TMA loads {tma}", flush=True)


def kernel_us(fn, name, reps=10):
    """Median device time of the kernels called `name` over reps calls, L2 flushed before each."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times = sorted(e.device_time for e in prof.events() if e.name.startswith(name) and e.device_time > 0)
    return times[len(times) // 2] if times else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4480,16384,65536")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and print its resources")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        n = rows * WIDTH
        src = torch.randn(rows, WIDTH, device="cuda", generator=gen)
        ref = src.half()
        print(f"[{rows}, {WIDTH}] fp32 -> fp16: {6 * n / 1e6:.1f} MB moved", flush=True)
        for name, (fn, warps, constexprs, persistent) in VARIANTS.items():
            kernel = FastKernel(fn)
            dst = torch.full((rows, WIDTH), float("nan"), device="cuda", dtype=torch.float16)
            stages = constexprs.get("STAGES", 1)
            if fn is persistent_tma_kernel:
                grid, extra = (sms,), (rows, sms)
            elif persistent:
                grid, extra = (sms,), (n, sms)
            else:
                grid, extra = (triton.cdiv(n, constexprs["BLOCK"]),), (n,)

            def run(kernel=kernel, grid=grid, dst=dst, extra=extra, constexprs=constexprs, warps=warps, stages=stages):
                kernel(grid, src, dst, *extra, **constexprs, num_warps=warps, num_stages=stages)

            t = kernel_us(run, fn.__name__)
            ok = torch.equal(dst, ref)
            print(f"  {name:42s} {t:7.1f} us  {6 * n / t / 1e6:5.2f} TB/s  {'exact' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
