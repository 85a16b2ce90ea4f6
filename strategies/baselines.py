"""The hand plans a user would otherwise write, as split counts every search prices beside
its own plan (DESIGN: the hand plan is the bar).

- ``data_parallel``: every operator splits the batch over all devices, parameters
  replicated (``jax.jit`` + ``NamedSharding`` on the batch; MindSpore's ``data_parallel``).
  :func:`autopar.strategies.search.data_parallel_splits` derives it.
- ``megatron tpT``: Megatron-LM's tensor parallelism over ``T`` devices, the most a node holds
  (:func:`megatron_degree`), x data parallelism over the rest (across nodes). Each matmul
  with a weight (a parameter, or a parameter's transpose or cast) is split as Megatron
  splits it: *column* (the weight's output dim over ``T``) where its input is the residual
  stream, *row* (the contracted dim over ``T``, a partial sum) where its input comes from a
  column-split matmul (through any operators but another weight matmul) -- q, k, v column
  and the attention output row; an MLP's first matmul column and its second row; a tied
  output projection column. The batch (dim 0 of the activation) is split over the
  data-parallel rest. :func:`megatron_splits` gives those
  matmuls' split counts; the search propagates them to the other operators
  (``sharding_propagation``), as a MindSpore user fixes the matmuls and propagates.

A hand plan is kept unless the search's own plan is priced cheaper than the cheapest hand plan
by more than :data:`HAND_PLAN_MARGIN` (the ``hand_plan_margin`` algorithm parameter): between
two plans of one model the price's ratio is off the measured ratio by up to that much (see
docs/fidelity.md), so a smaller saving is as likely a loss as a gain, and the plan the user
would otherwise write is the safer of the two.

The parameter-sharded hand plan (ZeRO / FSDP) is ``data_parallel`` with the parallel optimizer
(``enable_parallel_optimizer``): the same layouts, the parameters stored split over the
data-parallel group; the search prices it so whenever the context turns it on.

>>> import jax.numpy as jnp, autopar
>>> from autopar.strategies.layout import DeviceMesh
>>> def mlp(p, x):
...     return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
>>> g = autopar.trace(mlp, {"w1": jnp.ones((16, 64)), "w2": jnp.ones((64, 16))},
...                   jnp.ones((8, 16)))
>>> megatron_splits(g, DeviceMesh.for_devices(8), 4)  # (batch, out, contracted)
{'dot_general_0': (2, 4, 1), 'dot_general_1': (2, 1, 4)}
"""

from __future__ import annotations

from autopar.graph.ir import Graph, Node
from autopar.graph.ops import op_spec
from autopar.strategies.layout import DeviceMesh

__all__ = ["HAND_PLAN_MARGIN", "megatron_degree", "megatron_splits", "megatron_strategies",
           "weight_input"]

#: The fraction by which the search's own plan must be priced below the cheapest hand plan
#: to be kept over it (the ``hand_plan_margin`` algorithm parameter's default).
HAND_PLAN_MARGIN = 0.15

#: Operators through which a parameter is still a weight (its transpose, cast or reshape).
_WEIGHT_VIEWS = frozenset({"transpose", "convert_element_type", "reshape"})


def weight_input(graph: Graph, node: Node) -> int | None:
    """Which input of a two-operand matmul is its weight: a parameter, or a view of one
    (:data:`_WEIGHT_VIEWS`) read by nothing derived from data; None when neither is."""
    if node.op != "dot_general" or len(node.inputs) != 2:
        return None
    found = []
    for i, v in enumerate(node.inputs):
        value = graph.values[v]
        while value.kind == "activation":
            maker = graph.node(value.producer)
            if maker.op not in _WEIGHT_VIEWS or len(maker.inputs) != 1:
                break
            value = graph.values[maker.inputs[0]]
        if value.kind == "param":
            found.append(i)
    return found[0] if len(found) == 1 else None


def megatron_degree(device_num: int, devices_per_node: int) -> int:
    """Megatron's tensor-parallel degree: the largest divisor of ``device_num`` that fits in
    a node (the rest data parallel across nodes); 1 when there is none above 1.

    >>> [megatron_degree(n, 8) for n in (8, 64, 12, 7)]
    [8, 8, 6, 7]
    >>> megatron_degree(7, 4)
    1
    """
    return max(t for t in range(1, min(device_num, devices_per_node) + 1)
               if device_num % t == 0)


def megatron_splits(graph: Graph, mesh: DeviceMesh, tp: int) -> dict[str, tuple[int, ...]]:
    """Split counts (per iteration dim) of every weight matmul under Megatron's layout at
    tensor-parallel degree ``tp`` (see the module docstring); matmuls whose dims allow no
    such split are left out (the search decides them). Empty when the graph has no weight
    matmul or ``tp`` does not divide the devices."""
    if mesh.device_num % tp:
        return {}
    dp = mesh.device_num // tp
    column_made: set[str] = set()  # values downstream of a column split, no row split between
    out: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        w = weight_input(graph, node)
        if w is None:
            if any(v in column_made for v in node.inputs):
                column_made.update(node.outputs)
            continue
        x = 1 - w
        row = node.inputs[x] in column_made
        splits = _matmul_splits(graph, node, w, row, tp, dp, mesh)
        if splits is None:
            continue
        out[node.name] = splits
        if not row:
            column_made.update(node.outputs)
    return out


def megatron_strategies(graph: Graph, device_num: int, tp: int
                        ) -> dict[str, tuple[tuple[int, ...], ...]]:
    """:func:`megatron_splits` on ``device_num`` devices as MindSpore strategies (per input,
    one split count per dim): the ``fixed`` that pins Megatron's layout at degree ``tp`` in a
    search or a stage search, the rest propagated or searched.

    >>> import jax.numpy as jnp, autopar
    >>> g = autopar.trace(lambda w, x: jnp.sum(x @ w), jnp.ones((16, 64)), jnp.ones((8, 16)))
    >>> megatron_strategies(g, 8, 4)
    {'dot_general_0': ((2, 1), (1, 4))}
    """
    mesh = DeviceMesh.for_devices(device_num)
    out = {}
    for name, splits in megatron_splits(graph, mesh, tp).items():
        spec = op_spec(graph.node(name), graph)
        out[name] = tuple(tuple(1 if d is None else splits[d] for d in dims)
                          for dims in spec.in_maps)
    return out


def _matmul_splits(graph: Graph, node: Node, w: int, row: bool, tp: int, dp: int,
                   mesh: DeviceMesh) -> tuple[int, ...] | None:
    """One weight matmul's split counts: ``tp`` on the weight's first output dim (column) or
    first contracted dim (row) that allows it, ``dp`` on the activation's dim 0 where it
    allows it; None when no dim takes ``tp``."""
    spec = op_spec(node, graph)
    x_dims = {d for d in spec.in_maps[1 - w] if d is not None}
    out_dims = {d for m in spec.out_maps for d in m if d is not None}
    w_dims = [d for d in spec.in_maps[w] if d is not None]
    pick = [d for d in w_dims if (d in x_dims and d not in out_dims) == row
            and (row or d not in x_dims)]
    splits = [1] * len(spec.sizes)
    for d in pick:
        if spec.allows(d, tp):
            splits[d] = tp
            break
    else:
        return None
    batch = spec.in_maps[1 - w][0] if spec.in_maps[1 - w] else None
    if dp > 1 and batch is not None and batch not in w_dims and spec.allows(batch, dp):
        splits[batch] = dp
    return tuple(splits) if mesh.assign(splits) is not None else None
