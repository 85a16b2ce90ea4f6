"""``torch_npu.npu_mm_reduce_scatter_base``, argument for argument, on a JAX mesh axis.

The Ascend operator fuses a tensor-parallel matmul with a reduce-scatter of its result:
every rank holds ``input`` ``(m, k)`` and ``x2`` ``(k, n)`` (its slice of the contraction),
and receives rows ``[rank * m / world_size, (rank + 1) * m / world_size)`` of the sum of all
ranks' ``input @ x2``. Here it runs inside ``jax.shard_map``, ``hcom`` (the HCCL
communicator name on the NPU) is the mesh axis name, and the work is done by
:func:`autopar.kernels.mm_reduce_scatter` (a pipelined ring of ``ppermute``).

The operator's constraints are enforced as on the NPU (CANN 8.0.RC2), each violation
raising :class:`~autopar.errors.AutoParallelError` (``ValueError``) or
:class:`~autopar.errors.AutoParallelTypeError` (``TypeError``) that names the argument:

==============  ===========================================================================
argument        rule
==============  ===========================================================================
input, x2       2-D arrays, dtype float16 or bfloat16, the same dtype
input, x2       ``input.shape[1] == x2.shape[0]`` (= k), ``256 <= k < 65535``
input           ``m`` divisible by ``world_size``
hcom            a ``str`` naming an axis of the enclosing ``shard_map``
world_size      an ``int`` in {2, 4, 8}, equal to the size of the ``hcom`` axis
reduce_op       ``"sum"`` only
bias            ``None`` only (the NPU rejects a non-zero bias in this version)
comm_turn       ``0`` only (the default split granularity)
==============  ===========================================================================

Transposed ``x2``. On the NPU, ``x2`` may be a transposed *view* (a non-contiguous tensor
whose logical shape is still ``(k, n)``); ``input`` may not. JAX arrays have no views and
no strides: ``w.T`` is simply an array of shape ``(k, n)`` whose memory layout XLA chooses
(and fuses into the matmul). So the rule is stated on the logical shape only: ``x2`` must
be ``(k, n)``, whether or not it was produced by a transpose. Passing the untransposed
``(n, k)`` weight is a shape error whose message suggests ``x2.T``.

Worked example (the seed's shapes, 8 ranks: ``input`` (128, 512), ``x2`` (512, 64))::

    mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.shard_map(lambda a, b: npu_mm_reduce_scatter_base(a, b, "tp", 8),
                      mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
                      out_specs=P("tp", None))
    # global a: (128, 8 * 512) fp16, b: (8 * 512, 64) fp16 -> f(a, b): (128, 64), each
    # rank holding its (16, 64) block of a @ b.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.kernels.mm_reduce_scatter import mm_reduce_scatter

__all__ = ["npu_mm_reduce_scatter_base"]

K_MIN, K_MAX = 256, 65535            # k in [K_MIN, K_MAX)
WORLD_SIZES = (2, 4, 8)
DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _array(key: str, value: Any) -> None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise AutoParallelTypeError(key, value, "must be a tensor (a jax or numpy array)")
    if len(value.shape) != 2:
        raise AutoParallelError(f"{key}.shape", tuple(value.shape), "must be 2-D")
    if np.dtype(value.dtype) not in DTYPES:
        raise AutoParallelTypeError(f"{key}.dtype", np.dtype(value.dtype),
                                    "must be float16 or bfloat16")


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise AutoParallelTypeError(key, value, "must be an int")
    return int(value)


def npu_mm_reduce_scatter_base(input: jax.Array, x2: jax.Array, hcom: str, world_size: int,
                               *, reduce_op: str = "sum", bias: jax.Array | None = None,
                               comm_turn: int = 0) -> jax.Array:
    """Matmul + reduce-scatter, seed-compatible (``torch_npu.npu_mm_reduce_scatter_base``).

    Args:
      input: this rank's ``(m, k)`` fp16/bf16 operand.
      x2: this rank's ``(k, n)`` operand, same dtype (a transposed array is fine).
      hcom: the mesh axis name of the enclosing ``shard_map`` (the communicator).
      world_size: ranks in ``hcom``: 2, 4 or 8, and equal to the axis size.
      reduce_op: ``"sum"``.
      bias: ``None``.
      comm_turn: ``0``.

    Returns:
      ``(m / world_size, n)`` in ``input.dtype``: this rank's row block of the sum over
      ranks of ``input @ x2`` (accumulated in fp32).

    Example: ``input`` (128, 512) and ``x2`` (512, 64) in float16 on each of 8 ranks of axis
    "tp" -> ``npu_mm_reduce_scatter_base(input, x2, "tp", 8)`` is (16, 64) float16.
    """
    _array("input", input)
    _array("x2", x2)
    if np.dtype(x2.dtype) != np.dtype(input.dtype):
        raise AutoParallelTypeError("x2.dtype", np.dtype(x2.dtype),
                                    f"must equal input.dtype ({np.dtype(input.dtype)})")
    m, k = input.shape
    if x2.shape[0] != k:
        hint = ("x2 looks untransposed: pass x2.T (a transposed array is just an array in JAX)"
                if x2.shape[1] == k else "the contraction dims must match as for matmul")
        raise AutoParallelError("x2.shape", tuple(x2.shape),
                                f"first dim must equal input.shape[1] = {k} (k)", hint)
    if not K_MIN <= k < K_MAX:
        raise AutoParallelError("input.shape", tuple(input.shape),
                                f"k = {k} must be in [{K_MIN}, {K_MAX})")
    if not isinstance(hcom, str):
        raise AutoParallelTypeError("hcom", hcom, "must be a str (the mesh axis name)")
    world_size = _int("world_size", world_size)
    if world_size not in WORLD_SIZES:
        raise AutoParallelError("world_size", world_size, f"must be one of {list(WORLD_SIZES)}")
    if m % world_size:
        raise AutoParallelError("input.shape", tuple(input.shape),
                                f"m = {m} must be divisible by world_size = {world_size}")
    if not isinstance(reduce_op, str):
        raise AutoParallelTypeError("reduce_op", reduce_op, "must be a str")
    if reduce_op != "sum":
        raise AutoParallelError("reduce_op", reduce_op, "only 'sum' is supported")
    if bias is not None:
        raise AutoParallelError("bias", f"<array {getattr(bias, 'shape', '?')}>",
                                "must be None (a bias is not supported by this operator)",
                                "add the bias to the result instead")
    if _int("comm_turn", comm_turn) != 0:
        raise AutoParallelError("comm_turn", comm_turn, "only 0 (the default split) is "
                                "supported")
    try:
        axis = int(lax.axis_size(hcom))
    except NameError:
        raise AutoParallelError("hcom", hcom, "must name a mesh axis of the enclosing "
                                "jax.shard_map", "call it inside jax.shard_map") from None
    if axis != world_size:
        raise AutoParallelError("world_size", world_size,
                                f"must equal the size of axis {hcom!r} ({axis})")
    return mm_reduce_scatter(input, x2, hcom)
