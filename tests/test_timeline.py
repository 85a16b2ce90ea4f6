"""The iteration simulator (autopar.timeline) and the split advisor (autopar.split_advisor):
trace consistency, Chrome trace JSON, the PNG, exactness of the advisor, and that it never
loses to the usual alternatives on ResNet-50 and the zoo transformer at 8, 64, 512 devices."""

from __future__ import annotations

import itertools
import json

import jax
import pytest

import autopar as ap
from autopar.fusion import (buckets_by_index, buckets_by_percent, buckets_from_ends,
                            gradients)
from autopar.models import mlp, resnet50, transformer
from autopar.split_advisor import horovod_buckets, round_percentages
from autopar.strategies.cost import CLUSTERS, CostModel
from autopar.strategies.problem import requires_grad
from autopar.timeline import CommSegment


def _trace(model):
    return ap.trace(model.loss, *jax.eval_shape(model.example_args, jax.random.key(0)))


@pytest.fixture(scope="module")
def resnet():
    return _trace(resnet50(num_classes=1000, batch=32, image_size=224))


@pytest.fixture(scope="module")
def tfm():
    return _trace(transformer(layers=24, hidden=1024, heads=16, seq=512, vocab=32768, batch=8))


@pytest.fixture(scope="module")
def small_tfm_plan():
    g = _trace(transformer(layers=2, hidden=256, heads=4, seq=128, vocab=1024, batch=32))
    return g, ap.search(g, device_num=8, parallel_mode="auto_parallel",
                        mode="dynamic_programming")


def check_trace(t):
    """The invariants of every simulated iteration."""
    assert t.fp_start == 0.0 <= t.fp_end <= t.bp_end
    # forward: the launch, the operators and a share of the plan's communication; backward:
    # 2x the operators that read something trained, then the update (test_calibration checks
    # the sum against the plan's predicted step)
    assert t.fp_time >= sum(t.node_times) * (1 - 1e-12) and t.bp_time > 0
    ready = t.gradient_ready
    assert all(t.fp_end <= r <= t.bp_end for r in ready)
    assert list(ready) == sorted(ready)  # backward order is ready order
    prev_end = 0.0
    covered = 0
    for k, s in enumerate(t.segments):
        assert isinstance(s, CommSegment) and s.index == k and s.name == f"allreduce{k + 1}"
        assert s.first == covered and s.last >= s.first
        covered = s.last + 1
        assert s.ready == max(ready[s.first:s.last + 1]) or not t.overlap
        assert s.start >= s.ready            # never before its last gradient is ready
        assert s.start >= prev_end           # one stream: segments never overlap
        assert s.end >= s.start
        if not t.overlap:
            assert s.start >= t.bp_end       # without hcom_parallel, after backward
        prev_end = s.end
    assert covered == len(t.gradient_names)
    assert t.iteration_end == max(t.bp_end, prev_end)
    assert t.exposed_comm == pytest.approx(t.iteration_end - t.bp_end)
    names = [n for n, _ in t.events()]
    times = [x for _, x in t.events()]
    assert times == sorted(times)
    assert names[0] == "fp_start" and names[-1] == "Iteration_end"
    expect = {"fp_start", "bp_end", "Iteration_end"} | {
        f"allreduce{k + 1}_{e}" for k in range(len(t.segments)) for e in ("start", "end")}
    assert set(names) == expect and len(names) == len(expect)
    for k in range(len(t.segments)):
        assert names.index(f"allreduce{k + 1}_start") < names.index(f"allreduce{k + 1}_end")


@pytest.mark.parametrize("devices", [8, 64, 512])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("policy", ["hccl", "none", "size"])
def test_trace_consistency_resnet(resnet, devices, overlap, policy):
    if policy == "size":
        ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "size", "config": 8}})
        policy = "context"
    t = ap.simulation.simulate(resnet, buckets=policy, device_num=devices, overlap=overlap)
    check_trace(t)
    assert t.device_num == devices and t.overlap is overlap


