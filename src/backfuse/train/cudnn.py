"""cuDNN's fused attention (PyTorch's `_scaled_dot_product_cudnn_attention` ops, which SDPA and compiled
models run) for the training paths' attentions that it serves and ours does slower: bfloat16, causal
or unmasked, no soft cap, no sliding window (notes/training.md, session 33: 563 against our 990 µs
backward at Gemma 3 4B's head size 256).

Its outputs are tensors it allocates: a call records it into its CUDA graph as a
`kernels/graphs.py: Allocating` step (its memory from a pool of the recording's own), with the
launches that read its outputs after it. Operands are the training paths' token-major rows (row t
holds head h at columns h * D ... h * D + D - 1), passed as [B, heads, S, D] views; cuDNN keeps that
layout in what it returns. lse is in natural-log units, [B * heads, S] fp32.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importing backfuse imports no Triton (functional.py reads this module's switch)
    from .steps import Attention

_enabled = True
_seeds: dict = {}  # device -> (philox seed, offset): read by cuDNN only with dropout, which we never use


@contextlib.contextmanager
def cudnn_attention(enabled: bool):
    """Inside the block, plans made for bfloat16 attentions on a GPU use cuDNN's (True, the default) or
    backfuse's Triton attention (False), where both serve the call."""
    global _enabled
    saved, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = saved


def enabled() -> bool:
    return _enabled


def serves(a: Attention, compute: torch.dtype, device: torch.device, deterministic: bool) -> bool:
    """Whether a call's attention `a` with products in `compute` runs on cuDNN's kernels: on a GPU with
    cuDNN 9, bfloat16, no mask, no soft cap, no window shorter than the sequence (causal or unmasked), head size
    64, 128 or 256, and not in deterministic mode (cuDNN's backward sums dQ by atomics)."""
    return (_enabled and device.type == "cuda" and compute == torch.bfloat16 and not deterministic
            and a.masking is None and a.softcap == 0.0 and not (0 < a.window < a.s_k) and a.head_dim in (64, 128, 256)
            and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000)


def _heads(rows: torch.Tensor, batch: int, seq: int, head_dim: int) -> torch.Tensor:
    """[B, heads, S, D] view of token-major rows [B * S, heads * D] (rows any distance apart)."""
    ld = rows.stride(0)
    return rows.as_strided((batch, rows.shape[1] // head_dim, seq, head_dim), (seq * ld, head_dim, ld, 1))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Token-major rows [B * S, heads * D] of a [B, heads, S, D] result, contiguous (a copy only where cuDNN did
    not keep the layout: the kernels after it read rows with unit column stride)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h * d).contiguous()


def forward(a: Attention, q, k, v, scale: float) -> tuple:
    """(o [B * S_q, heads * D] in q's dtype, lse [B * heads, S_q] fp32) of attention a."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads(q, a.batch, a.s_q, a.head_dim), _heads(k, a.batch, a.s_k, a.head_dim), _heads(v, a.batch, a.s_k, a.head_dim),
        None, True, 0.0, a.causal, False, scale=scale)
    return _rows(out[0]), out[1].view(a.batch * a.heads, a.s_q)


def backward(a: Attention, q, k, v, o, lse, do, scale: float) -> tuple:
    """(dq, dk, dv) token-major, in q's dtype, of attention a at o, lse (`forward`'s) and upstream do."""
    seeds = _seeds.get(q.device)
    if seeds is None:
        seeds = _seeds[q.device] = (torch.zeros((), dtype=torch.int64, device=q.device),) * 2
    b, d = a.batch, a.head_dim
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _heads(do, b, a.s_q, d), _heads(q, b, a.s_q, d), _heads(k, b, a.s_k, d), _heads(v, b, a.s_k, d),
        _heads(o, b, a.s_q, d), lse.view(b, a.heads, a.s_q, 1), *seeds, None, None, None, a.s_q, a.s_k, 0.0, a.causal,
        scale=scale)
    return tuple(_rows(g) for g in grads)
