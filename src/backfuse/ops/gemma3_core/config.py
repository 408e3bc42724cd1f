"""037's launch shapes (`Config`), the rules that pick among them, and the plan of one call (`plan`):
pack, forward products (or, after cuBLAS's, only norm, RoPE and v's fp16 copy), attention forward,
attention backward, gradient products (or, on cuBLAS's path, only the norm-weight sums: before its
products, or with branches beside them). The operator's sizes come from its config
(`spec.Gemma3CoreConfig`; the kernels take the benchmark operator's, `spec.OFFICIAL`), and reach the
kernels as constexprs (`size_constexprs`).

Plain Python: a plan can be checked on any machine without launching anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.config import PackConfig, SumConfig, TileConfig, check_rings, check_sizes
from ...kernels.schedule import (
    Holds,
    Layout,
    Region,
    Regions,
    Segment,
    cdiv,
    choose_products,
    choose_splits,
    chunks,
    tile_count,
)
from .spec import OFFICIAL, Gemma3CoreConfig


def size_constexprs(sizes: Gemma3CoreConfig) -> dict:
    """The operator's sizes by the constexpr names the kernels read them under (each kernel takes
    those it reads: `kernels.launch.constexprs_of`)."""
    return dict(HIDDEN=sizes.hidden, HEADS=sizes.heads, KV_HEADS=sizes.kv_heads, GROUP=sizes.group,
                HEAD_DIM=sizes.head_dim, HALF=sizes.half, Q_OUT=sizes.q_out, KV_OUT=sizes.kv_out, QK=sizes.qk,
                QKV=sizes.qkv)


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Forward: fwd_bm queries per program, fwd_bn keys per step. Backward: kv_bn keys per dK/dV
    program, kv_bm queries per step; q_bm queries per dQ program, q_bn keys per step. approx_tanh:
    the soft cap's tanh as one GPU instruction (the interpreter needs False)."""

    fwd_bm: int = 64
    fwd_bn: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    kv_bn: int = 64
    kv_bm: int = 32
    q_bm: int = 64
    q_bn: int = 32
    warps: int = 4
    stages: int = 3
    approx_tanh: bool = True
    # Keys per forward step up to short_seq tokens (forward_keys).
    short_fwd_bn: int = 32
    short_seq: int = 256
    # Keys per dK/dV program when kv_bn-key programs would not fill the GPU once (key_block).
    few_kv_bn: int = 32
    # dK/dV programs split by query head (head_split); head_split_per_sm 0: never.
    head_split_per_sm: float = 3.0
    head_split_min_seq: int = 256
    head_split_one_wave: bool = True  # also below head_split_min_seq where the split grid fits one wave


@dataclass(frozen=True, kw_only=True)
class Config:
    pack: PackConfig = PackConfig(tile=64, block=8192, iters=1, warps=4)  # tile: the Wo^T tiles' side
    # bn: one head per tile (the norm is per head). Our products (below cublas_min_flop, products="triton",
    # the interpreter): 64-row tiles at 4 warps, so that 128 tokens still give 128 programs, not 64.
    forward: TileConfig = TileConfig(bm=64, bn=OFFICIAL.head_dim, bk=64, warps=4, stages=4)
    # The forward's tiles where its programs at these tiles fit one wave at one program per SM (128
    # tokens: 128 programs): a deeper ring (144 KB) keeps more of each program's weight slab in
    # flight, which a second program per SM cannot then (notes/037.md row 33). None: never.
    forward_one_wave: TileConfig | None = TileConfig(bm=64, bn=OFFICIAL.head_dim, bk=64, warps=4, stages=6)
    # The forward launch when cuBLAS made the projections and it only norms and rotates: a pass over
    # memory, so small tiles and few registers (71 at 32 rows, 4 warps) for many programs per SM.
    norm_rope: TileConfig = TileConfig(bm=32, bn=OFFICIAL.head_dim, bk=64, warps=4, stages=1)
    attention: AttentionConfig = AttentionConfig()
    gradients: TileConfig = TileConfig(bm=128, bn=128, bk=32, warps=4, stages=6)
    sums: SumConfig = SumConfig(rows=256, cols=16)  # the norm-weight gradients from their partial rows
    pdl: bool = True  # launches after the first as programmatic dependent launches (GPU only)
    # Independent cuBLAS products on concurrent streams, as branches of the call's graph: the copies of
    # grad_output and Wo and dA beside the other copies, [q | k | v] and its norms (Plan.pack_parts);
    # grad_Wo beside the attention backward and the products of G, which run beside each other (GPU
    # only; kernels/branches.py). The cuBLAS cases gain 1-8 % (notes/037.md rows 37, 39).
    branches: bool = True
    # From this much gradient-product work (FLOP) on, the products go to cuBLAS: on every length. As
    # one CUDA graph with branches, the cuBLAS path beats our five launches at 128 and 256 tokens too
    # (132.6 -> 128.2 us, 175.2 -> 162.5; notes/037.md row 37; row 36 had set 30 GFLOP without branches,
    # row 29 60 GFLOP for launches one by one). Our products remain the interpreter's path.
    cublas_min_flop: float = 0.0


