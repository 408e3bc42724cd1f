"""The `backfuse` command line: bench, check, sol, export, report, merge.

Errors a user can cause (a missing or malformed file, an impossible request) end in one line on
stderr and exit status 2, without a traceback, before any work; a case that fails the correctness
rule exits 1, and a run where backfuse was only the fp32 reference fallback (nothing of it checked)
exits 3. Without a CUDA GPU, `bench` and `check` run backfuse's kernels in the Triton interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

from . import PROBLEM_IDS, __version__, problem
from .bench import report, schema
from .bench.e2e import VARIANTS as E2E_VARIANTS
from .bench.impls import IMPLS
from .bench.runner import GROUPS, ITERS, ROUNDS, WARMUP, commit, environment, log, run_info, run_problem, smallest_case, to_json
from .bench.sol import GPUS, sol_ms
from .export import solution
from .problem import fused_unusable

RESULTS = pathlib.Path("benchmarks", "results", "h200.json")
CHECKOUT = pathlib.Path(__file__).resolve().parents[2]  # the repository root when run from a checkout
CPU_ROUNDS = 1  # the interpreter takes seconds per case and round
FAILED, USAGE, FALLBACK, CLOSED_PIPE = 1, 2, 3, 141  # exit statuses besides 0 (141: as a process killed by SIGPIPE)
EXIT_STATUS = (f"Exit status: 0 every case checked passed, {FAILED} a case failed the correctness rule, {USAGE} usage or "
               f"file errors (nothing run), {FALLBACK} backfuse was only the fp32 reference fallback (its kernels did not "
               f"run: nothing of it was checked), {CLOSED_PIPE} the output pipe closed (e.g. | head), 130 interrupted.")


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _cases(text: str):
    try:
        cases = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated case indices 0..15, got {text!r}")
    if not cases:
        raise argparse.ArgumentTypeError("no case index given")
    bad = [c for c in cases if not 0 <= c < 16]
    if bad:
        raise argparse.ArgumentTypeError(f"indices must be in 0..15, got {bad}")
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


class _Version(argparse.Action):
    """--version: the backfuse, torch and triton versions. Triton is imported only here, when asked: `bench` and
    `check` may still have to turn its interpreter on, which must happen before triton is first imported."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import torch
        import triton

        print(f"backfuse {__version__} (torch {torch.__version__}, triton {triton.__version__})")
        parser.exit()


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("problems", nargs="*", metavar="PROBLEM", help="072, 037, 021 or an official name (default: all three)")
    p.add_argument("--cases", type=_cases, metavar="I,J,...",
                   help="comma-separated official case indices 0..15, e.g. 0,3 (default: all 16 on a CUDA GPU; without "
                   "one, each problem's smallest case); tables and JSON keep these indices")
    p.add_argument("--rounds", type=_at_least(1),
                   help=f"correctness rounds of fresh random inputs per case (default {ROUNDS} on a CUDA GPU, "
                   f"{CPU_ROUNDS} without one)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the input draws (default 0)")


