"""Regenerate README's results table (per implementation the arithmetic and geometric means of the
per-case latencies; older results files get their geometric means computed from those), its training
tables (`bench --train`, `--models`, `--dynamic`, `--memory`, `--e2e`) and the latency plot from
benchmarks/results/h200.json; a training section h200.json does not hold yet comes from h100.json (runs on an
H100 lease, each table naming its device).

    python scripts/update_readme.py
"""

from __future__ import annotations

import json
import pathlib

from backfuse.bench import report

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "h200.json"
H100 = ROOT / "benchmarks" / "results" / "h100.json"
PLOT = ROOT / "benchmarks" / "plots" / "h200.png"
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
TRAIN_START, TRAIN_END = "<!-- train:start -->", "<!-- train:end -->"
# the training benches' sections: (marker name, table of the section's entries and its run)
SECTIONS = (("models", report.models_table), ("dynamic", report.dynamic_table), ("memory", report.memory_table),
            ("e2e", report.e2e_table))


def _between(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> None:
    results = json.loads(RESULTS.read_text())
    h100 = json.loads(H100.read_text()) if H100.exists() else {}
    text = _between(README.read_text(), START, END, report.readme_table(results))
    text = _between(text, TRAIN_START, TRAIN_END, report.train_readme_table(results))
    for name, table in SECTIONS:
        source = results if results.get(name) else h100
        text = _between(text, f"<!-- {name}:start -->", f"<!-- {name}:end -->",
                        table(source.get(name, {}), source.get(f"{name}_run")))
    README.write_text(text)
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    report.plot(results, str(PLOT))
    print(f"updated {README.name} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
