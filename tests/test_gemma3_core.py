"""037's fused kernels against the reference: causal blocks, K splits, dK/dV programs split by query
head, the norm and RoPE pass, single tokens, scalars, cuBLAS products, needs, deterministic mode.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import dataclasses

import pytest
import torch
from conftest import DEVICE
from helpers import (
    FP16_REL_ERR,
    assert_official_pass,
    check_beside_busy_stream,
    check_deterministic,
    check_fused,
    check_needs,
    fused_with,
    rel_err,
)

import backfuse
from backfuse.kernels import buffers
from backfuse.kernels.launch import constexprs_of
from backfuse.ops.gemma3_core import config
from backfuse.ops.gemma3_core.backward import FORWARD_PRODUCTS


def test_shipped_path():
    """Problem.run as users call it: one attention block per head, no K splits on the CPU."""
    check_fused(backfuse.problem("037"), dict(batch_size=2, seq_len=19), seed=4)


def test_causal_blocks_and_split_k():
    """37 tokens: several query and key blocks per head (causal skipping, diagonal masks, padded rows
    and columns), and our products' K splits from a GPU's processor count."""
    check_fused(backfuse.problem("037"), dict(batch_size=1, seq_len=37), seed=9,
                fn=fused_with("037", sms=132, products="triton"))


def _head_split_config():
    """The launch shapes of this device with dK/dV programs split by query head at any length (the
    shipped rule splits at batch 1 from 256 tokens)."""
    cfg = config.CONFIG if DEVICE == "cuda" else config.INTERPRETER_CONFIG
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, head_split_min_seq=0))


def test_dkdv_programs_split_by_query_head():
    """Three programs per key block, one per query head of the group; the last to finish sums their
    fp32 partials and runs the RoPE/RMSNorm epilogue (37 tokens: several key blocks, padded ones)."""
    check_fused(backfuse.problem("037"), dict(batch_size=1, seq_len=37), seed=10,
                fn=fused_with("037", sms=132, config=_head_split_config()))


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's fp16 products run on the GPU only")
@pytest.mark.parametrize("needs", [None, (True, False, False, False, True, True, True)])
def test_cublas_products(needs):
    """Projection products by cuBLAS, our launches around them (forward: only norm and RoPE)."""
    prob = backfuse.problem("037")
    if needs is None:
        check_fused(prob, dict(batch_size=2, seq_len=37), seed=12, fn=fused_with("037", sms=132, products="cublas"))
        return
    x = prob.make_inputs(dict(batch_size=1, seq_len=29), seed=12, device=DEVICE)
    with buffers.poisoned():
        outs = fused_with("037", products="cublas", needs=needs)(*x)
    for name, need, o, r in zip(prob.output_names, needs, outs, prob.reference(*x)):
        assert not need or rel_err(o, r) < FP16_REL_ERR, name


def test_norm_rope_pass():
    """The forward launch without products (the cuBLAS path's pass after its one [q | k | v] product,
    which on the CPU no other test reaches): rot = RoPE(RMSNorm(q) (1 + w)), q heads times scaling /
    |cap|, from fp32 projections, v copied to fp16, every slot of rot, v and the range regions written."""
    prob = backfuse.problem("037")
    c = prob.config
    _, hidden, cos, sin, wq, wk, wv, _, qnw, knw, scaling, cap, eps = prob.make_inputs(
        dict(batch_size=2, seq_len=19), seed=4, device=DEVICE)
    tokens = hidden.shape[0] * hidden.shape[1]
    x2 = hidden.reshape(tokens, c.hidden)
    qkv32 = torch.cat([x2 @ wq.T, x2 @ wk.T, x2 @ wv.T], 1)  # the plan's qk_width on this path: QKV
    cfg = (config.CONFIG if DEVICE == "cuda" else config.INTERPRETER_CONFIG).norm_rope
    row_blocks = -(-tokens // cfg.bm)
    unused = torch.empty(1, dtype=torch.float16, device=DEVICE)  # operands of the products path
    rot16 = torch.full((tokens, c.qk), float("nan"), dtype=torch.float16, device=DEVICE)
    v16 = torch.full((tokens, c.kv_out), float("nan"), dtype=torch.float16, device=DEVICE)
    ranges = torch.full(((c.heads + c.kv_heads) * row_blocks,), float("nan"), device=DEVICE)
    qkv_tiles = row_blocks * c.qkv // c.head_dim  # the whole grid: no dA tiles without PRODUCTS
    FORWARD_PRODUCTS((qkv_tiles,), unused, unused, unused, unused, cos, sin, qnw, knw,
                     qkv32, v16, rot16, unused, ranges, tokens, qkv_tiles, float(eps), float(scaling) / abs(float(cap)),
                     **constexprs_of(FORWARD_PRODUCTS.fn, config.size_constexprs(c)), BM=cfg.bm, BK=cfg.bk,
                     PRODUCTS=False, QK_WIDTH=c.qkv, PDL=False, num_warps=cfg.warps)

    _, q, k, _ = prob._project(hidden, cos, sin, wq, wk, wk, qnw, knw, eps)
    expected = torch.cat([q["rotated"] * (scaling / abs(cap)), k["rotated"]], 1)  # [batch, heads, seq, 128]
    expected = expected.transpose(1, 2).reshape(tokens, c.qk)
    assert rel_err(rot16.float(), expected) < FP16_REL_ERR
    assert torch.equal(v16, qkv32[:, c.qk:].half())
    largest = rot16.float().abs().max()  # the slots hold maxima before the rounding to fp16
    assert torch.isfinite(ranges).all() and abs(ranges.max() - largest) <= 1e-3 * largest


def test_single_token():
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
def test_scalars_are_honoured(cap):
    """Other scaling, soft cap (either sign: cap tanh(z / cap) is even in cap) and eps than the
    suite's: the kernels take them as given."""
    prob = backfuse.problem("037")
    x = prob.make_inputs(dict(batch_size=1, seq_len=21), seed=5, device=DEVICE, scalars=dict(
        scaling=0.3, attn_logit_softcapping=cap, rms_norm_eps=0.5))
    with buffers.poisoned():
        assert_official_pass(prob, prob.run(*x), prob.reference(*x))


