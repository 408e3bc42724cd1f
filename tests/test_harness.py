"""The harness: official rule, span extraction, fresh addresses, SOL model, reports, CLI."""

import json
import os

import pytest
import torch
from helpers import run_cli

import backfuse
from backfuse.bench import check_outputs, leaderboard_score, report, sol_ms
from backfuse.bench.timing import CALL_TAG, CLOSE_API, OPEN_API, FreshInputs, TraceEvent, call_spans, trace_events
from backfuse.problem import Tolerance

TOL = Tolerance(atol=1e-3, rtol=1e-3, ratio=0.99)
NAMES = ("a", "b")


def _pair():
    ref = (torch.randn(100, 10) + 3, torch.randn(7) + 3)
    return ref, tuple(r.clone() for r in ref)


def test_rule_passes_close_outputs():
    ref, out = _pair()
    out[0].view(-1)[:5] += 1.0  # 0.5% of elements out of tolerance is allowed
    v = check_outputs(out, ref, TOL, NAMES)
    assert v.passed and v.min_matched == pytest.approx(0.995)


@pytest.mark.parametrize("spoil,reason", [
    (lambda o: o[0].view(-1)[:20].add_(1.0), "0.980000 of elements"),
    (lambda o: o[1].__setitem__(3, float("nan")), "NaN or Inf"),
    (lambda o: o[1].__setitem__(3, float("inf")), "NaN or Inf"),
    (lambda o: o[1].zero_(), "all zeros"),
])
def test_rule_fails(spoil, reason):
    ref, out = _pair()
    spoil(out)
    v = check_outputs(out, ref, TOL, NAMES)
    assert not v.passed and reason in v.reason


def test_rule_checks_count_shape_dtype():
    ref, out = _pair()
    assert "expected 2 outputs, got 1" in check_outputs(out[:1], ref, TOL, NAMES).reason
    assert not check_outputs((out[0].double(), out[1]), ref, TOL, NAMES).passed
    assert not check_outputs((out[0][:-1], out[1]), ref, TOL, NAMES).passed


def FakeEvent(kind, name, start, end, corr=None):
    return TraceEvent(kind, name, start, end, corr)


def test_call_spans_group_kernels_by_launch():
    open_ = lambda t: FakeEvent("cuda_runtime", OPEN_API, t, t + 5)  # noqa: E731
    close = lambda t: FakeEvent("cuda_runtime", CLOSE_API, t, t + 5)  # noqa: E731
    events = [
        close(1),  # the profiler's own
        FakeEvent("kernel", "flush", 0, 90, corr=1),  # launched before the first window: dropped
        FakeEvent("cuda_runtime", "cudaLaunchKernel", 5, 6, corr=1),
        open_(95),
        FakeEvent("cuda_driver", "cuLaunchKernelEx", 110, 115, corr=2),
        FakeEvent("cuda_runtime", "cudaLaunchKernel", 120, 125, corr=3),
        FakeEvent("kernel", "k1", 130, 200, corr=2),
        FakeEvent("kernel", "k2", 250, 330, corr=3),
        close(400),
        FakeEvent("cuda_runtime", "cudaMemsetAsync", 440, 441, corr=9),
        FakeEvent("gpu_memset", "flush", 450, 480, corr=9),  # launched between windows: dropped
        open_(495),
        FakeEvent("cuda_runtime", "cudaLaunchKernel", 510, 512, corr=4),
        FakeEvent("kernel", "k1", 530, 560, corr=4),
        FakeEvent("kernel", "side-stream", 540, 600, corr=77),  # no launch record: its own start decides
        FakeEvent("cpu_op", "aten::mm", 505, 509),
        FakeEvent("kernel", "graph node", 901, 920, corr=78),  # no launch record, starts while the host waits
        close(900),
        close(950),  # the profiler's own
    ]
    spans, counts, launches, kernel_ms, busy = call_spans(events, 2)
    assert counts == [2, 3] and launches == [2, 3]
    assert kernel_ms == {"k1": pytest.approx(100 / 2e6), "k2": pytest.approx(80 / 2e6), "side-stream": pytest.approx(60 / 2e6),
                         "graph node": pytest.approx(19 / 2e6)}
    assert spans == [pytest.approx(200 / 1e6), pytest.approx(390 / 1e6)]
    # busy: the union of a call's activities (call 0 idles 200..250 between k1 and k2; call 1's overlap once)
    assert busy == [pytest.approx(150 / 1e6), pytest.approx(89 / 1e6)]


