"""Calibration: fits, the measured cluster, calibration files, which cluster prices a plan."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar import clusters
from autopar.calibration import CALIBRATION_VERSION, fit_alpha_beta, group_sizes
from autopar.clusters import ClusterFileError, load_cluster, resolve_cluster
from autopar.strategies.cost import CLUSTERS, Calibration, CollectiveFit, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.redistribution import Step


@settings(max_examples=40, deadline=None, derandomize=True)
@given(alpha=st.floats(1e-5, 1e-3), beta=st.floats(1e-11, 2e-9), seed=st.integers(0, 2 ** 16))
def test_fit_reproduces_synthetic_alpha_beta_within_5_percent(alpha, beta, seed):
    """Timings from a known alpha + beta * n with 2 % multiplicative noise, over the sizes a
    calibration measures: both figures come back within 5 %."""
    rng = np.random.default_rng(seed)
    sizes = np.array([2 ** 12, 2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24, 2 ** 25], dtype=float)
    t = (alpha + beta * sizes) * (1 + rng.uniform(-0.02, 0.02, sizes.size))
    a, b, resid = fit_alpha_beta(sizes, t)
    # each figure is judged where the timings show it: alpha at least half the smallest
    # message's time, beta at least half the largest's
    if alpha >= beta * sizes[0]:
        assert a == pytest.approx(alpha, rel=0.05)
    if beta * sizes[-1] >= alpha:
        assert b == pytest.approx(beta, rel=0.05)
    assert resid <= 0.05


def test_fit_refuses_one_sample():
    with pytest.raises(ap.AutoParallelError, match="samples"):
        fit_alpha_beta([1.0], [1.0])


def test_group_sizes_are_the_mesh_subset_products():
    assert group_sizes(8) == [2, 4, 8]
    assert group_sizes(12) == [2, 3, 4, 6, 12]
    assert group_sizes(1) == []


def _measured(**extra) -> ap.Cluster:
    fits = (CollectiveFit(kind="all_reduce", group=8, intra=True, alpha=1e-4, beta=2e-9,
                          residual=0.1, samples=5, knee=2.0 ** 20, beta_large=5e-9),
            CollectiveFit(kind="all_gather", group=2, intra=True, alpha=3e-5, beta=1e-9,
                          residual=0.1, samples=5))
    base = CLUSTERS["cpu-emulated"].model_dump()
    base.update(name="measured", collectives=fits, barrier=0.0)
    base.update(extra)
    return ap.Cluster.model_validate(base)


def test_cost_model_prices_with_the_fits():
    cm = CostModel(_measured())
    n = 3e6  # past the knee: the larger slope beyond it
    assert cm.collective_time("all_reduce", n, 8, intra=True) == pytest.approx(
        1e-4 + 2e-9 * 2 ** 20 + 5e-9 * (n - 2 ** 20))
    assert cm.collective_time("all_reduce", 1e5, 8, intra=True) == pytest.approx(
        1e-4 + 2e-9 * 1e5)
    # group 4 not measured: the nearest size's per-step latency and bandwidth, ring formula
    a2, b2 = 3e-5, 1e-9  # all_gather x2: 1 step, (2-1)/2 of n
    assert cm.collective_time("all_gather", n, 4, intra=True) == pytest.approx(
        a2 * 3 + b2 / 0.5 * 0.75 * n)
    # a kind never measured: the link figures of the cluster
    c = cm.cluster
    assert cm.collective_time("all_to_all", n, 8, intra=True) == pytest.approx(
        7 * c.intra_alpha + 7 / 8 * n / c.intra_bandwidth)


def test_shape_free_coefficients_agree_with_step_times():
    """One formula: coefficients(a + b * B) of shape-free steps equal the summed step times
    of the same steps with bytes, forward and backward (transposes priced as their kind)."""
    from autopar.strategies.layout import DeviceMesh

    mesh = DeviceMesh.for_devices(8)
    cm = CostModel(_measured())
    total = 1 << 23  # the all_reduce's share (2 MiB) lies past its knee
    steps = (Step("all_gather", ("a1", "a2"), 0, fraction=0.5),
             Step("all_reduce", ("a0", "a1", "a2"), fraction=0.25))
    with_bytes = tuple(Step(s.kind, s.axes, s.dim, s.src_dim, int(s.fraction * total),
                            s.fraction) for s in steps)
    for backward in (False, True):
        coef = cm.coefficients(steps, mesh, backward=backward)
        assert cm.steps_seconds(coef, total) == pytest.approx(
            cm.steps_time(with_bytes, mesh, backward=backward))


def test_update_and_launch_are_priced():
    """The optimizer update of a replicated parameter costs every device a full pass; the
    step's launch is counted once."""
    import jax.numpy as jnp

    g = ap.trace(lambda p, x: jnp.sum((x @ p["w"]) ** 2), {"w": jnp.ones((64, 64))},
                 jnp.ones((16, 64)))
    clus = _measured(step_overhead=1e-3)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        dp = ap.search(g, cluster=clus)
    cm = CostModel(clus)
    nb = 64 * 64 * 4
    # data parallel: w replicated, its update a full 7 passes on every device
    assert dp.cost.compute >= 1e-3 + cm.update_time(nb)


