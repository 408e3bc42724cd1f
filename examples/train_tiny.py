"""Train each backfuse module for a few steps next to a plain-PyTorch twin; the losses should match.

    python examples/train_tiny.py [--steps 5] [--blocks 072,021,037]

Both twins start from the same parameters and see the same random batch and targets; the twin
differentiates the operator's plain PyTorch forward with autograd, ours runs backfuse's fused forward
and backward (fp16 tensor-core products with fp32 accumulation on these float32 tensors). The loss is
mean-reduced, so the upstream gradients are below what fp16 holds well; backfuse scales them by a
power of two on the device. Without a CUDA GPU the fused kernels run in the Triton interpreter (slow,
hence the tiny shapes: the defaults take about 80 s on 2 CPU cores).

What it prints, per block: the operator's name, then one line per step (the step, the loss of the
backfuse module, the loss of the plain-PyTorch twin, their relative difference), then the count of
fp16 range warnings (0: a warning would be shown after it). With the defaults on a CPU, the losses of
072 and 021 agree to about 1e-5 at every step (072's falls 3.01 -> 2.95, 021's 1.25 -> 0.79); 037's
large learning rate makes its loss fall about threefold (1.00 -> 0.31) and amplifies the gradients'
~1e-3 rounding, so its two losses drift apart to about 3e-3 by the fifth step.
"""

import argparse
import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import backfuse  # noqa: E402
from backfuse import nn as bnn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = {  # module, axes of the batch (the twin differentiates that problem's forward), SGD learning rate
    "072": (bnn.QkvGqa, dict(batch_size=2, seq_len_dec=6, seq_len_enc=5), 50.0),
    "021": (bnn.WanXattn, dict(batch_size=2, num_video_tokens=9, num_text_tokens=7), 1.0),
    "037": (bnn.Gemma3Core, dict(batch_size=1, seq_len=6), 100.0),
}

SCALARS = {"scale": "scale", "scaling": "scaling", "attn_logit_softcapping": "softcap", "rms_norm_eps": "eps"}  # input: attribute


def train(pid: str, steps: int) -> list:
    """Prints and returns [(loss of ours, loss of the twin)] per step; shows backfuse's range warnings."""
    module_cls, axes, lr = BLOCKS[pid]
    prob = backfuse.problem(pid)
    torch.manual_seed(0)
    ours = module_cls(device=DEVICE)
    twin_params = {n: p.detach().clone().requires_grad_(True) for n, p in ours.named_parameters()}
    inputs = dict(zip(prob.input_names, prob.make_inputs(axes, seed=1, device=DEVICE)))
    activations = [inputs[n] for n in prob.input_names
                   if n not in prob.upstream_grads and n not in twin_params and isinstance(inputs[n], torch.Tensor)]
    scalars = [getattr(ours, SCALARS[s.name]) for s in prob.forward_inputs if s.name in SCALARS]
    targets = [torch.randn_like(o) for o in _as_tuple(ours(*activations))]
    opt_ours = torch.optim.SGD(ours.parameters(), lr=lr)
    opt_twin = torch.optim.SGD(twin_params.values(), lr=lr)

    def twin_forward():
        named = {**inputs, **twin_params}
        fwd = [named[n] for n in prob.input_names if n not in prob.upstream_grads and not isinstance(named[n], float)]
        return prob.forward(*fwd, *scalars)

    print(f"{prob.name}: step, loss (backfuse), loss (plain PyTorch), relative difference")
    history = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", backfuse.Fp16RangeWarning)
        for step in range(steps):
            losses = []
            for opt, forward in ((opt_ours, lambda: ours(*activations)), (opt_twin, twin_forward)):
                opt.zero_grad()
                loss = sum(((o - t) ** 2).mean() for o, t in zip(_as_tuple(forward()), targets))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            backfuse.check_ranges()
            print(f"  {step}  {losses[0]:.6f}  {losses[1]:.6f}  {abs(losses[0] - losses[1]) / losses[1]:.1e}")
            history.append(tuple(losses))
    found = [w for w in caught if issubclass(w.category, backfuse.Fp16RangeWarning)]
    print(f"  fp16 range warnings: {len(found)}")
    for w in found:  # shown again, now that they have been counted
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return history


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 1, got {text!r}")
    return int(text)


def _blocks(text: str) -> list:
    blocks = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in blocks if b not in BLOCKS]
    if unknown or not blocks:
        raise argparse.ArgumentTypeError(f"expected comma-separated problem ids from {', '.join(BLOCKS)}, got {text!r}")
    return list(dict.fromkeys(blocks))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=_steps, default=5, help="SGD steps per block (default 5)")
    ap.add_argument("--blocks", type=_blocks, default=list(BLOCKS),
                    help=f"comma-separated problem ids, from {','.join(BLOCKS)} (default: all three)")
    args = ap.parse_args()
    for pid in args.blocks:
        train(pid, args.steps)