def test_backward_computes_only_what_is_needed():
    check_needs(backfuse.problem("037"), dict(batch_size=1, seq_len=5), ("hidden_states", "o_weight"))


@pytest.mark.skipif(DEVICE != "cuda", reason="037's only atomics are K splits, which the interpreter runs in order; "
                    "its no-split path is test_shipped_path")
def test_deterministic_mode():
    check_deterministic(backfuse.problem("037"), dict(batch_size=1, seq_len=7),
                        fused_with("037", sms=132, deterministic=True, products="triton"))


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter runs the split programs in order")
def test_deterministic_mode_head_split():
    check_deterministic(backfuse.problem("037"), dict(batch_size=1, seq_len=77),
                        fused_with("037", sms=132, deterministic=True, config=_head_split_config()))


@pytest.mark.skipif(DEVICE != "cuda", reason="PDL and its early-started gradient launch run on the GPU only")
@pytest.mark.parametrize("axes", [dict(batch_size=1, seq_len=300), dict(batch_size=4, seq_len=128)])
@pytest.mark.parametrize("products", [None, "triton"])
def test_gradient_launch_waiting_on_the_attention_survives_a_busy_stream(axes, products):
    """With PDL the gradient launch starts before the attention backward ends: its norm-weight sums
    (and with our products, its tiles that read G) wait on the attention's `done` counter
    (helpers.check_beside_busy_stream; 300 tokens at batch 1 also splits the dK/dV programs by query
    head). By default (cuBLAS), grad_Wo's product runs beside them on a branch."""
    check_beside_busy_stream("037", axes, products=products)
