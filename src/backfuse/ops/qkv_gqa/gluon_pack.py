"""072's Gluon kernel, its pack partition: the fp16 operands of the four products made from the
fp32 inputs inside the product launch (ops/qkv_gqa/gluon_kernels.py), and the completion counters
through which the products wait for them.

Math: GQ[t, h*256 + d] = grad_query_states[b, h, s, d] for token t = b*Sd + s (the layout change);
GK[t, j*256 + d] = sum_{g<4} grad_key_states[b, 4j + g, s, d] (GV likewise: the head-group sums);
dec16, enc16, Wq16, [Wk; Wv]16 are fp16 copies; each item's largest |value| goes to its range slot
(the fp16 range guard). Items: 64 rows x 256 columns (a head-group sum: 16 tokens of the 4 query
heads of one KV head), read into shared memory by asynchronous copies, converted, stored, then
counted per 128-token block (release) in the order the products need them: zero fills of the
outputs that split-K products add into, the decoder side, Wq16, the encoder side, [Wk; Wv]16.
"""

# No `from __future__ import annotations`: the aggregates' field annotations must be types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.language.core import _aggregate as aggregate

from . import config

TOKEN_BLOCK = gl.constexpr(config.GLUON_TOKEN_BLOCK)  # tokens per pack counter (= BM)
UNIT = gl.constexpr(config.GLUON_SUM_ROWS)  # rows of one shared-memory slot of the pack (16 x 256 fp32)
UNITS = gl.constexpr(config.GLUON_PACK_SLOTS)  # slots: 64 KB in flight per item
ITEM_ROWS = gl.constexpr(config.GLUON_ITEM_ROWS)  # rows of a plain item (UNITS slots); a head-group sum: UNIT
PARTITIONS = gl.constexpr(4)  # per program: two consumers, the loader, the pack
# the fixed counter slots, by their index in config.GLUON_FIXED_COUNTERS
C_WQ16, C_WKV16, C_ZERO_WQ, C_ZERO_WKV, C_ZERO_DEC, C_ZERO_ENC, C_LEFT = (
    gl.constexpr(config.GLUON_FIXED_COUNTERS.index(name)) for name in (
        "Wq16", "[Wk; Wv]16", "zeroed grad_Wq", "zeroed grad_[Wk; Wv]", "zeroed grad_dec", "zeroed grad_enc",
        "partitions left"))


@aggregate
class Sizes:
    """The operator's sizes (constexprs, `config.size_constexprs`): decoder and encoder widths (HIDDEN,
    CROSS), query heads, query heads per KV head (GROUP), the head size, the q and the k / v
    projections' widths (Q_OUT, KV_OUT), and the pack's items of Wk16 (then Wv16's) in its [Wk; Wv]16
    segment (KV_ITEMS)."""

    HIDDEN: gl.constexpr
    CROSS: gl.constexpr
    HEADS: gl.constexpr
    GROUP: gl.constexpr
    HEAD_DIM: gl.constexpr
    Q_OUT: gl.constexpr
    KV_OUT: gl.constexpr
    KV_ITEMS: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, HIDDEN, CROSS, HEADS, GROUP, HEAD_DIM, Q_OUT, KV_OUT, KV_ITEMS):
        self.HIDDEN, self.CROSS, self.HEADS, self.GROUP = gl.constexpr(HIDDEN), gl.constexpr(CROSS), \
            gl.constexpr(HEADS), gl.constexpr(GROUP)
        self.HEAD_DIM, self.Q_OUT, self.KV_OUT, self.KV_ITEMS = gl.constexpr(HEAD_DIM), gl.constexpr(Q_OUT), \
            gl.constexpr(KV_OUT), gl.constexpr(KV_ITEMS)


@aggregate
class Counters:
    """The completion counters (config.GluonCounters, host side): `slots`, the first slot of the
    per-token-block runs of GQ, dec16, [GK | GV], enc16, and how many slots there are."""

    slots: gl.tensor
    gq: gl.tensor
    dec: gl.tensor
    gkv: gl.tensor
    enc: gl.tensor
    total: gl.tensor

    @gluon.constexpr_function
    def __init__(self, slots, gq, dec, gkv, enc, total):
        self.slots, self.gq, self.dec, self.gkv, self.enc, self.total = slots, gq, dec, gkv, enc, total