def test_overlap_follows_the_cluster_unless_given():
    """The gradient all-reduces run beside backward only where the cluster measured that a
    transfer hides behind compute: not on emulated CPU devices (overlap 0), where the
    iteration is then the plan's predicted step."""
    g = _three_matmuls()
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        plan = ap.search(g, cluster="cpu-emulated")
    cpu = ap.simulation.simulate(g, plan, buckets="none")
    assert cpu.overlap is False and cpu.step_time == pytest.approx(plan.cost.total, rel=1e-12)
    assert ap.simulation.simulate(g, plan, buckets="none", overlap=True).overlap is True
    assert ap.simulation.simulate(g, plan, cluster="accelerator-8x").overlap is True
    half = CLUSTERS["accelerator-8x"].model_copy(update={"name": "h", "overlap": 0.4})
    assert ap.simulation.simulate(g, plan, cluster=half).overlap is False
    assert ap.simulation.advise_split(g, plan).trace.overlap is False
    with pytest.raises(ap.AutoParallelTypeError, match="overlap"):
        ap.simulation.simulate(g, plan, overlap="yes")


def test_overlap_never_hurts_and_seed_events(resnet):
    on = ap.simulation.simulate(resnet, buckets="hccl", device_num=64)
    off = ap.simulation.simulate(resnet, buckets="hccl", device_num=64, overlap=False)
    assert on.iteration_end <= off.iteration_end
    ev = dict(on.events())
    assert sorted(ev) == sorted(["fp_start", "allreduce1_start", "allreduce1_end", "bp_end",
                                 "allreduce2_start", "allreduce2_end", "Iteration_end"])
    # the seed's picture: the first segment starts during backward, the last after it
    assert ev["allreduce1_start"] < ev["bp_end"] <= ev["allreduce2_start"]
    assert off.segments[0].start == off.bp_end
    assert off.iteration_end == pytest.approx(off.bp_end + off.comm_time)


def test_buckets_from_the_context(resnet):
    ap.set_auto_parallel_context(device_num=8, all_reduce_fusion_config=[20, 35])
    t = ap.simulation.simulate(resnet)            # device_num and buckets from the context
    assert t.device_num == 8 and len(t.segments) == 3
    assert [(s.first, s.last) for s in t.segments] == [(0, 19), (20, 34), (35, 160)]
    one = ap.simulation.simulate(resnet, device_num=1, buckets="hccl")
    assert one.comm_time == 0.0 and one.iteration_end == one.bp_end


def test_simulation_with_a_plan(small_tfm_plan):
    g, plan = small_tfm_plan
    gs = gradients(g, plan)
    assert len({x.axes for x in gs}) > 1      # mixed all-reduce groups under this plan
    t = ap.simulation.simulate(g, plan, buckets="hccl")
    check_trace(t)
    assert t.device_num == 8
    # compute is the per-device share: each node's time divided by its split product
    free = ap.simulation.simulate(g, device_num=8, buckets="hccl")
    assert t.fp_time < free.fp_time
    with pytest.raises(ap.AutoParallelError, match="plan is for 8 devices"):
        ap.simulation.simulate(g, plan, device_num=16)
    adv = ap.simulation.advise_split(g, plan)
    cmp = ap.simulation.compare_splits(g, plan)
    assert all(adv.iteration_time <= x.iteration_time for x in cmp.traces.values())


def test_chrome_trace_json(resnet, tmp_path):
    t = ap.simulation.simulate(resnet, buckets="hccl", device_num=64)
    path = t.write_chrome_trace(tmp_path / "iteration.json")
    doc = json.loads(path.read_text())
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list)
    ev = doc["traceEvents"]
    for e in ev:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "i", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["cat"], str)
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g") and isinstance(e["ts"], (int, float))
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index")
            assert isinstance(e["args"], dict)
    tracks = {e["tid"] for e in ev if e["ph"] == "X"}
    assert tracks == {1, 2}                                         # compute, communication
    comm = [e for e in ev if e["ph"] == "X" and e["tid"] == 2]
    assert [e["name"] for e in comm] == ["allreduce1", "allreduce2"]
    for e, s in zip(comm, t.segments):
        assert e["ts"] == pytest.approx(s.start * 1e6) and e["dur"] == pytest.approx(
            s.duration * 1e6)
        assert e["args"]["bytes"] == s.nbytes
    instants = [(e["name"], e["ts"]) for e in ev if e["ph"] == "i"]
    assert [n for n, _ in instants] == [n for n, _ in t.events()]
    fwd = [e for e in ev if e.get("cat") == "forward"]
    assert len(fwd) == len(resnet.nodes)
    assert sum(e["dur"] for e in fwd) == pytest.approx(t.fp_time * 1e6)
    coarse = t.to_chrome_trace(detail=False)["traceEvents"]
    assert len([e for e in coarse if e["ph"] == "X"]) == 2 + len(t.segments)


