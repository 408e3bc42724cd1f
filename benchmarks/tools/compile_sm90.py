"""Compile backfuse's kernels (072, 021, 037) for sm_90 on a machine without a GPU and report what they need.

Shared memory over the 227 KB a block may use, register spills or missing HGMMA instructions
show here, before any device time is spent. Pointers are taken as 16-byte aligned (as the
allocator gives them); integers as unspecialized.

    python benchmarks/tools/compile_sm90.py            # every configured kernel
    python benchmarks/tools/compile_sm90.py 037        # one operator's
    python benchmarks/tools/compile_sm90.py train      # the training attention at each mask form, loop by loop

`train` prints each loop of the SASS (a backward branch and what it jumps over) with its instructions, spill
loads and stores (LDL, STL) and barriers: static counts, so a loop's branch that a call never takes is counted
too (notes/training.md, session 38).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backfuse.kernels.launch import constexprs_of

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sm90(jit_fn, sizes: dict, scalars: dict, constexprs: dict, num_warps: int, num_stages: int,
                 int_pointers=()):
    """sizes: the operator's sizes as constexprs (its `config.size_constexprs` at the benchmark's sizes;
    the kernel gets those it takes); scalars: name -> 'i32' or 'fp32' (arguments in the kernel's
    do_not_specialize default to 'i32'); every other non-constexpr argument is a pointer: fp16 when
    its name ends in 16 (our fp16 operand buffers), int32 when listed in int_pointers, else fp32."""
    constexprs = {**constexprs_of(jit_fn, sizes), **constexprs}
    scalars = {**{p.name: "i32" for p in jit_fn.params if p.do_not_specialize}, **scalars}
    signature, attrs = {}, {}
    for i, name in enumerate(jit_fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in scalars:
            signature[name] = scalars[name]
        else:
            signature[name] = "*" + ("i32" if name in int_pointers else "fp16" if name.endswith("16") else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jit_fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def report(name: str, kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    return (f"{name:28s} smem {kernel.metadata.shared / 1024:6.1f} KB  regs {regs.group(1) if regs else '?':>3s}  "
            f"local {local.group(1) if local else '?':>4s} B  HGMMA {sass.count('HGMMA'):4d}  "
            f"LDGSTS {sass.count('LDGSTS'):3d}  atomics {len(re.findall(r'RED|ATOM', sass)):3d}")


def loops(sass: str) -> list:
    """(first, last address, instructions, LDL, STL, BAR) of every loop of a SASS listing: each backward branch
    and the instructions from its target to it."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    out = []
    for addr, text in code:
        jump = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < addr:
            body = [t for a, t in code if int(jump.group(1), 16) <= a <= addr]
            out.append((int(jump.group(1), 16), addr, len(body), sum("LDL" in t for t in body),
                        sum("STL" in t for t in body), sum(re.search(r"\bBAR\b", t) is not None for t in body)))
    return out


