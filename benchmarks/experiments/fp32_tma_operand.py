"""Can a persistent TMA product read its A operand in fp32 and round it to fp16 in registers, at
about the rate of an fp16 A? If so, the pack's activation copies (021: video, text, grad_output;
072: the upstream gradients) could go, their conversion hidden under the products' tensor-core
work. Row 21 of benchmarks/notes/021.md measured this for pointer-fed tiles (slower than the
copy); this is the persistent TMA form (`persistent_products.py`), C = A B + bias in fp16, timed
with CUDA-graph replays (TFLOP/s; '!' marks a wrong result), next to the fp16-A product plus the
fp32 -> fp16 copy it would replace.

    PYTHONPATH=src python benchmarks/experiments/fp32_tma_operand.py
"""
import torch
import triton
import triton.language as tl
from common import bias_fp16_epilogue, measure, replay_ms, tile_origin, use_torch_allocator


@triton.jit
def gemm_tma(a, b16, bias, c, M, N, K, B_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr):
    """a: fp16 or fp32 [M, K]; rounded to fp16 after the load."""
    da = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if B_T:
        db = tl.make_tensor_descriptor(b16, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        db = tl.make_tensor_descriptor(b16, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), tl.num_programs(0), flatten=True,
                         num_stages=STAGES):
        off_m, off_n = tile_origin(tile, N, BM, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            x = da.load([off_m, k]).to(tl.float16)
            y = db.load([off_n, k]).T if B_T else db.load([k, off_n])
            acc = tl.dot(x, y, acc)
        bias_fp16_epilogue(c, bias, acc, off_m, off_n, M, N, BM, BN)


def run(M, N, K, b_t):
    a32 = torch.randn(M, K, device="cuda")
    a16 = a32.half()
    b = torch.randn((N, K) if b_t else (K, N), device="cuda").half()
    bias = torch.randn(N, device="cuda")
    ref = (torch.mm(a16, b.T if b_t else b, out_dtype=torch.float32) + bias).half()
    c = torch.empty(M, N, device="cuda", dtype=torch.float16)
    flop = 2 * M * N * K
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cast_ms = replay_ms(lambda: a16.copy_(a32))
    cells = [f"copy A to fp16 {cast_ms * 1e3:5.1f} us"]
    for bm, bn, bk, w, s in ((128, 256, 64, 8, 3), (128, 256, 32, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4)):
        progs = min(triton.cdiv(M, bm) * triton.cdiv(N, bn), sms)
        for name, a in (("fp16 A", a16), ("fp32 A", a32)):
            def fn(a=a):
                gemm_tma[(progs,)](a, b, bias, c, M, N, K, B_T=b_t, BM=bm, BN=bn, BK=bk, STAGES=s, num_warps=w)

            ms = measure(cells, f"{bm}x{bn}x{bk}w{w}s{s} {name}", fn, c, ref, flop)
            if ms is not None and a is a16:
                cells[-1] += f" (+copy {flop / (ms + cast_ms) / 1e9:4.0f})"
    print(f"M={M} N={N} K={K} B_T={b_t}:\n  " + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    use_torch_allocator()
    # 021 forward (x W^T: 8192 and 16384 tokens), 072 grad_dec (GQ Wq, K 4096) and grad_enc ([GK | GV] [Wk; Wv]).
    for M, N, K, b_t in ((8192, 1024, 1024, True), (16384, 1024, 1024, True), (8192, 1536, 4096, False),
                         (8192, 1024, 2048, False)):
        run(M, N, K, b_t)