def test_call_spans_with_a_sync_inside_the_call():
    """A call that reads a result back synchronizes its stream itself; its copy counts."""
    events = [
        FakeEvent("cuda_runtime", OPEN_API, 0, 5),
        FakeEvent("cuda_runtime", "cudaLaunchKernel", 10, 12, corr=1),
        FakeEvent("kernel", "k1", 20, 60, corr=1),
        FakeEvent("cuda_runtime", "cudaMemcpyAsync", 14, 16, corr=2),
        FakeEvent("gpu_memcpy", "Memcpy DtoH", 60, 63, corr=2),
        FakeEvent("cuda_runtime", OPEN_API, 17, 64),  # the call's own
        FakeEvent("cuda_runtime", CLOSE_API, 70, 71),
        FakeEvent("cuda_runtime", OPEN_API, 80, 85),
        FakeEvent("cuda_runtime", "cudaLaunchKernel", 90, 92, corr=3),
        FakeEvent("kernel", "k1", 95, 105, corr=3),
        FakeEvent("cuda_runtime", CLOSE_API, 110, 111),
    ]
    spans, counts, launches, _, busy = call_spans(events, 2)
    assert counts == [2, 1] and spans == [pytest.approx(43 / 1e6), pytest.approx(10 / 1e6)]
    assert busy == spans  # the copy follows the kernel with no gap
    assert launches == [1, 1]  # the copy is a device activity of the call, not a kernel launch


def test_call_spans_needs_every_sync():
    with pytest.raises(RuntimeError, match=r"1 stream synchronizations \(expected 2\)"):
        call_spans([FakeEvent("cuda_runtime", OPEN_API, 0, 1), FakeEvent("cuda_runtime", CLOSE_API, 5, 6)], 2)


def test_call_spans_by_host_ranges():
    events = [
        FakeEvent("user_annotation", CALL_TAG + "0", 100, 400),
        FakeEvent("cuda_runtime", "cudaLaunchKernel", 120, 125, corr=3),
        FakeEvent("kernel", "k2", 250, 330, corr=3),
        FakeEvent("kernel", "flush", 450, 480),
    ]
    spans, counts, launches, _, _ = call_spans(events, 1)
    assert counts == launches == [1] and spans == [pytest.approx(80 / 1e6)]