def training_attention_loops(head_dim: int = 256):
    """(name, loops) of the training attention kernels (`train/steps.py`'s GPU tiles, bf16, one dK/dV program a
    key block) at each mask form: causal, bounds only (packed documents), a bool mask, an additive one."""
    from backfuse.kernels.gluon.sm90 import compile_triton
    from backfuse.kernels.triton import attention
    from backfuse.train import steps

    t = steps.attention_tiles(head_dim, True)
    d = head_dim
    common = dict(HEADS=8, GROUP=2, D=d, HAS_CAP=False, RANGES=False, APPROX_TANH=True, Q_NORM=False, LD_Q=8 * d,
                  LD_K=4 * d, LD_V=4 * d, WINDOW=False)
    for form, mask, mask_type in (("causal", 0, "fp32"), ("bounds", 1, "fp32"), ("bool", 2, "u8"), ("additive", 3, "bf16")):
        kinds = (("forward", attention.attention_forward_kernel, dict(LD_O=8 * d, BM=t.bm, BN=t.bn), t.warps, t.stages),
                 ("backward", attention.attention_backward_kernel,
                  dict(LD_DO=8 * d, LD_DQ=8 * d, LD_DK=4 * d, LD_DV=4 * d, KV_BN=t.kv_bn, KV_BM=t.kv_bm, Q_BM=t.q_bm,
                       Q_BN=t.q_bn, KV_ATOMIC=False, DQ_ATOMIC=t.dq_atomic), t.bwd_warps, t.bwd_stages))
        for kind, fn, extra, warps, stages in kinds:
            fp32 = ("lse", "delta", "ranges", "q_rstd", "dq")  # (dK, dV in bf16: one program a key block, as at 2x4096)
            sig = {p.name: "i32" if p.do_not_specialize else "fp32" if p.name in ("scale", "cap") else
                   "*i32" if p.name in ("lo", "hi", "k_lo", "k_hi", "alike") else f"*{mask_type}" if p.name == "mask" else
                   "*fp32" if p.name in fp32 else "*bf16" for p in fn.params if not p.is_constexpr}
            kernel = compile_triton(fn, sig, dict(common, **extra, CAUSAL=mask == 0, MASK=mask, READS=False),
                                    num_warps=warps, num_stages=stages)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
            yield f"D={d} {kind} {form}", loops(sass)


def wan_021_kernels(cfg=None):
    from backfuse.kernels.schedule import next_power_of_2
    from backfuse.ops.wan_xattn import config, spec, triton_attention, triton_kernels

    cfg = cfg or config.CONFIG
    sizes = config.size_constexprs(spec.OFFICIAL)
    p, fw, at, gr, sums, pdl = cfg.pack, cfg.forward, cfg.attention, cfg.gradients, cfg.sums, cfg.pdl
    yield "021 pack", compile_sm90(
        triton_kernels.pack_kernel, sizes, {},
        dict(ROWS=p.rows, COLS=p.cols, T=p.tile, BLOCK=p.block, ITERS=p.iters, PDL=pdl), p.warps, 1,
        int_pointers=("counters",))
    yield "021 forward products", compile_sm90(
        triton_kernels.forward_products_kernel, sizes, {},
        dict(BM=fw.bm, BN=fw.bn, BK=fw.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl), fw.warps, fw.stages)
    # one tile of the widest text, the suite's 77 tokens as head + tail (also in lone blocks), text in tiles
    lone_rows, lone_warps = at.lone_block or (at.bm, at.warps)
    for one_tile, (bn, tail), (bm, warps) in (
            (True, (at.one_tile, 0), (at.bm, at.warps)), (True, config.text_tiles(77), (at.bm, at.warps)),
            (True, config.text_tiles(77), (lone_rows, lone_warps)), (False, (at.bn, 0), (at.bm, at.warps))):
        for alone, deterministic in ((False, False), (False, True), (True, False)):
            yield (f"021 attention {'one tile' if one_tile else 'tiles'} {bm}x{bn}+{tail}"
                   f"{' det' if deterministic else ''}{' alone' if alone else ''}",
                   compile_sm90(triton_attention.attention_kernel, sizes, {"scale": "fp32"},
                                dict(BM=bm, BN=bn, BN_TAIL=tail, ONE_TILE=one_tile,
                                     FINISH=next_power_of_2(bn + tail) if one_tile else bn, ALONE=alone,
                                     DETERMINISTIC=deterministic, PDL=pdl), warps, at.stages,
                                int_pointers=("counters",)))
    yield "021 gradient products", compile_sm90(
        triton_kernels.gradient_products_kernel, sizes, {},
        dict(BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl), gr.warps, gr.stages,
        int_pointers=("counters",))


