"""Supported JAX primitives: their operator kind and FLOP count.

The kind groups primitives that split the same way (the strategy space of the search is
defined per kind). A primitive not listed here, and not a call that the tracer inlines, is
unsupported: tracing raises :class:`~autopar.errors.UnsupportedOperatorError`.

>>> KINDS["dot_general"], KINDS["exp"], KINDS["reduce_sum"]
('matmul', 'elementwise', 'reduce')
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from autopar.graph.ir import TensorSpec

__all__ = ["KINDS", "INLINED", "UNSUPPORTED_HINTS", "flops", "supported_primitives"]

_UNARY = """neg exp exp2 log log1p expm1 tanh logistic sqrt rsqrt cbrt integer_pow erf erfc
erf_inv abs sign floor ceil round sin cos tan asin acos atan sinh cosh asinh acosh atanh not
square convert_element_type stop_gradient copy copy_p is_finite reduce_precision real imag
population_count clz""".split()
_NARY = """add add_any sub mul div rem pow max min atan2 and or xor eq ne lt le gt ge select_n
clamp nextafter shift_left shift_right_logical shift_right_arithmetic""".split()

KINDS: dict[str, str] = {
    **{p: "elementwise" for p in _UNARY + _NARY},
    "dot_general": "matmul",
    "conv_general_dilated": "conv",
    "reduce_sum": "reduce", "reduce_max": "reduce", "reduce_min": "reduce",
    "reduce_prod": "reduce", "reduce_and": "reduce", "reduce_or": "reduce",
    "argmax": "reduce", "argmin": "reduce",
    "broadcast_in_dim": "broadcast",
    "reshape": "reshape", "squeeze": "reshape", "expand_dims": "reshape",
    "transpose": "transpose",
    "slice": "slice", "dynamic_slice": "slice",
    "concatenate": "concatenate",
    "split": "split",
    "pad": "pad",
    "gather": "gather",
    "iota": "iota",
    "reduce_window_sum": "reduce_window", "reduce_window_max": "reduce_window",
    "reduce_window_min": "reduce_window",
    "sharding_constraint": "identity",
    "optimization_barrier": "identity",
}

#: Call-like primitives whose body the tracer inlines, with the param holding the body.
INLINED: dict[str, str] = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
}

UNSUPPORTED_HINTS: dict[str, str] = {
    "scan": "unroll the loop with a Python for loop (the search needs every layer as nodes)",
    "while": "use a Python loop with a static trip count",
    "cond": "use jnp.where / lax.select (both branches computed) or a Python if on static data",
    "sort": "sorting is not partitionable by autopar yet; move it out of the parallel region",
    "random_bits": "draw random numbers outside the traced function and pass them as inputs",
    "rng_bit_generator": "draw random numbers outside the traced function and pass them in",
    "scatter-add": "use a one-hot matmul or gather-based formulation",
    "scatter": "use a one-hot matmul or gather-based formulation",
}


def supported_primitives() -> list[str]:
    return sorted(KINDS)


def _elems(specs: Sequence[TensorSpec]) -> int:
    return sum(s.size for s in specs)


def _dot_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    (lhs_contract, _), _ = p["dimension_numbers"]
    k = math.prod(ins[0].shape[d] for d in lhs_contract)
    return 2 * outs[0].size * k


def _conv_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    rhs_spec = p["dimension_numbers"].rhs_spec  # (out feature, in feature, *spatial)
    rhs = ins[1].shape
    per_output = rhs[rhs_spec[1]] * math.prod(rhs[d] for d in rhs_spec[2:])
    return 2 * outs[0].size * per_output


def _window_flops(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], p: dict[str, Any]) -> int:
    return outs[0].size * math.prod(p["window_dimensions"])


_FLOPS: dict[str, Callable[[Sequence[TensorSpec], Sequence[TensorSpec], dict[str, Any]], int]] = {
    "matmul": _dot_flops,
    "conv": _conv_flops,
    "reduce_window": _window_flops,
    "elementwise": lambda ins, outs, p: _elems(outs),
    "reduce": lambda ins, outs, p: ins[0].size,
}


def flops(kind: str, ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
          params: dict[str, Any]) -> int:
    """FLOPs of one forward application (data movement counts 0).

    >>> from autopar.graph.ir import TensorSpec as T
    >>> flops("matmul", [T((4, 8), "float32"), T((8, 16), "float32")], [T((4, 16), "float32")],
    ...       {"dimension_numbers": (((1,), (0,)), ((), ()))})
    1024
    """
    fn = _FLOPS.get(kind)
    return int(fn(ins, outs, params)) if fn else 0
