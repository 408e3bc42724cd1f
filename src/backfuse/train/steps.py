"""The launch steps the training paths compose: casts, sums, the scale's undoing, the guard's check,
and attention forward and backward, each prepared (`program.Kernel`) for one call's tensors.

`guard` arguments are a `guard.Guard` (fp16 products) or None (bfloat16 products, unguarded): with
None the kernels are compiled without their range bookkeeping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from ..kernels import buffers
from ..kernels.schedule import cdiv
from ..kernels.triton import attention, passes
from .masks import Masking
from .program import Buffer, Kernel, bases, compiling_only, constant, execute, torch_step

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Elements per program of the flat passes (the interpreter's cost is per program: few, large ones).
FLAT_BLOCK = 1 << 16 if INTERPRETED else 8192
FLAT_WARPS = 8

CAST = Kernel(passes.cast_kernel)
DECIDE = Kernel(passes.decide_kernel)
HEADS_TO_TOKENS = Kernel(passes.heads_to_tokens_kernel)
REPEAT = Kernel(passes.repeat_heads_kernel)
ROW_NORM = Kernel(passes.row_norm_kernel)
ROW_NORM_BACKWARD = Kernel(passes.row_norm_backward_kernel)
PARTIALS = Kernel(passes.column_partials_kernel)
FINISH = Kernel(passes.column_finish_kernel)
UNSCALE = Kernel(passes.unscale_kernel)
CHECK = Kernel(passes.guard_check_kernel)
FORWARD = Kernel(attention.attention_forward_kernel)
DELTA = Kernel(attention.attention_delta_kernel)
BACKWARD = Kernel(attention.attention_backward_kernel)
BOUNDS = Kernel(attention.attention_bounds_kernel)
KEY_BOUNDS = Kernel(attention.attention_key_bounds_kernel)
DOCUMENTS = Kernel(attention.documents_kernel)

_dummies: dict = {}


def _dummy(device) -> torch.Tensor:
    """A tensor standing for the guard's buffers in kernels compiled without them."""
    t = _dummies.get(device)
    if t is None:
        t = _dummies[device] = constant(torch.zeros(8, dtype=torch.float32, device=device))
    return t


def _guarded(guard, device):
    """(ranges, state, RANGES) for a kernel's arguments."""
    if guard is None:
        d = _dummy(device)
        return d, d, False
    return guard.maxima, guard.state, True


def _slot(guard, region) -> int:
    """A region's index for a kernel; -1 (not checked) for none."""
    return -1 if guard is None or region is None else guard.slot(region)


def cast(src, dst, guard, region: str, *, upstream: bool = False, redo: bool = False):
    """dst = src in dst's dtype (both contiguous, flat); upstream (a scaled guard's calls): times 2^k, the
    first or (redo) the second cast of `upstream_casts`."""
    ranges, state, checked = _guarded(guard, src.device)
    n = src.numel()
    return CAST((cdiv(n, FLAT_BLOCK),), dict(src=src, dst=dst, ranges=ranges, state=state, n=n,
                                            r=_slot(guard, region)),
                BLOCK=FLAT_BLOCK, UPSTREAM=upstream, REDO=redo, RANGES=checked, num_warps=FLAT_WARPS)


