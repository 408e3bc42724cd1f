"""The Gluon (Hopper) kernels compiled for sm_90 on any machine: Gluon has no interpreter, so this is
what CI checks of them (API, shared memory, registers, spills, wgmma). Their numbers run on the GPU
(test_qkv_gqa.py's GPU tests, benchmarks/experiments/gluon_*.py)."""

import pytest
from triton.experimental.gluon import language as gl

from backfuse.kernels.gluon import gemm
from backfuse.kernels.gluon.sm90 import SHARED_LIMIT, compile_sm90, descriptor_type, usage
from backfuse.ops.qkv_gqa import config, gluon_kernels

INTS = "i32"


def _checked(kernel, wgmma_at_least=1):
    u = usage(kernel)
    assert u.shared <= SHARED_LIMIT, u
    assert u.local == 0, f"spills: {u}"
    assert u.wgmma >= wgmma_at_least, u
    return u


@pytest.mark.parametrize("a_dtype, a_kmajor, b_kmajor, block", [
    (gl.float16, True, False, (128, 256, 64)),  # grad_dec-like: A [M, K], B [K, N]
    (gl.float16, False, True, (128, 128, 64)),  # A^T stored [K, M], B^T stored [N, K]
    (gl.float32, True, False, (128, 256, 32)),  # fp32 A rounded to fp16 in registers
])
def test_product_engine_compiles_for_sm90(a_dtype, a_kmajor, b_kmajor, block):
    bm, bn, bk = block
    sig = {"a_desc": descriptor_type(a_dtype, [bm, bk] if a_kmajor else [bk, bm]),
           "b_desc": descriptor_type(gl.float16, [bn, bk] if b_kmajor else [bk, bn]),
           "c_ptr": "*fp32", "stride_cm": INTS, "M": INTS, "N": INTS, "K": INTS, "splits": INTS}
    kernel = compile_sm90(gemm.gemm_kernel, sig, dict(A_KMAJOR=a_kmajor, A_REGS=a_dtype == gl.float32,
                                                      B_KMAJOR=b_kmajor, STAGES=4 if bk == 64 and bn == 128 else 3),
                          num_warps=4, maxnreg=168)
    _checked(kernel)


def test_qkv_gqa_one_launch_compiles_for_sm90():
    g = config.CONFIG.gluon
    fn = gluon_kernels.fused_kernel
    sig = {name: descriptor_type(gl.float16, block) for name, _, block in gluon_kernels.descriptor_blocks(g.bm, g.bn, g.bk)}
    for p in fn.params:  # integers (all unspecialized), fp16 operand buffers, the counters, fp32 tensors
        if p.name not in sig and not p.is_constexpr:
            sig[p.name] = INTS if p.do_not_specialize else \
                "*fp16" if p.name.endswith("16") else "*i32" if p.name == "counters" else "*fp32"
    kernel = compile_sm90(fn, sig, dict(STAGES=g.stages), num_warps=4, maxnreg=gluon_kernels.MAXNREG)
    u = _checked(kernel)
    assert u.registers <= gluon_kernels.MAXNREG