CONFIG = Config()
# The Triton interpreter's cost is per program and per operation, not per FLOP: few, large tiles.
INTERPRETER_CONFIG = Config(
    pack=PackConfig(tile=1024, block=1 << 20, iters=1, warps=4),
    forward=TileConfig(bm=128, bn=OFFICIAL.head_dim, bk=1024, warps=4, stages=1), forward_one_wave=None,
    norm_rope=TileConfig(bm=128, bn=OFFICIAL.head_dim, bk=1024, warps=4, stages=1),
    attention=AttentionConfig(fwd_bm=32, fwd_bn=16, fwd_warps=4, fwd_stages=1, kv_bn=32, kv_bm=16, q_bm=32, q_bn=16,
                              warps=4, stages=1, approx_tanh=False, short_fwd_bn=16),
    gradients=TileConfig(bm=1024, bn=1024, bk=256, warps=4, stages=1), pdl=False)


def forward_keys(at: AttentionConfig, seq: int) -> int:
    """Keys per attention-forward step: short_fwd_bn up to short_seq tokens (loops of at most four
    steps, half of them on the diagonal, where narrower steps compute fewer masked logits), else fwd_bn."""
    return at.short_fwd_bn if seq <= at.short_seq else at.fwd_bn


def key_block(at: AttentionConfig, sizes: Gemma3CoreConfig, batch: int, seq: int, sms: int) -> int:
    """Keys per dK/dV program: few_kv_bn when kv_bn-key programs would not fill the GPU once (batch
    1-4 at short sequences): twice the programs, each half as long on the launch's critical path."""
    return at.few_kv_bn if batch * sizes.kv_heads * cdiv(seq, at.kv_bn) <= sms else at.kv_bn


def head_split(at: AttentionConfig, sizes: Gemma3CoreConfig, kv_slots: int, seq: int, sms: int) -> int:
    """dK/dV programs per key block: one per query head of the group (summed by the last of them)
    while the split grid has at most head_split_per_sm programs per SM, from head_split_min_seq
    tokens: at batch 1 the first key blocks' programs (three heads times every later query) are the
    launch's critical path (benchmarks/notes/037.md row 27). Shorter sequences split only where the
    split grid still fits one wave (head_split_one_wave; row 34: 128 tokens at batch 1, while at
    batch 4 three programs per SM lose). Else 1."""
    programs = kv_slots * sizes.group
    if not at.head_split_per_sm:
        return 1
    if at.head_split_one_wave and programs <= sms:
        return sizes.group
    return sizes.group if programs <= at.head_split_per_sm * sms and seq >= at.head_split_min_seq else 1


