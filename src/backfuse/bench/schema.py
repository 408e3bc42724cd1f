"""The schema of results files (benchmarks/results/*.json): what `bench --json` writes and what
`merge` and `report` accept.

Top level: "device", "torch", "triton", "date" (strings) and "problems"; added since the first files:
"shapes" ("official" or "reduced"), "timed", "rounds", "warmup", "iters", "triton_interpret". Per
problem id: "sol_h200_mean_ms" and "impls"; per implementation: "mean_ms" and (added) "gmean_ms",
the arithmetic and geometric means of its latencies (null unless every case was timed), "fallback"
("reference", where the fp32 reference ran in its place) and "cases"; per case: "uuid", "axes" (the
problem's axes, positive integers), "latency_ms" (null: untimed), "passed" and "min_matched" (null:
nothing was checked, as for the reference itself), and optionally "index" (the official case, 0..15)
and (added) "launches" (kernel launches per call) and "busy_ms" (the median time per call that at
least one of its device activities ran: latency less the idle gaps, e.g. waits on the host), each
null untimed and absent in older files. Optional top-level objects: "train" (`bench --train`, per
problem and case index), "models" (`bench --models`, per "<preset>/<tokens>[/local]"), "dynamic"
(`bench --dynamic`, per entry), "memory" and "e2e" (`bench --memory`, `--e2e`, per "<model>/<tokens>"),
each with "<section>_run": the run that measured it (device, versions, date, commit, steps, warm-up; "train"
and "models" also the timed groups; where a merge kept entries of an earlier run, "earlier": that run's commit
and date).
"""

from __future__ import annotations

import json

from .. import problem as get_problem


class SchemaError(ValueError):
    """Where a document departs from the schema, in one line."""


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_count(minimum: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _or_null(test):
    return lambda v: v is None or test(v)


# (field, test, what it must be, required)
_TOP = (
    ("device", _is_str, "a string", True),
    ("torch", _is_str, "a string", True),
    ("triton", _is_str, "a string", True),
    ("date", _is_str, "a string", True),
    ("problems", lambda v: isinstance(v, dict), "an object of problems by id", True),
    ("shapes", lambda v: v in ("official", "reduced"), '"official" or "reduced"', False),
    ("timed", lambda v: isinstance(v, bool), "true or false", False),
    ("rounds", _is_count(1), "an integer >= 1", False),
    ("warmup", _is_count(0), "an integer >= 0", False),
    ("iters", _is_count(1), "an integer >= 1", False),
    ("triton_interpret", lambda v: isinstance(v, bool), "true or false", False),
    ("train", lambda v: isinstance(v, dict), "an object of problems by id (`bench --train`)", False),
    ("models", lambda v: isinstance(v, dict), 'an object of "<preset>/<tokens>" entries (`bench --models`)', False),
    ("dynamic", lambda v: isinstance(v, dict), "an object of entries by name (`bench --dynamic`)", False),
    ("memory", lambda v: isinstance(v, dict), 'an object of "<model>/<tokens>" entries (`bench --memory`)', False),
    ("e2e", lambda v: isinstance(v, dict), 'an object of "<model>/<tokens>" entries (`bench --e2e`)', False),
    *((f"{section}_run", lambda v: isinstance(v, dict) and isinstance(v.get("commit"), str),
       f"the run that measured \"{section}\": an object with its device, versions, date and commit", False)
      for section in ("train", "models", "dynamic", "memory", "e2e")),
)
# `bench --models`: per preset layer and token count, one bfloat16 training step's figures.
_MODEL_ENTRY = tuple((name, _is_number, "a number", True) for name in ("backfuse_ms", "hf_bf16_ms", "compile_bf16_ms")) + tuple(
    (name, _is_number, "a number", False) for name in ("backfuse_peak_mib", "hf_bf16_peak_mib", "host_us"))
# `bench --train`: per problem, per official case index (a string), one training step's figures.
_TRAIN_CASE = tuple((name, _is_number, "a number", True) for name in (
    "backfuse_fp32_ms", "backfuse_bf16_ms", "eager_bf16_ms", "compile_bf16_ms", "host_us", "peak_mib",
    "eager_bf16_peak_mib"))
_PROBLEM = (
    ("sol_h200_mean_ms", _is_number, "a number", True),
    ("impls", lambda v: isinstance(v, dict) and len(v) > 0, "a non-empty object of implementations by name", True),
)
_IMPL = (
    ("mean_ms", _or_null(_is_number), "a number or null", True),
    ("gmean_ms", _or_null(_is_number), "a number or null", False),
    ("fallback", lambda v: v == "reference", '"reference"', False),
    ("cases", lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of cases", True),
)
_CASE = (
    ("uuid", _is_str, "a string", True),
    ("axes", lambda v: isinstance(v, dict), "an object", True),
    ("latency_ms", _or_null(_is_number), "a number or null", True),
    ("passed", _or_null(lambda v: isinstance(v, bool)), "true, false or null", True),
    ("min_matched", _or_null(_is_number), "a number or null", True),
    ("index", lambda v: _is_count(0)(v) and v < 16, "an integer 0..15", False),
    ("launches", _or_null(_is_count(0)), "an integer >= 0 or null", False),
    ("busy_ms", _or_null(_is_number), "a number or null", False),
)


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(obj, where: str, spec) -> None:
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected an object, got {_shown(obj)}")
    for name, test, expected, required in spec:
        if name not in obj:
            if required:
                raise SchemaError(f'{where}: no "{name}" ({expected})')
        elif not test(obj[name]):
            raise SchemaError(f"{where}.{name}: expected {expected}, got {_shown(obj[name])}")


def validate(doc) -> None:
    """Raise SchemaError, naming the first field that departs from the schema, unless `doc` follows it."""
    _fields(doc, "results", _TOP)
    for pid, cases in doc.get("train", {}).items():
        if pid not in ("072", "037", "021") or not isinstance(cases, dict):
            raise SchemaError(f"train.{pid}: expected one of 072, 037, 021 with an object of cases")
        for index, case in cases.items():
            if not (index.isdigit() and int(index) < 16):
                raise SchemaError(f"train.{pid}: case keys are official indices 0..15, got {index!r}")
            _fields(case, f"train.{pid}.{index}", _TRAIN_CASE)
    for key, entry in doc.get("models", {}).items():
        if key.count("/") not in (1, 2):
            raise SchemaError(f'models: keys are "<preset>/<tokens>[/local]", got {key!r}')
        _fields(entry, f"models.{key}", _MODEL_ENTRY)
    for pid, entry in doc["problems"].items():
        where = f"problems.{pid}"
        try:
            prob = get_problem(pid)
        except ValueError:
            raise SchemaError(f"{where}: unknown problem {pid!r}") from None
        _fields(entry, where, _PROBLEM)
        for name, impl in entry["impls"].items():
            _fields(impl, f"{where}.impls.{name}", _IMPL)
            for k, case in enumerate(impl["cases"]):
                at = f"{where}.impls.{name}.cases[{k}]"
                _fields(case, at, _CASE)
                axes = case["axes"]
                if set(axes) != set(prob.axis_names) or not all(_is_count(1)(v) for v in axes.values()):
                    raise SchemaError(f"{at}.axes: expected positive integers for {', '.join(prob.axis_names)}, "
                                      f"got {_shown(axes)}")
