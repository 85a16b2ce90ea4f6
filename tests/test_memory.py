"""The memory a training step holds at its peak (strategies/memory.py): what backward reads
per operator kind, the ordered peak against a hand computation, the peak against XLA's
compiled programs, and the search's memory budget on that figure."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar as ap
from autopar.graph.ops import OPERATORS
from autopar.graph.residuals import ELEMENTWISE_RESIDUALS, RESIDUALS, kept
from autopar.models import mlp, tfm_stack
from autopar.strategies.cost import CLUSTERS, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.memory import Residuals
from autopar.strategies.problem import Problem, fused_values, parameter_values, requires_grad

KEY = jax.random.key(0)


def _residuals(f, *args) -> tuple[ap.Graph, Residuals]:
    g = ap.trace(f, *args)
    return g, Residuals(g, requires_grad(g), fused_values(g), None, parameter_values(g))


def _kept(g: ap.Graph, res: Residuals) -> list[str]:
    """The activations some backward reads, as their producers' ops (sorted)."""
    return sorted({v for refs in res.refs.values() for v, _, _ in refs
                   if g.values[v].kind == "activation"}, key=lambda v: g.producer(v).op)


def test_every_operator_kind_has_a_residual_rule():
    assert set(RESIDUALS) == set(OPERATORS)
    elementwise = set(OPERATORS["elementwise"].primitives)
    assert set(ELEMENTWISE_RESIDUALS) <= elementwise


