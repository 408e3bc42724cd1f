"""The training kernels as a GPU launches them, compiled for sm_90 on any machine (`test_train_paths.py`'s
test runs this file in a subprocess without TRITON_INTERPRET: the interpreter must not be on for a compile).

    python tests/sm90_kernels.py bf16      # prints [{name, shared bytes}] as JSON
"""

import bisect
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import tempfile


def _sm90_cases(dtype: str):
    """(name, kernel, pointer types, constexprs, warps, stages) of the training kernels as the GPU launches them:
    the attention at every tile choice `steps.attention_tiles` makes (each at its heaviest options: the range
    guard's maxima, the additive mask, a cap where the tiles are the cap's, the query norm at head size 128,
    Wan's), forward and backward with dQ by atomics or by programs; the norm/RoPE backward, Wan's row norm with
    RoPE both ways, a cast, the guard's check. In fp16 the attention without a mask only: a masked kernel's fp16
    binary differs from its bf16 one only in the wgmma operands' type (the same tiles, the same shared memory, the
    same loops), and each fp16 attention compile costs CI's CPU seconds (the GPU suite compiles them all)."""
    from backfuse.kernels.triton import attention, passes, rope
    from backfuse.train import steps

    # A mask at its widest: 1-byte bool for MASK 2, fp32 (4 bytes a tile element) for MASK 3 (`F._gemma_masks`).
    ptr = ({n: f"*{dtype}" for n in ("q", "k", "v", "o", "do", "dk", "dv", "q_w")}
           | {n: "*i32" for n in ("lo", "hi", "k_lo", "k_hi", "alike")}
           | {n: "*fp32" for n in ("lse", "delta", "ranges", "q_rstd", "dq", "mask")})
    for d in steps.GPU_TILES:
        for softcap in (False, True) if d in steps.GPU_SOFTCAP_TILES else (False,):
            t = steps.attention_tiles(d, True, softcap=softcap)
            common = dict(HEADS=8, GROUP=2, D=d, CAUSAL=True, WINDOW=True, HAS_CAP=softcap, RANGES=True, APPROX_TANH=True,
                          Q_NORM=d == 128, LD_Q=8 * d, LD_K=4 * d, LD_V=4 * d)
            name = f"D={d}{' cap' if softcap else ''}"
            for mask, reads in ((0, False), (2, False), (3, False), (3, True))[:None if dtype == "bf16" else 1]:
                yield (f"{name} forward mask={mask}{' reads' if reads else ''}", attention.attention_forward_kernel, ptr,
                       dict(common, LD_O=8 * d, BM=t.bm, BN=t.bn, MASK=mask, READS=reads), t.warps, t.stages)
                for atomic in sorted({t.dq_atomic, False} - ({True} if reads else set())):  # (no dQ programs to read)
                    yield (f"{name} backward mask={mask} dq_atomic={atomic}{' reads' if reads else ''}",
                           attention.attention_backward_kernel, ptr,
                           dict(common, LD_DO=8 * d, LD_DQ=8 * d, LD_DK=4 * d, LD_DV=4 * d, KV_BN=t.kv_bn, KV_BM=t.kv_bm,
                                Q_BM=t.q_bm, Q_BN=t.q_bn, KV_ATOMIC=True, DQ_ATOMIC=atomic, MASK=mask, READS=reads),
                           t.bwd_warps, t.bwd_stages)
    (br, bn), (kbr, kbk) = steps.BOUNDS_TILES
    yield ("bounds", attention.attention_bounds_kernel, ptr | {"documents": "*i32"},
           dict(CAUSAL=True, WINDOW=True, DOCS=True, MASK=3, BR=br, BN=bn), 4, 1)
    yield "key bounds", attention.attention_key_bounds_kernel, ptr, dict(BR=kbr, BK=kbk), 4, 1
    yield ("norm/RoPE backward", rope.norm_rope_backward_kernel,
           {n: "*fp32" for n in ("dout", "x", "w", "cos", "sin", "parts", "ranges")} | {"dx": f"*{dtype}"},
           dict(D=128, LD_DOUT=3072, LD_X=5120, LD_DX=5120, BT=32, RANGES=True, NORM=True), 4, 1)
    # Wan 14B's rows (5120 columns: the widest tile), normed across the heads and turned on pairs, both ways
    bw, bt = steps._row_block(5120)
    rows = {n: f"*{dtype}" for n in ("x", "out", "dy", "dx")} | {n: "*fp32" for n in ("w", "rstd", "cos", "sin",
                                                                                    "parts", "bias_parts", "ranges")}
    yield ("row norm + RoPE", passes.row_norm_kernel, rows,
           dict(W=5120, BW=bw, LD_X=5120, LD_OUT=5120, BT=bt, RSTD=False, NORM=True, ROPE=128), 8, 1)
    yield ("row norm + RoPE backward", passes.row_norm_backward_kernel, rows,
           dict(W=5120, BW=bw, LD_DY=5120, LD_X=5120, LD_DX=5120, BT=bt, RANGES=True, NORM=True, ROPE=128, BIAS=True),
           8, 1)
    casts = {"src": "*fp32", "dst": f"*{dtype}", "ranges": "*fp32", "state": "*fp32"}
    for redo in (False, True):  # the upstream gradients' first cast, and the second where the exponent changed
        yield f"cast{' again' * redo}", passes.cast_kernel, casts, dict(BLOCK=8192, UPSTREAM=True, REDO=redo, RANGES=True), 8, 1
        yield (f"heads to tokens{' again' * redo}", passes.heads_to_tokens_kernel, casts,
               dict(GROUP=4, D=256, HEADS_OUT=4, LD=1024, BT=32, UPSTREAM=True, REDO=redo, RANGES=True), 4, 1)
    yield "decide", passes.decide_kernel, {"state": "*fp32", "ranges": "*fp32"}, {}, 1, 1
    yield ("guard check", passes.guard_check_kernel, {"maxima": "*fp32", "flags": "*i32", "state": "*fp32", "log": "*fp32"},
           dict(R=32, SCALED=True), 4, 1)


