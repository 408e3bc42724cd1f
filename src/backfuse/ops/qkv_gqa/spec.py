"""072 — cross-attention QKV projection with GQA repeat, backward (Parakeet TDT 0.6B v3): the
operator's signature, inputs as the suite draws them, reference and forward.

Forward: q = dec @ Wq^T as 16 heads; k = enc @ Wk^T, v = enc @ Wv^T as 4 KV heads repeated to 16.
Backward: GQ is grad_query_states token-major; GK, GV sum each group of 4 query heads;
grad_dec = GQ @ Wq, grad_Wq = GQ^T @ dec, grad_enc = GK @ Wk + GV @ Wv, grad_Wk = GK^T @ enc,
grad_Wv = GV^T @ enc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...problem import Problem, Tensor

HIDDEN = 1536
CROSS_HIDDEN = 1024
HEADS = 16
KV_HEADS = 4
GROUP = HEADS // KV_HEADS
HEAD_DIM = 256
Q_OUT = HEADS * HEAD_DIM  # 4096
KV_OUT = KV_HEADS * HEAD_DIM  # 1024

B, SD, SE = "batch_size", "seq_len_dec", "seq_len_enc"


@dataclass(frozen=True)
class QkvGqaConfig:
    """The sizes of one cross-attention's q, k, v projections with grouped KV heads: decoder and
    encoder widths, query heads, KV heads (each serving heads / kv_heads query heads) and the head
    size. The default is the benchmark operator's."""

    hidden: int = HIDDEN
    cross_hidden: int = CROSS_HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM

    def __post_init__(self):
        for name in ("hidden", "cross_hidden", "heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"QkvGqaConfig.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"QkvGqaConfig: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 8:
            raise ValueError(f"QkvGqaConfig: head_dim must be a multiple of 8, got {self.head_dim}")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim


OFFICIAL = QkvGqaConfig()


class QkvGqaBackward(Problem):
    id = "072"
    name = "072_cross_attention_qkv_projection_with_gqa_repeat_backward"
    workload_file = "072_qkv_gqa.jsonl"
    inputs = (
        Tensor("grad_query_states", (B, HEADS, SD, HEAD_DIM)),
        Tensor("grad_key_states", (B, HEADS, SE, HEAD_DIM)),
        Tensor("grad_value_states", (B, HEADS, SE, HEAD_DIM)),
        Tensor("decoder_hidden_states", (B, SD, HIDDEN)),
        Tensor("encoder_hidden_states", (B, SE, CROSS_HIDDEN)),
        Tensor("q_weight", (Q_OUT, HIDDEN)),
        Tensor("k_weight", (KV_OUT, CROSS_HIDDEN)),
        Tensor("v_weight", (KV_OUT, CROSS_HIDDEN)),
    )
    outputs = (
        Tensor("grad_decoder_hidden_states", (B, SD, HIDDEN)),
        Tensor("grad_encoder_hidden_states", (B, SE, CROSS_HIDDEN)),
        Tensor("grad_q_weight", (Q_OUT, HIDDEN)),
        Tensor("grad_k_weight", (KV_OUT, CROSS_HIDDEN)),
        Tensor("grad_v_weight", (KV_OUT, CROSS_HIDDEN)),
    )
    upstream_grads = ("grad_query_states", "grad_key_states", "grad_value_states")
    differentiates = ("decoder_hidden_states", "encoder_hidden_states", "q_weight", "k_weight", "v_weight")

    def draw(self, axes, gen, device):
        def normal(spec, scale):
            return torch.randn(spec.shape(axes), generator=gen, device=device) * scale

        grads, dec, enc, wq, wk, wv = self.inputs[:3], *self.inputs[3:]
        return [normal(g, 1 / math.sqrt(Q_OUT)) for g in grads] + [
            normal(dec, 1 / math.sqrt(HIDDEN)),
            normal(enc, 1 / math.sqrt(CROSS_HIDDEN)),
            normal(wq, 1 / math.sqrt(HIDDEN)),
            normal(wk, 1 / math.sqrt(CROSS_HIDDEN)),
            normal(wv, 1 / math.sqrt(CROSS_HIDDEN)),
        ]

    def reference_math(self, gq, gk, gv, dec, enc, wq, wk, wv):
        batch, _, sd, _ = gq.shape
        se = gk.shape[2]

        def group_sum(g):  # [B,16,Se,256] -> [B*Se, 1024]: query head h belongs to KV head h // 4
            return g.view(batch, KV_HEADS, GROUP, se, HEAD_DIM).sum(2).transpose(1, 2).reshape(batch * se, KV_OUT)

        gq_tok = gq.transpose(1, 2).reshape(batch * sd, Q_OUT)
        gk_tok, gv_tok = group_sum(gk), group_sum(gv)
        dec2 = dec.reshape(batch * sd, HIDDEN)
        enc2 = enc.reshape(batch * se, CROSS_HIDDEN)
        return (
            (gq_tok @ wq).view(batch, sd, HIDDEN),
            (gk_tok @ wk + gv_tok @ wv).view(batch, se, CROSS_HIDDEN),
            gq_tok.T @ dec2,
            gk_tok.T @ enc2,
            gv_tok.T @ enc2,
        )

    def forward(self, dec, enc, wq, wk, wv):
        batch, sd, _ = dec.shape
        se = enc.shape[1]
        q = (dec @ wq.T).view(batch, sd, HEADS, HEAD_DIM).transpose(1, 2)

        def kv(w):
            heads = (enc @ w.T).view(batch, se, KV_HEADS, HEAD_DIM).transpose(1, 2)
            return heads.repeat_interleave(GROUP, dim=1)

        return q, kv(wk), kv(wv)

    def macs(self, axes):
        dec_tokens = axes[B] * axes[SD]
        enc_tokens = axes[B] * axes[SE]
        # grad_dec and grad_Wq; grad_enc (K = 2048 over [Wk; Wv]) and [grad_Wk; grad_Wv].
        return 2 * dec_tokens * Q_OUT * HIDDEN + 2 * enc_tokens * 2 * KV_OUT * CROSS_HIDDEN


PROBLEM = QkvGqaBackward()
