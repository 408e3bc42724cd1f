"""One GPU-suite record (`benchmarks/results/gpu-tests.json`) from several `pytest --gpu-report` runs: the whole
suite at a kernel commit, then a re-run of some of its tests (after a test-only fix, or of tests a run cut off).
Each test takes its outcome from the last run that ran it; `failed` counts the merged outcomes; `commit` is the
last run's; `runs` lists every run (its commit, device, tests run, failures and what it was).

    python3 benchmarks/tools/merge_gpu_reports.py suite.json rerun.json \\
        --what "the whole suite (runs.md s46-1)" "test_wan_self_attention.py after 3756c5c" -o gpu-tests.json
"""

from __future__ import annotations

import argparse
import json


def merge(records: list[dict], whats: list[str]) -> dict:
    """The merged record of `records` (earliest first), each described by the matching entry of `whats`."""
    if len(whats) != len(records):
        raise ValueError(f"--what needs one description per record: {len(records)} records, got {len(whats)}")
    tests: dict = {}
    runs = []
    for record, what in zip(records, whats):
        tests.update(record["tests"])
        runs.append({"commit": record["commit"], "device": record.get("device"), "what": what,
                     "tests": len(record["tests"]), "failed": record["failed"]})
    last = records[-1]
    return {"commit": last["commit"], "device": last.get("device"), "torch": last.get("torch"),
            "failed": sum(v == "failed" for v in tests.values()), "tests": dict(sorted(tests.items())),
            "slowest": records[0].get("slowest", []), "runs": runs}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="--gpu-report files, earliest first")
    p.add_argument("--what", nargs="+", required=True, help="what each run was, in the same order")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args()
    records = []
    for path in args.records:
        with open(path) as f:
            records.append(json.load(f))
    merged = merge(records, args.what)
    with open(args.output, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    print(f"{args.output}: {len(merged['tests'])} tests, {merged['failed']} failed, commit {merged['commit']}")


if __name__ == "__main__":
    main()
