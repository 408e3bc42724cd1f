"""What masks a training attention beyond causality and its window, on the host: the plan's `Masking` (the
kinds of tensors each call passes) and the documents of a packed batch as the attention kernels take them
(each query's first and last visible key), from FlashAttention's `cu_seqlens`.

Nothing here imports Triton or reads a tensor's values on the host: every step is a device op, so a call
never waits for the GPU.
"""

from __future__ import annotations

import weakref
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
    documents: packed documents: each call passes `documents` [2, B, S_q] int32, each query's first and
      last visible key (`documents_from_cu_seqlens`: causality is in them, the window counts back from the
      last)."""

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


def masking_of(mask, documents) -> Masking | None:
    """The Masking of a call's mask ([B, S] key padding, or [B or 1, 1, S, S]: floating is additive) and documents."""
    if mask is None:
        return None if documents is None else Masking(documents=True)
    dense = mask.dim() == 4
    return Masking(mask="add" if dense and mask.is_floating_point() else "keep", dense=dense,
                   documents=documents is not None)


def documents_from_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """[2, 1, tokens] int32: each query's first and last visible key in FlashAttention's varlen form. Document i
    holds the queries [cu_seqlens_q[i], cu_seqlens_q[i + 1]) and the keys [cu_seqlens_k[i], cu_seqlens_k[i + 1])
    (cu_seqlens_k None: the queries'); causality is aligned to each document's last query and last key, as
    FlashAttention aligns it, so query t sees its document's keys up to t + cu_seqlens_k[i + 1] - cu_seqlens_q[i + 1]
    (t itself where the two agree). A query in no document, or before its document's first key, sees none."""
    cq = cu_seqlens_q.to(torch.int64)
    ck = cq if cu_seqlens_k is None else cu_seqlens_k.to(torch.int64)
    t = torch.arange(tokens, device=cq.device)
    doc = torch.searchsorted(cq, t, right=True) - 1
    inside = (doc >= 0) & (doc < cq.numel() - 1)
    doc = doc.clamp(0, cq.numel() - 2)
    first = torch.where(inside, ck[doc], tokens)
    last = torch.where(inside, t + ck[doc + 1] - cq[doc + 1], -1)
    return torch.stack([first, last])[:, None].to(torch.int32)



_last = [(), None]  # ((weakref, version) of the last call's cu_seqlens and cu_seqlens_k, and tokens; its documents)


def documents(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None, tokens: int, make=None) -> torch.Tensor:
    """`documents_from_cu_seqlens`, made once for the calls that pass the same tensors, unchanged (a forward's
    layers): kept for the last call's while they are alive and their version counters unmoved. Made afresh under
    torch.compile and for inference tensors (which count no versions). make: what makes it (same arguments and
    result; the kernels' one launch, `steps.packed_documents`), except under torch.compile or while a CUDA graph
    is captured, where torch's ops do."""
    tensors = (cu_seqlens_q,) if cu_seqlens_k is None else (cu_seqlens_q, cu_seqlens_k)
    compiling = torch.compiler.is_compiling()
    if make is None or compiling or (cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing()):
        make = documents_from_cu_seqlens
    if compiling or any(t.is_inference() for t in tensors):
        return make(cu_seqlens_q, cu_seqlens_k, tokens)
    key, found = _last
    if len(key) == len(tensors) + 1 and key[-1] == tokens and all(
            ref() is t and version == t._version for (ref, version), t in zip(key, tensors)):
        return found
    found = make(cu_seqlens_q, cu_seqlens_k, tokens)
    _last[:] = [(*((weakref.ref(t), t._version) for t in tensors), tokens), found]
    return found
