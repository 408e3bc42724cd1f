"""What masks a training attention beyond causality and its window, on the host: the plan's `Masking` (the
kinds of tensors each call passes) and the documents of a packed batch as the attention kernels take them
(each token's document start), from FlashAttention's `cu_seqlens` or from position ids that restart.

Nothing here imports Triton or reads a tensor's values on the host: every step is a device op, so a call
never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Masking:
    """What masks an attention beyond its causality and window, as far as its plan knows: the kinds of
    tensors each call passes (their values are the call's own).

    mask: None; "keep", a 0/1 (bool, integer or float) mask, nonzero where a key is visible; "add", an
      additive float mask (visible where above -1e38, its value added to the logits, as eager attention
      does).
    dense: the mask is [B or 1, 1, S_q, S_k], every (query, key) pair's (what transformers builds and
      passes its attention: causality, window, padding, packed documents, image blocks all in it; the
      plan's causal and window then take no part), else [B, S_k], a key padding mask.
    documents: packed documents: each call passes `starts` [B, S_q] int32, the first token of each
      query's document (a query sees no key before it)."""

    mask: str | None = None
    dense: bool = False
    documents: bool = False

    def __post_init__(self):
        if self.mask not in (None, "keep", "add") or (self.dense and self.mask is None) or (self.dense and self.documents):
            raise ValueError(f"Masking: mask must be None, 'keep' or 'add', dense needs a mask and no documents, "
                             f"got {self}")

    @property
    def mode(self) -> int:
        """The attention kernels' MASK (kernels/triton/attention.py)."""
        return {None: 1, "keep": 2, "add": 3}[self.mask]


def masking_of(mask, starts) -> Masking | None:
    """The Masking of a call's mask ([B, S] key padding, or [B or 1, 1, S, S]: floating is additive) and starts."""
    if mask is None:
        return None if starts is None else Masking(documents=True)
    dense = mask.dim() == 4
    return Masking(mask="add" if dense and mask.is_floating_point() else "keep", dense=dense, documents=starts is not None)


def starts_from_cu_seqlens(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[1, tokens] int32: each token's document start, documents [cu_seqlens[i], cu_seqlens[i + 1]) (FlashAttention's
    varlen form); tokens past the last document form one more."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(tokens, device=cu.device)
    doc = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, cu.numel() - 1)
    return cu[doc].to(torch.int32)[None]


def starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] int32: each token's document start, a document beginning wherever a position is not its
    predecessor's plus one (transformers' rule for packed sequences, `find_packed_sequence_indices`)."""
    pos = position_ids.to(torch.int64)
    t = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return torch.where(starts, t, 0).cummax(-1).values.to(torch.int32)
