"""The training paths' pieces: the attention kernels against float64 (grouped heads, causal, a window,
a soft cap, lengths no tile divides, split key blocks); each operator's forward and backward at sizes
other than the benchmark's, on poisoned buffers, in every input dtype, with and without saved
activations, and with gradients left out; the layouts of a call's buffers; and, on a GPU, a training
loop's graph replays with no host synchronization.
"""

import gc
import math
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import attention64, check_training_step, rel_err, training_call, training_float64, training_inputs, training_module

from backfuse.kernels import graphs
from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig
from backfuse.ops.qkv_gqa.spec import QkvGqaConfig
from backfuse.ops.wan_xattn.spec import WanXattnConfig
from backfuse.train import guard, steps
from backfuse.train.program import Arena, Buffer, Outputs, Phases, Stack

GPU = torch.cuda.is_available()
TOL = {torch.float32: 3e-3, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("batch, s_q, s_k, heads, group, d, cap, causal, window, dtype, split, dq_atomic", [
    (2, 37, 37, 4, 2, 32, 50.0, True, 0, torch.float16, 1, False),
    (1, 37, 37, 4, 2, 32, 0.0, True, 0, torch.bfloat16, 1, False),
    (1, 41, 41, 2, 1, 16, 0.0, True, 7, torch.float16, 1, False),
    (2, 29, 19, 2, 1, 64, 0.0, False, 0, torch.float16, 3, False),
    (1, 5, 3, 3, 3, 16, 20.0, False, 0, torch.bfloat16, 2, False),
    (1, 33, 33, 4, 4, 16, 50.0, True, 5, torch.float16, 2, False),
    (2, 37, 37, 4, 2, 32, 50.0, True, 9, torch.bfloat16, 1, True),
    (1, 29, 29, 2, 1, 16, 0.0, True, 0, torch.float16, 2, True),
])
def test_attention_kernels_match_float64(batch, s_q, s_k, heads, group, d, cap, causal, window, dtype, split,
                                         dq_atomic):
    """O and lse, then dQ, dK, dV (fp32 atomic sums when split; dQ from the key blocks' programs by fp32
    atomic sums when dq_atomic), against float64 autograd; unwritten elements would stay NaN."""
    torch.manual_seed(0)
    kv = heads // group
    q, k, v, do = (torch.randn(batch * s, w * d, device=DEVICE).to(dtype) for s, w in
                   ((s_q, heads), (s_k, kv), (s_k, kv), (s_q, heads)))
    a = steps.Attention(batch, s_q, s_k, heads, group, d, causal=causal, window=window, softcap=cap)
    tiles = steps.attention_tiles(d, GPU)
    scale = 1 / math.sqrt(d)
    nan = float("nan")
    o, lse, delta = torch.full_like(q, nan), torch.full((batch * heads, s_q), nan, device=DEVICE), torch.full(
        (batch * heads, s_q), nan, device=DEVICE)
    dq = torch.zeros(batch * s_q, heads * d, device=DEVICE) if dq_atomic else torch.full_like(q, nan)
    dk, dv = ((torch.zeros(batch * s_k, kv * d, device=DEVICE),) * 2 if split > 1 else
              (torch.full_like(k, nan), torch.full_like(v, nan)))
    dk, dv = dk.clone(), dv.clone()
    for launch in (*steps.attention_forward(a, tiles, q, k, v, o, lse, scale, None),
                   steps.attention_delta(a, o, do, delta, None),
                   *steps.attention_backward(a, tiles, split, q, k, v, do, lse, delta, dq, dk, dv, scale, None,
                                             dq_atomic=dq_atomic)):
        launch()
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention64(*exact, batch, heads, group, d, scale, cap, causal, window)
    ref.backward(do.double())
    tol = 3e-3 if dtype == torch.float16 else 3e-2
    assert rel_err(o, ref) < tol
    for got, x in zip((dq, dk, dv), exact):
        assert rel_err(got, x.grad) < tol


CASES = [  # pid, config, activations' sizes, softcap
    ("021", WanXattnConfig(64, 2), (2, 13, 7), None),
    ("021", WanXattnConfig(128, 1), (1, 19, 77), None),
    ("021", WanXattnConfig(64, 4, qk_norm=True), (2, 11, 5), None),
    ("072", QkvGqaConfig(48, 32, 4, 2, 16), (2, 5, 3), None),
    ("072", QkvGqaConfig(64, 64, 2, 2, 32), (1, 1, 37), None),
    ("037", Gemma3CoreConfig(64, 4, 2, 16), (2, 13), 50.0),
    ("037", Gemma3CoreConfig(64, 2, 1, 32, window=5), (1, 19), None),
    ("037", Gemma3CoreConfig(64, 4, 2, 16, window=6, qk_norm=False), (2, 11), 30.0),
    # Gemma 3's global layers (causal, no cap; a window the sequence fits in): cuDNN's attention on a GPU in bf16
    ("037", Gemma3CoreConfig(128, 4, 2, 64), (2, 37), None),
    ("037", Gemma3CoreConfig(96, 2, 1, 128, window=64), (1, 61), None),
]


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pid, config, sizes, softcap", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_training_paths_at_other_sizes(pid, config, sizes, softcap, dtype, save):
    """Forward and backward at sizes and features the benchmark does not have (GQA groups, head sizes,
    a sliding window, no soft cap, Wan's q/k norm, Gemma 2's missing QK norm, a single query), on
    poisoned buffers, against float64."""
    torch.manual_seed(1)
    m = training_module(pid, config, dtype, softcap)
    check_training_step(pid, m, training_inputs(pid, config, sizes, dtype), TOL[dtype], save)


@pytest.mark.skipif(not GPU, reason="the interpreter gives a row pass one program over all rows")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "plain"])
def test_training_paths_where_row_passes_split_their_rows(qk_norm, dtype):
    """Wan's training step at 18720 video tokens, where the GPU's row passes give each program a run of rows that is
    not a whole number of its steps (column sums: 293 rows, 32 a step; the norms' backward at width 128: 74 rows, 16
    a step): every gradient against float64. Before session 59 the bias gradients counted rows twice here, and the
    in-place norm backward wrote wrong rows of dQ."""
    torch.manual_seed(5)
    config = WanXattnConfig(128, 2, qk_norm=qk_norm)
    m = training_module("021", config, dtype)
    check_training_step("021", m, training_inputs("021", config, (1, 18720, 77), dtype), TOL[dtype])


