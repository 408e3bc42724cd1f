"""The one-launch 021 study's kernel: one persistent Triton launch whose programs each do their items
of the call's task queue (`plan.plan`, `backfuse/kernels/queue.py`) in order, each by its kind:

- CAST, TRANSPOSE, GRAD_OUTPUT: fp16 copies of the operands (Wo transposed, so that the three forward
  products share one operand layout), grad_output with fp32 column sums per row tile (for grad_bo);
- ZERO: zeros in what split-K tiles and the attention's runs add into;
- FORWARD: one tile of Q = video Wq^T + bq, [K | V] = text [Wk; Wv]^T + [bk | bv] or dC = grad_output Wo
  (fp16 out; both operands through two TMA descriptors over the stacked buffers
  act16 = [video; text; grad_output] and w16 = [Wq; Wk; Wv; Wo^T]);
- OUTPUT_BIAS: grad_bo = column sums of grad_output (from the per-tile sums);
- ATTENTION (`triton_attention.py`): C, dQ, dK, dV and the q/k/v bias gradients' partial rows of one
  (batch, head, run of video blocks);
- GRADIENT: one tile of grad_video = dQ Wq, grad_text = [dK | dV] [Wk; Wv], grad_Wq = dQ^T video,
  grad_Wo = grad_output^T C, grad_Wk = dK^T text, grad_Wv = dV^T text (atomically added when K is split);
- BIAS: grad_bq, grad_bk, grad_bv = fixed-order sums of the attention's partial rows.

Every item that rounds a tensor to fp16 stores the largest |value| it rounded in the range slot the
plan gave it (`fp16_guard.py`).
"""

# No `from __future__ import annotations`: Triton's aggregates check their fields' types against the
# annotations, which must then be types, not strings.
import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate

from backfuse.kernels.triton.elementwise import cast_chunk, column_sums, max_abs, transpose_tile, zero_chunk
from backfuse.kernels.triton.gemm import mma_tile, store_tile, tma_tile
from backfuse.kernels.triton.queue import ARG0, FIELDS, KIND, RANGE0, clock, field, leave, my_items, profile_item, signal, wait_for
from backfuse.ops.wan_xattn.spec import HIDDEN
from backfuse.ops.wan_xattn.triton_attention import attention_item
from backfuse.ops.wan_xattn.triton_kernels import _grad_output_tile

from .plan import Gradient, Product, Tensor, Work, Zeroed

_HIDDEN = tl.constexpr(HIDDEN)
_W = tl.constexpr(HIDDEN * HIDDEN)




def _c(member) -> tl.constexpr:
    return tl.constexpr(int(member))


# The plan's vocabulary (config.py's enums), as the constexprs the kernel compares item fields with.
CAST, TRANSPOSE, GRAD_OUTPUT, ZERO = _c(Work.CAST), _c(Work.TRANSPOSE), _c(Work.GRAD_OUTPUT), _c(Work.ZERO)
FORWARD, OUTPUT_BIAS, ATTENTION = _c(Work.FORWARD), _c(Work.OUTPUT_BIAS), _c(Work.ATTENTION)
GRADIENT, BIAS = _c(Work.GRADIENT), _c(Work.BIAS)
T_VIDEO, T_TEXT, T_WQ, T_WK = _c(Tensor.VIDEO), _c(Tensor.TEXT), _c(Tensor.QUERY_WEIGHT), _c(Tensor.KEY_WEIGHT)
Z_PARTIALS, Z_WQ, Z_WO = _c(Zeroed.KV_PARTIALS), _c(Zeroed.GRAD_QUERY_WEIGHT), _c(Zeroed.GRAD_OUTPUT_WEIGHT)
Z_WK, Z_WV, Z_VIDEO = _c(Zeroed.GRAD_KEY_WEIGHT), _c(Zeroed.GRAD_VALUE_WEIGHT), _c(Zeroed.GRAD_VIDEO)
P_QUERIES, P_KEYS_VALUES = _c(Product.QUERIES), _c(Product.KEYS_VALUES)
G_VIDEO, G_TEXT, G_WQ, G_WO, G_WK = (_c(Gradient.VIDEO), _c(Gradient.TEXT), _c(Gradient.QUERY_WEIGHT),
                                     _c(Gradient.OUTPUT_WEIGHT), _c(Gradient.KEY_WEIGHT))


