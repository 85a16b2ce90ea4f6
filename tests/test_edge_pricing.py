"""The search's vectorised redistribution pricing equals the planner's, bit for bit.

``strategies/edge_pricing.py`` plans every layout pair of an edge at once (numpy) and prices
the steps as it goes, without building them. Its latency, per-byte and knee coefficients
must be exactly those of ``plan_steps`` + ``CostModel.coefficients`` (the plans of the search
must not move), on random pairs of random layouts (8 / 64 / 512 devices and meshes with
axes of size 3, gradients or not, all_to_all or not, clusters with and without measured
knees) and on the edges of real search problems.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar as ap
from autopar.errors import AutoParallelError
from autopar.models import tfm_stack, transformer
from autopar.strategies.cost import CLUSTERS, Cluster, CollectiveFit, CostModel
from autopar.strategies.edge_pricing import EdgePricer
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.problem import Problem
from autopar.strategies.redistribution import plan_steps
from layouts import draw_layout


def _kneed() -> Cluster:
    """A measured cluster whose collectives have knees a few bytes in: knee terms in most
    pairs (and fits at other group sizes scaled to the asked one)."""
    fits = tuple(CollectiveFit(kind=k, group=g, intra=intra, alpha=1e-5 * g, beta=1e-10 * g,
                               residual=0.1, samples=5, knee=64.0 * g, beta_large=3e-10 * g)
                 for k in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
                 for g in (2, 4) for intra in (True, False))
    base = CLUSTERS["accelerator-8x"].model_dump()
    base.update(name="kneed", collectives=fits)
    return Cluster.model_validate(base)


_CLUSTERS = {**CLUSTERS, "kneed": _kneed()}


@st.composite
def edges(draw):
    """A mesh and an edge's lists of sources and targets (repeats allowed): any axes on any
    dims in any order; sources with partial sums, targets keeping some of those every
    source has (sometimes one only some have: the planner refuses those pairs)."""
    mesh = DeviceMesh.for_devices(draw(st.sampled_from([8, 8, 12, 24, 64, 64, 512, 512])))
    rank = draw(st.integers(0, 4))

    def one(partial_from: tuple[str, ...] | None) -> TensorLayout:
        return draw_layout(draw, mesh, rank, partial_from)

    pool = [one(None) for _ in range(draw(st.integers(1, 5)))]
    common = tuple(a for a in pool[0].partial if all(a in s.partial for s in pool))
    allowed = pool[0].partial if draw(st.integers(0, 9)) == 0 else common
    dsts = [one(allowed) for _ in range(draw(st.integers(1, 5)))]
    dsts += draw(st.lists(st.sampled_from(pool), max_size=2))  # a source as a target
    srcs = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=7))
    return mesh, srcs, dsts


def _planned(cm: CostModel, src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh, alltoall: bool,
             grad: bool) -> tuple | None:
    """The planner's coefficients of one pair (None where it refuses the pair)."""
    try:
        return cm.coefficients(plan_steps(src, dst, mesh, alltoall), mesh, backward=grad)
    except AutoParallelError:
        return None


def _terms(coef, i: int, j: int, nd: int) -> tuple:
    """The knee terms of entry (i, j) of :meth:`EdgePricer.coefficients`, in order."""
    at = i * nd + j
    return tuple((float(frac[k]), float(knee[k]), float(extra[k]))
                 for idx, frac, knee, extra in coef[2]
                 for k in np.flatnonzero(idx == at))


@settings(max_examples=400, deadline=None)
@given(edges(), st.sampled_from(sorted(_CLUSTERS)), st.booleans(), st.booleans())
def test_edge_coefficients_equal_the_planners(case, cluster, grad, alltoall):
    mesh, srcs, dsts = case
    cm = CostModel(_CLUSTERS[cluster])
    want = {(s, t): _planned(cm, s, t, mesh, alltoall, grad) for s in srcs for t in dsts}
    coef = EdgePricer(mesh, cm, alltoall).coefficients(srcs, dsts, grad)
    if coef is None:  # only when some pair cannot be planned: priced pair by pair
        assert None in want.values()
        return
    lat, per_byte, _ = coef
    nbytes = 3 * 2**20 + 7
    seconds = EdgePricer.seconds(coef, nbytes)
    for i, s in enumerate(srcs):
        for j, t in enumerate(dsts):
            got = (float(lat[i, j]), float(per_byte[i, j]), _terms(coef, i, j, len(dsts)))
            assert got == want[s, t], (str(s), str(t))
            assert seconds[i, j] == CostModel.steps_seconds(want[s, t], nbytes)


def test_layouts_the_planner_does_not_take_are_priced_pair_by_pair():
    mesh = DeviceMesh.for_devices(8)
    pricer = EdgePricer(mesh, CostModel(CLUSTERS["accelerator-8x"]), False)
    twice = TensorLayout((("a0",), ("a0",)))
    fine = TensorLayout((("a0",), ()))
    assert pricer.coefficients([twice, fine], [fine], True) is None
    creates = TensorLayout(((), ()), ("a1",))  # a target cannot create a partial sum
    assert pricer.coefficients([fine], [creates], False) is None
    assert pricer.coefficients([fine], [fine, TensorLayout(((), ("a1",)))], False) is not None


