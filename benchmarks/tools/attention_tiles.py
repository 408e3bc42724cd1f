"""The training attention's tiles by head size (`train/steps.py: GPU_TILES`): forward and backward of
tile variants at the presets' attention shapes, checked against the first variant and timed, with
PyTorch's SDPA (cuDNN, flash) beside them where it takes the shape.

    PYTHONPATH=src python3 benchmarks/tools/attention_tiles.py            # compiles in parallel, then times
    PYTHONPATH=src python3 benchmarks/tools/attention_tiles.py --shapes g3-4b --variants cur,b64

Compilation runs first in worker processes (one per variant and shape, --jobs at once, each under
--timeout seconds), filling Triton's cache; the timing then runs in this process, one launch at a time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from backfuse.train import steps
from backfuse.train.steps import Attention, AttentionTiles

# name: (Attention, scale)
SHAPES = {
    "g3-4b": (Attention(1, 4096, 4096, 8, 2, 256, causal=True), 256 ** -0.5),
    "g3-4b-local": (Attention(1, 4096, 4096, 8, 2, 256, causal=True, window=1024), 256 ** -0.5),
    "g3-4b-8x1k": (Attention(8, 1024, 1024, 8, 2, 256, causal=True), 256 ** -0.5),
    "g2-9b": (Attention(1, 4096, 4096, 16, 2, 256, causal=True, softcap=50.0), 256 ** -0.5),
    "g3-27b": (Attention(1, 4096, 4096, 32, 2, 128, causal=True), 168 ** -0.5),
    "wan-1.3b": (Attention(1, 32760, 512, 12, 1, 128), 128 ** -0.5),
    "wan-14b": (Attention(1, 4680, 512, 40, 1, 128), 128 ** -0.5),
    # Wan 1.3B at some of `bench --dynamic`'s shapes (video x text): the key lengths a 128-key block wastes most on
    **{f"wan-{v}x{t}": (Attention(1, v, t, 12, 1, 128), 128 ** -0.5)
       for v, t in ((7800, 185), (29640, 233), (17160, 261), (31200, 393), (14040, 497))},
}

T = AttentionTiles
VARIANTS = {
    256: {
        "cur": steps.GPU_TILES[256],  # forward c's, backward b's (notes/training.md, session 32)
        "s31": T(bm=64, bn=32, warps=4, stages=2, kv_bn=32, kv_bm=32, q_bm=32, q_bn=32, bwd_warps=8, bwd_stages=1),
        "a": T(bm=64, bn=64, warps=4, stages=2, kv_bn=64, kv_bm=32, q_bm=64, q_bn=32, bwd_warps=8, bwd_stages=2),
        "b": T(bm=64, bn=64, warps=8, stages=2, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=8, bwd_stages=2),
        "c": T(bm=128, bn=64, warps=8, stages=2, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=8, bwd_stages=1),
        "d": T(bm=128, bn=32, warps=8, stages=3, kv_bn=32, kv_bm=64, q_bm=64, q_bn=32, bwd_warps=4, bwd_stages=2),
        "e": T(bm=64, bn=64, warps=8, stages=2, kv_bn=64, kv_bm=32, q_bm=64, q_bn=32, bwd_warps=8, bwd_stages=1),
    },
    128: {
        "cur": steps.GPU_TILES[128],  # forward d's, backward a's
        "s31": T(bm=128, bn=64, warps=8, stages=3, kv_bn=64, kv_bm=32, q_bm=64, q_bn=32, bwd_warps=4, bwd_stages=2),
        "a": T(bm=128, bn=128, warps=8, stages=2, kv_bn=128, kv_bm=64, q_bm=128, q_bn=64, bwd_warps=8, bwd_stages=2),
        "b": T(bm=128, bn=64, warps=8, stages=2, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=4, bwd_stages=3),
        "c": T(bm=128, bn=64, warps=4, stages=3, kv_bn=128, kv_bm=32, q_bm=128, q_bn=32, bwd_warps=8, bwd_stages=2),
        "d": T(bm=64, bn=64, warps=4, stages=3, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=8, bwd_stages=2),
        "e": T(bm=64, bn=64, warps=4, stages=3, kv_bn=64, kv_bm=64, q_bm=128, q_bn=64, bwd_warps=8, bwd_stages=2),
        "f": T(bm=64, bn=32, warps=4, stages=3, kv_bn=64, kv_bm=128, q_bm=128, q_bn=32, bwd_warps=8, bwd_stages=2),
    },
}
# A variant's name with "+atomic": dQ added by the key blocks' programs (fp32 atomics, no dQ programs);
# by default for these (others need more shared memory than a program has).
ATOMIC = {256: ("a",), 128: ("a",)}


def variant(a: Attention, name: str):
    base, _, extra = name.partition("+")
    return VARIANTS[a.head_dim][base], extra == "atomic"


class Run:
    """One variant at one shape: its buffers and its launches."""

    def __init__(self, a: Attention, scale: float, tiles: AttentionTiles, atomic: bool, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev, bf = "cuda", torch.bfloat16
        kv = a.heads // a.group
        tq, tk = a.batch * a.s_q, a.batch * a.s_k

        def rnd(rows, cols):
            return torch.randn(rows, cols, device=dev, generator=g).to(bf)

        self.q, self.k, self.v = rnd(tq, a.heads * a.head_dim), rnd(tk, kv * a.head_dim), rnd(tk, kv * a.head_dim)
        self.do = rnd(tq, a.heads * a.head_dim)
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty(a.batch * a.heads, a.s_q, device=dev)
        self.delta = torch.empty_like(self.lse)
        self.split = a.split(tiles, torch.cuda.get_device_properties(0).multi_processor_count, False)
        wide = torch.float32 if self.split > 1 else bf
        self.dq = torch.empty(tq, a.heads * a.head_dim, device=dev, dtype=torch.float32 if atomic else bf)
        self.dk = torch.empty(tk, kv * a.head_dim, device=dev, dtype=wide)
        self.dv = torch.empty_like(self.dk)
        self.scale, self.atomic = scale, atomic
        self.forward_launches = steps.attention_forward(a, tiles, self.q, self.k, self.v, self.o, self.lse, scale, None)
        self.delta_launch = steps.attention_delta(a, self.o, self.do, self.delta, None)
        self.backward_launches = steps.attention_backward(a, tiles, self.split, self.q, self.k, self.v, self.do,
                                                          self.lse, self.delta, self.dq, self.dk, self.dv, scale, None,
                                                          dq_atomic=atomic)

    def forward(self):
        for launch in self.forward_launches:
            launch()

    def backward(self):
        if self.split > 1:
            self.dk.zero_()
            self.dv.zero_()
        if self.atomic:
            self.dq.zero_()
        self.delta_launch()
        for launch in self.backward_launches:
            launch()

    def grads(self):
        return [t.float() for t in (self.o, self.dq, self.dk, self.dv)]


def sdpa(a: Attention, scale: float, backend, seed: int = 0):
    """(forward, backward) closures of torch's SDPA on the shape, or None where it does not take it."""
    from torch.nn.attention import sdpa_kernel

    if a.softcap or a.window:
        return None
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = a.heads // a.group

    def rnd(s, h):
        return torch.randn(a.batch, s, h, a.head_dim, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)

    q, k, v = rnd(a.s_q, a.heads).requires_grad_(), rnd(a.s_k, kv).requires_grad_(), rnd(a.s_k, kv).requires_grad_()
    do = rnd(a.s_q, a.heads)
    state = {}

    def forward():
        with sdpa_kernel(backend):
            state["o"] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=a.causal, scale=scale,
                                                                          enable_gqa=a.group > 1)

    def backward():
        torch.autograd.grad(state["o"], (q, k, v), do, retain_graph=True)

    try:
        forward()
        backward()
    except RuntimeError:
        return None
    return forward, backward