def qkv_gqa_072_kernels(cfg=None):
    from backfuse.ops.qkv_gqa import config, spec, triton_kernels

    cfg = cfg or config.CONFIG
    sizes = config.size_constexprs(spec.OFFICIAL)
    p, g, pdl = cfg.pack, cfg.tiles, cfg.pdl
    yield "072 pack", compile_sm90(
        triton_kernels.pack_kernel, sizes, {},
        dict(ROWS=p.rows, BLOCK=p.block, ITERS=p.iters, PDL=pdl), p.warps, 1)
    yield "072 products", compile_sm90(
        triton_kernels.projection_grads_kernel, sizes, {},
        dict(WEIGHT_GRADS=True, INPUT_GRADS=True, BM=g.bm, BN=g.bn, BK=g.bk, PDL=pdl), g.warps, g.stages)


def gemma3_037_kernels(cfg=None):
    from backfuse.ops.gemma3_core import config, spec, triton_kernels

    cfg = cfg or config.CONFIG
    official = spec.OFFICIAL
    sizes = config.size_constexprs(official)
    p, at, gr, sums, pdl = cfg.pack, cfg.attention, cfg.gradients, cfg.sums, cfg.pdl
    yield "037 pack", compile_sm90(
        triton_kernels.pack_kernel, sizes, {},
        dict(TILE=p.tile, BLOCK=p.block, ITERS=p.iters, PDL=pdl), p.warps, 1)
    forwards = [("products", True, cfg.forward), ("products, one wave", True, cfg.forward_one_wave),
                ("norm+rope", False, cfg.norm_rope)]
    for name, products, fw in (f for f in forwards if f[2] is not None):
        yield f"037 forward {name}", compile_sm90(
            triton_kernels.forward_products_kernel, sizes, {"eps": "fp32", "q_scale": "fp32"},
            dict(BM=fw.bm, BK=fw.bk, PRODUCTS=products, QK_WIDTH=official.qk if products else official.qkv, PDL=pdl),
            fw.warps, fw.stages)
    for bn in (at.fwd_bn, at.short_fwd_bn):
        yield f"037 attention forward BN={bn}", compile_sm90(
            triton_kernels.attention_forward_kernel, sizes, {"cap": "fp32"},
            dict(BM=at.fwd_bm, BN=bn, APPROX_TANH=at.approx_tanh, PDL=pdl), at.fwd_warps, at.fwd_stages)
    for kv_bn, split in ((at.kv_bn, 1), (at.few_kv_bn, 1), (at.few_kv_bn, official.group)):
        yield f"037 attention backward KV_BN={kv_bn} split {split}", compile_sm90(
            triton_kernels.attention_backward_kernel, sizes, {"scaling": "fp32", "cap": "fp32", "eps": "fp32"},
            dict(KV_BN=kv_bn, KV_BM=at.kv_bm, Q_BM=at.q_bm, Q_BN=at.q_bn, HEAD_SPLIT=split, QK_WIDTH=official.qk,
                 APPROX_TANH=at.approx_tanh, PDL=pdl), at.warps, at.stages,
            int_pointers=("counters",))
    yield "037 gradient products", compile_sm90(
        triton_kernels.gradient_products_kernel, sizes, {},
        dict(BM=gr.bm, BN=gr.bn, BK=gr.bk, SUM_ROWS=sums.rows, SUM_COLS=sums.cols, PDL=pdl), gr.warps, gr.stages,
        int_pointers=("counters",))


KERNELS = {"072": qkv_gqa_072_kernels, "021": wan_021_kernels, "037": gemma3_037_kernels}

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # a compile (importing backfuse would turn the interpreter on)
    if sys.argv[1:2] == ["train"]:
        for head_dim in map(int, sys.argv[2:] or ["256"]):
            for name, found in training_attention_loops(head_dim):
                print(name)
                for first, last, n, ldl, stl, bar in found:
                    if n > 100:
                        print(f"  loop {first:#07x}-{last:#07x}: {n:5d} instructions, LDL {ldl:3d}, STL {stl:3d}, BAR {bar}")
        sys.exit()
    for kernels in (KERNELS[op]() for op in (sys.argv[1:] or KERNELS)):
        for name, kernel in kernels:
            print(report(name, kernel))
            sys.stdout.flush()
