"""Device experiment for 072: product-launch configs, kernel breakdown, cuBLAS products, host cost.

Run on the GPU machine from the checkout: PYTHONPATH=src python benchmarks/tune_072.py --out DIR
Every variant is checked (official rule, 2 rounds) and timed under the official clock (CUPTI span,
L2 flushed, fresh addresses). Prints a short table; writes everything to DIR/tune_072.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import backfuse
from backfuse.bench import check_outputs, sol_ms, time_calls
from backfuse.ops import cross_attn_qkv_gqa as op

G = op.GemmConfig
CONFIGS = [G(128, 256, 64, 8, 3), G(128, 256, 64, 8, 4), G(128, 256, 64, 8, 3, True), G(128, 256, 64, 8, 4, True),
           G(128, 128, 64, 4, 4), G(128, 128, 64, 4, 4, True)]


def cublas_products(td, te):
    """The five products alone through cuBLAS (fp16 operands, fp32 out), for comparison."""
    f16 = lambda *s: torch.randn(s, device="cuda").half()  # noqa: E731
    gq16, gkv16, dec16, enc16 = f16(td, 4096), f16(te, 2048), f16(td, 1536), f16(te, 1024)
    wq16, wkv16 = f16(4096, 1536), f16(2048, 1024)

    def run(gq16, gkv16, dec16, enc16, wq16, wkv16):
        mm = lambda a, b: torch.mm(a, b, out_dtype=torch.float32)  # noqa: E731
        return (mm(gq16, wq16), mm(gkv16, wkv16), mm(gq16.T, dec16), mm(gkv16[:, :1024].T, enc16),
                mm(gkv16[:, 1024:].T, enc16))

    return run, [gq16, gkv16, dec16, enc16, wq16, wkv16]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default=None)
    ap.add_argument("--configs", default=None, help="indices into CONFIGS")
    args = ap.parse_args()
    prob = backfuse.problem("072")
    cases = range(16) if args.cases is None else [int(c) for c in args.cases.split(",")]
    configs = CONFIGS if args.configs is None else [CONFIGS[int(i)] for i in args.configs.split(",")]
    rows = []
    for i in cases:
        w = prob.workloads[i]
        a = w.axes
        row = {"case": i, "axes": a, "sol_ms": sol_ms(prob, a), "variants": {}}
        for cfg in configs:
            fn = lambda *x, cfg=cfg: op.qkv_gqa_backward(*x, config=cfg)  # noqa: E731
            worst, ok = 1.0, True
            for r in range(2):
                x = prob.make_inputs(a, seed=100 + r, device="cuda")
                v = check_outputs(fn(*x), prob.reference(*x), w.tolerance, prob.output_names)
                worst, ok = min(worst, v.min_matched), ok and v.passed
            t = time_calls(fn, x)
            row["variants"][",".join(str(int(v)) for v in cfg)] = {"ms": t.median_ms, "event_ms": t.event_median_ms, "passed": ok,
                                         "min_matched": worst, "kernel_ms": t.kernel_ms}
            del x
        td, te = a["batch_size"] * a["seq_len_dec"], a["batch_size"] * a["seq_len_enc"]
        run, ops16 = cublas_products(td, te)
        t = time_calls(run, ops16)
        row["variants"]["cublas_products_only"] = {"ms": t.median_ms, "kernel_ms": t.kernel_ms}
        rows.append(row)
        torch.cuda.empty_cache()
        cells = "  ".join(f"{k[:16]}={v['ms']:.4f}{'' if v.get('passed', True) else '!'}" for k, v in row["variants"].items())
        print(f"{i:2d} sol={row['sol_ms']:.4f}  {cells}", flush=True)

    # Host cost of one call (no profiler): back-to-back calls on a tiny case.
    x = prob.make_inputs(dict(batch_size=1, seq_len_dec=16, seq_len_enc=16), seed=0, device="cuda")
    for _ in range(20):
        prob.run(*x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        prob.run(*x)
    host_us = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"host time per run() call on a tiny case: {host_us:.1f} us")

    means = {k: statistics.fmean(r["variants"][k]["ms"] for r in rows) for k in rows[0]["variants"]}
    print("means:", "  ".join(f"{k}={v:.4f}" for k, v in means.items()))
    with open(f"{args.out}/tune_072.json", "w") as f:
        json.dump({"rows": rows, "means": means, "host_us_per_call": host_us}, f, indent=1)


if __name__ == "__main__":
    main()
