"""Fused calls as one CUDA graph (`kernels/graphs.py`): repeated calls at fresh addresses with other
sizes between, graph and direct launches bit for bit alike, a launch that cannot be recorded, and a
user's own graph capture around the operator."""

import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import ODD_AXES, assert_official_pass

import backfuse
from backfuse.kernels import buffers, graphs

GPU = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs run on the GPU only")


def test_no_graphs_off_the_gpu_or_when_switched_off():
    assert not graphs.enabled(torch.device("cpu"), [])
    with backfuse.cuda_graphs(False):
        assert not graphs.enabled(torch.device("cuda", 0), [])


def test_the_graph_cache_keeps_the_newest_and_frees_what_it_drops(monkeypatch):
    """EXECS_KEPT executable graphs, most recently used last; a dropped one is destroyed (a plan whose
    recording failed holds FAILED, which owns nothing); a key's hash is computed once."""
    import collections
    import types

    destroyed = []
    monkeypatch.setattr(graphs, "driver", lambda: types.SimpleNamespace(destroy_exec=destroyed.append))
    monkeypatch.setattr(graphs, "_execs", collections.OrderedDict())
    monkeypatch.setattr(graphs, "EXECS_KEPT", 2)
    slot = graphs._Slot(("plan", 0, 7))
    assert slot == graphs._Slot(("plan", 0, 7)) and hash(slot) == hash(("plan", 0, 7))
    graphs._keep(slot, 11)
    graphs._keep(graphs._Slot("failed"), graphs.FAILED)
    graphs._keep(graphs._Slot("c"), 13)
    assert destroyed == [11]
    graphs._keep(graphs._Slot("d"), 14)
    assert destroyed == [11] and list(graphs._execs.values()) == [13, 14]


@GPU
@pytest.mark.parametrize("pid,options", [("072", dict(products="triton")), ("072", dict(products="cublas")),
                                         ("037", {}), ("021", {})])
def test_repeated_calls_run_as_one_graph_each(pid, options):
    """From a shape's second call on, its launches are recorded and launched as one graph whose
    cached executable takes each call's addresses; another size between calls keeps its own."""
    prob = backfuse.problem(pid)
    before = graphs.counts.copy()
    for seed in range(3):
        for axes in ODD_AXES[pid]:
            x = prob.make_inputs(axes, seed=seed, device=DEVICE)
            with buffers.poisoned():
                outs = prob.fused(*x, **options)
            assert_official_pass(prob, outs, prob.reference(*x))
    new = graphs.counts - before
    assert new["launched"] >= 4 and new["updated"] >= 2 and not new["direct"], new


@GPU
def test_a_call_of_one_launch_launches_it_directly():
    prob = backfuse.problem("072")  # on Hopper one Gluon launch
    x = prob.make_inputs(ODD_AXES["072"][0], seed=1, device=DEVICE)
    before = graphs.counts.copy()
    for _ in range(2):
        prob.fused(*x, products="gluon")
    assert graphs.counts == before


@GPU
@pytest.mark.parametrize("pid", ["072", "037", "021"])
def test_graph_and_direct_launches_agree_bit_for_bit(pid):
    prob = backfuse.problem(pid)
    x = prob.make_inputs(ODD_AXES[pid][1], seed=5, device=DEVICE)
    options = dict(deterministic=True, products="triton") if pid == "072" else dict(deterministic=True)
    with backfuse.cuda_graphs(False):
        direct = prob.fused(*x, **options)
    for _ in range(2):  # instantiated, then updated
        for d, g in zip(direct, prob.fused(*x, **options)):
            assert torch.equal(d, g)


@GPU
def test_a_launch_that_cannot_be_recorded_runs_directly_with_a_warning():
    """Both direct runs on the caller's stream (a direct run left on the recording stream raced the caller's next
    work: H100, session 44)."""
    out = torch.zeros(4, device=DEVICE)
    key = ("test", "uncapturable")
    streams = []

    def launch():
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not while recording")
        streams.append(torch.cuda.current_stream().cuda_stream)
        out.add_(1)

    with pytest.warns(backfuse.GraphWarning, match="could not be recorded"):
        graphs.run(key, out.device, [launch])
    graphs.run(key, out.device, [launch])  # known to fail: direct, no second warning
    assert streams == [torch.cuda.current_stream().cuda_stream] * 2
    assert out.tolist() == [2.0] * 4


