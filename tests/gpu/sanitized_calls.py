"""Training calls for compute-sanitizer's memcheck (`test_sanitizer.py` runs this file under it): Gemma's attention
core with every mask form at a length no tile divides (2 x 613 tokens; head sizes 256 and 128, soft cap and
window), packed documents, and Wan's cross- and self-attention (whole, and the core between projections: `wan_attention`),
forward and backward in bf16 and fp32, each call
twice (the second a template's or graph's). Runs anywhere (the interpreter without a GPU); prints "ok".

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitized_calls.py [tokens a row]
"""

import sys

import torch

import backfuse  # noqa: F401  (the interpreter on without a GPU)
from backfuse import functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gemma(dtype, b: int, s: int, head_dim: int, softcap, window: int, **masks):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden, heads, kv = 2 * head_dim, 4, 2

    def rand(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype).requires_grad_(grad)

    x = rand(b, s, hidden, scale=hidden ** -0.5)
    cos, sin = (rand(b, s, head_dim, grad=False) for _ in range(2))
    ws = [rand(heads * head_dim, hidden, scale=hidden ** -0.5), rand(kv * head_dim, hidden, scale=hidden ** -0.5),
          rand(kv * head_dim, hidden, scale=hidden ** -0.5), rand(hidden, heads * head_dim, scale=hidden ** -0.5)]
    norms = [rand(head_dim, scale=0.1), rand(head_dim, scale=0.1)]
    for _ in range(2):
        out = F.gemma3_core(x, cos, sin, *ws, *norms, head_dim ** -0.5, softcap, 1e-6, window=window, **masks)
        out.float().square().mean().backward()


def _masks(b: int, s: int) -> dict:
    i = torch.arange(s, device=DEVICE)
    causal = (i[None] <= i[:, None])[None, None].expand(b, 1, s, s).clone()
    holes = causal.clone()
    holes[:, :, s // 2:s // 2 + s // 15, s // 6:s // 5] = False
    padding = torch.ones(b, s, dtype=torch.int64, device=DEVICE)
    padding[0, :s // 8] = 0  # left
    padding[-1, s - s // 12:] = 0  # right
    additive = torch.where(holes, 0.0, torch.finfo(torch.float32).min)
    additive[:, :, :s // 15] = torch.finfo(torch.float32).min  # rows that see nothing: every key alike
    return {"padding": dict(attention_mask=padding), "bool": dict(attention_mask=causal),
            "holes": dict(attention_mask=holes), "additive": dict(attention_mask=additive)}


def _wan(dtype, self_attention: bool, nv: int):
    g = torch.Generator(device="cpu").manual_seed(1)
    hidden, heads, nt = 256, 2, 77

    def rand(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype).requires_grad_(grad)

    video = rand(1, nv, hidden)
    text = video if self_attention else rand(1, nt, hidden)
    params = [rand(hidden, hidden, scale=hidden ** -0.5) if i % 2 == 0 else rand(hidden, scale=0.1) for i in range(8)]
    extra = {}
    if self_attention:
        d = hidden // heads
        extra["rope"] = (rand(nv, d, grad=False), rand(nv, d, grad=False))
    for _ in range(2):
        out = F.wan_xattn(video, text, *params, (hidden // heads) ** -0.5, heads=heads, norm_q_weight=rand(hidden),
                          norm_k_weight=rand(hidden), **extra)
        out.float().square().mean().backward()
    q, k, v = (rand(1, n, hidden) for n in (nv, nv if self_attention else nt, nv if self_attention else nt))
    for _ in range(2):  # the core between a model's own projections
        out = F.wan_attention(q, k, v, rand(hidden), rand(hidden), (hidden // heads) ** -0.5, heads=heads, **extra)
        out.float().square().mean().backward()


def main(s: int):
    b = 2
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim, softcap, window in ((256, None, 0), (256, 50.0, 0), (128, None, s // 3)):
            _gemma(dtype, b, s, head_dim, softcap, window)
            for masks in _masks(b, s).values():
                _gemma(dtype, b, s, head_dim, softcap, window, **masks)
        cu = torch.tensor([0, s // 6, s // 2 + 3, 2 * s], dtype=torch.int32, device=DEVICE)
        _gemma(dtype, 1, 2 * s, 256, None, 0, cu_seqlens=cu)
        _wan(dtype, False, s)
        _wan(dtype, True, s)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 613)
