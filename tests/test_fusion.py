"""Gradient buckets (autopar.fusion): every mode on ResNet-50's 161 gradients, precedence,
the rounding rule of HCCL's split by size, and typed errors for bad inputs."""

from __future__ import annotations

import itertools
import math

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.fusion import (MB, Gradient, buckets_by_index, buckets_by_percent,
                            buckets_by_size, buckets_from_ends, buckets_per_gradient,
                            buckets_pytorch_ddp, gradients, percent_ends)
from autopar.models import resnet50


@pytest.fixture(scope="module")
def graph():
    m = resnet50(num_classes=1000, batch=32, image_size=224)
    return ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))


@pytest.fixture(scope="module")
def grads(graph):
    return gradients(graph)


def check_partition(b, n):
    """Buckets are contiguous, ordered, cover 0..n-1 once, and their bytes add up."""
    assert [x.index for x in b] == list(range(len(b)))
    assert b[0].first == 0 and b[-1].last == n - 1
    for x, y in zip(b, b.buckets[1:]):
        assert y.first == x.last + 1
    for x in b:
        assert len(x) == x.last - x.first + 1
        assert x.gradients == tuple(g.name for g in b.gradients[x.first:x.last + 1])
        assert x.nbytes == sum(g.nbytes for g in b.gradients[x.first:x.last + 1])


def test_resnet50_gradients_in_backward_order(graph, grads):
    assert len(grads) == 161
    assert [g.name for g in grads] == list(graph.gradient_order())
    assert grads[0].name == "params/fc/b" and grads[-1].name == "params/stem/conv/w"
    assert sum(g.nbytes for g in grads) == 25557032 * 4
    assert all(g.axes is None for g in grads)
    fwd = gradients(graph, order="forward")
    assert [g.name for g in fwd] == [g.name for g in grads][::-1]


def test_hccl_default_split_96_54_3_46(grads):
    b = ap.simulation.gradient_buckets(grads, policy="hccl")
    assert b.mode == "hccl_size" and "default" in b.source
    assert b.ends == (109, 161)
    check_partition(b, 161)
    # the rounding rule: the first gradient at which the cumulative bytes reach 96.54 %
    total = b.total_bytes
    cum = list(itertools.accumulate(g.nbytes for g in grads))
    assert cum[108] >= 0.9654 * total > cum[107]
    assert b.hccl_indices == (108, 160)
    assert b.percentages[0] == pytest.approx(100 * cum[108] / total)


def test_hccl_index_20_100_159(grads):
    ap.set_auto_parallel_context(device_num=8)
    ap.hccl.set_split_strategy_by_idx([20, 100, 159])
    b = ap.simulation.gradient_buckets(grads)
    assert b.mode == "hccl_index"
    assert [(x.first, x.last) for x in b] == [(0, 20), (21, 100), (101, 159), (160, 160)]
    check_partition(b, 161)
    # ending the list at the last gradient leaves no rest
    last = buckets_by_index(grads, [20, 100, 160], convention="hccl")
    assert [(x.first, x.last) for x in last] == [(0, 20), (21, 100), (101, 160)]


def test_all_reduce_fusion_config_20_35(grads):
    ap.set_auto_parallel_context(device_num=8, all_reduce_fusion_config=[20, 35])
    b = ap.simulation.gradient_buckets(grads)
    assert b.mode == "index" and "all_reduce_fusion_config" in b.source
    assert [(x.first, x.last) for x in b] == [(0, 19), (20, 34), (35, 160)]
    assert b.fusion_config == (20, 35)
    # one bucket: its split point is the number of gradients (an empty list is not a setting)
    n = len(grads)
    ap.set_auto_parallel_context(all_reduce_fusion_config=[n])
    one = ap.simulation.gradient_buckets(grads)
    assert len(one.buckets) == 1 and one.fusion_config == (n,)
    ap.set_auto_parallel_context(all_reduce_fusion_config=list(one.fusion_config))
    assert ap.simulation.gradient_buckets(grads).ends == one.ends
    check_partition(b, 161)
    # comm_fusion's index mode is the same setting
    ap.reset_auto_parallel_context()
    ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": [20, 35]}})
    assert ap.simulation.gradient_buckets(grads).ends == b.ends
    # MindSpore's own example [8, 160] on 161 gradients; a point equal to n leaves no rest
    assert buckets_by_index(grads, [8, 160]).ends == (8, 160, 161)
    assert buckets_by_index(grads, [8, 161]).ends == (8, 161)