CPU_NOTE = ("Without a CUDA GPU: correctness only, on reduced shapes (batch at most 2, other axes 17..47), no timing; "
            "backfuse's kernels run in the Triton interpreter (TRITON_INTERPRET=1 is set for the run unless "
            "TRITON_INTERPRET is already set; set to anything else, backfuse is the fp32 reference fallback, labelled "
            "so, which is not a pass: exit status 3); by default each problem's smallest case, 1 round (the interpreter "
            "takes seconds per case and round). Timing, the official shapes and the Hopper Gluon kernel need a CUDA GPU.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="backfuse",
        description="Fused backward kernels for three attention blocks, measured as SOL-ExecBench does. " + EXIT_STATUS,
    )
    parser.add_argument("--version", action=_Version, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="check and time implementations on the official cases",
        description="Per case: correctness (the official rule over --rounds rounds of fresh random inputs) and, on a "
        "CUDA GPU, timing (--warmup untimed calls, then --iters timed calls, each after an L2 flush and on fresh input "
        "addresses; latency = median CUPTI span, and the kernel launches per call); per implementation the arithmetic "
        "and the geometric mean over the cases run. The reference is what the others are checked against: it is "
        "timed, not checked. " + CPU_NOTE + " " + EXIT_STATUS,
    )
    _add_selection(bench)
    bench.add_argument("--impl", nargs="+", choices=IMPLS, metavar="NAME",
                       help=f"implementations, from {', '.join(IMPLS)} (default: all on a GPU; backfuse without one, where "
                       "the reference, which is never checked against itself, would have nothing to do)")
    bench.add_argument("--warmup", type=_at_least(0), default=WARMUP, help=f"untimed calls before timing (default {WARMUP})")
    bench.add_argument("--iters", type=_at_least(1), default=ITERS, help=f"timed calls per case (default {ITERS})")
    bench.add_argument("--gpu", choices=sorted(GPUS), default="h200",
                       help="GPU whose speed of light the table compares with (default h200)")
    bench.add_argument("--baseline", choices=IMPLS, metavar="NAME",
                       help="also print SOL-ExecBench's leaderboard score S of each impl against this one (needs timings)")
    bench.add_argument("--json", metavar="FILE", help="write results as JSON (the benchmarks/results schema; "
                       "missing directories are created; checked before the run)")
    bench.add_argument("--merge", action="store_true",
                       help="with --json: keep the file's other problems and impls (refused across devices or shapes)")
    bench.add_argument("--plot", metavar="FILE.png",
                       help="write a PNG of per-case latencies against SOL (needs timings: a CUDA GPU)")
    bench.add_argument("--train", action="store_true",
                       help="instead: one layer's training step (forward + backward, groups of steps queued back to "
                       "back, one synchronization a group, the implementations' groups alternating) of backfuse on "
                       "float32 and on bfloat16 against the layer written plainly in bfloat16, eager and "
                       "torch.compile'd; host time per step and peak memory; fp32 outputs and gradients checked by "
                       "the official rule (needs a CUDA GPU; JSON under \"train\")")
    bench.add_argument("--models", nargs="*", metavar="PRESET",
                       help="instead: one layer's training step at released models' sizes and token counts "
                       "(backfuse.presets; default all), bfloat16, against the model's own attention code, eager and "
                       "torch.compile'd (needs a CUDA GPU; JSON under \"models\")")
    bench.add_argument("--dynamic", nargs="*", metavar="ENTRY",
                       help="instead: training steps whose shapes change every step (12 lengths in random order, twice, "
                       "after a warm-up at another; backfuse against the model's own code, eager and torch.compile'd) "
                       "for gemma3-1b, gemma3-4b, gemma2-9b, gemma3-4b/packed, wan2.1-1.3b (default all; needs a CUDA "
                       "GPU; JSON under \"dynamic\")")
    bench.add_argument("--e2e", nargs="*", metavar="MODEL",
                       help="instead: a released model's whole training step (a few decoder layers at its width in the "
                       "released pattern, transformers' and diffusers' classes, bf16): as shipped, compiled, patched, "
                       "patched and compiled, and Liger Kernel's patch with and without backfuse's where liger-kernel is "
                       "installed; ms, host ms, peak memory, first loss checked (default all: Gemma 2 and 3, Wan; "
                       "needs a CUDA GPU, diffusers for Wan; JSON under \"e2e\")")
    bench.add_argument("--memory", action="store_true",
                       help="instead: peak memory of a training step of 2-layer Gemma 3 4B (2x4096 tokens) and 27B "
                       "(1x4096), patched against unpatched, eager and compiled (needs a CUDA GPU; JSON under \"memory\")")
    bench.add_argument("--variants", nargs="+", choices=E2E_VARIANTS, metavar="VARIANT",
                       help=f"with --e2e: the variants to run, from {', '.join(E2E_VARIANTS)} (default all; hf always "
                       "runs first: the others' first losses are checked against it)")
    bench.add_argument("--lora", type=_at_least(1), default=0, metavar="RANK",
                       help="with --e2e: a LoRA fine-tuning step (PEFT adapters of this rank on every linear layer of "
                       "the decoder layers or blocks, added after backfuse's patch, the rest frozen), under "
                       "\"<model>/<tokens>/lora<RANK>\"")
    bench.add_argument("--split", action="store_true",
                       help="with --e2e: also each variant's GPU time a step by kind of kernel (products, attention, the "
                       "rest; the profiler over 3 more steps), under \"<variant>_split\"")
    bench.add_argument("--steps", type=_at_least(1), default=20,
                       help="--train, --models: timed steps per group (default 20); --e2e, --memory: per variant, at most 10")
    bench.add_argument("--groups", type=_at_least(1),
                       help=f"--train, --models: timed groups per implementation, the implementations' groups "
                       f"alternating; each figure the median over its groups; --dynamic: rounds of the loop, each at "
                       f"its 12 shapes' tensors made anew, the second pass the median over them (default {GROUPS})")

    check = sub.add_parser(
        "check",
        help="correctness only (official rule)",
        description="Runs one implementation on the official cases (--rounds rounds of fresh random inputs each) and "
        "applies the official rule against the fp32 reference; nothing is timed. " + CPU_NOTE + " " + EXIT_STATUS,
    )
    _add_selection(check)
    checkable = [n for n in IMPLS if n != "reference"]
    check.add_argument("--impl", choices=IMPLS, default="backfuse", metavar="NAME",
                       help=f"implementation, one of {', '.join(checkable)} (default backfuse; the reference is what "
                       "they are checked against)")

    sol = sub.add_parser("sol", help="speed-of-light table (no GPU needed)",
                         description="Per official case: matrix GFLOP, minimal fp32 I/O in MB, and speed-of-light times "
                         "max(2 * MACs / tensor-core rate, I/O bytes / HBM bandwidth) at the fp16 and TF32 rates, with "
                         "their arithmetic and geometric means. No GPU needed.")
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
        status = _dispatch(parser, args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return status
    except CLIError as e:
        print(f"backfuse {args.command}: error: {e}", file=sys.stderr, flush=True)
        return USAGE
    except KeyboardInterrupt:
        print(f"backfuse {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # The reader went away (`backfuse sol | head -3`): stop quietly, as other Unix tools do, and
        # point both streams at /dev/null so that the interpreter's flush at exit finds nothing to say.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            os.dup2(devnull, stream.fileno())
        return CLOSED_PIPE


def _dispatch(parser, args) -> int:
    if args.command == "report":
        return _report(args.results, args.out, args.gpu)
    if args.command == "merge":
        return _merge(args.into, args.sources)
    if args.command == "export":
        try:
            prob = _problems([args.problem])[0]
        except ValueError as e:
            parser.error(str(e))
        _check_writable(args.output)
        doc = solution(prob, author=args.author)
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
    if args.command == "bench" and args.split and args.e2e is None:
        parser.error("--split splits --e2e's steps: add --e2e [MODEL ...]")
    if args.command == "bench" and args.lora and args.e2e is None:
        parser.error("--lora adds adapters to --e2e's models: add --e2e [MODEL ...]")
    if args.command == "bench" and args.variants and args.e2e is None:
        parser.error("--variants chooses --e2e's variants: add --e2e [MODEL ...]")
    if args.command == "bench":
        _one_training_run(parser, args)
        _one_triton_cache()
    if args.command == "bench" and args.models is not None:
        return _bench_models(args)
    if args.command == "bench" and args.dynamic is not None:
        return _bench_dynamic(args)
    if args.command == "bench" and (args.e2e is not None or args.memory):
        return _bench_e2e(args)
    if args.command == "bench" and args.train:
        return _bench_train(problems, args)
    return _bench(problems, args, timing=args.command == "bench")


def _one_training_run(parser, args) -> None:
    """Refuse two training benches in one call, and the official cases' selection on those that choose their own."""
    runs = [name for name, on in (("--train", args.train), ("--models", args.models is not None),
                                  ("--dynamic", args.dynamic is not None), ("--e2e", args.e2e is not None),
                                  ("--memory", args.memory)) if on]
    if len(runs) > 1:
        parser.error(f"{' and '.join(runs)} are separate runs: pass one")
    if args.groups is not None and runs[:1] not in (["--train"], ["--models"], ["--dynamic"]):
        parser.error("--groups is --train's, --models' and --dynamic's: the groups of timed steps they alternate")
    if runs and runs[0] != "--train" and (args.problems or args.cases or args.impl or args.plot or args.baseline):
        parser.error(f"{runs[0]} runs its own selection (what it times against the model's own code): drop problems, "
                     "--cases, --impl, --plot and --baseline")


def _one_triton_cache() -> None:
    """TRITON_CACHE_DIR set for the bench's process, to Triton's own default unless the user set it: TorchInductor
    sets it to a directory of its own at its first compile where it is unset, so without this the kernels backfuse
    compiles after a compiled implementation's run (the next entry of `--dynamic`, `--e2e`'s later variants) would
    miss the kernels compiled before it and compile them again, inside whatever that run times."""
    home = os.environ.get("TRITON_HOME", os.path.expanduser("~/"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(home, ".triton", "cache"))


def train_warmup(requested: int) -> int:
    """Untimed steps before `--train` / `--models` time theirs: the requested count up to 5, and at least
    `e2e.steady_after()`, so that the timed steps are a long fixed-shape run's steady state."""
    from .bench import e2e

    return max(min(requested, 5), e2e.steady_after())


class _Section:
    """A training bench's results (`bench --train`, `--models`, `--dynamic`, `--e2e`, `--memory`) and their file:
    `save` writes them after every entry (a run cut short keeps what it measured), over the file's own entries
    of the section with --merge (train: per problem), with `<section>_run`, the run that measured them (device,
    versions, date, commit, steps; where merged entries of an earlier run stay, that run's commit and date
    under "earlier")."""

    def __init__(self, args, section: str, *, warmup: int, steps: int, groups: int | None = None):
        self.path, self.section = args.json, section
        if self.path:
            _check_writable(self.path)
        self.old = _load_results(self.path) if self.path and args.merge and os.path.exists(self.path) else None
        device = environment()["device"]
        if self.old is not None and self.old["device"] != device:
            raise CLIError(f"refusing to merge this run ({device}) into {self.path} ({self.old['device']}): results from "
                           "different devices don't mix")
        self.doc = {**environment(), **run_info("cuda", timing=True, rounds=1, warmup=warmup, iters=steps),
                    "problems": {}, section: {}}
        self.run = {**environment(), "commit": commit(), "steps": steps, "warmup": warmup,
                    **({} if groups is None else {"groups": groups})}

    @property
    def entries(self) -> dict:
        return self.doc[self.section]

    def save(self) -> None:
        if not self.path:
            return
        section, run = self.section, dict(self.run)
        if self.old is None:
            doc = {**self.doc, f"{section}_run": run}
        else:
            kept = dict(self.old.get(section, {}))
            for key, entry in self.entries.items():
                kept[key] = {**kept.get(key, {}), **entry} if section == "train" else entry
            stays = any(key not in self.entries or (section == "train" and set(kept[key]) - set(self.entries[key]))
                        for key in kept)
            earlier = self.old.get(f"{section}_run", {})
            if stays and earlier.get("commit") not in (None, run["commit"]):
                run["earlier"] = {k: earlier[k] for k in ("commit", "date") if k in earlier}
            doc = {**self.old, section: kept, f"{section}_run": run}
        _write_file(self.path, json.dumps(doc, indent=1))


def _bench_train(problems, args) -> int:
    import torch

    from .bench import train

    if not torch.cuda.is_available():
        raise CLIError("--train times training steps on a CUDA GPU, and none is visible; without one, `backfuse check` "
                       "and the tests check the training paths' arithmetic in the Triton interpreter")
    if args.impl or args.plot or args.baseline:
        raise CLIError("--train compares its own set of implementations (backfuse fp32 and bf16, eager and compiled bf16); "
                       "drop --impl, --plot and --baseline")
    warmup = train_warmup(args.warmup)
    groups = args.groups or GROUPS
    out = _Section(args, "train", warmup=warmup, steps=args.steps, groups=groups)
    selection = {prob.id: args.cases or list(range(len(prob.workloads))) for prob in problems}
    total, done = sum(map(len, selection.values())), 0
    failed = False
    for prob in problems:
        entries = out.entries[prob.id] = {}
        for index in selection[prob.id]:
            start = time.perf_counter()
            entry = entries[str(index)] = train.run_case(prob, index, "cuda", warmup=warmup, steps=args.steps,
                                                                groups=groups)
            done += 1
            failed |= not (entry["fp32_forward_passed"] and entry["fp32_backward_passed"] and entry["sync_free"])
            log(f"[{done}/{total}] {prob.id} case {index} ({report.axes_text(prob.workloads[index].axes)}): "
                + ", ".join(f"{name} {entry[name + '_ms']:.3f} ms" for name in train.IMPLEMENTATIONS)
                + f" ({time.perf_counter() - start:.1f} s)")
            out.save()
        print(report.train_table(prob.id, entries))
        print()
    if args.json:
        log(f"wrote {args.json}")
    return FAILED if failed else 0


def _bench_models(args) -> int:
    import torch

    from . import presets
    from .bench import models

    for name in args.models:
        if name not in presets.PRESETS:
            raise CLIError(f"--models: no preset {name!r}; there are {', '.join(presets.PRESETS)}")
    if not torch.cuda.is_available():
        raise CLIError("--models times training steps on a CUDA GPU, and none is visible; without one the tests check "
                       "every preset's layer against float64 at a few tokens (tests/test_presets.py)")
    warmup = train_warmup(args.warmup)
    groups = args.groups or GROUPS
    out = _Section(args, "models", warmup=warmup, steps=args.steps, groups=groups)
    todo = models.entries(args.models)
    for done, (key, preset, local, tokens) in enumerate(todo, 1):
        start = time.perf_counter()
        entry = out.entries[key] = models.run_entry(preset, local, tokens, "cuda", warmup=warmup, steps=args.steps,
                                                             groups=groups)
        log(f"[{done}/{len(todo)}] {key}: " + ", ".join(f"{name} {entry[name + '_ms']:.3f} ms"
                                                     for name in models.IMPLEMENTATIONS)
            + f" ({time.perf_counter() - start:.1f} s)")
        out.save()
    print(report.models_table(out.entries))
    if args.json:
        log(f"wrote {args.json}")
    return 0


def _bench_dynamic(args) -> int:
    import torch

    from .bench import dynamic

    todo = args.dynamic or list(dynamic.ENTRIES)
    for key in todo:
        if key not in dynamic.ENTRIES:
            raise CLIError(f"--dynamic: no entry {key!r}; there are {', '.join(dynamic.ENTRIES)}")
    if not torch.cuda.is_available():
        raise CLIError("--dynamic times training steps on a CUDA GPU, and none is visible")
    rounds = args.groups or GROUPS
    out = _Section(args, "dynamic", warmup=1, steps=2 * dynamic.SHAPES, groups=rounds)
    for done, key in enumerate(todo, 1):
        start = time.perf_counter()
        log(f"[{done}/{len(todo)}] {key}")
        out.entries[key] = dynamic.run_entry(key, "cuda", seed=args.seed, rounds=rounds)
        log(f"[{done}/{len(todo)}] {key} ({time.perf_counter() - start:.1f} s)")
        out.save()
    print(report.dynamic_table(out.entries))
    if args.json:
        log(f"wrote {args.json}")
    return 0


def _bench_e2e(args) -> int:
    import torch

    from .bench import e2e

    if args.memory:
        section, todo = "memory", [(name, tokens, 2) for name, tokens in e2e.MEMORY]
    else:
        for name in args.e2e:
            if name not in e2e.TOKENS:
                raise CLIError(f"--e2e: no model {name!r}; there are {', '.join(e2e.TOKENS)}")
        section, todo = "e2e", [(name, e2e.TOKENS[name], None) for name in args.e2e or e2e.TOKENS]
    if not torch.cuda.is_available():
        raise CLIError(f"--{section} times training steps on a CUDA GPU, and none is visible")
    steps = min(args.steps, 10)
    out = _Section(args, section, warmup=3, steps=steps)
    if section == "memory":
        variants = e2e.MEMORY_VARIANTS
    else:
        variants = ("hf", *(v for v in e2e.VARIANTS if v != "hf" and v in (args.variants or e2e.VARIANTS)))

    def record(key, entry):
        """The entry (a partial one after each variant) into the results and their file."""
        if section == "memory":
            entry = {k: entry.get(k) for k in ("patched_peak_mib", "hf_peak_mib", "patched_compile_peak_mib",
                                                "compile_peak_mib")} | {"layers": 2}
        out.entries[key] = entry
        out.save()

    for done, (name, tokens, layers) in enumerate(todo, 1):
        key = f"{name}/{'x'.join(map(str, tokens))}" + (f"/lora{args.lora}" if args.lora else "")
        log(f"[{done}/{len(todo)}] {key}")
        record(key, e2e.run_entry(name, tokens, layers=layers, steps=steps, split=args.split, variants=variants,
                                  lora=args.lora, progress=lambda entry, key=key: record(key, dict(entry))))
    print(json.dumps(out.entries, indent=1))
    if args.json:
        log(f"wrote {args.json}")
    return 0


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
        print(f"{'mean':>2}  {'':<28} {'':>8} {'':>7} {statistics.fmean(fp16):12.4f} {statistics.fmean(tf32):12.4f}")
        print(f"{'geomean':<32} {'':>8} {'':>7} {statistics.geometric_mean(fp16):12.4f} "
              f"{statistics.geometric_mean(tf32):12.4f}\n")
    return 0


def _bench(problems, args, *, timing: bool) -> int:
    import torch

    json_path, plot_path = getattr(args, "json", None), getattr(args, "plot", None)
    for path in (json_path, plot_path):
        if path:
            _check_writable(path)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    impls = [args.impl] if args.command == "check" else args.impl or (list(IMPLS) if cuda else ["backfuse"])
    if args.command == "check" and args.impl == "reference":
        raise CLIError("--impl reference: the reference is what check compares against, and checking it against itself "
                       f"tells nothing; pick one of {', '.join(n for n in IMPLS if n != 'reference')}")
    if not cuda:
        timing = False
        if plot_path:
            raise CLIError("--plot needs latencies, and without a CUDA GPU nothing is timed (correctness only); "
                           "drop --plot or run on a GPU")
        if "reference" in impls:
            impls = [n for n in impls if n != "reference"]
            if not impls:
                raise CLIError("--impl reference: without a CUDA GPU nothing is timed, and the reference is what the "
                               "others are checked against, so it alone has nothing to do; add backfuse, reference_tf32 "
                               "or torch_compile")
            log("reference left out: without a CUDA GPU nothing is timed, and it is what the others are checked against")
        if "backfuse" in impls:
            _announce_cpu_kernels()
    rounds = args.rounds or (ROUNDS if cuda else CPU_ROUNDS)
    warmup, iters = getattr(args, "warmup", WARMUP), getattr(args, "iters", ITERS)
    doc = {**environment(), **run_info(device, timing=timing, rounds=rounds, warmup=warmup, iters=iters), "problems": {}}
    if json_path and args.merge and os.path.exists(json_path):
        _check_mergeable(_load_results(json_path), json_path, doc, "this run")
    baseline = getattr(args, "baseline", None)
    if baseline and (not timing or baseline not in impls):
        log(f"--baseline {baseline}: no score S (needs {baseline} among the timed implementations)")
    # The cases asked for; else all 16 on a CUDA GPU, else each problem's smallest (the interpreter is slow).
    selection = {prob.id: args.cases or (list(range(len(prob.workloads))) if cuda else [smallest_case(prob)])
                 for prob in problems}
    total, done = sum(map(len, selection.values())), []

    def progress(prob, index, axes, results, seconds):
        """One line per case on stderr, whatever it is (terminal, file, pipe)."""
        done.append(index)
        cells = ", ".join(f"{name} {report.case_status(name, r.fallback, r.passed)}"
                          + (f" {r.latency_ms:.4f} ms" if r.latency_ms is not None else "") for name, r in results.items())
        log(f"[{len(done)}/{total}] {prob.id} case {index} ({report.axes_text(axes)}): {cells} ({seconds:.1f} s)")

    for prob in problems:
        results = run_problem(prob, impls, cases=selection[prob.id], device=device, rounds=rounds, warmup=warmup,
                              iters=iters, timing=timing, seed=args.seed,
                              progress=lambda *a, prob=prob: progress(prob, *a))
        doc["problems"][prob.id] = to_json(prob, results)
        for name, results_of_impl in results.items():
            for c in results_of_impl:
                if c.passed is False:
                    log(f"{prob.id} {name} case {c.index} ({report.axes_text(c.axes)}) FAILED: {c.reason}")
    for pid, entry in doc["problems"].items():
        print(report.case_table(pid, entry, gpu=getattr(args, "gpu", "h200"), baseline=baseline, meta=doc))
        print()
    statuses = {status for _, status in _statuses(doc)}
    print(_summary(doc, device))
    if json_path:
        _write_json(doc, json_path, merge=args.merge)
    if plot_path:
        _plot(doc, plot_path, gpu=args.gpu)
    return FAILED if "FAIL" in statuses else FALLBACK if "fallback" in statuses else 0


def _announce_cpu_kernels() -> None:
    """Without a CUDA GPU, run backfuse's kernels in the Triton interpreter: TRITON_INTERPRET=1 unless the user
    set TRITON_INTERPRET (then respected). The command line imports triton only after this (the interpreter
    must be on before triton is first imported). Says what will run; a setup where the kernels cannot run in
    the interpreter (`fused_unusable`) is a CLIError."""
    import torch

    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] != "1":
        log(f"no CUDA GPU and TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}: backfuse runs as the fp32 reference "
            "fallback, so nothing of it is checked (exit status 3); unset TRITON_INTERPRET to run its kernels in the "
            "Triton interpreter")
        return
    reason = fused_unusable(torch.device("cpu"))
    if reason:
        raise CLIError(reason)
    log("no CUDA GPU: running backfuse's Triton kernels in the Triton interpreter on the CPU, on reduced shapes, "
        "no timing (seconds per case and round)")


def _statuses(doc: dict):
    """(impl, status) of every case of a results document (report.case_status)."""
    for entry in doc["problems"].values():
        for name, impl in entry["impls"].items():
            for c in impl["cases"]:
                yield name, report.case_status(name, impl.get("fallback"), c["passed"])


def _summary(doc: dict, device: str) -> str:
    """One line: what was checked (implementations, cases, shapes, rounds), on what, with what result, and on a
    CPU what needs a CUDA GPU."""
    where = []
    for pid, entry in doc["problems"].items():
        prob = problem(pid)
        indices = [report.case_index(prob, c, k) for k, c in enumerate(next(iter(entry["impls"].values()))["cases"])]
        where.append(f"{pid} {'all 16 cases' if sorted(indices) == list(range(16)) else _cases_text(indices)}")
    statuses = list(_statuses(doc))
    checked = list(dict.fromkeys(name for name, status in statuses if status in ("pass", "FAIL")))
    fallbacks = list(dict.fromkeys(name for name, status in statuses if status == "fallback"))
    passed, failed = (sum(status == s for _, status in statuses) for s in ("pass", "FAIL"))
    names = ", ".join(("backfuse's kernels in the Triton interpreter" if n == "backfuse" and doc.get("triton_interpret")
                       else n) for n in checked)
    rounds = f"{doc['rounds']} round{'s' if doc['rounds'] > 1 else ''} each"
    text = (f"checked {names} against the fp32 reference on {doc['device']}: {'; '.join(where)} ({doc['shapes']} shapes), "
            f"{rounds}: {passed}/{passed + failed} passed" if checked else
            f"checked nothing on {doc['device']} ({'; '.join(where)})")
    if fallbacks:
        text += f"; {', '.join(fallbacks)} ran as the fp32 reference fallback (not checked)"
    if doc["timed"]:
        text += f"; timed: median CUPTI span of {doc['iters']} calls per case"
    elif device == "cpu":
        text += ". Timing, the official shapes and the Hopper Gluon kernel need a CUDA GPU"
    return text + "."


def _cases_text(indices) -> str:
    return ("case " if len(indices) == 1 else "cases ") + ", ".join(map(str, indices))


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
    _check_writable(out, directory=True)
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
    report_path = os.path.join(out, "report.md")
    _write_file(report_path, text)
    log(f"wrote {report_path} and {len(plots)} plots from {path}")
    return 0


def _merge(into: str, sources) -> int:
    _check_writable(into)
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
    old_device, old_shapes = old["device"], report.shapes_of(old)
    new_device, new_shapes = new["device"], report.shapes_of(new)
    if old_device != new_device or (old_shapes and new_shapes and old_shapes != new_shapes):
        raise CLIError(f"refusing to merge {new_name} ({new_device}, {new_shapes or 'no'} shapes) into {old_name} "
                       f"({old_device}, {old_shapes or 'no'} shapes): results from different devices or shapes don't mix")


def _load_results(path: str) -> dict:
    """A results file written by `backfuse bench --json` (bench/schema.py), or a one-line error saying why not."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CLIError(f"results file {path} does not exist")
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CLIError(f"{path} is not JSON ({e})")
    try:
        schema.validate(doc)
    except schema.SchemaError as e:
        raise CLIError(f"{path} is not a results file written by `backfuse bench --json`: {e}")
    return doc


def _check_writable(path: str, *, directory: bool = False) -> None:
    """Refuse, before any work, an output path that cannot be written: a directory where a file is wanted (or
    the other way round), or one whose nearest existing ancestor is a file or not writable (missing
    directories are created when writing)."""
    target = os.path.abspath(path)
    if os.path.exists(target) and os.path.isdir(target) != directory:
        raise CLIError(f"cannot write {path}: it is {'not ' if directory else ''}a directory")
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CLIError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise CLIError(f"cannot write {path}: permission denied")
    # Access bits are not the whole story (/proc, read-only mounts, root): make the missing directories
    # now and try the file there, leaving nothing behind that was not there.
    folder = target if directory else os.path.dirname(target)
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".backfuse-write-check-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None


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
            kept = old["problems"].get(pid, {}).get("impls", {})
            entry["impls"] = {**kept, **entry["impls"]}
        doc = {**doc, "problems": {**old["problems"], **doc["problems"]}}
        _note_uneven_cases(doc)
    _write_file(path, json.dumps(doc, indent=1))
    log(f"wrote {path}")


def _note_uneven_cases(doc: dict) -> None:
    """After a merge, say where implementations of one problem cover different cases (their means don't compare)."""
    for pid, entry in doc["problems"].items():
        prob = problem(pid)
        covered = {name: sorted(report.case_index(prob, c, k) for k, c in enumerate(impl["cases"]))
                   for name, impl in entry["impls"].items()}
        if len({tuple(v) for v in covered.values()}) > 1:
            text = "; ".join(f"{name} {v if len(v) < 16 else 'all 16'}" for name, v in covered.items())
            log(f"note: {pid}'s implementations now cover different cases ({text}): their means don't compare")

