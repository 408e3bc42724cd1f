"""What a mask costs the training attention: one layer's forward + backward (`F.gemma3_core`, bfloat16, Triton
attention: cuDNN's takes no mask) at a preset's width, unmasked against each form a model passes it.

    PYTHONPATH=src python3 benchmarks/tools/mask_cost.py                 # gemma3-4b 2x4096, gemma2-9b 2x4096
    PYTHONPATH=src python3 benchmarks/tools/mask_cost.py --presets gemma3-4b --tokens 1x8192

Forms: causal (no mask: the kernels' own causality), padding (a [B, S] all-ones mask as a tokenizer gives it),
dense bool (SDPA's [B, 1, S, S] causal mask), dense additive (eager's 0 / finfo.min), the last entry left-padded
by a quarter of its tokens in either dense form (SDPA's padded queries see no key; eager's weigh every key
alike), packed (four documents by cu_seqlens, B = 1 rows of B x S tokens). Gemma 2 also with dQ by programs
(deterministic mode) against its default atomics. ms per step: steps queued back to back, one synchronization
(`bench/train.py: time_steps`).
"""

from __future__ import annotations

import argparse

import torch

import backfuse
from backfuse import functional as F
from backfuse import nn as bnn
from backfuse import presets
from backfuse.bench.train import Steps, time_steps
from backfuse.kernels import graphs


def _forms(b: int, s: int, device) -> dict:
    i = torch.arange(s, device=device)
    causal = (i[None] <= i[:, None])[None, None].expand(b, 1, s, s)
    left = causal.clone()
    left[-1, :, :, :s // 4] = False  # as transformers builds a left-padded entry's mask

    def additive(visible):
        return torch.where(visible, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)

    return {
        "causal": {},
        "padding": dict(attention_mask=torch.ones(b, s, dtype=torch.int64, device=device)),
        "dense bool": dict(attention_mask=causal),
        "dense additive": dict(attention_mask=additive(causal)),
        "left-padded bool": dict(attention_mask=left),
        "left-padded additive": dict(attention_mask=additive(left)),
        "packed": dict(cu_seqlens=torch.tensor([0, b * s // 4, b * s // 2, 3 * b * s // 4, b * s], dtype=torch.int32,
                                               device=device)),
    }


def run(preset: str, tokens: tuple, steps: int) -> list:
    b, s = tokens
    m = bnn.Gemma3Core.from_preset(preset, device="cuda", dtype=torch.bfloat16)
    c = m.config
    rows = []
    forms = list(_forms(b, s, "cuda").items())
    for form, masks in [forms[0]] + forms:  # the first form twice: its first run holds the process's first calls
        bb, ss = (1, b * s) if form == "packed" else (b, s)
        x = (torch.randn(bb, ss, c.hidden, device="cuda") / c.hidden ** 0.5).to(torch.bfloat16).requires_grad_()
        cos, sin = torch.randn(2, 1, ss, c.head_dim, device="cuda").to(torch.bfloat16)
        grad = torch.randn(bb, ss, c.hidden, device="cuda").to(torch.bfloat16)

        def call(x=x, cos=cos, sin=sin, masks=masks):
            return F.gemma3_core(x, cos, sin, m.q_weight, m.k_weight, m.v_weight, m.o_weight,
                                 getattr(m, "q_norm_weight", None), getattr(m, "k_norm_weight", None), m.scaling,
                                 m.softcap, m.eps, window=c.window, head_dim=c.head_dim, **masks)

        for variant in ("default", "dq programs") if m.softcap and form == "causal" else ("default",):
            layer = Steps([x, *m.parameters()], call, [grad])
            torch.use_deterministic_algorithms(variant == "dq programs", warn_only=True)  # no atomics: dQ programs
            try:
                with backfuse.cudnn_attention(False):
                    ms, host = time_steps(layer, warmup=3, steps=steps)
            finally:
                torch.use_deterministic_algorithms(False)
            rows.append((preset, f"{b}x{s}", form + ("" if variant == "default" else f" ({variant})"), ms, host))
            graphs.release()
    del rows[:1 + bool(m.softcap)]  # (the first form's first run)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="gemma3-4b,gemma2-9b")
    ap.add_argument("--tokens", default="2x4096", help="BxS")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split("x"))
    rows = []
    for name in args.presets.split(","):
        presets.get(name)
        rows += run(name, tokens, args.steps)
    base = {}
    print(f"{'preset':12s} {'tokens':8s} {'form':28s} {'ms':>8s} {'vs causal':>9s} {'host us':>8s}")
    for preset, tok, form, ms, host in rows:
        base.setdefault((preset, tok), ms)
        print(f"{preset:12s} {tok:8s} {form:28s} {ms:8.3f} {ms / base[(preset, tok)]:9.3f} {host:8.0f}")


if __name__ == "__main__":
    main()
