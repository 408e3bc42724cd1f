"""037 — QK-norm + RoPE attention core, backward (Gemma 3 4B): the operator's signature, inputs as
the suite draws them, reference and forward.

Forward: q, k, v projections; Gemma RMSNorm per head on q and k (weight applied as 1 + w); RoPE
(rotate-half) after the norm; soft-capped, causal, GQA (3 query heads per KV head) attention.
The backward recomputes the forward from X, then runs attention, RoPE and RMSNorm backward and the
six projection products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...problem import Problem, Scalar, Tensor

HIDDEN = 3072
HEADS = 24
KV_HEADS = 8
GROUP = HEADS // KV_HEADS
HEAD_DIM = 128
HALF = HEAD_DIM // 2
Q_OUT = HEADS * HEAD_DIM  # 3072
KV_OUT = KV_HEADS * HEAD_DIM  # 1024
QK = Q_OUT + KV_OUT  # 4096: the q and k heads, which are normed and rotated
QKV = QK + KV_OUT  # 5120: width of the stacked [q | k | v] projection
ROPE_THETA = 10000.0

B, S = "batch_size", "seq_len"
HEAD_SIZES = (16, 32, 64, 128, 256)  # what the training path's attention kernels take


@dataclass(frozen=True)
class Gemma3CoreConfig:
    """The sizes of one Gemma-style attention core: model width, query heads, KV heads (each serving
    heads / kv_heads query heads), head size, the sliding window of its local layers (0: global,
    causal over every earlier token; w > 0: each query sees its w latest tokens, itself included), and
    whether q and k are RMS-normed per head (Gemma 3; Gemma 2 has no QK norm). The default is the
    benchmark operator's."""

    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    window: int = 0
    qk_norm: bool = True

    def __post_init__(self):
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"Gemma3CoreConfig.qk_norm must be True or False, got {self.qk_norm!r}")
        for name in ("hidden", "heads", "kv_heads", "head_dim", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "window" else 1):
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
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim


OFFICIAL = Gemma3CoreConfig()


def rotate_half(x):
    """rot(x) = concat(-x[64:], x[:64])."""
    return torch.cat((-x[..., HALF:], x[..., :HALF]), dim=-1)


def rotate_half_transposed(y):
    """rot^T(y) = concat(y[64:], -y[:64])."""
    return torch.cat((y[..., HALF:], -y[..., :HALF]), dim=-1)


def rope_tables(batch: int, seq: int, device) -> tuple:
    """Real RoPE tables: angle(pos, i) = pos * theta^(-i/64), concatenated twice to 128 features."""
    inv_freq = ROPE_THETA ** (-torch.arange(HALF, dtype=torch.float64) / HALF)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)

    def table(t):
        return t.to(torch.float32).expand(batch, seq, HEAD_DIM).contiguous().to(device)

    return table(angles.cos()), table(angles.sin())