@pytest.mark.parametrize("f,op,grads,want", [
    (lambda w, x: x @ w, "dot_general", [True, True], ((0, 1), ())),
    (lambda w, x: x @ w, "dot_general", [False, True], ((0,), ())),   # dW = x^T g: x only
    (lambda w, x: jnp.exp(x @ w), "exp", [True], ((), (0,))),
    (lambda w, x: jnp.tanh(x @ w), "tanh", [True], ((), (0,))),
    (lambda w, x: x / w[0], "div", [False, True], ((0, 1), ())),
    (lambda w, x: x + w[0], "add", [True, True], ((), ())),
    (lambda w, x: (x @ w).max(-1), "reduce_max", [True], ((0,), (0,))),
    (lambda w, x: (x @ w).sum(-1), "reduce_sum", [True], ((), ())),
    (lambda w, x: w[jnp.array([0, 1])], "gather", [True, False], ((1,), ())),
])
def test_what_each_kind_keeps(f, op, grads, want):
    g = ap.trace(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
    node = next(n for n in g.nodes if n.op == op)
    assert kept(node, grads) == want
    assert kept(node, [False] * len(grads)) == ((), ())  # no gradient: nothing kept


def test_a_fused_chain_keeps_what_its_backward_needs():
    """gelu (tanh form) is eight elementwise operators XLA fuses: backward reads the matmul's
    output (recomputing the cheap ones from it) and tanh's output (XLA does not recompute a
    tanh); the next matmul reads the gelu's output. Not every intermediate."""
    g, res = _residuals(lambda w, x: jnp.sum(jax.nn.gelu(x @ w[0]) @ w[1]),
                        (jnp.ones((8, 16)), jnp.ones((16, 8))), jnp.ones((4, 8)))
    assert [g.producer(v).op for v in _kept(g, res)] == ["dot_general", "mul", "tanh"]
    assert len([n for n in g.nodes if n.kind == "elementwise"]) >= 8


def test_a_value_read_by_several_operators_is_kept_once():
    def f(w, x):
        h = jnp.tanh(x @ w[0])
        return jnp.sum(h @ w[1]) + jnp.sum(h @ w[2])  # three readers of h

    args = ((jnp.ones((8, 8)),) * 3, jnp.ones((4, 8)))
    g, res = _residuals(f, *args)
    tanh = next(n.outputs[0] for n in g.nodes if n.op == "tanh")
    readers = [n for n, refs in res.refs.items() if any(v == tanh for v, _, _ in refs)]
    assert len(readers) == 3  # tanh itself and both matmuls read it...
    problem = _one_device(g)
    picks = _picks(problem)
    memory = problem.step_memory(picks, update=False)
    assert memory.activations == g.spec(tanh).nbytes + 4  # ...one buffer (and the loss)


def test_values_that_feed_no_gradient_are_not_kept():
    def f(w, x):
        logits = x @ w
        hit = jnp.argmax(jax.lax.stop_gradient(logits), -1)  # no gradient through it
        return jnp.sum(jnp.tanh(logits)) + jnp.sum(hit) * 0.0

    g, res = _residuals(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
    assert [g.producer(v).op for v in _kept(g, res)] == ["tanh"]  # not the logits


def _one_device(g: ap.Graph, cluster: str = "accelerator-8x") -> Problem:
    return Problem(g, DeviceMesh.for_devices(1), CostModel(CLUSTERS[cluster]), lazy=True)


def _picks(problem: Problem) -> list[int]:
    picks = problem.settle({i: (1,) * len(problem.specs[v.name].sizes)
                            for i, v in problem.iter_ops()})
    problem.pick_parameters(picks)
    return picks


def test_the_ordered_peak_of_a_tiny_mlp_is_the_hand_computation():
    """loss = sum(tanh(x @ w1) @ w2) on one device, float32 [B, D] @ [D, H] @ [H, O]."""
    B, D, H, O = 64, 8, 16, 2
    g = ap.trace(lambda p, x: jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"]),
                 {"w1": jnp.ones((D, H)), "w2": jnp.ones((H, O))}, jnp.ones((B, D)))
    X, W1, W2, A, L = 4 * B * D, 4 * D * H, 4 * H * O, 4 * B * H, 4
    problem = _one_device(g)
    picks = _picks(problem)
    # a gradient function: the gradients are its outputs, held throughout with the
    # arguments. At tanh's backward: tanh's output (kept for it), its cotangent, the
    # matmul output's cotangent, the loss -- the matmul's output was freed in forward, the
    # logits' cotangent after the second matmul's backward
    grad = problem.step_memory(picks, update=False)
    assert grad.held == X + 2 * (W1 + W2)
    assert grad.activations == A + L
    assert (grad.phase, grad.at) == ("backward", "tanh_0")
    assert grad.peak == X + 2 * (W1 + W2) + 3 * A + L
    # a training step with Adam (state 2x): the new parameters and state are outputs beside
    # the arguments, 3 buffers per parameter; a temporary shares a free one where it fits
    # (here the loss and w2's gradient do, the [B, H] activations do not)
    state = CLUSTERS["accelerator-8x"].optimizer_state_factor
    step = problem.step_memory(picks)
    written = (1 + state) * (W1 + W2)
    assert step.held == X + written and step.outputs == written
    assert (step.phase, step.at) == ("backward", "tanh_0")
    assert step.peak == X + 2 * written + 3 * A


def _xla(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes -
            m.alias_size_in_bytes)


#: predicted / XLA's (argument + output + temp - alias): XLA's allocator packs buffers less
#: tightly than the model's live total, and keeps some values the model recomputes
TOLERANCE = 0.2


def test_a_gradient_function_is_priced_within_tolerance_of_xla():
    m = mlp(widths=(64, 256, 256, 64), batch=128)
    params, x = m.example_args(KEY)
    xla = _xla(jax.jit(jax.value_and_grad(m.loss)).lower(params, x).compile())
    problem = _one_device(ap.trace(m.loss, params, x))
    predicted = problem.step_memory(_picks(problem), update=False).peak
    assert abs(predicted / xla - 1) < TOLERANCE, (predicted, xla)


@pytest.mark.parametrize("name,pmode", [("mlp", "data_parallel"), ("mlp", "auto_parallel"),
                                        ("tfm_stack", "data_parallel")])
def test_a_training_step_is_priced_within_tolerance_of_xla(name, pmode):
    m = {"mlp": lambda: mlp(widths=(64, 256, 256, 64), batch=128),
         "tfm_stack": lambda: tfm_stack(blocks=1, batch=4, seq=32, hidden=64, heads=4)}[name]()
    params, *batch = m.example_args(KEY)
    with ap.auto_parallel_context(device_num=8, parallel_mode=pmode, gradients_mean=True):
        step = ap.train_step(m.loss, params, tuple(batch), optax.adam(1e-3))
    xla = _xla(step.lower(params, step.init(params), *batch).compile())
    assert abs(step.plan.cost.memory_bytes / xla - 1) < TOLERANCE, \
        (step.plan.cost.memory_bytes, xla)


def test_the_memory_budget_checks_the_peak_not_every_output():
    """A budget between the step's peak and what counting every operator output as kept
    gave (the model before) now fits, with no memory priced; below the peak it fails."""
    m = mlp(widths=(64, 512, 512, 64), batch=1024)
    g = ap.trace(m.loss, *m.example_args(KEY))
    cm = CostModel(CLUSTERS["accelerator-8x"])
    outputs = sum(g.spec(v).nbytes for n in g.nodes for v in n.outputs)
    before = outputs + sum(cm.parameter_memory(g.spec(v).nbytes, 1) for v in g.parameters()) \
        + sum(g.spec(v).nbytes for v in g.data_inputs())
    with ap.auto_parallel_context(parallel_mode="stand_alone", device_num=1):
        peak = ap.search(g).cost.memory_bytes
        assert peak < 0.7 * before
        budget = CLUSTERS["accelerator-8x"].model_copy(update={"memory_bytes": (peak + before)
                                                              / 2})
        plan = ap.search(g, cluster=budget)
        assert plan.cost.memory_bytes == peak <= budget.memory_bytes
        assert not any("memory priced" in note for note in plan.notes)
        with pytest.raises(ValueError, match="budget"):
            ap.search(g, cluster=budget.model_copy(update={"memory_bytes": 0.9 * peak}))