@aggregate
class Inputs:
    """The official fp32 inputs (the output bias is unused)."""

    go: tl.tensor
    video: tl.tensor
    text: tl.tensor
    wq: tl.tensor
    bq: tl.tensor
    wk: tl.tensor
    bk: tl.tensor
    wv: tl.tensor
    bv: tl.tensor
    wo: tl.tensor

    @triton.constexpr_function
    def __init__(self, go, video, text, wq, bq, wk, bk, wv, bv, wo):
        self.go, self.video, self.text, self.wq, self.bq = go, video, text, wq, bq
        self.wk, self.bk, self.wv, self.bv, self.wo = wk, bk, wv, bv, wo


@aggregate
class Buffers:
    """The call's scratch: fp16 operands act16 = [video; text; grad_output] and w16 = [Wq; Wk; Wv; Wo^T],
    fp16 intermediates, and fp32 partial sums."""

    act16: tl.tensor
    w16: tl.tensor
    q16: tl.tensor  # [Tv, 1024]
    kv16: tl.tensor  # [Tt, 2048]: [K | V]
    dc16: tl.tensor  # [Tv, 1024]
    ctx16: tl.tensor  # [Tv, 1024]: C
    dq16: tl.tensor  # [Tv, 1024]
    dkv16: tl.tensor  # [Tt, 2048]: [dK | dV]
    dkv32: tl.tensor  # the attention runs' fp32 dK/dV partial sums
    colsum_parts: tl.tensor  # [grad_output tiles, 1024]
    bias_parts: tl.tensor  # [batch * runs, 3072]

    @triton.constexpr_function
    def __init__(self, act16, w16, q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, colsum_parts, bias_parts):
        self.act16, self.w16, self.q16, self.kv16, self.dc16, self.ctx16 = act16, w16, q16, kv16, dc16, ctx16
        self.dq16, self.dkv16, self.dkv32, self.colsum_parts, self.bias_parts = dq16, dkv16, dkv32, colsum_parts, \
            bias_parts


@aggregate
class Outputs:
    grad_video: tl.tensor
    grad_text: tl.tensor
    grad_wq: tl.tensor
    grad_wo: tl.tensor
    grad_wk: tl.tensor
    grad_wv: tl.tensor
    grad_bq: tl.tensor
    grad_bk: tl.tensor
    grad_bv: tl.tensor
    grad_bo: tl.tensor

    @triton.constexpr_function
    def __init__(self, grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv, grad_bo):
        self.grad_video, self.grad_text, self.grad_wq, self.grad_wo = grad_video, grad_text, grad_wq, grad_wo
        self.grad_wk, self.grad_wv, self.grad_bq, self.grad_bk, self.grad_bv, self.grad_bo = \
            grad_wk, grad_wv, grad_bq, grad_bk, grad_bv, grad_bo


