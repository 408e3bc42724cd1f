"""The command line never misleads: labels say what ran and what was measured, errors are one line."""

import json
import math
import os
import shutil
import statistics

import pytest
import torch
from helpers import ROOT, run_cli

import backfuse
from backfuse import cli
from backfuse.bench import report, sol_ms
from backfuse.cli import main

H200 = ROOT / "benchmarks" / "results" / "h200.json"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")


def _one_line_error(err: str, *words) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _h200() -> dict:
    return json.loads(H200.read_text())


def _cpu_doc(pid="021", cases=(3,)):
    """What `bench --json` writes on a CPU, without running anything."""
    prob = backfuse.problem(pid)
    rows = [{"uuid": prob.workloads[i].uuid, "axes": {k: min(v, 2) for k, v in prob.workloads[i].axes.items()},
             "latency_ms": None, "passed": True, "min_matched": 1.0, "index": i} for i in cases]
    return {"device": "cpu", "torch": "t", "triton": "t", "date": "d", "shapes": "reduced", "timed": False, "rounds": 1,
            "problems": {pid: {"sol_h200_mean_ms": 0.01, "impls": {"backfuse": {"mean_ms": None, "cases": rows,
                                                                                "fallback": "reference"}}}}}


# ---- --version, --help ------------------------------------------------------------------------

def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"backfuse {backfuse.__version__} (torch {torch.__version__}, triton ")


FALLBACK_STATUS = "3 backfuse was only the fp32 reference fallback"


@pytest.mark.parametrize("command, words", [
    ("bench", ["--cases", "--json", "--merge", "--plot", "median CUPTI span", "reduced shapes", "TRITON_INTERPRET=1",
               "reference fallback", "needs timings", "geometric mean", "kernel launches per call", "Triton interpreter",
               "smallest case", "checked before the run", "timed, not checked", FALLBACK_STATUS, "141"]),
    ("check", ["--impl", "--rounds", "nothing is timed", "Exit status", "TRITON_INTERPRET=1", "reference fallback",
               "not a pass", FALLBACK_STATUS]),
    ("sol", ["--gpu", "speed-of-light", "No GPU needed", "geometric means"]),
    ("export", ["-o", "solution.py::run", "are created"]),
    ("report", ["--results", "--out", "any directory", "benchmarks/results/h200.json"]),
    ("merge", ["INTO", "FROM", "Refuses", "another device", "reduced shapes"]),
])
def test_help_of_every_command(capsys, command, words):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for w in words:
        assert w in out, (command, w)


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("bench", "check", "sol", "export", "report", "merge", "--version"):
        assert command in out
    assert FALLBACK_STATUS in " ".join(out.split())


