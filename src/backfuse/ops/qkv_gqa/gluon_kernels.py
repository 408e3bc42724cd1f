"""072 in one Gluon launch: the fp16 operand pack and the four products, overlapped on every SM.

Math (072): GQ[t, h*256 + d] = grad_query_states[b, h, s, d] for token t = b*Sd + s; GK[t, j*256 + d]
= sum_{g<4} grad_key_states[b, 4j + g, s, d] (GV likewise); then
grad_Wq = GQ^T dec, grad_dec = GQ Wq, [grad_Wk; grad_Wv] = [GK | GV]^T enc, grad_enc = [GK | GV] [Wk; Wv].

A program (one per SM) runs four partitions at once:
- pack (4 warps): converts its share of the fp32 inputs to fp16 operand buffers in items of 64 rows
  x 256 columns (a head-group sum: 16 tokens of 4 heads), read into shared memory by asynchronous
  copies (64 KB in flight); the GQ layout change and the head-group sums included. It records each
  item's largest |value| (the fp16 range guard), counts finished items per 128-token block and per
  weight in global counters (release), and zeroes the outputs that split-K products add into;
- loader (1 warp): before the TMA copies of a tile's operands, waits (acquire) until the pack
  tiles they read are counted;
- two consumer warpgroups: wgmma over the ring, fp32 stores (atomics for split-K tiles).
The pack runs in the order the products need it (the decoder side first), so the products start
after the first token block is packed and the pack's memory traffic runs under their compute.
Measured (benchmarks/notes/gluon.md): at parity with pack + products as separate launches on the
16-case mean; on the official clock faster only at the largest sizes below cuBLAS (config.GluonConfig).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ...kernels.gluon.gemm import LOADER_REGS, consume_tile, issue_step, store_tile, tile_coords, wait_count
from . import config, spec

HIDDEN = gl.constexpr(spec.HIDDEN)
CROSS = gl.constexpr(spec.CROSS_HIDDEN)
HEADS = gl.constexpr(spec.HEADS)
GROUP = gl.constexpr(spec.GROUP)
HEAD_DIM = gl.constexpr(spec.HEAD_DIM)
Q_OUT = gl.constexpr(spec.Q_OUT)
KV_OUT = gl.constexpr(spec.KV_OUT)
TOKEN_BLOCK = gl.constexpr(config.GLUON_TOKEN_BLOCK)  # tokens per pack counter (= BM)
UNIT = gl.constexpr(config.GLUON_SUM_ROWS)  # rows of one shared-memory slot of the pack (16 x 256 fp32)
UNITS = gl.constexpr(4)  # slots: 64 KB in flight per item
ITEM_ROWS = gl.constexpr(config.GLUON_ITEM_ROWS)  # rows of a plain item (UNITS slots); a head-group sum: UNIT
W_ITEMS = gl.constexpr((spec.Q_OUT // ITEM_ROWS) * (spec.HIDDEN // HEAD_DIM))  # of Wq16 (and of zeroing grad_Wq)
KV_ITEMS = gl.constexpr((spec.KV_OUT // ITEM_ROWS) * (spec.CROSS_HIDDEN // HEAD_DIM))  # per weight (Wk16, Wv16)
PACK_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))
# 16 warps (4 + 4 consumer, 1 loader, 4 pack) share the 64K registers: the launch gives 128 per
# thread (maxnreg), which caps every partition's code, so tiles are 128 x 128 (a 64 x 256 fp32
# accumulator per warpgroup would need more than 154).
MAXNREG = 128
PACK_REGS = gl.constexpr(128)
CONSUMER_REGS = gl.constexpr(128)



@gluon.jit
def _chunks(block, T, ROWS: gl.constexpr):
    """ROWS-row pack items in token block `block` of T tokens (all full but the last block's)."""
    return gl.cdiv(gl.minimum(TOKEN_BLOCK, T - block * TOKEN_BLOCK), ROWS)


@gluon.jit
def _gq_items(block, TD):
    return HEADS * _chunks(block, TD, ITEM_ROWS)


@gluon.jit
def _gkv_items(block, TE):
    return 2 * GROUP * _chunks(block, TE, UNIT)


@gluon.jit
def _counters(counters, TD, TE):
    """The counter slots: GQ and dec16 per decoder token block, [GK | GV] and enc16 per encoder token
    block, then (c_w + i) Wq16, [Wk; Wv]16 and the zeroed grad_Wq, grad_[Wk; Wv], grad_dec, grad_enc."""
    nb_d = gl.cdiv(TD, TOKEN_BLOCK)
    nb_e = gl.cdiv(TE, TOKEN_BLOCK)
    return counters, counters + nb_d, counters + 2 * nb_d, counters + 2 * nb_d + nb_e, counters + 2 * nb_d + 2 * nb_e


@gluon.jit
def _release(counter):
    """Count one finished pack item: every thread's stores before the counter's increment."""
    gl.thread_barrier()
    gl.atomic_add(counter, 1, sem="release", scope="gpu")


@gluon.jit
def _token_rows(t0, S, head):
    """Rows of grad_*_states [B, 16, S, 256] (viewed [B*16*S, 256]) of tokens t0 + r, r < 16, of one head."""
    r = gl.arange(0, UNIT, layout=gl.SliceLayout(1, PACK_LAYOUT))
    t = t0 + r
    b = t // S
    return (b * HEADS + head).to(gl.int64) * S + (t - b * S)


@gluon.jit
def _plain_rows(row0):
    return (row0 + gl.arange(0, UNIT, layout=gl.SliceLayout(1, PACK_LAYOUT))).to(gl.int64)


@gluon.jit
def _fetch(buf, src, rows, stride, n_rows):
    """Asynchronous copy of src[rows[r], :256] (r < n_rows; zeros past) into a [16, 256] slot."""
    r = gl.arange(0, UNIT, layout=gl.SliceLayout(1, PACK_LAYOUT))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, PACK_LAYOUT))
    ok = (r < n_rows)[:, None] & (c < HEAD_DIM)[None, :]
    async_copy.async_copy_global_to_shared(buf, src + rows[:, None] * stride + c[None, :], mask=ok)


