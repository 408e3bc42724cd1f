"""Launch plans, checked without launching: every official case of every operator, on an H200's
132 processors, plans as the notes describe; pack layouts consistent; the shared schedule helpers."""

import dataclasses
import inspect

import pytest

import backfuse
from backfuse.kernels.schedule import Holds, Layout, Segment, choose_products, longest_first
from backfuse.ops.gemma3_core import config as gemma3_core
from backfuse.ops.qkv_gqa import config as qkv_gqa
from backfuse.ops.wan_xattn import config as wan_xattn

SMS = 132
CONFIGS = {"072": qkv_gqa, "037": gemma3_core, "021": wan_xattn}


def _plans(pid, **options):
    module = CONFIGS[pid]
    return [module.plan(module.CONFIG, w.axes, SMS, **options) for w in backfuse.problem(pid).workloads]


def _cases(plans, test):
    return [i for i, p in enumerate(plans) if test(p)]


@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_pack_layouts_are_consistent(pid):
    for p in _plans(pid) + _plans(pid, deterministic=True) + _plans(pid, products="cublas"):
        ends = p.pack.ends
        assert ends[-1] == p.pack.programs and list(ends) == sorted(ends)
        ranged = [s for s in p.pack.segments if s.ranged]
        assert dict(p.pack.regions.counts) == {s.name: s.programs for s in ranged}
        assert p.ranges[0] == p.pack.regions


@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_pack_kernel_takes_the_segment_ends_in_the_plans_order(pid):
    """The launcher passes `ends[:-1]` in order; each pack kernel's parameters from the first end on
    must be the plan's `end_parameters`, so that reordering segments in one and not the other fails
    here, not silently on a GPU. (The kernels' segment chains test `pid < e_*` in that order.)"""
    from backfuse.ops.gemma3_core.triton_kernels import pack_kernel as pack_037
    from backfuse.ops.qkv_gqa.triton_kernels import pack_kernel as pack_072
    from backfuse.ops.wan_xattn.triton_kernels import pack_kernel as pack_021

    kernel = {"072": pack_072, "037": pack_037, "021": pack_021}[pid]
    names = list(kernel.arg_names)
    signature = inspect.signature(getattr(kernel, "fn", kernel))  # the Python function (JIT or interpreter)
    for p in _plans(pid) + _plans(pid, deterministic=True):
        if p.pack is None:  # 072 on its Gluon path packs inside the product launch
            continue
        ends = p.pack.end_parameters
        first = names.index(ends[0])
        assert tuple(names[first:first + len(ends)]) == ends
        after = signature.parameters[names[first + len(ends)]].annotation
        assert "constexpr" in str(after), "the kernel has an end parameter the plan does not fill"


def test_gluon_kernel_takes_the_pack_lists_ends_in_the_plans_order():
    """072's one-launch kernel reads its pack item list's segment ends (the plan's
    `gluon_pack_items`) by these parameters, in this order, then the list's length."""
    from backfuse.ops.qkv_gqa.gluon_kernels import fused_kernel

    names = list(fused_kernel.arg_names)
    p = _plans("072", products="gluon")[4]
    ends = p.gluon.items.end_parameters
    first = names.index(ends[0])
    assert tuple(names[first:first + len(ends) + 1]) == ends + ("pack_items",)
    assert p.gluon_arguments()["pack_items"] == p.gluon.items.programs