@pytest.mark.skipif(DEVICE != "cuda", reason="cuDNN's attention runs on a GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cudnn_attention_serves_only_what_it_computes(head_dim, monkeypatch):
    """In bf16 on a GPU, Gemma 3's global layers take cuDNN's attention (here from a shape's first call),
    soft-capped, windowed and fp16-product calls ours; with `cudnn_attention(False)`, ours everywhere. Both
    right against float64."""
    from backfuse import cudnn_attention, functional
    from backfuse.train import plans

    monkeypatch.setattr(plans, "CUDNN_AFTER", 1)
    torch.manual_seed(4)
    for softcap, window, dtype, enabled, expected in ((None, 0, torch.bfloat16, True, True),
                                                      (None, 0, torch.bfloat16, False, False),
                                                      (50.0, 0, torch.bfloat16, True, False),
                                                      (None, 16, torch.bfloat16, True, False),
                                                      (None, 0, torch.float32, True, False)):
        cfg = Gemma3CoreConfig(2 * head_dim, 2, 1, head_dim, window=window)
        m = training_module("037", cfg, dtype, softcap)
        functional._plans.clear()
        with cudnn_attention(enabled):
            check_training_step("037", m, training_inputs("037", cfg, (2, 45), dtype), TOL[dtype])
        used = {p.cudnn for p in functional._plans.values() if hasattr(p, "cudnn")}
        assert used == {expected}, (softcap, window, dtype, enabled)


@pytest.mark.skipif(DEVICE != "cuda", reason="cuDNN's attention runs on a GPU")
def test_a_shape_takes_cudnn_attention_once_it_recurs(monkeypatch):
    """A shape's first CUDNN_AFTER - 1 calls run our attention (cuDNN's would build a plan for every new
    length), the later ones cuDNN's; each call's gradients right against float64."""
    from backfuse import functional
    from backfuse.train import plans

    monkeypatch.setattr(plans, "CUDNN_AFTER", 3)
    cfg = Gemma3CoreConfig(256, 2, 1, 128)
    m = training_module("037", cfg, torch.bfloat16, None)
    functional._plans.clear()
    used = []
    for seed in range(4):
        torch.manual_seed(seed)
        m.zero_grad(set_to_none=True)
        check_training_step("037", m, training_inputs("037", cfg, (2, 45), torch.bfloat16), TOL[torch.bfloat16])
        used.append([p.cudnn for k, p in functional._plans.items() if k[0] == "037"])
    assert used == [[False], [False], [True], [True]], used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemmas_normed_turned_queries_and_keys_are_made_again_not_saved(dtype):
    """qr and kr (q and k normed and turned) are not saved, by gemma3_core nor by gemma3_attention: the forward
    leaves them in its scratch and the backward norms and turns them again from the raw q and k (`Plan.turned_anew`),
    two tensors of q's and k's size fewer saved a call, and right against float64 all the same (the scratches start
    poisoned)."""
    from backfuse import functional

    config = Gemma3CoreConfig(256, 2, 1, 128)
    m = training_module("037", config, dtype)
    check_training_step("037", m, training_inputs("037", config, (2, 37), dtype), TOL[dtype])
    plans = [p for k, p in functional._plans.items() if k[0] == "037" and (p.batch, p.seq, p.io, p.save) == (2, 37, dtype, True)]
    assert plans and all(p.turned_anew for p in plans)
    x, cos, sin = training_inputs("037", config, (2, 37), dtype)
    q, k, v = (torch.nn.functional.linear(x, w) for w in (m.q_weight, m.k_weight, m.v_weight))
    a = functional.gemma3_attention(q, k, v, cos, sin, m.q_norm_weight, m.k_norm_weight, m.scaling, m.softcap, m.eps,
                                    head_dim=config.head_dim)
    a.backward(torch.randn_like(a))  # (right against gemma3_core: test_functional's attention between projections)
    plans += [p for k, p in functional._plans.items()
              if k[0] == "037 attention" and (p.batch, p.seq, p.io, p.save) == (2, 37, dtype, True)]
    assert len({type(p) for p in plans}) == 2
    for p in plans:
        assert not {"rot_q", "rot_k"} & {b.name for b in p.activations.specs}
        assert {"rot_q", "rot_k"} <= {b.name for b in p.backward_scratch.specs}
        assert {"rot_q", "rot_k"} <= {b.name for b in p.forward_scratch.specs}


@pytest.mark.parametrize("form", ["causal", "packed", "padding", "window"])
def test_lengths_a_few_tokens_apart_compile_nothing_new(form, monkeypatch):
    """Gemma's forward and backward at lengths 64, 65, 66, 67 (batch 2; packed: one row of three documents):
    every launch's specialization (`kernels/launch.py`: constexprs, dtypes, pointers' 16-byte alignment) is
    one the first length's launches had, so a loop of changing lengths compiles no kernel after its first
    call (s51: the bounds' rows B * S entries apart compiled the bounds and attention kernels again at the
    first odd length of a packed or masked loop). In the interpreter the launches are prepared and recorded, their
    programs not run: what is compared is each launch's arguments, which no kernel's result decides (the masks and
    documents are read on the device only); checked once: the same sets as with the programs run, every form."""
    from backfuse import functional as F
    from backfuse.kernels.launch import FastKernel, specialization

    seen = []
    prepare = FastKernel.prepare

    def recording(self, grid, *args, **meta):
        seen[-1].add((self.fn.__name__, specialization(args, meta)))
        launch = prepare(self, grid, *args, **meta)
        return launch if DEVICE == "cuda" else (lambda: None)

    monkeypatch.setattr(FastKernel, "prepare", recording)
    config = Gemma3CoreConfig(256, 2, 1, 128, window=16 if form == "window" else 0)
    m = training_module("037", config, torch.bfloat16)
    params = [m.q_weight, m.k_weight, m.v_weight, m.o_weight, m.q_norm_weight, m.k_norm_weight]
    for s in (64, 65, 66, 67):
        seen.append(set())
        b = 1 if form == "packed" else 2
        x, cos, sin = training_inputs("037", config, (b, s), torch.bfloat16)
        kw = {}
        if form == "packed":
            kw["cu_seqlens"] = torch.tensor([0, 20, 31, s], device=x.device, dtype=torch.int32)
        elif form == "padding":
            mask = torch.ones(b, s, dtype=torch.bool, device=x.device)
            mask[0, s - 5:] = False
            kw["attention_mask"] = mask
        out = F.gemma3_core(x, cos, sin, *params, m.scaling, m.softcap, m.eps, window=config.window,
                            head_dim=config.head_dim, **kw)
        out.backward(torch.randn_like(out))
        assert seen[-1] <= seen[0], (s, sorted(seen[-1] - seen[0], key=repr))
    assert len(seen[0]) >= 5  # the products aside, the norms', the bounds' and the attention's kernels


@pytest.mark.parametrize("form, dtype", [("037", torch.bfloat16), ("037 attention", torch.float32),
                                         ("021", torch.bfloat16), ("021", torch.float32),
                                         ("021 attention", torch.bfloat16), ("021 attention", torch.float32)], ids=str)
def test_a_length_across_the_split_compiles_nothing_new(form, dtype, monkeypatch):
    """Whether the attention backward splits its key blocks depends on the length (`steps.Attention.split`), and its
    binary on whether it does (KV_ATOMIC, fp32 sums, their zeroing and copies): a call compiles the other side's
    kernels too (`steps.compile_other_split`), so that a loop of lengths that cross from one side to the other
    compiles nothing in its midst (s54: the packed loop's first pass). Here even lengths split (2) and odd ones
    do not, both ways round (40 then 41, 43 then 42): every specialization the second call prepares is one the
    first prepared or compiled. In the interpreter nothing is compiled or run; the specializations are recorded."""
    from backfuse import functional as F
    from backfuse.kernels.launch import FastKernel, specialization
    from backfuse.ops.gemma3_core import training as gemma
    from backfuse.ops.wan_xattn import training as wan

    seen = []
    prepare, warm = FastKernel.prepare, FastKernel.warm

    def preparing(self, grid, *args, **meta):
        seen[-1].add((self.fn.__name__, specialization(args, meta)))
        launch = prepare(self, grid, *args, **meta)
        return launch if DEVICE == "cuda" else (lambda: None)

    def warming(self, grid, *args, **meta):
        seen[-1].add((self.fn.__name__, specialization(args, meta)))
        warm(self, grid, *args, **meta)

    gemma_form = form.startswith("037")
    plan = gemma.Plan if gemma_form else wan.Plan
    monkeypatch.setattr(FastKernel, "prepare", preparing)
    monkeypatch.setattr(FastKernel, "warm", warming)
    monkeypatch.setattr(plan, "split", property(lambda p: 2 if (p.seq if gemma_form else p.nv) % 2 == 0 else 1))
    monkeypatch.setattr(plan, "other_split", property(lambda p: 1 if p.split > 1 else 2))
    config = Gemma3CoreConfig(256, 2, 1, 128) if gemma_form else WanXattnConfig(64, 2, qk_norm=True)
    m = training_module(form[:3], config, dtype)
    for lengths in ((40, 41), (43, 42)):
        seen.clear()
        for n in lengths:
            seen.append(set())
            if form == "037":
                out = training_call("037", m, training_inputs("037", config, (1, n), dtype))
            elif form == "021":
                out = training_call("021", m, training_inputs("021", config, (1, n, 7), dtype))
            elif gemma_form:
                x, cos, sin = training_inputs("037", config, (1, n), dtype)
                q, k, v = (torch.nn.functional.linear(x, w) for w in (m.q_weight, m.k_weight, m.v_weight))
                out = F.gemma3_attention(q, k, v, cos, sin, m.q_norm_weight, m.k_norm_weight, m.scaling, m.softcap,
                                         m.eps, head_dim=config.head_dim)
            else:
                q = torch.randn(1, n, 64, device=DEVICE, dtype=dtype, requires_grad=True)
                k, v = (torch.randn(1, 7, 64, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
                out = F.wan_attention(q, k, v, m.norm_q_weight, m.norm_k_weight, 1 / math.sqrt(32), heads=2)
            out.backward(torch.randn_like(out))
        assert any(name == "attention_backward_kernel" for name, _ in seen[1])
        assert seen[1] <= seen[0], (lengths, sorted(seen[1] - seen[0], key=repr))


@pytest.mark.skipif(not GPU, reason="kernels compile on a GPU")
@pytest.mark.parametrize("pid, config, lengths", [
    ("037", Gemma3CoreConfig(192, 3, 1, 64), (256, 64)), ("037", Gemma3CoreConfig(320, 5, 1, 64), (64, 256)),
    ("021", WanXattnConfig(96, 3, qk_norm=True), (512, 64)), ("021", WanXattnConfig(160, 5, qk_norm=True), (64, 512))])
def test_a_length_across_the_split_compiles_nothing_on_the_gpu(pid, config, lengths):
    """The real plans and compiles: a length on one side of the split, then one on the other (batch 1, each way
    round, at widths no other test takes, so that no kernel is compiled before): Triton compiles (or loads from its
    cache) no kernel in the second call."""
    import triton

    from backfuse.ops.gemma3_core import training as gemma
    from backfuse.ops.wan_xattn import training as wan

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if pid == "037":
        splits = [gemma.Plan(1, n, config, torch.bfloat16, sms=sms).split for n in lengths]
    else:
        splits = [wan.Plan(1, n, 7, config, torch.bfloat16, sms=sms).split for n in lengths]
    assert (splits[0] > 1) != (splits[1] > 1), splits
    m = training_module(pid, config, torch.bfloat16)
    compiled, hook = [], triton.knobs.runtime.jit_post_compile_hook

    def seen(*args, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))
        return hook(*args, **kwargs) if hook is not None else None

    try:
        for n in lengths:
            compiled.clear()
            triton.knobs.runtime.jit_post_compile_hook = seen
            out = training_call(pid, m, training_inputs(pid, config, (1, n) if pid == "037" else (1, n, 7),
                                                        torch.bfloat16))
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            triton.knobs.runtime.jit_post_compile_hook = hook
            if n == lengths[0]:
                assert "attention_backward_kernel" in compiled  # (compiled here: the test can see a compile)
        assert compiled == [], (lengths, compiled)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = hook


@pytest.mark.parametrize("pid, config, shapes", [
    ("037", Gemma3CoreConfig(256, 2, 1, 128), [(2, 45), (1, 70), (2, 33)]),
    ("021", WanXattnConfig(64, 4, qk_norm=True), [(1, 40, 7), (2, 33, 13), (1, 19, 3)])])
def test_a_loop_of_changing_shapes_is_right_at_every_step(pid, config, shapes):
    """A training loop whose shapes change every step, each shape met three times: on a GPU its calls run
    directly, then from their key's template (an earlier call's launches re-aimed at this call's tensors),
    then where addresses recur as a recorded graph; every step's output and gradients against float64. On the CPU
    each call's launches run one by one (`program.execute`: no template, no graph), so two rounds meet every path
    there is: each shape's first call, and its plan kept and used again after the other shapes' calls."""
    m = training_module(pid, config, torch.bfloat16)
    inputs = {s: training_inputs(pid, config, s, torch.bfloat16) for s in shapes}
    for _ in range(3 if GPU else 2):
        for s in shapes:
            torch.manual_seed(len(s) + s[1])
            m.zero_grad(set_to_none=True)
            for a in inputs[s]:
                a.grad = None
            check_training_step(pid, m, inputs[s], TOL[torch.bfloat16])


@pytest.mark.skipif(not GPU, reason="synchronization exists on a GPU")
@pytest.mark.parametrize("pid, config, shapes", [
    ("037", Gemma3CoreConfig(256, 2, 1, 128), [(2, 45), (1, 70), (2, 33), (1, 90)]),
    ("021", WanXattnConfig(64, 4, qk_norm=True), [(1, 40, 7), (2, 33, 13), (1, 19, 3), (2, 50, 1)])])
def test_changing_shapes_never_synchronize(pid, config, shapes):
    """Shapes that change every step, after each was met once (so their calls run from templates, and a
    new shape's plan is made): no step makes the host wait for the GPU (set_sync_debug_mode("error") raises)."""
    m = training_module(pid, config, torch.bfloat16)
    inputs = {s: training_inputs(pid, config, s, torch.bfloat16) for s in shapes}
    grads = {s: torch.randn_like(inputs[s][0]) for s in shapes}

    def step(s):
        m.zero_grad(set_to_none=True)
        for a in inputs[s]:
            a.grad = None
        m(*inputs[s]).backward(grads[s])

    step(shapes[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in [*shapes[1:], *shapes]:
            step(s)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.skipif(not GPU, reason="synchronization exists on a GPU")
def test_packed_documents_of_changing_lengths_never_synchronize():
    """Packed rows whose documents change every step (`cu_seqlens` of other counts and lengths, other totals),
    after each was met once: no step makes the host wait for the GPU, and each step's output and input gradient
    are its first call's (the template at new addresses gives the kernels' own result; the backward's atomic
    sums may round in another order, so within 1e-2 where a stale template is off by ~1)."""
    from backfuse import functional as F

    config = Gemma3CoreConfig(256, 2, 1, 128)
    m = training_module("037", config, torch.bfloat16)
    params = [m.q_weight, m.k_weight, m.v_weight, m.o_weight, m.q_norm_weight, m.k_norm_weight]
    rows = [(5, 40), (13, 1, 29, 7), (61,), (3, 3, 30), (17, 20)]
    calls = {}
    for docs in rows:
        x, cos, sin = training_inputs("037", config, (1, sum(docs)), torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=x.device, dtype=torch.int32)
        calls[docs] = (x, cos, sin, cu, torch.randn(1, sum(docs), config.hidden, device=x.device, dtype=x.dtype))
    first = {}

    def step(docs):
        x, cos, sin, cu, grad = calls[docs]
        for t in (*params, x):
            t.grad = None
        out = F.gemma3_core(x, cos, sin, *params, m.scaling, m.softcap, m.eps, head_dim=config.head_dim,
                            cu_seqlens=cu)
        out.backward(grad)
        return out.detach().clone(), x.grad.clone()

    for docs in rows:
        first[docs] = step(docs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        later = [(docs, step(docs)) for docs in [*rows[1:], *rows]]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for docs, (out, grad) in later:
        assert rel_err(out, first[docs][0]) < 1e-2 and rel_err(grad, first[docs][1]) < 1e-2, docs


@pytest.mark.parametrize("pid, dtype", [("021", torch.bfloat16), ("021", torch.float16), ("021", torch.float32),
                                        ("037", torch.bfloat16)])
def test_split_key_blocks_in_the_training_ops(monkeypatch, pid, dtype):
    """dK and dV summed by atomics from split key blocks (in fp32, then copied: Wan's side by side where they are
    stacked), as a GPU's plans split them: the training step against float64 (the interpreter's plans never
    split by themselves)."""
    from backfuse.ops.gemma3_core import training as gemma
    from backfuse.ops.wan_xattn import training as wan

    monkeypatch.setattr((wan if pid == "021" else gemma).Plan, "split", property(lambda self: 2))
    torch.manual_seed(11)
    config = WanXattnConfig(64, 2, qk_norm=True) if pid == "021" else Gemma3CoreConfig(64, 4, 2, 16)
    m = training_module(pid, config, dtype)
    check_training_step(pid, m, training_inputs(pid, config, (1, 9, 5) if pid == "021" else (1, 13), dtype), TOL[dtype])


@pytest.mark.parametrize("frozen", ["weights", "activations"])
def test_gradients_left_out(frozen):
    """Frozen parameters (or activations without gradients) get no gradient; the rest are right."""
    torch.manual_seed(2)
    config = Gemma3CoreConfig(64, 4, 2, 16)
    m = training_module("037", config, torch.float32, 50.0)
    acts = training_inputs("037", config, (1, 11), torch.float32)
    if frozen == "weights":
        for p in m.parameters():
            p.requires_grad_(False)
    else:
        acts[0].requires_grad_(False)
    out = m(*acts)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, params, exact = training_float64("037", m, acts)
    ref.backward(grad.double())
    if frozen == "weights":
        assert all(p.grad is None for p in m.parameters()) and rel_err(acts[0].grad, exact[0].grad) < 3e-3
    else:
        assert acts[0].grad is None
        assert all(rel_err(p.grad, e.grad) < 3e-3 for p, e in zip(m.parameters(), params.values()))


def test_deterministic_mode_gives_the_same_bits():
    """Under torch.use_deterministic_algorithms(True), no atomic sums: two calls, the same gradients."""
    torch.manual_seed(3)
    config = WanXattnConfig(64, 2)
    m = training_module("021", config, torch.float32)
    acts = training_inputs("021", config, (1, 9, 5), torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            m(*acts).sum().backward()
            runs.append([p.grad.clone() for p in m.parameters()])
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_buffer_layouts():
    """An arena's tensors start 256-byte aligned; phases share their bytes; gradients split one allocation."""
    a, b = Buffer("a", (3, 5), torch.float32), Buffer("b", (7,), torch.bfloat16)
    arena = Arena([a, Phases([b], [Buffer("c", (100,), torch.float32), Buffer("d", (1,), torch.float16)]), None])
    assert arena.offsets == [0, 256, 256, 768] and arena.nbytes == 1024
    views = arena.views(arena.allocate("cpu"))
    assert views.a.shape == (3, 5) and views.c.dtype == torch.float32 and views.d.data_ptr() - views.a.data_ptr() == 768
    outs, bases = Outputs([Buffer("w", (4, 2), torch.float32), None, Buffer("bias", (4,), torch.float32)]).allocate("cpu")
    assert outs.w.shape == (4, 2) and outs.bias.data_ptr() - outs.w.data_ptr() == 32
    assert len(bases) == 1 and bases[0].data_ptr() == outs.w.data_ptr() and bases[0].numel() == 12


@pytest.mark.parametrize("separate", [False, True])
def test_a_stacks_parts_are_its_row_blocks(separate):
    """A Stack's parts are the gradients autograd takes and the row blocks of the one tensor its product
    writes; separate (the custom ops): after `own`, each later part is memory of its own with its values."""
    f = torch.float32
    wk, wv = Buffer("wk", (3, 4), f), Buffer("wv", (3, 4), f)
    spec = Outputs([Buffer("wq", (2, 4), f), Stack("wkv", (wk, wv)), Buffer("bias", (5,), f)], separate=separate)
    w, bases = spec.allocate("cpu")
    assert (w.wq.shape, w.wk.shape, w.wv.shape, w.bias.shape) == ((2, 4), (3, 4), (3, 4), (5,))
    stack = spec.stack(w, "wkv")
    assert stack.shape == (6, 4) and stack.data_ptr() == w.wk.data_ptr()
    stack.copy_(torch.arange(24, dtype=f).view(6, 4))  # what the product writes
    assert torch.equal(w.wk, torch.arange(12, dtype=f).view(3, 4)) and torch.equal(w.wv, stack[3:])
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * 4) for b in bases)
    for t in (w.wq, stack, w.bias):  # every tensor the launches write lies in one allocation `execute` is given
        assert any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * 4 <= hi for lo, hi in spans)
    assert len(bases) == (3 if separate else 1)
    spec.own(w)
    assert torch.equal(w.wv, torch.arange(12, 24, dtype=f).view(3, 4))
    assert (w.wv.data_ptr() != stack.data_ptr() + 48) == separate  # a copy of its own only where separate


def test_gemma_upstream_of_attention_in_grad_hidden_where_it_fits():
    """dA lives in grad_hidden's bytes where grad_hidden is needed and holds it (the CASES above run both
    placements on poisoned buffers), else in the scratch."""
    from backfuse.ops.gemma3_core.training import Plan

    fits = Plan(2, 13, Gemma3CoreConfig(64, 4, 2, 16), torch.bfloat16)
    wider = Plan(2, 37, Gemma3CoreConfig(128, 4, 2, 64), torch.bfloat16)  # q_out 256 > hidden 128
    assert fits.da_in_grad_hidden and "da" not in {b.name for b in fits.backward_scratch.specs}
    assert not wider.da_in_grad_hidden and "da" in {b.name for b in wider.backward_scratch.specs}
    assert Plan(2, 37, Gemma3CoreConfig(128, 4, 2, 64), torch.float32).da_in_grad_hidden  # fp16 dA in fp32 bytes
    assert not Plan(2, 13, Gemma3CoreConfig(64, 4, 2, 16), torch.bfloat16, needs=(False,) + (True,) * 6).da_in_grad_hidden


def test_split_key_blocks_only_where_the_gpu_would_idle():
    a = steps.Attention(1, 4096, 77, 16, 1, 64)
    tiles = steps.attention_tiles(64, True)
    assert a.split(tiles, 132, False) == 4 and a.split(tiles, 132, True) == 1
    wide = steps.Attention(64, 256, 256, 24, 3, 128, causal=True)
    assert wide.split(steps.attention_tiles(128, True), 132, False) == 1
    # the other side of the split, at another length of the same batch (`compile_other_split`)
    assert a.other_split(tiles, 132, False, tied=False) == 1 and a.other_split(tiles, 132, True, tied=False) is None
    assert wide.other_split(steps.attention_tiles(128, True), 132, False, tied=True) is None  # 64 x 8 KV heads
    big = steps.attention_tiles(256, True)
    for s, split, other in ((384, 2, 1), (512, 2, 1), (513, 1, 2), (4096, 1, 2)):  # Gemma 3 4B, batch 2
        gemma = steps.Attention(2, s, s, 8, 2, 256, causal=True)
        assert (gemma.split(big, 132, False), gemma.other_split(big, 132, False, tied=True)) == (split, other), s


@pytest.mark.skipif(not GPU, reason="CUDA graphs and synchronization exist on a GPU")
@pytest.mark.parametrize("pid", ["021", "037"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_loop_replays_graphs_and_never_synchronizes(dtype, pid):
    """After its first steps, every call of a steady loop is one graph replay (037 in bf16: with cuDNN's
    attention recorded in it), nothing recorded; no step makes the host wait (set_sync_debug_mode("error")
    would raise). (The caching allocator's history, what earlier tests on the worker left freed, decides when
    the addresses settle: the cache is emptied first, and six steps are given to settle.)"""
    guard.reset()
    gc.collect()
    torch.cuda.empty_cache()
    if pid == "021":
        config, sizes = WanXattnConfig(), (2, 256, 77)
        m = training_module(pid, config, dtype)
    else:
        config, sizes = Gemma3CoreConfig(512, 4, 2, 128), (2, 256)
        m = training_module(pid, config, dtype, None)
    acts = training_inputs(pid, config, sizes, dtype)
    grad = torch.randn(*sizes[:2], config.hidden, device=DEVICE, dtype=dtype)

    def step():
        m.zero_grad(set_to_none=True)
        for a in acts:
            a.grad = None
        m(*acts).backward(grad)

    def totals():  # (hits, misses, direct runs, graphs instantiated)
        return tuple(graphs.counts[k] for k in ("replayed", "missed", "direct", "instantiated"))

    seen = [totals()]  # after each step: what the message shows where a step was not all replays
    for _ in range(6):
        step()
        seen.append(totals())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
            seen.append(totals())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    per_step = [tuple(a - b for a, b in zip(after, before)) for before, after in zip(seen, seen[1:])]
    hits, misses, direct, _ = (a - b for a, b in zip(seen[-1], seen[6]))
    assert (hits, misses, direct) == (6, 0, 0), per_step  # a forward and a backward per step


def test_qkv_gqas_backward_key_names_its_upstream_gradients_layout(monkeypatch):
    """072's head-group sums read grad_key_states and grad_value_states at their own strides (runtime arguments, any
    layout with a contiguous last axis): two calls at one shape whose gradients are laid out differently must not
    share a key, or the second would run the first's graph or template at the first's strides and sum the wrong
    elements (found in session 50: the key held the plan alone)."""
    import backfuse.ops.qkv_gqa.training as qkv

    keys = []
    real = qkv.execute
    monkeypatch.setattr(qkv, "execute", lambda key, *a: (keys.append(key), real(key, *a))[1])
    config, dtype = QkvGqaConfig(64, 32, 4, 2, 16), torch.bfloat16
    m = training_module("072", config, dtype)
    dec, enc = training_inputs("072", config, (2, 5, 7), dtype)
    results = []
    for token_major in (False, True):
        m.zero_grad(set_to_none=True)
        dec.grad = enc.grad = None
        outs = m(dec, enc)
        torch.manual_seed(3)
        grads = [torch.randn(o.shape, device=DEVICE).to(dtype) for o in outs]
        if token_major:  # k's and v's gradients [B, H, S, D] in [B, S, H, D] memory; q's as before
            grads[1:] = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in grads[1:]]
        torch.autograd.backward(outs, grads)
        results.append((enc.grad.clone(), m.k_weight.grad.clone(), m.v_weight.grad.clone()))
    backward = [k for k in keys if k[0] == "qkv_gqa backward"]
    assert len(backward) == 2 and backward[0] != backward[1]
    assert all(rel_err(a.float(), b.float()) < 1e-2 for a, b in zip(*results))  # the same sums, read in either layout


@pytest.mark.skipif(not GPU, reason="templates serve a GPU's direct launches")
@pytest.mark.parametrize("pid, config, shapes", [
    ("072", QkvGqaConfig(256, 128, 4, 2, 64), [(2, 37, 77), (1, 61, 13)]),
    ("037", Gemma3CoreConfig(256, 4, 2, 64), [(2, 61), (1, 200)]),
    ("037", Gemma3CoreConfig(256, 4, 2, 64, qk_norm=True, window=32), [(2, 97), (2, 33)]),
    ("021", WanXattnConfig(256, 4, qk_norm=True), [(1, 300, 77), (2, 97, 5)]),
])
def test_a_loop_of_changing_lengths_runs_templates(pid, config, shapes, monkeypatch):
    """In bf16 with graphs off (every call direct, as a length met for the first or second time is): once a shape's
    call has compiled nothing, its next calls' forward and backward each run their key's template, not a build of
    their launches (the host cost `bench --dynamic`'s second pass depends on), with the results of the call that
    built them (within bf16's rounding: the attention's atomic sums may add in another order)."""
    from backfuse.train import program

    runs = []
    real = program.Template.run
    monkeypatch.setattr(program.Template, "run", lambda self, tensors, addresses: (runs.append(1), real(self, tensors, addresses)))
    dtype = torch.bfloat16
    m = training_module(pid, config, dtype, None) if pid == "037" else training_module(pid, config, dtype)
    with graphs.cuda_graphs(False):
        for sizes in shapes:
            acts = training_inputs(pid, config, sizes, dtype)
            counts, results = [], []
            for _ in range(3):  # the first may compile; the second builds (and keeps the template) where it did
                m.zero_grad(set_to_none=True)
                for a in acts:
                    a.grad = None
                start = len(runs)
                out = m(*acts)
                outs = out if isinstance(out, tuple) else (out,)
                grads = [torch.randn(o.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(7)).to(dtype)
                         for o in outs]
                torch.autograd.backward(outs, grads)
                counts.append(len(runs) - start)
                results.append([o.detach().float() for o in outs] + [a.grad.float() for a in acts if a.grad is not None]
                               + [p.grad.float() for p in m.parameters()])
            assert counts[2] == 2, (sizes, counts)  # its forward and its backward
            for first, last in zip(results[0], results[2]):
                assert rel_err(last, first) < 2e-2, sizes


def _at_odd_offset(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in memory one element past a 16-byte boundary (a contiguous view at an odd offset)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return flat[1:].view(t.shape).copy_(t.detach()).requires_grad_(t.requires_grad)


def test_calls_off_16_bytes_keep_templates_of_their_own():
    from backfuse.train.program import template_slot

    key = ("plan", 1)
    assert template_slot(key, 0, (4096, 0, 8192)) == template_slot(key, 0, (512, 0, 1024)) == (key, 0)
    odd = template_slot(key, 0, (4098, 0, 8192))
    assert odd != (key, 0) and odd == template_slot(key, 0, (514, 0, 256)) != template_slot(key, 0, (4096, 0, 8200))


@pytest.mark.skipif(not GPU, reason="templates serve a GPU's direct launches")
@pytest.mark.parametrize("pid, config, sizes", [
    ("072", QkvGqaConfig(256, 128, 4, 2, 64), (2, 37, 77)),
    ("037", Gemma3CoreConfig(256, 4, 2, 64, qk_norm=True, window=32), (2, 97)),
    ("021", WanXattnConfig(256, 4, qk_norm=True), (1, 300, 77)),
])
def test_a_template_from_aligned_tensors_does_not_run_at_unaligned_ones(pid, config, sizes, monkeypatch):
    """A template re-aims Triton binaries compiled for its call's pointer alignment: after a key's calls at
    16-byte-aligned inputs have made and run its template, the same shapes at inputs off 16 bytes (views at an
    odd offset) run binaries of their own alignment. Every call is checked against float64 (within bf16's
    rounding), the templates' runs counted so that the test cannot pass without them."""
    from backfuse.train import program

    runs = []
    real = program.Template.run
    monkeypatch.setattr(program.Template, "run", lambda self, tensors, addresses: (runs.append(1), real(self, tensors, addresses)))
    dtype = torch.bfloat16
    m = training_module(pid, config, dtype, None) if pid == "037" else training_module(pid, config, dtype)
    acts = training_inputs(pid, config, sizes, dtype)
    with graphs.cuda_graphs(False):
        for _ in range(3):  # the first may compile; the second builds the template; the third runs it
            m.zero_grad(set_to_none=True)
            check_training_step(pid, m, [a.detach().requires_grad_(a.requires_grad) for a in acts], TOL[dtype])
        assert len(runs) >= 2, runs
        shifted = [_at_odd_offset(a) if a.is_floating_point() else a for a in acts]
        assert all(a.data_ptr() % 16 for a in shifted if a.is_floating_point())
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            check_training_step(pid, m, [a.detach().requires_grad_(a.requires_grad) for a in shifted], TOL[dtype])


@pytest.mark.filterwarnings(r"ignore::RuntimeWarning:(triton|numpy)\.")  # the interpreter's overflow in casts
def test_a_graph_taken_under_another_guard_is_not_launched_at_its_memory():
    """A layer's fp16 range guard replaced under its recorded graphs (`guard.reset`, or a guard evicted past
    GUARDS_KEPT) at the same tensors' addresses: the next calls run with the new guard's memory, so a value
    weight fp16 cannot hold is still named. (Were the old graph launched, it would check the range into the
    old guard's memory, kept alive here, and nothing would be said.)"""
    import backfuse

    guard.reset()
    config, sizes = WanXattnConfig(hidden=256, heads=2), (1, 37, 13)
    m = training_module("021", config, torch.float32)
    acts = training_inputs("021", config, sizes, torch.float32)
    grad = torch.randn(*sizes[:2], config.hidden, device=DEVICE)

    def step():
        m.zero_grad(set_to_none=True)
        for a in acts:
            a.grad = None
        m(*acts).backward(grad)

    for _ in range(5):  # recorded at the third call, then replayed
        step()
    old = list(guard._guards.values())  # their memory stays allocated: a new guard gets other addresses
    guard.reset()
    with torch.no_grad():
        m.value_weight.mul_(2e5)  # in place: every tensor of the call at its address
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
        backfuse.check_ranges()
    assert any("values (call 1" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert old


def test_a_backward_first_on_its_thread_warns_nothing():
    """A fresh process with every UserWarning an error: a backward started from an explicit gradient, whose first
    launch on the autograd engine's device thread (no CUDA context current there yet) is a cuBLAS product."""
    script = (
        "import torch, backfuse.nn\n"
        "from backfuse.ops.gemma3_core.spec import Gemma3CoreConfig\n"
        f"d = {DEVICE!r}\n"
        "m = backfuse.nn.Gemma3Core(Gemma3CoreConfig(64, 2, 1, 32), device=d, dtype=torch.bfloat16)\n"
        "x = torch.randn(2, 24, 64, device=d, dtype=torch.bfloat16, requires_grad=True)\n"
        "pos = torch.arange(24, device=d, dtype=torch.float32)[:, None] * torch.ones(32, device=d)\n"
        "cos, sin = (f(pos).expand(2, 24, 32).to(torch.bfloat16) for f in (torch.cos, torch.sin))\n"
        "for _ in range(2):\n"
        "    torch.autograd.backward(m(x, cos, sin), torch.randn_like(x))\n"
        "if d == 'cuda':\n"
        "    torch.cuda.synchronize()\n")
    run = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_training_kernels_compile_for_sm90(dtype):
    """The training paths' kernels compiled for the H100/H200 target on any machine: the interpreter runs their
    arithmetic but never their compilation, so API breaks and a tile choice needing more shared memory than a
    program has (Gemma 2's soft-capped backward once asked 262656 bytes of 232448) show here, before device
    time; so does ptxas serializing every wgmma of a kernel (a mask-reading loop once did that to the whole masked
    attention). In a subprocess without TRITON_INTERPRET. fp16 compiles the attention without a mask only (its
    masked binaries differ from bf16's in the operands' type alone; `sm90_kernels._sm90_cases`): 153 -> 30 s of CI's
    CPU cold. Not in the GPU suite: the same compile as on the CPU machine, where CI runs it, and there every test
    compiles what it launches."""
    import json
    import os
    import subprocess
    import sys

    from backfuse.kernels.gluon.sm90 import SHARED_LIMIT

    if DEVICE == "cuda":
        pytest.skip("the CPU machine's compile for sm_90 (CI runs it); on the GPU every test compiles what it launches")

    env = dict(os.environ, TRITON_INTERPRET="0")  # a compile: the interpreter off (importing backfuse would turn it on)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    script = os.path.join(os.path.dirname(__file__), "sm90_kernels.py")
    done = subprocess.run([sys.executable, script, dtype], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(kernels) >= (40 if dtype == "bf16" else 15), kernels  # (fp16: the unmasked attention, `_sm90_cases`)
    over = [k for k in kernels if k["shared"] > SHARED_LIMIT]
    assert not over, f"more shared memory than a program has ({SHARED_LIMIT} bytes): {over}"
    # the attention's launches that read no mask keep their wgmma in flight (READ_APART); the mask-reading ones may not
    waiting = [k["name"] for k in kernels if k["serialized"] and " reads" not in k["name"]]
    assert not waiting, f"ptxas serialized every wgmma of: {waiting}"


@pytest.mark.parametrize("layout", ["token-major", "contiguous"])
def test_qkv_gqa_query_gradient_in_any_layout(layout):
    """072 on bfloat16 reads grad_query_states in place when it has the forward output's token-major
    memory (no copy), and copies it otherwise: the same gradients either way, against float64."""
    torch.manual_seed(4)
    config = QkvGqaConfig(64, 32, 4, 2, 16)
    m = training_module("072", config, torch.bfloat16)
    acts = training_inputs("072", config, (2, 7, 5), torch.bfloat16)
    outs = training_call("072", m, acts)
    grads = [torch.randn(o.shape, device=DEVICE).to(torch.bfloat16) for o in outs]
    if layout == "token-major":
        grads[0] = grads[0].transpose(1, 2).contiguous().transpose(1, 2)
    assert grads[0].transpose(1, 2).is_contiguous() == (layout == "token-major")
    torch.autograd.backward(outs, grads)
    ref, params, exact = training_float64("072", m, acts)
    torch.autograd.backward(ref, [g.double() for g in grads])
    for p, e in zip(m.parameters(), params.values()):
        assert rel_err(p.grad, e.grad) < 3e-2
    for x, e in zip(acts, exact):
        assert rel_err(x.grad, e.grad) < 3e-2
