"""The fused kernels against the reference: odd shapes, fresh inputs, poisoned buffers, official rule.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE
from helpers import assert_official_pass, rel_err

import backfuse
from backfuse.kernels import buffers, gemm
from backfuse.kernels.fp16_range import RangeSlots
from backfuse.ops import cross_attn_qkv_gqa, gemma3_attn_core, wan_text_video_xattn

FP16_REL_ERR = 2e-3  # fp16 operands with fp32 accumulation land near 3e-4 (021's attention chain: 1e-3)
# Outputs that are zero in exact arithmetic (only rounding noise remains): bounded in absolute terms.
NEAR_ZERO = {"grad_key_bias": 0.05}


def _check_fused(prob, axes, seed, fn=None):
    """Run once on poisoned buffers, check against the reference; returns (inputs, outputs).

    fn (default prob.run, whose fp16 range guard fails the test by its warning) takes `ranges`:
    every slot of the range guard must be written and in range (poisoned slots read NaN)."""
    inputs = prob.make_inputs(axes, seed=seed, device=DEVICE)
    copies = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    ranges = RangeSlots()
    with buffers.poisoned():
        outs = fn(*inputs, ranges=ranges) if fn else prob.run(*inputs)
    assert ranges.out_of_range() == []
    refs = prob.reference(*inputs)
    assert_official_pass(prob, outs, refs)
    for name, o, r in zip(prob.output_names, outs, refs):
        assert o.shape == r.shape and o.dtype == torch.float32 and o.is_contiguous(), name
        if name in NEAR_ZERO:
            assert (o - r).abs().max().item() < NEAR_ZERO[name], name
        else:
            assert rel_err(o, r) < FP16_REL_ERR, name
    for name, x, y in zip(prob.input_names, inputs, copies):
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"{name} was modified"
    storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
    assert not any(o.untyped_storage().data_ptr() in storages for o in outs), "an output aliases an input"
    return inputs, outs


@pytest.mark.parametrize("axes", [
    dict(batch_size=1, seq_len_dec=37, seq_len_enc=19),
    dict(batch_size=2, seq_len_dec=1, seq_len_enc=77),
])
def test_072_fused_odd_shapes(axes):
    _check_fused(backfuse.problem("072"), axes, seed=11)


def test_072_fused_split_k_and_gpu_tiles():
    """Many processors force K splits (atomics into pre-zeroed outputs); the GPU's tile shape."""
    prob = backfuse.problem("072")
    config = cross_attn_qkv_gqa.GEMM_CONFIG
    fn = lambda *x, **kw: cross_attn_qkv_gqa.qkv_gqa_backward(*x, config=config, sms=132, **kw)  # noqa: E731
    _check_fused(prob, dict(batch_size=3, seq_len_dec=5, seq_len_enc=13), seed=5, fn=fn)


def test_021_fused_default_path():
    """Problem.run as users call it; one block per head, its text as a 32-token head and a 16-token
    tail: dK/dV written directly, no partial sums."""
    _check_fused(backfuse.problem("021"), dict(batch_size=1, num_video_tokens=37, num_text_tokens=37), seed=7)


def test_longest_first_orders_groups_by_tile_depth():
    groups = [(512, 1024, 1), (312, 2048, 1), (256, 8192, 2), (128, 4928, 1), (0, 77, 0)]
    starts = gemm.longest_first(groups)
    spans = sorted((start, start + tiles) for start, (tiles, _, _) in zip(starts, groups))
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
    assert starts[:4] == [696, 384, 128, 0]  # depths 1024, 2048, 4096, 4928: deepest first


@pytest.mark.parametrize("nt, tiles", [(1, (16, 0)), (19, (32, 0)), (33, (32, 16)), (77, (64, 16)), (100, (128, 0))])
def test_021_text_tiles_pad_least(nt, tiles):
    assert wan_text_video_xattn.text_tiles(nt) == tiles
    assert wan_text_video_xattn.text_tiles(nt, split=False) == (max(16, 1 << (nt - 1).bit_length()), 0)


