"""`backfuse bench --e2e` and `--memory`: a released model's whole training step, as transformers builds the
model, with and without `backfuse.patch`, eager and under torch.compile.

A model: a few decoder layers of a released Gemma at its width (transformers' own classes, random init,
bfloat16, vocab 32768), in the released layer pattern (Gemma 3: five sliding-window layers and one global;
Gemma 2: one of each), or two blocks of a released Wan (diffusers' `WanTransformer3DModel`, an 81-frame
480p clip's 21 x 60 x 104 latents: 32760 video tokens, 512 text tokens). A step: the gradients cleared
(set to None), the forward (Gemma: with labels, the LM cross-entropy; Wan: the mean square of its
output), the backward. Steps queued back to back, one synchronization at the end (ms per step, the
host's own time per step beside it), after warm-up steps (compile's compile time not timed; backfuse's variants
past `steady_after()`, where a long run's plans and graphs have settled); the peak is the
most memory allocated during one step above what was allocated before it (with what backfuse's recorded
graphs keep in their pools). Each variant's first loss is checked against the unpatched eager model's (same
weights, same batch): a variant that computes another loss is reported wrong, not timed.

Variants:
    hf                  the model as transformers / diffusers run it (SDPA attention; eager for Gemma 2's
                        soft caps)
    compile             torch.compile of it (default mode)
    patched             after `backfuse.patch(model)`
    patched_compile     torch.compile of the patched model
    liger               Liger Kernel's patch of the model (its RMSNorm, GeGLU, RoPE and fused linear
                        cross-entropy), where `liger-kernel` is installed (Gemma only)
    liger_patched       Liger's patch, then backfuse's
Liger patches transformers' classes as well as the model, so its variants run each in a process of their own.
With `--split` each variant's GPU time a step is also split by kind of kernel: products, attention, the rest
(`kernel_split`), where a fused attention block's gain can come from and where it cannot.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import torch

from ..kernels import graphs
from .runner import log

VOCAB = 32768
# (family, hidden, intermediate, heads, kv heads, head size, query_pre_attn_scalar, window), published configs
MODELS = {
    "gemma3-1b": ("gemma3", 1152, 6912, 4, 1, 256, 256, 512),
    "gemma3-4b": ("gemma3", 2560, 10240, 8, 4, 256, 256, 1024),
    "gemma3-12b": ("gemma3", 3840, 15360, 16, 8, 256, 256, 1024),
    "gemma3-27b": ("gemma3", 5376, 21504, 32, 16, 128, 168, 1024),
    "gemma2-2b": ("gemma2", 2304, 9216, 8, 4, 256, 256, 4096),
    "gemma2-9b": ("gemma2", 3584, 14336, 16, 8, 256, 256, 4096),
    "gemma2-27b": ("gemma2", 4608, 36864, 32, 16, 128, 144, 4096),
}
# (heads, latent channels, FFN width), published configs (head size 128, text width 4096)
WAN = {"wan2.1-1.3b": (12, 16, 8960), "wan2.2-5b": (24, 48, 14336), "wan2.1-14b": (40, 16, 13824)}
WAN_LATENTS = (21, 60, 104)  # frames, height, width of an 81-frame 480p clip's latents
WAN_TEXT = 512
TOKENS = {"gemma3-1b": (8, 1024), "gemma3-4b": (2, 4096), "gemma3-12b": (1, 4096), "gemma3-27b": (1, 4096),
          "gemma2-2b": (2, 4096), "gemma2-9b": (2, 4096), "gemma2-27b": (1, 4096),
          **{name: (1, WAN_LATENTS[0] * WAN_LATENTS[1] * WAN_LATENTS[2] // 4, WAN_TEXT) for name in WAN}}
LAYERS = {"gemma3": 6, "gemma2": 2, "wan": 2}  # the released pattern's period (Wan: two blocks)
MEMORY = (("gemma3-4b", (2, 4096)), ("gemma3-27b", (1, 4096)))  # `--memory`: 2 layers each
MEMORY_VARIANTS = ("hf", "compile", "patched", "patched_compile")
VARIANTS = ("hf", "compile", "patched", "patched_compile", "liger", "liger_patched")
LOSS_TOLERANCE = 2e-2  # |first loss - hf's|, relative (bf16 models' losses near log(32768) = 10.4)


def build(name: str, layers: int | None = None, seed: int = 0, device="cuda"):
    """The model `name` with `layers` decoder layers (None: the released pattern's period), on `device` in
    bfloat16, its weights drawn from `seed`."""
    if name in WAN:
        return _build_wan(name, layers or LAYERS["wan"], seed, device)
    import transformers

    family, hidden, inter, heads, kv, head, scalar, window = MODELS[name]
    n = layers or LAYERS[family]
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=n,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=head, query_pre_attn_scalar=scalar,
                  sliding_window=window, max_position_embeddings=8192)
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(**common, layer_types=[
            "full_attention" if (i + 1) % 6 == 0 or n < 6 and i == n - 1 else "sliding_attention" for i in range(n)])
        cls, impl = transformers.Gemma3ForCausalLM, "sdpa"
    else:
        config = transformers.Gemma2Config(**common, layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
        cls, impl = transformers.Gemma2ForCausalLM, "eager"
    config._attn_implementation = impl
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config).to(torch.bfloat16)
    model.train()
    return model


def _build_wan(name: str, blocks: int, seed: int, device):
    import diffusers

    heads, channels, ffn = WAN[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128,
                                                in_channels=channels, out_channels=channels, text_dim=4096,
                                                freq_dim=256, ffn_dim=ffn, num_layers=blocks, cross_attn_norm=True,
                                                qk_norm="rms_norm_across_heads", eps=1e-6).to(torch.bfloat16)
    model.train()
    return model


# `--lora`: PEFT's LoRA on every linear layer of the decoder layers (Gemma) or blocks (Wan)
LORA_TARGETS = {"gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]}


def add_lora(model, name: str, rank: int) -> None:
    """PEFT LoRA of `rank` (alpha 2 rank, no dropout, B initialized nonzero so that the adapters change the loss)
    on `LORA_TARGETS`, in place, the rest of the model frozen: a LoRA fine-tuning step."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, init_lora_weights="gaussian",
                             target_modules=LORA_TARGETS["wan" if name in WAN else "gemma"])
    peft.inject_adapter_in_model(config, model)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)


