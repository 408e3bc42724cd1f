"""backfuse inside other libraries' models: `patch(model)` finds the attention modules backfuse covers and
binds backfuse's training ops to them. A patched module serves a call only where it can show the op computes
what the module's own code would (the mask the model built, the projections' own computation, the call's own
state): plain `nn.Linear` projections are fused into the op, others (LoRA, quantized, hooked) run as the modules
do around the op's attention core (PEFT's vanilla LoRA layers together with the plain ones: `lora.py`); anything
else (a KV cache, attention dropout, a mask the op does not take, float64) runs the module's own code, with a
warning naming the reason.

    report = backfuse.patch(model)      # e.g. {"Gemma3Attention": 26} (printed unless quiet=True)
    backfuse.unpatch(model)             # the modules' own code again

Covered (`transformers.py`, `diffusers.py`; both libraries are optional, imported only to recognise
their classes): Hugging Face transformers' `Gemma2Attention` and `Gemma3Attention` (the module's
forward, bound per instance, as Liger and Unsloth bind theirs), diffusers' `WanAttention`, both attentions
of a Wan transformer block (through `set_processor`).

Each patched module counts the calls it handed back and why (`fallbacks(model)`), and the modules of one
`patch` warn once per reason (`backfuse.BackfuseWarning`, at the line that called the model), so a model that
never reaches backfuse says so.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from .. import callsite
from ..problem import TRAINING_DTYPES, dtypes_text

PATCHED = "_backfuse_patched"  # attribute of a patched module: (what was there before, the fallback counter)


def _kinds():
    """(name, recognise(module) -> bool, patch(module), unpatch(module)) of every kind of module covered,
    from the libraries that are installed (nothing is imported that the model has not)."""
    kinds = []
    if "transformers" in sys.modules:
        from . import transformers as hf

        kinds += hf.KINDS
    if "diffusers" in sys.modules:
        from . import diffusers as df

        kinds += df.KINDS
    return kinds


def patch(model, *, quiet: bool = False) -> dict:
    """Bind backfuse's ops to every module of `model` it covers; returns {module class: count}, which it
    also prints in one line unless quiet. A model with nothing covered is refused (a ValueError naming
    the classes backfuse covers), as a silent no-op would look like a speed-up that never comes."""
    report = Counter()
    warned = set()  # the reasons this patch's modules have warned of (once each)
    for module in model.modules():
        if getattr(module, PATCHED, None) is not None:
            report[type(module).__name__] += 1
            continue
        for name, recognise, bind, _ in _kinds():
            if recognise(module):
                bind(module)
                getattr(module, PATCHED)["warned"] = warned
                report[type(module).__name__] += 1
                break
    if not report:
        covered = ", ".join(name for name, *_ in _kinds()) or "none (import transformers or diffusers first)"
        raise ValueError(f"backfuse.patch: {type(model).__name__} has no module backfuse covers; it covers: {covered}")
    _after_patch(model)
    if not quiet:
        print(f"backfuse.patch: {', '.join(f'{name} x{n}' for name, n in report.items())}", file=sys.stderr)
    return dict(report)


def _after_patch(model) -> None:
    """The model-level pieces a kind needs (transformers: what the model's caller passed)."""
    if "transformers" in sys.modules:
        from . import transformers as hf

        hf.wrap_model(model)


def unpatch(model) -> int:
    """Give every patched module of `model` its own code back; returns how many there were."""
    count = 0
    for module in model.modules():
        if getattr(module, PATCHED, None) is not None:
            for _, recognise, _, unbind in _kinds():
                if recognise(module, patched=True):
                    unbind(module)
                    count += 1
                    break
    if "transformers" in sys.modules:
        from . import transformers as hf

        hf.unwrap_model(model)
    return count


def fallbacks(model) -> dict:
    """{reason: calls} handed back to the modules' own code, over the patched modules of `model`."""
    total = Counter()
    for module in model.modules():
        state = getattr(module, PATCHED, None)
        if state is not None:
            total.update(state["fallbacks"])
    return dict(total)


def unusable_dtype(name: str, tensor) -> str | None:
    """Why backfuse's ops cannot take `tensor` (a call's activations) in its dtype, or None: they compute in
    float32, bfloat16 and float16, so a model in float64 (a gradient check, say) runs its own code."""
    if tensor is None or tensor.dtype in TRAINING_DTYPES:
        return None
    return f"{name} in {tensor.dtype} (backfuse's ops take {dtypes_text(TRAINING_DTYPES)})"


def plain_linear(name: str, linear, *, bias: bool) -> str | None:
    """Why `linear` is not a plain nn.Linear (without a bias unless `bias`) whose weight an op may read in
    place of calling it, or None: no subclass or wrapper (LoRA, quantized layers), hook or parametrization."""
    if type(linear) is not torch.nn.Linear:  # (a parametrized layer is of a class torch makes for it)
        return (f"{name} is a {type(linear).__module__.split('.')[0]} {type(linear).__name__}, not a plain nn.Linear "
                "(LoRA, quantized or wrapped projections run the module's own code)")
    params = linear._parameters  # (read as dicts: a patched model runs these checks at every call of every layer)
    if params.get("bias") is not None and not bias:
        return f"{name} has a bias"
    if linear._forward_hooks or linear._forward_pre_hooks:
        return f"{name} has hooks"
    if "forward" in linear.__dict__:
        return f"{name}'s forward is replaced on the module ({replaced_forward(linear)})"
    weight = params.get("weight")
    if type(weight) not in (torch.nn.Parameter, torch.Tensor) or not weight.is_floating_point():
        return f"{name}'s weight is a {type(weight).__name__} of {weight.dtype}, not a plain floating tensor"
    return None


def replaced_forward(module) -> str | None:
    """Who replaced `module`'s forward on the instance (accelerate's hooks, Liger Kernel's norms, a user's own
    function), or None where the class's own forward runs: an op that reads the module's weights in place of
    calling it must know that calling it would run the class's code."""
    forward = vars(module).get("forward")
    if forward is None:
        return None
    fn = getattr(forward, "__func__", forward)
    return f"{getattr(fn, '__module__', None) or 'unknown'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def fall_back(module, reason: str) -> None:
    """Count a call `module` hands to its own code, warning the first time for each class and reason among
    the modules one `patch` bound."""
    state = getattr(module, PATCHED)
    warned = state.setdefault("warned", set())
    if (type(module).__name__, reason) not in warned:
        warned.add((type(module).__name__, reason))
        callsite.warn(f"backfuse: {type(module).__name__} ran its own code: {reason} (backfuse.fallbacks(model) counts "
                      "these calls)", callsite.BackfuseWarning)
    state["fallbacks"][reason] += 1
