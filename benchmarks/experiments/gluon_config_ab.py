"""072's one-launch Gluon kernel under several `GluonConfig`s, in one GPU call: each variant's outputs
checked against the reference (poisoned buffers, the official rule), then its kernel device time
(CUPTI, L2 flushed) per case, beside the default plan's official-clock time.

    PYTHONPATH=src timeout 300 python3 benchmarks/experiments/gluon_config_ab.py [--cases 0,6,7,9]
"""

from __future__ import annotations

import argparse
import dataclasses

from gluon_fused_072 import kernel_us

import backfuse
from backfuse.bench.check import check_outputs
from backfuse.bench.timing import time_calls
from backfuse.kernels import buffers
from backfuse.ops.qkv_gqa import config
from backfuse.ops.qkv_gqa.backward import backward

VARIANTS = {
    "128x128, 4 stages, 4-warp pack (default)": config.CONFIG.gluon,
    "128x256, 3 stages, 2-warp pack": config.GluonConfig(bn=256, stages=3, pack_warps=2, maxnreg=168, regs=168),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="0,6,7,9")
    args = ap.parse_args()
    op = backfuse.problem("072")
    for c in (int(c) for c in args.cases.split(",")):
        w = op.workloads[c]
        inputs = op.make_inputs(w.axes, seed=c, device="cuda")
        row = [f"case {c:2d}: plan {time_calls(op.run, inputs).median_ms * 1e3:7.1f} us"]
        for name, g in VARIANTS.items():
            cfg = dataclasses.replace(config.CONFIG, gluon=g)

            def fn(*x, cfg=cfg):
                return backward(*x, products="gluon", config=cfg)

            with buffers.poisoned():
                verdict = check_outputs(fn(*inputs), op.reference(*inputs), w.tolerance, op.output_names)
            row.append(f"{name}: {kernel_us(fn, inputs, calls=10):7.1f} us {'ok' if verdict.passed else 'FAIL'}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