def test_trace_events_reads_a_profile():
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("marker"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    events = trace_events(prof)
    marker = [e for e in events if e.name == "marker"]
    assert len(marker) == 1 and marker[0].kind == "user_annotation" and marker[0].end_ns > marker[0].start_ns


def test_fresh_inputs_move_every_call():
    inputs = [torch.randn(3, 5), 0.5, torch.randn(7)]
    fresh = FreshInputs(inputs, calls=4)
    seen = set()
    for _ in range(4):
        placed = fresh()
        assert placed[1] == 0.5
        for x, y in zip(placed[::2], inputs[::2]):
            assert torch.equal(x, y) and x.is_contiguous() and (x.data_ptr() - fresh.pool.data_ptr()) % 256 == 0
        seen.add(tuple(x.data_ptr() for x in placed[::2]))
    assert len(seen) == 4


# macs_min and bytes_fp32_io from ../shared/spec/anchors_h200.json (measured facts, two cases each)
ANCHORS = {
    "072": [(dict(batch_size=4, seq_len_dec=2048, seq_len_enc=4096), 171798691840, 973078528),
            (dict(batch_size=1, seq_len_dec=613, seq_len_enc=691), 10611589120, 112988160)],
    "037": [(dict(batch_size=4, seq_len=128), 34431565824, 220727296),
            (dict(batch_size=2, seq_len=541), None, None)],
    "021": [(dict(batch_size=64, num_video_tokens=128, num_text_tokens=77), 77829505024, 174620672),
            (dict(batch_size=8, num_video_tokens=256, num_text_tokens=373), 34204549120, 83197952)],
}


def test_cost_model_matches_anchors():
    for pid, cases in ANCHORS.items():
        prob = backfuse.problem(pid)
        for axes, macs, nbytes in cases:
            if macs is not None:
                assert prob.macs(axes) == macs and prob.io_bytes(axes) == nbytes
    prob = backfuse.problem("037")
    assert prob.macs(dict(batch_size=1, seq_len=2048)) == 173965049856
    # Anchors' SOL: max(2 * macs / 989e12, bytes / 4.8e12).
    assert sol_ms(prob, dict(batch_size=4, seq_len=1024)) == pytest.approx(0.6254, abs=1e-4)
    assert sol_ms(backfuse.problem("072"), ANCHORS["072"][1][0]) == pytest.approx(0.02354, abs=1e-5)


def test_leaderboard_score():
    assert leaderboard_score(2.0, 2.0, 0.5) == pytest.approx(0.5)
    assert leaderboard_score(0.5, 2.0, 0.5) == pytest.approx(1.0)


def _doc(latency=0.1):
    prob = backfuse.problem("021")
    cases = [{"uuid": w.uuid, "axes": w.axes, "latency_ms": latency, "passed": True, "min_matched": 1.0}
             for w in prob.workloads]
    impl = {"mean_ms": latency, "cases": cases}
    return {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "date": "2026-11-30",
            "problems": {"021": {"sol_h200_mean_ms": 0.046, "impls": {"reference": impl, "backfuse": dict(impl)}}}}


def test_reports(tmp_path):
    doc = _doc()
    text = report.case_table("021", doc["problems"]["021"], baseline="reference")
    assert "score S" in text and len(text.splitlines()) == 1 + 1 + 16 + 3 + 1  # means, score, the reference's note
    md = report.readme_table(doc)
    assert "| 021 | backfuse | 0.100 | 0.100 | 16/16 | 46% | 1.0× |" in md
    assert "| 021 | reference | 0.100 | 0.100 | (reference) | 46% | 1.0× |" in md
    png = tmp_path / "plot.png"
    report.plot(doc, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_help_and_sol():
    assert run_cli("--help").returncode == 0
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "--cases" in r.stdout and "--json" in r.stdout
    r = run_cli("sol", "072", "--gpu", "b200")
    assert r.returncode == 0 and r.stdout.count("\n") >= 19 and "0.0" in r.stdout
    r = run_cli("sol", "nope")
    assert r.returncode == 2 and "unknown problem" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback path")
def test_cli_bench_without_gpu_checks_reduced_shapes(tmp_path):
    out = tmp_path / "r.json"
    r = run_cli("bench", "021", "--cases", "12", "--rounds", "1", "--impl", "reference", "backfuse", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stderr and "reference left out" in r.stderr
    doc = json.loads(out.read_text())
    # The first schema's fields, and the ones added since (additively: old files still load).
    assert set(doc) == {"device", "torch", "triton", "date", "problems"} | {"shapes", "timed", "rounds", "triton_interpret"}
    assert doc["shapes"] == "reduced" and doc["timed"] is False and doc["rounds"] == 1
    entry = doc["problems"]["021"]
    assert set(entry) == {"sol_h200_mean_ms", "impls"}
    assert list(entry["impls"]) == ["backfuse"] and set(entry["impls"]["backfuse"]) == {"mean_ms", "gmean_ms", "cases"}
    case = entry["impls"]["backfuse"]["cases"][0]
    assert set(case) == {"uuid", "axes", "latency_ms", "passed", "min_matched"} | {"index", "launches", "busy_ms"}
    assert case["passed"] and case["latency_ms"] is None and case["axes"]["batch_size"] == 2 and case["index"] == 12
    assert case["launches"] is None and doc["triton_interpret"] is True  # the kernels ran in the interpreter


def test_case_table_shows_launches_and_idle_share():
    from backfuse.bench.report import _launches

    assert _launches({"launches": 4, "latency_ms": 0.1, "busy_ms": 0.08}) == "4 idle 20%"
    assert _launches({"launches": 5, "latency_ms": 0.1, "busy_ms": None}) == "5"
    assert _launches({"launches": None}) == "?"


def test_cli_merge_keeps_other_entries(tmp_path):
    from backfuse.cli import main

    def impl(ms, pid="072"):
        w = backfuse.problem(pid).workloads[0]
        return {"mean_ms": ms, "cases": [{"uuid": w.uuid, "axes": w.axes, "latency_ms": ms, "passed": True,
                                          "min_matched": 1.0, "index": 0}]}

    def doc(date, problems):
        return {"device": "NVIDIA H200", "torch": "t", "triton": "t", "date": date,
                "problems": {pid: {"sol_h200_mean_ms": 0.1, "impls": impls} for pid, impls in problems.items()}}

    into, new = tmp_path / "into.json", tmp_path / "new.json"
    into.write_text(json.dumps(doc("old", {"072": {"reference": impl(3.0), "backfuse": impl(1.0)},
                                           "021": {"reference": impl(2.0, "021")}})))
    new.write_text(json.dumps(doc("new", {"072": {"backfuse": impl(0.5)}})))
    assert main(["merge", str(into), str(new)]) == 0
    merged = json.loads(into.read_text())
    assert merged["date"] == "new"
    assert merged["problems"]["072"]["impls"] == {"reference": impl(3.0), "backfuse": impl(0.5)}
    assert merged["problems"]["021"]["impls"] == {"reference": impl(2.0, "021")}


def test_cli_report_writes_markdown_and_plots(tmp_path):
    from backfuse.cli import main

    results = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h200.json")
    assert main(["report", "--results", results, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    for pid in ("072", "037", "021"):
        assert f"## {pid}" in text and (tmp_path / "plots" / f"{pid}.png").stat().st_size > 10_000
        assert f"![{pid}" in text
