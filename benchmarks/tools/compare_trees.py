"""`bench --train`'s steps, or `bench --dynamic`'s loops, of two source trees timed under one harness: a
regression check's figures.

Each tree runs in a worker process of its own (its `src` first on the path), which builds and warms the layers
(`bench/train.py: Layer`, as the tree has it) and times a group of steps when asked (`time_steps`). The parent
alternates the trees' groups, and the implementations' groups, round after round. Each figure is the median
of its groups. So neither tree always runs first on a cool GPU, and a slow spell of the host falls on both.
(Two runs of `bench --train`, one per tree, compare only as well as the host and the clock held between them:
notes/training.md, sessions 48 and 49.)

    python benchmarks/tools/compare_trees.py . bis/main --cases 072:0,5 037:5 021:9
    python benchmarks/tools/compare_trees.py . bis/main --cases 037:5 --impls backfuse_bf16 --groups 7
    python benchmarks/tools/compare_trees.py . bis/main --dynamic gemma3-4b/packed wan2.1-1.3b

--dynamic: backfuse's loop of each entry (its warm-up step and first pass untimed), a group being a round of
`bench --dynamic` (session 58): the 12 shapes' tensors made anew, one pass untimed, the second timed, every
earlier group's tensors held, so each timed call is its shape's second at its addresses and no graph is recorded
(before session 58 a group was one more pass over the same tensors, so from the third on a call whose addresses
recurred replayed a recorded graph), the trees alternating group by group.

A tree is a checkout's root (its `src`) or a `src`-like folder holding `backfuse`. --device cpu is a smoke run
(the interpreter; no timing worth reading).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

IMPLS = ("backfuse_fp32", "backfuse_bf16", "eager_bf16", "compile_bf16")
REPLY = "@@"  # a worker's replies start with it (anything else it prints is passed on)

WORKER = r'''
import json, sys, torch
import backfuse
from backfuse.bench import train
device = sys.argv[1]
if device == "cpu":
    torch.cuda.synchronize = lambda *a: None  # (a smoke run)
layers = {}
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "build":
        prob = backfuse.problem(cmd["pid"])
        layer = layers[cmd["key"]] = train.Layer(prob, prob.workloads[cmd["case"]].axes, cmd["impl"], device)
        for _ in range(cmd["warmup"]):
            layer.step()
        torch.cuda.synchronize()
        reply = {"path": backfuse.__file__}
    elif cmd["op"] == "time":
        ms, us = train.time_steps(layers[cmd["key"]], warmup=cmd["settle"], steps=cmd["steps"])
        reply = {"ms": ms, "us": us}
    elif cmd["op"] == "build_loop":  # (what both trees' bench/dynamic.py have)
        from backfuse import nn as bnn, presets
        from backfuse.bench import dynamic
        key = cmd["key"]
        preset = presets.get(key.split("/")[0])
        cls = bnn.WanXattn if preset.problem == "021" else bnn.Gemma3Core
        module = cls(preset.config, device=device, dtype=torch.bfloat16, **preset.kwargs)
        warm, shapes = dynamic.shapes(key)
        warm_call, *calls = dynamic._make_calls(preset, preset.config, key, [warm, *shapes], device, 0)
        step = dynamic._stepper(preset, preset.config, key, "backfuse", module)
        step(warm_call)
        dynamic._loop(step, calls)
        layers[key] = (step, preset, shapes, [calls])
        reply = {"path": backfuse.__file__}
    elif cmd["op"] == "time_loop":  # a pass at the 12 shapes' tensors made anew, then the timed one (its second)
        from backfuse.bench import dynamic
        step, preset, shapes, held = layers[cmd["key"]]
        calls = dynamic._make_calls(preset, preset.config, cmd["key"], shapes, device, dynamic.SHAPES * len(held))
        held.append(calls)  # (held: no later call meets these addresses)
        dynamic._loop(step, calls)
        ms, us = dynamic._loop(step, calls)
        reply = {"ms": ms, "us": us}
    else:  # "drop"
        layers.clear()
        if device != "cpu":
            torch.cuda.empty_cache()
        reply = {}
    print("@@" + json.dumps(reply), flush=True)
'''


class Worker:
    """One tree's process: `ask` sends a command and returns its reply."""

    def __init__(self, tree: str, device: str):
        src = os.path.join(tree, "src") if os.path.isdir(os.path.join(tree, "src")) else tree
        if not os.path.isdir(os.path.join(src, "backfuse")):
            raise SystemExit(f"{tree}: no backfuse package in it (or in its src)")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
        self.tree, self.shown = tree, False
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, device], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            print(f"  [{self.tree}] {line.rstrip()}", file=sys.stderr)
        raise SystemExit(f"{self.tree}: the worker ended (exit {self.proc.wait()}) during {cmd['op']}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def compare_case(workers, pid: str, case: int, impls, *, warmup: int, steps: int, groups: int, settle: int) -> dict:
    """{impl: {tree: (median ms, median host us)}} of one case, every tree's layers built first."""
    for w in workers:
        for impl in impls:
            path = w.ask(op="build", key=impl, pid=pid, case=case, impl=impl, warmup=warmup)["path"]
            if not w.shown:
                print(f"{w.tree}: backfuse from {os.path.dirname(path)}", file=sys.stderr)
                w.shown = True
    samples = {(impl, w.tree): [] for impl in impls for w in workers}
    for g in range(groups):
        k = g % len(impls)
        for impl in impls[k:] + impls[:k]:
            for w in (workers if g % 2 == 0 else workers[::-1]):
                got = w.ask(op="time", key=impl, steps=steps, settle=settle)
                samples[impl, w.tree].append((got["ms"], got["us"]))
    for w in workers:
        w.ask(op="drop")
    return {impl: {w.tree: (statistics.median(ms for ms, _ in samples[impl, w.tree]),
                            statistics.median(us for _, us in samples[impl, w.tree])) for w in workers}
            for impl in impls}


def compare_loop(workers, key: str, *, groups: int) -> dict:
    """{tree: (median ms, median host us) a step} of an entry's dynamic loop, every tree's loop built first."""
    for w in workers:
        path = w.ask(op="build_loop", key=key)["path"]
        if not w.shown:
            print(f"{w.tree}: backfuse from {os.path.dirname(path)}", file=sys.stderr)
            w.shown = True
    samples = {w.tree: [] for w in workers}
    for g in range(groups):
        for w in (workers if g % 2 == 0 else workers[::-1]):
            got = w.ask(op="time_loop", key=key)
            samples[w.tree].append((got["ms"], got["us"]))
    for w in workers:
        w.ask(op="drop")
    return {tree: (statistics.median(ms for ms, _ in got), statistics.median(us for _, us in got))
            for tree, got in samples.items()}


def cases_of(specs) -> list:
    """[(pid, case)] from "072:0,5" items."""
    out = []
    for spec in specs:
        pid, _, cases = spec.partition(":")
        if not cases:
            raise SystemExit(f"--cases: expected PID:CASE[,CASE...], got {spec!r}")
        out += [(pid, int(c)) for c in cases.split(",")]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs=2, help="the baseline tree, then the tree to compare with it")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--cases", nargs="+", metavar="PID:CASES", help="e.g. 072:0,5 037:5")
    what.add_argument("--dynamic", nargs="+", metavar="ENTRY", help="bench --dynamic's entries, e.g. wan2.1-1.3b")
    parser.add_argument("--impls", default=",".join(IMPLS[:2]), help=f"comma-separated, of {', '.join(IMPLS)}")
    parser.add_argument("--warmup", type=int, default=70, help="untimed steps per layer before the groups (70)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per group (10)")
    parser.add_argument("--groups", type=int, default=5, help="groups per layer (or loop) and tree (5)")
    parser.add_argument("--settle", type=int, default=4, help="untimed steps opening each group (4)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the figures there")
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    if set(impls) - set(IMPLS):
        parser.error(f"--impls: unknown {sorted(set(impls) - set(IMPLS))}; there are {', '.join(IMPLS)}")
    base, other = args.trees
    workers = [Worker(base, args.device), Worker(other, args.device)]
    rows, out = [], {}
    if args.dynamic:
        return _dynamic(workers, args)
    try:
        for pid, case in cases_of(args.cases):
            got = compare_case(workers, pid, case, impls, warmup=args.warmup, steps=args.steps, groups=args.groups,
                               settle=args.settle)
            out[f"{pid}/{case}"] = {impl: {tree: {"ms": ms, "host_us": us} for tree, (ms, us) in trees.items()}
                                    for impl, trees in got.items()}
            for impl, trees in got.items():
                (a_ms, a_us), (b_ms, b_us) = trees[base], trees[other]
                rows.append(f"| {pid} | {case} | {impl} | {a_ms:.3f} | {b_ms:.3f} | {b_ms / a_ms:.3f} | {a_us:.0f} | "
                            f"{b_us:.0f} |")
                print(rows[-1], flush=True)
    finally:
        for w in workers:
            w.close()
    print(f"\nmedian ms and host us a step, {args.groups} alternating groups of {args.steps} steps after {args.warmup}; "
          f"ratio {other} / {base}")
    print(f"| problem | case | implementation | {base} ms | {other} ms | ratio | {base} host us | {other} host us |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": [base, other], "groups": args.groups, "steps": args.steps, "cases": out}, f, indent=1)
    return 0


def _dynamic(workers, args) -> int:
    base, other = args.trees
    rows, out = [], {}
    try:
        for key in args.dynamic:
            got = compare_loop(workers, key, groups=args.groups)
            out[key] = {tree: {"ms": ms, "host_us": us} for tree, (ms, us) in got.items()}
            (a_ms, a_us), (b_ms, b_us) = got[base], got[other]
            rows.append(f"| {key} | {a_ms:.3f} | {b_ms:.3f} | {b_ms / a_ms:.3f} | {a_us:.0f} | {b_us:.0f} |")
            print(rows[-1], flush=True)
    finally:
        for w in workers:
            w.close()
    print(f"\nbackfuse's dynamic loop, median ms and host us a step over {args.groups} alternating passes; "
          f"ratio {other} / {base}")
    print(f"| entry | {base} ms | {other} ms | ratio | {base} host us | {other} host us |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": [base, other], "groups": args.groups, "dynamic": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
