"""Device experiment per operator: variants of the fused path (launch shapes, product backends),
each with its per-kernel breakdown.

Run on the GPU machine from the checkout: PYTHONPATH=src python benchmarks/tools/tune.py 037 --out DIR
Every variant is checked (official rule, 2 rounds) and timed under the official clock (CUPTI span,
L2 flushed, fresh addresses). Prints a short table; writes everything to DIR/tune_<problem>.json.
A variant is the keywords of the operator's fused backward (`ops/<stem>/backward.py`): a `config`
(its `config.Config`, keyword-built), `products`, ...; and `graphs=False` to launch the kernels one
by one instead of as one CUDA graph (`backfuse.cuda_graphs`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

import backfuse
from backfuse.bench import check_outputs, sol_ms, time_calls
from backfuse.kernels.config import PackConfig, TileConfig
from backfuse.ops.gemma3_core.config import AttentionConfig as A37
from backfuse.ops.gemma3_core.config import Config as C37
from backfuse.ops.qkv_gqa.config import Config as C72
from backfuse.ops.qkv_gqa.config import GluonConfig as G72
from backfuse.ops.wan_xattn.config import AttentionConfig as A21
from backfuse.ops.wan_xattn.config import Config as C21


def T(bm, bn, bk, warps, stages):  # a TileConfig, briefly
    return TileConfig(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages)


VARIANTS = {
    "072": {
        "default": dict(config=C72()),
        "direct": dict(config=C72(), graphs=False),
        "triton_1launch": dict(products="triton", config=C72(tiles=T(128, 256, 64, 8, 4))),
        "triton_default": dict(products="triton"),
        "cublas": dict(products="cublas"),
        # The four cuBLAS products one after another, or beside each other (graph branches) at any size
        # (by default below Config.branches_below_flop).
        "cublas_no_branches": dict(config=C72(branches_below_flop=0), products="cublas"),
        "cublas_branches": dict(config=C72(branches_below_flop=float("inf")), products="cublas"),
        "gluon": dict(products="gluon"),
        # Registers of the second consumer and the pack (the first consumer gets 488 - 2 regs): 128 gives
        # 232 / 128 / 128 and a 128-byte stack frame, 160 gives 168 / 160 / 160 and 72 bytes.
        "gluon_regs144": dict(products="gluon", config=C72(gluon=G72(regs=144))),
        "gluon_regs160": dict(products="gluon", config=C72(gluon=G72(regs=160))),
        # Deeper rings (the fourth stage measured 7-8 % against three: notes/072.md row 30); 5 x 64 or
        # 10 x 32 deep fill the shared memory beside the pack's 64 KB.
        "gluon_s5": dict(products="gluon", config=C72(gluon=G72(stages=5))),
        "gluon_k32_s8": dict(products="gluon", config=C72(gluon=G72(bk=32, stages=8))),
        "gluon_k32_s10": dict(products="gluon", config=C72(gluon=G72(bk=32, stages=10))),
        "pack_r32_b4096_i16_w8": dict(config=C72(pack=PackConfig(rows=32, block=4096, iters=16, warps=8))),
        # Shorter flat-cast programs (16K or 32K elements instead of 64K): on the small cases the pack's
        # ~350 programs are ~2.6 per SM, its Wq chunks 256 KB each.
        "pack_i4": dict(config=C72(pack=PackConfig(rows=32, block=4096, iters=4, warps=4))),
        "pack_i8": dict(config=C72(pack=PackConfig(rows=32, block=4096, iters=8, warps=4))),
        # Smaller product tiles for the small (Triton-product) cases: more tiles than SMs, 2 per SM.
        "triton_128x128_w8": dict(products="triton", config=C72(tiles=T(128, 128, 64, 8, 4))),
        "triton_128x128_w4": dict(products="triton", config=C72(tiles=T(128, 128, 64, 4, 4))),
        "triton_128x128_k32": dict(products="triton", config=C72(tiles=T(128, 128, 32, 4, 6))),
    },
    "021": {
        "default": dict(config=C21()),
        "direct": dict(config=C21(), graphs=False),
        "no_pdl": dict(config=C21(pdl=False)),
        "no_branches": dict(config=C21(branches=False)),
        "grad_cublas_no_branches": dict(config=C21(branches=False), products="cublas"),
        "att_half_sm": dict(config=C21(attention=A21(programs_per_sm=0.5))),
        "att_2sm": dict(config=C21(attention=A21(programs_per_sm=2))),
        # Persistent TMA forward products: 128 x 128 tiles, or 4 stages.
        "fwd_128x128": dict(config=C21(forward=T(128, 128, 64, 8, 3))),
        "fwd_s4": dict(config=C21(forward=T(128, 256, 64, 8, 4))),
        # 4 stages: fp32_tma_operand.py measured 128 x 128 tiles at 580 TFLOP/s with 4, 534 with 3.
        "fwd_small_s4": dict(config=C21(forward_small=T(128, 128, 64, 8, 4))),
        # A deeper ring where the small tiles' programs are one wave at one per SM (037's rule of
        # session 25: 6 stages −6 us on its 128-token case): 192 KB.
        "fwd_small_s6": dict(config=C21(forward_small=T(128, 128, 64, 8, 6))),
        "fwd_small_s5": dict(config=C21(forward_small=T(128, 128, 64, 8, 5))),
        "fwd_128x128_s4": dict(config=C21(forward=T(128, 128, 64, 8, 4), forward_small=T(128, 128, 64, 8, 4))),
        # Narrower tiles where 128 x 128 ones leave a ragged last round (wave quantization: 160 tiles on
        # 132 SMs take two tile times): 128 x 64 at 4 warps.
        "fwd_small_128x64": dict(config=C21(forward_small=T(128, 64, 64, 4, 4))),
        "fwd_128x128_small_128x64": dict(config=C21(forward=T(128, 128, 64, 8, 3), forward_small=T(128, 64, 64, 4, 4))),
        # One text tile padded to a power of two (77 -> 128) instead of a head and a tail (64 + 16).
        "no_split": dict(config=C21(attention=A21(split_text=False))),
        "att_64x4": dict(config=C21(attention=A21(bm=64, warps=4))),
        "att_64x4_2sm": dict(config=C21(attention=A21(bm=64, warps=4, programs_per_sm=2))),
        "no_lone_block": dict(config=C21(attention=A21(lone_block=None))),
        "att_s1": dict(config=C21(attention=A21(stages=1))),
        "att_s3": dict(config=C21(attention=A21(stages=3))),
        "grad_cublas": dict(config=C21(), products="cublas"),
        "grad_triton": dict(config=C21(), products="triton"),
        # Fewer, deeper K steps for the small cases' latency-bound tile loops (one tile per program; session 29):
        # the forward's K = 1024 in 8 steps of 128, the gradient tiles' K in steps of 64 (2 programs per SM still).
        "fwd_small_k128_s2": dict(config=C21(forward_small=T(128, 128, 128, 8, 2))),
        "fwd_small_k128_s3": dict(config=C21(forward_small=T(128, 128, 128, 8, 3))),
        "grad_k64_s3": dict(config=C21(gradients=T(128, 128, 64, 4, 3))),
        "grad_k64_s4": dict(config=C21(gradients=T(128, 128, 64, 4, 4))),
    },
    "037": {
        "default": dict(config=C37()),
        "direct": dict(config=C37(), graphs=False),
        "exp2_tanh": dict(config=C37(attention=A37(approx_tanh=False))),
        "no_pdl": dict(config=C37(pdl=False)),
        "no_branches": dict(config=C37(branches=False)),
        "cublas_no_branches": dict(config=C37(branches=False), products="cublas"),
        "norm_rope_128x8": dict(config=C37(norm_rope=T(128, 128, 64, 8, 3))),
        "norm_rope_64x4": dict(config=C37(norm_rope=T(64, 128, 64, 4, 1))),
        "triton": dict(config=C37(), products="triton"),
        "cublas": dict(config=C37(), products="cublas"),
        "bwd_s2": dict(config=C37(attention=A37(stages=2))),
        "att_fwd_128x64": dict(config=C37(attention=A37(fwd_bm=128, fwd_bn=64, fwd_warps=8))),
        "forward_256": dict(config=C37(forward=T(256, 128, 64, 8, 3))),
        # Attention shapes for short sequences (S <= 256: loops of 2-8 steps, mostly diagonal blocks).
        "att_64_steps": dict(config=C37(attention=A37(kv_bm=64, q_bn=64))),
        "att_32_blocks": dict(config=C37(attention=A37(kv_bn=32, kv_bm=32, q_bm=32, q_bn=32))),
        "att_kv32": dict(config=C37(attention=A37(kv_bn=32))),
        "att_q32": dict(config=C37(attention=A37(q_bm=32))),
        "att_fwd_64x32": dict(config=C37(attention=A37(fwd_bn=32))),
        "att_fwd_32x64": dict(config=C37(attention=A37(fwd_bm=32))),
        "no_short_fwd": dict(config=C37(attention=A37(short_fwd_bn=64))),
        "no_few_kv": dict(config=C37(attention=A37(few_kv_bn=64))),
        # dK/dV programs split by query head: never, or also below 256 tokens.
        "no_head_split": dict(config=C37(attention=A37(head_split_per_sm=0))),
        "head_split_short": dict(config=C37(attention=A37(head_split_min_seq=0))),
        "no_one_wave_split": dict(config=C37(attention=A37(head_split_one_wave=False))),
        # Our product tiles run below 512 tokens only (cases 8, 11): 128-token tiles leave 64 forward
        # programs for 132 SMs at 128 tokens.
        "fwd_64x4_s4": dict(config=C37(forward=T(64, 128, 64, 4, 4))),
        "fwd_64x4_s3": dict(config=C37(forward=T(64, 128, 64, 4, 3))),
        "fwd_128x4": dict(config=C37(forward=T(128, 128, 64, 4, 3))),
        # More bytes in flight per forward program (session 24, prepared, not yet run): at 128-512 tokens
        # the forward's 128-512 programs each stream a 128-row weight slab over K = 3072 at ≈ 40 GB/s
        # (notes/037.md row 30); 96 KB of ring today, 144 KB with 128-deep steps or 6 stages.
        "fwd_64x4_k128_s3": dict(config=C37(forward=T(64, 128, 128, 4, 3))),
        "fwd_64x4_s6": dict(config=C37(forward=T(64, 128, 64, 4, 6))),
        # Where the forward fits one wave at one program per SM (`forward_one_wave`; session 25: 6
        # stages −6.8 us on case 8, +2..11 us where 256-512 programs then ran one per SM): never; 5 or
        # 8 stages; 128-row tiles (then case 11's 256 tokens fit one wave too; 192 KB).
        "one_wave_off": dict(config=C37(forward_one_wave=None)),
        "one_wave_s5": dict(config=C37(forward_one_wave=T(64, 128, 64, 4, 5))),
        "one_wave_s8": dict(config=C37(forward_one_wave=T(64, 128, 64, 4, 8))),
        "one_wave_128x6": dict(config=C37(forward_one_wave=T(128, 128, 64, 4, 6))),
        "grad_64x128": dict(config=C37(gradients=T(64, 128, 32, 4, 6))),
        "grad_128x128x64_w8": dict(config=C37(gradients=T(128, 128, 64, 8, 3))),
    },
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem", choices=sorted(VARIANTS))
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all of the problem's)")
    args = ap.parse_args()
    prob = backfuse.problem(args.problem)
    cases = range(16) if args.cases is None else [int(c) for c in args.cases.split(",")]
    names = args.variants.split(",") if args.variants else list(VARIANTS[args.problem])
    variants = {k: VARIANTS[args.problem][k] for k in names}
    backward = prob.fused  # the fused function on the official inputs, with a variant's keywords
    rows = []
    for i in cases:
        w = prob.workloads[i]
        a = w.axes
        row = {"case": i, "axes": a, "sol_ms": sol_ms(prob, a), "variants": {}}
        for name, kw in variants.items():
            kw = dict(kw)
            graphs = kw.pop("graphs", True)

            def fn(*x, kw=kw, graphs=graphs):
                with backfuse.cuda_graphs(graphs):
                    return backward(*x, **kw)
            worst, ok = 1.0, True
            try:
                for r in range(2):
                    x = prob.make_inputs(a, seed=100 + r, device="cuda")
                    v = check_outputs(fn(*x), prob.reference(*x), w.tolerance, prob.output_names)
                    worst, ok = min(worst, v.min_matched), ok and v.passed
                    if not v.passed:
                        print(f"case {i} {name}: FAILED {v.reason}", flush=True)
                t = time_calls(fn, x)
            except Exception as e:  # keep measuring the other variants
                print(f"case {i} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            row["variants"][name] = {"ms": t.median_ms, "event_ms": t.event_median_ms, "passed": ok,
                                     "min_matched": worst, "kernel_ms": t.kernel_ms, "busy_ms": t.busy_median_ms,
                                     "kernels": statistics.median(t.kernels_per_call)}
            del x
        rows.append(row)
        torch.cuda.empty_cache()
        cells = "  ".join(f"{k}={v['ms']:.4f}{'' if v['passed'] else '!'}" for k, v in row["variants"].items())
        print(f"{i:2d} {a} sol={row['sol_ms']:.4f}  {cells}", flush=True)
        first = next(iter(row["variants"].values()), None)
        if first:
            print("    " + "  ".join(f"{k.strip('_')}={v * 1000:.1f}us" for k, v in first["kernel_ms"].items()),
                  flush=True)

    names = [k for k in variants if all(k in r["variants"] for r in rows)]
    means = {k: statistics.fmean(r["variants"][k]["ms"] for r in rows) for k in names}
    best = statistics.fmean(min(v["ms"] for v in r["variants"].values()) for r in rows)
    print("means:", "  ".join(f"{k}={v:.4f}" for k, v in means.items()), f" best-per-case={best:.4f}")
    for k in names:
        kernels = {}
        for r in rows:
            for kn, ms in r["variants"][k]["kernel_ms"].items():
                kernels[kn] = kernels.get(kn, 0.0) + ms / len(rows)
        print(f"  {k}: mean busy per kernel: " + "  ".join(f"{kn.strip('_')}={ms * 1000:.1f}us" for kn, ms in kernels.items()))
    os.makedirs(args.out, exist_ok=True)
    with open(f"{args.out}/tune_{args.problem}.json", "w") as f:
        json.dump({"rows": rows, "means": means}, f, indent=1)


if __name__ == "__main__":
    main()