_W = wan_text_video_xattn


def _021_with(config=None, sms=132, **kw):
    return lambda *x, **extra: _W.text_video_xattn_backward(*x[:10], x[11], config=config, sms=sms, **kw, **extra)


@pytest.mark.parametrize("axes", [
    dict(batch_size=1, num_video_tokens=70, num_text_tokens=77),  # text as head + tail, runs of blocks
    dict(batch_size=1, num_video_tokens=70, num_text_tokens=150),  # text in tiles, one block per run
])
def test_021_fused_shared_heads_and_text_tiles(axes):
    """Several programs per head (fp32 partial sums, the last to arrive converts) and K splits."""
    _check_fused(backfuse.problem("021"), axes, seed=3, fn=_021_with())


def test_021_fused_single_tokens():
    prob = backfuse.problem("021")
    _check_fused(prob, dict(batch_size=3, num_video_tokens=1, num_text_tokens=2), seed=2, fn=_021_with())
    # One text token: P = 1, so dS and every gradient through it are rounding noise; the rule still holds.
    x = prob.make_inputs(dict(batch_size=2, num_video_tokens=3, num_text_tokens=1), seed=2, device=DEVICE)
    with buffers.poisoned():
        assert_official_pass(prob, _021_with()(*x), prob.reference(*x))


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's fp16 products run on the GPU only")
@pytest.mark.parametrize("needs", [None, (False, True, False, False, True, True, True, True, False, False)])
def test_021_cublas_gradient_products(needs):
    """Gradient products by cuBLAS; our fourth launch then only sums the bias gradients."""
    prob = backfuse.problem("021")
    if needs is None:
        _check_fused(prob, dict(batch_size=2, num_video_tokens=70, num_text_tokens=77), seed=13,
                     fn=_021_with(products="cublas"))
        return
    x = prob.make_inputs(dict(batch_size=1, num_video_tokens=29, num_text_tokens=13), seed=13, device=DEVICE)
    with buffers.poisoned():
        outs = _021_with(products="cublas", needs=needs)(*x)
    for name, need, o, r in zip(prob.output_names, needs, outs, prob.reference(*x)):
        assert not need or name in NEAR_ZERO or rel_err(o, r) < FP16_REL_ERR, name


def test_037_fused_shipped_path():
    """Problem.run as users call it: one attention block per head, no K splits on the CPU."""
    _check_fused(backfuse.problem("037"), dict(batch_size=2, seq_len=19), seed=4)


def _037_with(sms=132, **kw):
    return lambda *x, **extra: gemma3_attn_core.gemma3_attention_backward(*x, sms=sms, **kw, **extra)


def test_037_fused_causal_blocks_and_split_k():
    """37 tokens: several query and key blocks per head (causal skipping, diagonal masks, padded rows
    and columns), and K splits from a GPU's processor count."""
    _check_fused(backfuse.problem("037"), dict(batch_size=1, seq_len=37), seed=9, fn=_037_with())


def _037_head_split_config():
    """The launch shapes of this device with dK/dV programs split by query head at any length (the
    shipped rule splits at batch 1 from 256 tokens)."""
    cfg = gemma3_attn_core.CONFIG if DEVICE == "cuda" else gemma3_attn_core.INTERPRETER_CONFIG
    return cfg._replace(attention=cfg.attention._replace(head_split_min_seq=0))


def test_037_fused_dkdv_programs_split_by_query_head():
    """Three programs per key block, one per query head of the group; the last to finish sums their
    fp32 partials and runs the RoPE/RMSNorm epilogue (37 tokens: several key blocks, padded ones)."""
    _check_fused(backfuse.problem("037"), dict(batch_size=1, seq_len=37), seed=10,
                 fn=_037_with(config=_037_head_split_config()))


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's fp16 products run on the GPU only")
@pytest.mark.parametrize("needs", [None, (True, False, False, False, True, True, True)])
def test_037_cublas_products(needs):
    """Projection products by cuBLAS, our launches around them (forward: only norm and RoPE)."""
    prob = backfuse.problem("037")
    if needs is None:
        _check_fused(prob, dict(batch_size=2, seq_len=37), seed=12, fn=_037_with(products="cublas"))
        return
    x = prob.make_inputs(dict(batch_size=1, seq_len=29), seed=12, device=DEVICE)
    with buffers.poisoned():
        outs = gemma3_attn_core.gemma3_attention_backward(*x, products="cublas", needs=needs)
    for name, need, o, r in zip(prob.output_names, needs, outs, prob.reference(*x)):
        assert not need or rel_err(o, r) < FP16_REL_ERR, name