def greedy_ok(b, threshold):
    for x, y in zip(b, b.buckets[1:]):
        assert x.nbytes + b.gradients[y.first].nbytes > threshold  # closing was necessary
    for x in b:
        assert x.nbytes <= threshold or len(x) == 1


@pytest.mark.parametrize("config", [{"mode": "size", "config": 64}, {"mode": "auto"}])
def test_size_64mb_and_auto(grads, config):
    ap.set_auto_parallel_context(comm_fusion={"allreduce": config})
    b = ap.simulation.gradient_buckets(grads)
    assert b.mode == config["mode"]
    check_partition(b, 161)
    greedy_ok(b, 64 * MB)
    assert b.ends == (31, 161)  # ResNet-50's 97.5 MB in fp32: two buckets
    assert b[0].nbytes <= 64 * MB < b[0].nbytes + grads[31].nbytes


def test_gradient_larger_than_threshold_gets_its_own_bucket(grads):
    """fc/w is 7.8 MB: with a 1 MB threshold it is never split and never merged."""
    ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": 1}})
    b = ap.simulation.gradient_buckets(grads)
    check_partition(b, 161)
    greedy_ok(b, 1 * MB)
    fc = next(x for x in b if "params/fc/w" in x.gradients)
    assert fc.gradients == ("params/fc/w",) and fc.nbytes > 1 * MB
    big = [g.name for g in grads if g.nbytes > MB]
    for x in b:
        if any(n in big for n in x.gradients):
            assert len(x) == 1


def test_fusion_closed_and_none(grads):
    b = ap.simulation.gradient_buckets(grads)  # nothing set: fusion closed
    assert len(b) == 161 and b.mode == "none" and "fusion closed" in b.source
    assert ap.simulation.gradient_buckets(grads, policy="none").ends == b.ends
    assert buckets_per_gradient(grads).ends == tuple(range(1, 162))


def test_precedence(grads):
    ap.set_auto_parallel_context(device_num=8)
    # HCCL size wins over HCCL index
    ap.hccl.set_split_strategy_by_idx([20, 100, 159])
    ap.hccl.set_split_strategy_by_size([60, 20, 20])
    b = ap.simulation.gradient_buckets(grads)
    assert b.mode == "hccl_size" and "ignored" in b.source
    assert b.ends == buckets_by_percent(grads, [60, 20, 20]).ends
    # comm_fusion in the context wins over any HCCL strategy
    ap.set_auto_parallel_context(all_reduce_fusion_config=[20, 35])
    assert ap.simulation.gradient_buckets(grads).ends == (20, 35, 161)
    # policy="hccl" uses HCCL's effective strategy (comm_fusion not consulted)
    assert ap.simulation.gradient_buckets(grads, policy="hccl").ends == b.ends
    ap.hccl.reset_comm_groups()
    assert ap.simulation.gradient_buckets(grads, policy="hccl").ends == (109, 161)  # the default
    assert ap.simulation.gradient_buckets(grads).ends == (20, 35, 161)
    # a resolved context replaces the current one
    with ap.auto_parallel_context(parallel_mode="data_parallel", comm_fusion={
            "allreduce": {"mode": "index", "config": [5]}}):
        resolved = ap.resolve_context()
    assert ap.simulation.gradient_buckets(grads, resolved=resolved).ends == (5, 161)


def test_group_strategies_are_per_group(grads):
    ap.set_auto_parallel_context(device_num=8)
    ap.hccl.create_group("dp", [0, 1, 2, 3])
    ap.hccl.set_split_strategy_by_size([50, 50], "dp")
    assert len(ap.simulation.gradient_buckets(grads)) == 161          # the world group: nothing set
    assert len(ap.simulation.gradient_buckets(grads, group="dp")) == 2


def test_allgather_and_reducescatter(graph):
    ap.set_auto_parallel_context(comm_fusion={"allgather": {"mode": "size", "config": 32},
                                              "reducescatter": {"mode": "auto"}})
    ag = ap.simulation.gradient_buckets(graph, kind="allgather")
    assert ag.kind == "allgather" and ag.gradients[0].name == "params/stem/conv/w"  # forward
    greedy_ok(ag, 32 * MB)
    rs = ap.simulation.gradient_buckets(graph, kind="reducescatter")
    assert rs.gradients[0].name == "params/fc/b" and rs.mode == "auto"
    assert len(ap.simulation.gradient_buckets(graph)) == 161  # allreduce untouched: closed