def test_tile_shapes_are_checked_before_anything_launches():
    """A tile side that is no power of two, a warp count a launch cannot take, or (on a GPU) an
    operand ring larger than a program's shared memory is refused by name, on any machine; the
    interpreter's large tiles stay allowed off the GPU."""
    from backfuse.kernels.config import SM90_SHARED_BYTES, TileConfig

    for field, value in (("bk", 48), ("bm", 8), ("bn", 96)):
        with pytest.raises(ValueError, match=f"TileConfig.{field}: a power of two"):
            TileConfig(**{field: value})
    with pytest.raises(ValueError, match="TileConfig.warps"):
        TileConfig(warps=3)
    with pytest.raises(ValueError, match="TileConfig.stages"):
        TileConfig(stages=0)
    assert TileConfig(bm=128, bn=256, bk=64, stages=3).ring_bytes == 3 * (128 + 256) * 64 * 2
    too_deep = TileConfig(bm=128, bn=256, bk=64, warps=8, stages=5)
    assert too_deep.ring_bytes > SM90_SHARED_BYTES
    for pid, field in (("021", "forward"), ("037", "gradients"), ("072", "tiles")):
        module, axes = CONFIGS[pid], backfuse.problem(pid).workloads[0].axes
        cfg = dataclasses.replace(module.CONFIG, **{field: too_deep})
        with pytest.raises(ValueError, match=rf"{pid} Config\.{field}: 5 stages of 128 x 256 x 64"):
            module.plan(cfg, axes, SMS, gpu=True)
        module.plan(cfg, axes, SMS, gpu=False)  # the interpreter has no shared-memory limit
        module.plan(module.INTERPRETER_CONFIG, axes, 4, gpu=False)


def test_layout_refuses_unnamed_or_repeated_ends():
    with pytest.raises(ValueError, match="distinct end"):
        Layout((Segment("a", 1, end="e_a"), Segment("b", 1), Segment("c", 1)))
    with pytest.raises(ValueError, match="distinct end"):
        Layout((Segment("a", 1, end="e_a"), Segment("b", 1, end="e_a"), Segment("c", 1)))
    with pytest.raises(ValueError, match="distinct end"):
        Layout((Segment("a", 1, end="e_a"), Segment("b", 1, end="e_b")))
    assert Layout((Segment("a", 1, end="e_a"), Segment("b", 2))).end_parameters == ("e_a",)


# The fp16-range regions whose tensors are linear in the upstream gradients, and what each holds: when
# only these are out of range, Problem.backward scales the upstream gradients by a power of two instead
# of falling back to fp32 (a region given another Holds would silently change that: hence the lists).
U, G, V = Holds.UPSTREAM, Holds.GRADIENT, Holds.VANISHING
LINEAR_REGIONS = {
    "072": {"grad_query_states": U, "grad_key_states (head-group sums)": U, "grad_value_states (head-group sums)": U},
    "037": {"grad_output": U, "gradient of attention output": G, "gradient of k projection": V,
            "gradient of v projection": V, "gradient of q projection": V},
    "021": {"grad_output": U, "gradient of attention context": G, "gradient of queries": V,
            "gradient of keys": V, "gradient of values": V},
}


@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_regions_linear_in_the_upstream_gradients(pid):
    """{region: what it holds} for every region that scales with the upstream gradients."""
    plans = _plans(pid) + _plans(pid, products="cublas") + (_plans(pid, products="gluon") if pid == "072" else [])
    for p in plans:
        regions = [r for block in p.ranges for r in block.regions]
        assert {r.name: r.holds for r in regions if r.holds.linear} == LINEAR_REGIONS[pid]


def test_product_backends_follow_the_notes():
    """072: cuBLAS from 100 GFLOP (8 Triton cases, 072.md row 21); launched as one CUDA graph, 037
    on every case (with its products as branches, 037.md row 37) and 021 from 35 GFLOP (cases 0, 5,
    10, 15; 021.md row 42). No cuBLAS without a GPU."""
    assert _cases(_plans("072"), lambda p: p.products == "triton") == [1, 2, 3, 4, 5, 12, 13, 15]
    # on Hopper: cuBLAS below the Gluon kernel's window too, its products beside each other below 30 GFLOP
    # (072.md row 34); one after another from the window's top (row 32)
    hopper = _plans("072", gluon=True)
    assert _cases(hopper, lambda p: p.products == "cublas") == [0, 1, 3, 6, 7, 9, 12, 13]
    assert _cases(hopper, lambda p: p.branches) == [1, 3, 12, 13]
    assert _cases(_plans("037"), lambda p: p.products == "triton") == []
    assert _cases(_plans("021"), lambda p: p.products == "cublas") == [0, 5, 10, 15]
    for pid in CONFIGS:
        assert all(p.products == "triton" for p in _plans(pid, gpu=False))
    with pytest.raises(ValueError, match="'triton', 'cublas' or 'gluon'"):
        choose_products("cutlass", 0, 0, True)


