"""`backfuse bench --train`: one layer's training step (forward + backward) as a training loop runs it.

Per operator and official case, each implementation runs `warmup` steps, then `groups` groups of `steps`
steps queued back to back with one synchronization at the end (wall-clock ms per step, the GPU and the host
overlapping as in training), the implementations' groups alternating (`time_alternating`); the host's own
time per step is the wall time of issuing a group's steps before its synchronization; each figure is the
median over the groups; peak memory is the most allocated during one step above what the step's inputs
hold; `host_floor_us` is the host time of a step of an autograd op that takes the same tensors, allocates
the same outputs and gradients and computes nothing (`_Floor`: what no implementation can go below). A step:
the parameters' gradients cleared (set to None, as `zero_grad` does), the forward, the
backward from a fixed upstream gradient.

Implementations, side by side in one run (only ratios from one run compare: hosts differ):
    backfuse_fp32   backfuse's module on float32 parameters and activations
    backfuse_bf16   the same on bfloat16
    eager_bf16      the layer written plainly in PyTorch on bfloat16 (F.linear; SDPA for 021; 037 as
                    Hugging Face Gemma's eager attention with its soft cap)
    compile_bf16    torch.compile of eager_bf16 (default mode; its compile time is not timed)
Also checked on float32 (one round of the suite's inputs): the fused forward's output against the fp32
forward, and its gradients against the fp32 reference, by the official rule; and a step of each
backfuse implementation under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as tf

from .. import nn as bnn
from .check import check_outputs
from .runner import GROUPS, log, turned

IMPLEMENTATIONS = ("backfuse_fp32", "backfuse_bf16", "eager_bf16", "compile_bf16")
MODULES = {"072": bnn.QkvGqa, "037": bnn.Gemma3Core, "021": bnn.WanXattn}


def plain_072(dec, enc, wq, wk, wv, *, heads=16, kv_heads=4, head_dim=256):
    """072's forward written plainly: three linears, heads, the KV heads repeated."""
    b, sd, _ = dec.shape
    se = enc.shape[1]
    q = tf.linear(dec, wq).view(b, sd, heads, head_dim).transpose(1, 2)
    k = tf.linear(enc, wk).view(b, se, kv_heads, head_dim).transpose(1, 2)
    v = tf.linear(enc, wv).view(b, se, kv_heads, head_dim).transpose(1, 2)
    g = heads // kv_heads
    return q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _gemma_norm(x, w, eps):
    """Hugging Face's Gemma3RMSNorm: in float32, weight 1 + w, cast back."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).type_as(x)


def plain_037(x, cos, sin, wq, wk, wv, wo, qnw, knw, scaling, softcap, eps):
    """037's forward as Hugging Face's Gemma attention runs it eagerly (`eager_attention_forward`)."""
    b, s, _ = x.shape
    d = qnw.shape[0]
    heads, kv_heads = wq.shape[0] // d, wk.shape[0] // d
    q = _gemma_norm(tf.linear(x, wq).view(b, s, heads, d).transpose(1, 2), qnw, eps)
    k = _gemma_norm(tf.linear(x, wk).view(b, s, kv_heads, d).transpose(1, 2), knw, eps)
    v = tf.linear(x, wv).view(b, s, kv_heads, d).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    g = heads // kv_heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    w = q @ k.transpose(2, 3) * scaling
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    mask = torch.full((s, s), float("-inf"), device=x.device, dtype=w.dtype).triu(1)
    w = torch.softmax(w + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return tf.linear((w @ v).transpose(1, 2).reshape(b, s, heads * d), wo)


def plain_021(video, text, wq, bq, wk, bk, wv, bv, wo, bo, scale, *, heads=16):
    """021's forward written plainly: linears and scaled_dot_product_attention."""
    b, nv, hidden = video.shape
    nt = text.shape[1]
    d = hidden // heads
    q = tf.linear(video, wq, bq).view(b, nv, heads, d).transpose(1, 2)
    k = tf.linear(text, wk, bk).view(b, nt, heads, d).transpose(1, 2)
    v = tf.linear(text, wv, bv).view(b, nt, heads, d).transpose(1, 2)
    o = tf.scaled_dot_product_attention(q, k, v, scale=scale)
    return tf.linear(o.transpose(1, 2).reshape(b, nv, hidden), wo, bo)


