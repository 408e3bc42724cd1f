"""Concurrent launch steps (`kernels/branches.py`): what runs where and after what, and the fused
paths whose independent cuBLAS products run as branches giving the same outputs, bit for bit, as
the same products one after another, in a graph and launched directly."""

import pytest
import torch
from conftest import DEVICE
from helpers import ODD_AXES, assert_official_pass

import backfuse
from backfuse.kernels import branches
from backfuse.ops.gemma3_core.config import Config as C37
from backfuse.ops.qkv_gqa.config import Config as C72
from backfuse.ops.wan_xattn.config import Config as C21

GPU = pytest.mark.skipif(DEVICE != "cuda", reason="streams are the GPU's")


def test_one_group_runs_in_order_on_the_current_stream_and_is_graphable_as_its_launches():
    order = []
    step = branches.concurrent([lambda: order.append(1), lambda: order.append(2)], [])
    step()
    assert order == [1, 2] and step.graphable

    def compiling():
        order.append(3)
    compiling.graphable = False
    assert not branches.concurrent([lambda: None], [compiling]).graphable
    branches.concurrent()()  # nothing to run


@GPU
def test_groups_run_on_their_own_streams_after_what_came_before_and_before_what_follows():
    """Group 0 on the current stream; every other group on a side stream of its own, a nested step's
    sides distinct from its parent's; each side sees what was launched before the step, and what
    follows the step sees every group's work."""
    streams = {}
    x = torch.zeros(1 << 20, device=DEVICE)
    parts = [torch.empty_like(x) for _ in range(4)]

    def launch(name, out, cycles):
        def run():
            streams[name] = torch.cuda.current_stream().cuda_stream
            torch.cuda._sleep(cycles)
            out.copy_(x + 1)
        return run

    main = torch.cuda.Stream()
    with torch.cuda.stream(main):
        for _ in range(2):  # the second call takes the same side streams
            for part in parts:
                part.zero_()
            x.zero_()
            torch.cuda._sleep(4_000_000)  # a side not waiting for what came before would read x = 0
            x.fill_(2.0)
            # the sides sleep longest: what follows the step would miss their parts without the join
            step = branches.concurrent(
                [launch("a", parts[0], 1000), branches.concurrent([launch("b", parts[1], 1000)],
                                                                   [launch("c", parts[2], 2_000_000)])],
                [launch("d", parts[3], 2_000_000)])
            step()
            total = sum(parts)
    main.synchronize()
    assert torch.equal(total, torch.full_like(x, 12.0))
    assert streams["a"] == streams["b"] == main.cuda_stream
    assert len({streams["a"], streams["c"], streams["d"]}) == 3


def _bitwise_alike(pid, options, on, off, needs=None):
    """The operator with branches (config `on`: a graph, then launched directly) against the same
    products one after another (config `off`): equal outputs (those needed), and the official rule
    passed where all are."""
    prob = backfuse.problem(pid)
    x = prob.make_inputs(ODD_AXES[pid][1], seed=3, device=DEVICE)
    serial = prob.fused(*x, config=off, needs=needs, **options)
    wanted = needs or (True,) * len(serial)
    for graphs_on in (True, True, False):  # instantiated, updated, then directly
        with backfuse.cuda_graphs(graphs_on):
            outs = prob.fused(*x, config=on, needs=needs, **options)
        for s, o, w in zip(serial, outs, wanted, strict=True):
            assert not w or torch.equal(s, o)
    if needs is None:
        assert_official_pass(prob, outs, prob.reference(*x))


@GPU
@pytest.mark.parametrize("pid,options,on,off", [
    ("072", dict(products="cublas"), C72(branches_below_flop=float("inf")), C72(branches_below_flop=0)),
    ("037", dict(products="cublas"), C37(branches=True), C37(branches=False)),
    ("021", dict(products="cublas", deterministic=True), C21(branches=True), C21(branches=False)),
])
def test_branched_cublas_products_agree_bit_for_bit_with_serial_ones(pid, options, on, off):
    _bitwise_alike(pid, options, on, off)


@GPU
def test_an_unneeded_product_leaves_its_branch_empty():
    """037 without grad_Wo: the attention backward's step has no side group."""
    _bitwise_alike("037", dict(products="cublas"), C37(branches=True), C37(branches=False),
                   needs=(True, True, True, True, False, True, True))