# ---------------------------------------------------------------------------- files


def test_calibration_file_round_trips_byte_identically(tmp_path):
    c = _measured(calibration=None)
    p1 = ap.clusters.save_cluster(c, tmp_path / "a.json")
    back = load_cluster(p1)
    assert back == c
    p2 = ap.clusters.save_cluster(back, tmp_path / "b.json")
    assert p1.read_bytes() == p2.read_bytes()


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t[: len(t) // 2], "<json>"),
    (lambda t: t.replace('"version": 1', '"version": "1"'), "version"),
    (lambda t: t.replace('"format": "autopar-cluster"', '"format": "x"'), "format"),
    (lambda t: t.replace('"alpha": 0.0001', '"alpha": -1.0'), "cluster.collectives.0.alpha"),
    (lambda t: t.replace('"name": "measured"', '"name": "measured", "extra": 1'),
     "cluster.extra"),
    (lambda t: "[" * 100000, "<json>"),
    # figures that made prices infinite (a search's "inf ms", NaN in traces) or overflowed
    (lambda t: t.replace('"peak_flops": 4000000000.0', '"peak_flops": 5e-324'),
     "cluster.peak_flops"),
    (lambda t: t.replace('"alpha": 0.0001', '"alpha": 1e308'), "cluster.collectives.0.alpha"),
    (lambda t: t.replace('"group": 8', '"group": 1' + "0" * 400), "cluster.collectives.0.group"),
    (lambda t: t.replace('"name": "measured"', '"name": "\\u001b[31m"'), "cluster.name"),
    (lambda t: t.replace('"cluster": {', '"cluster_": {'), "cluster_"),
])
def test_corrupt_calibration_file_names_the_file_and_field(tmp_path, mutate, field):
    path = ap.clusters.save_cluster(_measured(), tmp_path / "c.json")
    path.write_text(mutate(path.read_text()))
    with pytest.raises(ClusterFileError) as info:
        load_cluster(path)
    assert str(path) in str(info.value) and info.value.field == field


def test_a_file_without_the_cluster_says_it_is_missing(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"format": "autopar-cluster", "version": 1}')
    with pytest.raises(ClusterFileError, match="<missing>") as info:
        load_cluster(path)
    assert info.value.field == "cluster"


@pytest.mark.parametrize("call, key", [
    (lambda: ap.calibrate(2, budget_s=10 ** 400, cache=False), "budget_s"),
    (lambda: ap.calibrate([jax.devices()[0]] * 2, budget_s=1, cache=False), "devices"),
    (lambda: ap.clusters.describe_cluster("x"), "cluster"),
    (lambda: ap.clusters.dumps_cluster(None), "cluster"),
])
def test_bad_calibration_arguments_are_typed_errors(call, key):
    with pytest.raises(ap.AutoparError) as info:
        call()
    assert info.value.key == key