def variant(name: str, which: str, layers: int | None = None, device="cuda", lora: int = 0):
    """(model as the step calls it, the model whose parameters it trains); lora: `add_lora`'s rank (0: none),
    after backfuse's patch, as a user adds adapters to a patched model."""
    import backfuse

    model = build(name, layers, device=device)
    if which.startswith("liger"):
        import liger_kernel.transformers as liger

        family = MODELS[name][0]
        (liger.apply_liger_kernel_to_gemma3_text if family == "gemma3" else liger.apply_liger_kernel_to_gemma2)(
            model=model)
    if "patched" in which:
        backfuse.patch(model, quiet=True)
    if lora:
        add_lora(model, name, lora)
    if which.endswith("compile"):
        torch._dynamo.reset()
        return torch.compile(model), model
    return model, model


def batch(name: str, tokens: tuple, seed: int = 1, device="cuda") -> dict:
    """One step's inputs: Gemma's token ids (labels the same), Wan's latents, timestep and text states."""
    g = torch.Generator(device=device).manual_seed(seed)
    if name not in WAN:
        ids = torch.randint(0, VOCAB, tokens, device=device, generator=g)
        return dict(input_ids=ids, labels=ids)
    b, _, text = tokens
    channels = WAN[name][1]
    return dict(hidden_states=torch.randn(b, channels, *WAN_LATENTS, device=device, generator=g).to(torch.bfloat16),
                timestep=torch.full((b,), 500, device=device),
                encoder_hidden_states=torch.randn(b, text, 4096, device=device, generator=g).to(torch.bfloat16))


