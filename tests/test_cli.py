"""The command line never misleads: labels say what ran and what was measured, errors are one line."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import backfuse
from backfuse import cli
from backfuse.bench import report
from backfuse.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
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


@pytest.mark.parametrize("command, words", [
    ("bench", ["--cases", "--json", "--merge", "--plot", "median CUPTI span", "reduced shapes", "TRITON_INTERPRET=1",
               "reference fallback", "needs timings"]),
    ("check", ["--impl", "--rounds", "nothing is timed", "Exit status", "TRITON_INTERPRET=1", "reference fallback"]),
    ("sol", ["--gpu", "speed-of-light", "No GPU needed"]),
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


@pytest.mark.parametrize("args, message", [
    (["--cases", ""], "no case index"),
    (["--cases", "3,16"], "0..15"),
    (["--cases", "a"], "comma-separated"),
    (["--rounds", "0"], "at least 1"),
])
def test_bad_selection_is_a_usage_error(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["check", "021", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cases_keep_their_order_once():
    assert cli._cases("5,0,5") == [5, 0]


# ---- CPU runs: the fallback is labelled, nothing claims timing, indices are official -----------

@cpu_only
def test_cpu_check_without_interpreter_labels_the_fallback(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the fused kernels can't run: problem.run is the reference
    assert main(["check", "021", "--cases", "3", "--rounds", "1"]) == 0
    out, err = capsys.readouterr()
    assert "backfuse (reference fallback)" in out and "1/1 fallback" in out and "pass" not in out
    assert "checked against itself" in out
    assert "correctness only, reduced shapes, no timing" in out and "CUPTI" not in out
    assert "TRITON_INTERPRET=1" in err and "not checked" in err
    assert "\r" not in err  # no progress bar when stderr is not a terminal


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
def test_cpu_bench_json_keeps_official_indices_and_says_what_ran(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out_json = tmp_path / "cpu.json"
    assert main(["bench", "021", "--cases", "12,3", "--rounds", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:4]]
    assert rows == ["12", "3"]
    doc = json.loads(out_json.read_text())
    assert doc["device"] == "cpu" and doc["shapes"] == "reduced" and doc["timed"] is False
    assert doc["triton_interpret"] is False and "iters" not in doc
    impls = doc["problems"]["021"]["impls"]
    assert impls["backfuse"]["fallback"] == "reference" and "fallback" not in impls["reference"]
    assert [c["index"] for c in impls["backfuse"]["cases"]] == [12, 3]
    assert impls["backfuse"]["cases"][0]["uuid"] == backfuse.problem("021").workloads[12].uuid


@cpu_only
def test_cpu_check_in_a_fresh_process_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-m", "backfuse", "check", "037", "--cases", "1", "--rounds", "1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "backfuse (reference fallback)" in r.stdout and "CUPTI" not in r.stdout
    assert r.stdout.splitlines()[2].split()[0] == "1"
    assert "\r" not in r.stderr and "Traceback" not in r.stderr


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


@pytest.mark.parametrize("content, words", [(None, "does not exist"), ("{", "not JSON"), ("[]", "not a results file"),
                                            ('{"problems": {"999": {}}}', "unknown problem")])
def test_merge_of_a_bad_file_is_one_line(tmp_path, capsys, content, words):
    src = tmp_path / "src.json"
    if content is not None:
        src.write_text(content)
    assert main(["merge", str(tmp_path / "into.json"), str(src)]) == 2
    _one_line_error(capsys.readouterr().err, "backfuse merge: error:", words)
    assert not (tmp_path / "into.json").exists()


@cpu_only
def test_bench_merge_refuses_before_running(tmp_path, capsys):
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    assert main(["bench", "021", "--cases", "0", "--rounds", "1", "--json", str(into), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "refusing to merge this run (cpu, reduced shapes)" in err and "Traceback" not in err
    assert json.loads(into.read_text()) == _h200()


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
    _one_line_error(capsys.readouterr().err, "backfuse export: error: cannot write", "x.json")


# ---- the H200 results still load, report and plot; tables and plots by official index ------

def test_h200_results_are_read_as_before():
    doc = _h200()
    assert report.shapes_of(doc) == "official" and report.is_timed(doc)
    assert report.readme_table(doc).startswith("Measured on NVIDIA H200 (torch 2.11.0+cu130, triton 3.6.0, 2026-12-01), "
                                               "official protocol: median CUPTI span of 50 calls")
    table = report.case_table("072", doc["problems"]["072"]).splitlines()
    assert "median of CUPTI spans" in table[0] and [r.split()[0] for r in table[2:18]] == [str(i) for i in range(16)]


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
    assert table[3].rstrip().endswith("–") and "%" in table[7].split()[-1]
    assert "mean over the cases run" in report.readme_table(doc)
    report.plot(doc, str(tmp_path / "p.png"), only="021")


# ---- the GPU path's plumbing, with the GPU and the measurements faked -----------------------

def test_gpu_bench_plumbing(tmp_path, capsys, monkeypatch):
    from backfuse.bench.runner import CaseResult

    def fake_run(prob, impls, *, cases, device, rounds, warmup, iters, timing, seed, progress):
        assert device == "cuda" and timing and iters == 5 and warmup == 2
        return {name: [CaseResult(prob.workloads[i].uuid, dict(prob.workloads[i].axes), True, 1.0, latency_ms=0.5 + i,
                                  event_ms=0.6 + i, kernels=4, index=i) for i in cases] for name in impls}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "run_problem", fake_run)
    monkeypatch.setattr(cli, "environment", lambda: {"device": "NVIDIA H200", "torch": "t", "triton": "t", "date": "d"})
    into = tmp_path / "h200.json"
    shutil.copy(H200, into)
    png = tmp_path / "plots" / "g.png"
    args = ["bench", "021", "--cases", "7,2", "--impl", "reference", "backfuse", "--warmup", "2", "--iters", "5",
            "--rounds", "1", "--baseline", "reference", "--json", str(into), "--merge", "--plot", str(png)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "median of CUPTI spans of 5 calls" in out and "fallback" not in out and "score S" in out
    assert [line.split()[0] for line in out.splitlines()[2:4]] == ["7", "2"]
    doc = json.loads(into.read_text())
    assert doc["timed"] is True and doc["iters"] == 5 and doc["shapes"] == "official" and "triton_interpret" not in doc
    assert [c["index"] for c in doc["problems"]["021"]["impls"]["backfuse"]["cases"]] == [7, 2]
    assert len(doc["problems"]["021"]["impls"]["torch_compile"]["cases"]) == 16  # kept by --merge
    assert "021's implementations now cover different cases" in err
    assert png.read_bytes()[:4] == b"\x89PNG"
