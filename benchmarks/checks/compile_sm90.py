"""Compile backfuse's kernels for sm_90 on a machine without a GPU and report what they need.

Shared memory over the 227 KB a block may use, register spills or missing HGMMA instructions
show here, before any device time is spent. Pointers are taken as 16-byte aligned (as the
allocator gives them); integers as unspecialized.

    python benchmarks/checks/compile_sm90.py            # every configured kernel
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

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sm90(jit_fn, pointers: dict, scalars: dict, constexprs: dict, num_warps: int, num_stages: int):
    """pointers: name -> element type ('fp32', 'fp16', 'i32'); scalars: name -> 'i32' or 'fp32'."""
    fn = jit_fn
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in scalars:
            signature[name] = scalars[name]
        else:
            signature[name] = "constexpr"
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
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


def wan_021_kernels(cfg=None):
    from backfuse.ops import wan_text_video_xattn as op

    cfg = cfg or op.CONFIG
    f16, f32 = "fp16", "fp32"
    pack_ptrs = dict(go=f32, video=f32, text=f32, wq=f32, wk=f32, wv=f32, wo=f32, go16=f16, video16=f16,
                     text16=f16, wq16=f16, wkv16=f16, wo_t16=f16, colsum_parts=f32, dkv32=f32, grad_bq=f32,
                     grad_bk=f32, grad_bv=f32, arrivals="i32", grad_wq=f32, grad_wo=f32, grad_wk=f32, grad_wv=f32,
                     grad_video=f32, grad_text=f32)
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    p = cfg.pack
    yield "021 pack", compile_sm90(op._pack_kernel, pack_ptrs,
                                   ints("TV", "TT", "n_heads", "zero_dkv", "zero_wq", "zero_wo", "zero_wkv", "zero_gv", "zero_gt"),
                                   dict(ROWS=p.rows, COLS=p.cols, T=p.tile, BLOCK=p.block, ITERS=p.iters), p.warps, 1)
    fw = cfg.forward
    yield "021 forward products", compile_sm90(
        op._forward_products_kernel,
        dict(video16=f16, text16=f16, go16=f16, wq16=f16, wkv16=f16, wo_t16=f16, bq=f32, bk=f32, bv=f32,
             q16=f16, kv16=f16, dc16=f16, colsum_parts=f32, grad_bo=f32),
        ints("TV", "TT", "n_parts"),
        dict(BM=fw.bm, BN=fw.bn, BK=fw.bk, SUM_ROWS=op.SUM_ROWS, SUM_COLS=op.SUM_COLS), fw.warps, fw.stages)
    at = cfg.attention
    for one_tile, bn in ((True, at.one_tile), (False, at.bn)):
        yield f"021 attention {'one tile' if one_tile else 'tiles'} BN={bn}", compile_sm90(
            op._attention_kernel,
            dict(q16=f16, kv16=f16, dc16=f16, ctx16=f16, dq16=f16, dkv32=f32, dkv16=f16, grad_bq=f32,
                 grad_bk=f32, grad_bv=f32, arrivals="i32"),
            {**ints("NV", "NT", "per_program"), "scale": "fp32"}, dict(BM=at.bm, BN=bn, ONE_TILE=one_tile), at.warps, at.stages)
    gr = cfg.gradients
    yield "021 gradient products", compile_sm90(
        op._gradient_products_kernel,
        dict(dq16=f16, dkv16=f16, go16=f16, video16=f16, text16=f16, ctx16=f16, wq16=f16, wkv16=f16,
             grad_video=f32, grad_text=f32, grad_wq=f32, grad_wo=f32, grad_wk=f32, grad_wv=f32),
        ints("TV", "TT", "split_wv", "split_wt", "split_gv", "split_gt"), dict(BM=gr.bm, BN=gr.bn, BK=gr.bk), gr.warps, gr.stages)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    for name, kernel in wan_021_kernels():
        print(report(name, kernel))
        sys.stdout.flush()