@GPU
@pytest.mark.parametrize("pid", ["072", "021"])
def test_inside_a_users_own_graph(pid):
    """A user capturing the operator in torch.cuda.graph (after one call at the shape) records its
    kernels into their graph; replays give the reference's result for the captured inputs."""
    prob = backfuse.problem(pid)
    x = prob.make_inputs(ODD_AXES[pid][0], seed=9, device=DEVICE)
    prob.fused(*x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = prob.fused(*x)
    fresh = prob.make_inputs(ODD_AXES[pid][0], seed=10, device=DEVICE)
    for t, f in zip(x, fresh):
        if isinstance(t, torch.Tensor):
            t.copy_(f)
    g.replay()
    torch.cuda.synchronize()
    assert_official_pass(prob, outs, prob.reference(*fresh))


@GPU
def test_recording_after_a_users_own_capture():
    """torch frees cuBLAS's workspaces when a capture of its own begins (torch.cuda.graph, compile's graphs): a
    training call recorded after one still records (no product takes memory while recorded: no GraphWarning)."""
    from backfuse import nn as bnn

    g = torch.cuda.CUDAGraph()
    a = torch.ones(64, 64, device=DEVICE, dtype=torch.float16)
    with torch.cuda.graph(g):
        torch.mm(a, a)
    m = bnn.WanXattn(device=DEVICE, dtype=torch.float16)
    video = torch.randn(1, 33, 1024, device=DEVICE, dtype=torch.float16, requires_grad=True)
    text = torch.randn(1, 7, 1024, device=DEVICE, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backfuse.GraphWarning)
        for _ in range(3):
            m(video, text).float().sum().backward()
    torch.cuda.synchronize()


@GPU
def test_two_threads_on_their_own_streams():
    """Each thread records on a stream of its own and launches on its caller's stream."""
    import threading

    prob = backfuse.problem("021")
    results, errors = {}, []

    def work(name, seed):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for r in range(3):
                    x = prob.make_inputs(ODD_AXES["021"][1], seed=seed + r, device=DEVICE)
                    results[name, r] = (x, prob.fused(*x))
            stream.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n, 10 * n)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for x, outs in results.values():
        assert_official_pass(prob, outs, prob.reference(*x))


def test_an_allocating_step_runs_its_op_then_what_reads_its_outputs():
    """Run directly, an Allocating step makes its outputs as any op, runs the launches prepared for them,
    and is graphable (recorded with its memory from the recording's pool) only from its second run on."""
    key = ("test allocating", DEVICE, object())
    seen = []
    x = torch.arange(6.0, device=DEVICE)
    made = lambda: graphs.Allocating(key, lambda: (x * 2, x + 1),  # noqa: E731
                                     lambda a, b: [lambda: seen.append((a + b).tolist())], "an op")
    first = made()
    assert not first.graphable
    first()
    assert seen == [[3.0 * i + 1 for i in range(6)]]
    assert made().graphable


def test_recordings_on_two_threads_keep_their_own_pools(monkeypatch):
    """Two threads record at once, interleaved (A begins, B begins, A ends, B ends): each thread's allocating
    steps take their memory from its own recording's pool, and afterwards no pool is left behind, so a direct
    allocating step allocates as any op and becomes graphable (s51-3: a process-wide slot kept A's pool after
    both ended, and every later direct allocating step took memory from a graph's pool)."""
    import contextlib
    import threading

    used = []

    @contextlib.contextmanager
    def use_mem_pool(pool):
        used.append((threading.current_thread().name, pool))
        yield

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(graphs, "_pools", {"a": "pool a", "b": "pool b"})
    x = torch.arange(3.0)

    def allocating(key):
        return graphs.Allocating(key, lambda: (x + 1,), lambda y: [], "x + 1")

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with graphs._pooled("a"):
            a_in.set()
            b_in.wait(10)
            allocating(("a", object()))()
        a_out.set()

    def b():
        a_in.wait(10)
        with graphs._pooled("b"):
            b_in.set()
            a_out.wait(10)
            allocating(("b", object()))()

    threads = [threading.Thread(target=f, name=f.__name__) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(used) == [("a", "pool a"), ("b", "pool b")]
    key = ("after", object())
    allocating(key)()
    assert len(used) == 2 and allocating(key).graphable


@GPU
def test_an_allocating_step_recorded_into_a_graph_replays_its_op():
    """An op that allocates (here torch's own arithmetic) recorded with the launches that read its output:
    replays compute on each call's data, and no memory outside the pool is taken or corrupted."""
    assert graphs.RECORD_AT == 3
    x = torch.randn(1 << 16, device=DEVICE)
    out = torch.empty_like(x)
    key = ("test allocating replay", object())

    def build():
        return [lambda: out.zero_(), graphs.Allocating(key, lambda: (x * 3,), lambda y: [lambda: out.add_(y)], "x * 3")]

    before = graphs.counts.copy()
    for i in range(5):
        x.copy_(torch.full_like(x, float(i)))
        graphs.replay(key, (x.data_ptr(), out.data_ptr()), x.device, build)
        other = torch.full_like(x, -1.0)  # memory taken after the call: never the graph's
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(x, 3.0 * i)) and torch.equal(other, torch.full_like(x, -1.0))
    new = graphs.counts - before
    assert (new["direct"], new["instantiated"], new["replayed"]) == (2, 1, 2)  # direct twice, recorded, replays


