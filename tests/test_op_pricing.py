"""Operators priced from split counts (strategies/op_pricing.py) are bit for bit the prices
through the strategy's layouts and operator_time, the rule the simulators share."""

from __future__ import annotations


import jax
import pytest

import autopar as ap
from autopar.models import mlp, resnet50, tfm_stack, transformer
from autopar.strategies.cost import BACKWARD_FACTOR, CLUSTERS, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.problem import Problem, enumerate_splits, operator_time

_GRAPHS: dict[str, ap.Graph] = {}


def _graph(name: str) -> ap.Graph:
    if name not in _GRAPHS:
        m = {"gpt": lambda: transformer(layers=2, hidden=64, heads=4, seq=16, vocab=128,
                                        batch=4),
             "stack": lambda: tfm_stack(blocks=2, batch=4, seq=8, hidden=32, heads=4),
             "mlp": lambda: mlp(widths=(64, 256, 64), batch=16),
             "resnet": lambda: resnet50(batch=4, image_size=32, num_classes=10)}[name]()
        _GRAPHS[name] = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    return _GRAPHS[name]


def _reference(problem: Problem, node, choice) -> tuple[float, float, float, float]:
    """The operator price as first written: through the choice's layouts."""
    g, mesh, cm = problem.graph, problem.mesh, problem.cm
    grad = any(problem.requires_grad[v] for v in node.inputs)
    compute = operator_time(cm, g, node, choice.splits, choice.in_layouts, choice.out_layouts,
                            mesh, problem.fused) * (1.0 + BACKWARD_FACTOR if grad else 1.0)
    comm = sync = 0.0
    for v, lay in zip(node.inputs, choice.in_layouts):
        if not problem.requires_grad[v]:
            continue
        missing = [a for a in mesh.names if a in choice.used_axes and a not in lay.used_axes()]
        if not missing:
            continue
        nbytes = problem._local_bytes(v, lay)
        if v in problem.param_like:  # a parameter, or computed from parameters alone
            sync += cm.gradient_sync_time(nbytes, missing, mesh)
        else:
            comm += cm.all_reduce_time(nbytes, missing, mesh)
    memory = float(sum(problem._local_bytes(v, lay) for v, lay in zip(node.outputs,
                                                                      choice.out_layouts)
                       if v in problem.residuals.kept_outputs))  # what backward reads
    return compute, comm, sync, memory


@pytest.mark.parametrize("name", ["gpt", "stack", "mlp", "resnet"])
@pytest.mark.parametrize("devices,cluster", [(8, "accelerator-8x"), (12, "accelerator-8x"),
                                             (64, "accelerator-8x"), (8, "cpu-emulated")])
def test_split_prices_equal_the_layouts_prices(name, devices, cluster):
    g = _graph(name)
    problem = Problem(g, DeviceMesh.for_devices(devices), CostModel(CLUSTERS[cluster]),
                      lazy=True)
    seen = set()
    checked = 0
    for node in g.nodes:
        if problem._sig[node.name] in seen:
            continue
        seen.add(problem._sig[node.name])
        for splits in enumerate_splits(problem.specs[node.name], devices, False):
            choice = problem.op_choice(node, splits)
            assert problem.op_costs(node, choice) == _reference(problem, node, choice), \
                (node.name, splits)
            # the optimizer update of the parameters it reads, in the blocks it reads them in
            pricer = problem._op_pricer
            recipe = pricer.recipe(problem._sig[node.name], node)
            want = sum(problem.param_update(v, lay) for v, lay in zip(node.inputs,
                                                                       choice.in_layouts)
                       if g.values[v].kind == "param")
            assert pricer.update(recipe, splits) == want
            checked += 1
    assert checked > len(seen)


def test_missing_axes_follow_the_mesh_order():
    g = _graph("mlp")
    problem = Problem(g, DeviceMesh.for_devices(8), CostModel(CLUSTERS["accelerator-8x"]),
                      lazy=True)
    splits = (2, 4, 1)  # canonical axes (("a0",), ("a1", "a2"), ())
    assert problem._op_pricer.missing(splits, frozenset({0})) == ("a1", "a2")
    assert problem._op_pricer.missing(splits, frozenset({1})) == ("a0",)
    assert problem._op_pricer.missing(splits, frozenset({0, 1})) == ()