@pytest.mark.parametrize("args, message", [
    (["--cases", ""], "no case index"),
    (["--cases", "3,16"], "0..15"),
    (["--cases", "a"], "comma-separated"),
    (["--rounds", "0"], "at least 1"),
])
def test_bad_selection_is_a_usage_error(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["check", "021", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err
    assert f"argument {args[0]}: {args[0]}" not in err  # argparse names the option once


def test_bad_cases_in_a_fresh_process_name_the_option_once():
    r = run_cli("check", "021", "--cases", "")
    assert r.returncode == 2 and "error: argument --cases: no case index given" in r.stderr
    assert "--cases: --cases" not in r.stderr and r.stdout == ""


def test_cases_keep_their_order_once():
    assert cli._cases("5,0,5") == [5, 0]


# ---- CPU runs: the kernels run in the interpreter; a fallback is labelled and no pass ----------

@cpu_only
def test_cpu_bench_runs_the_kernels_in_the_interpreter_without_being_asked(tmp_path):
    """No TRITON_INTERPRET, no case or round: backfuse's kernels run in the interpreter on the problem's
    smallest case, one round, with a progress line on a pipe and one line saying what was checked."""
    out_json = tmp_path / "r.json"
    r = run_cli("bench", "021", "--json", str(out_json), env={"TRITON_INTERPRET": None})
    assert r.returncode == 0, r.stderr
    case = backfuse.bench.runner.smallest_case(backfuse.problem("021"))
    assert f"[1/1] 021 case {case} (" in r.stderr and "backfuse pass" in r.stderr and "\r" not in r.stderr
    assert "Traceback" not in r.stderr and "fallback" not in r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("checked backfuse's kernels in the Triton interpreter against the fp32 reference on cpu: "
                           f"021 case {case} (reduced shapes), 1 round each: 1/1 passed.")
    assert "need a CUDA GPU" in last and "CUPTI" not in r.stdout
    doc = json.loads(out_json.read_text())
    assert doc["triton_interpret"] is True and doc["rounds"] == 1 and list(doc["problems"]["021"]["impls"]) == ["backfuse"]
    impl = doc["problems"]["021"]["impls"]["backfuse"]
    assert "fallback" not in impl and impl["mean_ms"] is None and impl["gmean_ms"] is None
    assert [(c["index"], c["passed"], c["launches"]) for c in impl["cases"]] == [(case, True, None)]


@cpu_only
def test_cpu_check_in_the_interpreter_runs_the_kernels(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as conftest set it before triton was imported
    prob = backfuse.problem("021")
    calls = []
    fused = prob.fused

    def counted(*args, **kw):
        calls.append(1)
        return fused(*args, **kw)

    monkeypatch.setattr(prob, "fused", counted)
    assert main(["check", "021", "--cases", "3", "--rounds", "1"]) == 0
    out, err = capsys.readouterr()
    assert calls and "1/1 pass" in out and "fallback" not in out and "CUPTI" not in out
    assert "Triton interpreter" in err


@cpu_only
def test_cpu_fallback_is_not_a_pass():
    """TRITON_INTERPRET=0: backfuse is only the fp32 reference, labelled so everywhere, with its own exit status."""
    r = run_cli("check", "021", "--cases", "3", "--rounds", "1", env={"TRITON_INTERPRET": "0"})
    assert r.returncode == cli.FALLBACK == 3, r.stderr
    assert "backfuse (reference fallback)" in r.stdout and "pass" not in r.stdout and "1/1" not in r.stdout
    assert "nothing of backfuse was checked" in r.stdout and r.stdout.strip().splitlines()[-1].startswith("checked nothing")
    assert "TRITON_INTERPRET=0" in r.stderr and "exit status 3" in r.stderr and "Traceback" not in r.stderr
    assert "[1/1] 021 case 3 (B=2 Nv=26 Nt=32): backfuse fallback" in r.stderr


@cpu_only
def test_cpu_bench_json_keeps_official_indices_and_says_what_ran(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the fallback: nothing runs, quickly
    out_json = tmp_path / "cpu.json"
    assert main(["bench", "021", "--cases", "12,3", "--rounds", "1", "--json", str(out_json)]) == cli.FALLBACK
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:4]]
    assert rows == ["12", "3"]
    doc = json.loads(out_json.read_text())
    assert doc["device"] == "cpu" and doc["shapes"] == "reduced" and doc["timed"] is False
    assert doc["triton_interpret"] is False and "iters" not in doc
    impl = doc["problems"]["021"]["impls"]["backfuse"]
    assert impl["fallback"] == "reference" and [c["passed"] for c in impl["cases"]] == [None, None]
    assert [c["index"] for c in impl["cases"]] == [12, 3]
    assert impl["cases"][0]["uuid"] == backfuse.problem("021").workloads[12].uuid
    assert report.readme_table(doc).splitlines()[-1] == "| 021 | backfuse (reference fallback) | – | – | fallback | – | – |"


@cpu_only
def test_cpu_check_refuses_a_numpy_the_interpreter_fails_on(tmp_path):
    """`TRITON_INTERPRET=1 backfuse check 021 --cases 0 --rounds 1` with numpy 2.4 once died inside the interpreter."""
    (tmp_path / "sitecustomize.py").write_text("import numpy\nnumpy.__version__ = '2.4.6'  # as pip's newest\n")
    r = run_cli("check", "021", "--cases", "0", "--rounds", "1",
                env={"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])})
    assert r.returncode == 2 and r.stdout == ""
    _one_line_error(r.stderr, "backfuse check: error: the Triton interpreter (TRITON_INTERPRET=1) fails "
                    "on numpy 2.4.6; it needs numpy < 2.4 (backfuse's dependencies ask for the tested range: "
                    "pip install 'numpy<2.3')")


def test_the_main_dependencies_bound_numpy_for_the_interpreter():
    """`pip install -e .` alone must give a numpy the interpreter runs on (the test extra is not installed then)."""
    from backfuse.problem import INTERPRETER_NUMPY_BELOW

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = [d for d in project["dependencies"] if d.startswith("numpy")]
    assert bounds == ["numpy<2.3"] and (2, 3) <= INTERPRETER_NUMPY_BELOW
    assert not any(d.startswith("numpy") for d in project["optional-dependencies"]["test"])


@pytest.mark.parametrize("args, words", [
    (["check", "021", "--impl", "reference"], ["--impl reference", "checking it against itself tells nothing"]),
    (["bench", "021", "--impl", "reference"] if not torch.cuda.is_available() else ["check", "--impl", "reference"],
     ["--impl reference"]),
])
def test_the_reference_is_never_checked_against_itself(args, words):
    r = run_cli(*args)
    assert r.returncode == 2
    line = _one_line_error(r.stderr, f"backfuse {args[0]}: error:", *words)
    assert "interpreter" not in line and r.stdout == ""


@cpu_only
def test_cpu_plot_is_a_one_line_error_before_running(tmp_path, capsys):
    png = tmp_path / "x.png"
    assert main(["bench", "021", "--cases", "0", "--rounds", "1", "--plot", str(png)]) == 2
    _one_line_error(capsys.readouterr().err, "backfuse bench: error: --plot", "nothing is timed")
    assert not png.exists()


def test_plot_of_untimed_results_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(report.NothingToPlot):
        report.plot(_cpu_doc(), str(tmp_path / "x.png"))
    assert main(["report", "--results", _write(tmp_path / "cpu.json", _cpu_doc()), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "correctness only, reduced shapes, no timing" in text and "CUPTI" not in text
    assert "backfuse (reference fallback)" in text and "speed of light" not in text


# ---- merge refuses runs that don't belong together ------------------------------------------

def _write(path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def test_merge_refuses_another_device(tmp_path, capsys):
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    before = into.read_bytes()
    src = _write(tmp_path / "cpu.json", _cpu_doc())
    assert main(["merge", str(into), src]) == 2
    line = _one_line_error(capsys.readouterr().err, "backfuse merge: error: refusing", str(into), src, "cpu",
                           "NVIDIA H200", "reduced shapes", "official shapes")
    assert line
    assert into.read_bytes() == before


def test_merge_refuses_reduced_shapes_of_the_same_device(tmp_path, capsys):
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    doc = _cpu_doc("072", cases=(0, 5))
    doc["device"] = "NVIDIA H200"
    del doc["shapes"]  # an older file: the axes themselves tell
    ok = _write(tmp_path / "ok.json", _cpu_doc())
    assert main(["merge", str(into), _write(tmp_path / "small.json", doc), ok]) == 2
    _one_line_error(capsys.readouterr().err, "refusing", "small.json", "reduced shapes", "official shapes")
    assert json.loads(into.read_text()) == _h200()


def test_merge_of_cpu_runs_into_a_new_file(tmp_path):
    into = tmp_path / "new" / "cpu.json"
    assert main(["merge", str(into), _write(tmp_path / "a.json", _cpu_doc("021")),
                 _write(tmp_path / "b.json", _cpu_doc("072"))]) == 0
    assert set(json.loads(into.read_text())["problems"]) == {"021", "072"}


def _spoiled(change):
    doc = _cpu_doc()
    change(doc, doc["problems"]["021"]["impls"]["backfuse"])
    return json.dumps(doc)


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"), ("{", "not JSON"), ("[]", "results: expected an object, got []"),
    (_spoiled(lambda d, i: d["problems"].update({"999": {}})), "problems.999: unknown problem '999'"),
    (_spoiled(lambda d, i: i.update(cases="oops")),
     'problems.021.impls.backfuse.cases: expected a non-empty list of cases, got "oops"'),
    (_spoiled(lambda d, i: d.pop("device")), 'results: no "device" (a string)'),
    (_spoiled(lambda d, i: i["cases"][0].update(launches="x")), "cases[0].launches: expected an integer >= 0 or null"),
    (_spoiled(lambda d, i: i["cases"][0]["axes"].pop("batch_size")), "cases[0].axes: expected positive integers for "
                                                                      "batch_size, num_video_tokens, num_text_tokens"),
    (_spoiled(lambda d, i: i["cases"][0].update(passed="yes")), "cases[0].passed: expected true, false or null"),
    (_spoiled(lambda d, i: i.update(mean_ms="1")), 'mean_ms: expected a number or null, got "1"'),
])
def test_merge_of_a_bad_file_is_one_line(tmp_path, capsys, content, words):
    src = tmp_path / "src.json"
    if content is not None:
        src.write_text(content)
    assert main(["merge", str(tmp_path / "into.json"), str(src)]) == 2
    _one_line_error(capsys.readouterr().err, "backfuse merge: error:", words)
    assert not (tmp_path / "into.json").exists()


def test_merge_and_report_refuse_a_bad_schema_in_a_fresh_process(tmp_path):
    """The file that merge once wrote and report then crashed on."""
    src = tmp_path / "src.json"
    src.write_text(_spoiled(lambda d, i: i.update(cases="oops")))
    into = tmp_path / "into.json"
    for args in (["merge", str(into), str(src)], ["report", "--results", str(src), "--out", str(tmp_path / "r")]):
        r = run_cli(*args)
        assert r.returncode == 2
        _one_line_error(r.stderr, f"backfuse {args[0]}: error: {src} is not a results file", "cases: expected")
    assert not into.exists() and not (tmp_path / "r" / "report.md").exists()


@cpu_only
def test_bench_merge_refuses_before_running(tmp_path, capsys):
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    assert main(["bench", "021", "--cases", "0", "--rounds", "1", "--json", str(into), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "refusing to merge this run (cpu, reduced shapes)" in err and "Traceback" not in err
    assert json.loads(into.read_text()) == _h200()


def test_a_training_bench_saves_its_entries_with_the_run_that_measured_them(tmp_path, monkeypatch):
    """Each training bench writes its section after every entry; --merge keeps the file's other entries (train: per
    problem and case) and says which earlier run measured those that stay."""
    import argparse

    monkeypatch.setenv("BACKFUSE_COMMIT", "f" * 40)
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    earlier = _h200()
    versions = {k: earlier[k] for k in ("torch", "triton", "date")}
    monkeypatch.setattr(cli, "environment", lambda: {"device": "cpu", **versions})  # (on any machine)
    with pytest.raises(cli.CLIError, match=r"refusing to merge this run \(cpu\) into .* \(NVIDIA H200\)"):
        cli._Section(argparse.Namespace(json=str(into), merge=True), "dynamic", warmup=1, steps=24)
    monkeypatch.setattr(cli, "environment", lambda: {k: earlier[k] for k in ("device", "torch", "triton", "date")})
    out = cli._Section(argparse.Namespace(json=str(into), merge=True), "dynamic", warmup=1, steps=24)
    out.entries["gemma3-1b"] = {"backfuse_first_ms": 1.0}
    out.save()
    doc = json.loads(into.read_text())
    assert doc["dynamic"]["gemma3-1b"] == {"backfuse_first_ms": 1.0}
    assert doc["dynamic"]["gemma3-4b"] == earlier["dynamic"]["gemma3-4b"]  # measured before, kept
    run = doc["dynamic_run"]
    assert run["commit"] == "f" * 40 and run["steps"] == 24 and run["warmup"] == 1 and run["device"] == doc["device"]
    assert run["earlier"] == {"commit": earlier["dynamic_run"]["commit"], "date": earlier["dynamic_run"]["date"]}
    assert {k: v for k, v in doc.items() if k not in ("dynamic", "dynamic_run")} == {
        k: v for k, v in earlier.items() if k not in ("dynamic", "dynamic_run")}
    train = cli._Section(argparse.Namespace(json=str(into), merge=True), "train", warmup=6, steps=15, groups=5)
    train.entries["021"] = {"0": {"backfuse_bf16_ms": 0.5}}
    train.save()
    doc = json.loads(into.read_text())
    assert doc["train"]["021"]["0"] == {"backfuse_bf16_ms": 0.5} and doc["train_run"]["earlier"]["commit"] == "824dc59"
    assert doc["train_run"]["groups"] == 5 and "groups" not in run
    table = report.train_readme_table({**earlier, "train_run": doc["train_run"]})
    assert "5 groups of 15 steps an implementation after 6 warm-up steps" in table
    assert doc["train"]["021"]["1"] == earlier["train"]["021"]["1"] and doc["train"]["072"] == earlier["train"]["072"]
    fresh = tmp_path / "fresh.json"
    alone = cli._Section(argparse.Namespace(json=str(fresh), merge=False), "e2e", warmup=3, steps=10)
    alone.entries["gemma3-1b/8x1024"] = {"hf_ms": 20.0}
    alone.save()
    doc = json.loads(fresh.read_text())
    assert doc["e2e"] == {"gemma3-1b/8x1024": {"hf_ms": 20.0}} and "earlier" not in doc["e2e_run"]
    assert main(["report", "--results", str(fresh), "--out", str(tmp_path / "r")]) in (0, 1)  # a valid results file


@pytest.mark.parametrize("argv, said", [
    (["--models", "--dynamic"], "--models and --dynamic are separate runs: pass one"),
    (["--e2e", "--memory"], "--e2e and --memory are separate runs: pass one"),
    (["--train", "--e2e", "gemma3-1b"], "--train and --e2e are separate runs: pass one"),
    (["021", "--dynamic"], "--dynamic runs its own selection"),
    (["--memory", "--impl", "backfuse"], "--memory runs its own selection"),
    (["--e2e", "gemma3-1b", "--groups", "3"], "--groups is --train's, --models' and --dynamic's"),
    (["072", "--groups", "3"], "--groups is --train's, --models' and --dynamic's"),
])
def test_bench_runs_one_training_bench_at_a_time(capsys, argv, said):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and "Traceback" not in err


@pytest.mark.parametrize("preset", [None, "/somewhere/of/the/users"])
def test_bench_keeps_one_triton_cache_for_its_process(monkeypatch, tmp_path, preset):
    """A bench's process compiles into one Triton cache: TRITON_CACHE_DIR is set to Triton's default before any
    implementation runs (TorchInductor would move an unset one to its own directory at its first compile, and
    backfuse's kernels compiled after that would be compiled again), and a user's own setting is kept."""
    import triton

    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # (the process's own value, restored after)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if preset is None:
        monkeypatch.delenv("TRITON_CACHE_DIR")
        expected = triton.knobs.cache.dir  # Triton's default, read before the bench sets anything
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", preset)
        expected = preset
    assert main(["bench", "--dynamic", "gemma3-1b"]) == 2  # (refused for want of a GPU, after the setup)
    assert os.environ["TRITON_CACHE_DIR"] == expected == triton.knobs.cache.dir


@pytest.mark.parametrize("option, said", [(["--split"], "--split splits --e2e's steps"),
                                          (["--variants", "compile"], "--variants chooses --e2e's variants")])
def test_bench_e2e_options_need_e2e(capsys, option, said):
    with pytest.raises(SystemExit) as e:
        main(["bench", *option])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{said}: add --e2e [MODEL ...]" in err and "Traceback" not in err


# ---- report from anywhere; export into new directories --------------------------------------

def test_report_from_another_directory_finds_the_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "median CUPTI span of 50 calls" in text and "## 021" in text
    assert str(H200) in capsys.readouterr().err


def test_report_defaults_write_next_to_the_results(tmp_path, monkeypatch):
    results = tmp_path / "benchmarks" / "results" / "h200.json"
    results.parent.mkdir(parents=True)
    shutil.copy(H200, results)
    monkeypatch.chdir(tmp_path)
    assert main(["report"]) == 0
    assert (tmp_path / "benchmarks" / "report.md").is_file()
    assert (tmp_path / "benchmarks" / "plots" / "072.png").stat().st_size > 10_000


def test_report_without_a_results_file_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path / "elsewhere")  # as when installed outside a checkout
    assert main(["report"]) == 2
    _one_line_error(capsys.readouterr().err, "backfuse report: error: no results file", "--results FILE")
    assert main(["report", "--results", "missing.json"]) == 2
    _one_line_error(capsys.readouterr().err, "missing.json does not exist")


def test_export_creates_missing_directories(tmp_path):
    out = tmp_path / "missing" / "dir" / "x.json"
    assert main(["export", "021", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["definition"] == backfuse.problem("021").name


def test_export_to_an_unwritable_place_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["export", "021", "-o", str(blocker / "x.json")]) == 2
    _one_line_error(capsys.readouterr().err, "backfuse export: error: cannot write", "x.json", "is not a directory")


@pytest.mark.parametrize("args", [["bench", "021", "--json", "{dir}"], ["bench", "021", "--json", "{file}/x.json"],
                                  ["merge", "{dir}", "{h200}"],
                                  ["report", "--results", "{h200}", "--out", "{file}"]])
def test_output_paths_are_checked_before_any_work(tmp_path, args):
    """bench --json DIR used to run everything and then fail to write it."""
    (tmp_path / "file").write_text("")
    paths = {"dir": str(tmp_path), "file": str(tmp_path / "file"), "h200": str(H200)}
    r = run_cli(*[a.format(**paths) for a in args])
    assert r.returncode == 2, r.stderr
    _one_line_error(r.stderr, f"backfuse {args[0]}: error: cannot write")
    assert r.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_closed_pipe_ends_quietly():
    """`backfuse sol 072 | head -3`: the reader is gone before the output is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = run_cli("sol", "072", stdout=write)
    finally:
        os.close(write)
    assert r.returncode == cli.CLOSED_PIPE and r.stderr == ""


def test_sol_prints_both_means(capsys):
    assert main(["sol", "021"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sols = [sol_ms(backfuse.problem("021"), w.axes) for w in backfuse.problem("021").workloads]
    assert lines[18].split()[:2] == ["mean", f"{statistics.fmean(sols):.4f}"]
    assert lines[19].split()[:2] == ["geomean", f"{statistics.geometric_mean(sols):.4f}"]


# ---- the H200 results still load, report and plot; tables and plots by official index ------

def _before_launches(doc: dict) -> dict:
    """doc as results files were before "gmean_ms", "launches" and "busy_ms" existed."""
    for entry in doc["problems"].values():
        for impl in entry["impls"].values():
            impl.pop("gmean_ms", None)
            for case in impl["cases"]:
                case.pop("launches", None)
                case.pop("busy_ms", None)
    return doc


def test_h200_results_are_read_as_before():
    """A GPU file from before "gmean_ms" and "launches": both means come from its per-case latencies,
    launches show as ?."""
    doc = _before_launches(_h200())
    assert report.shapes_of(doc) == "official" and report.is_timed(doc)
    readme = report.readme_table(doc)
    assert readme.startswith(f"Measured on NVIDIA H200 (torch {doc['torch']}, triton {doc['triton']}, {doc['date']}), "
                             "official protocol: median CUPTI span of 50 calls")
    latencies = [c["latency_ms"] for c in doc["problems"]["072"]["impls"]["backfuse"]["cases"]]
    gmean = math.exp(statistics.fmean(math.log(x) for x in latencies))
    assert f"| 072 | backfuse | {statistics.fmean(latencies):.3f} | {gmean:.3f} | 16/16 |" in readme
    assert "| 072 | reference | 3.457 |" in readme and "| (reference) |" in readme
    table = report.case_table("072", doc["problems"]["072"]).splitlines()
    assert "median of CUPTI spans" in table[0] and [r.split()[0] for r in table[2:18]] == [str(i) for i in range(16)]
    assert all(row.count("[?]") == 4 for row in table[2:18])
    assert table[19].split()[0] == "geomean" and f"{gmean:.4f}" in table[19].split()


def test_h200_results_show_launches():
    """The GPU file as benched since session 18: each case's kernel launches per call, in the report;
    since session 25 also the share of its span the device sat idle (from "busy_ms")."""
    doc = _h200()
    cases = doc["problems"]["021"]["impls"]["backfuse"]["cases"]
    assert all(isinstance(c["launches"], int) and c["launches"] >= 1 for c in cases)
    assert all(0 < c["busy_ms"] <= c["latency_ms"] for c in cases)
    rows = report.case_table("021", doc["problems"]["021"]).splitlines()[2:18]
    idle = [round(100 * (1 - c["busy_ms"] / c["latency_ms"])) for c in cases]
    assert all(f"[{c['launches']} idle {i}%]" in row for row, c, i in zip(rows, cases, idle))


def test_subset_tables_and_plots_use_official_indices():
    doc = _h200()
    for impl in doc["problems"]["021"]["impls"].values():
        impl["cases"] = [impl["cases"][12], impl["cases"][3]]  # an older file: no "index", the uuid tells
    table = report.case_table("021", doc["problems"]["021"], baseline="reference").splitlines()
    assert [r.split()[0] for r in table[2:4]] == ["12", "3"]
    fig = report.figure(doc, only="021")
    try:
        ax = fig.axes[0]
        assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["#12", "#3"]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend, frame = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        assert legend.x0 >= frame.x1  # the legend sits beside the bars, never over them
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_merged_subset_next_to_full_runs_reports_and_plots(tmp_path):
    """A 2-case run merged into the 16-case file: rows stay by official index, missing cells say so."""
    doc = _h200()
    impl = doc["problems"]["021"]["impls"]["backfuse"]
    impl["cases"] = [dict(impl["cases"][5], index=5), dict(impl["cases"][0], index=0)]
    table = report.case_table("021", doc["problems"]["021"]).splitlines()
    assert [r.split()[0] for r in table[2:18]] == [str(i) for i in range(16)]
    assert table[3].rstrip().endswith("–") and table[7].rsplit("[", 1)[0].split()[-1].endswith("%")
    assert "mean over the cases run" in report.readme_table(doc)
    report.plot(doc, str(tmp_path / "p.png"), only="021")


# ---- the GPU path's plumbing, with the GPU and the measurements faked -----------------------

def test_gpu_bench_plumbing(tmp_path, capsys, monkeypatch):
    from backfuse.bench.runner import CaseResult

    def fake_run(prob, impls, *, cases, device, rounds, warmup, iters, timing, seed, progress):
        assert device == "cuda" and timing and iters == 5 and warmup == 2 and rounds == 10
        results = {name: [] for name in impls}
        for i in cases:
            for name in impls:
                checked = name != "reference"
                results[name].append(CaseResult(prob.workloads[i].uuid, dict(prob.workloads[i].axes), checked or None,
                                                1.0 if checked else None, latency_ms=0.5 + i, event_ms=0.6 + i,
                                                kernels=4, launches=3, index=i))
            progress(i, dict(prob.workloads[i].axes), {n: r[-1] for n, r in results.items()}, 0.1)
        return results

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "run_problem", fake_run)
    monkeypatch.setattr(cli, "environment", lambda: {"device": "NVIDIA H200", "torch": "t", "triton": "t", "date": "d"})
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    png = tmp_path / "plots" / "g.png"
    args = ["bench", "021", "--cases", "7,2", "--impl", "reference", "backfuse", "--warmup", "2", "--iters", "5",
            "--baseline", "reference", "--json", str(into), "--merge", "--plot", str(png)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "median of CUPTI spans of 5 calls" in out and "fallback" not in out and "score S" in out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["7", "2"]
    assert lines[2].count("[3]") == 2 and lines[4].split()[:1] == ["mean"] and lines[5].split()[:1] == ["geomean"]
    assert lines[4].split()[-3:] == ["5.0000", "5.0000", "2/2"]  # the reference: a mean, no passes
    assert lines[5].split()[-2:] == [f"{math.sqrt(7.5 * 2.5):.4f}"] * 2
    assert "[1/2] 021 case 7 (B=" in err and "reference reference 7.5000 ms, backfuse pass 7.5000 ms" in err
    assert out.strip().splitlines()[-1].startswith("checked backfuse against the fp32 reference on NVIDIA H200: 021 cases 7, 2 "
                                                   "(official shapes), 10 rounds each: 2/2 passed; timed")
    doc = json.loads(into.read_text())
    assert doc["timed"] is True and doc["iters"] == 5 and doc["shapes"] == "official" and "triton_interpret" not in doc
    impls = doc["problems"]["021"]["impls"]
    assert [(c["index"], c["launches"]) for c in impls["backfuse"]["cases"]] == [(7, 3), (2, 3)]
    assert impls["backfuse"]["mean_ms"] == 5.0 and impls["backfuse"]["gmean_ms"] == pytest.approx(math.sqrt(7.5 * 2.5))
    assert [c["passed"] for c in impls["reference"]["cases"]] == [None, None]
    assert len(doc["problems"]["021"]["impls"]["torch_compile"]["cases"]) == 16  # kept by --merge
    assert "021's implementations now cover different cases" in err
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("section", ["models", "dynamic", "memory", "e2e"])
def test_readme_shows_each_training_section_of_the_results_file(section):
    """README's training tables are scripts/update_readme.py's, from h200.json's sections and their runs (h100.json's
    where h200.json has none yet)."""
    doc = _h200()
    if not doc.get(section):
        doc = json.loads((ROOT / "benchmarks" / "results" / "h100.json").read_text())
    table = getattr(report, f"{section}_table")(doc.get(section, {}), doc.get(f"{section}_run"))
    readme = (ROOT / "README.md").read_text()
    assert readme.split(f"<!-- {section}:start -->\n", 1)[1].split(f"\n<!-- {section}:end -->", 1)[0] == table


def test_the_e2e_table_compares_with_the_fastest_alternative_and_names_a_wrong_loss():
    entry = {"hf_ms": 40.0, "compile_ms": 30.0, "liger_ms": 28.0, "liger_peak_mib": 900.0, "liger_patched_ms": None,
             "liger_patched_wrong": 22.3, "patched_ms": 35.0, "patched_compile_ms": 21.0, "patched_compile_peak_mib": 800.0}
    table = report.e2e_table({"gemma3-4b/2x4096": entry, "wan2.1-1.3b/1x32760x512": {
        "hf_ms": 140.0, "compile_ms": 126.0, "liger_ms": None, "liger_patched_ms": None, "patched_ms": 139.0,
        "patched_compile_ms": 120.0, "patched_compile_peak_mib": 10.0, "compile_peak_mib": 11.0}},
        {"device": "NVIDIA H200", "date": "2026-12-05", "commit": "a" * 40, "steps": 10})
    lines = table.splitlines()
    assert lines[0].startswith("Measured on NVIDIA H200 (2026-12-05, commit aaaaaaa)")
    assert lines[-2] == ("| gemma3-4b/2x4096 | 40.0 | 30.0 | 28.0 | wrong (first loss 22.300) | 35.0 | 21.0 | "
                         "0.75 (Liger) | 800, 900 |")
    assert lines[-1] == "| wan2.1-1.3b/1x32760x512 | 140.0 | 126.0 | – | – | 139.0 | 120.0 | 0.95 (compiled) | 10, 11 |"


def test_readme_and_report_show_the_results_file_with_both_means():
    """README's table is scripts/update_readme.py's (report.readme_table of h200.json), and so is the report's."""
    table = report.readme_table(_h200())
    readme = (ROOT / "README.md").read_text()
    assert readme.split("<!-- results:start -->\n", 1)[1].split("\n<!-- results:end -->", 1)[0] == table
    assert table in (ROOT / "benchmarks" / "report.md").read_text()
    assert "| mean ms | geomean ms |" in table