def loss_of(name: str, out) -> torch.Tensor:
    """The step's loss: Gemma's LM cross-entropy, the mean square of Wan's output."""
    return out.sample.float().square().mean() if name in WAN else out.loss


# What a kernel computes, from its name (`kind_of`): inductor's generated pointwise and reduction kernels are
# "rest" whatever ops they are named after; then attention cores (cuDNN's SDPA, FlashAttention, the efficient
# kernels, backfuse's Triton attention and its delta pass); then products (cuBLAS and cuBLASLt, CUTLASS,
# inductor's GEMM templates, backfuse's Gluon GEMMs); everything else (norms, RoPE, activations, residual adds,
# casts, copies, the loss) is "rest".
GENERATED = ("triton_poi_", "triton_per_", "triton_red_")
ATTENTION_NAMES = ("attention", "attn", "fmha", "flash", "sdpa")
PRODUCT_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "splitkreduce", "_mm_", "addmm", "matmul", "bmm")
KINDS = ("products", "attention", "rest")


def kind_of(kernel: str) -> str:
    """"products", "attention" or "rest": what a GPU kernel of a training step computes, by its name."""
    n = kernel.lower()
    if n.startswith(GENERATED):
        return "rest"
    if any(p in n for p in ATTENTION_NAMES):
        return "attention"
    return "products" if any(p in n for p in PRODUCT_NAMES) else "rest"