@pytest.mark.parametrize("model,devices,alltoall", [
    ("tfm_stack", 8, False), ("tfm_stack", 8, True), ("transformer", 64, False)])
def test_search_matrices_equal_pair_by_pair(model, devices, alltoall):
    """Every edge matrix the search builds equals its entries priced one by one."""
    m = (tfm_stack(blocks=1, batch=4, seq=16, hidden=64, heads=4) if model == "tfm_stack"
         else transformer(layers=1, hidden=64, heads=4, seq=16, vocab=128, batch=8))
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    mesh = DeviceMesh.for_devices(devices)
    problem = Problem(g, mesh, CostModel(CLUSTERS["accelerator-8x"]),
                      enable_alltoall=alltoall)
    batched = 0
    for e in problem.edges:
        cu, cv = problem.vertices[e.u].choices, problem.vertices[e.v].choices
        batched += len(cu) * len(cv) >= EdgePricer.MIN_PAIRS
        one_by_one = np.array([[problem.edge_cost(e.value, a.out_layouts[e.out_index],
                                                  b.in_layouts[e.in_index]) for b in cv]
                               for a in cu]).reshape(len(cu), len(cv))
        assert np.array_equal(e.matrix, one_by_one), e.value
    assert batched


@settings(max_examples=400, deadline=None)
@given(edges(), st.sampled_from(sorted(_CLUSTERS)), st.booleans(), st.booleans())
def test_one_pair_coefficients_equal_the_planners(case, cluster, grad, alltoall):
    """The one-pair path (:meth:`EdgePricer.pair`, the planner on Python ints, which prices
    small edges) gives the planner's coefficients bit for bit, and None exactly where the
    planner raises; :meth:`EdgePricer.small` gives ``Problem.edge_cost``'s seconds."""
    mesh, srcs, dsts = case
    cm = CostModel(_CLUSTERS[cluster])
    pricer = EdgePricer(mesh, cm, alltoall)
    want = {}
    for s in srcs:
        for t in dsts:
            want[s, t] = _planned(cm, s, t, mesh, alltoall, grad)
            assert pricer.pair(s, t, grad) == want[s, t], (str(s), str(t))
    nbytes = 3 * 2**20 + 7
    if None in [want[s, t] for s in srcs for t in dsts if s != t]:
        with pytest.raises(AutoParallelError):
            pricer.small(srcs, dsts, grad, nbytes)
        return
    seconds = pricer.small(srcs, dsts, grad, nbytes)
    assert seconds.shape == (len(srcs), len(dsts))
    for i, s in enumerate(srcs):
        for j, t in enumerate(dsts):
            assert seconds[i, j] == (0.0 if s == t else
                                     CostModel.steps_seconds(want[s, t], nbytes))


def test_layouts_the_codes_do_not_take_are_refused():
    """A layout using an axis twice has no code: the planner refuses it, in ``plan_steps``
    as on the one-pair path (which has no answer for it and lets ``plan_steps`` say why)."""
    mesh = DeviceMesh.for_devices(8)
    cm = CostModel(CLUSTERS["accelerator-8x"])
    pricer = EdgePricer(mesh, cm, False)
    twice, fine = TensorLayout((("a0",), ("a0",))), TensorLayout((("a0",), ()))
    assert pricer.pair(twice, fine, True) is None
    for price in (lambda: plan_steps(twice, fine, mesh, False),
                  lambda: pricer.coef(twice, fine, True),
                  lambda: pricer.small([twice, fine], [fine], True, 1e6)):
        with pytest.raises(AutoParallelError, match="at most one dim"):
            price()
    with pytest.raises(AutoParallelError):  # a target creating a partial sum
        pricer.small([fine], [TensorLayout(((), ()), ("a1",))], False, 1e6)


def test_searches_on_one_mesh_and_cluster_share_a_pricer_and_plan_as_alone():
    """A second search on the same mesh and cluster reuses the first's edge pricer (its
    coefficients do not depend on shapes) and finds the plan a fresh pricer finds."""
    import autopar as ap
    from autopar.models import transformer
    from autopar.strategies import search as search_mod

    m = transformer(layers=2, hidden=32, heads=4, seq=16, vocab=64, batch=8)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    clus = ap.CLUSTERS["accelerator-8x"]
    search_mod._PRICERS.clear()
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        first = ap.search(g, cluster=clus)
        (mesh, _, _, pricer), = search_mod._PRICERS
        again = ap.search(g, cluster=clus.model_copy())
        assert search_mod._PRICERS[-1][3] is pricer and len(search_mod._PRICERS) == 1
        search_mod._PRICERS.clear()
        fresh = ap.search(g, cluster=clus)
        ap.search(g, device_num=4, cluster=clus)  # another mesh: another pricer
    assert mesh.device_num == 8 and first.cost.communication + first.cost.redistribution > 0
    assert first.decisions() == again.decisions() == fresh.decisions()
    assert first.cost == again.cost == fresh.cost
    assert len(search_mod._PRICERS) == 2 and search_mod._PRICERS[-1][0] != mesh