@gluon.jit
def _put(dst, rows, stride, n_rows, x):
    """dst[rows[r], :256] = fp16(x[r]) for r < n_rows."""
    r = gl.arange(0, UNIT, layout=gl.SliceLayout(1, PACK_LAYOUT))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, PACK_LAYOUT))
    ok = (r < n_rows)[:, None] & (c < HEAD_DIM)[None, :]
    gl.store(dst + rows[:, None] * stride + c[None, :], x.to(gl.float16), mask=ok)


@gluon.jit
def _fetch_item(bufs, mode, src, row0, n_rows, src_stride, S, head):
    """Start the asynchronous copies of one pack item into its 4 slots: mode 1, 64 rows of src from
    row0; mode 2, 64 tokens from row0 of one head of grad_*_states [B, 16, S, 256]; mode 3, 16
    tokens of 4 consecutive heads from `head`; mode 0 (zero fill) reads nothing."""
    for u in gl.static_range(UNITS):
        if mode == 1:
            _fetch(bufs.slice(u * UNIT, UNIT), src, _plain_rows(row0 + u * UNIT), src_stride, n_rows - u * UNIT)
        elif mode == 2:
            _fetch(bufs.slice(u * UNIT, UNIT), src, _token_rows(row0 + u * UNIT, S, head), HEAD_DIM, n_rows - u * UNIT)
        elif mode == 3:
            _fetch(bufs.slice(u * UNIT, UNIT), src, _token_rows(row0, S, head + u), HEAD_DIM, n_rows)
    async_copy.commit_group()


@gluon.jit
def _finish_item(bufs, mode, dst, zero_dst, row0, n_rows, dst_stride, slot, counter):
    """Store a landed item as fp16 rows of dst from row0 (mode 3: the sum of its 4 slots; mode 0:
    zeros in fp32), record its largest |value| in `slot` and count it."""
    if mode == 3:
        acc = bufs.slice(0, UNIT).load(PACK_LAYOUT)
        for u in gl.static_range(1, UNITS):
            acc += bufs.slice(u * UNIT, UNIT).load(PACK_LAYOUT)
        _put(dst, _plain_rows(row0), dst_stride, n_rows, acc)
        gl.store(slot, gl.max(gl.max(gl.abs(acc), axis=1), axis=0))
    elif mode == 0:
        for u in gl.static_range(UNITS):
            _put(zero_dst, _plain_rows(row0 + u * UNIT), dst_stride, n_rows - u * UNIT,
                 gl.zeros([UNIT, HEAD_DIM], gl.float32, PACK_LAYOUT))
    else:
        largest = 0.0
        for u in gl.static_range(UNITS):
            x = bufs.slice(u * UNIT, UNIT).load(PACK_LAYOUT)
            _put(dst, _plain_rows(row0 + u * UNIT), dst_stride, n_rows - u * UNIT, x)
            largest = gl.maximum(largest, gl.max(gl.max(gl.abs(x), axis=1), axis=0))
        gl.store(slot, largest)
    _release(counter)


