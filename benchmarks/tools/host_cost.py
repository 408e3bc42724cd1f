"""Host time of what a fused call issues, on the GPU machine: cuBLAS products through torch.mm in
the forms the operators use, and one whole call of an official case under cProfile.

    python3 benchmarks/tools/host_cost.py 037 14

The products run on tiny operands, so the loop measures the host's cost per call, not the GPU's.
A call whose GPU work is shorter than the host time between its first and last launch is
host-bound: the official clock (first kernel start to last kernel end) then counts the gaps.
"""

import argparse
import cProfile
import pstats
import time

import torch

import backfuse


def host_us(fn, calls=500):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


ap = argparse.ArgumentParser()
ap.add_argument("problem")
ap.add_argument("case", type=int)
ap.add_argument("--products", default=None, help="force 'cublas' or 'triton' products")
args = ap.parse_args()

a16 = torch.randn(128, 128, device="cuda", dtype=torch.float16)
b16 = torch.randn(128, 128, device="cuda", dtype=torch.float16)
o32 = torch.empty(128, 128, device="cuda")
o16 = torch.empty(128, 128, device="cuda", dtype=torch.float16)
forms = {
    "mm fp16 -> fp32 (out_dtype, out=)": lambda: torch.mm(a16, b16, out_dtype=torch.float32, out=o32),
    "mm fp16 -> fp32 (out_dtype, A^T)": lambda: torch.mm(a16.T, b16, out_dtype=torch.float32, out=o32),
    "mm fp16 -> fp16 (out=)": lambda: torch.mm(a16, b16, out=o16),
    "aten.mm.dtype_out": lambda: torch.ops.aten.mm.dtype_out(a16, b16, torch.float32, out=o32),
}
for name, fn in forms.items():
    try:
        print(f"{name:40s} {host_us(fn):7.1f} us per call")
    except Exception as e:  # noqa: BLE001  (a form this torch lacks)
        print(f"{name:40s} {type(e).__name__}: {e}")

prob = backfuse.problem(args.problem)
x = prob.make_inputs(prob.workloads[args.case].axes, seed=0, device="cuda")
run = prob.run
if args.products:
    run = lambda *x: prob.fused(*x, products=args.products)  # noqa: E731
print(f"{prob.id} case {args.case}: {host_us(lambda: run(*x), calls=50):.1f} us host per call")
cProfile.runctx("for _ in range(50): run(*x)", globals(), {"run": run, "x": x}, "/tmp/host.prof")
pstats.Stats("/tmp/host.prof").sort_stats("tottime").print_stats(14)
