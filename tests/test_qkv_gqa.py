"""072's fused kernels against the reference: odd shapes, K splits, needs, deterministic mode.

Without a GPU these run in the Triton interpreter (set up in conftest.py).
"""

import dataclasses

import pytest
from helpers import check_deterministic, check_fused, check_needs, fused_with

import backfuse
from backfuse.ops.qkv_gqa import config

AXES = dict(batch_size=3, seq_len_dec=5, seq_len_enc=13)


@pytest.mark.parametrize("axes", [
    dict(batch_size=1, seq_len_dec=37, seq_len_enc=19),
    dict(batch_size=2, seq_len_dec=1, seq_len_enc=77),
])
def test_odd_shapes(axes):
    check_fused(backfuse.problem("072"), axes, seed=11)


def test_split_k_and_gpu_tiles():
    """Many processors force K splits (atomics into pre-zeroed outputs); the GPU's tile shape."""
    cfg = dataclasses.replace(config.INTERPRETER_CONFIG, tiles=config.CONFIG.tiles)
    check_fused(backfuse.problem("072"), AXES, seed=5, fn=fused_with("072", config=cfg, sms=132))


@pytest.mark.parametrize("wanted", [("decoder_hidden_states", "encoder_hidden_states"), ("k_weight",)])
def test_backward_computes_only_what_is_needed(wanted):
    check_needs(backfuse.problem("072"), dict(batch_size=1, seq_len_dec=7, seq_len_enc=5), wanted)


def test_deterministic_mode():
    check_deterministic(backfuse.problem("072"), AXES, fused_with("072", deterministic=True, sms=132))