def test_switched_off_a_kept_training_graph_is_not_launched(monkeypatch):
    """`cuda_graphs(False)` launches kernel by kernel also where a call's graph was kept before the switch
    (s50-3 found the kept graph launched inside the block); switched on again, the kept graph serves."""
    import collections
    import types

    launched = []
    monkeypatch.setattr(graphs, "raw_stream", lambda index: 7)
    monkeypatch.setattr(graphs, "_driver", types.SimpleNamespace(launch=lambda exec_, stream: launched.append(exec_)))
    monkeypatch.setattr(graphs, "_replays", collections.OrderedDict())
    monkeypatch.setattr(graphs, "_seen", collections.OrderedDict())
    device, key, addresses = torch.device("cuda", 0), ("test kept", object()), (4096,)
    graphs._replays[(key, addresses, 0, 7)] = 99
    direct = []
    with backfuse.cuda_graphs(False):
        graphs.replay(key, addresses, device, lambda: [], lambda: direct.append(1))
    assert launched == [] and direct == [1]
    graphs.replay(key, addresses, device, lambda: [], lambda: direct.append(1))
    assert launched == [99] and direct == [1]


def test_a_recurring_call_of_one_launch_runs_its_template(monkeypatch):
    """A (key, addresses) of one launch reaches its RECORD_AT-th call, where no graph is worth recording: from
    then on the key's calls go to `direct` (its template), not build() and the launch prepared again at every
    call (s52-4: the packed documents' kernel prepared at each call of a recurring batch, 105 us)."""
    import collections
    import types

    monkeypatch.setattr(graphs, "raw_stream", lambda index: 7)
    monkeypatch.setattr(graphs, "driver", lambda: types.SimpleNamespace())
    monkeypatch.setattr(graphs, "_replays", collections.OrderedDict())
    monkeypatch.setattr(graphs, "_seen", collections.OrderedDict())
    monkeypatch.setattr(graphs, "_unrecordable", collections.OrderedDict())
    monkeypatch.setattr(graphs, "UNRECORDABLE_KEPT", 2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    device, addresses = torch.device("cuda", 0), (4096,)
    built, ran = [], []

    def build():
        built.append(1)
        return [lambda: ran.append("launch")]

    key = ("one launch", object())
    for _ in range(graphs.RECORD_AT + 3):
        graphs.replay(key, addresses, device, build, lambda: ran.append("template"))
    assert len(built) == 1 and ran == ["template"] * (graphs.RECORD_AT - 1) + ["launch"] + ["template"] * 3
    assert key in graphs._unrecordable
    others = [("one launch", object()) for _ in range(2)]
    for other in others:
        for _ in range(graphs.RECORD_AT):
            graphs.replay(other, addresses, device, build, lambda: None)
    assert list(graphs._unrecordable) == others  # bounded: the oldest key forgotten first


@GPU
def test_a_training_call_is_recorded_only_when_its_addresses_recur():
    """replay: a (key, addresses) launches directly at its first RECORD_AT - 1 calls (a batch of a new length,
    or new memory); at the next it is recorded, then replayed; calls whose addresses change never record."""
    x = torch.zeros(1 << 10, device=DEVICE)
    key = ("test admission", object())

    def call(t):
        graphs.replay(key, (t.data_ptr(),), t.device, lambda: [lambda: t.add_(1.0), lambda: t.mul_(2.0)])

    before = graphs.counts.copy()
    fresh = [torch.zeros(1 << 10, device=DEVICE) for _ in range(3)]
    for t in fresh:
        call(t)
    assert (graphs.counts - before)["instantiated"] == 0
    for _ in range(graphs.RECORD_AT + 1):
        call(x)
    new = graphs.counts - before
    assert (new["direct"], new["instantiated"], new["replayed"]) == (graphs.RECORD_AT + 2, 1, 1), new
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 30.0)) and all(torch.equal(t, torch.full_like(t, 2.0)) for t in fresh)
