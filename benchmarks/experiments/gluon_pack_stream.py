"""How fast can one 4-warp program per SM pack 072's head-group sums, as the one-launch kernel's pack
partition must? A standalone study of the pack's dominant item kind (the sum of 4 query heads of
grad_key_states [B, 16, S, 256] into fp16 GK [B*S, 1024]), by asynchronous copies into shared
memory, in three shapes:

- `item`: one item at a time (its 4 units of 16 tokens x 256 copied, waited for, summed, stored),
  as the kernel's pack partition does: 64 KB in flight, then none while the item is used;
- `stream`: the units of this program's items in one ring of SLOTS slots, SLOTS - 1 copies ahead of
  the unit being used (16 KB per slot);
- programs per SM (`per_sm`): 2 programs of `item` give two items in flight per SM.

Reads 4 B x 16 heads, writes 2 B x 4 heads per token-feature: bandwidth = bytes / time.

    PYTHONPATH=src python benchmarks/experiments/gluon_pack_stream.py [--compile-only]
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

HEADS, GROUP, FEATURES, TOKENS = 16, 4, 256, 16  # host-side sizes
D, UNIT = gl.constexpr(256), gl.constexpr(16)
LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))
SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))


@gluon.jit
def _fetch_unit(buf, src, T, S, unit, step):
    """Unit `unit` of this program's list: item = pid + (unit // 4) * step, its query head unit % 4 of
    KV head item % 4, tokens (item // 4) * 16 .. + 16 (rows past T zero-filled)."""
    item = gl.program_id(0) + (unit // 4) * step
    head = (item % 4) * 4 + unit % 4
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LAYOUT))
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, LAYOUT))
    t = (item // 4) * 16 + r
    b = t // S
    rows = (b * 16 + head).to(gl.int64) * S + (t - b * S)
    ok = (t < T)[:, None] & (c < 256)[None, :]
    async_copy.async_copy_global_to_shared(buf, src + rows[:, None] * 256 + c[None, :], mask=ok)
    async_copy.commit_group()


@gluon.jit
def _store_sum(dst, acc, item, T):
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, LAYOUT))
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, LAYOUT))
    t = (item // 4) * 16 + r
    ok = (t < T)[:, None] & (c < 256)[None, :]
    gl.store(dst + t[:, None].to(gl.int64) * 1024 + (item % 4) * 256 + c[None, :], acc.to(gl.float16), mask=ok)


@gluon.jit(do_not_specialize=["T", "S", "items"])
def head_sums_kernel(src, dst, T, S, items, STREAM: gl.constexpr, SLOTS: gl.constexpr):
    """dst[t, j*256 + d] = fp16(sum_{g<4} src[b, 4j + g, s, d]) for t = b*S + s (items: 4 per 16 tokens)."""
    bufs = gl.allocate_shared_memory(gl.float32, [SLOTS, UNIT, D], SMEM)
    step = gl.num_programs(0)
    mine = gl.cdiv(items - gl.program_id(0), step)
    if STREAM:
        n_units = mine * 4
        for j in gl.static_range(SLOTS - 1):
            _fetch_unit(bufs.index(j), src, T, S, j, step)
        acc = gl.zeros([UNIT, D], gl.float32, LAYOUT)
        for j in range(n_units):
            ahead = j + SLOTS - 1  # into the slot read at j - 1 (freed by that iteration's barrier)
            _fetch_unit(bufs.index(ahead % SLOTS), src, T, S, ahead, step)
            async_copy.wait_group(SLOTS - 1)
            gl.thread_barrier()
            x = bufs.index(j % SLOTS).load(LAYOUT)
            acc = gl.where(j % 4 == 0, x, acc + x)
            if j % 4 == 3:
                _store_sum(dst, acc, gl.program_id(0) + (j // 4) * step, T)
            gl.thread_barrier()
        async_copy.wait_group(0)
    else:
        for k in range(mine):
            for u in gl.static_range(4):
                _fetch_unit(bufs.index(u), src, T, S, k * 4 + u, step)
            async_copy.wait_group(0)
            gl.thread_barrier()
            acc = bufs.index(0).load(LAYOUT)
            for u in gl.static_range(1, 4):
                acc += bufs.index(u).load(LAYOUT)
            _store_sum(dst, acc, gl.program_id(0) + k * step, T)
            gl.thread_barrier()


VARIANTS = {  # name: (STREAM, SLOTS, programs per SM)
    "item, 1 per SM": (False, 4, 1),
    "item, 2 per SM": (False, 4, 2),
    "stream 4 slots": (True, 4, 1),
    "stream 6 slots": (True, 6, 1),
    "stream 8 slots": (True, 8, 1),
    "stream 12 slots": (True, 12, 1),
}


def compile_only():
    sys.path.insert(0, "src")
    from backfuse.kernels.gluon.sm90 import compile_sm90, usage

    sig = {"src": "*fp32", "dst": "*fp16", "T": "i32", "S": "i32", "items": "i32"}
    for name, (stream, slots, _) in VARIANTS.items():
        k = compile_sm90(head_sums_kernel, sig, dict(STREAM=stream, SLOTS=slots), num_warps=4, maxnreg=128)
        print(f"{name:16s} {usage(k)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    from common import replay_ms

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, s in ((4, 4096), (64, 256), (8, 997)):  # 072 cases 0, 6, 7 (encoder side)
        src = torch.randn(batch, HEADS, s, FEATURES, device="cuda")
        t = batch * s
        ref = src.view(batch, GROUP, GROUP, s, D).sum(2).permute(0, 2, 1, 3).reshape(t, GROUP * FEATURES)
        items = -(-t // TOKENS) * GROUP
        nbytes = src.numel() * 4 + t * GROUP * FEATURES * 2
        copy = torch.empty_like(src)
        line = [f"B={batch} S={s}: copy {src.numel() * 8 / replay_ms(lambda: copy.copy_(src)) / 1e9:5.2f} TB/s"]
        for name, (stream, slots, per_sm) in VARIANTS.items():
            dst = torch.full((t, GROUP * FEATURES), float("nan"), dtype=torch.float16, device="cuda")

            def run(dst=dst, stream=stream, slots=slots, per_sm=per_sm):
                head_sums_kernel[(sms * per_sm,)](src, dst, t, s, items, STREAM=stream, SLOTS=slots, num_warps=4,
                                                  maxnreg=128)

            run()
            torch.cuda.synchronize()
            err = ((dst.float() - ref).abs().max() / ref.abs().max()).item()
            ms = replay_ms(run)
            line.append(f"{name} {nbytes / ms / 1e9:5.2f} TB/s{'' if err < 1e-3 else f' WRONG {err:.1e}'}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
