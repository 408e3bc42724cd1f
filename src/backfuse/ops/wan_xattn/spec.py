"""021 — text-to-video cross-attention conditioning, backward (Wan 2.2 T2V A14B): the operator's
signature, inputs as the suite draws them, reference and forward, at the sizes of its config
(`WanXattnConfig`; the default, `OFFICIAL`, is the benchmark operator's: the one definition of its
sizes).

Forward: Q = video @ Wq^T + bq, K = text @ Wk^T + bk, V = text @ Wv^T + bv (16 heads of 64),
P = softmax(scale * Q K^T) over the text tokens (no mask), C = P V token-major, out = C Wo^T + bo.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...problem import Problem, Scalar, Tensor, is_int

HEAD_SIZES = (16, 32, 64, 128, 256)  # what the training path's attention kernels take


@dataclass(frozen=True)
class WanXattnConfig:
    """The sizes of one Wan-style cross-attention: the model width (video and text tokens alike), its
    heads (head size hidden / heads), and whether q and k are RMS-normed across all heads with weights
    (Wan 2.1 / 2.2's `norm_q`, `norm_k`; the benchmark operator has none). The default is the benchmark
    operator's (`OFFICIAL`)."""

    # The benchmark operator's sizes: the one place they are written (spec, plan and kernels read them here).
    hidden: int = 1024
    heads: int = 16
    qk_norm: bool = False

    def __post_init__(self):
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"WanXattnConfig.qk_norm must be True or False, got {self.qk_norm!r}")
        for name in ("hidden", "heads"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"WanXattnConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"WanXattnConfig: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.head_dim not in HEAD_SIZES:
            raise ValueError(f"WanXattnConfig: head size hidden / heads = {self.head_dim}; the kernels take "
                             f"{', '.join(map(str, HEAD_SIZES))}")

    @property
    def head_dim(self) -> int:
        """64 in the benchmark."""
        return self.hidden // self.heads


OFFICIAL = WanXattnConfig()  # the benchmark operator's sizes

B, NV, NT = "batch_size", "num_video_tokens", "num_text_tokens"


class WanXattnBackward(Problem):
    id = "021"
    name = "021_cross_attention_text_video_conditioning_backward"
    workload_file = "021_wan_xattn.jsonl"
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

    def __init__(self, config: WanXattnConfig = OFFICIAL):
        if config.qk_norm:
            raise ValueError(f"{self.name}: the operator has no q/k norm; got {config}")
        self.config = config

    @functools.cached_property
    def inputs(self) -> tuple:
        h = self.config.hidden
        return (
            Tensor("grad_output", (B, NV, h)),
            Tensor("video_latents", (B, NV, h)),
            Tensor("text_embeddings", (B, NT, h)),
            Tensor("query_weight", (h, h)),
            Tensor("query_bias", (h,)),
            Tensor("key_weight", (h, h)),
            Tensor("key_bias", (h,)),
            Tensor("value_weight", (h, h)),
            Tensor("value_bias", (h,)),
            Tensor("output_weight", (h, h)),
            Tensor("output_bias", (h,)),
            Scalar("scale", 1 / math.sqrt(self.config.head_dim)),
        )

    @functools.cached_property
    def outputs(self) -> tuple:
        h = self.config.hidden
        return (
            Tensor("grad_video_latents", (B, NV, h)),
            Tensor("grad_text_embeddings", (B, NT, h)),
            Tensor("grad_query_weight", (h, h)),
            Tensor("grad_query_bias", (h,)),
            Tensor("grad_key_weight", (h, h)),
            Tensor("grad_key_bias", (h,)),
            Tensor("grad_value_weight", (h, h)),
            Tensor("grad_value_bias", (h,)),
            Tensor("grad_output_weight", (h, h)),
            Tensor("grad_output_bias", (h,)),
        )

    def draw(self, axes, gen, device):
        # Weights ~ N(0, 1/hidden); biases, activations and grad_output ~ N(0, 1).
        return [
            torch.randn(spec.shape(axes), generator=gen, device=device)
            * (1 / math.sqrt(self.config.hidden) if spec.name.endswith("_weight") else 1.0)
            for spec in self.inputs
            if isinstance(spec, Tensor)
        ]

    def _heads(self, t, batch):
        return t.view(batch, -1, self.config.heads, self.config.head_dim).transpose(1, 2)

    def _tokens(self, t):
        batch, _, n, _ = t.shape
        return t.transpose(1, 2).reshape(batch * n, self.config.hidden)

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
        hidden = self.config.hidden
        go2 = go.reshape(-1, hidden)
        video2, text2 = video.reshape(-1, hidden), text.reshape(-1, hidden)
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
        hidden = self.config.hidden
        projections = (5 * video_tokens + 6 * text_tokens) * hidden * hidden
        return projections + 6 * axes[B] * axes[NV] * axes[NT] * hidden


PROBLEM = WanXattnBackward()
