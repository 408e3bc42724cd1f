"""021 — text-to-video cross-attention conditioning, backward (Wan 2.2 T2V A14B): the operator's
signature, inputs as the suite draws them, reference and forward.

Forward: Q = video @ Wq^T + bq, K = text @ Wk^T + bk, V = text @ Wv^T + bv (16 heads of 64),
P = softmax(scale * Q K^T) over the text tokens (no mask), C = P V token-major, out = C Wo^T + bo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...problem import Problem, Scalar, Tensor

HIDDEN = 1024
HEADS = 16
HEAD_DIM = 64
HEAD_SIZES = (16, 32, 64, 128, 256)  # what the training path's attention kernels take


@dataclass(frozen=True)
class WanXattnConfig:
    """The sizes of one Wan-style cross-attention: the model width (video and text tokens alike), its
    heads (head size hidden / heads), and whether q and k are RMS-normed across all heads with weights
    (Wan 2.1 / 2.2's `norm_q`, `norm_k`; the benchmark operator has none). The default is the benchmark
    operator's."""

    hidden: int = HIDDEN
    heads: int = HEADS
    qk_norm: bool = False

    def __post_init__(self):
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"WanXattnConfig.qk_norm must be True or False, got {self.qk_norm!r}")
        for name in ("hidden", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WanXattnConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"WanXattnConfig: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.head_dim not in HEAD_SIZES:
            raise ValueError(f"WanXattnConfig: head size hidden / heads = {self.head_dim}; the kernels take "
                             f"{', '.join(map(str, HEAD_SIZES))}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


OFFICIAL = WanXattnConfig()

B, NV, NT = "batch_size", "num_video_tokens", "num_text_tokens"


class WanXattnBackward(Problem):
    id = "021"
    name = "021_cross_attention_text_video_conditioning_backward"
    workload_file = "021_wan_xattn.jsonl"
    inputs = (
        Tensor("grad_output", (B, NV, HIDDEN)),
        Tensor("video_latents", (B, NV, HIDDEN)),
        Tensor("text_embeddings", (B, NT, HIDDEN)),
        Tensor("query_weight", (HIDDEN, HIDDEN)),
        Tensor("query_bias", (HIDDEN,)),
        Tensor("key_weight", (HIDDEN, HIDDEN)),
        Tensor("key_bias", (HIDDEN,)),
        Tensor("value_weight", (HIDDEN, HIDDEN)),
        Tensor("value_bias", (HIDDEN,)),
        Tensor("output_weight", (HIDDEN, HIDDEN)),
        Tensor("output_bias", (HIDDEN,)),
        Scalar("scale", 1 / math.sqrt(HEAD_DIM)),
    )
    outputs = (
        Tensor("grad_video_latents", (B, NV, HIDDEN)),
        Tensor("grad_text_embeddings", (B, NT, HIDDEN)),
        Tensor("grad_query_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_query_bias", (HIDDEN,)),
        Tensor("grad_key_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_key_bias", (HIDDEN,)),
        Tensor("grad_value_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_value_bias", (HIDDEN,)),
        Tensor("grad_output_weight", (HIDDEN, HIDDEN)),
        Tensor("grad_output_bias", (HIDDEN,)),
    )
    upstream_grads = ("grad_output",)
    differentiates = (
        "video_latents",
        "text_embeddings",
        "query_weight",
        "query_bias",
        "key_weight",
        "key_bias",
        "value_weight",
        "value_bias",
        "output_weight",
        "output_bias",
    )

    def draw(self, axes, gen, device):
        # Weights ~ N(0, 1/1024); biases, activations and grad_output ~ N(0, 1).
        return [
            torch.randn(spec.shape(axes), generator=gen, device=device)
            * (1 / math.sqrt(HIDDEN) if spec.name.endswith("_weight") else 1.0)
            for spec in self.inputs
            if isinstance(spec, Tensor)
        ]

    @staticmethod
    def _heads(t, batch):
        return t.view(batch, -1, HEADS, HEAD_DIM).transpose(1, 2)

    @staticmethod
    def _tokens(t):
        batch, _, n, _ = t.shape
        return t.transpose(1, 2).reshape(batch * n, HIDDEN)

    def _attention(self, video, text, wq, bq, wk, bk, wv, bv, scale):
        batch = video.shape[0]
        q = self._heads(video @ wq.T + bq, batch)
        k = self._heads(text @ wk.T + bk, batch)
        v = self._heads(text @ wv.T + bv, batch)
        p = torch.softmax(scale * (q @ k.transpose(-1, -2)), dim=-1)
        return q, k, v, p

    def reference_math(self, go, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale):
        batch = video.shape[0]
        q, k, v, p = self._attention(video, text, wq, bq, wk, bk, wv, bv, scale)
        go2 = go.reshape(-1, HIDDEN)
        video2, text2 = video.reshape(-1, HIDDEN), text.reshape(-1, HIDDEN)
        grad_wo = go2.T @ self._tokens(p @ v)
        d_ctx = self._heads(go2 @ wo, batch)
        dp = d_ctx @ v.transpose(-1, -2)
        dv = self._tokens(p.transpose(-1, -2) @ d_ctx)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq = self._tokens(ds @ k)
        dk = self._tokens(ds.transpose(-1, -2) @ q)
        return (
            (dq @ wq).view(video.shape),
            (dk @ wk + dv @ wv).view(text.shape),
            dq.T @ video2,
            dq.sum(0),
            dk.T @ text2,
            dk.sum(0),
            dv.T @ text2,
            dv.sum(0),
            grad_wo,
            go2.sum(0),
        )

    def forward(self, video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale):
        _, _, v, p = self._attention(video, text, wq, bq, wk, bk, wv, bv, scale)
        return (p @ v).transpose(1, 2).reshape(video.shape) @ wo.T + bo

    def macs(self, axes):
        video_tokens = axes[B] * axes[NV]
        text_tokens = axes[B] * axes[NT]
        # Video side: Q forward, dC, grad_Wo, grad_video, grad_Wq. Text side: K and V forward,
        # grad_text (two), grad_Wk, grad_Wv. Attention: QK^T, PV, dP, dV, dQ, dK.
        projections = (5 * video_tokens + 6 * text_tokens) * HIDDEN * HIDDEN
        return projections + 6 * axes[B] * axes[NV] * axes[NT] * HIDDEN


PROBLEM = WanXattnBackward()
