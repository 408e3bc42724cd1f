"""Tables for people (terminal, README) and plots, from bench results."""

from __future__ import annotations

import statistics

from .. import problem as get_problem
from .sol import GPUS, leaderboard_score, sol_ms


def axes_text(axes: dict) -> str:
    short = {"batch_size": "B", "seq_len": "S", "seq_len_dec": "Sd", "seq_len_enc": "Se",
             "num_video_tokens": "Nv", "num_text_tokens": "Nt"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in axes.items())


def case_index(prob, case: dict, position: int) -> int:
    """A result case's index among the problem's official workloads.

    Results files written before cases carried an "index" are matched by uuid; failing that, the
    case's position in its list stands in.
    """
    if isinstance(case.get("index"), int):
        return case["index"]
    for i, w in enumerate(prob.workloads):
        if w.uuid == case.get("uuid"):
            return i
    return position


def is_reduced(prob, case: dict, position: int = 0) -> bool:
    """Whether a result case ran on other axes than its official workload's (CPU runs reduce them)."""
    i = case_index(prob, case, position)
    return not (0 <= i < len(prob.workloads)) or dict(case.get("axes", {})) != dict(prob.workloads[i].axes)


def shapes_of(results: dict) -> str | None:
    """"official", "reduced" or "mixed" for a results file; None when it holds no cases.

    Files that say so (their "shapes" field) are believed; older ones are judged by their axes.
    """
    if results.get("shapes") in ("official", "reduced"):
        return results["shapes"]
    kinds = set()
    for pid, entry in results.get("problems", {}).items():
        prob = get_problem(pid)
        for impl in entry.get("impls", {}).values():
            kinds.update("reduced" if is_reduced(prob, c, k) else "official" for k, c in enumerate(impl.get("cases", [])))
    return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"


def is_timed(entry: dict) -> bool:
    """Whether any case of any impl of a problem's entry (or of a whole results file) has a latency."""
    entries = entry["problems"].values() if "problems" in entry else [entry]
    return any(c.get("latency_ms") is not None for e in entries for i in e.get("impls", {}).values() for c in i.get("cases", []))


def impl_label(name: str, impl: dict) -> str:
    return f"{name} (reference fallback)" if impl.get("fallback") else name


def case_status(name: str, fallback, passed) -> str:
    """A case's status for an impl: "reference" (what the others are checked against, so never
    checked itself), "fallback" (the fp32 reference ran in the impl's place: nothing of it was
    checked), "pass" or "FAIL"."""
    if name == "reference":
        return "reference"
    if fallback:
        return "fallback"
    return "pass" if passed else "FAIL"


def passes(name: str, impl: dict) -> str:
    """An impl's passes as "14/16", or what stands in for them ("reference", "fallback")."""
    statuses = [case_status(name, impl.get("fallback"), c["passed"]) for c in impl["cases"]]
    if statuses[0] in ("reference", "fallback"):
        return statuses[0]
    return f"{statuses.count('pass')}/{len(statuses)}"


def means(latencies) -> tuple:
    """(arithmetic, geometric) mean of per-case latencies in ms; (None, None) unless every case has one.

    The leaderboard ranks by geometric means (a case twice as fast counts the same on any case);
    the arithmetic mean follows the largest cases."""
    latencies = list(latencies)
    if not latencies or None in latencies:
        return None, None
    return statistics.fmean(latencies), statistics.geometric_mean(latencies)


def impl_means(impl: dict) -> tuple:
    """means() of an impl's cases (computed from them, so older files without "gmean_ms" get both)."""
    return means(c["latency_ms"] for c in impl["cases"])


def _aligned_cases(prob, impls: dict) -> tuple:
    """(official indices in first-seen order, {impl: {index: case}})."""
    by_impl = {name: {case_index(prob, c, k): c for k, c in enumerate(impl.get("cases", []))} for name, impl in impls.items()}
    order = []
    for cases in by_impl.values():
        order += [i for i in cases if i not in order]
    return order, by_impl


FALLBACK_NOTE = ("{names}: the fused kernels did not run (on a CPU they need the Triton interpreter, TRITON_INTERPRET=1), "
                 "so the fp32 reference ran in their place and nothing of backfuse was checked.")


def _launches(case: dict) -> str:
    """Kernel launches per call, and where recorded the share of the span in which the device ran
    nothing of the call (it waited on the host)."""
    text = "?" if case.get("launches") is None else str(case["launches"])
    if case.get("busy_ms") is not None and case.get("latency_ms"):
        text += f" idle {100 * max(0.0, 1 - case['busy_ms'] / case['latency_ms']):.0f}%"
    return text


