#!/usr/bin/env bash
# scratch device script (not committed)
export PYTHONPATH=src:.deps
for pc in "021 6" "021 12" "072 3" "037 8"; do
  timeout 120 python benchmarks/checks/repeat_calls.py $pc --calls 300 --deterministic 2>&1 | grep -v "Warn\|warn" | tail -4
done | tee $OUT/repeat_pdl.log
timeout 400 python -m backfuse bench 072 037 021 --impl backfuse --json $OUT/bench.json 2>&1 | grep -v "Warn\|warn\|step/s" | tee $OUT/bench.log | grep -v "^[0-9] \|^1[0-5] "
