"""072 — cross-attention QKV projection with GQA repeat, backward (Parakeet TDT 0.6B v3).

Forward: q = dec @ Wq^T as 16 heads; k = enc @ Wk^T, v = enc @ Wv^T as 4 KV heads repeated to 16.
Backward: GQ is grad_query_states token-major; GK, GV sum each group of 4 query heads;
grad_dec = GQ @ Wq, grad_Wq = GQ^T @ dec, grad_enc = GK @ Wk + GV @ Wv, grad_Wk = GK^T @ enc,
grad_Wv = GV^T @ enc.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..kernels import buffers
from ..kernels.elementwise import cast_chunk, chunks, zero_chunk
from ..kernels.fp16_range import RangeSlots, max_abs
from ..kernels.gemm import TileConfig, choose_splits, gemm_tile, longest_first, tile_count
from ..kernels.launch import FastKernel, after_previous_launch
from ..problem import Problem, Tensor, fp32_matmul

HIDDEN = 1536
CROSS_HIDDEN = 1024
HEADS = 16
KV_HEADS = 4
GROUP = HEADS // KV_HEADS
HEAD_DIM = 256
Q_OUT = HEADS * HEAD_DIM  # 4096
KV_OUT = KV_HEADS * HEAD_DIM  # 1024

B, SD, SE = "batch_size", "seq_len_dec", "seq_len_enc"

# The same constants as constexpr for the kernels.
_HIDDEN = tl.constexpr(HIDDEN)
_CROSS = tl.constexpr(CROSS_HIDDEN)
_HEADS = tl.constexpr(HEADS)
_GROUP = tl.constexpr(GROUP)
_HEAD_DIM = tl.constexpr(HEAD_DIM)
_Q_OUT = tl.constexpr(Q_OUT)
_KV_OUT = tl.constexpr(KV_OUT)


class CrossAttnQKVGQABackward(Problem):
    id = "072"
    name = "072_cross_attention_qkv_projection_with_gqa_repeat_backward"
    workload_file = "072_cross_attn_qkv_gqa_bwd.jsonl"
    inputs = (
        Tensor("grad_query_states", (B, HEADS, SD, HEAD_DIM)),
        Tensor("grad_key_states", (B, HEADS, SE, HEAD_DIM)),
        Tensor("grad_value_states", (B, HEADS, SE, HEAD_DIM)),
        Tensor("decoder_hidden_states", (B, SD, HIDDEN)),
        Tensor("encoder_hidden_states", (B, SE, CROSS_HIDDEN)),
        Tensor("q_weight", (Q_OUT, HIDDEN)),
        Tensor("k_weight", (KV_OUT, CROSS_HIDDEN)),
        Tensor("v_weight", (KV_OUT, CROSS_HIDDEN)),
    )
    outputs = (
        Tensor("grad_decoder_hidden_states", (B, SD, HIDDEN)),
        Tensor("grad_encoder_hidden_states", (B, SE, CROSS_HIDDEN)),
        Tensor("grad_q_weight", (Q_OUT, HIDDEN)),
        Tensor("grad_k_weight", (KV_OUT, CROSS_HIDDEN)),
        Tensor("grad_v_weight", (KV_OUT, CROSS_HIDDEN)),
    )
    upstream_grads = ("grad_query_states", "grad_key_states", "grad_value_states")
    differentiates = ("decoder_hidden_states", "encoder_hidden_states", "q_weight", "k_weight", "v_weight")

    def draw(self, axes, gen, device):
        def normal(spec, scale):
            return torch.randn(spec.shape(axes), generator=gen, device=device) * scale

        grads, dec, enc, wq, wk, wv = self.inputs[:3], *self.inputs[3:]
        return [normal(g, 1 / math.sqrt(Q_OUT)) for g in grads] + [
            normal(dec, 1 / math.sqrt(HIDDEN)),
            normal(enc, 1 / math.sqrt(CROSS_HIDDEN)),
            normal(wq, 1 / math.sqrt(HIDDEN)),
            normal(wk, 1 / math.sqrt(CROSS_HIDDEN)),
            normal(wv, 1 / math.sqrt(CROSS_HIDDEN)),
        ]

    def reference_math(self, gq, gk, gv, dec, enc, wq, wk, wv):
        batch, _, sd, _ = gq.shape
        se = gk.shape[2]

        def group_sum(g):  # [B,16,Se,256] -> [B*Se, 1024]: query head h belongs to KV head h // 4
            return g.view(batch, KV_HEADS, GROUP, se, HEAD_DIM).sum(2).transpose(1, 2).reshape(batch * se, KV_OUT)

        gq_tok = gq.transpose(1, 2).reshape(batch * sd, Q_OUT)
        gk_tok, gv_tok = group_sum(gk), group_sum(gv)
        dec2 = dec.reshape(batch * sd, HIDDEN)
        enc2 = enc.reshape(batch * se, CROSS_HIDDEN)
        return (
            (gq_tok @ wq).view(batch, sd, HIDDEN),
            (gk_tok @ wk + gv_tok @ wv).view(batch, se, CROSS_HIDDEN),
            gq_tok.T @ dec2,
            gk_tok.T @ enc2,
            gv_tok.T @ enc2,
        )

    def forward(self, dec, enc, wq, wk, wv):
        batch, sd, _ = dec.shape
        se = enc.shape[1]
        q = (dec @ wq.T).view(batch, sd, HEADS, HEAD_DIM).transpose(1, 2)

        def kv(w):
            heads = (enc @ w.T).view(batch, se, KV_HEADS, HEAD_DIM).transpose(1, 2)
            return heads.repeat_interleave(GROUP, dim=1)

        return q, kv(wk), kv(wv)

    def macs(self, axes):
        dec_tokens = axes[B] * axes[SD]
        enc_tokens = axes[B] * axes[SE]
        # grad_dec and grad_Wq; grad_enc (K = 2048 over [Wk; Wv]) and [grad_Wk; grad_Wv].
        return 2 * dec_tokens * Q_OUT * HIDDEN + 2 * enc_tokens * 2 * KV_OUT * CROSS_HIDDEN

    def fused(self, gq, gk, gv, dec, enc, wq, wk, wv, needs=None, deterministic=False, ranges=None):
        if gk.numel() >= 2**31 or gq.numel() >= 2**31:  # the kernels count elements in int32
            with fp32_matmul(tf32=False):
                return self.reference_math(gq, gk, gv, dec, enc, wq, wk, wv)
        return qkv_gqa_backward(gq, gk, gv, dec, enc, wq, wk, wv, needs=needs, deterministic=deterministic,
                                ranges=ranges)


PROBLEM = CrossAttnQKVGQABackward()

# ---- fused path: one prologue pass to fp16 operands, then the four products ----------------------


@triton.jit
def _gq_tile(gq, gq16, tile, SD, ROWS: tl.constexpr):
    """GQ[b*Sd + s, h*256 + d] = fp16(grad_query_states[b, h, s, d]) for ROWS tokens of one head;
    returns their largest |value|."""
    s_blocks = (SD + ROWS - 1) // ROWS
    b = tile // (_HEADS * s_blocks)
    h = (tile // s_blocks) % _HEADS
    s = (tile % s_blocks) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, _HEAD_DIM)
    rows_ok = s[:, None] < SD
    src = gq + ((b * _HEADS + h).to(tl.int64) * SD + s[:, None]) * _HEAD_DIM + d[None, :]
    dst = gq16 + (b.to(tl.int64) * SD + s[:, None]) * _Q_OUT + h * _HEAD_DIM + d[None, :]
    x = tl.load(src, mask=rows_ok, other=0.0)
    tl.store(dst, x.to(tl.float16), mask=rows_ok)
    return max_abs(x)


@triton.jit
def _group_sum_tile(g, gkv16, tile, SE, column0, ROWS: tl.constexpr):
    """GK[b*Se + s, j*256 + d] = fp16(sum over g < 4 of grad[b, 4j + g, s, d]), at column0 of [GK | GV];
    returns the sums' largest |value|."""
    s_blocks = (SE + ROWS - 1) // ROWS
    b = tile // (_KV_OUT // _HEAD_DIM * s_blocks)
    j = (tile // s_blocks) % (_KV_OUT // _HEAD_DIM)
    s = (tile % s_blocks) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, _HEAD_DIM)
    rows_ok = s[:, None] < SE
    acc = tl.zeros((ROWS, _HEAD_DIM), dtype=tl.float32)
    for q_head in tl.static_range(_GROUP):
        head = b * _HEADS + j * _GROUP + q_head
        acc += tl.load(g + (head.to(tl.int64) * SE + s[:, None]) * _HEAD_DIM + d[None, :], mask=rows_ok)
    dst = gkv16 + (b.to(tl.int64) * SE + s[:, None]) * (2 * _KV_OUT) + column0 + j * _HEAD_DIM + d[None, :]
    tl.store(dst, acc.to(tl.float16), mask=rows_ok)
    return max_abs(acc)