def heads_to_tokens(src, dst, group: int, guard, region: str, *, upstream: bool = False, redo: bool = False):
    """dst[B * S, (H / group) * D] = src[B, H, S, D] (any strides but a contiguous last axis) summed over
    each group of `group` heads, in dst's dtype (dst may be a column block of a wider buffer); upstream and
    redo as `cast`."""
    batch, heads, seq, d = src.shape
    ranges, state, checked = _guarded(guard, src.device)
    bt = 64 if INTERPRETED else max(8, min(64, 8192 // d))
    return HEADS_TO_TOKENS(
        (cdiv(seq, bt), batch * heads // group),
        dict(src=src, dst=dst, ranges=ranges, state=state, S=seq, stride_b=src.stride(0), stride_h=src.stride(1),
             stride_s=src.stride(2), r=_slot(guard, region)),
        GROUP=group, D=d, HEADS_OUT=heads // group, LD=dst.stride(0), BT=bt, UPSTREAM=upstream, REDO=redo,
        RANGES=checked, num_warps=4)


def upstream_casts(guard, casts) -> list:
    """The launches that cast an op's upstream gradients to the products' dtype, scaled by this call's 2^k
    where the guard scales (`guard.Guard.scaled`), reading them once where their size has not jumped: each
    cast first at the last call's k while it takes their largest |value|, then `passes.decide_kernel` keeps
    that k where this call's gradients fit it, or records another and has the second casts, which otherwise
    exit at once, cast again at it (before anything reads the first). casts: (src, dst, region, group), group
    None for a flat cast, else `heads_to_tokens`' sum over `group` heads; at most three."""
    scaled = guard is not None and guard.scaled

    def launch(src, dst, region, group, redo):
        if group is None:
            return cast(src, dst, guard, region, upstream=scaled, redo=redo)
        return heads_to_tokens(src, dst, group, guard, region, upstream=scaled, redo=redo)

    first = [launch(*c, False) for c in casts]
    if not scaled:
        return first
    slots = [_slot(guard, region) for _, _, region, _ in casts] + [-1] * (3 - len(casts))
    decide = DECIDE((1,), dict(state=guard.state, ranges=guard.maxima, r0=slots[0], r1=slots[1], r2=slots[2]))
    return first + [decide] + [launch(*c, True) for c in casts]


def repeat_heads(src, dst, group: int, head_dim: int):
    """dst[T, H * D] = src[T, (H / group) * D] with each head repeated `group` times (same dtype)."""
    tokens, width = src.shape
    bt = 64 if INTERPRETED else max(8, min(64, 8192 // head_dim))
    return REPEAT((cdiv(tokens, bt), width // head_dim), dict(src=src, dst=dst, T=tokens), GROUP=group, D=head_dim,
                  LD_SRC=src.stride(0), LD_DST=dst.stride(0), BT=bt, num_warps=4)


def _row_block(width: int) -> tuple:
    """(columns a program's tile spans: a power of two, rows per tile) of the row norms."""
    bw = 1 << (width - 1).bit_length()
    return bw, max(1, min(16, 8192 // bw))


def row_norm(x, w, out, eps: float, rstd=None, rope=None):
    """out = RMSNorm(x) * w over each row (all of its columns); rope = (cos, sin, head size): then turned by RoPE on
    interleaved pairs (`passes.py: _turn_pairs`; cos, sin [rows, head size] tables, token t reading row t % rows),
    w None: the turn alone; given rstd [T] fp32, only each row's 1 / sqrt(mean(x^2) + eps) into it (w and out
    unused: None). out may be x."""
    tokens, width = x.shape
    bw, bt = _row_block(width)
    only = rstd is not None  # (x stands for the pointers the kernel does not use)
    cos, sin, head = rope if rope is not None else (x, x, 0)
    return ROW_NORM((cdiv(tokens, bt),), dict(x=x, w=x if w is None else w, out=x if only else out,
                                              rstd=rstd if only else x, cos=cos, sin=sin, T=tokens,
                                              cos_rows=cos.shape[0], eps=float(eps)),
                    W=width, BW=bw, LD_X=x.stride(0), LD_OUT=(x if only else out).stride(0), BT=bt, RSTD=only,
                    NORM=w is not None or only, ROPE=head, num_warps=8 if bw >= 4096 else 4)


def row_norm_parts(tokens: int) -> int:
    """Rows of partial weight gradients `row_norm_backward` writes for `tokens` rows."""
    return cdiv(tokens, row_norm_rows(tokens))


def row_norm_rows(tokens: int) -> int:
    return tokens if INTERPRETED else max(64, cdiv(tokens, 256))


def row_norm_backward(dy, x, w, dx, parts, eps: float, guard, region: str, rope=None, bias_parts=None):
    """dx (and w's gradient in parts, [row_norm_parts(T), W] fp32) of `row_norm` with the same rope; w None: of the
    turn alone (x and parts unused: None). bias_parts (the same shape): each program's column sums of dx, the
    gradient of a bias added to the rows before the norm (`column_finish` sums them). dx may be dy."""
    tokens, width = dy.shape
    bw, bt = _row_block(width)
    per = row_norm_rows(tokens)
    ranges, _, checked = _guarded(guard, dy.device)
    cos, sin, head = rope if rope is not None else (dy, dy, 0)
    norm = w is not None
    return ROW_NORM_BACKWARD((cdiv(tokens, per),), dict(dy=dy, x=x if norm else dy, w=w if norm else dy, dx=dx,
                                                         parts=parts if norm else dy,
                                                         bias_parts=dy if bias_parts is None else bias_parts,
                                                         ranges=ranges, cos=cos, sin=sin, T=tokens,
                                                         cos_rows=cos.shape[0], eps=float(eps), rows_per_program=per,
                                                         r_dx=_slot(guard, region)),
                             W=width, BW=bw, LD_DY=dy.stride(0), LD_X=(x if norm else dy).stride(0), LD_DX=dx.stride(0),
                             BT=bt, RANGES=checked, NORM=norm, ROPE=head, BIAS=bias_parts is not None,
                             num_warps=8 if bw >= 2048 else 4)


def column_sum_parts(rows: int) -> int:
    """Rows of partial sums `column_sums` needs for an input of `rows` rows."""
    return cdiv(rows, column_rows_per_program(rows))


def column_rows_per_program(rows: int) -> int:
    return max(256, cdiv(rows, 64)) if not INTERPRETED else max(rows, 1)


def column_sums(x, out, parts, guard, *, unscale: bool):
    """out = column sums of x[R, C] (rows in order: the same bits every call), through parts
    [column_sum_parts(R), C] fp32; unscale: times 2^-k (x holds upstream-scaled values)."""
    rows, cols = x.shape
    per = column_rows_per_program(rows)
    strips = 1024 if INTERPRETED else 64  # columns per program (the interpreter: few, wide ones)
    return [PARTIALS((cdiv(rows, per), cdiv(cols, strips)), dict(x=x, parts=parts, R=rows, C=cols, rows_per_program=per),
                     LD=x.stride(0), ROWS=32, COLS=strips),
            *column_finish(parts, out, guard, unscale=unscale)]


def column_finish(parts, out, guard, *, unscale: bool):
    """out = the column sums of parts [n, C] fp32, in order (per-program partial sums: `column_sums`,
    `row_norm_backward`'s); unscale: times 2^-k."""
    n, cols = parts.shape
    _, state, checked = _guarded(guard, parts.device)
    strips = 1024 if INTERPRETED else 64
    return [FINISH((cdiv(cols, strips),), dict(parts=parts, out=out, state=state, n_parts=n, C=cols),
                   ROWS=32, COLS=strips, UNSCALE=unscale and checked)]


def unscale(x, guard):
    """x *= 2^-k in place (contiguous); nothing when the call's k is 0."""
    n = x.numel()
    return UNSCALE((cdiv(n, FLAT_BLOCK),), dict(x=x, state=guard.state, n=n), BLOCK=FLAT_BLOCK)


def check(guard):
    """The guard's check of this call's maxima (the call's last launch)."""
    return CHECK((1,), dict(maxima=guard.maxima, flags=guard.flags, state=guard.state, log=guard.log,
                            n_regions=len(guard.regions)), R=32, SCALED=guard.scaled)


@dataclass(frozen=True, kw_only=True)
class AttentionTiles:
    """Forward: bm queries per program, bn keys per step. Backward: kv_bn keys per dK/dV program,
    kv_bm queries per step; q_bm queries per dQ program, q_bn keys per step; dq_atomic: where the
    caller's dQ is fp32 and atomics are allowed, the dK/dV programs add dQ by atomics instead (no dQ
    programs)."""

    bm: int
    bn: int
    warps: int
    stages: int
    kv_bn: int
    kv_bm: int
    q_bm: int
    q_bn: int
    bwd_warps: int
    bwd_stages: int
    dq_atomic: bool = False


# By head size on a GPU (registers: the backward's two fp32 accumulators are kv_bn x D each). 128 and 256:
# the fastest of `benchmarks/tools/attention_tiles.py`'s variants at the presets' shapes (notes/training.md).
GPU_TILES = {
    16: AttentionTiles(bm=64, bn=64, warps=4, stages=2, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=4, bwd_stages=2),
    32: AttentionTiles(bm=64, bn=64, warps=4, stages=2, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=4, bwd_stages=2),
    64: AttentionTiles(bm=128, bn=64, warps=4, stages=3, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=4,
                       bwd_stages=2),
    128: AttentionTiles(bm=64, bn=64, warps=4, stages=3, kv_bn=128, kv_bm=64, q_bm=128, q_bn=64, bwd_warps=8,
                        bwd_stages=2),
    256: AttentionTiles(bm=128, bn=64, warps=8, stages=2, kv_bn=64, kv_bm=64, q_bm=64, q_bn=64, bwd_warps=8,
                        bwd_stages=2),
}
# With a soft cap, dQ by atomics from the key blocks' programs (no dQ programs recomputing the tanh): 2204
# against 2385 µs at gemma2-9b 1x4096 on the H200 (tools/attention_tiles.py's "a+atomic", session 32), whose
# backward steps over 32 queries: the fp32 dQ part of 64 would need 262656 bytes of shared memory, more than
# a program has (232448; `tests/test_sm90.py` compiles every choice here for sm_90).
GPU_SOFTCAP_TILES = {256: replace(GPU_TILES[256], kv_bm=32, q_bn=32, dq_atomic=True)}
# The interpreter's: dQ by atomics (fewer programs: 037's training-path tests run 16 % faster than with dQ
# programs). On the GPU the dQ programs win at every measured shape but the soft-capped one.
INTERPRETER_TILES = AttentionTiles(bm=32, bn=32, warps=4, stages=1, kv_bn=32, kv_bm=32, q_bm=32, q_bn=32, bwd_warps=4,
                                   bwd_stages=1, dq_atomic=True)


def attention_tiles(head_dim: int, gpu: bool, softcap: bool = False) -> AttentionTiles:
    if head_dim not in GPU_TILES:
        raise ValueError(f"attention head size must be one of {sorted(GPU_TILES)}, got {head_dim}")
    if not gpu:
        return INTERPRETER_TILES
    return GPU_SOFTCAP_TILES.get(head_dim, GPU_TILES[head_dim]) if softcap else GPU_TILES[head_dim]


@dataclass(frozen=True)
class Attention:
    """One attention's shape and mask: batch, query and key lengths per batch entry, query heads,
    query heads per KV head, head size, causal, window (0: none), soft cap (0: none), and a Masking
    (None: causal and window alone)."""

    batch: int
    s_q: int
    s_k: int
    heads: int
    group: int
    head_dim: int
    causal: bool = False
    window: int = 0
    softcap: float = 0.0
    masking: Masking | None = None

    def meta(self, guard) -> dict:
        masked = self.masking is not None  # the bounds hold causality and the window
        return dict(HEADS=self.heads, GROUP=self.group, D=self.head_dim, CAUSAL=self.causal and not masked,
                    WINDOW=self.window > 0 and not masked, HAS_CAP=self.softcap != 0.0, RANGES=guard is not None,
                    APPROX_TANH=not INTERPRETED, MASK=self.masking.mode if masked else 0)

    def split(self, tiles: AttentionTiles, sms: int, deterministic: bool) -> int:
        """dK/dV programs per key block: more than one (their sums added by atomics into fp32) where the
        key blocks alone would leave most of the GPU idle, each run keeping at least four query steps."""
        if deterministic:
            return 1
        kv_programs = self.batch * (self.heads // self.group) * cdiv(self.s_k, tiles.kv_bn)
        steps = cdiv(self.s_q, tiles.kv_bm) * self.group
        return max(1, min(sms // max(1, kv_programs), steps // 4))

    def other_split(self, tiles: AttentionTiles, sms: int, deterministic: bool, tied: bool) -> int | None:
        """A split on the other side of 1 from this attention's own that another length of its batch takes (the
        split depends on the lengths, so a loop of changing lengths crosses it: its kernels are compiled at the
        first call, `compile_other_split`), or None where none does. tied: a self-attention, S_k = S_q; else
        each length free. Where this one splits, 1 (a long enough length never does); else the first split > 1
        at whole key blocks, or one key block and queries as many as it takes."""
        if deterministic:
            return None
        if self.split(tiles, sms, deterministic) > 1:
            return 1
        kv_heads = self.batch * (self.heads // self.group)
        if not tied:
            return sms // kv_heads if sms // kv_heads > 1 else None
        for blocks in range(1, sms // (2 * kv_heads) + 1):  # past these, the key blocks fill half the GPU
            s = blocks * tiles.kv_bn
            split = replace(self, s_q=s, s_k=s).split(tiles, sms, deterministic)
            if split > 1:
                return split
        return None


def stand_ins(specs, views: SimpleNamespace) -> SimpleNamespace:
    """views, with meta-device tensors of the buffers' shapes and dtypes by their names in place of its own: what
    a call passes for the buffers its plan lacks (or has in another dtype) to the kernels it compiles for another
    plan (`program.compiling_only`)."""
    return SimpleNamespace(**{**vars(views), **{b.name: torch.empty(b.shape, dtype=b.dtype, device="meta")
                                                 for b in specs if b is not None}})


def compile_other_split(plan, views: SimpleNamespace, launches_at) -> None:
    """The kernels that launches_at(other, views') prepares, compiled now and none launched
    (`program.compiling_only`), for `other` the plan's `other_split` (None: nothing) and views' its views
    with stand-ins for the buffers that split has (`plan.split_buffers(other)`, `stand_ins`)."""
    other = plan.other_split
    if other is not None:
        with compiling_only():
            launches_at(other, stand_ins(plan.split_buffers(other), views))


def bounds_buffer(a: Attention) -> Buffer | None:
    """The masked attention's bounds (`attention_bounds`), int32 [5, max(B * S, 2 B) rounded up to 4] (a masked
    attention is a self-attention: S_q = S_k = S): rows 0-3 each query's lo and hi, then each key's k_lo and k_hi
    (B * S entries each); row 4 each batch entry's first and last query that weighs every key alike (2 B
    entries). The rows are 16 bytes apart at every length, so each starts as aligned as the buffer: a kernel's
    binary is specific to its pointers' 16-byte alignment (`kernels/launch.py: specialization`), and rows B * S
    entries apart compiled every bounds and attention kernel again at the first B * S not divisible by 4. None
    without a mask."""
    if a.masking is None:
        return None
    return Buffer("bounds", (5, -(-max(a.batch * a.s_q, 2 * a.batch) // 4) * 4), torch.int32)


def _mask_args(a: Attention, bounds, mask, q, keys: bool = False) -> dict:
    """The attention kernels' mask arguments: `bounds_buffer`'s rows, the mask tensor and its element strides
    (batch, query, key; 0 where broadcast); keys: the keys' bounds and the alike rows' too (the backward's).
    Unmasked: q stands for the tensors."""
    if a.masking is None:
        args = dict(lo=q, hi=q, mask=q, m_sb=0, m_sq=0, m_sk=0)
        return args | (dict(k_lo=q, k_hi=q, alike=q) if keys else {})
    args = dict(lo=bounds[0], hi=bounds[1]) | (dict(k_lo=bounds[2], k_hi=bounds[3], alike=bounds[4]) if keys else {})
    if mask is None:
        return args | dict(mask=q, m_sb=0, m_sq=0, m_sk=0)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    if a.masking.dense:
        sb = mask.stride(0) if mask.shape[0] > 1 else 0
        return args | dict(mask=mask, m_sb=sb, m_sq=mask.stride(2), m_sk=mask.stride(3))
    return args | dict(mask=mask, m_sb=mask.stride(0), m_sq=0, m_sk=mask.stride(1))


# (rows, keys) a step of the rows' bounds' programs, (rows a step, keys) of the keys' bounds' programs. On the GPU the
# rows' programs take 16 rows and 256 keys a step: a dense mask leaves them every key to read, and 64-row programs
# over 64-key steps were 64 programs at 1 x 4096 taking ~0.3 ms a call, one dependent load after another (s45-3:
# 1.67 ms a step at gemma3-27b); the keys' programs read 256 rows' bounds a step (a fourth of the steps).
BOUNDS_TILES = ((32, 64), (32, 32)) if INTERPRETED else ((16, 256), (256, 64))


DOCUMENTS_BLOCK = 256 if INTERPRETED else 1024


def packed_documents(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """`masks.documents_from_cu_seqlens`'s [2, 1, tokens] int32 made by one kernel (`documents_kernel`), where
    torch's ops take ~15 launches, each with its Python on the host, once a forward of a packed batch. The launch
    goes through `execute`, keyed by the tokens, the documents and the dtypes, so a batch whose token and document
    counts recur runs its key's template (no launch prepared)."""
    out = buffers.empty((2, 1, tokens), torch.int32, cu_seqlens_q.device)
    if tokens == 0:
        return out
    cu_q = cu_seqlens_q.contiguous()
    cu_k = None if cu_seqlens_k is None else cu_seqlens_k.contiguous()
    documents = cu_q.numel() - 1
    args = dict(out=out, cu_q=cu_q, cu_k=cu_q if cu_k is None else cu_k, tokens=tokens, documents=documents,
                steps=(documents + 1).bit_length())

    def build():
        return [DOCUMENTS((cdiv(tokens, DOCUMENTS_BLOCK),), args, BLOCK=DOCUMENTS_BLOCK, num_warps=4)]

    key = ("packed documents", tokens, documents, cu_q.dtype, None if cu_k is None else cu_k.dtype)
    execute(key, out.device, bases(out, cu_q, cu_k), build)
    return out


def attention_bounds(a: Attention, bounds, mask=None, documents=None) -> list:
    """Launches writing `bounds_buffer`'s tensor: each query row's bounds (`attention_bounds_kernel`) from a's
    causality and window, the documents' first and last keys (which hold the causality) and the mask
    (`Masking`), then each key's and the alike rows' from them (`attention_key_bounds_kernel`)."""
    m = a.masking
    args = _mask_args(a, bounds, mask, bounds)
    (br, bn), (kbr, kbk) = BOUNDS_TILES
    return [BOUNDS((a.batch, cdiv(a.s_q, br)),
                   dict(lo=bounds[0], hi=bounds[1], mask=args["mask"], documents=bounds if documents is None else documents,
                        S_q=a.s_q, S_k=a.s_k, window=a.window, m_sb=args["m_sb"], m_sq=args["m_sq"], m_sk=args["m_sk"]),
                   CAUSAL=a.causal and not m.dense and not m.documents, WINDOW=a.window > 0 and not m.dense,
                   DOCS=m.documents, MASK=m.mode,
                   BR=br, BN=bn, num_warps=4),
            KEY_BOUNDS((a.batch, cdiv(a.s_k, kbk)), dict(lo=bounds[0], hi=bounds[1], k_lo=bounds[2], k_hi=bounds[3],
                                                         alike=bounds[4], S_q=a.s_q, S_k=a.s_k), BR=kbr, BK=kbk, num_warps=4)]


def _query_norm(q_norm, q) -> tuple:
    """The attention kernels' (q_rstd, q_w) from q_norm (rstd [T] fp32, weight [H * D]); None: q for both
    (not read)."""
    return q_norm if q_norm is not None else (q, q)


def reads_apart(a: Attention) -> bool:
    """Whether a's mask is read (a "keep" or "add" mask, where a query block has a partial row): the attention's
    blocks that read it then run in a launch of their own (`kernels/triton/attention.py: READ_APART`)."""
    return a.masking is not None and a.masking.mask is not None


def attention_forward(a: Attention, tiles: AttentionTiles, q, k, v, o, lse, scale: float, guard,
                      regions=("queries", "keys", "values"), q_norm=None, bounds=None, mask=None):
    """The launches writing o, lse of attention a; q, k, v, o token-major views (rows ld apart, head h at column
    h * D). q_norm: (rstd, weight) of an RMSNorm across q's heads, applied as q is loaded (q: the rows before it).
    With a.masking: bounds (`attention_bounds`') and the mask tensor it names (None: no tensor); a mask to read
    adds a second launch for the query blocks with a partial row (`reads_apart`)."""
    ranges, _, _ = _guarded(guard, q.device)
    r_q, r_k, r_v = (_slot(guard, r) for r in regions)
    q_rstd, q_w = _query_norm(q_norm, q)
    args = dict(q=q, k=k, v=v, o=o, lse=lse, ranges=ranges, q_rstd=q_rstd, q_w=q_w, S_q=a.s_q, S_k=a.s_k,
                scale=float(scale), cap=float(a.softcap) or 1.0, window=a.window, r_q=r_q, r_k=r_k, r_v=r_v,
                **_mask_args(a, bounds, mask, q))
    return [FORWARD((a.batch * a.heads, cdiv(a.s_q, tiles.bm)), args, LD_Q=q.stride(0), LD_K=k.stride(0),
                    LD_V=v.stride(0), LD_O=o.stride(0), BM=tiles.bm, BN=tiles.bn, num_warps=tiles.warps,
                    num_stages=tiles.stages, Q_NORM=q_norm is not None, READS=reads, **a.meta(guard))
            for reads in (False, True)[:1 + reads_apart(a)]]


def attention_delta(a: Attention, o, do, delta, guard, region="gradient of attention output"):
    """delta = rowsum(dO * O) per (head, query); dO's largest |value| into `region`."""
    ranges, _, checked = _guarded(guard, o.device)
    tokens = a.batch * a.s_q
    bt = 32 if INTERPRETED else max(16, 8192 // a.head_dim)
    return DELTA((cdiv(tokens, bt), a.heads),
                 dict(o=o, do=do, delta=delta, ranges=ranges, T=tokens, S_q=a.s_q, r_do=_slot(guard, region)),
                 HEADS=a.heads, D=a.head_dim, LD_O=o.stride(0), LD_DO=do.stride(0), BT=bt, RANGES=checked, num_warps=4)


def attention_backward(a: Attention, tiles: AttentionTiles, split: int, q, k, v, do, lse, delta, dq, dk, dv,
                       scale: float, guard, regions=("gradient of queries", "gradient of keys", "gradient of values"),
                       dq_atomic: bool = False, q_norm=None, bounds=None, mask=None):
    """The launches writing dq, dk, dv of attention a (a second one, of dQ programs, where `reads_apart`). split > 1:
    dk, dv are fp32 and zeroed before (atomic sums).
    dq_atomic: dq is fp32, zeroed before, and receives dQ as atomic sums from the key blocks' programs
    (no dQ programs: no recomputation of P and dP for dQ). q_norm: as `attention_forward`'s (dq: the
    gradient of the normed q)."""
    ranges, _, _ = _guarded(guard, q.device)
    q_rstd, q_w = _query_norm(q_norm, q)
    r_dq, r_dk, r_dv = (_slot(guard, r) for r in regions)
    kv_programs = a.batch * (a.heads // a.group) * cdiv(a.s_k, tiles.kv_bn) * split
    q_programs = 0 if dq_atomic else a.batch * a.heads * cdiv(a.s_q, tiles.q_bm)
    args = dict(q=q, k=k, v=v, do=do, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv, ranges=ranges, q_rstd=q_rstd,
                q_w=q_w, S_q=a.s_q, S_k=a.s_k, scale=float(scale), cap=float(a.softcap) or 1.0, window=a.window,
                kv_programs=kv_programs, split=split, r_dq=r_dq, r_dk=r_dk, r_dv=r_dv,
                **_mask_args(a, bounds, mask, q, keys=True))
    grids = [(kv_programs + q_programs,)] + ([(q_programs,)] if q_programs and reads_apart(a) else [])
    return [BACKWARD(grid, args, LD_Q=q.stride(0), LD_K=k.stride(0), LD_V=v.stride(0), LD_DO=do.stride(0),
                     LD_DQ=dq.stride(0), LD_DK=dk.stride(0), LD_DV=dv.stride(0), KV_BN=tiles.kv_bn, KV_BM=tiles.kv_bm,
                     Q_BM=tiles.q_bm, Q_BN=tiles.q_bn, KV_ATOMIC=split > 1, DQ_ATOMIC=dq_atomic,
                     num_warps=tiles.bwd_warps, num_stages=tiles.bwd_stages, Q_NORM=q_norm is not None, READS=reads,
                     **a.meta(guard))
            for grid, reads in zip(grids, (False, True))]


def zero(t):
    """A launch step: t = 0."""
    return torch_step(torch.Tensor.zero_, t, label="zero")
