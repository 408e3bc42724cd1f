"""037 — QK-norm + RoPE attention core, backward (Gemma 3 4B): the operator's signature, inputs as
the suite draws them, reference and forward, at the sizes of its config (`Gemma3CoreConfig`; the
default, `OFFICIAL`, is the benchmark operator's: the one definition of its sizes).

Forward: q, k, v projections; Gemma RMSNorm per head on q and k (weight applied as 1 + w); RoPE
(rotate-half) after the norm; soft-capped, causal, GQA (3 query heads per KV head) attention.
The backward recomputes the forward from X, then runs attention, RoPE and RMSNorm backward and the
six projection products.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...problem import Problem, Scalar, Tensor, is_int

ROPE_THETA = 10000.0  # the base of the RoPE tables the suite draws

B, S = "batch_size", "seq_len"
HEAD_SIZES = (16, 32, 64, 128, 256)  # what the training path's attention kernels take


@dataclass(frozen=True)
class Gemma3CoreConfig:
    """The sizes of one Gemma-style attention core: model width, query heads, KV heads (each serving
    heads / kv_heads query heads), head size, the sliding window of its local layers (0: global,
    causal over every earlier token; w > 0: each query sees its w latest tokens, itself included), and
    whether q and k are RMS-normed per head (Gemma 3; Gemma 2 has no QK norm). The default is the
    benchmark operator's (`OFFICIAL`)."""

    # The benchmark operator's sizes: the one place they are written (spec, plan and kernels read them here).
    hidden: int = 3072
    heads: int = 24
    kv_heads: int = 8
    head_dim: int = 128
    window: int = 0
    qk_norm: bool = True

    def __post_init__(self):
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"Gemma3CoreConfig.qk_norm must be True or False, got {self.qk_norm!r}")
        for name in ("hidden", "heads", "kv_heads", "head_dim", "window"):
            value = getattr(self, name)
            if not is_int(value) or value < (0 if name == "window" else 1):
                raise ValueError(f"Gemma3CoreConfig.{name} must be a {'non-negative' if name == 'window' else 'positive'} "
                                 f"int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"Gemma3CoreConfig: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim not in HEAD_SIZES:
            raise ValueError(f"Gemma3CoreConfig: head_dim {self.head_dim}; the kernels take "
                             f"{', '.join(map(str, HEAD_SIZES))}")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def half(self) -> int:
        """Half a head: the feature pairs RoPE rotates together are (i, i + half)."""
        return self.head_dim // 2

    @property
    def q_out(self) -> int:
        """Width of the q projection (3072 in the benchmark)."""
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        """Width of the k and of the v projection (1024 in the benchmark)."""
        return self.kv_heads * self.head_dim

    @property
    def qk(self) -> int:
        """Width of [q | k], the heads that are normed and rotated (4096 in the benchmark)."""
        return self.q_out + self.kv_out

    @property
    def qkv(self) -> int:
        """Width of the stacked [q | k | v] projection (5120 in the benchmark)."""
        return self.qk + self.kv_out


OFFICIAL = Gemma3CoreConfig()  # the benchmark operator's sizes


def rotate_half(x):
    """rot(x) = concat(-x[half:], x[:half]) over the last dim (a head; half: its size / 2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_transposed(y):
    """rot^T(y) = concat(y[half:], -y[:half]) over the last dim."""
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


def rope_tables(batch: int, seq: int, head_dim: int, device) -> tuple:
    """Real RoPE tables: angle(pos, i) = pos * theta^(-i/half) for i < half = head_dim / 2,
    concatenated twice to head_dim features."""
    half = head_dim // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)

    def table(t):
        return t.to(torch.float32).expand(batch, seq, head_dim).contiguous().to(device)

    return table(angles.cos()), table(angles.sin())


class Gemma3CoreBackward(Problem):
    id = "037"
    name = "037_qk_norm_rope_attention_core_backward"
    workload_file = "037_gemma3_core.jsonl"
    upstream_grads = ("grad_output",)
    differentiates = ("hidden_states", "q_weight", "k_weight", "v_weight", "o_weight", "q_norm_weight", "k_norm_weight")

    def __init__(self, config: Gemma3CoreConfig = OFFICIAL):
        if config.window or not config.qk_norm:
            raise ValueError(f"{self.name}: the operator is causal over every earlier token (window 0), with the QK "
                             f"norm; got {config}")
        self.config = config

    @functools.cached_property
    def inputs(self) -> tuple:
        c = self.config
        return (
            Tensor("grad_output", (B, S, c.hidden)),
            Tensor("hidden_states", (B, S, c.hidden)),
            Tensor("cos", (B, S, c.head_dim)),
            Tensor("sin", (B, S, c.head_dim)),
            Tensor("q_weight", (c.q_out, c.hidden)),
            Tensor("k_weight", (c.kv_out, c.hidden)),
            Tensor("v_weight", (c.kv_out, c.hidden)),
            Tensor("o_weight", (c.hidden, c.q_out)),
            Tensor("q_norm_weight", (c.head_dim,)),
            Tensor("k_norm_weight", (c.head_dim,)),
            Scalar("scaling", 1 / math.sqrt(c.head_dim)),
            Scalar("attn_logit_softcapping", 50.0, nonzero=True),  # the benchmark's op divides by it
            Scalar("rms_norm_eps", 1e-6),
        )

    @functools.cached_property
    def outputs(self) -> tuple:
        c = self.config
        return (
            Tensor("grad_hidden_states", (B, S, c.hidden)),
            Tensor("grad_q_weight", (c.q_out, c.hidden)),
            Tensor("grad_k_weight", (c.kv_out, c.hidden)),
            Tensor("grad_v_weight", (c.kv_out, c.hidden)),
            Tensor("grad_o_weight", (c.hidden, c.q_out)),
            Tensor("grad_q_norm_weight", (c.head_dim,)),
            Tensor("grad_k_norm_weight", (c.head_dim,)),
        )

    def draw(self, axes, gen, device):
        def normal(spec, scale):
            return torch.randn(spec.shape(axes), generator=gen, device=device) * scale

        c = self.config
        go, x, _, _, wq, wk, wv, wo, qnw, knw = self.inputs[:10]
        grad_output = normal(go, 1.0)
        hidden = normal(x, 1 / math.sqrt(c.hidden))
        cos, sin = rope_tables(axes[B], axes[S], c.head_dim, device)
        weights = [normal(w, math.sqrt(2 / c.hidden)) for w in (wq, wk, wv, wo)]
        return [grad_output, hidden, cos, sin, *weights, normal(qnw, 0.02), normal(knw, 0.02)]

    def _project(self, x, cos, sin, wq, wk, wv, qnw, knw, eps):
        """Forward up to the attention inputs, keeping what the backward needs."""
        c = self.config
        batch, seq, _ = x.shape
        x2 = x.reshape(batch * seq, c.hidden)

        def heads(t, n):
            return t.view(batch, seq, n, c.head_dim).transpose(1, 2)

        cos, sin = cos[:, None], sin[:, None]

        def norm_rope(raw, w):
            r = torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + eps)
            normed = raw * r
            hat = normed * (1 + w)
            return dict(raw=raw, r=r, normed=normed, rotated=hat * cos + rotate_half(hat) * sin)

        q = norm_rope(heads(x2 @ wq.T, c.heads), qnw)
        k = norm_rope(heads(x2 @ wk.T, c.kv_heads), knw)
        v = heads(x2 @ wv.T, c.kv_heads)
        return x2, q, k, v

    @staticmethod
    def _attention_probs(qr, kr, scaling, cap):
        seq = qr.shape[2]
        z = (qr @ kr.transpose(-1, -2)) * scaling
        t = torch.tanh(z / cap)
        masked = torch.ones(seq, seq, dtype=torch.bool, device=qr.device).triu(1)
        return t, torch.softmax((t * cap).masked_fill(masked, float("-inf")), dim=-1)

    def reference_math(self, go, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps):
        c = self.config
        batch, seq, _ = x.shape
        x2, q, k, v = self._project(x, cos, sin, wq, wk, wv, qnw, knw, eps)
        kr = k["rotated"].repeat_interleave(c.group, dim=1)  # query head h reads KV head h // group
        vr = v.repeat_interleave(c.group, dim=1)
        t, p = self._attention_probs(q["rotated"], kr, scaling, cap)

        def tokens(t_heads):
            return t_heads.transpose(1, 2).reshape(batch * seq, -1)

        go2 = go.reshape(batch * seq, c.hidden)
        grad_wo = go2.T @ tokens(p @ vr)
        d_out = (go2 @ wo).view(batch, seq, c.heads, c.head_dim).transpose(1, 2)

        dp = d_out @ vr.transpose(-1, -2)
        dv_per_q = p.transpose(-1, -2) @ d_out
        dc = p * (dp - (dp * p).sum(-1, keepdim=True))
        ds = dc * (1 - t * t) * scaling
        dqr = ds @ kr
        dkr_per_q = ds.transpose(-1, -2) @ q["rotated"]

        def group_sum(g):
            return g.view(batch, c.kv_heads, c.group, seq, c.head_dim).sum(2)

        cos_h, sin_h = cos[:, None], sin[:, None]

        def rope_norm_backward(d_rot, state, w):
            d_hat = d_rot * cos_h + rotate_half_transposed(d_rot * sin_h)
            grad_w = (d_hat * state["normed"]).sum((0, 1, 2))
            m = d_hat * (1 + w)
            r, raw = state["r"], state["raw"]
            d_raw = r * m - (r**3 / c.head_dim) * raw * (m * raw).sum(-1, keepdim=True)
            return d_raw, grad_w

        dq, grad_qnw = rope_norm_backward(dqr, q, qnw)
        dk, grad_knw = rope_norm_backward(group_sum(dkr_per_q), k, knw)
        gq, gk, gv = tokens(dq), tokens(dk), tokens(group_sum(dv_per_q))
        grad_x = gq @ wq + gk @ wk + gv @ wv
        return (
            grad_x.view(batch, seq, c.hidden),
            gq.T @ x2,
            gk.T @ x2,
            gv.T @ x2,
            grad_wo,
            grad_qnw,
            grad_knw,
        )

    def forward(self, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps):
        c = self.config
        batch, seq, _ = x.shape
        _, q, k, v = self._project(x, cos, sin, wq, wk, wv, qnw, knw, eps)
        kr = k["rotated"].repeat_interleave(c.group, dim=1)
        _, p = self._attention_probs(q["rotated"], kr, scaling, cap)
        attn = (p @ v.repeat_interleave(c.group, dim=1)).transpose(1, 2).reshape(batch, seq, c.q_out)
        return attn @ wo.T

    def macs(self, axes):
        c = self.config
        tokens = axes[B] * axes[S]
        # Forward QKV (qkv wide), dA and grad_Wo, grad_hidden and grad_[Wq;Wk;Wv].
        projections = tokens * c.hidden * (c.qkv + 2 * c.q_out + 2 * c.qkv)
        # Six attention products (QK^T, PV, dP, dV, dQ, dK) over the causal triangle.
        causal_pairs = axes[S] * (axes[S] + 1) // 2
        return projections + 6 * axes[B] * c.heads * causal_pairs * c.head_dim


PROBLEM = Gemma3CoreBackward()