class Gemma3CoreBackward(Problem):
    id = "037"
    name = "037_qk_norm_rope_attention_core_backward"
    workload_file = "037_gemma3_core.jsonl"
    inputs = (
        Tensor("grad_output", (B, S, HIDDEN)),
        Tensor("hidden_states", (B, S, HIDDEN)),
        Tensor("cos", (B, S, HEAD_DIM)),
        Tensor("sin", (B, S, HEAD_DIM)),
        Tensor("q_weight", (Q_OUT, HIDDEN)),
        Tensor("k_weight", (KV_OUT, HIDDEN)),
        Tensor("v_weight", (KV_OUT, HIDDEN)),
        Tensor("o_weight", (HIDDEN, Q_OUT)),
        Tensor("q_norm_weight", (HEAD_DIM,)),
        Tensor("k_norm_weight", (HEAD_DIM,)),
        Scalar("scaling", 1 / math.sqrt(HEAD_DIM)),
        Scalar("attn_logit_softcapping", 50.0, nonzero=True),  # the benchmark's op divides by it
        Scalar("rms_norm_eps", 1e-6),
    )
    outputs = (
        Tensor("grad_hidden_states", (B, S, HIDDEN)),
        Tensor("grad_q_weight", (Q_OUT, HIDDEN)),
        Tensor("grad_k_weight", (KV_OUT, HIDDEN)),
        Tensor("grad_v_weight", (KV_OUT, HIDDEN)),
        Tensor("grad_o_weight", (HIDDEN, Q_OUT)),
        Tensor("grad_q_norm_weight", (HEAD_DIM,)),
        Tensor("grad_k_norm_weight", (HEAD_DIM,)),
    )
    upstream_grads = ("grad_output",)
    differentiates = ("hidden_states", "q_weight", "k_weight", "v_weight", "o_weight", "q_norm_weight", "k_norm_weight")

    def draw(self, axes, gen, device):
        def normal(spec, scale):
            return torch.randn(spec.shape(axes), generator=gen, device=device) * scale

        go, x, _, _, wq, wk, wv, wo, qnw, knw = self.inputs[:10]
        grad_output = normal(go, 1.0)
        hidden = normal(x, 1 / math.sqrt(HIDDEN))
        cos, sin = rope_tables(axes[B], axes[S], device)
        weights = [normal(w, math.sqrt(2 / HIDDEN)) for w in (wq, wk, wv, wo)]
        return [grad_output, hidden, cos, sin, *weights, normal(qnw, 0.02), normal(knw, 0.02)]

    def _project(self, x, cos, sin, wq, wk, wv, qnw, knw, eps):
        """Forward up to the attention inputs, keeping what the backward needs."""
        batch, seq, _ = x.shape
        x2 = x.reshape(batch * seq, HIDDEN)

        def heads(t, n):
            return t.view(batch, seq, n, HEAD_DIM).transpose(1, 2)

        cos, sin = cos[:, None], sin[:, None]

        def norm_rope(raw, w):
            r = torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + eps)
            normed = raw * r
            hat = normed * (1 + w)
            return dict(raw=raw, r=r, normed=normed, rotated=hat * cos + rotate_half(hat) * sin)

        q = norm_rope(heads(x2 @ wq.T, HEADS), qnw)
        k = norm_rope(heads(x2 @ wk.T, KV_HEADS), knw)
        v = heads(x2 @ wv.T, KV_HEADS)
        return x2, q, k, v

    @staticmethod
    def _attention_probs(qr, kr, scaling, cap):
        seq = qr.shape[2]
        z = (qr @ kr.transpose(-1, -2)) * scaling
        t = torch.tanh(z / cap)
        masked = torch.ones(seq, seq, dtype=torch.bool, device=qr.device).triu(1)
        return t, torch.softmax((t * cap).masked_fill(masked, float("-inf")), dim=-1)

    def reference_math(self, go, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps):
        batch, seq, _ = x.shape
        x2, q, k, v = self._project(x, cos, sin, wq, wk, wv, qnw, knw, eps)
        kr = k["rotated"].repeat_interleave(GROUP, dim=1)  # query head h reads KV head h // 3
        vr = v.repeat_interleave(GROUP, dim=1)
        t, p = self._attention_probs(q["rotated"], kr, scaling, cap)

        def tokens(t_heads):
            return t_heads.transpose(1, 2).reshape(batch * seq, -1)

        go2 = go.reshape(batch * seq, HIDDEN)
        grad_wo = go2.T @ tokens(p @ vr)
        d_out = (go2 @ wo).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)

        dp = d_out @ vr.transpose(-1, -2)
        dv_per_q = p.transpose(-1, -2) @ d_out
        dc = p * (dp - (dp * p).sum(-1, keepdim=True))
        ds = dc * (1 - t * t) * scaling
        dqr = ds @ kr
        dkr_per_q = ds.transpose(-1, -2) @ q["rotated"]

        def group_sum(g):
            return g.view(batch, KV_HEADS, GROUP, seq, HEAD_DIM).sum(2)

        cos_h, sin_h = cos[:, None], sin[:, None]

        def rope_norm_backward(d_rot, state, w):
            d_hat = d_rot * cos_h + rotate_half_transposed(d_rot * sin_h)
            grad_w = (d_hat * state["normed"]).sum((0, 1, 2))
            m = d_hat * (1 + w)
            r, raw = state["r"], state["raw"]
            d_raw = r * m - (r**3 / HEAD_DIM) * raw * (m * raw).sum(-1, keepdim=True)
            return d_raw, grad_w

        dq, grad_qnw = rope_norm_backward(dqr, q, qnw)
        dk, grad_knw = rope_norm_backward(group_sum(dkr_per_q), k, knw)
        gq, gk, gv = tokens(dq), tokens(dk), tokens(group_sum(dv_per_q))
        grad_x = gq @ wq + gk @ wk + gv @ wv
        return (
            grad_x.view(batch, seq, HIDDEN),
            gq.T @ x2,
            gk.T @ x2,
            gv.T @ x2,
            grad_wo,
            grad_qnw,
            grad_knw,
        )

    def forward(self, x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, cap, eps):
        batch, seq, _ = x.shape
        _, q, k, v = self._project(x, cos, sin, wq, wk, wv, qnw, knw, eps)
        kr = k["rotated"].repeat_interleave(GROUP, dim=1)
        _, p = self._attention_probs(q["rotated"], kr, scaling, cap)
        attn = (p @ v.repeat_interleave(GROUP, dim=1)).transpose(1, 2).reshape(batch, seq, Q_OUT)
        return attn @ wo.T

    def macs(self, axes):
        tokens = axes[B] * axes[S]
        # Forward QKV (5120 wide), dA and grad_Wo, grad_hidden and grad_[Wq;Wk;Wv].
        projections = tokens * HIDDEN * (5120 + 2 * Q_OUT + 2 * 5120)
        # Six attention products (QK^T, PV, dP, dV, dQ, dK) over the causal triangle.
        causal_pairs = axes[S] * (axes[S] + 1) // 2
        return projections + 6 * axes[B] * HEADS * causal_pairs * HEAD_DIM


PROBLEM = Gemma3CoreBackward()