@aggregate
class Inputs:
    """The official fp32 inputs: grad_query/key/value_states, decoder and encoder hidden states,
    Wq, Wk, Wv."""

    gq: gl.tensor
    gk: gl.tensor
    gv: gl.tensor
    dec: gl.tensor
    enc: gl.tensor
    wq: gl.tensor
    wk: gl.tensor
    wv: gl.tensor

    @gluon.constexpr_function
    def __init__(self, gq, gk, gv, dec, enc, wq, wk, wv):
        self.gq, self.gk, self.gv, self.dec, self.enc, self.wq, self.wk, self.wv = gq, gk, gv, dec, enc, wq, wk, wv


@aggregate
class Operands:
    """The fp16 operand buffers that the pack fills: GQ, [GK | GV], dec16, enc16, Wq16, [Wk; Wv]16."""

    gq16: gl.tensor
    gkv16: gl.tensor
    dec16: gl.tensor
    enc16: gl.tensor
    wq16: gl.tensor
    wkv16: gl.tensor

    @gluon.constexpr_function
    def __init__(self, gq16, gkv16, dec16, enc16, wq16, wkv16):
        self.gq16, self.gkv16, self.dec16, self.enc16, self.wq16, self.wkv16 = gq16, gkv16, dec16, enc16, wq16, wkv16


@aggregate
class Outputs:
    """The five fp32 outputs (the pack zero-fills those that split-K products add into)."""

    grad_dec: gl.tensor
    grad_enc: gl.tensor
    grad_wq: gl.tensor
    grad_wk: gl.tensor
    grad_wv: gl.tensor

    @gluon.constexpr_function
    def __init__(self, grad_dec, grad_enc, grad_wq, grad_wk, grad_wv):
        self.grad_dec, self.grad_enc, self.grad_wq, self.grad_wk, self.grad_wv = (grad_dec, grad_enc, grad_wq,
                                                                                  grad_wk, grad_wv)


@aggregate
class PackList:
    """The pack's item list (the plan's `config.gluon_pack_items`): decoder and encoder tokens (TD,
    TE) and sequence lengths (SD, SE), 256-column chunks per row of dec / enc (0 when no weight
    gradient is wanted), and the end of each segment, in the list's order: zero fills of grad_Wq,
    grad_[Wk; Wv], grad_dec, grad_enc, the decoder side, Wq16, the encoder side, [Wk; Wv]16 (`items`)."""

    TD: gl.tensor
    TE: gl.tensor
    SD: gl.tensor
    SE: gl.tensor
    dec_chunks: gl.tensor
    enc_chunks: gl.tensor
    e_zwq: gl.tensor
    e_zwkv: gl.tensor
    e_zdec: gl.tensor
    e_zenc: gl.tensor
    e_dec: gl.tensor
    e_wq: gl.tensor
    e_enc: gl.tensor
    items: gl.tensor

    @gluon.constexpr_function
    def __init__(self, TD, TE, SD, SE, dec_chunks, enc_chunks, e_zwq, e_zwkv, e_zdec, e_zenc, e_dec, e_wq, e_enc,
                 items):
        self.TD, self.TE, self.SD, self.SE = TD, TE, SD, SE
        self.dec_chunks, self.enc_chunks = dec_chunks, enc_chunks
        self.e_zwq, self.e_zwkv, self.e_zdec, self.e_zenc = e_zwq, e_zwkv, e_zdec, e_zenc
        self.e_dec, self.e_wq, self.e_enc, self.items = e_dec, e_wq, e_enc, items


@aggregate
class RangeBases:
    """The fp16 range guard's slots (`ranges`) and the first slot of each region (the plan's
    Regions.bases): GQ, GK, GV, dec, enc, Wq, Wk, Wv."""

    ranges: gl.tensor
    gq: gl.tensor
    gk: gl.tensor
    gv: gl.tensor
    dec: gl.tensor
    enc: gl.tensor
    wq: gl.tensor
    wk: gl.tensor
    wv: gl.tensor

    @gluon.constexpr_function
    def __init__(self, ranges, gq, gk, gv, dec, enc, wq, wk, wv):
        self.ranges = ranges
        self.gq, self.gk, self.gv, self.dec, self.enc, self.wq, self.wk, self.wv = gq, gk, gv, dec, enc, wq, wk, wv