def test_037_norm_rope_pass():
    """The forward launch without products (the cuBLAS path's norm and RoPE pass, which on the CPU
    no other test reaches): rot = RoPE(RMSNorm(q) (1 + w)), q heads times scaling / |cap|, from fp32
    projections, every slot of rot and of its range regions written."""
    op = gemma3_attn_core
    prob = backfuse.problem("037")
    _, hidden, cos, sin, wq, wk, _, _, qnw, knw, scaling, cap, eps = prob.make_inputs(
        dict(batch_size=2, seq_len=19), seed=4, device=DEVICE)
    tokens = hidden.shape[0] * hidden.shape[1]
    x2 = hidden.reshape(tokens, op.HIDDEN)
    qk32 = torch.cat([x2 @ wq.T, x2 @ wk.T], 1)
    cfg = (op.CONFIG if DEVICE == "cuda" else op.INTERPRETER_CONFIG).norm_rope
    row_blocks = -(-tokens // cfg.bm)
    unused = torch.empty(1, dtype=torch.float16, device=DEVICE)  # operands of the products path
    rot16 = torch.full((tokens, op.QK), float("nan"), dtype=torch.float16, device=DEVICE)
    ranges = torch.full(((op.HEADS + op.KV_HEADS) * row_blocks,), float("nan"), device=DEVICE)
    op.FORWARD_PRODUCTS((row_blocks * op.QKV // op.HEAD_DIM,), unused, unused, unused, unused, cos, sin, qnw, knw,
                        qk32, unused, rot16, unused, ranges, tokens, float(eps), float(scaling) / abs(float(cap)),
                        BM=cfg.bm, BK=cfg.bk, PRODUCTS=False, PDL=False, num_warps=cfg.warps)

    _, q, k, _ = prob._project(hidden, cos, sin, wq, wk, wk, qnw, knw, eps)
    expected = torch.cat([q["rotated"] * (scaling / abs(cap)), k["rotated"]], 1)  # [batch, heads, seq, 128]
    expected = expected.transpose(1, 2).reshape(tokens, op.QK)
    assert rel_err(rot16.float(), expected) < FP16_REL_ERR
    largest = rot16.float().abs().max()  # the slots hold maxima before the rounding to fp16
    assert torch.isfinite(ranges).all() and abs(ranges.max() - largest) <= 1e-3 * largest


def test_037_single_token():
    """S = 1: each softmax row has one key, so dS, and with it every gradient through q and k, is
    exactly zero, in the reference too (where the official rule fails any all-zero output); the
    rest still matches."""
    prob = backfuse.problem("037")
    x = prob.make_inputs(dict(batch_size=2, seq_len=1), seed=3, device=DEVICE)
    with buffers.poisoned():
        outs = prob.run(*x)
    for name, o, r in zip(prob.output_names, outs, prob.reference(*x)):
        if name in ("grad_q_weight", "grad_k_weight", "grad_q_norm_weight", "grad_k_norm_weight"):
            assert r.abs().max() == 0 and o.abs().max() < 1e-6, name
        else:
            assert rel_err(o, r) < FP16_REL_ERR, name


@pytest.mark.parametrize("cap", [2.0, -2.0])
def test_037_scalars_are_honoured(cap):
    """Other scaling, soft cap (either sign: cap tanh(z / cap) is even in cap) and eps than the
    suite's: the kernels take them as given."""
    prob = backfuse.problem("037")
    x = prob.make_inputs(dict(batch_size=1, seq_len=21), seed=5, device=DEVICE, scalars=dict(
        scaling=0.3, attn_logit_softcapping=cap, rms_norm_eps=0.5))
    with buffers.poisoned():
        assert_official_pass(prob, prob.run(*x), prob.reference(*x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_without_interpreter_falls_back_to_reference():
    code = (
        "import torch, backfuse\n"
        "p = backfuse.problem('072')\n"
        "x = p.make_inputs(dict(batch_size=1, seq_len_dec=3, seq_len_enc=2), seed=0)\n"
        "assert all(torch.equal(a, b) for a, b in zip(p.run(*x), p.reference(*x)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@pytest.mark.parametrize("pid, axes, wanted", [
    ("072", dict(batch_size=1, seq_len_dec=7, seq_len_enc=5), ("decoder_hidden_states", "encoder_hidden_states")),
    ("072", dict(batch_size=1, seq_len_dec=7, seq_len_enc=5), ("k_weight",)),
    ("021", dict(batch_size=1, num_video_tokens=9, num_text_tokens=5), ("video_latents",)),
    ("021", dict(batch_size=1, num_video_tokens=9, num_text_tokens=5), ("query_weight", "value_bias")),
    ("021", dict(batch_size=1, num_video_tokens=9, num_text_tokens=5), ("key_bias", "output_bias")),
    ("037", dict(batch_size=1, seq_len=5), ("hidden_states", "o_weight")),
])
def test_backward_computes_only_what_is_needed(pid, axes, wanted):
    """Skipped products leave their outputs as None; the wanted ones still match the reference."""
    prob = backfuse.problem(pid)
    inputs = prob.make_inputs(axes, seed=6, device=DEVICE)
    needs = [name in wanted for name in prob.differentiates]
    with buffers.poisoned():
        outs = prob.backward(*inputs, needs=needs)
    refs = prob.reference(*inputs)
    for name, need, o, r in zip(prob.output_names, needs, outs, refs):
        if not need:
            assert o is None, name
        elif name in NEAR_ZERO:
            assert (o - r).abs().max().item() < NEAR_ZERO[name], name
        else:
            assert rel_err(o, r) < FP16_REL_ERR, name


@pytest.mark.parametrize("pid, axes, fn", [
    ("021", dict(batch_size=1, num_video_tokens=70, num_text_tokens=77), _021_with(deterministic=True)),
    ("072", dict(batch_size=3, seq_len_dec=5, seq_len_enc=13),
     lambda *x, **kw: cross_attn_qkv_gqa.qkv_gqa_backward(*x, deterministic=True, sms=132, **kw)),
    pytest.param("037", dict(batch_size=1, seq_len=7), _037_with(deterministic=True),
                 marks=pytest.mark.skipif(DEVICE != "cuda", reason="037's only atomics are K splits, which the "
                                          "interpreter runs in order; its no-split path is test_037_fused_shipped_path")),
    pytest.param("037", dict(batch_size=1, seq_len=77), _037_with(deterministic=True, config=_037_head_split_config()),
                 marks=pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter runs the split programs in order"),
                 id="037-head-split"),
])
def test_deterministic_mode(pid, axes, fn):
    """Partial sums stored per program and added in a fixed order: correct, and the same bits twice
    (a real check on the GPU; the interpreter runs programs in order anyway)."""
    prob = backfuse.problem(pid)
    inputs, outs = _check_fused(prob, axes, seed=8, fn=fn)
    for a, b in zip(outs, fn(*inputs)):
        assert torch.equal(a, b)


def test_deterministic_algorithms_flag_reaches_the_kernels(monkeypatch):
    prob = backfuse.problem("072")
    seen = {}
    monkeypatch.setattr(cross_attn_qkv_gqa, "qkv_gqa_backward", lambda *x, **kw: seen.update(kw) or prob.reference(*x))
    x = prob.make_inputs(dict(batch_size=1, seq_len_dec=2, seq_len_enc=2), seed=0, device=DEVICE)
    torch.use_deterministic_algorithms(True)
    try:
        prob.run(*x)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen.get("deterministic") is True
