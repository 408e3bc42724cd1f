"""`backfuse bench --dynamic`: training steps whose shapes change every step, as a fine-tuning collator
makes them (dynamic padding: each batch as long as its longest sequence; packing: documents of other
lengths in every batch).

Per entry, each implementation runs one warm-up step at a shape outside the loop's, then the loop: 12
shapes in random order, one step each, queued back to back with one synchronization at the end (the
first pass: every shape new to it); then the same 12 again (the second pass: every shape seen once).
That is the first round. Each later round makes the 12 shapes' tensors anew (new values, as a data loader's
next batches of those lengths) and runs both passes of each implementation at them, the implementations' order
turning round by round, with every earlier round's tensors still held: no call meets addresses an earlier call
had, so each second-pass call is its shape's second at its addresses, as in the first round, and nothing is
recorded that the first round would not record. The first pass is the first round's (where compiles fall); the
second pass, and the host's own time per step of it, the median over the rounds, each round the same work (a
host-bound loop's single pass moved 0.71-1.11x compiled between runs of one lease: notes/training.md, session
58). The entries:
    gemma3-1b, gemma3-4b, gemma2-9b   the global block, bfloat16, batch 2, lengths 512-4096 (4096 and 512
                                      among them)
    gemma3-4b/packed                  the global block over one row of packed documents, 512-4096 tokens
                                      in 1-8 documents of random lengths (backfuse: `cu_seqlens`; the
                                      model: the block-diagonal causal mask transformers builds from
                                      restarting position ids, through SDPA)
    wan2.1-1.3b                       the cross-attention, batch 1, 1560 video tokens a latent frame (1-21
                                      frames: 81-frame 480p clips and shorter), 1-512 text tokens
Implementations (`bench/models.py`'s): backfuse (the preset's module, or `F.gemma3_core` for packed
documents), eager (the model's own attention, eager), compile (torch.compile of it, default mode, as a user
compiles a model whose batches change length: it recompiles at the second shape with dynamic sizes).
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from .. import functional as bf
from .. import nn as bnn
from .. import presets
from ..kernels import graphs
from .models import inputs, model_function, model_gemma, rope_tables
from .runner import GROUPS, log, turned

ENTRIES = ("gemma3-1b", "gemma3-4b", "gemma2-9b", "gemma3-4b/packed", "wan2.1-1.3b")
IMPLEMENTATIONS = ("backfuse", "eager", "compile")
SHAPES = 12
WAN_FRAME = 1560  # video latent tokens per latent frame at 480p (60 x 104 / (2 x 2) patches)


def shapes(key: str, seed: int = 0) -> tuple:
    """(warm-up shape, the loop's 12 shapes) of an entry: Gemma (batch, length), packed (document lengths),
    Wan (batch, video, text)."""
    rng = random.Random(f"{key}/{seed}")
    if key.startswith("wan"):
        frames = rng.sample(range(1, 22), SHAPES + 1)
        if 21 not in frames[1:]:
            frames[1] = 21
        made = [(1, f * WAN_FRAME, rng.randint(1, 512)) for f in frames]
        return made[0], made[1:]
    lengths = rng.sample(range(513, 4096), SHAPES - 2) + [512, 4096]
    rng.shuffle(lengths)
    warm = 384
    if key.endswith("/packed"):
        return _documents(rng, warm), [_documents(rng, n) for n in lengths]
    return (2, warm), [(2, n) for n in lengths]


def _documents(rng, total: int) -> tuple:
    """total tokens in 1-8 documents of random lengths."""
    count = rng.randint(1, 8)
    cuts = sorted(rng.sample(range(1, total), count - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


class _Call:
    """One step's tensors at one shape: the activations, their upstream gradient, the packed documents."""

    def __init__(self, acts, grad, extra=None):
        self.acts, self.grad, self.extra = acts, grad, extra


def _make_calls(preset, config, key, shape_list, device, seed) -> list:
    calls = []
    for i, shape in enumerate(shape_list):
        if key.endswith("/packed"):
            total = sum(shape)
            x = torch.randn(1, total, config.hidden, device=device, generator=torch.Generator(device).manual_seed(i))
            positions = torch.cat([torch.arange(n, device=device) for n in shape])
            cos, sin = rope_tables(max(shape), config.head_dim, device, torch.bfloat16)
            cos, sin = cos[:, positions], sin[:, positions]
            cu = torch.tensor([0, *torch.tensor(shape).cumsum(0).tolist()], device=device, dtype=torch.int32)
            docs = torch.repeat_interleave(torch.arange(len(shape), device=device),
                                           torch.tensor(shape, device=device))
            acts = [x.to(torch.bfloat16).requires_grad_(), cos, sin]
            extra = (cu, docs)
        else:
            acts, extra = inputs(preset, config, shape, device, torch.bfloat16, seed + i), None
        out_shape = (*acts[0].shape[:-1], config.hidden)
        grad = torch.randn(out_shape, device=device, generator=torch.Generator(device).manual_seed(10_000 + i))
        calls.append(_Call(acts, (grad / math.sqrt(grad.numel())).to(torch.bfloat16), extra))
    return calls


def _packed_model(config, module):
    """The model's own attention over packed documents: SDPA under the block-diagonal causal mask."""

    def f(x, cos, sin, docs, wq, wk, wv, wo, qnw, knw):
        same = docs[:, None] == docs[None]
        return model_gemma(x, cos, sin, wq, wk, wv, wo, qnw, knw, heads=config.heads, kv_heads=config.kv_heads,
                           head_dim=config.head_dim, scaling=module.scaling, softcap=module.softcap or 0.0,
                           eps=module.eps, window=0, extra_mask=same)
    return f


def _stepper(preset, config, key, impl, module):
    """step(call): one training step of `impl` at a call's tensors (gradients cleared first)."""
    packed = key.endswith("/packed")
    if impl == "backfuse":
        params = list(module.parameters())
        if packed:
            def forward(c):
                return bf.gemma3_core(*c.acts, *params, module.scaling, module.softcap, module.eps,
                                      head_dim=config.head_dim, cu_seqlens=c.extra[0])
        else:
            def forward(c):
                return module(*c.acts)
    else:
        params = [p.detach().clone().requires_grad_() for p in module.parameters()]
        fn = _packed_model(config, module) if packed else model_function(preset, config, module)
        if impl == "compile":
            torch._dynamo.reset()
            fn = torch.compile(fn)
        if packed:
            def forward(c):
                return fn(*c.acts, c.extra[1], *params)
        else:
            def forward(c):
                return fn(*c.acts, *params)

    def step(c):
        for p in params:
            p.grad = None
        for a in c.acts:
            if a.requires_grad:
                a.grad = None
        torch.autograd.backward(forward(c), c.grad)
    return step


def _loop(step, calls) -> tuple:
    """(ms per step, host us per step) of one step at each call, back to back, one synchronization."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c in calls:
        step(c)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(calls) * 1e3, (issued - t0) / len(calls) * 1e6


def run_entry(key: str, device, seed: int = 0, rounds: int = GROUPS) -> dict:
    """The "dynamic" entry of one key of ENTRIES (benchmarks/results schema) over `rounds` rounds."""
    name = key.split("/")[0]
    preset = presets.get(name)
    config = preset.config
    warm, loop = shapes(key, seed)
    torch.manual_seed(seed)
    cls = bnn.WanXattn if preset.problem == "021" else bnn.Gemma3Core
    module = cls(config, device=device, dtype=torch.bfloat16, **preset.kwargs)
    with torch.no_grad():
        for p in module.parameters():  # norms away from 0 (their gradients flow)
            if p.dim() == 1:
                p.normal_(0.0, 0.1)
    warm_call, *calls = _make_calls(preset, config, key, [warm, *loop], device, seed)
    held = [calls]  # every round's tensors, to the entry's end
    entry = {"shapes": [list(s) for s in loop], "rounds": rounds}
    graphs.release()
    before = dict(graphs.counts)
    steps, seconds, hosts = {}, {impl: [] for impl in IMPLEMENTATIONS}, {impl: [] for impl in IMPLEMENTATIONS}
    for impl in IMPLEMENTATIONS:
        step = steps[impl] = _stepper(preset, config, key, impl, module)
        start = time.perf_counter()
        step(warm_call)
        torch.cuda.synchronize()
        first, _ = _loop(step, calls)
        second, host = _loop(step, calls)
        entry[f"{impl}_first_ms"] = round(first, 3)
        seconds[impl].append(second)
        hosts[impl].append(host)
        log(f"    {impl}: first pass {first:.3f} ms, second {second:.3f} ms a step, host {host:.0f} us "
            f"({time.perf_counter() - start:.1f} s)")
    for r in range(1, rounds):
        calls = _make_calls(preset, config, key, loop, device, seed + SHAPES * r)
        held.append(calls)
        for impl in turned(list(IMPLEMENTATIONS), r):
            _loop(steps[impl], calls)  # the first pass at these addresses (untimed)
            second, host = _loop(steps[impl], calls)
            seconds[impl].append(second)
            hosts[impl].append(host)
    for impl in IMPLEMENTATIONS:
        entry[f"{impl}_second_ms"] = round(statistics.median(seconds[impl]), 3)
        entry[f"{impl}_host_us"] = round(statistics.median(hosts[impl]), 1)
        entry[f"{impl}_second_rounds_ms"] = [round(v, 3) for v in seconds[impl]]
    entry["graph_counts"] = {k: v - before.get(k, 0) for k, v in graphs.counts.items()}  # (backfuse's: the others record none)
    if rounds > 1:
        log("    2nd pass, median of %d rounds: " % rounds + ", ".join(
            f"{impl} {entry[f'{impl}_second_ms']:.3f} ms (host {entry[f'{impl}_host_us']:.0f} us)" for impl in IMPLEMENTATIONS))
    del steps, held
    torch.cuda.empty_cache()
    return entry