def test_png_timeline(resnet, tmp_path):
    t = ap.simulation.advise_split(resnet, device_num=64).trace
    out = t.plot(tmp_path / "timeline.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ap.simulation.plot_timeline(t, tmp_path / "t2.png").stat().st_size > 1000


def all_splits(n, max_segments):
    for s in range(1, max_segments + 1):
        for cuts in itertools.combinations(range(1, n), s - 1):
            yield list(cuts) + [n]


@pytest.mark.parametrize("devices, overlap", [(8, True), (64, True), (512, True),
                                              (64, False)])
def test_advisor_is_exact_by_brute_force(small_tfm_plan, devices, overlap):
    g = small_tfm_plan[0]
    n = len(g.parameters())
    best = {}
    for ends in all_splits(n, 3):
        t = ap.simulation.simulate(g, buckets=buckets_from_ends(gradients(g), ends),
                                   device_num=devices, overlap=overlap)
        best[len(ends)] = min(best.get(len(ends), float("inf")), t.iteration_end)
    for s in (1, 2, 3):
        adv = ap.simulation.advise_split(g, device_num=devices, max_segments=s, overlap=overlap)
        assert adv.iteration_time == min(v for k, v in best.items() if k <= s)
        assert len(adv.buckets) <= s


def test_advisor_on_a_tiny_mlp_matches_every_split():
    g = _trace(mlp(widths=(256, 1024, 1024, 256), batch=64))
    n = len(g.parameters())
    times = [ap.simulation.simulate(g, buckets=buckets_from_ends(gradients(g), e), device_num=64)
             .iteration_end for e in all_splits(n, n)]
    assert ap.simulation.advise_split(g, device_num=64, max_segments=min(n, 8)).iteration_time == \
        min(times)


@pytest.mark.parametrize("model", ["resnet", "tfm"])
@pytest.mark.parametrize("devices", [8, 64, 512])
def test_advisor_never_loses(request, model, devices):
    g = request.getfixturevalue(model)
    cmp = ap.simulation.compare_splits(g, device_num=devices)
    adv = cmp.advice
    assert set(cmp.traces) == {"advised", "hccl_default_96.54/3.46", "one_per_gradient",
                               "one_segment", "mindspore_auto_64MB", "pytorch_ddp_1+25MiB",
                               "horovod_128MB"}
    for name, t in cmp.traces.items():
        check_trace(t)
        assert adv.iteration_time <= t.iteration_time, name
    assert cmp.best() == "advised"
    assert adv.iteration_time <= adv.unbounded * (1 + 0.01)  # 8 segments ~ any number
    assert adv.lower_bound <= adv.tight_bound <= adv.unbounded <= adv.iteration_time
    assert len(adv.buckets) <= 8 and len(adv.percentages) == len(adv.buckets)
    if devices > 8:  # where communication matters, strictly better than HCCL's default
        assert adv.iteration_time < cmp.traces["hccl_default_96.54/3.46"].iteration_time
    # the advice is usable as each API's setting, and gives back the same buckets
    gs = gradients(g)
    assert buckets_by_percent(gs, list(adv.percentages)).ends == adv.buckets.ends
    assert buckets_by_index(gs, list(adv.hccl_indices), convention="hccl").ends == \
        adv.buckets.ends
    if adv.fusion_config:
        assert buckets_by_index(gs, list(adv.fusion_config)).ends == adv.buckets.ends
    assert "advised" in cmp.table() and "lower bound" in cmp.table()


def test_advice_applies_as_hccl_strategy(resnet):
    ap.set_auto_parallel_context(device_num=64)
    adv = ap.simulation.advise_split(resnet)
    adv.apply()
    assert ap.hccl.get_split_strategy().values == adv.percentages
    t = ap.simulation.simulate(resnet)  # the context's precedence now finds the HCCL strategy
    assert t.iteration_end == adv.iteration_time
    assert "advised split" in adv.summary()


def test_advisor_without_overlap_prefers_one_segment(resnet):
    adv = ap.simulation.advise_split(resnet, device_num=64, overlap=False)
    assert len(adv.buckets) == 1   # nothing to hide: every extra segment only adds latency
    check_trace(adv.trace)


def test_round_percentages_and_horovod():
    assert round_percentages([10, 80, 10], [2, 3]) == (90.0, 10.0)
    assert round_percentages([1, 1, 1], [1, 2, 3]) == (33.0, 33.0, 34.0)  # fewest digits
    sizes = [5, 7, 11, 13, 17]
    for ends in all_splits(5, 5):
        pct = round_percentages(sizes, ends)
        assert sum(pct) == pytest.approx(100, abs=1e-6)
        assert buckets_by_percent([(str(i), s) for i, s in enumerate(sizes)],
                                  list(pct)).ends == tuple(ends)
    g = [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    # one cycle per ms: a, b ready in the first; c, d in the second
    assert horovod_buckets(g, [0.0002, 0.0009, 0.0013, 0.0015]).ends == (2, 4)
    assert horovod_buckets(g, [0.0] * 4, fusion_mb=4 / 2**20).ends == (2, 3, 4)


@pytest.mark.parametrize("call, exc, match", [
    (lambda g: ap.simulation.simulate("graph"), ap.AutoParallelTypeError, "Graph"),
    (lambda g: ap.simulation.simulate(g, device_num=8, overlap=1), ap.AutoParallelTypeError,
     "bool"),
    (lambda g: ap.simulation.simulate(g, device_num=8.0), ap.AutoParallelTypeError, "int"),
    (lambda g: ap.simulation.simulate(g, device_num=0), ap.AutoParallelError, "4096"),
    (lambda g: ap.simulation.simulate(g, device_num=8, cluster="tpu"), ap.AutoParallelError,
     "preset"),
    (lambda g: ap.simulation.simulate(g, device_num=8, buckets=42), ap.AutoParallelTypeError,
     "policy"),
    (lambda g: ap.simulation.simulate(g, device_num=8, buckets="fast"), ap.AutoParallelError,
     "buckets='fast'"),
    (lambda g: ap.simulation.simulate(g, device_num=8, buckets=buckets_from_ends(
        [("x", 4), ("y", 4)], [2])), ap.AutoParallelError, "exactly once"),
    (lambda g: ap.simulation.simulate(g, device_num=8, buckets=list(ap.simulation.gradient_buckets(
        g, policy="hccl"))[::-1]), ap.AutoParallelError, "backward order"),
    (lambda g: ap.simulation.advise_split(g, device_num=8, max_segments=9), ap.AutoParallelError,
     r"\[1, 8\]"),
    (lambda g: ap.simulation.advise_split(g, device_num=8, max_segments=0), ap.AutoParallelError,
     r"\[1, 8\]"),
    (lambda g: ap.simulation.advise_split(g, device_num=8, max_segments=True),
     ap.AutoParallelTypeError, "int"),
    (lambda g: ap.simulation.simulate(g, object()), ap.AutoParallelTypeError, "Plan"),
    (lambda g: ap.simulation.plot_timeline("trace", "x.png"), ap.AutoParallelTypeError,
     "IterationTrace"),
    (lambda g: ap.simulation.compare_splits(g, device_num=8, extra={"x": [1]}),
     ap.AutoParallelTypeError, "GradientBuckets"),
    (lambda g: ap.simulation.compare_splits(g, device_num=8, extra=[1]), ap.AutoParallelTypeError,
     "extra"),  # (was AttributeError: 'list' object has no attribute 'items')
    (lambda g: horovod_buckets([("a", 1)], [0.0, 1.0]), ap.AutoParallelError, "ready"),
])
def test_bad_inputs_raise_typed_errors(resnet, call, exc, match):
    with pytest.raises(exc, match=match):
        call(resnet)


# ---------------------------------------------------------------------------- one cluster


def _three_matmuls():
    import jax.numpy as jnp

    params = {k: jnp.ones((1024, 1024)) for k in "abc"}
    return ap.trace(lambda p, x: jnp.sum(((x @ p["a"]) @ p["b"]) @ p["c"]), params,
                    jnp.ones((256, 1024)))


def test_simulating_a_plan_on_another_cluster_reprices_its_communication(tmp_path):
    """simulate(cluster=X) and advise_split(cluster=X) of a plan searched elsewhere give the
    answer of the same plan loaded on X: no figure of the plan's own cluster is mixed in."""
    g = _three_matmuls()
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")
    plan = ap.search(g, cluster="accelerator-8x")
    assert plan.cost.communication + plan.cost.redistribution > 0
    ap.save_strategy(plan, g, tmp_path / "s.json")
    there = ap.load_strategy(tmp_path / "s.json", g, cluster="cpu-emulated")
    kw = {"overlap": False, "buckets": "none"}
    moved = ap.simulation.simulate(g, plan, cluster="cpu-emulated", **kw)
    loaded = ap.simulation.simulate(g, there, **kw)
    assert moved.step_time == loaded.step_time
    assert moved.step_time == pytest.approx(there.cost.total, rel=1e-12)
    assert (moved.fp_end, moved.bp_end) == (loaded.fp_end, loaded.bp_end)
    from autopar.timeline import plan_communication

    c = there.cost
    cm = CostModel(there.cluster_config)
    assert plan_communication(g, plan, cm) == (c.communication, c.redistribution,
                                               c.gradient_sync)
    assert ap.simulation.advise_split(g, plan, cluster="cpu-emulated").iteration_time == \
        ap.simulation.advise_split(g, there).iteration_time
    # on its own cluster (named or not), the plan's own figures: its predicted step
    own = ap.simulation.simulate(g, plan, cluster="accelerator-8x", **kw)
    assert own.step_time == ap.simulation.simulate(g, plan, **kw).step_time
    assert own.step_time == pytest.approx(plan.cost.total, rel=1e-12)


# ---------------------------------------------------------------------------- Chrome trace


def _phase_events(t):
    ev = [e for e in t.to_chrome_trace()["traceEvents"]
          if e["ph"] == "X" and e["tid"] == 1 and e["cat"] != "compute"]
    cut = t.fp_end * 1e6
    fwd = [e for e in ev if e["cat"] in ("launch", "forward") or
           (e["cat"] == "communication" and e["ts"] < cut)]
    bwd = [e for e in ev if e not in fwd]
    return fwd, bwd


def check_chrome_phases(t):
    """Every per-operator event lies inside its phase; each phase's events add up to it."""
    us, tol = 1e6, 1e-9
    fwd, bwd = _phase_events(t)
    for events, lo, hi in ((fwd, t.fp_start, t.fp_end), (bwd, t.fp_end, t.bp_end)):
        assert events[0]["ts"] == pytest.approx(lo * us, abs=tol)
        for a, b in zip(events, events[1:]):                    # back to back, in order
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=tol)
        for e in events:
            assert lo * us - tol <= e["ts"] and e["ts"] + e["dur"] <= hi * us + tol
        assert sum(e["dur"] for e in events) == pytest.approx((hi - lo) * us, abs=tol)
    assert len([e for e in fwd if e["cat"] == "forward"]) == len(t.node_names)
    grads = [e for e in bwd if e["cat"] == "backward"]
    assert [e["dur"] for e in grads] == pytest.approx([d * us for d in reversed(
        t.node_backward)])
    return fwd, bwd


def test_chrome_trace_operators_follow_the_simulated_phases():
    import jax.numpy as jnp

    g = ap.trace(lambda p, x: jnp.sum((jnp.exp(jnp.sin(x) * 3.) @ p["w"]) ** 2),
                 {"w": jnp.ones((512, 512))}, jnp.ones((64, 512)))
    base = ap.clusters.resolve_cluster("accelerator-8x")
    t = ap.simulation.simulate(g, device_num=8, cluster=base)
    fwd, bwd = check_chrome_phases(t)
    # sin and exp read only the data: their backward is free, as the model prices it
    nodes = {e["name"]: e["dur"] for e in bwd}
    grad = requires_grad(g)
    free = [n.name for n in g.nodes if not any(grad[v] for v in n.inputs)]
    assert free and all(nodes[f"{n} (grad)"] == 0.0 for n in free)
    late = ap.simulation.simulate(g, device_num=8,
                                  cluster=base.model_copy(update={"step_overhead": 1e-3}))
    fwd, _ = check_chrome_phases(late)
    ops = [e for e in fwd if e["cat"] == "forward"]
    assert ops[0]["ts"] == pytest.approx(1e3) and fwd[0]["name"] == "launch"


def test_chrome_trace_with_a_plans_activation_communication(small_tfm_plan):
    g, plan = small_tfm_plan
    assert plan.cost.communication + plan.cost.redistribution > 0
    t = ap.simulation.simulate(g, plan, buckets="hccl")
    fwd, bwd = check_chrome_phases(t)
    assert fwd[0]["cat"] == "communication" and bwd[0]["cat"] == "communication"
    assert (fwd[0]["dur"] + bwd[0]["dur"]) / 1e6 == pytest.approx(
        plan.cost.communication + plan.cost.redistribution)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_chrome_trace_refuses_non_finite_times(resnet, tmp_path, bad):
    import dataclasses

    from autopar.pipeline.simulation import simulate_schedule

    t = ap.simulation.simulate(resnet, buckets="hccl", device_num=8)
    for broken in (dataclasses.replace(t, bp_end=bad),
                   dataclasses.replace(t, node_times=(bad,) + t.node_times[1:]),
                   dataclasses.replace(t, segments=(dataclasses.replace(
                       t.segments[0], end=bad),) + t.segments[1:])):
        with pytest.raises(ap.AutoParallelError, match="finite"):
            broken.to_chrome_trace()
        with pytest.raises(ap.AutoParallelError, match="finite"):
            broken.write_chrome_trace(tmp_path / "t.json")
        assert not (tmp_path / "t.json").exists()
    with pytest.raises(ap.AutoParallelError, match="overflows"):  # (summed: inf, then nan)
        simulate_schedule([1e308, 1e308], [1e308, 1e308], micro_batches=4)


# ---------------------------------------------------------------------------- pipeline simulator


@pytest.mark.parametrize("kw, exc, match", [
    ({"forward": [float("nan"), 1.0]}, ap.AutoParallelError, "finite"),
    ({"forward": [float("inf"), 1.0]}, ap.AutoParallelError, "finite"),
    ({"backward": [1.0, float("-inf")]}, ap.AutoParallelError, "finite"),
    ({"forward": [10**400, 1.0]}, ap.AutoParallelError, "finite"),
    ({"forward": ["1", 1.0]}, ap.AutoParallelTypeError, "forward="),
    ({"sends": 5}, ap.AutoParallelTypeError, "sends=5"),
    ({"sync": 5}, ap.AutoParallelTypeError, "sync=5"),
    ({"sends": "a"}, ap.AutoParallelTypeError, "sends='a'"),
    ({"sends": [float("nan")]}, ap.AutoParallelError, "sends="),
    ({"sync": [1.0, float("inf")]}, ap.AutoParallelError, "sync="),
])
def test_pipeline_simulator_refuses_bad_times(kw, exc, match):
    from autopar.pipeline.simulation import simulate_schedule

    args = {"forward": [1.0, 1.0], "backward": [2.0, 2.0], **kw}
    with pytest.raises(exc, match=match):
        simulate_schedule(args.pop("forward"), args.pop("backward"), micro_batches=2, **args)


def test_pipeline_simulator_takes_any_sequence_and_empty_work():
    import numpy as np

    from autopar.pipeline.simulation import simulate_schedule

    t = simulate_schedule([1.0, 1.0], [2.0, 2.0], micro_batches=2, sends=np.array([0.5]),
                          sync=(np.float32(1.0), 0))
    assert t.iteration_time == t.makespan + 2 * 0.5 + 1.0  # the last tick's transfers, sync
    idle = simulate_schedule([0.0, 0.0], [0.0, 0.0], micro_batches=2)
    assert idle.bubble == 0.0 and idle.to_chrome_trace()["otherData"]["bubble"] == 0.0


def test_pipeline_simulator_refuses_plans_of_another_cluster():
    from autopar.pipeline.simulation import simulate_pipeline

    g = _trace(mlp(widths=(256, 1024, 1024, 256), batch=64))
    ap.set_auto_parallel_context(device_num=4, parallel_mode="auto_parallel")
    plan = ap.search(g, cluster="accelerator-8x")
    with pytest.raises(ap.AutoParallelError, match="cluster='cpu-emulated'.*accelerator-8x"):
        simulate_pipeline(g, 2, device_num=8, plans=[plan, plan], cluster="cpu-emulated")
    with pytest.raises(ap.AutoParallelTypeError, match=r"plans=.*\[1\]"):
        simulate_pipeline(g, 2, device_num=8, plans=[plan, "plan"])


@pytest.mark.parametrize("buckets", ["", "foo", "Context"])
def test_bucket_policy_names_are_checked_as_buckets(resnet, buckets):
    with pytest.raises(ap.AutoParallelError, match=f"buckets={buckets!r}.*'context', 'hccl'"):
        ap.simulation.simulate(resnet, device_num=8, buckets=buckets)
