"""Regenerate README's results table (per implementation the arithmetic and geometric means of the
per-case latencies; older results files get their geometric means computed from those), its training
table (`bench --train`) and the latency plot from benchmarks/results/h200.json.

    python scripts/update_readme.py
"""

from __future__ import annotations

import json
import pathlib

from backfuse.bench import report

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "h200.json"
PLOT = ROOT / "benchmarks" / "plots" / "h200.png"
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
TRAIN_START, TRAIN_END = "<!-- train:start -->", "<!-- train:end -->"


def main() -> None:
    results = json.loads(RESULTS.read_text())
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    text = f"{head}{START}\n{report.readme_table(results)}\n{END}{tail}"
    head, rest = text.split(TRAIN_START, 1)
    _, tail = rest.split(TRAIN_END, 1)
    README.write_text(f"{head}{TRAIN_START}\n{report.train_readme_table(results)}\n{TRAIN_END}{tail}")
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    report.plot(results, str(PLOT))
    print(f"updated {README.name} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