def test_gemma3_core_attention_rules():
    """32-key dK/dV programs where 64-key ones would not fill the GPU once (037.md row 25: cases 0,
    3, 8, 9, 11, 14, 15); programs split by query head at batch 1 from 256 tokens (row 27: cases 9,
    11), and below where the split grid fits one wave (row 34: case 8's 96 programs)."""
    plans = _plans("037")
    assert _cases(plans, lambda p: p.kv_bn == 32) == [0, 3, 8, 9, 11, 14, 15]
    assert _cases(plans, lambda p: p.head_split == 3) == [8, 9, 11]
    assert plans[8].kv_slots * 3 <= SMS < plans[0].kv_slots * 3
    assert all(p.attention_forward_keys == (32 if w.axes["seq_len"] <= 256 else 64)
               for p, w in zip(plans, backfuse.problem("037").workloads))
    # the cuBLAS path's forward launch only norms and rotates, with its own tiles; our products take
    # the deep ring where their programs fit one wave (128 tokens: 128 programs; 037.md row 33)
    cfg = gemma3_core.CONFIG
    assert all(p.forward == cfg.norm_rope for p in plans)
    ours = _plans("037", products="triton")
    assert _cases(ours, lambda p: p.forward == cfg.forward_one_wave) == [8]
    assert all(p.forward == cfg.forward for i, p in enumerate(ours) if i != 8)
    assert ours[8].forward_programs == 128 <= SMS
    one_wave = dict(batch_size=1, seq_len=128)
    assert gemma3_core.plan(cfg, one_wave, 127, products="triton").forward == cfg.forward  # not one wave


def test_gemma3_core_pack_parts():
    """One pack launch, or with branches on the cuBLAS path two: grad_output and Wo^T (what dA reads),
    then the rest, together every program of the layout once."""
    for p in _plans("037") + _plans("037", products="triton") + _plans("037", gpu=False):
        if p.products == "cublas" and p.branches:
            (first_a, n_a), (first_b, n_b) = p.pack_parts
            assert first_a == 0 and first_b == n_a == p.pack.end_of("o_weight") and first_b + n_b == p.pack.programs
        else:
            assert p.pack_parts == ((0, p.pack.programs),)
    assert all(len(p.pack_parts) == 2 for p in _plans("037"))


