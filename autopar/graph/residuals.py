"""What backward reads: the residuals of each operator kind's VJP.

Reverse mode keeps, from the forward pass, only what the operators' derivative rules read
(JAX's partial evaluation of the linearized program: the residuals); everything else is
freed as soon as its forward readers are done. This module is the one rule per operator
kind, beside the registry (:mod:`autopar.graph.ops`): given an operator and which of its
inputs carry a gradient, the inputs and outputs its backward reads. A matmul keeps each
input whose partner carries a gradient (``dW = x^T g`` reads ``x``); ``exp``, ``tanh``,
``logistic`` and ``sqrt`` keep their output; ``log``, powers and the trigonometric functions
their input; a division its denominator (and its numerator, where the denominator carries a
gradient); ``add``, reshapes, transposes, broadcasts, slices and
``reduce_sum`` are linear and keep nothing; a maximum keeps its input and output (where the
maximum was); a gather keeps its indices.

A value that several operators keep is one buffer: :mod:`autopar.strategies.memory` counts
it once, and there also resolves values XLA fuses away (never stored) to the stored values
their fused chain reads -- what the fused backward recomputes them from -- except a value
made by an operation XLA does not recompute (:data:`NOT_RECOMPUTED`: ``tanh``, ``exp``, a
division), which is stored where backward reads it; a division by a broadcast row keeps the
row at the division's full shape (:data:`DIVIDES_BY_ROW`).

>>> import jax.numpy as jnp, autopar
>>> g = autopar.trace(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((4, 4)), jnp.ones((2, 4)))
>>> [kept(n, [True] * len(n.inputs)) for n in g.nodes]
[((0, 1), ()), ((), (0,)), ((), ())]
>>> kept(g.nodes[0], [False, True])    # x carries no gradient: dW = x^T g reads x only
((0,), ())
>>> d = autopar.trace(lambda x: (x / 8.0).sum(), jnp.ones((2, 4))).nodes[0]
>>> d.op, kept(d, [True, False])       # x / 8: g / 8 reads the constant alone
('div', ((1,), ()))
"""

from __future__ import annotations

from typing import Callable, Sequence

from autopar.graph.ir import Node

__all__ = ["RESIDUALS", "ELEMENTWISE_RESIDUALS", "NOT_RECOMPUTED", "DIVIDES_BY_ROW",
           "kept"]

#: (inputs kept, outputs kept), as positions
Kept = tuple[tuple[int, ...], tuple[int, ...]]
#: (node, per input whether it carries a gradient) -> what its backward reads
Rule = Callable[[Node, Sequence[bool]], Kept]

_NOTHING: Kept = ((), ())


def _linear(node: Node, grads: Sequence[bool]) -> Kept:
    """A linear operator (sums, moves, reshapes): its backward reads no forward value."""
    return _NOTHING


def _partners(node: Node, grads: Sequence[bool]) -> Kept:
    """A product (``mul``, matmul, convolution): input j's gradient reads the others."""
    n = len(node.inputs)
    return tuple(i for i in range(n) if any(g for j, g in enumerate(grads) if j != i)), ()


def _output(node: Node, grads: Sequence[bool]) -> Kept:
    """``exp``, ``tanh``, ``logistic``, ``sqrt``: the derivative is a function of the output."""
    return ((), (0,)) if any(grads) else _NOTHING


def _inputs(node: Node, grads: Sequence[bool]) -> Kept:
    """``log``, powers, trigonometric functions, ``max``: the derivative reads the inputs."""
    return (tuple(range(len(node.inputs))), ()) if any(grads) else _NOTHING


def _quotient(node: Node, grads: Sequence[bool]) -> Kept:
    """``div(x, y)``: x's gradient ``g / y`` reads the denominator, y's ``-g x / y^2`` both
    (a division by a constant keeps only the constant)."""
    if len(grads) > 1 and grads[1]:
        return (0, 1), ()
    return ((1,), ()) if grads and grads[0] else _NOTHING


def _inputs_output(node: Node, grads: Sequence[bool]) -> Kept:
    """``rsqrt``, ``pow``, a maximum or product reduction, ``cumprod``: inputs and output."""
    return (tuple(range(len(node.inputs))), tuple(range(len(node.outputs)))) if any(grads) \
        else _NOTHING


def _first_input(node: Node, grads: Sequence[bool]) -> Kept:
    """``select_n(which, *cases)``: the cases' gradients are selected by ``which``;
    a maximum pool's window maximum is found in its operand."""
    return ((0,), ()) if any(grads) else _NOTHING