@triton.jit
def _cast(row, x: Inputs, bufs: Buffers, TV, TT, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """CAST (Tensor, chunk, elements): fp16 copy of one chunk of video, text, Wq, Wk or Wv."""
    t = field(row, ARG0)
    src = tl.where(t == T_VIDEO, x.video, tl.where(t == T_TEXT, x.text, tl.where(
        t == T_WQ, x.wq, tl.where(t == T_WK, x.wk, x.wv))))
    dst = tl.where(t == T_VIDEO, bufs.act16, tl.where(t == T_TEXT, bufs.act16 + TV * _HIDDEN, tl.where(
        t == T_WQ, bufs.w16, tl.where(t == T_WK, bufs.w16 + _W, bufs.w16 + 2 * _W))))
    return cast_chunk(src, dst, field(row, ARG0 + 2), field(row, ARG0 + 1), BLOCK, ITERS)


@triton.jit
def _zero(row, bufs: Buffers, out: Outputs, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """ZERO (Zeroed, chunk, elements)."""
    z = field(row, ARG0)
    dst = tl.where(z == Z_PARTIALS, bufs.dkv32, tl.where(z == Z_WQ, out.grad_wq, tl.where(
        z == Z_WO, out.grad_wo, tl.where(z == Z_WK, out.grad_wk, tl.where(
            z == Z_WV, out.grad_wv, tl.where(z == Z_VIDEO, out.grad_video,
                                                                     out.grad_text))))))
    zero_chunk(dst, field(row, ARG0 + 2), field(row, ARG0 + 1), BLOCK, ITERS)


@triton.jit
def _forward(row, x: Inputs, bufs: Buffers, a_desc, b_desc,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """FORWARD (Product, tile row, tile column, A row, B row, rows): one fp16 tile of Q (+ bq), [K | V]
    (+ [bk | bv]) or dC; returns its largest |value|."""
    product = field(row, ARG0)
    off_m = field(row, ARG0 + 1) * BM  # tile indices times the tile shape (see _gradient)
    off_n = field(row, ARG0 + 2) * BN
    rows = field(row, ARG0 + 5)
    acc = tma_tile(a_desc, b_desc, field(row, ARG0 + 3), field(row, ARG0 + 4), 0, _HIDDEN, BM, BN, BK, STAGES)
    on_q = product == P_QUERIES
    on_kv = product == P_KEYS_VALUES
    rn = off_n + tl.arange(0, BN)
    bias = tl.where(on_q, x.bq + rn, tl.where(rn < _HIDDEN, x.bk + rn, x.bv + rn - _HIDDEN))
    acc += tl.load(bias, mask=on_q | on_kv, other=0.0)[None, :]
    rm = off_m + tl.arange(0, BM)
    width = tl.where(on_kv, 2 * _HIDDEN, _HIDDEN)
    out = tl.where(on_q, bufs.q16, tl.where(on_kv, bufs.kv16, bufs.dc16))
    tl.store(out + rm[:, None].to(tl.int64) * width + rn[None, :], acc.to(tl.float16), mask=rm[:, None] < rows)
    return max_abs(tl.where(rm[:, None] < rows, acc, 0.0))


@triton.jit
def _gradient(row, bufs: Buffers, out: Outputs, TV, TT,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """GRADIENT (Gradient, tile row, tile column, k_lo / BK, k_hi, accumulate): one tile. Input gradients read A
    row-major, weight gradients A feature-contiguous: one call site per layout, one shared-memory
    ring each."""
    g = field(row, ARG0)
    # Tile indices and K steps times the constexpr tile shape: so the compiler knows the offsets'
    # divisibility, and the loads vectorize and pipeline (tl.multiple_of on the loaded values does not).
    off_m = field(row, ARG0 + 1) * BM
    off_n = field(row, ARG0 + 2) * BN
    k_lo = field(row, ARG0 + 3) * BK
    k_hi = field(row, ARG0 + 4)
    accumulate = field(row, ARG0 + 5) != 0
    dq16, dkv16, go16, video16 = bufs.dq16, bufs.dkv16, bufs.act16 + (TV + TT) * _HIDDEN, bufs.act16
    text16, wq16, wkv16 = bufs.act16 + TV * _HIDDEN, bufs.w16, bufs.w16 + _W
    if (g == G_VIDEO) | (g == G_TEXT):
        on_video = g == G_VIDEO
        depth = tl.multiple_of(tl.where(on_video, _HIDDEN, 2 * _HIDDEN), 1024)
        rows = tl.where(on_video, TV, TT)
        acc = mma_tile(tl.where(on_video, dq16, dkv16), tl.where(on_video, wq16, wkv16), off_m, off_n, rows, _HIDDEN,
                       k_lo, k_hi, depth, 1, _HIDDEN, 1, BM, BN, BK, STAGES)
        store_tile(tl.where(on_video, out.grad_video, out.grad_text), acc, off_m, off_n, rows, _HIDDEN, _HIDDEN, 1,
                   accumulate, BM, BN)
    else:
        over_video = (g == G_WQ) | (g == G_WO)
        a = tl.where(g == G_WQ, dq16, tl.where(g == G_WO, go16, tl.where(
            g == G_WK, dkv16, dkv16 + _HIDDEN)))
        b = tl.where(g == G_WQ, video16, tl.where(g == G_WO, bufs.ctx16,
                                                                       text16))
        c = tl.where(g == G_WQ, out.grad_wq, tl.where(g == G_WO, out.grad_wo,
                                                                           tl.where(g == G_WK,
                                                                                    out.grad_wk, out.grad_wv)))
        width = tl.multiple_of(tl.where(over_video, _HIDDEN, 2 * _HIDDEN), 1024)
        acc = mma_tile(a, b, off_m, off_n, _HIDDEN, _HIDDEN, k_lo, k_hi, 1, width, _HIDDEN, 1, BM, BN, BK, STAGES)
        store_tile(c, acc, off_m, off_n, _HIDDEN, _HIDDEN, _HIDDEN, 1, accumulate, BM, BN)


@triton.jit(do_not_specialize=["n_slots", "TV", "TT", "NV", "NT", "runs", "go_tiles", "bias_rows", "scale"])
def backward_kernel(
    table, counters, ranges, profile, n_slots,
    go, video, text, wq, bq, wk, bk, wv, bv, wo,
    act16, w16, q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, colsum_parts, bias_parts,
    grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv, grad_bo,
    TV, TT, NV, NT, runs, go_tiles, bias_rows, scale,
    ROWS: tl.constexpr, COLS: tl.constexpr, T: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
    FBM: tl.constexpr, FBN: tl.constexpr, FBK: tl.constexpr, FSTAGES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr, ONE_TILE: tl.constexpr, ALONE: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    GBM: tl.constexpr, GBN: tl.constexpr, GBK: tl.constexpr, GSTAGES: tl.constexpr,
    SUM_ROWS: tl.constexpr, SUM_COLS: tl.constexpr, GPU: tl.constexpr, PROFILE: tl.constexpr = False,
):
    """The 021 outputs: each program does its items of the queue `table` (`config.plan`) in order;
    `counters` (n_slots int32, zero at the start and left zero) count finished items; `ranges` gets
    the fp16-range maxima. Tile shapes: pack ROWS/COLS/T/BLOCK/ITERS, forward FBM x FBN x FBK,
    attention BM (+ BN, BN_TAIL text tokens), gradients GBM x GBN x GBK. PROFILE (GPU diagnostics):
    each item's timestamps go to `profile` ([rows, 4] int64, `profile_item`)."""
    x = Inputs(go, video, text, wq, bq, wk, bk, wv, bv, wo)
    bufs = Buffers(act16, w16, q16, kv16, dc16, ctx16, dq16, dkv16, dkv32, colsum_parts, bias_parts)
    out = Outputs(grad_video, grad_text, grad_wq, grad_wo, grad_wk, grad_wv, grad_bq, grad_bk, grad_bv, grad_bo)
    a_desc = tl.make_tensor_descriptor(act16, shape=[2 * TV + TT, _HIDDEN], strides=[_HIDDEN, 1],
                                       block_shape=[FBM, FBK])
    b_desc = tl.make_tensor_descriptor(w16, shape=[4 * _HIDDEN, _HIDDEN], strides=[_HIDDEN, 1], block_shape=[FBN, FBK])
    first, end, rows = my_items(table)
    for item in range(first, end):
        row = rows + item * FIELDS
        if PROFILE:
            started = clock()
        wait_for(row, counters, GPU)
        if PROFILE:
            waited = clock()
        kind = field(row, KIND)
        if kind == CAST:
            tl.store(ranges + field(row, RANGE0), _cast(row, x, bufs, TV, TT, BLOCK, ITERS))
        elif kind == TRANSPOSE:
            tl.store(ranges + field(row, RANGE0), transpose_tile(wo, w16 + 3 * _W, field(row, ARG0), _HIDDEN, T))
        elif kind == GRAD_OUTPUT:
            tl.store(ranges + field(row, RANGE0), _grad_output_tile(go, act16 + (TV + TT) * _HIDDEN, colsum_parts,
                                                                    field(row, ARG0), TV, ROWS, COLS))
        elif kind == ZERO:
            _zero(row, bufs, out, BLOCK, ITERS)
        elif kind == FORWARD:
            tl.store(ranges + field(row, RANGE0), _forward(row, x, bufs, a_desc, b_desc, FBM, FBN, FBK, FSTAGES))
        elif kind == OUTPUT_BIAS:
            cols = field(row, ARG0) * SUM_COLS + tl.arange(0, SUM_COLS)
            tl.store(grad_bo + cols, column_sums(colsum_parts, go_tiles, _HIDDEN, cols, SUM_ROWS, SUM_COLS))
        elif kind == ATTENTION:
            attention_item(q16, kv16, dc16, ctx16, dq16, dkv32, dkv16, bias_parts, counters + field(row, ARG0 + 5),
                           ranges, field(row, ARG0), field(row, ARG0 + 1), field(row, ARG0 + 2), field(row, ARG0 + 3),
                           field(row, ARG0 + 4), field(row, RANGE0), field(row, RANGE0 + 1), field(row, RANGE0 + 2),
                           NV, NT, TT, runs, scale, BM, BN, BN_TAIL, ONE_TILE, ALONE, DETERMINISTIC)
        elif kind == GRADIENT:
            _gradient(row, bufs, out, TV, TT, GBM, GBN, GBK, GSTAGES)
        elif kind == BIAS:
            strip = field(row, ARG0)
            cols = strip * SUM_COLS + tl.arange(0, SUM_COLS)
            which = (strip * SUM_COLS) // _HIDDEN  # 0: q, 1: k, 2: v
            dst = tl.where(which == 0, grad_bq, tl.where(which == 1, grad_bk, grad_bv)) + cols - which * _HIDDEN
            tl.store(dst, column_sums(bias_parts, bias_rows, 3 * _HIDDEN, cols, SUM_ROWS, SUM_COLS))
        if PROFILE:
            profile_item(profile, item, started, waited)
        signal(row, counters)
    leave(counters, n_slots)
