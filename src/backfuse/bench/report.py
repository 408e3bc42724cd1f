"""Tables for people (terminal, README) and plots, from bench results."""

from __future__ import annotations

import statistics

from .. import problem as get_problem
from .sol import GPUS, leaderboard_score, sol_ms


def axes_text(axes: dict) -> str:
    short = {"batch_size": "B", "seq_len": "S", "seq_len_dec": "Sd", "seq_len_enc": "Se",
             "num_video_tokens": "Nv", "num_text_tokens": "Nt"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in axes.items())


def case_table(pid: str, entry: dict, *, gpu: str = "h200", baseline: str | None = None) -> str:
    """Per case: axes, SOL, and for each impl its latency, % of SOL and pass/fail; then the means."""
    prob = get_problem(pid)
    impls = entry["impls"]
    names = list(impls)
    first = impls[names[0]]["cases"]
    sols = [sol_ms(prob, c["axes"], gpu) for c in first]
    header = ["#", "axes", f"SOL {gpu}"] + names
    rows = []
    for i, case in enumerate(first):
        row = [str(i), axes_text(case["axes"]), f"{sols[i]:.4f}"]
        for name in names:
            c = impls[name]["cases"][i]
            mark = "" if c["passed"] else " FAIL"
            if c["latency_ms"] is None:
                row.append(("ok" if c["passed"] else "FAIL") + f" {c['min_matched']:.4f}")
            else:
                row.append(f"{c['latency_ms']:.4f} {100 * sols[i] / c['latency_ms']:3.0f}%{mark}")
        rows.append(row)
    summary = ["mean", "", f"{statistics.fmean(sols):.4f}"]
    for name in names:
        cases = impls[name]["cases"]
        passed = sum(c["passed"] for c in cases)
        mean = impls[name]["mean_ms"]
        summary.append(f"{passed}/{len(cases)} pass" if mean is None else f"{mean:.4f} {passed}/{len(cases)}")
    rows.append(summary)
    if baseline and baseline in impls and impls[baseline]["mean_ms"] is not None:
        score = ["score S", f"vs {baseline}", ""]
        for name in names:
            pairs = zip(impls[name]["cases"], impls[baseline]["cases"], sols)
            score.append(f"{statistics.fmean(leaderboard_score(c['latency_ms'], b['latency_ms'], s) for c, b, s in pairs):.3f}")
        rows.append(score)
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    lines = [f"{prob.name}  (latency ms, median of CUPTI spans; % of {GPUS[gpu].name} fp16 SOL)"]
    for r in [header] + rows:
        lines.append("  ".join(cell.ljust(w) if j < 2 else cell.rjust(w) for j, (cell, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def readme_table(results: dict) -> str:
    """Markdown summary: per problem and impl, the 16-case mean, passes, % of SOL and speedup."""
    lines = [
        f"Measured on {results['device']} (torch {results['torch']}, triton {results['triton']}, {results['date']}), "
        "official protocol: median CUPTI span of 50 calls, L2 flushed, fresh input addresses; mean over 16 cases.",
        "",
        "| problem | implementation | mean ms | passed | % of H200 SOL | vs fp32 reference |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for pid, entry in results["problems"].items():
        sol = entry["sol_h200_mean_ms"]
        ref = entry["impls"].get("reference", {}).get("mean_ms")
        for name, impl in entry["impls"].items():
            mean = impl["mean_ms"]
            passed = f"{sum(c['passed'] for c in impl['cases'])}/{len(impl['cases'])}"
            speedup = f"{ref / mean:.1f}×" if ref and mean else "–"
            pct = f"{100 * sol / mean:.0f}%" if mean else "–"
            mean_text = f"{mean:.3f}" if mean else "–"
            lines.append(f"| {pid} | {name} | {mean_text} | {passed} | {pct} | {speedup} |")
        lines.append(f"| {pid} | *speed of light (fp16)* | {sol:.3f} | | 100% | |")
    return "\n".join(lines)


def plot(results: dict, path: str, *, gpu: str = "h200", only: str | None = None) -> None:
    """Per problem (or only the one given), per-case latency bars of each impl (log scale) against the SOL line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = [(pid, e) for pid, e in results["problems"].items()
                if (only is None or pid == only) and any(i["mean_ms"] is not None for i in e["impls"].values())]
    if not problems:
        raise ValueError("nothing to plot: these results hold no latencies (a CPU run times nothing)")
    fig, axs = plt.subplots(len(problems), 1, figsize=(12, 3.6 * len(problems)), squeeze=False)
    for ax, (pid, entry) in zip(axs[:, 0], problems):
        prob = get_problem(pid)
        names = [n for n, i in entry["impls"].items() if i["mean_ms"] is not None]
        cases = entry["impls"][names[0]]["cases"]
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            lat = [c["latency_ms"] for c in entry["impls"][name]["cases"]]
            ax.bar([i + (k - (len(names) - 1) / 2) * width for i in range(len(cases))], lat, width,
                   label=f"{name} (mean {entry['impls'][name]['mean_ms']:.3f} ms)")
        sols = [sol_ms(prob, c["axes"], gpu) for c in cases]
        ax.hlines(sols, [i - 0.45 for i in range(len(cases))], [i + 0.45 for i in range(len(cases))],
                  color="black", linewidth=1.5, label=f"{GPUS[gpu].name} SOL (fp16)")
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([axes_text(c["axes"]).replace(" ", "\n") for c in cases], fontsize=6)
        ax.set_ylabel("ms per call")
        ax.set_title(f"{prob.name} — {results['device']}", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        lines += ["```", case_table(pid, entry, gpu=gpu), "```", "",
                  f"What was tried, predicted and measured: [notes/{pid}.md](notes/{pid}.md).", ""]
    return "\n".join(lines)
