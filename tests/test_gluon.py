"""The Gluon (Hopper) kernels compiled for sm_90 on any machine: Gluon has no interpreter, so this is
what CI checks of them (API, shared memory, registers, spills, wgmma). Their numbers run on the GPU
(test_qkv_gqa.py's GPU tests).

Each compile runs in a subprocess without TRITON_INTERPRET: under the interpreter (which the test
session sets on a CPU before Triton is imported) the standard library's jit functions that Gluon
kernels call (reductions) are interpreter objects the compiler cannot inline.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

INTS = "i32"
ENGINE_CASES = {  # name: (A fp32, A K-major, B K-major, (bm, bn, bk), stages)
    "engine fp16 A[M, K] B[K, N] 128x256x64": (False, True, False, (128, 256, 64), 3),
    "engine fp16 A^T B^T 128x128x64": (False, False, True, (128, 128, 64), 4),
    "engine fp32 A in registers 128x256x32": (True, True, False, (128, 256, 32), 3),
}
CASES = [*ENGINE_CASES, "072 one launch"]
# Stack bytes per thread (ptxas's register spills) each case may use: the engine's kernels none; the
# 072 kernel 80 today (72 before session 20 passed each partition its first tile and stride, 128
# before session 19 gave its second consumer and pack 144 registers, 168 before its counter
# aggregate), with room to 128; more means a change made it spill
# (benchmarks/notes/gluon.md: the streamed pack partition that spilled more was 1.9x slower).
STACK_BUDGET = {name: 0 for name in ENGINE_CASES} | {"072 one launch": 128}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _compile(case: str):
    """Compile one case for sm_90 (in this process: run without TRITON_INTERPRET); its Usage."""
    from triton.experimental.gluon import language as gl

    from backfuse.kernels.gluon import gemm
    from backfuse.kernels.gluon.sm90 import compile_sm90, descriptor_type, usage
    from backfuse.kernels.launch import constexprs_of
    from backfuse.ops.qkv_gqa import config, gluon_kernels, spec

    if case in ENGINE_CASES:
        fp32, a_kmajor, b_kmajor, (bm, bn, bk), stages = ENGINE_CASES[case]
        sig = {"a_desc": descriptor_type(gl.float32 if fp32 else gl.float16, [bm, bk] if a_kmajor else [bk, bm]),
               "b_desc": descriptor_type(gl.float16, [bn, bk] if b_kmajor else [bk, bn]),
               "c_ptr": "*fp32", "stride_cm": INTS, "M": INTS, "N": INTS, "K": INTS, "splits": INTS}
        kernel = compile_sm90(gemm.gemm_kernel, sig, dict(A_KMAJOR=a_kmajor, A_REGS=fp32, B_KMAJOR=b_kmajor,
                                                          STAGES=stages), num_warps=4, maxnreg=168)
        return usage(kernel), 168
    g = config.CONFIG.gluon
    fn = gluon_kernels.fused_kernel
    sig = {name: descriptor_type(gl.float16, block) for name, _, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)}
    for p in fn.params:  # integers (all unspecialized), fp16 operand buffers, the counters, fp32 tensors
        if p.name not in sig and not p.is_constexpr:
            sig[p.name] = INTS if p.do_not_specialize else \
                "*fp16" if p.name.endswith("16") else "*i32" if p.name == "counters" else "*fp32"
    sizes = constexprs_of(fn, config.size_constexprs(spec.OFFICIAL))
    kernel = compile_sm90(fn, sig, dict(**sizes, STAGES=g.stages, PACK_WARPS=g.pack_warps, REGS=g.regs),
                          num_warps=4, maxnreg=g.maxnreg)
    assert usage(kernel).shared <= g.shared_bytes + 1024, (usage(kernel), g.shared_bytes)  # the plan's count holds
    return usage(kernel), g.maxnreg


@pytest.mark.parametrize("case", CASES)
def test_compiles_for_sm90(case):
    env = dict(os.environ, TRITON_INTERPRET="0")  # a compile: the interpreter off (importing backfuse would turn it on)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    from backfuse.kernels.gluon.sm90 import SHARED_LIMIT

    assert result["shared"] <= SHARED_LIMIT, result
    assert result["local"] == 0, f"local memory: {result}"
    assert result["stack"] <= STACK_BUDGET[case], f"spills beyond the budget: {result}"
    assert result["wgmma"] > 0, result
    assert result["registers"] <= result["maxnreg"], result


if __name__ == "__main__":
    found, maxnreg = _compile(sys.argv[1])
    print(json.dumps(dataclasses.asdict(found) | {"maxnreg": maxnreg}))