PLAIN = {"072": plain_072, "037": plain_037, "021": plain_021}
SCALARS = {"scale": "scale", "scaling": "scaling", "softcap": "attn_logit_softcapping", "eps": "rms_norm_eps"}  # module kw: input


class Steps:
    """A layer's training step: the leaves (parameters and activations that get gradients), the forward
    `call` and the upstream gradients."""

    def __init__(self, leaves, call, grads):
        self.leaves, self.call, self.grads = leaves, call, grads

    def step(self):
        for leaf in self.leaves:
            leaf.grad = None
        out = self.call()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, self.grads)


class Layer(Steps):
    """One implementation's layer at one official case (`by_name`: backfuse's leaves by input name)."""

    def __init__(self, prob, axes, impl: str, device, seed: int = 0):
        dtype = torch.float32 if impl == "backfuse_fp32" else torch.bfloat16
        inputs = prob.make_inputs(axes, seed=seed, device=device)
        named = dict(zip(prob.input_names, inputs))
        grads = [named[n].to(dtype) for n in prob.upstream_grads]
        forward = [(s.name, named[s.name]) for s in prob.forward_inputs]
        module_cls = MODULES[prob.id]
        if impl.startswith("backfuse"):
            module = module_cls(device=device, dtype=dtype, **{
                kw: named[name] for kw, name in SCALARS.items() if name in named})
            params = dict(module.named_parameters())
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(named[name])
            names = [n for n, v in forward if isinstance(v, torch.Tensor) and n not in params]
            acts = [named[n].to(dtype).requires_grad_(n in prob.differentiates) for n in names]
            self.by_name = {**params, **dict(zip(names, acts))}
            leaves = list(params.values()) + [a for a in acts if a.requires_grad]
            call = lambda: module(*acts)  # noqa: E731
        else:
            values = [v.to(dtype).requires_grad_(n in prob.differentiates) if isinstance(v, torch.Tensor) else v
                      for n, v in forward]
            leaves = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
            fn = PLAIN[prob.id]
            if impl == "compile_bf16":
                fn = torch.compile(fn)
            call = lambda: fn(*values)  # noqa: E731
        super().__init__(leaves, call, grads)


class _Floor(torch.autograd.Function):
    """The least host work of an autograd op with a layer's tensor inputs and outputs: it saves the inputs,
    allocates its outputs and the inputs' gradients, and computes nothing (`host_floor_us`)."""

    @staticmethod
    def forward(ctx, shapes, *tensors):
        ctx.save_for_backward(*tensors)
        outs = tuple(tensors[0].new_empty(s) for s in shapes)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(torch.empty_like(t) if need else None
                        for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])))


def floor_of(layer: Layer) -> Steps:
    """A step of `_Floor` with a backfuse layer's tensors (the parameters and activations its op takes)."""
    tensors = list(layer.by_name.values())
    shapes = [g.shape for g in layer.grads]
    return Steps(layer.leaves, lambda: _Floor.apply(shapes, *tensors), layer.grads)


def time_steps(layer: Steps, *, warmup: int, steps: int) -> tuple:
    """(ms per step, host us per step): `steps` steps back to back, one synchronization at the end."""
    for _ in range(warmup):
        layer.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        layer.step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    return (t1 - t0) / steps * 1e3, (issued - t0) / steps * 1e6


def time_alternating(layers: dict, *, warmup: int, steps: int, groups: int = GROUPS, settle: int | None = None) -> dict:
    """{name: (ms per step, host us per step)} of each layer: `warmup` steps each, then `groups` rounds in which
    every layer times a group of `steps` steps after `settle` untimed ones (`time_steps`), the round's order
    rotated by one each round. Each figure is the median of the layer's groups. None runs always first on a
    rested GPU, or always after the same neighbour (a GPU's clock falls under a long load: notes/training.md,
    session 48), and one slow group of the host does not decide a figure. The settling steps (default: a graph's
    recording call, `graphs.RECORD_AT`, and one more) take a backfuse layer back to its steady state: after
    another layer's steps the caching allocator may hand its first step other addresses, which its graphs are
    not kept for, until its own gradients and activations have cycled."""
    from ..kernels import graphs

    settle = graphs.RECORD_AT + 1 if settle is None else settle
    names = list(layers)
    for name in names:
        for _ in range(warmup):
            layers[name].step()
    samples = {name: [] for name in names}
    for g in range(groups):
        for name in turned(names, g):
            samples[name].append(time_steps(layers[name], warmup=settle, steps=steps))
    return {name: (statistics.median(ms for ms, _ in got), statistics.median(us for _, us in got))
            for name, got in samples.items()}