def test_a_bad_cluster_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CLUSTER", "bogus")
    with pytest.raises(ap.AutoParallelError, match="AUTOPAR_CLUSTER='bogus'"):
        ap.clusters.resolve_cluster()


@pytest.mark.parametrize("bad, error, key", [
    ({"peak_flops": "1"}, ap.AutoParallelTypeError, "Cluster.peak_flops"),
    ({"devices_per_node": True}, ap.AutoParallelTypeError, "Cluster.devices_per_node"),
    ({"peak_flops": 0.5}, ap.AutoParallelError, "Cluster.peak_flops"),
    ({"inter_alpha": float("inf")}, ap.AutoParallelError, "Cluster.inter_alpha"),
    ({"collectives": ({"kind": "all_reduce", "group": 1, "intra": True, "alpha": 0.0,
                       "beta": 0.0, "residual": 0.0, "samples": 2},)},
     ap.AutoParallelError, "Cluster.collectives.0.group"),
])
def test_a_cluster_written_in_code_gets_typed_errors(bad, error, key):
    """ap.Cluster(...) with a bad figure names the field (was pydantic's ValidationError)."""
    base = ap.CLUSTERS["accelerator-8x"].model_dump()
    with pytest.raises(error) as info:
        ap.Cluster(**{**base, **bad})
    assert info.value.key == key and type(info.value).__module__ == "autopar.errors"
    with pytest.raises(ap.UnknownKeyError, match="'colour' is not a field of Cluster"):
        ap.Cluster(**base, colour=1)


def test_calibration_file_special_and_missing_paths(tmp_path):
    with pytest.raises(ClusterFileError, match="regular file"):
        load_cluster(tmp_path)
    with pytest.raises(ClusterFileError, match="missing"):
        load_cluster(tmp_path / "none.json")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ClusterFileError, match="regular file"):
        load_cluster(fifo)
    with pytest.raises(ap.AutoParallelError, match="regular file"):
        ap.clusters.save_cluster(_measured(), fifo)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (clusters.MAX_FILE_BYTES + 1))
    with pytest.raises(ClusterFileError, match="at most"):
        load_cluster(big)


# ---------------------------------------------------------------------------- resolution