def _second_input(node: Node, grads: Sequence[bool]) -> Kept:
    """``gather(operand, indices)``, ``scatter-add(operand, indices, updates)``,
    ``select_and_scatter_add(source, operand)``: the indices (the operand)."""
    return ((1,), ()) if any(grads) and len(node.inputs) > 1 else _NOTHING


def _index_inputs(node: Node, grads: Sequence[bool]) -> Kept:
    """``dynamic_slice(operand, *starts)``: the start indices."""
    return (tuple(range(1, len(node.inputs))), ()) if any(grads) else _NOTHING


def _outputs(node: Node, grads: Sequence[bool]) -> Kept:
    """``sort`` and ``top_k``: the order they found (their outputs)."""
    return ((), tuple(range(len(node.outputs)))) if any(grads) else _NOTHING


#: elementwise primitive -> its rule (a primitive not listed: linear, or no gradient)
ELEMENTWISE_RESIDUALS: dict[str, Rule] = {
    **dict.fromkeys(("exp", "exp2", "tanh", "logistic", "sqrt", "cbrt", "expm1", "tan",
                     "erf_inv"), _output),
    **dict.fromkeys(("log", "log1p", "integer_pow", "square", "sin", "cos", "asin", "acos",
                     "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "erfc", "abs",
                     "max", "min", "atan2", "rem", "clamp"), _inputs),
    "div": _quotient,
    **dict.fromkeys(("rsqrt", "pow"), _inputs_output),
    "mul": _partners,
    "select_n": _first_input,
}


#: elementwise primitives XLA does not recompute inside another fusion (its "expensive"
#: operations: transcendental functions, division, powers): a value one of them makes that
#: backward reads is stored, even where XLA fuses it into its forward readers
NOT_RECOMPUTED: frozenset[str] = frozenset("""exp exp2 expm1 log log1p tanh logistic sqrt
rsqrt cbrt pow div rem atan2 erf erfc erf_inv asin acos atan sinh cosh asinh acosh
atanh""".split())


#: elementwise primitives XLA rewrites, when they divide by a broadcast row (a softmax's
#: ``exp / sum``), into a multiplication by the row's reciprocal broadcast to the full shape:
#: that full-shape row is what their backward reads
DIVIDES_BY_ROW: frozenset[str] = frozenset({"div"})


def _elementwise(node: Node, grads: Sequence[bool]) -> Kept:
    return ELEMENTWISE_RESIDUALS.get(node.op, _linear)(node, grads)


def _reduce(node: Node, grads: Sequence[bool]) -> Kept:
    """``reduce_sum`` is linear; a maximum, minimum or product reads input and output."""
    return _linear(node, grads) if node.op == "reduce_sum" else \
        _inputs_output(node, grads)


def _cumulative(node: Node, grads: Sequence[bool]) -> Kept:
    return _linear(node, grads) if node.op == "cumsum" else _inputs_output(node, grads)


def _slice(node: Node, grads: Sequence[bool]) -> Kept:
    return _index_inputs(node, grads) if node.op == "dynamic_slice" else \
        _linear(node, grads)


def _window(node: Node, grads: Sequence[bool]) -> Kept:
    """A window sum is linear; a window maximum (max pooling) reads its operand."""
    return _linear(node, grads) if node.op == "reduce_window_sum" else \
        _first_input(node, grads)


#: operator kind -> what its backward reads (:func:`kept`)
RESIDUALS: dict[str, Rule] = {
    "elementwise": _elementwise,
    "matmul": _partners,
    "conv": _partners,
    "reduce": _reduce,
    "broadcast": _linear,
    "reshape": _linear,
    "transpose": _linear,
    "slice": _slice,
    "concatenate": _linear,
    "stack": _linear,
    "split": _linear,
    "cumulative": _cumulative,
    "top_k": _outputs,
    "sort": _outputs,
    "pad": _linear,
    "gather": _second_input,
    "scatter": _second_input,
    "scatter_add": _second_input,
    "iota": _linear,
    "reduce_window": _window,
    "select_and_scatter": _second_input,
    "identity": _linear,
    # no gradient flows through these: bits, keys and bit casts
    "bitcast": _linear,
    "random_key": _linear,
    "random_bits": _linear,
}


def kept(node: Node, grads: Sequence[bool]) -> Kept:
    """The inputs and outputs (positions) ``node``'s backward reads, given which of its
    inputs carry a gradient (nothing when none does). A kind without a rule keeps every
    input and output (safe: it may over-count, never under-count)."""
    if not any(grads):
        return _NOTHING
    rule = RESIDUALS.get(node.kind)
    if rule is None:
        return tuple(range(len(node.inputs))), tuple(range(len(node.outputs)))
    return rule(node, grads)