def case_table(pid: str, entry: dict, *, gpu: str = "h200", baseline: str | None = None, meta: dict | None = None) -> str:
    """Per case (by official index): axes and, for each impl, its status and, where timed, latency against
    SOL and kernel launches per call; then the means (arithmetic and geometric) or the totals.

    meta: the results file's top level (for how many calls each latency is the median of).
    """
    prob = get_problem(pid)
    impls = entry["impls"]
    names = list(impls)
    order, by_impl = _aligned_cases(prob, impls)
    axes = {i: next(cases[i]["axes"] for cases in by_impl.values() if i in cases) for i in order}
    timed = is_timed(entry)
    reduced = any(is_reduced(prob, c, k) for impl in impls.values() for k, c in enumerate(impl.get("cases", [])))
    sols = {i: sol_ms(prob, axes[i], gpu) for i in order}
    header = ["#", "axes"] + ([f"SOL {gpu}"] if timed else []) + [impl_label(n, impls[n]) for n in names]
    rows = []
    for i in order:
        row = [str(i), axes_text(axes[i])] + ([f"{sols[i]:.4f}"] if timed else [])
        for name in names:
            c = by_impl[name].get(i)
            status = None if c is None else case_status(name, impls[name].get("fallback"), c["passed"])
            if c is None:
                row.append("–")
            elif c["latency_ms"] is not None:
                row.append(f"{c['latency_ms']:.4f} {100 * sols[i] / c['latency_ms']:3.0f}% [{_launches(c)}]"
                           + (" FAIL" if status == "FAIL" else ""))
            elif status in ("reference", "fallback"):
                row.append(status)
            else:
                row.append(("ok" if status == "pass" else "FAIL") + f" {c['min_matched']:.4f}")
        rows.append(row)
    if timed:
        sol_mean, sol_gmean = means(sols.values())
        mean_row, gmean_row = ["mean", "", f"{sol_mean:.4f}"], ["geomean", "", f"{sol_gmean:.4f}"]
        for name in names:
            mean, gmean = impl_means(impls[name])
            shown = passes(name, impls[name])
            mean_row.append((f"{mean:.4f}" if mean is not None else "–") + ("" if shown == "reference" else f" {shown}"))
            gmean_row.append(f"{gmean:.4f}" if gmean is not None else "–")
        rows += [mean_row, gmean_row]
    else:
        total = ["total", ""]
        for name in names:
            shown = passes(name, impls[name])
            total.append(f"{shown} pass" if "/" in shown else shown)
        rows.append(total)
    if baseline and baseline in impls and impl_means(impls[baseline])[0] is not None:
        score = ["score S", f"vs {baseline}"] + [""]
        for name in names:
            base = by_impl[baseline]
            pairs = [(c["latency_ms"], base[i]["latency_ms"], sols[i]) for i, c in by_impl[name].items()
                     if i in base and c["latency_ms"] is not None and base[i]["latency_ms"] is not None]
            score.append(f"{statistics.fmean(leaderboard_score(*p) for p in pairs):.3f}" if pairs else "–")
        rows.append(score)
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    if timed:
        calls = f" of {meta['iters']} calls" if meta and meta.get("iters") else ""
        what = (f"latency ms, median of CUPTI spans{calls}; % of {GPUS[gpu].name} fp16 SOL; [kernel launches per call, "
                "? where not recorded; idle: share of the span the device ran nothing of the call]")
    else:
        what = (f"correctness only, {'reduced' if reduced else 'official'} shapes, no timing; "
                "ok/FAIL and the worst output's fraction of elements in tolerance")
    lines = [f"{prob.name}  ({what})"]
    for r in [header] + rows:
        lines.append("  ".join(cell.ljust(w) if j < 2 else cell.rjust(w) for j, (cell, w) in enumerate(zip(r, widths))))
    fallbacks = [n for n in names if impls[n].get("fallback")]
    if fallbacks:
        lines.append(FALLBACK_NOTE.format(names=", ".join(fallbacks)))
    if "reference" in impls:
        lines.append("reference: what the others are checked against (its outputs are the expected ones), so not "
                     "checked itself.")
    return "\n".join(lines)