@gluon.constexpr_function
def pack_layout(warps):
    """[rows, 256] fp32 tiles over the pack partition's `warps` warps: 4 columns (16 B) per thread."""
    return gl.BlockedLayout([1, 4], [1, 32], [warps, 1], [1, 0])


@gluon.jit
def _chunks(block, T, ROWS: gl.constexpr):
    """ROWS-row pack items in token block `block` of T tokens (all full but the last block's)."""
    return gl.cdiv(gl.minimum(TOKEN_BLOCK, T - block * TOKEN_BLOCK), ROWS)


@gluon.jit
def _gq_items(block, TD, HEADS: gl.constexpr):
    return HEADS * _chunks(block, TD, ITEM_ROWS)


@gluon.jit
def _gkv_items(block, TE, GROUP: gl.constexpr):
    return 2 * GROUP * _chunks(block, TE, UNIT)


@gluon.jit
def _leave(counters):
    """Count this partition out of the launch; the launch's last partition to leave
    zeroes every counter slot, so the next call on this stream finds them zero (no memset launch)."""
    gl.thread_barrier()  # the partition's warps are past their last use of the counters
    left = gl.atomic_add(counters.slots + C_LEFT, 1, sem="acq_rel", scope="gpu")
    if left == PARTITIONS * gl.num_programs(0) - 1:
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        BLOCK: gl.constexpr = 128 * gl.num_warps()
        for start in range(0, counters.total, BLOCK):
            slots = start + gl.arange(0, BLOCK, layout=layout)
            gl.store(counters.slots + slots, gl.zeros([BLOCK], gl.int32, layout), mask=slots < counters.total)


@gluon.jit
def _release(counter):
    """Count one finished pack item: every thread's stores before the counter's increment."""
    gl.thread_barrier()
    gl.atomic_add(counter, 1, sem="release", scope="gpu")


@gluon.jit
def _token_rows(t0, S, head, HEADS: gl.constexpr):
    """Rows of grad_*_states [B, 16, S, 256] (viewed [B*16*S, 256]) of tokens t0 + r, r < 16, of one head."""
    r = gl.arange(0, UNIT, layout=gl.SliceLayout(1, pack_layout(gl.num_warps())))
    t = t0 + r
    b = t // S
    return (b * HEADS + head).to(gl.int64) * S + (t - b * S)


@gluon.jit
def _plain_rows(row0):
    return (row0 + gl.arange(0, UNIT, layout=gl.SliceLayout(1, pack_layout(gl.num_warps())))).to(gl.int64)


@gluon.jit
def _fetch(buf, src, rows, stride, n_rows, HEAD_DIM: gl.constexpr):
    """Asynchronous copy of src[rows[r], :256] (r < n_rows; zeros past) into a [16, 256] slot."""
    r = gl.arange(0, UNIT, layout=gl.SliceLayout(1, pack_layout(gl.num_warps())))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, pack_layout(gl.num_warps())))
    ok = (r < n_rows)[:, None] & (c < HEAD_DIM)[None, :]
    async_copy.async_copy_global_to_shared(buf, src + rows[:, None] * stride + c[None, :], mask=ok)


@gluon.jit
def _put(dst, rows, stride, n_rows, x, HEAD_DIM: gl.constexpr):
    """dst[rows[r], :256] = fp16(x[r]) for r < n_rows."""
    r = gl.arange(0, UNIT, layout=gl.SliceLayout(1, pack_layout(gl.num_warps())))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, pack_layout(gl.num_warps())))
    ok = (r < n_rows)[:, None] & (c < HEAD_DIM)[None, :]
    gl.store(dst + rows[:, None] * stride + c[None, :], x.to(gl.float16), mask=ok)