def test_graph_source_with_plan(graph):
    small = resnet50(num_classes=10, batch=8, image_size=32)
    g = ap.trace(small.loss, *jax.eval_shape(small.example_args, jax.random.key(0)))
    plan = ap.search(g, device_num=8, parallel_mode="data_parallel")
    gs = gradients(g, plan)
    assert [x.name for x in gs] == list(g.gradient_order())
    w = next(x for x in gs if x.name == "params/stem/conv/w")
    assert w.nbytes == g.spec(w.name).nbytes and w.axes == plan.mesh.names
    b = ap.simulation.gradient_buckets(g, plan, policy="hccl")
    check_partition(b, 161)
    with pytest.raises(ap.AutoParallelError, match="another graph"):
        gradients(graph, plan)


def test_table_is_readable(grads):
    text = ap.simulation.gradient_buckets(grads, policy="hccl").table()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["bucket", "gradients", "count"]
    assert "0..108" in text and "109..160" in text and "params/stem/conv/w" in text
    assert "HCCL default split [96.54, 3.46]" in lines[-1]


def test_pytorch_ddp_buckets():
    g = [("a", MB // 2), ("b", MB // 2), ("c", 10 * MB), ("d", 20 * MB), ("e", MB)]
    # first bucket closes once it holds >= 1 MiB; the next once it holds >= 25 MiB
    assert buckets_pytorch_ddp(g).ends == (2, 4, 5)


@pytest.mark.parametrize("call, exc, match", [
    (lambda gs: buckets_by_index(gs, [20, 162]), ap.AutoParallelError, r"\[1, 161\]"),
    (lambda gs: buckets_by_index(gs, [0, 5]), ap.AutoParallelError, "out of range"),
    (lambda gs: buckets_by_index(gs, [20, 161], convention="hccl"), ap.AutoParallelError,
     r"\[0, 160\]"),
    (lambda gs: buckets_by_index(gs, list(range(1, 9)), convention="hccl"),
     ap.AutoParallelError, "at most 8"),
    (lambda gs: buckets_by_index(gs, [5, 3]), ap.AutoParallelError, "ascending"),
    (lambda gs: buckets_by_index(gs, ["5"]), ap.AutoParallelTypeError, "ints"),
    (lambda gs: buckets_by_index(gs, [True]), ap.AutoParallelTypeError, "ints"),
    (lambda gs: buckets_by_index(gs, [3], convention="torch"), ap.AutoParallelError,
     "convention"),
    (lambda gs: buckets_by_percent(gs, [50, 40]), ap.AutoParallelError, "sum to 100"),
    (lambda gs: buckets_by_percent(gs, [-10, 110]), ap.AutoParallelError, "non-negative"),
    (lambda gs: buckets_by_percent(gs, [12.5] * 8 + [0]), ap.AutoParallelError, "at most 8"),
    (lambda gs: buckets_by_percent(gs, "100"), ap.AutoParallelTypeError, "list"),
    (lambda gs: buckets_by_size(gs, 0), ap.AutoParallelError, "larger than 0"),
    (lambda gs: buckets_by_size(gs, "64"), ap.AutoParallelTypeError, "number"),
    (lambda gs: buckets_from_ends(gs, [10, 5, 161]), ap.AutoParallelError, "ascending"),
    (lambda gs: buckets_from_ends(gs, [10]), ap.AutoParallelError, "161"),
    (lambda gs: buckets_from_ends(gs, 3), ap.AutoParallelTypeError, "ends=3"),
    (lambda gs: buckets_from_ends(gs, None), ap.AutoParallelTypeError, "ends=None"),
    (lambda gs: buckets_by_size(gs, 10**400), ap.AutoParallelError, "finite"),
    (lambda gs: buckets_by_size(gs, float("inf")), ap.AutoParallelError, "finite"),
    (lambda gs: buckets_pytorch_ddp(gs, bucket_cap_mb="x"), ap.AutoParallelTypeError,
     "bucket_cap_mb='x'"),
    (lambda gs: buckets_pytorch_ddp(gs, first_bucket_mb=True), ap.AutoParallelTypeError,
     "first_bucket_mb=True"),
    (lambda gs: buckets_pytorch_ddp(gs, bucket_cap_mb=0), ap.AutoParallelError,
     "bucket_cap_mb=0.*larger than 0"),
    (lambda gs: buckets_pytorch_ddp(gs, first_bucket_mb=float("nan")), ap.AutoParallelError,
     "first_bucket_mb=nan.*finite"),
    (lambda gs: buckets_pytorch_ddp(gs, bucket_cap_mb=10**400), ap.AutoParallelError,
     "bucket_cap_mb=.*finite"),
    (lambda gs: ap.simulation.gradient_buckets(gs, kind="broadcast"), ap.AutoParallelError, "kind"),
    (lambda gs: ap.simulation.gradient_buckets(gs, policy="nccl"), ap.AutoParallelError, "policy"),
    (lambda gs: ap.simulation.gradient_buckets(gs, kind="allgather", policy="hccl"),
     ap.AutoParallelError, "allreduce only"),
    (lambda gs: ap.simulation.gradient_buckets(gs, plan=object()), ap.AutoParallelError, "Graph"),
    (lambda gs: ap.simulation.gradient_buckets(gs, resolved={"x": 1}), ap.AutoParallelTypeError,
     "ResolvedContext"),
    (lambda gs: ap.simulation.gradient_buckets([]), ap.AutoParallelError, "no gradients"),
    (lambda gs: ap.simulation.gradient_buckets([("a", 1), ("a", 2)]), ap.AutoParallelError,
     "unique"),
    (lambda gs: ap.simulation.gradient_buckets([("a", -1)]), ap.AutoParallelError, ">= 0"),
    (lambda gs: ap.simulation.gradient_buckets([("a", 1.5)]), ap.AutoParallelTypeError, "int"),
    (lambda gs: ap.simulation.gradient_buckets("abc"), ap.AutoParallelTypeError, "list"),
    (lambda gs: gradients([1, 2]), ap.AutoParallelTypeError, "Graph"),
])
def test_bad_inputs_raise_typed_errors(grads, call, exc, match):
    with pytest.raises(exc, match=match):
        call(grads)


@pytest.mark.parametrize("call", [
    lambda gs: buckets_by_percent(gs, [50, 50]),
    lambda gs: buckets_from_ends(gs, [1, 2]).table(),
    lambda gs: buckets_per_gradient(gs).percentages,
    lambda gs: buckets_pytorch_ddp(gs),
])
def test_gradient_bytes_are_capped(call):
    """A gradient past 2**62 bytes is refused naming its index (no OverflowError later)."""
    with pytest.raises(ap.AutoParallelError, match=r"'big' at \[1\].*2\*\*62"):
        call([("a", 1), ("big", 10**400)])
    with pytest.raises(ap.AutoParallelError, match=r"at \[0\]"):
        call([Gradient("a", 2**62 + 1), Gradient("b", 1)])
    call([("a", 2**62), ("b", 2**62)])  # the cap itself is accepted


def test_context_index_beyond_gradients_names_the_key(grads):
    ap.set_auto_parallel_context(all_reduce_fusion_config=[20, 500])
    with pytest.raises(ap.AutoParallelError, match="all_reduce_fusion_config=") as err:
        ap.simulation.gradient_buckets(grads)
    assert err.value.key == "all_reduce_fusion_config"
    ap.reset_auto_parallel_context()
    ap.set_auto_parallel_context(device_num=8)
    ap.hccl.set_split_strategy_by_idx([20, 300])
    with pytest.raises(ap.AutoParallelError, match="idxList="):
        ap.simulation.gradient_buckets(grads)


sizes_st = st.lists(st.integers(0, 10_000), min_size=1, max_size=40).filter(lambda s: sum(s))
pcts_st = st.lists(st.integers(0, 1000), min_size=1, max_size=8).filter(lambda p: sum(p))


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, raw=pcts_st)
def test_percent_rule_property(sizes, raw):
    """Each boundary is the first gradient where the cumulative bytes reach the cumulative
    percentage; segments are never more than the percentages; all are non-empty."""
    total_raw = sum(raw)
    pcts = [100.0 * r / total_raw for r in raw]
    pcts[-1] = 100.0 - math.fsum(pcts[:-1])
    ends = percent_ends(sizes, pcts)
    assert ends[-1] == len(sizes) and len(ends) <= len(pcts)
    assert all(b > a for a, b in zip([0] + ends, ends))
    total = sum(sizes)
    cum = list(itertools.accumulate(sizes))
    targets = [total * math.fsum(pcts[:k + 1]) / 100 for k in range(len(pcts) - 1)]
    for e in ends[:-1]:
        # e closes a segment: some target is reached at gradient e-1 and not before it
        reached = [t for t in targets if cum[e - 1] >= t - 1e-9 * total]
        assert any((cum[e - 2] if e >= 2 else 0) < t - 1e-9 * total for t in reached)


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, threshold=st.integers(1, 20_000))
def test_size_rule_property(sizes, threshold):
    gs = [Gradient(f"g{i}", s) for i, s in enumerate(sizes)]
    b = buckets_by_size(gs, threshold)
    check_partition(b, len(gs))
    for x, y in zip(b, b.buckets[1:]):
        assert x.nbytes + gs[y.first].nbytes > threshold
    for x in b:
        assert x.nbytes <= threshold or len(x) == 1
