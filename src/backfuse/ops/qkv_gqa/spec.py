"""072 — cross-attention QKV projection with GQA repeat, backward (Parakeet TDT 0.6B v3): the
operator's signature, inputs as the suite draws them, reference and forward, at the sizes of its
config (`QkvGqaConfig`; the default, `OFFICIAL`, is the benchmark operator's: the one definition of
its sizes).

Forward: q = dec @ Wq^T as 16 heads; k = enc @ Wk^T, v = enc @ Wv^T as 4 KV heads repeated to 16.
Backward: GQ is grad_query_states token-major; GK, GV sum each group of 4 query heads;
grad_dec = GQ @ Wq, grad_Wq = GQ^T @ dec, grad_enc = GK @ Wk + GV @ Wv, grad_Wk = GK^T @ enc,
grad_Wv = GV^T @ enc.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...problem import Problem, Tensor, is_int

B, SD, SE = "batch_size", "seq_len_dec", "seq_len_enc"


@dataclass(frozen=True)
class QkvGqaConfig:
    """The sizes of one cross-attention's q, k, v projections with grouped KV heads: decoder and
    encoder widths, query heads, KV heads (each serving heads / kv_heads query heads) and the head
    size. The default is the benchmark operator's (`OFFICIAL`)."""

    # The benchmark operator's sizes: the one place they are written (spec, plan and kernels read them here).
    hidden: int = 1536
    cross_hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 256

    def __post_init__(self):
        for name in ("hidden", "cross_hidden", "heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
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
        """Width of the q projection (4096 in the benchmark)."""
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        """Width of the k and of the v projection (1024 in the benchmark)."""
        return self.kv_heads * self.head_dim


OFFICIAL = QkvGqaConfig()  # the benchmark operator's sizes


class QkvGqaBackward(Problem):
    id = "072"
    name = "072_cross_attention_qkv_projection_with_gqa_repeat_backward"
    workload_file = "072_qkv_gqa.jsonl"
    upstream_grads = ("grad_query_states", "grad_key_states", "grad_value_states")
    differentiates = ("decoder_hidden_states", "encoder_hidden_states", "q_weight", "k_weight", "v_weight")

    def __init__(self, config: QkvGqaConfig = OFFICIAL):
        self.config = config

    @functools.cached_property
    def inputs(self) -> tuple:
        c = self.config
        return (
            Tensor("grad_query_states", (B, c.heads, SD, c.head_dim)),
            Tensor("grad_key_states", (B, c.heads, SE, c.head_dim)),
            Tensor("grad_value_states", (B, c.heads, SE, c.head_dim)),
            Tensor("decoder_hidden_states", (B, SD, c.hidden)),
            Tensor("encoder_hidden_states", (B, SE, c.cross_hidden)),
            Tensor("q_weight", (c.q_out, c.hidden)),
            Tensor("k_weight", (c.kv_out, c.cross_hidden)),
            Tensor("v_weight", (c.kv_out, c.cross_hidden)),
        )

    @functools.cached_property
    def outputs(self) -> tuple:
        c = self.config
        return (
            Tensor("grad_decoder_hidden_states", (B, SD, c.hidden)),
            Tensor("grad_encoder_hidden_states", (B, SE, c.cross_hidden)),
            Tensor("grad_q_weight", (c.q_out, c.hidden)),
            Tensor("grad_k_weight", (c.kv_out, c.cross_hidden)),
            Tensor("grad_v_weight", (c.kv_out, c.cross_hidden)),
        )

    def draw(self, axes, gen, device):
        def normal(spec, scale):
            return torch.randn(spec.shape(axes), generator=gen, device=device) * scale

        c = self.config
        grads, dec, enc, wq, wk, wv = self.inputs[:3], *self.inputs[3:]
        return [normal(g, 1 / math.sqrt(c.q_out)) for g in grads] + [
            normal(dec, 1 / math.sqrt(c.hidden)),
            normal(enc, 1 / math.sqrt(c.cross_hidden)),
            normal(wq, 1 / math.sqrt(c.hidden)),
            normal(wk, 1 / math.sqrt(c.cross_hidden)),
            normal(wv, 1 / math.sqrt(c.cross_hidden)),
        ]

    def reference_math(self, gq, gk, gv, dec, enc, wq, wk, wv):
        c = self.config
        batch, _, sd, _ = gq.shape
        se = gk.shape[2]

        def group_sum(g):  # [B, H, Se, D] -> [B*Se, kv_out]: query head h belongs to KV head h // group
            return g.view(batch, c.kv_heads, c.group, se, c.head_dim).sum(2).transpose(1, 2).reshape(batch * se, c.kv_out)

        gq_tok = gq.transpose(1, 2).reshape(batch * sd, c.q_out)
        gk_tok, gv_tok = group_sum(gk), group_sum(gv)
        dec2 = dec.reshape(batch * sd, c.hidden)
        enc2 = enc.reshape(batch * se, c.cross_hidden)
        return (
            (gq_tok @ wq).view(batch, sd, c.hidden),
            (gk_tok @ wk + gv_tok @ wv).view(batch, se, c.cross_hidden),
            gq_tok.T @ dec2,
            gk_tok.T @ enc2,
            gv_tok.T @ enc2,
        )

    def forward(self, dec, enc, wq, wk, wv):
        c = self.config
        batch, sd, _ = dec.shape
        se = enc.shape[1]
        q = (dec @ wq.T).view(batch, sd, c.heads, c.head_dim).transpose(1, 2)

        def kv(w):
            heads = (enc @ w.T).view(batch, se, c.kv_heads, c.head_dim).transpose(1, 2)
            return heads.repeat_interleave(c.group, dim=1)

        return q, kv(wk), kv(wv)

    def macs(self, axes):
        c = self.config
        dec_tokens = axes[B] * axes[SD]
        enc_tokens = axes[B] * axes[SE]
        # grad_dec and grad_Wq; grad_enc (K = 2 kv_out over [Wk; Wv]) and [grad_Wk; grad_Wv].
        return 2 * dec_tokens * c.q_out * c.hidden + 2 * enc_tokens * 2 * c.kv_out * c.cross_hidden


PROBLEM = QkvGqaBackward()