@gluon.jit
def _fetch_item(bufs, mode, src, row0, n_rows, src_stride, S, head, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Start the asynchronous copies of one pack item into its 4 slots: mode 1, 64 rows of src from
    row0; mode 2, 64 tokens from row0 of one head of grad_*_states [B, 16, S, 256]; mode 3, 16
    tokens of 4 consecutive heads from `head`; mode 0 (zero fill) reads nothing."""
    for u in gl.static_range(UNITS):
        if mode == 1:
            _fetch(bufs.slice(u * UNIT, UNIT), src, _plain_rows(row0 + u * UNIT), src_stride, n_rows - u * UNIT,
                   HEAD_DIM)
        elif mode == 2:
            _fetch(bufs.slice(u * UNIT, UNIT), src, _token_rows(row0 + u * UNIT, S, head, HEADS), HEAD_DIM,
                   n_rows - u * UNIT, HEAD_DIM)
        elif mode == 3:
            _fetch(bufs.slice(u * UNIT, UNIT), src, _token_rows(row0, S, head + u, HEADS), HEAD_DIM, n_rows, HEAD_DIM)
    async_copy.commit_group()


@gluon.jit
def _finish_item(bufs, mode, dst, zero_dst, row0, n_rows, dst_stride, slot, HEAD_DIM: gl.constexpr):
    """Store a landed item as fp16 rows of dst from row0 (mode 3: the sum of its 4 slots; mode 0:
    zeros in fp32) and record its largest |value| in `slot`."""
    if mode == 3:
        acc = bufs.slice(0, UNIT).load(pack_layout(gl.num_warps()))
        for u in gl.static_range(1, UNITS):
            acc += bufs.slice(u * UNIT, UNIT).load(pack_layout(gl.num_warps()))
        _put(dst, _plain_rows(row0), dst_stride, n_rows, acc, HEAD_DIM)
        gl.store(slot, gl.max(gl.max(gl.abs(acc), axis=1), axis=0))
    elif mode == 0:
        for u in gl.static_range(UNITS):
            _put(zero_dst, _plain_rows(row0 + u * UNIT), dst_stride, n_rows - u * UNIT,
                 gl.zeros([UNIT, HEAD_DIM], gl.float32, pack_layout(gl.num_warps())), HEAD_DIM)
    else:  # one reduction per item: elementwise maxima over its units first (rows past n_rows are zeros)
        largest = gl.zeros([UNIT, HEAD_DIM], gl.float32, pack_layout(gl.num_warps()))
        for u in gl.static_range(UNITS):
            x = bufs.slice(u * UNIT, UNIT).load(pack_layout(gl.num_warps()))
            _put(dst, _plain_rows(row0 + u * UNIT), dst_stride, n_rows - u * UNIT, x, HEAD_DIM)
            largest = gl.maximum(largest, gl.abs(x))
        gl.store(slot, gl.max(gl.max(largest, axis=1), axis=0))


@gluon.jit
def _item(item, inp, ops, outs, counters, lst, rb, sz):
    """Pack item `item` of the call's list `lst` (its segments' ends are the plan's): zero fills
    (split-K outputs), the decoder side per token block (GQ heads, dec16), Wq16, the encoder side per
    token block ([GK | GV] head sums, enc16), [Wk; Wv]16. Returns (mode, src, dst (fp16), zero_dst
    (fp32, zero fills), row0, n_rows, src_stride, dst_stride, S, head, range slot, counter); items
    past the list have n_rows 0."""
    # the operator's sizes (`Sizes`) under their kernel names
    HIDDEN: gl.constexpr = sz.HIDDEN
    CROSS: gl.constexpr = sz.CROSS
    HEADS: gl.constexpr = sz.HEADS
    GROUP: gl.constexpr = sz.GROUP
    HEAD_DIM: gl.constexpr = sz.HEAD_DIM
    Q_OUT: gl.constexpr = sz.Q_OUT
    KV_OUT: gl.constexpr = sz.KV_OUT
    KV_ITEMS: gl.constexpr = sz.KV_ITEMS
    ROWS: gl.constexpr = ITEM_ROWS
    PER_BLOCK: gl.constexpr = TOKEN_BLOCK // ROWS
    SUM_PER_BLOCK: gl.constexpr = TOKEN_BLOCK // UNIT
    per_d = PER_BLOCK * (HEADS + lst.dec_chunks)
    per_e = SUM_PER_BLOCK * 2 * GROUP + PER_BLOCK * lst.enc_chunks
    # defaults: a zero fill of grad_Wq's row block (64 rows x 256 columns)
    mode = 0
    src = inp.gq
    dst = ops.gq16
    zero_dst = outs.grad_wq + item // (Q_OUT // ROWS) * HEAD_DIM
    row0 = item % (Q_OUT // ROWS) * ROWS
    n_rows = Q_OUT - row0
    src_stride = HEAD_DIM
    dst_stride = HIDDEN
    S = lst.SD
    head = 0
    slot = rb.ranges
    counter = counters.slots + C_ZERO_WQ
    if item >= lst.items:
        n_rows = 0
    elif item < lst.e_zwq:
        pass
    elif item < lst.e_zwkv:
        local = item - lst.e_zwq
        zero_dst = gl.where(local < KV_ITEMS, outs.grad_wk, outs.grad_wv) \
            + local % KV_ITEMS // (KV_OUT // ROWS) * HEAD_DIM
        row0 = local % (KV_OUT // ROWS) * ROWS
        n_rows = KV_OUT - row0
        dst_stride = CROSS
        counter = counters.slots + C_ZERO_WKV
    elif item < lst.e_zdec:  # zero grad_dec [TD, 1536]
        local = item - lst.e_zwkv
        zero_dst = outs.grad_dec + local // gl.cdiv(lst.TD, ROWS) * HEAD_DIM
        row0 = local % gl.cdiv(lst.TD, ROWS) * ROWS
        n_rows = lst.TD - row0
        counter = counters.slots + C_ZERO_DEC
    elif item < lst.e_zenc:  # zero grad_enc [TE, 1024]
        local = item - lst.e_zdec
        zero_dst = outs.grad_enc + local // gl.cdiv(lst.TE, ROWS) * HEAD_DIM
        row0 = local % gl.cdiv(lst.TE, ROWS) * ROWS
        n_rows = lst.TE - row0
        dst_stride = CROSS
        counter = counters.slots + C_ZERO_ENC
    elif item < lst.e_dec:  # decoder side, block by block
        local = item - lst.e_zenc
        block = local // per_d
        sub = local - block * per_d
        chunks = _chunks(block, lst.TD, ROWS)
        row0 = block * TOKEN_BLOCK + sub % chunks * ROWS
        n_rows = lst.TD - row0
        if sub < _gq_items(block, lst.TD, HEADS):  # GQ: 64 tokens of one head
            mode = 2
            head = sub // chunks
            dst = ops.gq16 + head * HEAD_DIM
            dst_stride = Q_OUT
            slot = rb.ranges + rb.gq + block * PER_BLOCK * HEADS + sub
            counter = counters.slots + counters.gq + block
        else:  # dec16: 64 tokens x 256 columns
            mode = 1
            col = (sub - HEADS * chunks) // chunks * HEAD_DIM
            src = inp.dec + col
            dst = ops.dec16 + col
            src_stride = HIDDEN
            slot = rb.ranges + rb.dec + block * PER_BLOCK * lst.dec_chunks + sub - HEADS * chunks
            counter = counters.slots + counters.dec + block
    elif item < lst.e_wq:  # Wq16
        local = item - lst.e_dec
        mode = 1
        col = local // (Q_OUT // ROWS) * HEAD_DIM
        src = inp.wq + col
        dst = ops.wq16 + col
        row0 = local % (Q_OUT // ROWS) * ROWS
        n_rows = ROWS
        src_stride = HIDDEN
        slot = rb.ranges + rb.wq + local
        counter = counters.slots + C_WQ16
    elif item < lst.e_enc:  # encoder side, block by block
        local = item - lst.e_wq
        block = local // per_e
        sub = local - block * per_e
        sum_chunks = _chunks(block, lst.TE, UNIT)
        S = lst.SE
        if sub < _gkv_items(block, lst.TE, GROUP):  # one KV head of GK or GV for 16 tokens: the sum of its 4 query heads
            mode = 3
            part = sub // sum_chunks  # 0..3: GK heads, 4..7: GV heads
            row0 = block * TOKEN_BLOCK + sub % sum_chunks * UNIT
            n_rows = lst.TE - row0
            src = gl.where(part < GROUP, inp.gk, inp.gv)
            head = part % GROUP * GROUP
            dst = ops.gkv16 + part // GROUP * KV_OUT + part % GROUP * HEAD_DIM
            dst_stride = 2 * KV_OUT
            slot = rb.ranges + gl.where(part < GROUP, rb.gk, rb.gv) + block * SUM_PER_BLOCK * GROUP \
                + part % GROUP * sum_chunks + sub % sum_chunks
            counter = counters.slots + counters.gkv + block
        else:  # enc16: 64 tokens x 256 columns
            mode = 1
            sub = sub - 2 * GROUP * sum_chunks
            chunks = _chunks(block, lst.TE, ROWS)
            row0 = block * TOKEN_BLOCK + sub % chunks * ROWS
            n_rows = lst.TE - row0
            col = sub // chunks * HEAD_DIM
            src = inp.enc + col
            dst = ops.enc16 + col
            src_stride = CROSS
            dst_stride = CROSS
            slot = rb.ranges + rb.enc + block * PER_BLOCK * lst.enc_chunks + sub
            counter = counters.slots + counters.enc + block
    else:  # [Wk; Wv]16
        local = item - lst.e_enc
        on_v = local >= KV_ITEMS
        local = local % KV_ITEMS
        mode = 1
        col = local // (KV_OUT // ROWS) * HEAD_DIM
        src = gl.where(on_v, inp.wv, inp.wk) + col
        dst = ops.wkv16 + on_v.to(gl.int32) * KV_OUT * CROSS + col
        row0 = local % (KV_OUT // ROWS) * ROWS
        n_rows = ROWS
        src_stride = CROSS
        dst_stride = CROSS
        slot = rb.ranges + gl.where(on_v, rb.wv, rb.wk) + local
        counter = counters.slots + C_WKV16
    return mode, src, dst, zero_dst, row0, n_rows, src_stride, dst_stride, S, head, slot, counter


@gluon.jit
def _pack(bufs, inp, ops, outs, counters, lst, rb, sz, first, stride):
    """The pack partition: items first, first + stride, ... of the pack list `lst` (`_item`; in the
    one-launch kernel a program's share, every num_programs-th), one at a time (64 KB of copies in
    flight), with the next item's decode done while an item's
    copies fly and its copies issued before the current item is counted (the release's fence then
    waits for the stores under them): the pack alone 8% faster than decode, copy, use, count in
    turn (benchmarks/notes/gluon.md). Measured slower: two items in flight with the products' ring
    one slot shorter (+8% on the large cases); the 16-row units streamed through the slots (the
    pack alone 1.9x slower, with spills)."""
    item = first
    mode, src, dst, zero_dst, row0, n_rows, src_stride, dst_stride, S, head, slot, counter = _item(
        item, inp, ops, outs, counters, lst, rb, sz)
    _fetch_item(bufs, mode, src, row0, n_rows, src_stride, S, head, sz.HEADS, sz.HEAD_DIM)
    while n_rows > 0:
        item += stride
        # the next item's decode (integer divisions) while this item's copies fly
        n_mode, n_src, n_dst, n_zero_dst, n_row0, n_n_rows, n_src_stride, n_dst_stride, n_S, n_head, n_slot, \
            n_counter = _item(item, inp, ops, outs, counters, lst, rb, sz)
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's copies have landed
        _finish_item(bufs, mode, dst, zero_dst, row0, n_rows, dst_stride, slot, sz.HEAD_DIM)
        gl.thread_barrier()  # every thread has read the slots
        _fetch_item(bufs, n_mode, n_src, n_row0, n_n_rows, n_src_stride, n_S, n_head, sz.HEADS, sz.HEAD_DIM)
        _release(counter)  # its fence waits for this item's stores while the next item's copies fly
        mode, src, dst, zero_dst, row0, n_rows, src_stride, dst_stride, S, head, slot, counter = \
            n_mode, n_src, n_dst, n_zero_dst, n_row0, n_n_rows, n_src_stride, n_dst_stride, n_S, n_head, n_slot, \
            n_counter
    async_copy.wait_group(0)
    _leave(counters)