def peak_mib(layer: Steps, pools: bool = False) -> float:
    """The most memory allocated during one step above what was allocated before it (MiB); pools (a backfuse
    layer): with the memory that backfuse's recorded graphs keep in their pools (`kernels/graphs.py:
    Allocating`; a run measuring one layer releases the graphs before: `graphs.release()`)."""
    from ..kernels import graphs

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base + (graphs.pool_bytes() if pools else 0)) / 2**20


def check_fp32(prob, axes, tolerance, device, seed: int = 1) -> tuple:
    """(forward passes, backward passes) of backfuse's fp32 step by the official rule against the fp32
    forward and reference, on the suite's inputs."""
    from ..problem import fp32_matmul

    layer = Layer(prob, axes, "backfuse_fp32", device, seed=seed)
    inputs = prob.make_inputs(axes, seed=seed, device=device)
    named = dict(zip(prob.input_names, inputs))
    with torch.no_grad():
        out = layer.call()
    with fp32_matmul(tf32=False), torch.no_grad():
        ref_out = prob.forward(*[named[s.name] for s in prob.forward_inputs])
        refs = prob.reference(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    forward = check_outputs([o.contiguous() for o in outs], [r.contiguous() for r in ref_outs], tolerance,
                            [f"output {i}" for i in range(len(outs))])
    layer.step()
    backward = check_outputs([layer.by_name[n].grad for n in prob.differentiates], refs, tolerance, prob.output_names)
    return forward, backward


def sync_free(layer: Steps) -> bool:
    """Whether a step runs under torch.cuda.set_sync_debug_mode("error") without an error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.step()
        ok = True
    except RuntimeError as e:
        log(f"    synchronizing: {e}")
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return ok


def run_case(prob, index: int, device, *, warmup: int, steps: int, groups: int = GROUPS) -> dict:
    """The "train" entry of one case (benchmarks/results schema): the implementations and the host floor (with
    the bf16 layer's tensors) timed in alternating groups, then each backfuse layer's and eager's peak and
    backfuse's synchronization check."""
    case = prob.workloads[index]
    layers = {impl: Layer(prob, case.axes, impl, device) for impl in IMPLEMENTATIONS}
    layers["floor"] = floor_of(layers["backfuse_bf16"])
    timed = time_alternating(layers, warmup=warmup, steps=steps, groups=groups)
    entry = {f"{impl}_ms": round(timed[impl][0], 4) for impl in IMPLEMENTATIONS}
    entry["host_us"] = round(timed["backfuse_fp32"][1], 1)
    entry["host_bf16_us"] = round(timed["backfuse_bf16"][1], 1)
    entry["host_floor_us"] = round(timed["floor"][1], 1)
    entry["peak_fp32_mib"] = round(peak_mib(layers["backfuse_fp32"], pools=True), 1)
    entry["peak_mib"] = round(peak_mib(layers["backfuse_bf16"], pools=True), 1)
    entry["eager_bf16_peak_mib"] = round(peak_mib(layers["eager_bf16"]), 1)
    entry["sync_free"] = sync_free(layers["backfuse_fp32"]) and sync_free(layers["backfuse_bf16"])
    del layers
    forward, backward = check_fp32(prob, case.axes, case.tolerance, device)
    entry["fp32_forward_passed"], entry["fp32_backward_passed"] = forward.passed, backward.passed
    if not (forward.passed and backward.passed):
        log(f"    fp32 check: forward {forward.reason or 'ok'}; backward {backward.reason or 'ok'}")
    return entry