def _text(cubin: bytes) -> bytes:
    """The one .text.<kernel> section of a cubin (ELF64, little-endian): its instructions, 16 bytes each on sm_90."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * size) for i in range(count)]
    table = headers[names][4]
    texts = [cubin[h[4]:h[4] + h[5]] for h in headers
             if cubin[table + h[0]:cubin.index(b"\0", table + h[0])].startswith(b".text.")]
    assert len(texts) == 1, len(texts)
    return texts[0]


def _sass_counts(kernels) -> list:
    """[(HGMMA, WARPGROUP.DEPBAR)] of each compiled kernel, as `usage` counts them in `cuobjdump -sass`, from one
    nvdisasm of all their instructions laid end to end (a disassembler per kernel costs ~0.7 s, mostly its start);
    each instruction is told to its kernel by its address."""
    from backfuse.kernels.gluon.sm90 import _CUOBJDUMP

    texts = [_text(k.asm["cubin"]) for k in kernels]
    ends = list(itertools.accumulate(len(t) for t in texts))
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(b"".join(texts))
        f.flush()
        sass = subprocess.run([os.path.join(os.path.dirname(_CUOBJDUMP), "nvdisasm"), "-b", "SM90a", f.name],
                              capture_output=True, text=True, check=True).stdout
    counts = [[0, 0] for _ in kernels]
    for address, line in re.findall(r"/\*([0-9a-f]{4,})\*/([^\n]*)", sass):
        c = counts[bisect.bisect_right(ends, int(address, 16))]
        c[0] += line.count("HGMMA")
        c[1] += line.count("WARPGROUP.DEPBAR")
    return [tuple(c) for c in counts]


def _sm90_shared(dtype: str) -> list:
    """[{name, shared bytes, serialized}] of every `_sm90_cases` kernel compiled for sm_90 (run without
    TRITON_INTERPRET); serialized: ptxas made each wgmma wait for the one before (`Usage.serialized` on the
    SASS's HGMMA and WARPGROUP.DEPBAR counts).

    A kernel whose signature has no `dtype` pointer is the same specialization for both dtypes: it is compiled
    in the bf16 run only (the session still compiles each once). The SASS is read only where the answer can be
    True and is asked: a kernel whose PTX has no wgmma.mma_async has no HGMMA (serialized False by definition);
    a mask-reading attention (' reads') may serialize (the test does not ask), so its serialized is None. Those
    read are disassembled together (`_sass_counts`), the first also by `usage` as a check of that reading."""
    from backfuse.kernels.gluon.sm90 import Usage, compile_triton, usage

    out, read = [], []
    for name, fn, pointers, constexprs, warps, stages in _sm90_cases(dtype):
        if constexprs.get("MASK") == 2:
            pointers = dict(pointers, mask="*u8")
        sig = {p.name: pointers.get(p.name) or ("i32" if p.do_not_specialize else "fp32") for p in fn.params
               if not p.is_constexpr}
        if dtype != "bf16" and f"*{dtype}" not in sig.values():
            continue
        kernel = compile_triton(fn, sig, constexprs, num_warps=warps, num_stages=stages)
        out.append({"name": name, "shared": kernel.metadata.shared, "serialized": None if " reads" in name else False})
        if " reads" not in name and "wgmma.mma_async" in kernel.asm["ptx"]:
            read.append((out[-1], kernel))
    counts = _sass_counts([k for _, k in read])
    if read:
        first = usage(read[0][1])
        assert (first.wgmma, first.waits) == counts[0], ((first.wgmma, first.waits), counts[0])
    for (entry, kernel), (wgmma, waits) in zip(read, counts):
        entry["serialized"] = Usage(kernel.metadata.shared, 0, 0, 0, wgmma, waits).serialized
    return out


if __name__ == "__main__":
    print(json.dumps(_sm90_shared(sys.argv[1])))