@gluon.jit
def _item(item, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16, grad_wq, grad_wk,
          grad_wv, grad_dec, grad_enc, counters, ranges, TD, TE, SD, SE, dec_chunks, enc_chunks, zero_wq, zero_wkv,
          zero_dec, zero_enc, pack_w, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv):
    """Pack item `item` of the call's list, in order: zero fills (split-K outputs), the decoder side
    per token block (GQ heads, dec16), Wq16, the encoder side per token block ([GK | GV] head sums,
    enc16), [Wk; Wv]16. Returns (mode, src, dst (fp16), zero_dst (fp32, zero fills), row0, n_rows,
    src_stride, dst_stride, S, head, range slot, counter); items past the list have n_rows 0."""
    nb_d = gl.cdiv(TD, TOKEN_BLOCK)
    nb_e = gl.cdiv(TE, TOKEN_BLOCK)
    c_gq, c_dec, c_gkv, c_enc, c_w = _counters(counters, TD, TE)
    ROWS: gl.constexpr = ITEM_ROWS
    PER_BLOCK: gl.constexpr = TOKEN_BLOCK // ROWS
    SUM_PER_BLOCK: gl.constexpr = TOKEN_BLOCK // UNIT
    n_zq = zero_wq * W_ITEMS
    n_zkv = zero_wkv * 2 * KV_ITEMS
    n_zdec = zero_dec * gl.cdiv(TD, ROWS) * (HIDDEN // HEAD_DIM)
    n_zenc = zero_enc * gl.cdiv(TE, ROWS) * (CROSS // HEAD_DIM)
    per_d = PER_BLOCK * (HEADS + dec_chunks)
    n_d = (nb_d - 1) * per_d + _chunks(nb_d - 1, TD, ROWS) * (HEADS + dec_chunks)
    per_e = SUM_PER_BLOCK * 2 * GROUP + PER_BLOCK * enc_chunks
    n_e = (nb_e - 1) * per_e + _chunks(nb_e - 1, TE, UNIT) * 2 * GROUP + _chunks(nb_e - 1, TE, ROWS) * enc_chunks
    e_zero = n_zq + n_zkv + n_zdec + n_zenc
    e_d = e_zero + n_d
    e_wq = e_d + pack_w * W_ITEMS
    e_e = e_wq + n_e
    total = e_e + pack_w * 2 * KV_ITEMS
    # defaults: a zero fill of grad_Wq's row block (64 rows x 256 columns)
    mode = 0
    src = gq
    dst = gq16
    zero_dst = grad_wq + item // (Q_OUT // ROWS) * HEAD_DIM
    row0 = item % (Q_OUT // ROWS) * ROWS
    n_rows = Q_OUT - row0
    src_stride = HEAD_DIM
    dst_stride = HIDDEN
    S = SD
    head = 0
    slot = ranges
    counter = c_w + 2
    if item >= total:
        n_rows = 0
    elif item < n_zq:
        pass
    elif item < n_zq + n_zkv:
        local = item - n_zq
        zero_dst = gl.where(local < KV_ITEMS, grad_wk, grad_wv) + local % KV_ITEMS // (KV_OUT // ROWS) * HEAD_DIM
        row0 = local % (KV_OUT // ROWS) * ROWS
        n_rows = KV_OUT - row0
        dst_stride = CROSS
        counter = c_w + 3
    elif item < n_zq + n_zkv + n_zdec:  # zero grad_dec [TD, 1536]
        local = item - n_zq - n_zkv
        zero_dst = grad_dec + local // gl.cdiv(TD, ROWS) * HEAD_DIM
        row0 = local % gl.cdiv(TD, ROWS) * ROWS
        n_rows = TD - row0
        counter = c_w + 4
    elif item < e_zero:  # zero grad_enc [TE, 1024]
        local = item - n_zq - n_zkv - n_zdec
        zero_dst = grad_enc + local // gl.cdiv(TE, ROWS) * HEAD_DIM
        row0 = local % gl.cdiv(TE, ROWS) * ROWS
        n_rows = TE - row0
        dst_stride = CROSS
        counter = c_w + 5
    elif item < e_d:  # decoder side, block by block
        local = item - e_zero
        block = local // per_d
        sub = local - block * per_d
        chunks = _chunks(block, TD, ROWS)
        row0 = block * TOKEN_BLOCK + sub % chunks * ROWS
        n_rows = TD - row0
        if sub < _gq_items(block, TD):  # GQ: 64 tokens of one head
            mode = 2
            head = sub // chunks
            dst = gq16 + head * HEAD_DIM
            dst_stride = Q_OUT
            slot = ranges + r_gq + block * PER_BLOCK * HEADS + sub
            counter = c_gq + block
        else:  # dec16: 64 tokens x 256 columns
            mode = 1
            col = (sub - HEADS * chunks) // chunks * HEAD_DIM
            src = dec + col
            dst = dec16 + col
            src_stride = HIDDEN
            slot = ranges + r_dec + block * PER_BLOCK * dec_chunks + sub - HEADS * chunks
            counter = c_dec + block
    elif item < e_wq:  # Wq16
        local = item - e_d
        mode = 1
        col = local // (Q_OUT // ROWS) * HEAD_DIM
        src = wq + col
        dst = wq16 + col
        row0 = local % (Q_OUT // ROWS) * ROWS
        n_rows = ROWS
        src_stride = HIDDEN
        slot = ranges + r_wq + local
        counter = c_w
    elif item < e_e:  # encoder side, block by block
        local = item - e_wq
        block = local // per_e
        sub = local - block * per_e
        sum_chunks = _chunks(block, TE, UNIT)
        S = SE
        if sub < _gkv_items(block, TE):  # one KV head of GK or GV for 16 tokens: the sum of its 4 query heads
            mode = 3
            part = sub // sum_chunks  # 0..3: GK heads, 4..7: GV heads
            row0 = block * TOKEN_BLOCK + sub % sum_chunks * UNIT
            n_rows = TE - row0
            src = gl.where(part < GROUP, gk, gv)
            head = part % GROUP * GROUP
            dst = gkv16 + part // GROUP * KV_OUT + part % GROUP * HEAD_DIM
            dst_stride = 2 * KV_OUT
            slot = ranges + gl.where(part < GROUP, r_gk, r_gv) + block * SUM_PER_BLOCK * GROUP \
                + part % GROUP * sum_chunks + sub % sum_chunks
            counter = c_gkv + block
        else:  # enc16: 64 tokens x 256 columns
            mode = 1
            sub = sub - 2 * GROUP * sum_chunks
            chunks = _chunks(block, TE, ROWS)
            row0 = block * TOKEN_BLOCK + sub % chunks * ROWS
            n_rows = TE - row0
            col = sub // chunks * HEAD_DIM
            src = enc + col
            dst = enc16 + col
            src_stride = CROSS
            dst_stride = CROSS
            slot = ranges + r_enc + block * PER_BLOCK * enc_chunks + sub
            counter = c_enc + block
    else:  # [Wk; Wv]16
        local = item - e_e
        on_v = local >= KV_ITEMS
        local = local % KV_ITEMS
        mode = 1
        col = local // (KV_OUT // ROWS) * HEAD_DIM
        src = gl.where(on_v, wv, wk) + col
        dst = wkv16 + on_v.to(gl.int32) * KV_OUT * CROSS + col
        row0 = local % (KV_OUT // ROWS) * ROWS
        n_rows = ROWS
        src_stride = CROSS
        dst_stride = CROSS
        slot = ranges + gl.where(on_v, r_wv, r_wk) + local
        counter = c_w + 1
    return mode, src, dst, zero_dst, row0, n_rows, src_stride, dst_stride, S, head, slot, counter


@gluon.jit
def _pack(bufs, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16, grad_wq, grad_wk, grad_wv,
          grad_dec, grad_enc, counters, ranges, TD, TE, SD, SE, dec_chunks, enc_chunks, zero_wq, zero_wkv, zero_dec,
          zero_enc, pack_w, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv):
    """The pack partition: this program's share (every num_programs-th) of the pack items (`_item`),
    one at a time (64 KB of copies in flight). Measured: two items in flight, with the products'
    ring one slot shorter to make room, were slower (benchmarks/notes/gluon.md)."""
    item = gl.program_id(0)
    mode, src, dst, zero_dst, row0, n_rows, src_stride, dst_stride, S, head, slot, counter = _item(
        item, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16, grad_wq, grad_wk, grad_wv,
        grad_dec, grad_enc, counters, ranges, TD, TE, SD, SE, dec_chunks, enc_chunks, zero_wq, zero_wkv, zero_dec,
        zero_enc, pack_w, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv)
    while n_rows > 0:
        _fetch_item(bufs, mode, src, row0, n_rows, src_stride, S, head)
        async_copy.wait_group(0)
        gl.thread_barrier()  # every thread's copies have landed
        _finish_item(bufs, mode, dst, zero_dst, row0, n_rows, dst_stride, slot, counter)
        item += gl.num_programs(0)
        mode, src, dst, zero_dst, row0, n_rows, src_stride, dst_stride, S, head, slot, counter = _item(
            item, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16, grad_wq, grad_wk,
            grad_wv, grad_dec, grad_enc, counters, ranges, TD, TE, SD, SE, dec_chunks, enc_chunks, zero_wq, zero_wkv,
            zero_dec, zero_enc, pack_w, r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv)


@gluon.jit
def _product_of(tile, s1, s2, s3):
    return (tile >= s1).to(gl.int32) + (tile >= s2).to(gl.int32) + (tile >= s3).to(gl.int32)


@gluon.jit
def _loader(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc, a_k, a_m, b_bufs, ready, empty, counters,
            TD, TE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """Tiles in order [grad_Wq | grad_dec | grad_Wkv | grad_enc] (starts 0, s1, s2, s3); each waits for
    the pack tiles it reads: per K step (weight gradients: K is tokens) or once (input gradients)."""
    c_gq, c_dec, c_gkv, c_enc, c_w = _counters(counters, TD, TE)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        p = _product_of(tile, s1, s2, s3)
        if p == 0:  # grad_Wq = GQ^T dec16: A M-major [tokens, 4096], B [tokens, 1536]
            off_m, off_n, k_lo, k_hi = tile_coords(tile, Q_OUT // BM, HIDDEN // BN, TD, split_wq, BM, BN, BK)
            for k in range(k_lo, k_hi, BK):
                block = k // TOKEN_BLOCK
                if (k == k_lo) | (k % TOKEN_BLOCK == 0):
                    wait_count(c_gq + block, _gq_items(block, TD))
                    wait_count(c_dec + block, dec_chunks * _chunks(block, TD, ITEM_ROWS))
                issue_step(a_wq, b_wq, a_m, b_bufs, ready, empty, it, k, off_m, k, off_n, STAGES)
                it += 1
        elif p == 1:  # grad_dec = GQ Wq16
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s1, gl.cdiv(TD, BM), HIDDEN // BN, Q_OUT, split_dec, BM, BN, BK)
            wait_count(c_w, W_ITEMS)
            wait_count(c_gq + off_m // TOKEN_BLOCK, _gq_items(off_m // TOKEN_BLOCK, TD))
            for k in range(k_lo, k_hi, BK):
                issue_step(a_dec, b_dec, a_k, b_bufs, ready, empty, it, off_m, k, k, off_n, STAGES)
                it += 1
        elif p == 2:  # [grad_Wk; grad_Wv] = [GK | GV]^T enc16
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s2, 2 * KV_OUT // BM, CROSS // BN, TE, split_wkv, BM, BN, BK)
            for k in range(k_lo, k_hi, BK):
                block = k // TOKEN_BLOCK
                if (k == k_lo) | (k % TOKEN_BLOCK == 0):
                    wait_count(c_gkv + block, _gkv_items(block, TE))
                    wait_count(c_enc + block, enc_chunks * _chunks(block, TE, ITEM_ROWS))
                issue_step(a_wkv, b_wkv, a_m, b_bufs, ready, empty, it, k, off_m, k, off_n, STAGES)
                it += 1
        else:  # grad_enc = [GK | GV] [Wk; Wv]16
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s3, gl.cdiv(TE, BM), CROSS // BN, 2 * KV_OUT, split_enc, BM, BN,
                                                   BK)
            wait_count(c_w + 1, 2 * KV_ITEMS)
            wait_count(c_gkv + off_m // TOKEN_BLOCK, _gkv_items(off_m // TOKEN_BLOCK, TE))
            for k in range(k_lo, k_hi, BK):
                issue_step(a_enc, b_enc, a_k, b_bufs, ready, empty, it, off_m, k, k, off_n, STAGES)
                it += 1


@gluon.jit
def _consumer(a_k, a_m, b_bufs, ready, empty, counters, grad_wq, grad_dec, grad_wk, grad_wv, grad_enc,
              TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr):
    """Rows [PART * BM/2, +BM/2) of every tile of this program; split-K tiles add into outputs that
    the pack zeroed (waited for before the first atomic)."""
    ROWS: gl.constexpr = BM // 2
    ROW0: gl.constexpr = PART * ROWS
    c_w = _counters(counters, TD, TE)[4]
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        p = _product_of(tile, s1, s2, s3)
        if p == 0:
            off_m, off_n, k_lo, k_hi = tile_coords(tile, Q_OUT // BM, HIDDEN // BN, TD, split_wq, BM, BN, BK)
            acc, it = consume_tile(a_m, b_bufs, ready, empty, it, gl.cdiv(k_hi - k_lo, BK), False, False, False,
                                   ROW0, ROWS, BN, STAGES, 4)
            if split_wq > 1:
                wait_count(c_w + 2, W_ITEMS)
            store_tile(grad_wq, HIDDEN, acc, off_m + ROW0, off_n, Q_OUT, HIDDEN, split_wq > 1)
        elif p == 1:
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s1, gl.cdiv(TD, BM), HIDDEN // BN, Q_OUT, split_dec, BM, BN, BK)
            acc, it = consume_tile(a_k, b_bufs, ready, empty, it, gl.cdiv(k_hi - k_lo, BK), True, False, False,
                                   ROW0, ROWS, BN, STAGES, 4)
            if split_dec > 1:
                wait_count(c_w + 4, gl.cdiv(TD, ITEM_ROWS) * (HIDDEN // HEAD_DIM))
            store_tile(grad_dec, HIDDEN, acc, off_m + ROW0, off_n, TD, HIDDEN, split_dec > 1)
        elif p == 2:
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s2, 2 * KV_OUT // BM, CROSS // BN, TE, split_wkv, BM, BN, BK)
            acc, it = consume_tile(a_m, b_bufs, ready, empty, it, gl.cdiv(k_hi - k_lo, BK), False, False, False,
                                   ROW0, ROWS, BN, STAGES, 4)
            if split_wkv > 1:
                wait_count(c_w + 3, 2 * KV_ITEMS)
            # rows below KV_OUT are grad_Wk's, the rest grad_Wv's: one output tensor each
            on_v = off_m >= KV_OUT
            store_tile(gl.where(on_v, grad_wv, grad_wk), CROSS, acc, off_m + ROW0 - on_v.to(gl.int32) * KV_OUT, off_n,
                       KV_OUT, CROSS, split_wkv > 1)
        else:
            off_m, off_n, k_lo, k_hi = tile_coords(tile - s3, gl.cdiv(TE, BM), CROSS // BN, 2 * KV_OUT, split_enc, BM, BN,
                                                   BK)
            acc, it = consume_tile(a_k, b_bufs, ready, empty, it, gl.cdiv(k_hi - k_lo, BK), True, False, False,
                                   ROW0, ROWS, BN, STAGES, 4)
            if split_enc > 1:
                wait_count(c_w + 5, gl.cdiv(TE, ITEM_ROWS) * (CROSS // HEAD_DIM))
            store_tile(grad_enc, CROSS, acc, off_m + ROW0, off_n, TE, CROSS, split_enc > 1)


@gluon.jit
def _second_consumer(a_k, a_m, b_bufs, ready, empty, counters, grad_wq, grad_dec, grad_wk, grad_wv, grad_enc,
                     TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    _consumer(a_k, a_m, b_bufs, ready, empty, counters, grad_wq, grad_dec, grad_wk, grad_wv, grad_enc,
              TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, BM, BN, BK, STAGES, 1)


@gluon.jit(do_not_specialize=["TD", "TE", "SD", "SE", "dec_chunks", "enc_chunks", "split_wq", "split_wkv", "split_dec",
                               "split_enc", "s1", "s2", "s3", "total", "r_gq", "r_gk", "r_gv", "r_dec", "r_enc", "r_wq",
                               "r_wk", "r_wv"])
def fused_kernel(a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc,
                 gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16,
                 grad_dec, grad_enc, grad_wq, grad_wk, grad_wv, counters, ranges,
                 TD, TE, SD, SE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
                 r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv,
                 STAGES: gl.constexpr):
    """The five 072 outputs from the official inputs, one persistent launch (counters pre-zeroed).

    Descriptors (fp16, over the pack's buffers): a_wq/a_wkv [tokens, 4096 | 2048] in [BK, BM]
    tiles (A M-major), a_dec/a_enc the same buffers in [BM, BK] tiles, b_* the B operands in
    [BK, BN] tiles. dec_chunks / enc_chunks: 256-column pack tiles per row of dec / enc (0 when
    no weight gradient is wanted). Tiles: grad_Wq [0, s1), grad_dec [s1, s2), grad_Wkv [s2, s3),
    grad_enc [s3, total). Launched with num_warps=4 (the first consumer warpgroup).
    """
    BK: gl.constexpr = a_dec.block_type.shape[1]
    BM: gl.constexpr = a_dec.block_type.shape[0]
    BN: gl.constexpr = b_dec.block_type.shape[1]
    a_k = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], a_dec.layout)
    a_m = a_k._reinterpret(gl.float16, [STAGES, BK, BM], a_wq.layout)  # the same slots, M-major
    b_bufs = gl.allocate_shared_memory(gl.float16, [STAGES, BK, BN], b_dec.layout)
    pack_bufs = gl.allocate_shared_memory(gl.float32, [UNITS * UNIT, HEAD_DIM],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (a_k, a_m, b_bufs, ready, empty, counters, grad_wq, grad_dec, grad_wk, grad_wv, grad_enc,
                     TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, BM, BN, BK, STAGES, 0)),
        (_second_consumer, (a_k, a_m, b_bufs, ready, empty, counters, grad_wq, grad_dec, grad_wk, grad_wv, grad_enc,
                            TD, TE, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total, BM, BN, BK, STAGES)),
        (_loader, (a_wq, b_wq, a_dec, b_dec, a_wkv, b_wkv, a_enc, b_enc, a_k, a_m, b_bufs, ready, empty, counters,
                   TD, TE, dec_chunks, enc_chunks, split_wq, split_wkv, split_dec, split_enc, s1, s2, s3, total,
                   BM, BN, BK, STAGES)),
        (_pack, (pack_bufs, gq, gk, gv, dec, enc, wq, wk, wv, gq16, gkv16, dec16, enc16, wq16, wkv16, grad_wq, grad_wk,
                 grad_wv, grad_dec, grad_enc, counters, ranges, TD, TE, SD, SE, dec_chunks, enc_chunks,
                 (split_wq > 1).to(gl.int32), (split_wkv > 1).to(gl.int32), (split_dec > 1).to(gl.int32),
                 (split_enc > 1).to(gl.int32), ((s3 < total) | (s1 < s2)).to(gl.int32),
                 r_gq, r_gk, r_gv, r_dec, r_enc, r_wq, r_wk, r_wv)),
    ], [4, 1, 4], [CONSUMER_REGS, LOADER_REGS, PACK_REGS])


def descriptor_blocks(bm: int, bn: int, bk: int) -> tuple:
    """(argument, fp16 buffer, block) of fused_kernel's eight TMA descriptors, in argument order: the A
    operands of the weight gradients M-major ([bk, bm] tiles of GQ and [GK | GV]), the B operands
    [bk, bn], the A operands of the input gradients K-major ([bm, bk])."""
    return (("a_wq", "gq16", [bk, bm]), ("b_wq", "dec16", [bk, bn]), ("a_dec", "gq16", [bm, bk]),
            ("b_dec", "wq16", [bk, bn]), ("a_wkv", "gkv16", [bk, bm]), ("b_wkv", "enc16", [bk, bn]),
            ("a_enc", "gkv16", [bm, bk]), ("b_enc", "wkv16", [bk, bn]))