@dataclass(frozen=True)
class Plan:
    """Every launch of one 037 call (grids in programs), and each launch's runtime scalars by the
    kernel's parameter names (`*_arguments`: the launcher passes them by name)."""

    batch: int
    seq: int
    sizes: Gemma3CoreConfig  # the operator's (the benchmark operator's: the plan refuses others)
    products: str  # "triton" (our tiles) or "cublas" (the forward and gradient products)
    pdl: bool
    branches: bool  # Config.branches on a GPU
    pack: Layout
    # (first program, programs) of each pack launch: the whole layout, or with branches on the cuBLAS path
    # two launches, grad_output and Wo^T (beside the rest, before dA), then the rest (before [q | k | v])
    pack_parts: tuple
    forward: TileConfig  # the forward launch's tiles: `Config.forward` (`forward_one_wave` where it fits one
    # wave), or `norm_rope` on cuBLAS
    forward_programs: int
    forward_bounds: tuple  # the forward launch's programs [start, end) of [q | k | v] and (our products only) dA
    attention_forward_programs: int
    attention_forward_keys: int  # keys per step
    kv_bn: int  # keys per dK/dV program
    head_split: int  # dK/dV programs per key block
    kv_slots: int  # (batch, KV head, key block)s
    q_programs: int  # dQ programs
    sum_programs: int  # the gradient launch's last programs, which sum the norm-weight partials
    splits: tuple  # K splits of grad_hidden, grad_[Wq; Wk; Wv], grad_Wo (0: skipped or on cuBLAS)
    gradient_bounds: tuple  # programs [start, end) of grad_hidden, grad_[Wq; Wk; Wv], grad_Wo (GRADIENT_ORDER)
    gradient_programs: int  # our gradient products' tiles, then the sums
    wanted: tuple  # whether grad_hidden, grad_[Wq; Wk; Wv], grad_Wo are needed (cuBLAS runs those)
    ranges: tuple  # Regions of the pack, forward, attention forward and attention backward launches

    @property
    def kv_programs(self) -> int:
        return self.kv_slots * self.head_split

    @property
    def sums_start(self) -> int:
        """The gradient launch's first program that sums the norm-weight partials: after every tile."""
        return max(end for _, end in self.gradient_bounds)

    @property
    def attention_backward_programs(self) -> int:
        """dK/dV programs, then dQ programs."""
        return self.kv_programs + self.q_programs

    @property
    def arrivals(self) -> int:
        """Arrival counters of split dK/dV programs, one per key block (none unsplit)."""
        return self.kv_slots if self.head_split > 1 else 0

    @property
    def done(self) -> int:
        """The counter slot after the arrivals: every dK/dV and dQ program adds 1 once its G rows and
        norm-weight partial row are stored; the sums, and with PDL the gradient tiles that read G,
        wait for kv_programs + q_programs."""
        return self.arrivals

    @property
    def counters(self) -> int:
        """The attention backward's int32 counters (arrivals, then done), zeroed by the pack."""
        return self.arrivals + 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def pack_arguments(self) -> dict:
        return dict(T=self.tokens, n_counters=self.counters, **self.pack.end_arguments)

    def forward_arguments(self, scaling: float, cap: float, eps: float) -> dict:
        """cap: |softcap| (cap tanh(z / cap) depends on |cap| only; the kernels take cap > 0)."""
        return dict(T=self.tokens, end_qkv=self.forward_bounds[0][1], eps=float(eps), q_scale=float(scaling) / cap)

    def attention_forward_arguments(self, cap: float) -> dict:
        return dict(S=self.seq, cap=cap)

    def attention_backward_arguments(self, scaling: float, cap: float, eps: float) -> dict:
        r_v, r_dk, r_dv, r_dq = self.ranges[3].bases
        return dict(S=self.seq, kv_programs=self.kv_programs, done=self.done, r_v=r_v, r_dk=r_dk, r_dv=r_dv, r_dq=r_dq,
                    scaling=float(scaling), cap=cap, eps=float(eps))

    def gradient_arguments(self) -> dict:
        split_gx, split_wqkv, split_wo = self.splits
        (start_gx, end_gx), (start_wqkv, end_wqkv), (start_wo, end_wo) = self.gradient_bounds
        return dict(T=self.tokens, split_gx=split_gx, split_wqkv=split_wqkv, split_wo=split_wo, start_gx=start_gx,
                    end_gx=end_gx, start_wqkv=start_wqkv, end_wqkv=end_wqkv, start_wo=start_wo, end_wo=end_wo,
                    sums_start=self.sums_start, done=self.done, n_done=self.attention_backward_programs,
                    n_q_parts=self.q_programs, n_k_parts=self.kv_slots)

    @property
    def qk_width(self) -> int:
        """Row width of the fp32 projections buffer: [q | k] after our products (v goes to fp16
        directly), [q | k | v] after cuBLAS's (one product writes all three; launch 2 copies v to fp16)."""
        return self.sizes.qkv if self.products == "cublas" else self.sizes.qk