def test_wan_xattn_attention_rules():
    """Lone blocks where a head's 128 video tokens fit one block (cases 0 and 15, 021.md row 22); the
    77-token text as 64 + 16 (row 20); long text in tiles of 128; one run per head where it fills the GPU."""
    plans = _plans("021")
    assert _cases(plans, lambda p: p.block_rows == 64) == [0, 15]
    assert all((p.text_tile, p.text_tail) == ((64, 16) if w.axes["num_text_tokens"] == 77 else (128, 0))
               for p, w in zip(plans, backfuse.problem("021").workloads))
    assert all(p.one_tile == (w.axes["num_text_tokens"] <= 128) for p, w in zip(plans, backfuse.problem("021").workloads))
    assert all(p.runs * p.per_program >= -(-w.axes["num_video_tokens"] // p.block_rows)
               for p, w in zip(plans, backfuse.problem("021").workloads))
    small = _cases(plans, lambda p: p.forward == wan_xattn.CONFIG.forward_small)
    assert small and all(p.forward_programs <= SMS for p in plans)


def test_wan_xattn_attention_counters_and_hand_off():
    """The attention's counters: one per head, then `done` (target: every program) and `kv_done`
    (target: every head), zeroed by the pack; the last run's dK/dV hand-off in one step of text rows
    where the text is one tile (021.md row 38)."""
    for p, w in zip(_plans("021") + _plans("021", deterministic=True), backfuse.problem("021").workloads * 2):
        c = p.counters
        assert (c.heads, c.programs) == (w.axes["batch_size"] * 16, p.attention_programs)
        assert (c.done, c.kv_done, c.total) == (c.heads, c.heads + 1, c.heads + 2)
        assert p.finish_rows == (128 if p.one_tile else wan_xattn.CONFIG.attention.bn)
        assert p.pack.size("zero attention counters") == 1


@pytest.mark.parametrize("nt, tiles", [(1, (16, 0)), (19, (32, 0)), (33, (32, 16)), (77, (64, 16)), (100, (128, 0))])
def test_text_tiles_pad_least(nt, tiles):
    assert wan_xattn.text_tiles(nt) == tiles
    assert wan_xattn.text_tiles(nt, split=False) == (max(16, 1 << (nt - 1).bit_length()), 0)


@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_deterministic_plans_do_not_split(pid):
    for p in _plans(pid, deterministic=True):
        assert all(s <= 1 for s in p.splits)
        assert not any(s.programs for s in p.pack.segments if s.name.startswith("zero grad"))


def test_needs_skip_products():
    """072 without any weight gradient runs only the input-gradient tiles; 037 and 021 mark skipped
    products with 0 splits."""
    p = qkv_gqa.plan(qkv_gqa.CONFIG, backfuse.problem("072").workloads[3].axes, SMS,
                     needs=(True, True, False, False, False))
    assert p.tiles.input_grads and not p.tiles.weight_grads
    p = gemma3_core.plan(gemma3_core.CONFIG, dict(batch_size=1, seq_len=128), SMS, products="triton",
                         needs=(False, True, True, True, False, True, True))
    assert p.splits[0] == 0 and p.splits[2] == 0 and p.splits[1] > 0
    p = gemma3_core.plan(gemma3_core.CONFIG, dict(batch_size=1, seq_len=128), SMS,  # cuBLAS: the products wanted
                         needs=(False, True, True, True, False, True, True))
    assert p.products == "cublas" and p.wanted == (False, True, False)
    p = wan_xattn.plan(wan_xattn.CONFIG, dict(batch_size=2, num_video_tokens=256, num_text_tokens=77), SMS,
                       needs=(True, True) + (False,) * 8)
    assert p.splits[2:] == (0, 0, 0, 0) and all(p.splits[:2])


def test_interpreter_configs_are_keyword_built_variants():
    for module in CONFIGS.values():
        assert type(module.INTERPRETER_CONFIG) is type(module.CONFIG)
        assert not module.INTERPRETER_CONFIG.pdl and module.CONFIG.pdl
        with pytest.raises(dataclasses.FrozenInstanceError):
            module.CONFIG.pdl = False


def test_gemma3_core_forward_tiles_are_one_head():
    for field in ("forward", "forward_one_wave", "norm_rope"):
        cfg = dataclasses.replace(gemma3_core.CONFIG, **{field: dataclasses.replace(getattr(gemma3_core.CONFIG, field), bn=64)})
        with pytest.raises(ValueError, match="one head"):
            gemma3_core.plan(cfg, dict(batch_size=1, seq_len=8), SMS)


def test_layout_keeps_converting_segments_first():
    layout = Layout((Segment("a", 3), Segment("b", 0), Segment("c", 2), Segment("zero d", 4, ranged=False)))
    assert layout.ends == (3, 3, 5, 9) and layout.programs == 9 and layout.size("c") == 2
    assert layout.regions.counts == (("a", 3), ("b", 0), ("c", 2))
    with pytest.raises(ValueError, match="first"):
        Layout((Segment("zero d", 4, ranged=False), Segment("a", 3)))
    with pytest.raises(ValueError, match="differ"):
        Layout((Segment("a", 3), Segment("a", 1)))


def test_longest_first_orders_groups_by_tile_depth():
    groups = [(512, 1024, 1), (312, 2048, 1), (256, 8192, 2), (128, 4928, 1), (0, 77, 0)]
    bounds = longest_first(groups)
    assert [end - start for start, end in bounds] == [tiles for tiles, _, _ in groups]
    spans = sorted(bounds)
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
    assert [start for start, _ in bounds[:4]] == [696, 384, 128, 0]  # depths 1024, 2048, 4096, 4928: deepest first


def test_qkv_gqa_gluon_window():
    """On Hopper, 072's one-launch Gluon kernel from 30 to 200 GFLOP (cases 2, 4, 5, 8, 10, 11, 14, 15:
    gluon.md, 072.md rows 28, 34); none where the GPU does not run it; its range regions cover one slot per converting
    pack item (checked on every case, forced), and deterministic mode splits nothing."""
    assert _cases(_plans("072", gluon=True), lambda p: p.products == "gluon") == [2, 4, 5, 8, 10, 11, 14, 15]
    plans = _plans("072", products="gluon")
    assert not _cases(_plans("072"), lambda p: p.products == "gluon")
    for p, w in zip(plans, backfuse.problem("072").workloads):
        if p.products != "gluon":
            continue
        td = w.axes["batch_size"] * w.axes["seq_len_dec"]
        counts = dict(p.gluon.regions.counts)
        assert counts["grad_query_states"] == 16 * -(-td // 64) and counts["q_weight"] == 64 * 6
        c, te = p.gluon.counters, w.axes["batch_size"] * w.axes["seq_len_enc"]
        runs = [c.gq, c.dec, c.gkv, c.enc, c.total]  # consecutive runs after the fixed slots, one slot per 128 tokens
        assert c.gq == len(qkv_gqa.GLUON_FIXED_COUNTERS)
        assert [b - a for a, b in zip(runs, runs[1:])] == [-(-td // 128)] * 2 + [-(-te // 128)] * 2
        assert p.gluon.tiles >= p.gluon.starts[-1] >= p.gluon.starts[0] and p.pack is None
        assert p.ranges == (p.gluon.regions,)  # the one block `ops/fused.begin` reserves is the kernel's
        # the pack's item list: each converting segment has one range slot per item, in the regions
        sizes, ranged = dict(zip((seg.name for seg in p.gluon.items.segments),
                                 (b - a for a, b in zip((0,) + p.gluon.items.ends, p.gluon.items.ends)))), counts
        assert sizes["decoder side"] == ranged["grad_query_states"] + ranged["decoder_hidden_states"]
        assert sizes["encoder side"] == sum(ranged[name] for name in (
            "grad_key_states (head-group sums)", "grad_value_states (head-group sums)", "encoder_hidden_states"))
        assert sizes["Wq16"] == ranged["q_weight"] and sizes["[Wk; Wv]16"] == ranged["k_weight"] + ranged["v_weight"]
        zero_fills = [sizes[name] > 0 for name in ("zero grad_q_weight", "zero grad_[k; v]_weight",
                                                   "zero grad_decoder_hidden_states", "zero grad_encoder_hidden_states")]
        assert zero_fills == [s > 1 for s in p.splits]
    det = qkv_gqa.plan(qkv_gqa.CONFIG, backfuse.problem("072").workloads[4].axes, SMS, gluon=True, deterministic=True)
    assert det.products == "gluon" and det.splits == (1, 1, 1, 1)
    assert all(seg.programs == 0 for seg in det.gluon.items.segments[:4])  # nothing to zero without K splits
    frozen = qkv_gqa.plan(qkv_gqa.CONFIG, backfuse.problem("072").workloads[4].axes, SMS, gluon=True,
                          needs=(True, True, False, False, False))
    assert frozen.gluon.dec_chunks == frozen.gluon.enc_chunks == 0 and frozen.gluon.starts[0] == 0


def test_gluon_plan_refuses_a_ring_that_does_not_fit():
    """The one-launch kernel's ring plus the pack's slots must fit one program's shared memory: the
    default 4 stages take 192 KB; 6 would take 256. (A GluonConfig alone may describe other kernels,
    e.g. the SM-roles study's products without a pack: the plan checks it.)"""
    assert qkv_gqa.GluonConfig().shared_bytes == 4 * 32768 + 65536
    cfg = dataclasses.replace(qkv_gqa.CONFIG, gluon=qkv_gqa.GluonConfig(stages=6))
    axes = backfuse.problem("072").workloads[2].axes
    with pytest.raises(ValueError, match="6 stages of 128 x 128 x 64 beside the pack need 262144 bytes of shared memory"):
        qkv_gqa.plan(cfg, axes, SMS, products="gluon")


def _tile_partition(bounds, total):
    """The groups' [start, end) tile ranges cover [0, total) exactly, none overlapping."""
    spans = sorted(b for b in bounds if b[1] > b[0])
    assert all(start <= end for start, end in bounds)
    assert (spans[0][0] if spans else 0) == 0 and (spans[-1][1] if spans else 0) == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_product_launches_take_the_plans_tile_bounds():
    """The kernels read each product's programs [start, end) from the plan instead of recounting its
    tiles: the bounds must partition the launch's product programs and match the tile counts, with
    021's bias sums after them and its forward tiles laid out as its range regions are."""
    sizes = {pid: backfuse.problem(pid).config for pid in CONFIGS}
    for p, w in zip(_plans("072") + _plans("072", needs=[True, True, False, False, False]),
                    backfuse.problem("072").workloads * 2):
        if p.tiles is not None:
            t = qkv_gqa.CONFIG.tiles
            tiles = [qkv_gqa.tile_count(m, n, s, t.bm, t.bn)
                     for (m, n, _), s in zip(qkv_gqa.product_shapes(sizes["072"], w.axes), p.splits)]
            kept = [n * (p.tiles.weight_grads if i < 2 else p.tiles.input_grads) for i, n in enumerate(tiles)]
            assert [end - start for start, end in p.tiles.bounds] == kept
            _tile_partition(p.tiles.bounds, p.tiles.programs)
    for p, w in zip(_plans("021") + _plans("021", products="cublas"), backfuse.problem("021").workloads * 2):
        _tile_partition(p.bounds, p.sums_start)
        assert p.gradient_programs == p.sums_start + 3 * sizes["021"].hidden // wan_xattn.CONFIG.sums.cols
        (q0, q1), (kv0, kv1), (dc0, dc1) = p.forward_bounds
        assert q0 == 0 and q1 == kv0 and kv1 == dc0 and dc1 - dc0 == q1 - q0
        assert dc1 == wan_xattn.forward_tile_count(p.forward, sizes["021"],
                                                   w.axes["batch_size"] * w.axes["num_video_tokens"],
                                                   w.axes["batch_size"] * w.axes["num_text_tokens"])
        regions = p.ranges[1]
        bases = [regions.base(name) for name in wan_xattn.FORWARD_REGIONS]
        assert bases == [q0, kv0, dc0]  # one slot per tile, in the loop's order
        assert regions.base("values") == kv0 + (kv1 - kv0) // 2  # V's column tiles run on past K's
    for p, w in zip(_plans("037") + _plans("037", products="cublas"), backfuse.problem("037").workloads * 2):
        tokens = w.axes["batch_size"] * w.axes["seq_len"]
        g = gemma3_core.CONFIG.gradients
        tiles = [gemma3_core.tile_count(m, n, s, g.bm, g.bn)
                 for (m, n, _), s in zip(gemma3_core.gradient_shapes(sizes["037"], tokens), p.splits)]
        assert [end - start for start, end in p.gradient_bounds] == tiles
        order = gemma3_core.GRADIENT_ORDER  # grad_Wo's tiles first: they need not wait for the attention backward
        assert sorted(order) == [0, 1, 2] and order[0] == 2
        assert [p.gradient_bounds[g][0] for g in order] == [0, tiles[order[0]], tiles[order[0]] + tiles[order[1]]]
        assert p.sums_start == sum(tiles)
        assert p.sum_programs == 2 * sizes["037"].head_dim // gemma3_core.CONFIG.sums.cols
        assert p.gradient_programs == sum(tiles) + p.sum_programs  # the norm-weight sums after the tiles
        assert p.attention_backward_programs == p.kv_programs + p.q_programs
        assert p.done == p.arrivals and p.counters == p.arrivals + 1  # zeroed by the pack
        assert p.pack.size("zero attention counters") >= 1
        assert p.qk_width == (sizes["037"].qkv if p.products == "cublas" else sizes["037"].qk)
        (q0, q1), (a0, a1) = p.forward_bounds
        assert q0 == 0 and q1 == a0 == gemma3_core.tile_count(tokens, sizes["037"].qkv, 1, p.forward.bm, p.forward.bn)
        assert a1 == p.forward_programs and (a1 == a0) == (p.products == "cublas")


def test_plan_caches_are_bounded_and_a_recurring_shape_changes_plan_once(monkeypatch):
    """The plan cache keeps the PLANS_KEPT most recently looked up; `recurring` hands its later plan from the
    CUDNN_AFTER-th lookup on, and `replaced` tells a dropped plan from one made later at its address."""
    from backfuse.train import plans

    monkeypatch.setattr(plans, "PLANS_KEPT", 3)
    cache = plans.Plans()
    for i in range(4):
        cache[i] = f"plan {i}"
    cache.get(1)
    cache[4] = "plan 4"
    assert list(cache) == [3, 1, 4]

    monkeypatch.setattr(plans, "CUDNN_AFTER", 3)
    monkeypatch.setattr(plans, "_plans", plans.Plans())
    monkeypatch.setattr(plans, "_pending", plans.Plans())
    plans.recurring("first", "later")
    plans._plans["k"] = "first"
    assert [plans.looked_up("k", plans._plans.get("k")) for _ in range(4)] == ["first", "first", "later", "later"]
    assert plans._plans["k"] == "later" and "first" not in plans._pending


def test_a_template_reaims_a_calls_launches_at_another_calls_tensors(monkeypatch):
    """`Template`: a call's Triton launches and products, taken from one call, run at another call's tensors:
    each pointer at its base's new address plus the same offset, each product on views at the same offsets
    (an accumulation's output the same view as its addend); the template keeps none of the first call's
    tensors; overlapping tensors, foreign memory and other steps give no template."""
    import gc
    import weakref

    import torch

    from backfuse.kernels import launch as launching
    from backfuse.kernels.launch import Launch
    from backfuse.train import program

    for module in (program, launching):
        monkeypatch.setattr(module, "current_stream", lambda device: 0)
    seen = []

    def run(gx, gy, gz, stream, *rest):
        seen.append(rest)

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        x, w, m = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g), torch.randn(5, 5, generator=g)
        arena, out = torch.ones(2 * 256, dtype=torch.uint8), torch.zeros(4, 5)
        y = arena[256:256 + 80].view(torch.float32).view(4, 5)  # a view 256 bytes into the arena
        launches = [program.torch_step(torch.Tensor.zero_, arena[:64].view(torch.float32), label="zero"),
                    program.Product(torch.mm, (x, w), y, None, "torch.mm"),
                    Launch(run, (1, 1, 1), None, ("head",), [x.data_ptr(), y.data_ptr(), 7, 32], (x, y, 7), True),
                    program.Product(torch.addmm, (out, x, w), out, None, "torch.addmm (accumulate)"),
                    program.Product(torch.addmm, (out, y, m.T), out, None, "torch.addmm (accumulate)")]
        return (x, w, m, arena, out), launches, y

    tensors, launches, _ = call(0)
    for launch in launches:
        launch()
    template = program.Template.of(launches, tensors)
    assert isinstance(template, program.Template)
    alive = weakref.ref(tensors[3])
    del tensors, launches
    gc.collect()
    assert alive() is None

    tensors, _, y = call(1)
    x, w, m, arena, out = tensors
    seen.clear()
    template.run(tensors, tuple(t.data_ptr() for t in tensors))
    assert seen == [("head", x.data_ptr(), arena.data_ptr() + 256, 7, 32)]
    assert torch.allclose(y, x @ w) and torch.allclose(out, x @ w + (x @ w) @ m.T, atol=1e-5)
    assert not arena[:64].any() and arena[64:256].all()
    views = {}  # a call's views: y, written by one product and read by another, made once; the arena typed once
    for step in template.steps:
        step(tensors, tuple(t.data_ptr() for t in tensors), views)
    typed = [k for k in views if len(k) == 2]
    assert typed == [(3, torch.float32)] and sum(v.data_ptr() == y.data_ptr() and v.shape == y.shape
                                                 for k, v in views.items() if len(k) == 5) == 1

    x2 = torch.randn(4, 6)
    product = program.Product(torch.mm, (x2, w), out, None, "torch.mm")
    assert program.Template.of([product], (x2, x2[1:], w, out)) is program.NOT_YET  # overlapping tensors
    assert program.Template.of([product], (x, w, out)) is None  # memory outside the call's tensors
    dummy = program.constant(torch.zeros(8))
    ok = Launch(run, (1, 1, 1), None, (), [dummy.data_ptr()], (dummy,), True)
    assert isinstance(program.Template.of([ok], (x,)), program.Template)
    assert program.Template.of([lambda: None], (x,)) is None

    def compiling():
        pass

    compiling.graphable = False
    assert program.Template.of([compiling], (x,)) is program.NOT_YET
