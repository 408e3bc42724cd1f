"""The `backfuse` command line: bench, check, sol."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from . import PROBLEM_IDS, problem
from .bench import report
from .bench.impls import IMPLS
from .bench.runner import ITERS, ROUNDS, WARMUP, environment, log, run_problem, to_json
from .bench.sol import GPUS, sol_ms
from .export import solution


def _cases(text: str | None):
    if text is None:
        return None
    try:
        cases = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cases takes comma-separated case indices 0..15, got {text!r}")
    bad = [c for c in cases if not 0 <= c < 16]
    if bad:
        raise argparse.ArgumentTypeError(f"--cases: indices must be in 0..15, got {bad}")
    return cases


def _problems(ids):
    return [problem(pid) for pid in (ids or PROBLEM_IDS)]


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("problems", nargs="*", metavar="PROBLEM", help="072, 037, 021 or an official name (default: all three)")
    p.add_argument("--cases", type=_cases, help="comma-separated case indices, e.g. 0,3 (default: all 16)")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"correctness rounds of fresh inputs per case (default {ROUNDS})")
    p.add_argument("--seed", type=int, default=0, help="base seed of the input draws (default 0)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="backfuse",
        description="Fused backward kernels for three attention blocks, measured as SOL-ExecBench does.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench",
        help="check and time implementations on the official cases",
        description="Correctness (official rule, fresh inputs each round) and timing (10 warm-up + 50 timed "
        "calls, L2 flushed, fresh input addresses, median CUPTI span) per case; 16-case mean per impl. "
        "Without a CUDA GPU it runs the correctness check on reduced shapes on the CPU instead.",
    )
    _add_selection(bench)
    bench.add_argument("--impl", nargs="+", choices=IMPLS,
                       help="implementations (default: all on a GPU; reference and backfuse on the CPU)")
    bench.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed calls before timing (default {WARMUP})")
    bench.add_argument("--iters", type=int, default=ITERS, help=f"timed calls per case (default {ITERS})")
    bench.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="GPU whose SOL the table compares with")
    bench.add_argument("--baseline", choices=IMPLS, help="also print the leaderboard score S against this impl")
    bench.add_argument("--json", metavar="FILE", help="write results as JSON (the benchmarks/results schema)")
    bench.add_argument("--merge", action="store_true", help="with --json: keep the file's other problems and impls")
    bench.add_argument("--plot", metavar="FILE.png", help="write a PNG of per-case latencies against SOL")

    check = sub.add_parser(
        "check",
        help="correctness only (official rule)",
        description="Runs an implementation on the official cases (10 rounds of fresh inputs each) and applies "
        "the official rule. On a machine without CUDA it uses reduced shapes on the CPU.",
    )
    _add_selection(check)
    check.add_argument("--impl", choices=IMPLS, default="backfuse", help="implementation (default backfuse)")

    sol = sub.add_parser("sol", help="speed-of-light table (no GPU needed)",
                         description="Per case: matrix GFLOP, minimal fp32 I/O, and SOL times at fp16 and TF32 rates.")
    sol.add_argument("problems", nargs="*", metavar="PROBLEM", help="072, 037, 021 or an official name (default: all)")
    sol.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="GPU peaks to use (default h200)")

    merge = sub.add_parser("merge", help="merge results files (from `bench --json` on a GPU) into one",
                           description="Copies every problem's implementations from each FROM file into INTO, "
                           "replacing entries of the same problem and implementation; FROM's device, versions and "
                           "date replace INTO's.")
    merge.add_argument("into", metavar="INTO", help="results file to update, e.g. benchmarks/results/h200.json")
    merge.add_argument("sources", nargs="+", metavar="FROM", help="results files written by `backfuse bench --json`")

    rpt = sub.add_parser("report", help="Markdown report and per-problem plots from a results file",
                         description="Writes DIR/report.md (summary, per-case tables, links to the notes) and "
                         "DIR/plots/<problem>.png (per-case latency of each implementation against SOL).")
    rpt.add_argument("--results", default="benchmarks/results/h200.json", help="results file (default %(default)s)")
    rpt.add_argument("--out", default="benchmarks", metavar="DIR", help="where to write (default %(default)s)")
    rpt.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="GPU whose SOL the report compares with")

    export = sub.add_parser("export", help="write a SOL-ExecBench solution package (JSON)",
                            description="Packs the operator's fused implementation (sources, entry point "
                            "`solution.py::run`, target hardware B200 and LOCAL) as a solution JSON file.")
    export.add_argument("problem", metavar="PROBLEM", help="072, 037, 021 or an official name")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the JSON")
    export.add_argument("--author", default="backfuse", help="author field (default backfuse)")

    args = parser.parse_args(argv)
    if args.command == "report":
        return _report(args.results, args.out, args.gpu)
    if args.command == "export":
        try:
            doc = solution(_problems([args.problem])[0], author=args.author)
        except ValueError as e:
            parser.error(str(e))
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {args.output}: {doc['definition']}, {len(doc['sources'])} source files")
        return 0
    if args.command == "merge":
        for source in args.sources:
            with open(source) as f:
                _write_json(json.load(f), args.into, merge=True)
        return 0
    try:
        problems = _problems(args.problems)
    except ValueError as e:
        parser.error(str(e))
    if args.command == "sol":
        return _sol(problems, args.gpu)
    return _bench(problems, args, timing=args.command == "bench")


def _sol(problems, gpu: str) -> int:
    g = GPUS[gpu]
    for prob in problems:
        print(f"{prob.name}  ({g.name}: fp16 {g.fp16_flops / 1e12:.0f} TFLOP/s, TF32 {g.tf32_flops / 1e12:.0f} "
              f"TFLOP/s, {g.hbm_bytes / 1e12:.2f} TB/s; {g.source})")
        print(f"{'#':>2}  {'axes':<28} {'GFLOP':>8} {'MB':>7} {'SOL fp16 ms':>12} {'SOL tf32 ms':>12}  bound")
        fp16, tf32 = [], []
        for i, w in enumerate(prob.workloads):
            a = w.axes
            fp16.append(sol_ms(prob, a, gpu, "fp16"))
            tf32.append(sol_ms(prob, a, gpu, "tf32"))
            bound = "compute" if 2 * prob.macs(a) / g.fp16_flops > prob.io_bytes(a) / g.hbm_bytes else "memory"
            print(f"{i:>2}  {report.axes_text(a):<28} {2 * prob.macs(a) / 1e9:8.1f} {prob.io_bytes(a) / 1e6:7.1f} "
                  f"{fp16[-1]:12.4f} {tf32[-1]:12.4f}  {bound}")
        print(f"{'mean':>2}  {'':<28} {'':>8} {'':>7} {statistics.fmean(fp16):12.4f} {statistics.fmean(tf32):12.4f}\n")
    return 0


def _bench(problems, args, *, timing: bool) -> int:
    import torch

    if torch.cuda.is_available():
        device = "cuda"
        impls = args.impl or list(IMPLS)
    else:
        device = "cpu"
        timing = False
        impls = args.impl or ["reference", "backfuse"]
        mode = "the Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "the reference fallback"
        log(f"no CUDA GPU: checking correctness on reduced shapes on the CPU ({mode} for backfuse), no timing")
    if args.command == "check":
        impls = [args.impl]
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are a nicety
        tqdm = None
    n_cases = len(args.cases) if args.cases is not None else 16
    steps = len(problems) * n_cases * (args.rounds + (len(impls) if timing else 0))
    progress = tqdm(total=steps, desc="bench", unit="step", file=sys.stderr) if tqdm else None
    doc = {**environment(), "problems": {}}
    all_passed = True
    try:
        for prob in problems:
            results = run_problem(prob, impls, cases=args.cases, device=device, rounds=args.rounds,
                                  warmup=getattr(args, "warmup", WARMUP), iters=getattr(args, "iters", ITERS),
                                  timing=timing, seed=args.seed, progress=progress)
            doc["problems"][prob.id] = to_json(prob, results)
            for name, cases in results.items():
                for i, c in enumerate(cases):
                    if not c.passed:
                        all_passed = False
                        log(f"{prob.id} {name} case {i} ({report.axes_text(c.axes)}) FAILED: {c.reason}")
    finally:
        if progress:
            progress.close()
    for pid, entry in doc["problems"].items():
        print(report.case_table(pid, entry, gpu=getattr(args, "gpu", "h200"), baseline=getattr(args, "baseline", None)))
        print()
    if getattr(args, "json", None):
        _write_json(doc, args.json, merge=args.merge)
    if getattr(args, "plot", None):
        report.plot(doc, args.plot, gpu=args.gpu)
    return 0 if all_passed else 1


def _report(results_path: str, out: str, gpu: str) -> int:
    with open(results_path) as f:
        results = json.load(f)
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    plots = {}
    for pid, entry in results["problems"].items():
        if any(i["mean_ms"] is not None for i in entry["impls"].values()):
            plots[pid] = f"plots/{pid}.png"
            report.plot(results, os.path.join(out, plots[pid]), gpu=gpu, only=pid)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write(report.markdown_report(results, plots, gpu=gpu))
    log(f"wrote {path} and {len(plots)} plots")
    return 0


def _write_json(doc: dict, path: str, *, merge: bool) -> None:
    if merge and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        for pid, entry in doc["problems"].items():
            kept = old.get("problems", {}).get(pid, {}).get("impls", {})
            entry["impls"] = {**kept, **entry["impls"]}
        doc = {**doc, "problems": {**old.get("problems", {}), **doc["problems"]}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    log(f"wrote {path}")