def gradient_shapes(sizes: Gemma3CoreConfig, tokens: int) -> list:
    """(M, N, K) of grad_hidden, grad_[Wq; Wk; Wv], grad_Wo."""
    hidden, qkv = sizes.hidden, sizes.qkv
    return [(tokens, hidden, qkv), (qkv, hidden, tokens), (sizes.q_out, hidden, tokens)]


# The gradient launch's programs take the products' tiles in this order (indices into
# gradient_shapes): grad_Wo first, since it reads only what earlier launches wrote (A, grad_output),
# so with PDL its tiles run on the SMs the attention backward leaves idle while the tiles that read
# G wait for it; then grad_hidden, grad_[Wq; Wk; Wv].
GRADIENT_ORDER = (2, 0, 1)


def pack_layout(cfg: Config, sizes: Gemma3CoreConfig, tokens: int, splits, counters: int) -> Layout:
    """The pack's programs: the cast of grad_output and the Wo^T tiles (what dA reads), flat casts of
    X, Wq, Wk, Wv (what [q | k | v] reads; those converting), then zero fills of split-K outputs and
    of the attention backward's counters. With branches the two parts run as two launches
    (`Plan.pack_parts`), each before the products that read it."""
    pk = cfg.pack

    def flat(n):
        return chunks(n, pk.block, pk.iters)

    split_gx, split_wqkv, split_wo = (s > 1 for s in splits)
    hidden, q_out, kv_out = sizes.hidden, sizes.q_out, sizes.kv_out
    return Layout((
        Segment("grad_output", flat(tokens * hidden), holds=Holds.UPSTREAM, end="e_go"),
        Segment("o_weight", (hidden // pk.tile) * (q_out // pk.tile), end="e_wo"),
        Segment("hidden_states", flat(tokens * hidden), end="e_x"),
        Segment("q_weight", flat(q_out * hidden), end="e_wq"),
        Segment("k_weight", flat(kv_out * hidden), end="e_wk"),
        Segment("v_weight", flat(kv_out * hidden), end="e_wv"),
        Segment("zero grad_hidden_states", split_gx * flat(tokens * hidden), ranged=False, end="e_gx"),
        Segment("zero grad_[q; k; v]_weight", split_wqkv * flat(sizes.qkv * hidden), ranged=False, end="e_zwqkv"),
        Segment("zero grad_o_weight", split_wo * flat(q_out * hidden), ranged=False, end="e_zwo"),
        Segment("zero attention counters", flat(counters), ranged=False),
    ))


def forward_tiles(sizes: Gemma3CoreConfig, tokens: int, t: TileConfig) -> int:
    """The forward launch's programs with our products at tiles t: [q | k | v], then dA."""
    return tile_count(tokens, sizes.qkv, 1, t.bm, t.bn) + tile_count(tokens, sizes.q_out, 1, t.bm, t.bn)


def plan(cfg: Config, axes, sms: int, *, sizes: Gemma3CoreConfig = OFFICIAL, gpu: bool = True,
         products: str | None = None, needs=None, deterministic: bool = False) -> Plan:
    """The launches of one call at `axes` on `sms` processors.

    sizes: the operator's (its `Problem.config`); the kernels are made for the benchmark operator's
    (`spec.OFFICIAL`), and other sizes are refused (a ValueError naming them).

    needs: one bool per output (None: all); grad_hidden's product, the three projection weights'
    product and grad_Wo's product are skipped when nobody needs them. deterministic: no K splits
    (nothing else uses atomics). products: "triton", "cublas", or None (by size on a GPU:
    `cublas_min_flop` of gradient-product work).
    """
    check_sizes("037 plan", sizes, OFFICIAL)
    widths = [t.bn for t in (cfg.forward, cfg.forward_one_wave, cfg.norm_rope) if t is not None]
    if any(w != sizes.head_dim for w in widths):
        raise ValueError(f"037 forward launch: tile width must be one head ({sizes.head_dim}), got {widths}")
    if gpu:
        check_rings("037 Config", dict(forward=cfg.forward, forward_one_wave=cfg.forward_one_wave,
                                       norm_rope=cfg.norm_rope, gradients=cfg.gradients))
    batch, seq = axes["batch_size"], axes["seq_len"]
    tokens = batch * seq
    at, gr = cfg.attention, cfg.gradients
    gemms = gradient_shapes(sizes, tokens)
    backend = choose_products(products, 2 * sum(m * n * k for m, n, k in gemms), cfg.cublas_min_flop, gpu)
    on_cublas = backend == "cublas"
    needs = needs or (True,) * 7
    wanted = (needs[0], any(needs[1:4]), needs[4])
    if on_cublas:
        splits = [0] * 3
    else:
        splits = [1] * 3 if deterministic else choose_splits(gemms, gr.bm, gr.bn, gr.bk, sms)
        splits = [s * w for s, w in zip(splits, wanted)]  # 0: skipped
    sum_programs = 2 * sizes.head_dim // cfg.sums.cols  # the q and k norm weights' columns in strips
    gradient_bounds, at_tile = [None] * 3, 0
    for g in GRADIENT_ORDER:
        (m, n, _), s = gemms[g], splits[g]
        gradient_bounds[g] = (at_tile, at_tile + tile_count(m, n, s, gr.bm, gr.bn))
        at_tile = gradient_bounds[g][1]

    kv_bn = key_block(at, sizes, batch, seq, sms)
    kv_slots = batch * sizes.kv_heads * cdiv(seq, kv_bn)  # one per (batch, KV head, key block)
    split = head_split(at, sizes, kv_slots, seq, sms)
    q_programs = batch * sizes.heads * cdiv(seq, at.q_bm)
    fw = cfg.norm_rope if on_cublas else cfg.forward
    deep = cfg.forward_one_wave
    if not on_cublas and deep is not None and forward_tiles(sizes, tokens, deep) <= sms:
        fw = deep
    row_blocks = cdiv(tokens, fw.bm)
    qkv_tiles = tile_count(tokens, sizes.qkv, 1, fw.bm, fw.bn)
    forward_bounds = ((0, qkv_tiles), (qkv_tiles, qkv_tiles + (not on_cublas) * tile_count(tokens, sizes.q_out, 1, fw.bm, fw.bn)))
    forward_programs = forward_bounds[1][1]
    attention_forward_programs = batch * sizes.heads * cdiv(seq, at.fwd_bm)
    pack = pack_layout(cfg, sizes, tokens, splits, (kv_slots if split > 1 else 0) + 1)
    branches = cfg.branches and gpu
    pack_parts = ((0, pack.programs),)
    if on_cublas and branches:
        d_attn_side = pack.end_of("o_weight")
        pack_parts = ((0, d_attn_side), (d_attn_side, pack.programs - d_attn_side))
    vanishing = Holds.VANISHING
    ranges = (
        pack.regions,
        Regions((Region("normed, rotated q", sizes.heads * row_blocks),
                 Region("normed, rotated k", sizes.kv_heads * row_blocks))),
        Regions((Region("gradient of attention output", attention_forward_programs, Holds.GRADIENT),)),
        Regions((Region("v projection", kv_slots), Region("gradient of k projection", kv_slots, vanishing),
                 Region("gradient of v projection", kv_slots, vanishing),
                 Region("gradient of q projection", q_programs, vanishing))),
    )
    return Plan(batch=batch, seq=seq, sizes=sizes, products=backend, pdl=cfg.pdl and gpu, branches=branches, pack=pack,
                pack_parts=pack_parts, forward=fw,
                forward_programs=forward_programs,
                forward_bounds=forward_bounds,
                attention_forward_programs=attention_forward_programs, attention_forward_keys=forward_keys(at, seq),
                kv_bn=kv_bn, head_split=split, kv_slots=kv_slots, q_programs=q_programs, sum_programs=sum_programs,
                splits=tuple(splits), gradient_bounds=tuple(gradient_bounds), gradient_programs=at_tile + sum_programs,
                wanted=wanted, ranges=ranges)