def kernel_split(step, steps: int = 3) -> dict:
    """GPU time per step by kind of kernel (`kind_of`), from the profiler over `steps` steps of `step`:
    {products_ms, attention_ms, rest_ms, kernels (a step's), and per kind <kind>_top: its TOP costliest kernels
    [name (its first 80 characters), ms a step]}."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name, count = {kind: {} for kind in KINDS}, 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        names = by_name[kind_of(e.name)]
        names[e.name] = names.get(e.name, 0.0) + e.device_time_total / steps / 1e3
        count += 1
    split = {f"{kind}_ms": round(sum(names.values()), 3) for kind, names in by_name.items()}
    for kind, names in by_name.items():
        split[f"{kind}_top"] = [[n[:80], round(ms, 3)] for n, ms in sorted(names.items(), key=lambda kv: -kv[1])[:TOP]]
    return {**split, "kernels": count // steps}


TOP = 5  # kernels named per kind in a split


def steady_after() -> int:
    """Steps of a fixed-shape loop before backfuse's calls reach their steady state: a shape's attention moves to
    cuDNN's where that serves it at its `plans.CUDNN_AFTER`-th call (Gemma 3's global layers, Wan's
    self-attention), and a loop whose addresses alternate between two sets has recorded both sets' graphs (a
    call is recorded at its `graphs.RECORD_AT`-th call at the same addresses) two calls after that."""
    from ..train import plans

    return plans.CUDNN_AFTER + 2 * graphs.RECORD_AT


def run_variant(name: str, which: str, tokens: tuple, *, layers: int | None = None, warmup: int = 3,
                steps: int = 10, split: bool = False, lora: int = 0, device="cuda") -> dict:
    """{ms, host_ms, peak_mib, loss} of one variant: `steps` steps after `warmup` (backfuse's variants at least
    `steady_after()`: a long run's steady state; with split, "split": the GPU time of a step by kind of kernel,
    `kernel_split`). On the CPU (the tests' smoke runs) no peak."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    graphs.release()
    torch.cuda.empty_cache()
    call, model = variant(name, which, layers, device, lora)
    inputs = batch(name, tokens, device=device)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        loss = loss_of(name, call(**inputs))
        loss.backward()
        return loss.detach()

    if "patched" in which and cuda:
        warmup = max(warmup, steady_after())
    first = float(step())
    for _ in range(warmup - 1):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    issued = time.perf_counter()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    host = (issued - t0) / steps * 1e3
    for p in params:
        p.grad = None
    peak = None
    if cuda:
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        peak = round((torch.cuda.max_memory_allocated() - base + graphs.pool_bytes()) / 2**20, 1)
    fallbacks = sum(__import__("backfuse").fallbacks(model).values()) if "patched" in which else 0
    result = dict(ms=round(ms, 3), host_ms=round(host, 3), peak_mib=peak, loss=first, fallbacks=fallbacks)
    if split:
        result["split"] = kernel_split(step)
    return result


def run_entry(name: str, tokens: tuple, *, layers: int | None = None, variants=VARIANTS, warmup: int = 3,
              steps: int = 10, split: bool = False, lora: int = 0, progress=None, device="cuda") -> dict:
    """The "e2e" entry of one model and token count: per variant its ms, host ms and peak (None where its first
    loss is not the first variant's, hf's: `<variant>_wrong` then holds that loss; None where it failed, out of
    memory or in a compile: `<variant>_error` then holds the error's first line, and the next variant runs); with
    split, `<variant>_split` (`kernel_split`); lora: every variant with `add_lora`'s adapters. progress, where
    given, is called with the entry so far after each variant (a run cut short keeps what it measured)."""
    entry, reference = {}, None
    for which in variants:
        if which.startswith("liger") and (name in WAN or importlib.util.find_spec("liger_kernel") is None):
            entry[f"{which}_ms"] = None  # Liger has no Wan patch; or it is not installed
            continue
        start = time.perf_counter()
        try:
            r = (_isolated if which.startswith("liger") else run_variant)(name, which, tokens, layers=layers,
                                                                          warmup=warmup, steps=steps, split=split,
                                                                          lora=lora, device=device)
        except Exception as e:  # out of memory, a compile's error, a failed process: recorded, and the next runs
            entry[f"{which}_ms"] = None
            entry[f"{which}_error"] = _first_line(e)
            log(f"    {which}: failed ({entry[f'{which}_error']})")
            torch.cuda.empty_cache()
            if progress is not None:
                progress(entry)
            continue
        if reference is None:
            reference = r["loss"]
        ok = abs(r["loss"] - reference) <= LOSS_TOLERANCE * max(1.0, abs(reference))
        entry[f"{which}_ms"] = r["ms"] if ok else None
        entry[f"{which}_host_ms"] = r["host_ms"]
        entry[f"{which}_peak_mib"] = r["peak_mib"]
        if not ok:
            entry[f"{which}_wrong"] = r["loss"]
        if r["fallbacks"]:
            entry[f"{which}_fallbacks"] = r["fallbacks"]
        if "split" in r:
            entry[f"{which}_split"] = r["split"]
        kernels = ("; kernels ms: " + ", ".join(f"{k} {r['split'][k + '_ms']:.2f}" for k in KINDS)) if "split" in r else ""
        peak = "" if r["peak_mib"] is None else f", peak {r['peak_mib']:.0f} MiB"
        log(f"    {which}: {r['ms']:.3f} ms a step (host {r['host_ms']:.3f}){peak}, first loss "
            f"{r['loss']:.4f}{'' if ok else ' WRONG'}{kernels} ({time.perf_counter() - start:.1f} s)")
        torch.cuda.empty_cache()
        entry["loss"] = reference
        if progress is not None:
            progress(entry)
    entry["loss"] = reference
    return entry


def _first_line(e: Exception) -> str:
    """An exception's first line (a failed process: the last line it wrote to stderr), at most 200 characters."""
    if isinstance(e, subprocess.CalledProcessError):
        said = [line for line in (e.stderr or "").splitlines() if line.strip()]
        text = said[-1] if said else f"exit status {e.returncode}"
    else:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text[:200]


def _isolated(name: str, which: str, tokens: tuple, **kw) -> dict:
    """run_variant in a process of its own (Liger's patch replaces transformers' classes for the process); its
    stderr passed on as it comes, and kept for a failure's message."""
    code = ("import json, sys; from backfuse.bench import e2e; "
            f"print(json.dumps(e2e.run_variant({name!r}, {which!r}, {tuple(tokens)!r}, **{kw!r})))")
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, "e2e variant", done.stdout, done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])