@triton.jit(do_not_specialize=["zero_dec", "zero_enc", "zero_wq", "zero_wkv", "B", "SD", "SE"])
def _pack_kernel(
    gq, gk, gv, dec, enc, wq, wk, wv,
    gq16, gkv16, dec16, enc16, wq16, wkv16, ranges,
    grad_dec, grad_enc, grad_wq, grad_wkv,
    zero_dec, zero_enc, zero_wq, zero_wkv,
    B, SD, SE,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every fp16 operand of the four products, and the zeroed outputs that split-K accumulates into.

    Program ranges, in order: GQ head-tiles, GK and GV group sums, flat casts of dec, enc, Wq, Wk,
    Wv (Wk and Wv stacked as [Wk; Wv]), then zero fills of the outputs whose flag is set. Each
    converting program stores the largest |value| it converted in ranges[pid].
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    n_gq = B * _HEADS * ((SD + ROWS - 1) // ROWS)
    n_gk = B * (_KV_OUT // _HEAD_DIM) * ((SE + ROWS - 1) // ROWS)
    n_dec = B * SD * _HIDDEN
    n_enc = B * SE * _CROSS
    n_wq = _Q_OUT * _HIDDEN
    n_wk = _KV_OUT * _CROSS
    e_gq = n_gq
    e_gk = e_gq + n_gk
    e_gv = e_gk + n_gk
    CHUNK: tl.constexpr = BLOCK * ITERS
    c_dec = (n_dec + CHUNK - 1) // CHUNK
    c_enc = (n_enc + CHUNK - 1) // CHUNK
    c_wq = (n_wq + CHUNK - 1) // CHUNK
    c_wk = (n_wk + CHUNK - 1) // CHUNK
    e_dec = e_gv + c_dec
    e_enc = e_dec + c_enc
    e_wq = e_enc + c_wq
    e_wk = e_wq + c_wk
    e_wv = e_wk + c_wk
    e_zdec = e_wv + zero_dec * c_dec
    e_zenc = e_zdec + zero_enc * c_enc
    e_zwq = e_zenc + zero_wq * c_wq
    largest = 0.0
    if pid < e_gq:
        largest = _gq_tile(gq, gq16, pid, SD, ROWS)
    elif pid < e_gk:
        largest = _group_sum_tile(gk, gkv16, pid - e_gq, SE, 0, ROWS)
    elif pid < e_gv:
        largest = _group_sum_tile(gv, gkv16, pid - e_gk, SE, _KV_OUT, ROWS)
    elif pid < e_dec:
        largest = cast_chunk(dec, dec16, n_dec, pid - e_gv, BLOCK, ITERS)
    elif pid < e_enc:
        largest = cast_chunk(enc, enc16, n_enc, pid - e_dec, BLOCK, ITERS)
    elif pid < e_wq:
        largest = cast_chunk(wq, wq16, n_wq, pid - e_enc, BLOCK, ITERS)
    elif pid < e_wk:
        largest = cast_chunk(wk, wkv16, n_wk, pid - e_wq, BLOCK, ITERS)
    elif pid < e_wv:
        largest = cast_chunk(wv, wkv16 + n_wk, n_wk, pid - e_wk, BLOCK, ITERS)
    elif pid < e_zdec:
        zero_chunk(grad_dec, n_dec, pid - e_wv, BLOCK, ITERS)
    elif pid < e_zenc:
        zero_chunk(grad_enc, n_enc, pid - e_zdec, BLOCK, ITERS)
    elif pid < e_zwq:
        zero_chunk(grad_wq, n_wq, pid - e_zenc, BLOCK, ITERS)
    else:
        zero_chunk(grad_wkv, 2 * n_wk, pid - e_zwq, BLOCK, ITERS)
    if pid < e_wv:
        tl.store(ranges + pid, largest)


@triton.jit(do_not_specialize=["TD", "TE", "split_wq", "split_wkv", "split_dec", "split_enc", "start_wq", "start_wkv",
                                "start_dec", "start_enc"])
def _projection_grads_kernel(
    gq16, gkv16, dec16, enc16, wq16, wkv16,
    grad_dec, grad_enc, grad_wq, grad_wkv,
    TD, TE,
    split_wq, split_wkv, split_dec, split_enc,
    start_wq, start_wkv, start_dec, start_enc,
    WEIGHT_GRADS: tl.constexpr,
    INPUT_GRADS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Tiles of the four products: grad_Wq, grad_[Wk; Wv] (WEIGHT_GRADS), grad_dec, grad_enc (INPUT_GRADS).

    With GQ [TD, 4096] and [GK | GV] [TE, 2048] in fp16: grad_Wq = GQ^T dec, grad_[Wk; Wv] =
    [GK | GV]^T enc, grad_dec = GQ Wq, grad_enc = [GK | GV] [Wk; Wv]. The weight gradients read
    their A operand transposed (feature-contiguous), the input gradients row-major; Triton gives
    each layout its own shared-memory ring, so one launch of both needs a smaller ring. Each
    product's tiles start at program start_* (the host orders them deepest first:
    gemm.longest_first).
    """
    after_previous_launch(PDL)
    pid = tl.program_id(0)
    if WEIGHT_GRADS:
        # One call site for both (so they share one shared-memory ring); operands by select.
        t_q = ((_Q_OUT + BM - 1) // BM) * ((_HIDDEN + BN - 1) // BN) * split_wq
        t_kv = ((2 * _KV_OUT + BM - 1) // BM) * ((_CROSS + BN - 1) // BN) * split_wkv
        on_q = (pid >= start_wq) & (pid < start_wq + t_q)
        if on_q | ((pid >= start_wkv) & (pid < start_wkv + t_kv)):
            width = tl.multiple_of(tl.where(on_q, _HIDDEN, _CROSS), 256)
            gemm_tile(
                pid - tl.where(on_q, start_wq, start_wkv),
                tl.where(on_q, gq16, gkv16),
                tl.where(on_q, dec16, enc16),
                tl.where(on_q, grad_wq, grad_wkv),
                tl.multiple_of(tl.where(on_q, _Q_OUT, 2 * _KV_OUT), 256), width, tl.where(on_q, TD, TE),
                1, tl.multiple_of(tl.where(on_q, _Q_OUT, 2 * _KV_OUT), 256), width, 1, width,
                tl.where(on_q, split_wq, split_wkv), BM, BN, BK,
            )
    if INPUT_GRADS:
        t_dec = ((TD + BM - 1) // BM) * ((_HIDDEN + BN - 1) // BN) * split_dec
        t_enc = ((TE + BM - 1) // BM) * ((_CROSS + BN - 1) // BN) * split_enc
        on_dec = (pid >= start_dec) & (pid < start_dec + t_dec)
        if on_dec | ((pid >= start_enc) & (pid < start_enc + t_enc)):
            width = tl.multiple_of(tl.where(on_dec, _HIDDEN, _CROSS), 256)
            depth = tl.multiple_of(tl.where(on_dec, _Q_OUT, 2 * _KV_OUT), 256)
            gemm_tile(
                pid - tl.where(on_dec, start_dec, start_enc),
                tl.where(on_dec, gq16, gkv16),
                tl.where(on_dec, wq16, wkv16),
                tl.where(on_dec, grad_dec, grad_enc),
                tl.where(on_dec, TD, TE), width, depth,
                depth, 1, width, 1, width,
                tl.where(on_dec, split_dec, split_enc), BM, BN, BK,
            )


PACK = FastKernel(_pack_kernel)
PRODUCTS = FastKernel(_projection_grads_kernel)


class PackConfig(NamedTuple):
    """Prologue shape: tokens per head-tile; flat casts and fills: elements per step, steps per program."""

    rows: int = 32
    block: int = 4096
    iters: int = 16
    warps: int = 4


PACK_CONFIG = PackConfig()


# Our products' tiles (both operand layouts in one launch; measured: benchmarks/notes/072.md). They
# run below CUBLAS_MIN_FLOP only, where 128 x 128 tiles at 4 warps (2 per SM) beat 128 x 256 by 5%.
GEMM_CONFIG = TileConfig(128, 128, 32, 4, 6)
# From this much product work (FLOP) on, cuBLAS's products beat ours by more than its three extra
# launches can cost, even on a slow host: the GPU work then outlasts the launching (measured:
# benchmarks/notes/072.md). Below it, cuBLAS wins only when the host keeps up.
CUBLAS_MIN_FLOP = 100e9
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles.
INTERPRETER_GEMM_CONFIG = TileConfig(512, 512, 256, 8, 1)
INTERPRETER_PACK_CONFIG = PackConfig(32, 1 << 20, 1, 4)


def qkv_gqa_backward(gq, gk, gv, dec, enc, wq, wk, wv, *, needs=None, deterministic=False, ranges=None,
                     config=None, one_launch=True, pack=None, products=None, sms=None):
    """The 072 outputs from the official inputs (validated by the caller).

    needs: one bool per output (None: all); the products of outputs not needed are skipped (with
    our products: grad_dec and grad_enc together, and the three weight gradients together).
    deterministic: the same outputs bit for bit on every call (our products without K splits; cuBLAS
    products are reproducible on one GPU model as they are). ranges: a RangeSlots that receives the
    largest |value| of every tensor converted to fp16 (only inputs and their head-group sums here).

    products: "triton" (our tiles) or "cublas" (four torch.mm on our fp16 operands); None picks by
    size on a GPU. config: tile shape and schedule of the Triton products; one_launch: both operand
    layouts in one grid (else one launch each); pack: the prologue's shape (config and pack None:
    GEMM_CONFIG, PACK_CONFIG on a GPU, the INTERPRETER_ ones on the CPU); sms: processors to balance
    their K splits over (the GPU's count; on the CPU interpreter, 1).
    """
    batch, _, sd, _ = gq.shape
    se = gk.shape[2]
    td, te = batch * sd, batch * se
    device = gq.device
    on_gpu = device.type == "cuda"
    config = config or (GEMM_CONFIG if on_gpu else INTERPRETER_GEMM_CONFIG)
    pack = pack or (PACK_CONFIG if on_gpu else INTERPRETER_PACK_CONFIG)
    if products is None:
        flop = 4 * (td * Q_OUT * HIDDEN + te * 2 * KV_OUT * CROSS_HIDDEN)
        products = "cublas" if device.type == "cuda" and flop >= CUBLAS_MIN_FLOP else "triton"
    f16 = lambda *shape: buffers.empty(shape, torch.float16, device)  # noqa: E731
    f32 = lambda *shape: buffers.empty(shape, torch.float32, device)  # noqa: E731
    gq16, gkv16, dec16, enc16 = f16(td, Q_OUT), f16(te, 2 * KV_OUT), f16(td, HIDDEN), f16(te, CROSS_HIDDEN)
    wq16, wkv16 = f16(Q_OUT, HIDDEN), f16(2 * KV_OUT, CROSS_HIDDEN)
    grad_dec, grad_enc = f32(batch, sd, HIDDEN), f32(batch, se, CROSS_HIDDEN)
    # grad_Wk and grad_Wv are the row blocks of one tensor, which one product writes.
    grad_wq, grad_wkv = f32(Q_OUT, HIDDEN), f32(2 * KV_OUT, CROSS_HIDDEN)
    grad_wk, grad_wv = grad_wkv[:KV_OUT], grad_wkv[KV_OUT:]

    needs = needs or (True,) * 5
    input_grads, weight_grads = any(needs[:2]), any(needs[2:])
    bm, bn, bk = config.bm, config.bn, config.bk
    if sms is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    weight_products = [(Q_OUT, HIDDEN, td), (2 * KV_OUT, CROSS_HIDDEN, te)]
    input_products = [(td, HIDDEN, Q_OUT), (te, CROSS_HIDDEN, 2 * KV_OUT)]
    splits = choose_splits(weight_products + input_products, bm, bn, bk, sms) \
        if products == "triton" and not deterministic else [1] * 4
    split_wq, split_wkv, split_dec, split_enc = splits
    tiles = [tile_count(m, n, s, bm, bn) for (m, n, _), s in zip(weight_products + input_products, splits)]
    weight_tiles, input_tiles = sum(tiles[:2]), sum(tiles[2:])

    flat = lambda n: chunks(n, pack.block, pack.iters)  # noqa: E731
    n_gq, n_gk = batch * HEADS * triton.cdiv(sd, pack.rows), batch * KV_HEADS * triton.cdiv(se, pack.rows)
    n_pack = (n_gq + 2 * n_gk
              + (1 + (split_dec > 1)) * flat(td * HIDDEN) + (1 + (split_enc > 1)) * flat(te * CROSS_HIDDEN)
              + (1 + (split_wq > 1)) * flat(Q_OUT * HIDDEN) + 2 * flat(KV_OUT * CROSS_HIDDEN)
              + (split_wkv > 1) * flat(2 * KV_OUT * CROSS_HIDDEN))
    ranges = ranges or RangeSlots()
    pack_ranges = ranges.reserve({  # the pack's converting programs, in order
        "grad_query_states": n_gq, "grad_key_states (head-group sums)": n_gk,
        "grad_value_states (head-group sums)": n_gk, "decoder_hidden_states": flat(td * HIDDEN),
        "encoder_hidden_states": flat(te * CROSS_HIDDEN), "q_weight": flat(Q_OUT * HIDDEN),
        "k_weight": flat(KV_OUT * CROSS_HIDDEN), "v_weight": flat(KV_OUT * CROSS_HIDDEN)})
    ranges.allocate(device)
    launches = [(weight_grads, input_grads, weight_grads * weight_tiles + input_grads * input_tiles)] \
        if one_launch else [(True, False, weight_tiles), (False, True, input_tiles)]
    launches = [(w, i, t) for w, i, t in launches if (w and weight_grads) or (i and input_grads)]
    if products == "cublas":  # operand views made before the first launch, so they add no gaps
        cublas_products = [(gq16, wq16, grad_dec.view(td, HIDDEN), needs[0]),
                           (gkv16, wkv16, grad_enc.view(te, CROSS_HIDDEN), needs[1]),
                           (gq16.T, dec16, grad_wq, needs[2]), (gkv16.T, enc16, grad_wkv, needs[3] or needs[4])]
    with buffers.on_device(device):
        # Every Triton launch prepared before the first runs: no host work between them.
        pack_launch = PACK.prepare(
            (n_pack,),
            gq, gk, gv, dec, enc, wq, wk, wv,
            gq16, gkv16, dec16, enc16, wq16, wkv16, ranges.block(pack_ranges),
            grad_dec, grad_enc, grad_wq, grad_wkv,
            int(split_dec > 1), int(split_enc > 1), int(split_wq > 1), int(split_wkv > 1),
            batch, sd, se, ROWS=pack.rows, BLOCK=pack.block, ITERS=pack.iters, PDL=on_gpu, num_warps=pack.warps)
        product_launches = [] if products == "cublas" else [
            PRODUCTS.prepare(
                (n_tiles,),
                gq16, gkv16, dec16, enc16, wq16, wkv16,
                grad_dec, grad_enc, grad_wq, grad_wkv,
                td, te, split_wq, split_wkv, split_dec, split_enc,
                *longest_first([(t * (with_weights if i < 2 else with_inputs), k, s) for i, (t, (_, _, k), s)
                                in enumerate(zip(tiles, weight_products + input_products, splits))]),
                WEIGHT_GRADS=with_weights, INPUT_GRADS=with_inputs,
                BM=bm, BN=bn, BK=bk, PDL=on_gpu, num_warps=config.warps, num_stages=config.stages, launch_pdl=on_gpu)
            for with_weights, with_inputs, n_tiles in launches]
        pack_launch()
        if products == "cublas":
            for a, b, out, needed in cublas_products:
                if needed:
                    torch.mm(a, b, out_dtype=torch.float32, out=out)
        for launch in product_launches:
            launch()
    return grad_dec, grad_enc, grad_wq, grad_wk, grad_wv