@pytest.fixture
def unpinned(monkeypatch, tmp_path):
    """The default resolution as a user meets it: no pin, an empty cache of our own."""
    monkeypatch.delenv(clusters.CLUSTER_ENV, raising=False)
    monkeypatch.setenv(clusters.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(clusters, "_noticed", set())
    return tmp_path / "cache"


def test_cpu_devices_default_to_the_cpu_preset_with_one_notice(unpinned, capsys):
    assert resolve_cluster(None).name == "cpu-emulated"
    assert resolve_cluster(None).name == "cpu-emulated"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'cpu-emulated' preset" in err and "autopar calibrate" in err


def test_the_barrier_prices_collectives_in_a_program_not_a_steps_gradient_sync():
    cm, plain, mesh = CostModel(_measured(barrier=2e-4)), CostModel(_measured()), \
        DeviceMesh.for_devices(8)
    for kind, p in (("all_reduce", 8), ("all_gather", 2), ("reduce_scatter", 4)):
        assert cm.alpha_beta(kind, p, True)[0] == pytest.approx(
            plain.alpha_beta(kind, p, True)[0] + 2e-4)
    axes = mesh.names
    assert cm.all_reduce_time(1e5, axes, mesh) == pytest.approx(
        plain.all_reduce_time(1e5, axes, mesh) + 2e-4)
    # XLA merges a step's gradient all-reduces into one: no barrier per parameter
    assert cm.gradient_sync_time(1e5, axes, mesh) == pytest.approx(
        plain.all_reduce_time(1e5, axes, mesh))
    assert cm.gradient_sync_time(1e5, (), mesh) == 0.0


def _calibrated(version: int = CALIBRATION_VERSION, **record) -> ap.Cluster:
    """``_measured()`` with a calibration record (this host and JAX unless ``record`` says)."""
    import jax

    from autopar.calibration import host_identity

    fields = dict(version=version, platform="cpu", device_kind="cpu", device_count=8,
                  process_count=1, jax_version=jax.__version__, host=host_identity(),
                  matmul_residual=0.0, memory_residual=0.0, shared_compute=4.0, seconds=1.0)
    return _measured(calibration=Calibration(**(fields | record)))


def test_a_cached_calibration_is_the_default(unpinned, capsys):
    import jax

    clusters.store_calibration(_calibrated(), jax.devices())
    assert resolve_cluster(None) == _calibrated()
    assert "calibration of these 8 cpu device(s)" in capsys.readouterr().err
    # a cache file that cannot be read counts as none
    next(unpinned.iterdir()).write_text("{")
    assert resolve_cluster(None).name == "cpu-emulated"
    # so does one an older calibration wrote (it lacks figures the model now prices), one
    # of another JAX, and a cluster with no calibration record
    for stale in (_calibrated(CALIBRATION_VERSION - 1), _calibrated(jax_version="0.0.1"),
                  _measured()):
        clusters.store_calibration(stale, jax.devices())
        assert resolve_cluster(None).name == "cpu-emulated"
    clusters.store_calibration(_calibrated(), jax.devices())
    assert resolve_cluster(None) == _calibrated()


def test_fresh_measures_again_and_replaces_the_cached_one(unpinned, monkeypatch):
    import jax

    clusters.store_calibration(_calibrated(), jax.devices())
    remeasured = _calibrated(seconds=2.0)
    monkeypatch.setattr(clusters, "measure", lambda devs, **kw: remeasured)
    assert ap.calibrate() == _calibrated()  # cached: nothing measured
    assert ap.calibrate(fresh=True) == remeasured
    assert ap.calibrate() == remeasured  # it replaced the cached one
    with pytest.raises(ap.AutoParallelTypeError, match="fresh"):
        ap.calibrate(fresh="yes")


def test_every_process_of_a_job_must_hold_devices_it_calibrates(monkeypatch):
    """Under jax.distributed every process measures together (tests/test_multiprocess.py);
    devices some process holds none of are refused before anything is measured."""
    import jax

    from autopar import calibration

    monkeypatch.setattr(calibration, "several", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ap.AutoParallelError, match="every one of the 2 processes measures"):
        calibration.measure(jax.devices()[:2], budget_s=1, progress=False)


def test_the_cache_keeps_one_calibration_per_host(unpinned, monkeypatch, capsys):
    """A calibration measured on another machine (a shared home, a copied cache) is never
    taken for this one's: another host's file is another cache entry, and a file that says
    another host is measured again."""
    import jax

    clusters.store_calibration(_calibrated(), jax.devices())
    here = clusters._cache_path(jax.devices())
    monkeypatch.setattr(clusters, "host_identity", lambda: "Other CPU (arm64), 64 CPUs, 512 GiB")
    assert clusters._cache_path(jax.devices()) != here
    assert clusters.cached_calibration(jax.devices()) is None
    # the other host's name on this host's file: still not this host's calibration
    here.rename(clusters._cache_path(jax.devices()))
    assert clusters.cached_calibration(jax.devices()) is None
    assert resolve_cluster(None).name == "cpu-emulated"


def test_a_calibration_of_another_host_is_used_with_a_notice(unpinned, tmp_path, capsys):
    mine = ap.clusters.save_cluster(_calibrated(), tmp_path / "mine.json")
    theirs = ap.clusters.save_cluster(_calibrated(host="Big GPU host (x86_64), 96 CPUs, "
                                                  "1024 GiB"), tmp_path / "theirs.json")
    assert resolve_cluster(str(mine)).name == "measured"
    assert capsys.readouterr().err == ""
    for form in (str(theirs), theirs, ap.clusters.load_cluster(theirs)):
        assert resolve_cluster(form).calibration.host.startswith("Big GPU host")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured on another host (Big GPU host" in err
    assert "autopar calibrate" in err


def test_plans_for_more_devices_than_calibrated_say_so(unpinned, tmp_path, capsys):
    """Collectives over more devices than a calibration measured are extrapolated."""
    import jax.numpy as jnp

    four = ap.clusters.save_cluster(_calibrated(device_count=4), tmp_path / "four.json")
    g = ap.trace(lambda w, x: jnp.sum(x @ w), jnp.ones((8, 8)), jnp.ones((16, 8)))
    with ap.auto_parallel_context(device_num=4, parallel_mode="auto_parallel"):
        ap.search(g, cluster=four)
    assert capsys.readouterr().err == ""
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        ap.search(g, cluster=four)
        ap.search(g, cluster=four)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pricing 8-device plans on measured, measured on 4 " in err
    assert "autopar calibrate --devices 8" in err


def test_env_pin_and_explicit_forms(unpinned, tmp_path, monkeypatch, capsys):
    path = ap.clusters.save_cluster(_measured(), tmp_path / "mine.json")
    monkeypatch.setenv(clusters.CLUSTER_ENV, str(path))
    assert resolve_cluster(None).name == "measured"
    assert resolve_cluster("accelerator-8x").name == "accelerator-8x"
    assert resolve_cluster(path).name == "measured"
    assert capsys.readouterr().err == ""  # a named cluster needs no notice
    with pytest.raises(ap.AutoParallelError, match="'calibrated'"):
        resolve_cluster("tpu-pod")
    with pytest.raises(ap.AutoParallelTypeError, match="got int"):
        resolve_cluster(3)


def test_plan_records_and_file_carries_the_cluster(tmp_path):
    import jax.numpy as jnp

    g = ap.trace(lambda p, x: jnp.sum((x @ p["w"]) ** 2), {"w": jnp.ones((64, 64))},
                 jnp.ones((16, 64)))
    path = ap.clusters.save_cluster(_measured(), tmp_path / "mine.json")
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        plan = ap.search(g, cluster=str(path))
    assert plan.cluster == "measured"
    doc = json.loads(ap.save_strategy(plan, g, tmp_path / "s.json").read_text())
    assert [f["kind"] for f in doc["cluster"]["collectives"]] == ["all_reduce", "all_gather"]
    # priced on the file's own cluster
    again = ap.load_strategy(tmp_path / "s.json", g, device_num=8)
    assert again.cost.total == pytest.approx(plan.cost.total)


# ---------------------------------------------------------------------------- measuring


def test_calibrate_two_devices_measures_fits_and_caches(unpinned):
    c = ap.calibrate(2, budget_s=2, progress=False, max_message_bytes=2 ** 16)
    assert c.calibration is not None and c.calibration.device_count == 2
    assert c.name == "calibrated-cpu-2" and c.devices_per_node == 2
    assert sorted(f.kind for f in c.collectives) == sorted(
        ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute"])
    assert all(f.group == 2 and f.samples >= 2 for f in c.collectives)
    assert c.peak_flops > 0 and math.isfinite(c.memory_bandwidth) and 0 <= c.overlap <= 1
    assert sorted(c.peak_flops_by_dtype) == ["bfloat16", "float16"]
    assert all(v > 0 for v in c.peak_flops_by_dtype.values())
    assert ap.calibrate(2) == c  # the cache: the same figures, nothing measured
    assert len(list(unpinned.iterdir())) == 1
    with pytest.raises(ap.AutoParallelError, match="budget_s"):
        ap.calibrate(2, budget_s=0)
    with pytest.raises(ap.AutoParallelError, match="devices"):
        ap.calibrate(99)
    with pytest.raises(ap.AutoParallelError, match="max_message_bytes"):
        ap.calibrate(2, cache=False, max_message_bytes=10)
    for bad in (dict(budget_s="60"), dict(max_message_bytes=2.0 ** 16)):  # types: TypeError
        with pytest.raises(ap.AutoParallelTypeError, match=next(iter(bad))):
            ap.calibrate(2, cache=False, **bad)


def test_a_collective_in_a_step_is_priced_on_the_line_beyond_its_fit():
    """A collective measured in a step-like program cost 0.45-1.7 ms more than its chained
    fit (more with larger messages); the barrier and barrier_per_byte are the line through
    the two sizes' excess, and price every collective but a step's gradient sync."""
    from autopar import calibration

    barrier, per_byte = calibration.in_step_line([2**18, 2**21], [9e-4, 4.4e-3], [3e-4, 1e-3])
    assert barrier == pytest.approx(6e-4 - 2**18 * per_byte)
    assert per_byte == pytest.approx((3.4e-3 - 6e-4) / (2**21 - 2**18))
    # measured below the fit: nothing added, never a negative price
    assert calibration.in_step_line([2**18, 2**21], [1e-4, 2e-4], [3e-4, 1e-3]) == \
        pytest.approx((0.0, 0.0), abs=1e-8)
    cm = CostModel(_measured(barrier=barrier, barrier_per_byte=per_byte))
    plain, mesh = CostModel(_measured()), DeviceMesh.for_devices(8)
    n, axes = 2**20, ("a0", "a1", "a2")
    step = cm.collective_time("all_gather", n, 8, intra=True)
    assert step - plain.collective_time("all_gather", n, 8, intra=True) == \
        pytest.approx(barrier + per_byte * n)
    assert cm.gradient_sync_time(n, axes, mesh) == pytest.approx(
        plain.gradient_sync_time(n, axes, mesh))

def test_iteration_trace_agrees_with_the_plan():
    """Priced by the same rules: without overlap and with one all-reduce per gradient, the
    simulated iteration is the plan's predicted step (launch, operators, communication,
    gradient sync, update)."""
    from autopar.models import mlp

    m = mlp(widths=(64, 256, 64), batch=32)
    g = ap.trace(m.loss, *m.example_args(__import__("jax").random.key(0)))
    clus = _measured(step_overhead=2e-4, op_overhead=5e-6)
    for pmode in ("data_parallel", "auto_parallel"):
        with ap.auto_parallel_context(device_num=8, parallel_mode=pmode):
            plan = ap.search(g, cluster=clus)
        t = ap.simulation.simulate(g, plan, buckets="none", overlap=False)
        assert t.cluster == "measured"  # the plan's own cluster
        assert t.step_time == pytest.approx(plan.cost.total, rel=1e-9), pmode


def test_ring_kernels_follow_the_measured_overlap():
    """The rewrite decides fused rings on the plan's own cluster: with the overlap a
    calibration of emulated devices measures (0) "auto" never fuses, with the same figures
    and full overlap it does where the accelerator preset does."""
    import jax.numpy as jnp

    def f(w1, w2, x):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2)

    g = ap.trace(f, jnp.ones((32, 64)), jnp.ones((64, 32)), jnp.ones((16, 32)))
    d0, d1 = (n.name for n in g.nodes if n.op == "dot_general")
    fixed = {d0: ((1, 1), (1, 4)), d1: ((1, 4), (4, 1)), g.nodes[-1].name: ((4, 1),)}
    acc = CLUSTERS["accelerator-8x"]
    fused = {}
    for overlap in (0.0, 1.0):
        clus = acc.model_copy(update={"name": f"overlap-{overlap}", "overlap": overlap})
        with ap.auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel"):
            plan = ap.search(g, fixed=fixed, cluster=clus)
        fused[overlap] = len(ap.rewrite.rewrite(g, plan, fused_kernels="auto").fused_nodes())
    assert fused == {0.0: 0, 1.0: 2}


def test_an_unwritable_cache_still_returns_the_calibration(tmp_path, monkeypatch):
    """A cache that cannot be written keeps nothing and raises nothing: the calibration is
    still the caller's (its directory under a regular file; its file's name taken by a
    directory)."""
    import jax

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(clusters.CACHE_ENV, str(blocker / "cache"))
    assert clusters.store_calibration(_measured(), jax.devices()) is None
    monkeypatch.setenv(clusters.CACHE_ENV, str(tmp_path / "cache"))
    clusters._cache_path(jax.devices()).mkdir(parents=True)
    assert clusters.store_calibration(_measured(), jax.devices()) is None
    assert clusters.cached_calibration(jax.devices()) is None


@pytest.mark.parametrize(("rate", "room", "largest"), [
    (1e15, 1e12, 8192),   # an accelerator: doubles until a product takes a millisecond
    (1e15, 2e9, 4096),    # ... or its operands would not fit a quarter of the memory
    (3e10, 1e12, 512),    # a CPU: the fixed sizes already take milliseconds
])
def test_the_matmul_ladder_grows_past_launch_bound_sizes(monkeypatch, rate, room, largest):
    from autopar import calibration as cal

    monkeypatch.setattr(cal, "_chain", lambda *a: None)
    monkeypatch.setattr(cal, "_operands", lambda mesh, spec, m, dtype: m)
    monkeypatch.setattr(cal, "_per_op", lambda s, l, m, k, limit: 2.0 * m ** 3 / rate + 5e-6)
    flops, seconds = cal._matmul_ladder(None, None, "bfloat16", 1.0, room)
    sizes = [round((f / 2) ** (1 / 3)) for f in flops]
    assert sizes[:4] == list(cal.MATMUL_SIZES) and sizes[-1] == largest
    assert sizes == [64 * 2 ** i for i in range(len(sizes))]
    assert cal.line_residual(flops, seconds, 5e-6, rate) < 1e-9


def test_the_peak_is_a_chain_of_at_least_the_sustain_time(monkeypatch):
    from autopar import calibration as cal

    chains = []
    monkeypatch.setattr(cal, "_chain", lambda mesh, body, spec, k: chains.append(k) or k)
    monkeypatch.setattr(cal, "_operands", lambda mesh, spec, m, dtype: m)
    monkeypatch.setattr(cal, "_per_op", lambda s, l, m, k, limit: 2.0 * m ** 3 / 7e14)
    peak = cal._sustained_peak(None, None, "bfloat16", 2.0 * 8192 ** 3, 1.4e-3, 1.0)
    assert chains == [1, math.ceil(cal._SUSTAIN_S / 1.4e-3)] and chains[1] * 1.4e-3 >= 0.05
    assert peak == pytest.approx(7e14)


def test_the_bandwidth_ladder_grows_until_calls_are_long(monkeypatch):
    from autopar import calibration as cal

    monkeypatch.setattr(cal, "_chain", lambda *a: None)
    monkeypatch.setattr(cal, "_placed", lambda mesh, spec, n: n)
    calls = []

    def per_call(f, n, limit):
        calls.append(n * 4)
        return 85e-6 + 2 * n * 4 / 4e12  # dispatch + read and write at 4 TB/s

    monkeypatch.setattr(cal, "_per_call", per_call)
    bandwidth, _ = cal._bandwidth(None, None, 1.0, 1e12)
    assert calls[:3] == list(cal.ELEMENTWISE_BYTES) and calls[-1] == 2 ** 32
    assert bandwidth == pytest.approx(4e12, rel=0.02)


@pytest.mark.parametrize(("platform", "kind", "preset"), [
    ("gpu", "NVIDIA H100 80GB HBM3", "dgx-h100-80gb"), ("gpu", "NVIDIA H200", "dgx-h100-80gb"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "dgx-a100-80gb"), ("gpu", "Tesla T4", "accelerator-8x"),
    ("cpu", "cpu", "cpu-emulated")])
def test_uncalibrated_devices_are_priced_on_their_kinds_preset(platform, kind, preset):
    from autopar.clusters import default_preset

    assert default_preset(platform, kind) == preset