def readme_table(results: dict) -> str:
    """Markdown summary: per problem and impl, the arithmetic and geometric means over the cases run,
    passes, % of SOL and speedup (both from the arithmetic means)."""
    counts = {len(i.get("cases", [])) for e in results["problems"].values() for i in e["impls"].values()}
    over = f"{counts.pop()} cases" if len(counts) == 1 else "the cases run"
    versions = f"torch {results['torch']}, triton {results['triton']}, {results['date']}"
    timed = is_timed(results)
    if timed:
        calls = results.get("iters", 50)
        head = (f"Measured on {results['device']} ({versions}), official protocol: median CUPTI span of {calls} calls, "
                f"L2 flushed, fresh input addresses; arithmetic and geometric mean over {over} (the leaderboard "
                "uses geometric means).")
    else:
        head = f"Checked on {results['device']} ({versions}): correctness only, {shapes_of(results)} shapes, no timing."
    lines = [
        head,
        "",
        "| problem | implementation | mean ms | geomean ms | passed | % of H200 SOL | vs fp32 reference |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pid, entry in results["problems"].items():
        prob = get_problem(pid)
        order, by_impl = _aligned_cases(prob, entry["impls"])
        axes = {i: next(cases[i]["axes"] for cases in by_impl.values() if i in cases) for i in order}
        sol, sol_gmean = means(sol_ms(prob, axes[i]) for i in order)
        ref = impl_means(entry["impls"]["reference"])[0] if "reference" in entry["impls"] else None
        for name, impl in entry["impls"].items():
            mean, gmean = impl_means(impl)
            speedup = f"{ref / mean:.1f}×" if ref and mean else "–"
            pct = f"{100 * sol / mean:.0f}%" if mean else "–"
            shown = passes(name, impl)
            shown = f"({shown})" if shown == "reference" else shown
            lines.append(f"| {pid} | {impl_label(name, impl)} | {_ms(mean)} | {_ms(gmean)} | {shown} | {pct} | {speedup} |")
        if timed:  # (the SOL of reduced shapes compares with nothing)
            lines.append(f"| {pid} | *speed of light (fp16)* | {sol:.3f} | {sol_gmean:.3f} | | 100% | |")
    return "\n".join(lines)


def _ms(value) -> str:
    return f"{value:.3f}" if value else "–"


class NothingToPlot(ValueError):
    pass


def plot(results: dict, path: str, *, gpu: str = "h200", only: str | None = None) -> None:
    """Per problem (or only the one given), per-case latency bars of each impl (log scale) against the SOL line.

    Cases are labelled by their official index and axes; the legend sits to the right of the axes.
    Raises NothingToPlot when the results hold no latencies (a CPU run times nothing).
    """
    fig = figure(results, gpu=gpu, only=only)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def figure(results: dict, *, gpu: str = "h200", only: str | None = None):
    """The matplotlib figure `plot` saves (the caller closes it)."""
    problems = [(pid, e) for pid, e in results["problems"].items() if (only is None or pid == only) and is_timed(e)]
    if not problems:
        raise NothingToPlot("nothing to plot: these results hold no latencies (a run without a CUDA GPU times nothing)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(len(problems), 1, figsize=(13, 3.8 * len(problems)), squeeze=False)
    for ax, (pid, entry) in zip(axs[:, 0], problems):
        prob = get_problem(pid)
        timed = {n: i for n, i in entry["impls"].items() if is_timed({"impls": {n: i}})}
        order, by_impl = _aligned_cases(prob, timed)
        names = list(timed)
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            cases = by_impl[name]
            xs = [x for x, i in enumerate(order) if i in cases and cases[i]["latency_ms"] is not None]
            mean, gmean = impl_means(timed[name])
            ax.bar([x + (k - (len(names) - 1) / 2) * width for x in xs], [cases[order[x]]["latency_ms"] for x in xs], width,
                   label=impl_label(name, timed[name])
                   + (f" (mean {mean:.3f} ms, geomean {gmean:.3f} ms)" if mean is not None else ""))
        axes = {i: next(c[i]["axes"] for c in by_impl.values() if i in c) for i in order}
        sols = [sol_ms(prob, axes[i], gpu) for i in order]
        ax.hlines(sols, [x - 0.45 for x in range(len(order))], [x + 0.45 for x in range(len(order))],
                  color="black", linewidth=1.5, label=f"{GPUS[gpu].name} SOL (fp16)")
        ax.set_yscale("log")
        ax.set_xlim(-0.6, len(order) - 0.4)
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels([f"#{i}\n" + axes_text(axes[i]).replace(" ", "\n") for i in order], fontsize=6)
        ax.set_xlabel("official case (index, axes)", fontsize=7)
        ax.set_ylabel("ms per call (median CUPTI span)", fontsize=8)
        ax.set_title(f"{prob.name} — {results['device']}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    fig.tight_layout()
    return fig


def markdown_report(results: dict, plots: dict, *, gpu: str = "h200") -> str:
    """benchmarks/report.md: the summary table, then per problem its plot and per-case table.

    plots: problem id -> path of its PNG, relative to the report.
    """
    lines = ["# backfuse benchmark report", "", "Generated by `backfuse report` from the results file; "
             "do not edit by hand.", "", readme_table(results), ""]
    for pid, entry in results["problems"].items():
        prob = get_problem(pid)
        lines += [f"## {pid} — `{prob.name}`", ""]
        if pid in plots:
            lines += [f"![{pid} per-case latency against speed of light]({plots[pid]})", ""]
        lines += ["```", case_table(pid, entry, gpu=gpu, meta=results), "```", "",
                  f"What was tried, predicted and measured: [notes/{pid}.md](notes/{pid}.md).", ""]
    if results.get("train"):
        lines += ["## Training step (`bench --train`)", "", train_readme_table(results), ""]
        for pid, entries in results["train"].items():
            lines += [train_table(pid, entries), ""]
        lines += ["Notes: [notes/training.md](notes/training.md).", ""]
    return "\n".join(lines)


TRAIN_COLUMNS = ("backfuse_fp32_ms", "backfuse_bf16_ms", "eager_bf16_ms", "compile_bf16_ms")


def train_ratios(entries: dict) -> tuple:
    """(geometric means over the cases of backfuse fp32 / compile bf16, backfuse bf16 / compile bf16, and the
    largest of either ratio on any case)."""
    r32 = [e["backfuse_fp32_ms"] / e["compile_bf16_ms"] for e in entries.values()]
    r16 = [e["backfuse_bf16_ms"] / e["compile_bf16_ms"] for e in entries.values()]
    return statistics.geometric_mean(r32), statistics.geometric_mean(r16), max(r32 + r16)


def train_table(pid: str, entries: dict) -> str:
    """Markdown table of a problem's `bench --train` cases: ms per step, ratios to compile bf16, host time,
    peak memory, and the fp32 checks."""
    prob = get_problem(pid)
    lines = [f"### {pid} training step (forward + backward), ms per step",
             "", "| case | axes | backfuse fp32 | backfuse bf16 | eager bf16 | compile bf16 | fp32 / compile | "
             "bf16 / compile | host us (fp32) | peak MiB (bf16) | eager bf16 peak MiB | fp32 checks |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for index, e in sorted(entries.items(), key=lambda kv: int(kv[0])):
        c = e["compile_bf16_ms"]
        checks = "pass" if e.get("fp32_forward_passed") and e.get("fp32_backward_passed") else "FAIL"
        if e.get("sync_free") is False:
            checks += ", syncs"
        lines.append(f"| {index} | {axes_text(prob.workloads[int(index)].axes)} | "
                     + " | ".join(f"{e[k]:.3f}" for k in TRAIN_COLUMNS)
                     + f" | {e['backfuse_fp32_ms'] / c:.2f} | {e['backfuse_bf16_ms'] / c:.2f} | {e['host_us']:.0f} | "
                     f"{e['peak_mib']:.0f} | {e['eager_bf16_peak_mib']:.0f} | {checks} |")
    g32, g16, worst = train_ratios(entries)
    lines.append(f"\ngeometric mean of the ratios to compile bf16: fp32 {g32:.2f}, bf16 {g16:.2f}; largest ratio {worst:.2f}")
    return "\n".join(lines)


def train_readme_table(results: dict) -> str:
    """README's training table from a results file's "train" object: per problem the geometric means of
    the step-time ratios to compile bf16, the largest ratio, the host time per step and the peak-memory
    comparison."""
    train = results.get("train")
    if not train:
        return "(no `bench --train` results yet)"
    run = results.get("train_run", {})
    lines = [f"Measured on {run.get('device', results['device'])} (torch {run.get('torch', results['torch'])}, "
             f"triton {run.get('triton', results['triton'])}, {run.get('date', results['date'])}"
             + (f", commit {run['commit']}" if "commit" in run else "") + "): one layer's forward + backward, "
             f"{steps_text(run, 15, 5)}; ms per step over the official cases.", "",
             "| problem | backfuse fp32 / compile bf16 (geomean, largest) | backfuse bf16 / compile bf16 (geomean, "
             "largest) | cases at most 0.75x (fp32, bf16) | host us per step (median, fp32) | peak memory above eager "
             "bf16's (bf16) | fp32 checks |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for pid in sorted(train, key=lambda p: ["072", "037", "021"].index(p)):
        entries = train[pid]
        r32 = [e["backfuse_fp32_ms"] / e["compile_bf16_ms"] for e in entries.values()]
        r16 = [e["backfuse_bf16_ms"] / e["compile_bf16_ms"] for e in entries.values()]
        host = statistics.median(e["host_us"] for e in entries.values())
        above = [e["peak_mib"] - e["eager_bf16_peak_mib"] for e in entries.values()]
        worse = sum(a > 0.5 for a in above)
        checks = all(e.get("fp32_forward_passed") and e.get("fp32_backward_passed") for e in entries.values())
        lines.append(f"| {pid} | {statistics.geometric_mean(r32):.2f}, {max(r32):.2f} | "
                     f"{statistics.geometric_mean(r16):.2f}, {max(r16):.2f} | {sum(r <= 0.75 for r in r32)}/{len(r32)}, "
                     f"{sum(r <= 0.75 for r in r16)}/{len(r16)} | {host:.0f} | "
                     f"{worse}/{len(above)} cases, at most {max(above):.1f} MiB | "
                     f"{'16/16 pass' if checks and len(entries) == 16 else 'see report'} |")
    return "\n".join(lines)


def steps_text(run: dict, steps=None, warmup=None) -> str:
    """How a training run timed its steps (its `<section>_run`'s steps, warm-up and groups; the defaults for a run
    that did not record them)."""
    steps, warmup = run.get("steps", steps), run.get("warmup", warmup)
    if "groups" not in run:  # (runs before session 49: one group an implementation)
        return f"{steps} steps queued back to back after {warmup}, one synchronization at the end"
    return (f"{run['groups']} groups of {steps} steps an implementation after {warmup} warm-up steps, the "
            "implementations' groups alternating, one synchronization a group; the median group")


def run_line(run: dict | None, what: str) -> list:
    """The lines above a training table naming the run that measured it (a results file's `<section>_run`): device,
    versions, date, commit; empty without one."""
    if not run:
        return []
    short = lambda c: c[:7] if len(c) >= 40 and all(ch in "0123456789abcdef" for ch in c[:40]) else c  # noqa: E731
    parts = [run[k] if k == "date" else f"{k} {run[k]}" for k in ("torch", "triton", "date") if k in run]
    parts.append(f"commit {short(run['commit'])}")
    if "earlier" in run:
        parts.append(f"entries it did not measure: commit {short(run['earlier'].get('commit', '?'))}")
    return [f"Measured on {run.get('device', 'a GPU')} ({', '.join(parts)}): {what}", ""]


def models_table(entries: dict, run: dict | None = None) -> str:
    """Markdown table of `bench --models`: per preset layer and token count, ms per bfloat16 training step
    of backfuse, the model's own code eager and compiled, the ratio, and peak memory; then the geometric
    mean of the ratios. run (a results file's "models_run"): the run's device, versions, date, commit."""
    if not entries:
        return "(no `bench --models` results yet)"
    head = run_line(run, f"one bfloat16 training step, {steps_text(run)}; ms per step.") if run else []
    lines = head + ["| layer / tokens | backfuse | model's code (bf16) | compiled | backfuse / compiled | peak MiB (backfuse, "
             "model's code) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ratios = []
    for key, e in entries.items():
        ratios.append(e["backfuse_ms"] / e["compile_bf16_ms"])
        peak = (f"{e['backfuse_peak_mib']:.0f}, {e['hf_bf16_peak_mib']:.0f}" if "backfuse_peak_mib" in e
                and "hf_bf16_peak_mib" in e else "")
        lines.append(f"| {key} | {e['backfuse_ms']:.3f} | {e['hf_bf16_ms']:.3f} | {e['compile_bf16_ms']:.3f} | "
                     f"{ratios[-1]:.2f} | {peak} |")
    lines.append(f"\ngeometric mean of backfuse / compiled: {statistics.geometric_mean(ratios):.2f} over {len(ratios)}; "
                 f"largest {max(ratios):.2f}")
    return "\n".join(lines)


def dynamic_table(entries: dict, run: dict | None = None) -> str:
    """Markdown table of `bench --dynamic`: per entry, ms per step of each pass of the changing-shape loop for
    backfuse, the model's code eager and compiled, and backfuse's second pass against the others. run: the
    results file's "dynamic_run"."""
    if not entries:
        return "(no `bench --dynamic` results yet)"
    rounds = (run or {}).get("groups", 1)  # (runs before session 58: one round)
    lines = run_line(run, "12 shapes in random order one step each (the 1st pass), then the same 12 again (the "
                          "2nd), after one warm-up step; " + (f"the 2nd the median over {rounds} rounds, each at the "
                          "12 shapes' tensors made anew; " if rounds > 1 else "") + "ms per step.")
    lines += ["| entry | backfuse 1st / 2nd | model's code 1st / 2nd | compiled 1st / 2nd | 2nd: / compiled, / eager | "
              "1st: / eager |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, e in entries.items():
        pair = lambda impl: f"{e[impl + '_first_ms']:.2f} / {e[impl + '_second_ms']:.2f}"  # noqa: E731
        lines.append(f"| {key} | {pair('backfuse')} | {pair('eager')} | {pair('compile')} | "
                     f"{e['backfuse_second_ms'] / e['compile_second_ms']:.2f}, "
                     f"{e['backfuse_second_ms'] / e['eager_second_ms']:.2f} | "
                     f"{e['backfuse_first_ms'] / e['eager_first_ms']:.2f} |")
    return "\n".join(lines)


def memory_table(entries: dict, run: dict | None = None) -> str:
    """Markdown table of `bench --memory`: per model and token count, the peak MiB of a training step, unpatched and
    patched, eager and compiled. run: the results file's "memory_run"."""
    if not entries:
        return "(no `bench --memory` results yet)"
    lines = run_line(run, "the most memory a bfloat16 training step allocates above what was allocated before it, "
                          "MiB.") + [
        "| model / tokens | layers | eager: unpatched | eager: patched | compiled: unpatched | compiled: patched |",
        "| --- | ---: | ---: | ---: | ---: | ---: |"]
    mib = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
    for key, e in entries.items():
        lines.append(f"| {key} | {e.get('layers', '')} | {mib(e.get('hf_peak_mib'))} | {mib(e.get('patched_peak_mib'))} | "
                     f"{mib(e.get('compile_peak_mib'))} | {mib(e.get('patched_compile_peak_mib'))} |")
    return "\n".join(lines)


E2E_COLUMNS = (("hf", "as shipped"), ("compile", "compiled"), ("liger", "Liger"), ("liger_patched", "Liger + patched"),
               ("patched", "patched"), ("patched_compile", "patched + compiled"))


def e2e_table(entries: dict, run: dict | None = None) -> str:
    """Markdown table of `bench --e2e`: per model and token count, ms per training step of each variant ("wrong"
    where its first loss was not the unpatched model's, "failed" where it raised, "–" where it did not run),
    patched + compiled against the fastest alternative in the run (compiled or Liger), and the two's peaks. run:
    the results file's "e2e_run"."""
    if not entries:
        return "(no `bench --e2e` results yet)"
    lines = run_line(run, "a released model's whole training step (its layers at full width in the released pattern), "
                          f"{run.get('steps') if run else ''} steps queued back to back after warm-up, one "
                          "synchronization at the end; ms per step.") + [
        "| model / tokens | " + " | ".join(label for _, label in E2E_COLUMNS) + " | patched + compiled / fastest "
        "alternative | peak MiB (patched + compiled, that alternative) |",
        "| --- | " + " | ".join("---:" for _ in E2E_COLUMNS) + " | ---: | ---: |"]

    def cell(e, v):
        if f"{v}_error" in e:
            return "failed"
        if f"{v}_wrong" in e:
            return f"wrong (first loss {e[f'{v}_wrong']:.3f})"
        ms = e.get(f"{v}_ms")
        return "–" if ms is None else f"{ms:.1f}"

    for key, e in entries.items():
        alternatives = [(e[f"{v}_ms"], v) for v in ("compile", "liger") if e.get(f"{v}_ms") is not None]
        ours = e.get("patched_compile_ms")
        if alternatives and ours is not None:
            best, which = min(alternatives)
            ratio = f"{ours / best:.2f} ({dict(E2E_COLUMNS)[which]})"
            peaks = f"{e.get('patched_compile_peak_mib', 0):.0f}, {e.get(f'{which}_peak_mib', 0):.0f}"
        else:
            ratio = peaks = "–"
        lines.append(f"| {key} | " + " | ".join(cell(e, v) for v, _ in E2E_COLUMNS) + f" | {ratio} | {peaks} |")
    return "\n".join(lines)
