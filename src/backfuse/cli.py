"""The `backfuse` command line: bench, check, sol, export, report, merge.

Errors a user can cause (a missing or malformed file, an impossible request) end in one line on
stderr and exit status 2, without a traceback; a case that fails the correctness rule exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

from . import PROBLEM_IDS, __version__, problem
from .bench import report
from .bench.impls import IMPLS, fallback
from .bench.runner import ITERS, ROUNDS, WARMUP, environment, log, run_info, run_problem, to_json
from .bench.sol import GPUS, sol_ms
from .export import solution

RESULTS = pathlib.Path("benchmarks", "results", "h200.json")
CHECKOUT = pathlib.Path(__file__).resolve().parents[2]  # the repository root when run from a checkout
INTERPRETER_HINT = ("set TRITON_INTERPRET=1 in the environment of the command to run them in the Triton interpreter "
                    "(slow: seconds per case and round; try --cases 0 --rounds 1)")


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _cases(text: str):
    try:
        cases = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cases takes comma-separated case indices 0..15, got {text!r}")
    if not cases:
        raise argparse.ArgumentTypeError("--cases: no case index given")
    bad = [c for c in cases if not 0 <= c < 16]
    if bad:
        raise argparse.ArgumentTypeError(f"--cases: indices must be in 0..15, got {bad}")
    return list(dict.fromkeys(cases))  # each case once, in the order given


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _problems(ids):
    return [problem(pid) for pid in (ids or PROBLEM_IDS)]


def _version() -> str:
    import torch
    import triton

    return f"backfuse {__version__} (torch {torch.__version__}, triton {triton.__version__})"


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("problems", nargs="*", metavar="PROBLEM", help="072, 037, 021 or an official name (default: all three)")
    p.add_argument("--cases", type=_cases, metavar="I,J,...",
                   help="comma-separated official case indices 0..15, e.g. 0,3 (default: all 16); tables and JSON "
                   "keep these indices")
    p.add_argument("--rounds", type=_at_least(1), default=ROUNDS,
                   help=f"correctness rounds of fresh random inputs per case (default {ROUNDS})")
    p.add_argument("--seed", type=int, default=0, help="base seed of the input draws (default 0)")


CPU_NOTE = ("Without a CUDA GPU: correctness only, on reduced shapes (batch at most 2, other axes 17..47), no timing; "
            "`backfuse` is then the fp32 reference fallback (labelled so) unless TRITON_INTERPRET=1 is set in the "
            "command's environment, which runs its kernels in the Triton interpreter (slowly).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="backfuse",
        description="Fused backward kernels for three attention blocks, measured as SOL-ExecBench does. "
        "Exit status: 0 success, 1 a case failed the correctness rule, 2 usage or file errors.",
    )
    parser.add_argument("--version", action="version", version=_version(), help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="check and time implementations on the official cases",
        description="Per case: correctness (the official rule over --rounds rounds of fresh random inputs) and, on a "
        "CUDA GPU, timing (--warmup untimed calls, then --iters timed calls, each after an L2 flush and on fresh input "
        "addresses; latency = median CUPTI span); per implementation the mean over the cases run. " + CPU_NOTE,
    )
    _add_selection(bench)
    bench.add_argument("--impl", nargs="+", choices=IMPLS, metavar="NAME",
                       help=f"implementations, from {', '.join(IMPLS)} (default: all on a GPU; reference and backfuse "
                       "on the CPU)")
    bench.add_argument("--warmup", type=_at_least(0), default=WARMUP, help=f"untimed calls before timing (default {WARMUP})")
    bench.add_argument("--iters", type=_at_least(1), default=ITERS, help=f"timed calls per case (default {ITERS})")
    bench.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                       help="GPU whose speed of light the table compares with (default h200)")
    bench.add_argument("--baseline", choices=IMPLS, metavar="NAME",
                       help="also print SOL-ExecBench's leaderboard score S of each impl against this one (needs timings)")
    bench.add_argument("--json", metavar="FILE", help="write results as JSON (the benchmarks/results schema; "
                       "missing directories are created)")
    bench.add_argument("--merge", action="store_true",
                       help="with --json: keep the file's other problems and impls (refused across devices or shapes)")
    bench.add_argument("--plot", metavar="FILE.png",
                       help="write a PNG of per-case latencies against SOL (needs timings: a CUDA GPU)")

    check = sub.add_parser(
        "check",
        help="correctness only (official rule)",
        description="Runs one implementation on the official cases (--rounds rounds of fresh random inputs each) and "
        "applies the official rule; nothing is timed. Exit status 0 when every case passes, 1 otherwise. " + CPU_NOTE,
    )
    _add_selection(check)
    check.add_argument("--impl", choices=IMPLS, default="backfuse", metavar="NAME",
                       help=f"implementation, one of {', '.join(IMPLS)} (default backfuse)")

    sol = sub.add_parser("sol", help="speed-of-light table (no GPU needed)",
                         description="Per official case: matrix GFLOP, minimal fp32 I/O in MB, and speed-of-light times "
                         "max(2 * MACs / tensor-core rate, I/O bytes / HBM bandwidth) at the fp16 and TF32 rates. No GPU needed.")
    sol.add_argument("problems", nargs="*", metavar="PROBLEM", help="072, 037, 021 or an official name (default: all three)")
    sol.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="GPU peaks to use (default h200)")

    export = sub.add_parser("export", help="write a SOL-ExecBench solution package (JSON)",
                            description="Packs the operator's fused implementation (its sources under the package name "
                            "backfuse_solution, entry point `solution.py::run`, target hardware B200 and LOCAL) as a "
                            "solution JSON file. Missing directories of FILE are created.")
    export.add_argument("problem", metavar="PROBLEM", help="072, 037, 021 or an official name")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the JSON")
    export.add_argument("--author", default="backfuse", help="author field (default backfuse)")

    rpt = sub.add_parser("report", help="Markdown report and per-problem plots from a results file",
                         description="Writes OUT/report.md (summary, per-case tables, links to the notes) and "
                         "OUT/plots/<problem>.png (per-case latency of each timed implementation against SOL) from a "
                         f"results file. Works from any directory: the default results file is {RESULTS} under the "
                         "current directory, else under the checkout backfuse runs from.")
    rpt.add_argument("--results", metavar="FILE", help=f"results file (default: {RESULTS}, found as described above)")
    rpt.add_argument("--out", metavar="DIR",
                     help="where to write (default: the benchmarks directory holding the results file, i.e. the parent "
                     "of its results/ folder; else the file's own directory)")
    rpt.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                     help="GPU whose SOL the per-case tables and plots compare with (default h200; the summary table "
                     "always uses the H200's)")

    merge = sub.add_parser("merge", help="merge results files (from `bench --json`) into one",
                           description="Copies every problem's implementations from each FROM file into INTO (created "
                           "if missing), replacing entries of the same problem and implementation and keeping the rest; "
                           "FROM's device, versions and date replace INTO's. Refuses (exit 2, nothing written) files from "
                           "another device, or with other shapes (CPU runs use reduced shapes), than INTO's.")
    merge.add_argument("into", metavar="INTO", help=f"results file to update, e.g. {RESULTS}")
    merge.add_argument("sources", nargs="+", metavar="FROM", help="results files written by `backfuse bench --json`")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except CLIError as e:
        print(f"backfuse {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"backfuse {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


def _dispatch(parser, args) -> int:
    if args.command == "report":
        return _report(args.results, args.out, args.gpu)
    if args.command == "merge":
        return _merge(args.into, args.sources)
    if args.command == "export":
        try:
            doc = solution(_problems([args.problem])[0], author=args.author)
        except ValueError as e:
            parser.error(str(e))
        _write_file(args.output, json.dumps(doc, indent=1))
        log(f"wrote {args.output}: {doc['definition']}, {len(doc['sources'])} source files")
        return 0
    try:
        problems = _problems(args.problems)
    except ValueError as e:
        parser.error(str(e))
    if args.command == "sol":
        return _sol(problems, args.gpu)
    if args.command == "bench" and args.merge and not args.json:
        parser.error("--merge needs --json FILE")
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

    json_path, plot_path = getattr(args, "json", None), getattr(args, "plot", None)
    if torch.cuda.is_available():
        device = "cuda"
        impls = [args.impl] if args.command == "check" else args.impl or list(IMPLS)
    else:
        device = "cpu"
        timing = False
        impls = [args.impl] if args.command == "check" else args.impl or ["reference", "backfuse"]
        if plot_path:
            raise CLIError("--plot needs latencies, and without a CUDA GPU nothing is timed (correctness only); "
                           "drop --plot or run on a GPU")
    fallbacks = [p.id for p in problems if "backfuse" in impls and fallback(p, "backfuse", device)]
    if device == "cpu":
        how = ("backfuse is the reference fallback (its kernels did not run): " + INTERPRETER_HINT if fallbacks
               else "backfuse's kernels run in the Triton interpreter")
        log(f"no CUDA GPU: correctness only, on reduced shapes, no timing; {how}")
    elif fallbacks:
        log(f"backfuse has no fused kernels for {', '.join(fallbacks)}: there it is the reference fallback")
    doc = {**environment(), **run_info(device, timing=timing, rounds=args.rounds, warmup=getattr(args, "warmup", WARMUP),
                                       iters=getattr(args, "iters", ITERS)), "problems": {}}
    if json_path and args.merge and os.path.exists(json_path):
        _check_mergeable(_load_results(json_path), json_path, doc, "this run")
    baseline = getattr(args, "baseline", None)
    if baseline and (not timing or baseline not in impls):
        log(f"--baseline {baseline}: no score S (needs {baseline} among the timed implementations)")
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are a nicety
        tqdm = None
    n_cases = len(args.cases) if args.cases is not None else 16
    steps = len(problems) * n_cases * (args.rounds + (len(impls) if timing else 0))
    # disable=None: no bar when stderr is not a terminal (no carriage returns in log files).
    progress = tqdm(total=steps, desc=args.command, unit="step", file=sys.stderr, disable=None) if tqdm else None
    all_passed = True
    try:
        for prob in problems:
            results = run_problem(prob, impls, cases=args.cases, device=device, rounds=args.rounds,
                                  warmup=getattr(args, "warmup", WARMUP), iters=getattr(args, "iters", ITERS),
                                  timing=timing, seed=args.seed, progress=progress)
            doc["problems"][prob.id] = to_json(prob, results)
            for name, cases in results.items():
                for c in cases:
                    if not c.passed:
                        all_passed = False
                        log(f"{prob.id} {name} case {c.index} ({report.axes_text(c.axes)}) FAILED: {c.reason}")
    finally:
        if progress:
            progress.close()
    for pid, entry in doc["problems"].items():
        print(report.case_table(pid, entry, gpu=getattr(args, "gpu", "h200"), baseline=baseline, meta=doc))
        print()
    if fallbacks:
        log(f"note: for {', '.join(fallbacks)} backfuse ran as the fp32 reference fallback; its fused kernels were not checked")
    if json_path:
        _write_json(doc, json_path, merge=args.merge)
    if plot_path:
        _plot(doc, plot_path, gpu=args.gpu)
    return 0 if all_passed else 1


def _plot(results: dict, path: str, **kw) -> None:
    try:
        _make_parent(path)
        report.plot(results, path, **kw)
    except report.NothingToPlot as e:
        raise CLIError(str(e))
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}")


def _locate_results(results_path: str | None) -> pathlib.Path:
    if results_path is not None:
        path = pathlib.Path(results_path)
        if not path.is_file():
            raise CLIError(f"results file {results_path} does not exist (write one with `backfuse bench --json FILE`)")
        return path
    candidates = list(dict.fromkeys([pathlib.Path.cwd() / RESULTS, CHECKOUT / RESULTS]))
    for path in candidates:
        if path.is_file():
            return path
    raise CLIError(f"no results file at {' or '.join(map(str, candidates))}; pass --results FILE "
                   "(written by `backfuse bench --json FILE`)")


def _report(results_path: str | None, out: str | None, gpu: str) -> int:
    path = _locate_results(results_path)
    results = _load_results(str(path))
    if out is None:
        folder = path.resolve().parent
        out = str(folder.parent if folder.name == "results" else folder)
    try:
        os.makedirs(os.path.join(out, "plots"), exist_ok=True)
        plots = {}
        for pid, entry in results["problems"].items():
            if report.is_timed(entry):
                plots[pid] = f"plots/{pid}.png"
                report.plot(results, os.path.join(out, plots[pid]), gpu=gpu, only=pid)
        text = report.markdown_report(results, plots, gpu=gpu)
    except OSError as e:
        raise CLIError(f"cannot write into {out}: {e.strerror or e}")
    except (KeyError, TypeError, ValueError) as e:
        raise CLIError(f"{path} is not a results file this version can read ({type(e).__name__}: {e})")
    report_path = os.path.join(out, "report.md")
    _write_file(report_path, text)
    log(f"wrote {report_path} and {len(plots)} plots from {path}")
    return 0


def _merge(into: str, sources) -> int:
    docs = [(source, _load_results(source)) for source in sources]
    target = (into, _load_results(into)) if os.path.exists(into) else docs[0]
    for source, doc in docs:  # all or nothing: check every file before writing any
        if doc is not target[1]:
            _check_mergeable(target[1], target[0], doc, source)
    for _, doc in docs:
        _write_json(doc, into, merge=True)
    return 0


def _check_mergeable(old: dict, old_name: str, new: dict, new_name: str) -> None:
    """Results from different devices, or from reduced and official shapes, must not share a file."""
    old_device, old_shapes = old.get("device", "unknown device"), report.shapes_of(old)
    new_device, new_shapes = new.get("device", "unknown device"), report.shapes_of(new)
    if old_device != new_device or (old_shapes and new_shapes and old_shapes != new_shapes):
        raise CLIError(f"refusing to merge {new_name} ({new_device}, {new_shapes or 'no'} shapes) into {old_name} "
                       f"({old_device}, {old_shapes or 'no'} shapes): results from different devices or shapes don't mix")


def _load_results(path: str) -> dict:
    """A results file written by `backfuse bench --json`, or a one-line error saying why not."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CLIError(f"results file {path} does not exist")
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CLIError(f"{path} is not JSON ({e})")
    if not isinstance(doc, dict) or not isinstance(doc.get("problems"), dict):
        raise CLIError(f"{path} is not a results file written by `backfuse bench --json` (no \"problems\" object)")
    for pid in doc["problems"]:
        try:
            problem(pid)
        except (TypeError, ValueError):
            raise CLIError(f"{path}: unknown problem {pid!r}")
    return doc


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def _write_file(path: str, text: str) -> None:
    try:
        _make_parent(path)
        with open(path, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}")


def _write_json(doc: dict, path: str, *, merge: bool) -> None:
    if merge and os.path.exists(path):
        old = _load_results(path)
        for pid, entry in doc["problems"].items():
            kept = old.get("problems", {}).get(pid, {}).get("impls", {})
            entry["impls"] = {**kept, **entry["impls"]}
        doc = {**doc, "problems": {**old.get("problems", {}), **doc["problems"]}}
        _note_uneven_cases(doc)
    _write_file(path, json.dumps(doc, indent=1))
    log(f"wrote {path}")


def _note_uneven_cases(doc: dict) -> None:
    """After a merge, say where implementations of one problem cover different cases (their means don't compare)."""
    for pid, entry in doc["problems"].items():
        prob = problem(pid)
        covered = {name: sorted(report.case_index(prob, c, k) for k, c in enumerate(impl.get("cases", [])))
                   for name, impl in entry.get("impls", {}).items()}
        if len({tuple(v) for v in covered.values()}) > 1:
            text = "; ".join(f"{name} {v if len(v) < 16 else 'all 16'}" for name, v in covered.items())
            log(f"note: {pid}'s implementations now cover different cases ({text}): their means don't compare")

