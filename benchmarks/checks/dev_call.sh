#!/usr/bin/env bash
# scratch device script (not committed)
export PYTHONPATH=src:.deps
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_fp16_range.py tests/test_properties.py tests/test_functional.py -k "037 or gemma" -x 2>&1 | tail -2 | tee $OUT/gpu_tests.log
timeout 300 python benchmarks/tune.py 037 --variants default,norm_rope_16s2,norm_rope_32s2 --out $OUT 2>&1 | grep -v "Warn\|warn" | tee $OUT/tune_037.log | grep "means\|FAIL"
python - <<'PY'
import json,os
d=json.load(open(os.environ['OUT']+'/tune_037.json'))
for r in d['rows']:
    print(r['case'], {k: round(v['kernel_ms'].get('_forward_products_kernel',0)*1000,1) for k,v in r['variants'].items()})
PY
