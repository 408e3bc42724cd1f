"""Device experiment for 072: product backends and launch schedules, kernel breakdown, host cost.

Run on the GPU machine from the checkout: PYTHONPATH=src python benchmarks/tune_072.py --out DIR
Every variant is checked (official rule, 2 rounds) and timed under the official clock (CUPTI span,
L2 flushed, fresh addresses). Prints a short table; writes everything to DIR/tune_072.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import backfuse
from backfuse.bench import check_outputs, sol_ms, time_calls
from backfuse.kernels.gemm import TileConfig
from backfuse.ops import cross_attn_qkv_gqa as op

G = TileConfig
P = op.PackConfig
VARIANTS = {
    "triton_1launch": dict(products="triton", config=G(128, 256, 64, 8, 4)),
    "triton_2launch": dict(products="triton", config=G(128, 256, 64, 8, 4), one_launch=False),
    "cublas": dict(products="cublas"),
    # prologue shapes, products chosen by size
    "pack_r32_b4096_i16_w4": dict(pack=P(32, 4096, 16, 4)),
    "pack_r16_b2048_i16_w4": dict(pack=P(16, 2048, 16, 4)),
    "pack_r32_b4096_i16_w8": dict(pack=P(32, 4096, 16, 8)),
    "pack_r16_b4096_i8_w8": dict(pack=P(16, 4096, 8, 8)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default=None)
    ap.add_argument("--variants", default="triton_1launch,triton_2launch,cublas")
    args = ap.parse_args()
    prob = backfuse.problem("072")
    cases = range(16) if args.cases is None else [int(c) for c in args.cases.split(",")]
    variants = {k: VARIANTS[k] for k in args.variants.split(",")}
    rows = []
    for i in cases:
        w = prob.workloads[i]
        a = w.axes
        row = {"case": i, "axes": a, "sol_ms": sol_ms(prob, a), "variants": {}}
        for name, kw in variants.items():
            fn = lambda *x, kw=kw: op.qkv_gqa_backward(*x, **kw)  # noqa: E731
            worst, ok = 1.0, True
            try:
                for r in range(2):
                    x = prob.make_inputs(a, seed=100 + r, device="cuda")
                    v = check_outputs(fn(*x), prob.reference(*x), w.tolerance, prob.output_names)
                    worst, ok = min(worst, v.min_matched), ok and v.passed
                t = time_calls(fn, x)
            except Exception as e:  # keep measuring the other variants
                print(f"case {i} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            row["variants"][name] = {"ms": t.median_ms, "event_ms": t.event_median_ms, "passed": ok,
                                     "min_matched": worst, "kernel_ms": t.kernel_ms,
                                     "kernels": statistics.median(t.kernels_per_call)}
            del x
        rows.append(row)
        torch.cuda.empty_cache()
        cells = "  ".join(f"{k}={v['ms']:.4f}/{sum(v['kernel_ms'].values()):.4f}{'' if v['passed'] else '!'}"
                          for k, v in row["variants"].items())
        print(f"{i:2d} sol={row['sol_ms']:.4f}  span/busy: {cells}", flush=True)

    # Host cost of one call (no profiler): back-to-back calls on a tiny case, and where it goes.
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
    cProfile.runctx("for _ in range(200): prob.run(*x)", globals(), {"prob": prob, "x": x}, f"{args.out}/host.prof")
    pstats.Stats(f"{args.out}/host.prof").sort_stats("tottime").print_stats(12)

    means = {k: statistics.fmean(r["variants"][k]["ms"] for r in rows) for k in rows[0]["variants"]}
    best = statistics.fmean(min(v["ms"] for v in r["variants"].values()) for r in rows)
    print("means:", "  ".join(f"{k}={v:.4f}" for k, v in means.items()), f" best-per-case={best:.4f}")
    pack = {k: statistics.fmean(r["variants"][k]["kernel_ms"].get("_pack_kernel", 0.0) for r in rows) for k in means}
    print("mean prologue ms:", "  ".join(f"{k}={v:.4f}" for k, v in pack.items()))
    with open(f"{args.out}/tune_072.json", "w") as f:
        json.dump({"rows": rows, "means": means, "host_us_per_call": host_us}, f, indent=1)


if __name__ == "__main__":
    main()