def median_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[reps // 2] * 1e3


def flops(a: Attention) -> float:
    """Matrix FLOPs of the forward (QK^T and PV) over the visible pairs."""
    if a.causal:
        pairs = sum(min(i + 1, a.window or i + 1) for i in range(a.s_q))
    else:
        pairs = a.s_q * a.s_k
    return 4.0 * a.batch * a.heads * pairs * a.head_dim


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", help="e.g. cur,a,d+atomic (default: every variant of the head size, and ATOMIC's)")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--only", help="(worker) compile one shape:variant and exit")
    args = ap.parse_args()
    if args.only:
        shape, name = args.only.split(":")
        a, scale = SHAPES[shape]
        run = Run(a, scale, *variant(a, name))
        run.forward()
        run.backward()
        torch.cuda.synchronize()
        return
    def names(shape):
        if args.variants:
            return args.variants.split(",")
        mine = list(VARIANTS[SHAPES[shape][0].head_dim])
        return mine + [f"{n}+atomic" for n in ATOMIC[SHAPES[shape][0].head_dim]]

    jobs = [(s, v) for s in args.shapes.split(",") for v in names(s)]
    failed = set()

    def compile_one(job):
        cmd = [sys.executable, __file__, "--only", ":".join(job)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return job, "compile timed out"
        return job, None if done.returncode == 0 else done.stderr.strip().splitlines()[-1][:160]

    with ThreadPoolExecutor(args.jobs) as pool:
        for job, err in pool.map(compile_one, jobs):
            if err:
                failed.add(job)
                print(f"{job[0]} {job[1]}: {err}", flush=True)
    print("| shape | variant | split | fwd us | bwd us | fwd TFLOP/s | bwd TFLOP/s | max err vs first |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        a, scale = SHAPES[shape]
        fl = flops(a)
        first = None
        for name in names(shape):
            if (shape, name) in failed:
                continue
            run = Run(a, scale, *variant(a, name))
            fwd, bwd = median_us(run.forward), median_us(run.backward)
            got = run.grads()
            if first is None:
                first, err = got, 0.0
            else:
                err = max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(got, first))
            print(f"| {shape} | {name} | {run.split} | {fwd:.1f} | {bwd:.1f} | {fl / fwd / 1e6:.0f} | "
                  f"{2.5 * fl / bwd / 1e6:.0f} | {err:.1e} |", flush=True)
            del run
        from torch.nn.attention import SDPBackend

        for label, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            fb = sdpa(a, scale, backend)
            if fb is not None:
                fwd, bwd = median_us(fb[0]), median_us(fb[1])
                print(f"| {shape} | {label} | | {fwd:.1f} | {bwd:.1f} | {fl / fwd / 1e6:.0f} | {2.5 * fl / bwd / 1e6:.0f} | |",
                      flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
