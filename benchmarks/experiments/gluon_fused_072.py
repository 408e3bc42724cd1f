"""072's one-launch Gluon path (`products="gluon"`, ops/qkv_gqa/gluon_kernels.py) against the path
the plan picks by default, in one GPU call: correctness on odd and official shapes (poisoned
buffers, the official rule), then per case the official-clock time of both and the Gluon kernel's
own device time (CUPTI kernel records).

    PYTHONPATH=src timeout 400 python3 benchmarks/experiments/gluon_fused_072.py [--cases 0,6]
"""

from __future__ import annotations

import argparse

import torch

import backfuse
from backfuse.bench.check import check_outputs
from backfuse.bench.timing import time_calls
from backfuse.kernels import buffers

ODD = [dict(batch_size=1, seq_len_dec=1, seq_len_enc=1), dict(batch_size=1, seq_len_dec=37, seq_len_enc=77),
       dict(batch_size=3, seq_len_dec=613, seq_len_enc=5), dict(batch_size=2, seq_len_dec=129, seq_len_enc=255)]


def kernel_us(fn, inputs, calls=20):
    """Mean device time of the Gluon kernel over `calls` calls, L2 flushed before each."""
    flush = torch.empty(2 * 60 * 2**20, dtype=torch.int8, device="cuda")
    fn(*inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn(*inputs)
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if "fused_kernel" in e.name]
    return sum(times) / max(1, len(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None)
    args = ap.parse_args()
    op = backfuse.problem("072")
    gluon = lambda *x, **kw: op.fused(*x, products="gluon", **kw)  # noqa: E731
    for i, axes in enumerate(ODD + [w.axes for w in op.workloads[:3]]):
        inputs = op.make_inputs(axes, seed=100 + i, device="cuda")
        tol = op.workloads[max(0, i - len(ODD))].tolerance
        for det in (False, True):
            with buffers.poisoned():
                outs = gluon(*inputs, deterministic=det)
            v = check_outputs(outs, op.reference(*inputs), tol, op.output_names)
            print(f"check {axes} deterministic={det}: {'PASS' if v.passed else 'FAIL'} {v.min_matched:.6f} {v.reason}",
                  flush=True)
    cases = [int(c) for c in args.cases.split(",")] if args.cases else range(16)
    rows = []
    for c in cases:
        inputs = op.make_inputs(op.workloads[c].axes, seed=c, device="cuda")
        default = time_calls(op.run, inputs).median_ms
        one = time_calls(gluon, inputs).median_ms
        kernel = kernel_us(gluon, inputs) / 1e3
        rows.append((default, one))
        print(f"case {c:2d} {op.workloads[c].axes}: default {default * 1e3:7.1f} us, gluon {one * 1e3:7.1f} us "
              f"({one / default:.2f}x; its kernel {kernel * 1e3:7.1f})", flush=True)
    if len(rows) == 16:
        print(f"mean: default {sum(r[0] for r in rows) / 16:.4f} ms, gluon everywhere {sum(r[1] for r in rows) / 16:.4f} ms, "
              f"best of both {sum(min(r) for r in rows) / 16:.4f} ms")


if __name__ == "__main__":
    main()
