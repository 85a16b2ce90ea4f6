"""``lower(parallel_graph)``: run a ParallelGraph on JAX devices with ``jax.shard_map``.

The abstract mesh of the plan becomes a :class:`jax.sharding.Mesh` of ``device_num`` devices
with the same axis names (``a0, a1, ...``, devices row-major). The body of one
``jax.shard_map`` walks the parallel program in order:

- a communication node becomes a ``jax.lax`` collective over its mesh axes, by the rule of
  its step kind in :data:`STEP_LOWERING`: ``psum`` (AllReduce), ``psum_scatter(...,
  tiled=True)`` (ReduceScatter), ``all_gather(..., tiled=True)`` (AllGather) -- these two
  in the form :mod:`autopar.collectives` picks for a strided dim --
  ``all_to_all(..., tiled=True)`` (AlltoAll), or a local ``dynamic_slice`` at this device's
  block (StridedSlice). A group of several axes is ordered mixed radix, outer axis first, as
  ``jax.lax`` orders a tuple ``axis_name``;
- an operator re-binds its JAX primitive on local arrays, with the shape-carrying parameters
  rewritten to local sizes by its kind's ``local_params`` rule in the operator registry
  (:mod:`autopar.graph.ops`: ``reshape.new_sizes``, ``broadcast_in_dim.shape``,
  ``iota.shape``, ``slice.limit_indices``, ``dynamic_slice`` / ``gather`` ``slice_sizes``)
  and shardings dropped; an ``iota`` split along its counting dim is offset by the device's
  block start, a ``scatter-add`` whose updates are split (a partial sum) adds its
  operand on the first device of those axes only, and a ``random_bits`` split along its
  drawn dims draws this device's block of the same global bits
  (:func:`autopar.graph.prng.draw_block`).

In-specs are the input layouts' ``PartitionSpec`` s and out-specs the output layouts'
(outputs never hold partial sums after the rewrite). The result is jitted, differentiable
(``jax.grad`` goes through ``shard_map``), and takes and returns the original pytrees.

``shard_map`` runs with ``check_vma=True``: re-bound primitives get their operands cast to
vary alike (``lax.pcast``, what ``jax.numpy`` inserts itself), collectives get inputs varying
over their axes and an AllGather's result is typed invarying. JAX's transpose then sums a
replicated input's gradient exactly over the axes its uses vary along -- the gradient
synchronisation of data parallelism, and nothing for a parameter used only in replicated
computation -- and the final AllReduce of a loss transposes to no communication. A program
holding a fused ``all_gather_matmul`` (whose replicated result cannot be typed invarying)
runs with ``check_vma=False`` instead: the transpose then divides replicated output
cotangents by the number of devices and sums every replicated input's cotangent, which is
exact but all-reduces gradients that are already complete; its AllReduces whose cotangent is
the same on every device of some of their axes are differentiated without summing over those
(:func:`alike_psums`). Either way the tests compare
gradients with the single-device ones.

>>> import jax.numpy as jnp, autopar
>>> f = lambda w, x: jnp.tanh(x @ w)
>>> w, x = jnp.ones((8, 4)), jnp.ones((2, 8))
>>> g = autopar.trace(f, w, x)
>>> plan = autopar.search(g, mode="dynamic_programming", device_num=2,
...                       parallel_mode="auto_parallel")
>>> run = lower(autopar.rewrite.rewrite(g, plan))
>>> bool(jnp.allclose(run(w, x), f(w, x)))
True
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from autopar.collectives import all_gather_dim, psum_scatter_dim
from autopar.cotangents import alike_axes
from autopar.errors import AutoparError, AutoParallelError, AutoParallelTypeError
from autopar.graph.ops import OPERATORS
from autopar.graph.prng import draw_block, is_key, wrap_key
from autopar.graph.tracer import flatten, traced_dtype
from autopar.graph.loops import LOOP_KIND
from autopar.graph.remat import spans
from autopar.kernel_rules import FusedKernels, fuse_kernels, run_fused
from autopar.lower_loops import body_programs, run_loop
from autopar.parallel_graph import PNode, ParallelGraph
from autopar.strategies.layout import DeviceMesh, axis_name, jax_mesh
from autopar.strategies.redistribution import STEP_KINDS, Step

__all__ = ["lower", "LoweredFunction", "jax_mesh", "user_mesh", "apply_step", "block_index",
           "psum_alike", "alike_psums", "put_on", "STEP_LOWERING"]


# ---------------------------------------------------------------------------- mesh


def user_mesh(given: Any, mesh: DeviceMesh) -> Mesh:
    """The user's mesh, or -- when its axes are the user's own, e.g. ``("dp", "mp")`` -- the
    plan's axes over the same devices in the same (row-major) order."""
    if not isinstance(given, Mesh):
        raise AutoParallelTypeError("mesh", given, "a jax.sharding.Mesh (or None)")
    want = {n: s for n, s in mesh.axes}
    have = dict(given.shape)
    if tuple(given.axis_names) == mesh.names and have == want:
        return given
    if given.devices.size != mesh.device_num:
        raise AutoParallelError("mesh", dict(have), f"it has {given.devices.size} devices; "
                                f"the plan needs {mesh.device_num} (axes {want})",
                                "Pass a mesh of device_num devices, or mesh=None")
    return jax_mesh(mesh, list(given.devices.flat))


def put_on(values: Sequence[Any], shardings: Sequence[Any],
           names: Sequence[str] | None = None) -> list[Any]:
    """``values`` laid out as ``shardings``, one ``jax.device_put`` for those that are not
    already (a step's own outputs are: feeding them back to the next step costs nothing;
    placing each leaf on its own cost ~30 us of Python apiece, every step). A shape without
    values (a ``jax.ShapeDtypeStruct``: what a function or step may be built from) is
    refused, naming the leaf (``names``: the traced inputs' names)."""
    for i, x in enumerate(values):
        if isinstance(x, (jax.ShapeDtypeStruct, jax.core.ShapedArray)):
            raise AutoParallelTypeError(
                f"argument {names[i]!r}" if names else f"argument leaf {i}", x, "a concrete "
                "array: a jax.ShapeDtypeStruct shapes what a function or step is built for; "
                "calling it needs the values")
    todo = [i for i, (x, s) in enumerate(zip(values, shardings))
            if not (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                    and x.sharding.is_equivalent_to(s, x.ndim))]
    out = list(values)
    if todo:
        for i, x in zip(todo, jax.device_put([values[i] for i in todo],
                                             [shardings[i] for i in todo])):
            out[i] = x
    return out


# ---------------------------------------------------------------------------- collectives


def block_index(axes: Sequence[str], sizes: Mapping[str, int]) -> Any:
    """This device's block number over ``axes``: mixed radix of ``lax.axis_index``, outer first."""
    idx: Any = 0
    for a in axes:
        idx = idx * sizes[a] + lax.axis_index(a)
    return idx


def varying(x: Any) -> frozenset[str]:
    """Mesh axes along which ``x`` varies (``shard_map(check_vma=True)``; empty otherwise)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _to_varying(x: Any, axes: Any) -> Any:
    missing = tuple(a for a in axes if a not in varying(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _psum(x: Any, step: Step, mesh: DeviceMesh, vma: bool) -> Any:
    return lax.psum(x, axis_name(step.axes))


def _psum_scatter(x: Any, step: Step, mesh: DeviceMesh, vma: bool) -> Any:
    return psum_scatter_dim(x, axis_name(step.axes), step.dim, mesh.size_of(step.axes))


def _all_gather(x: Any, step: Step, mesh: DeviceMesh, vma: bool) -> Any:
    if vma:  # every device of the group holds the same result
        return all_gather_dim(x, axis_name(step.axes), step.dim, to="invarying")
    return all_gather_dim(x, axis_name(step.axes), step.dim)


def _all_to_all(x: Any, step: Step, mesh: DeviceMesh, vma: bool) -> Any:
    return lax.all_to_all(x, axis_name(step.axes), split_axis=step.dim,
                          concat_axis=step.src_dim, tiled=True)


def _local_slice(x: Any, step: Step, mesh: DeviceMesh, vma: bool) -> Any:
    size = x.shape[step.dim] // mesh.size_of(step.axes)
    start = block_index(step.axes, mesh.sizes) * size
    return lax.dynamic_slice_in_dim(x, start, size, axis=step.dim)


#: The ``jax.lax`` rule of each redistribution step kind, keyed as
#: :data:`~autopar.strategies.redistribution.STEP_KINDS` (which holds the planning facts).
STEP_LOWERING: dict[str, Callable[[Any, Step, DeviceMesh, bool], Any]] = {
    "all_reduce": _psum,
    "reduce_scatter": _psum_scatter,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "slice": _local_slice,
}


def apply_step(x: Any, step: Step, mesh: DeviceMesh, *, vma: bool = False) -> Any:
    """One redistribution step on a local array, inside ``shard_map`` over ``mesh``'s axes.

    ``vma``: the program runs under ``check_vma=True``: collectives get inputs typed varying
    over their axes and an AllGather's result is typed invarying over them (every device of
    the group holds the same data), so JAX's transpose sums a gradient only where the
    contributions really differ.
    """
    rule = STEP_LOWERING.get(step.kind)
    if rule is None:
        raise AutoParallelError("step", str(step), "unknown redistribution step kind")
    if vma and STEP_KINDS[step.kind].collective is not None:
        x = _to_varying(x, step.axes)
    return rule(x, step, mesh, vma)


# ---------------------------------------------------------------------------- operators


def _node_error(node: PNode, why: str) -> AutoParallelError:
    where = f" at {node.source}" if node.source and node.source != "<unknown>" else ""
    return AutoParallelError(f"cannot lower node {node.name!r} ({node.op}){where} with strategy "
                             f"{node.strategy}: {why}. Fix its strategy (keep these dims "
                             f"whole) or move the operator out of the parallel function.")


def local_params(node: PNode, pg: ParallelGraph) -> dict[str, Any]:
    """The node's primitive params for its local shapes: its kind's ``local_params`` rule
    (:mod:`autopar.graph.ops`), shardings dropped."""
    p = dict(node.params)
    for key in ("sharding", "out_sharding"):
        if key in p:
            p[key] = None
    ins = [pg.values[v] for v in node.inputs]
    outs = [pg.values[v] for v in node.outputs]
    if all(v.local_shape == v.spec.shape for v in ins + outs):
        return p
    kind = OPERATORS.get(node.kind)
    if kind is None:
        raise _node_error(node, f"operators of kind {node.kind!r} cannot run on split tensors")
    try:
        return kind.local_params(p, [(v.local_shape, v.spec.shape) for v in ins],
                                 [(v.local_shape, v.spec.shape) for v in outs])
    except ValueError as e:
        raise _node_error(node, str(e)) from None


def _bind(node: PNode, args: list[Any], pg: ParallelGraph, vma: bool = False) -> list[Any]:
    if node.primitive is None:
        raise _node_error(node, "the node has no JAX primitive to re-bind")
    if node.op == "sharding_constraint":  # layouts are explicit here; the constraint is moot
        return list(args)
    params = local_params(node, pg)
    if node.op == "scatter-add":
        args = _operand_once(args, node, pg)
    if vma:  # primitives need operands varying alike (jax.numpy inserts these casts itself)
        union = frozenset().union(*(varying(a) for a in args))
        if union:
            args = [_to_varying(a, sorted(union)) for a in args]
    try:
        if node.op == "random_bits" and any(_drawn_axes(node, pg)):
            out = _random_block(args[0], node, pg)
        else:
            out = node.primitive.bind(*args, **params)
    except AutoparError:  # (a custom derivative rule refused: graph/custom_rules.py)
        raise
    except Exception as e:  # a JAX shape/type rule refused the local shapes
        raise _node_error(node, f"{type(e).__name__}: {e}") from None
    outs = list(out) if node.primitive.multiple_results else [out]
    if node.op == "iota":
        outs = [_offset_iota(outs[0], node, pg)]
    for v, x in zip(node.outputs, outs):
        want = pg.values[v].local_shape
        if tuple(x.shape) != want:
            raise _node_error(node, f"output {v!r} has local shape {tuple(x.shape)}, the plan "
                              f"expects {want}")
    return outs


def _operand_once(args: list[Any], node: PNode, pg: ParallelGraph) -> list[Any]:
    """A ``scatter-add`` whose updates are split along their scatter dims leaves a partial
    sum over those axes (the registry's summed dims); its operand, replicated there, is
    added on the first device of the group only, so that the sum holds it once."""
    axes = pg.values[node.outputs[0]].layout.partial
    if not axes:
        return args
    first = block_index(axes, pg.mesh.sizes) == 0
    return [jnp.where(first, args[0], jnp.zeros_like(args[0]))] + list(args[1:])


def _offset_iota(x: Any, node: PNode, pg: ParallelGraph) -> Any:
    """Global indices along a split counting dim: add this device's block start."""
    dim = node.params["dimension"]
    val = pg.values[node.outputs[0]]
    axes = val.layout.dims[dim]
    if not axes:
        return x
    start = block_index(axes, pg.mesh.sizes) * val.local_shape[dim]
    return x + lax.convert_element_type(start, x.dtype)


def _drawn_axes(node: PNode, pg: ParallelGraph) -> tuple[tuple[str, ...], ...]:
    """The mesh axes splitting each drawn dim of a ``random_bits`` (its output's dims after
    the keys')."""
    return pg.values[node.outputs[0]].layout.dims[pg.values[node.inputs[0]].spec.rank:]


def _random_block(keys: Any, node: PNode, pg: ParallelGraph) -> Any:
    """A ``random_bits`` whose drawn dims are split draws this device's block of the global
    draw: the same bits as that block of the one-device draw
    (:func:`autopar.graph.prng.draw_block`)."""
    val = pg.values[node.outputs[0]]
    k = pg.values[node.inputs[0]].spec.rank
    local = val.local_shape[k:]
    starts = [block_index(axes, pg.mesh.sizes) * n if axes else 0
              for axes, n in zip(_drawn_axes(node, pg), local)]
    return draw_block(keys, pg.values[node.inputs[0]].spec.dtype, node.params["bit_width"],
                      node.params["shape"], local, starts,
                      whole=lambda: node.primitive.bind(keys, **node.params))


def _read(env: dict[str, Any], pg: ParallelGraph, v: str) -> Any:
    if v in env:
        return env[v]
    val = pg.values[v]
    if val.data is None:
        raise AutoParallelError("value", v, "is read before it is computed")
    if is_key(val.spec.dtype):  # (a key constant holds its key data)
        return wrap_key(val.data, val.spec.dtype)
    return jnp.asarray(val.data, dtype=val.spec.dtype)


def psum_alike(axes: tuple[str, ...], alike: frozenset[str], mesh: DeviceMesh
               ) -> Callable[[Any], Any]:
    """AllReduce over ``axes`` of a value whose cotangent is the same on every device along
    the axes ``alike`` (:func:`autopar.cotangents.alike_axes`): its transpose sums over the
    step's other axes only and multiplies by the size of these, instead of communicating.

    Under ``check_vma=False`` ``lax.psum``'s transpose is a second AllReduce of the
    cotangent over all ``axes`` (a sync point in backward); summing equal values over an axis
    is multiplying by its size, computed locally. The loss's own final AllReduce (everything
    after it replicated) needs no communication in backward at all.
    """
    name = axis_name(axes)
    rest = tuple(a for a in axes if a not in alike)
    size = mesh.size_of(tuple(a for a in axes if a in alike))

    @jax.custom_vjp
    def psum(x: Any) -> Any:
        return lax.psum(x, name)

    def fwd(x: Any) -> tuple[Any, None]:
        return lax.psum(x, name), None

    def bwd(_: None, ct: Any) -> tuple[Any]:
        ct = lax.psum(ct, axis_name(rest)) if rest else ct
        return (ct * size,)

    psum.defvjp(fwd, bwd)
    return psum


def alike_psums(pg: ParallelGraph) -> Callable[[PNode, Any], Any]:
    """The ``run_step`` of :func:`run_body` for a program differentiated under
    ``check_vma=False``: each AllReduce whose output's cotangent is alike over some of its
    axes (:func:`autopar.cotangents.alike_axes`) runs as :func:`psum_alike`; every other
    node keeps its default (None)."""
    alike = alike_axes(pg)
    partly = {n.name: alike[n.outputs[0]] & frozenset(n.step.axes) for n in pg.nodes
              if n.step is not None and n.step.kind == "all_reduce"}

    def run_step(node: PNode, x: Any) -> Any:
        if partly.get(node.name):
            return psum_alike(node.step.axes, partly[node.name], pg.mesh)(x)  # type: ignore
        return None
    return run_step


def run_body(pg: ParallelGraph, *flat: Any,
             run_step: Callable[[PNode, Any], Any] | None = None,
             before_node: Callable[[int, PNode, dict[str, Any]], None] | None = None,
             vma: bool = False) -> tuple[Any, ...]:
    """The per-device program: local inputs (in ``pg.inputs`` order) -> local outputs.

    ``run_step(node, x)`` may replace how a communication node runs (the training step uses
    it for the loss all-reduce); it returns None to keep the default collective.
    ``before_node(i, node, env)`` runs before node ``i`` and may replace values in ``env``
    (the training step inserts its gradient-sync points there). ``vma``: the body runs under
    ``shard_map(check_vma=True)`` (see :func:`apply_step`).
    """
    env: dict[str, Any] = dict(zip(pg.inputs, flat))

    def one(node: PNode, local: dict[str, Any]) -> None:
        args = [_read(local, pg, v) for v in node.inputs]
        if node.step is not None:
            out = run_step(node, args[0]) if run_step is not None else None
            outs = [apply_step(args[0], node.step, pg.mesh, vma=vma) if out is None else out]
        elif node.is_fused:
            outs = run_fused(node, args, pg)
        elif node.kind == LOOP_KIND:  # one lax.scan of the body's program
            outs = run_loop(node, args, run_body, vma)
        else:
            outs = _bind(node, args, pg, vma)
        local.update(zip(node.outputs, outs))

    regions = spans(pg.nodes)
    last = _last_reads(pg) if regions else {}
    i = 0
    while i < len(pg.nodes):
        end = regions.get(i, i + 1)
        if before_node is not None:  # (a region's sync points are at its start)
            for k in range(i, end):
                before_node(k, pg.nodes[k], env)
        if i in regions:
            _run_region(pg, pg.nodes[i:end], env, [v for n in pg.nodes[i:end]
                                                   for v in n.outputs if last.get(v, -1) >= end],
                        one)
        else:
            one(pg.nodes[i], env)
        i = end
    return tuple(_read(env, pg, v) for v in pg.outputs)


def _last_reads(pg: ParallelGraph) -> dict[str, int]:
    """Value -> the index of the last node reading it (past the end: a program output)."""
    out = {v: i for i, n in enumerate(pg.nodes) for v in n.inputs}
    out.update((v, len(pg.nodes)) for v in pg.outputs)
    return out


def _run_region(pg: ParallelGraph, nodes: Sequence[PNode], env: dict[str, Any],
                outs: Sequence[str], one: Callable[[PNode, dict[str, Any]], None]) -> None:
    """One recomputation region's span of the program (:func:`autopar.graph.remat.spans`):
    its nodes run inside ``jax.checkpoint`` with the user's policy, from the values it reads
    in ``env`` to ``outs`` (what later nodes read), written into ``env``."""
    made = {v for n in nodes for v in n.outputs}
    reads = list(dict.fromkeys(v for n in nodes for v in n.inputs
                               if v not in made and v in env))
    remat = next(n.remat for n in nodes if n.remat is not None)

    def region(*xs: Any) -> tuple[Any, ...]:
        local = dict(zip(reads, xs))
        for node in nodes:
            one(node, local)
        return tuple(local[v] for v in outs)

    fn = jax.checkpoint(region, policy=remat.policy, prevent_cse=remat.prevent_cse)
    env.update(zip(outs, fn(*(env[v] for v in reads))))


# ---------------------------------------------------------------------------- lowering


class LoweredFunction:
    """The jitted ``shard_map`` program; call it with the original function's arguments."""

    def __init__(self, pg: ParallelGraph, mesh: Mesh, adapter: Any = None) -> None:
        self.parallel_graph = pg
        self.mesh = mesh
        # adapter (autopar.uneven.UnevenBatch): how inputs enter and outputs leave the body
        # when the caller's shapes are not the program's (an uneven batch, padded per device)
        self.adapter = adapter
        in_specs = tuple(pg.values[v].layout.partition_spec() for v in pg.inputs)
        out_specs = tuple(pg.values[v].layout.partition_spec() for v in pg.outputs)
        if adapter is not None:
            in_specs, out_specs = adapter.specs(pg, in_specs, out_specs)
        self.in_shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
        self.out_shardings = tuple(NamedSharding(mesh, s) for s in out_specs)

        # check_vma=True: JAX tracks which values vary over which axes, so the transpose sums
        # a replicated input's gradient only over the axes its uses vary along (a parameter
        # used only in replicated computation gets no all-reduce) and a final AllReduce
        # transposes to nothing. all_gather_matmul's ring result is the same on every device
        # but typed varying (no invarying cast exists), so programs using it run with
        # check_vma=False, where the transpose all-reduces every replicated input's gradient
        # and AllReduces whose cotangent is alike over their axes (the final one) are
        # differentiated locally (psum_alike).
        # An adapter's gathered outputs are replicated but typed varying: check_vma=False too.
        # A loop's carries may change variance across an iteration (lax.scan refuses that
        # under check_vma=True): programs with loops run with check_vma=False too.
        self.vma = adapter is None and not any(n.op == "all_gather_matmul"
                                               for n in pg.fused_nodes()) \
            and not any(n.kind == LOOP_KIND for n in pg.nodes)
        final_step = None if self.vma else alike_psums(pg)

        def body(*flat: Any) -> tuple[Any, ...]:
            if adapter is not None:
                return adapter.leave(pg, run_body(pg, *adapter.enter(pg, flat),
                                                  run_step=final_step, vma=self.vma))
            return run_body(pg, *flat, run_step=final_step, vma=self.vma)

        body.__name__ = f"autopar_{pg.name}".replace("<", "").replace(">", "")
        self.sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=self.vma)
        self.flat = jax.jit(self.sharded, in_shardings=self.in_shardings,
                            out_shardings=self.out_shardings)

    def place(self, *args: Any) -> list[Any]:
        """Check the arguments against the traced signature and put each leaf on the mesh."""
        pg = self.parallel_graph
        leaves, tree = flatten("arguments", tuple(args))
        if pg.in_tree is not None and tree != pg.in_tree:
            raise AutoParallelError("arguments", f"{len(args)} args", "must have the structure "
                                    f"of the example arguments ({pg.in_tree}); got {tree}")
        if len(leaves) != len(pg.inputs):
            raise AutoParallelError("arguments", f"{len(leaves)} leaves", f"expected "
                                    f"{len(pg.inputs)} array leaves")
        placed = []
        for v, x, sh in zip(pg.inputs, leaves, self.in_shardings):
            spec = pg.values[v].spec
            want = spec.shape if self.adapter is None else self.adapter.arg_shape(v, spec.shape)
            if tuple(np.shape(x)) != want:
                raise AutoParallelError(f"argument {v!r}", tuple(np.shape(x)),
                                        f"shape must be {want}, as in the example")
            if traced_dtype(x) != spec.dtype:
                raise AutoParallelError(f"argument {v!r}", traced_dtype(x),
                                        f"dtype must be {spec.dtype}, as in the example")
            placed.append(x)
        return put_on(placed, self.in_shardings, pg.inputs)

    def __call__(self, *args: Any) -> Any:
        try:
            outs = self.flat(*self.place(*args))
        except AutoparError:
            raise
        except Exception as e:  # under a transformation that cannot carry the placed arrays
            if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
                raise
            raise AutoParallelError(
                "arguments", "traced by a JAX transformation", "the parallel function runs "
                "under jax.jit, grad, jvp and value_and_grad; batching transformations (vmap, "
                "and jacfwd and hessian, which use it) cannot carry its placed arguments: "
                "apply them to the function before autopar.parallelize (JAX said: "
                f"{str(e).strip().splitlines()[0][:200]})") from e
        tree = self.parallel_graph.out_tree
        return jax.tree_util.tree_unflatten(tree, list(outs)) if tree is not None else outs

    def as_text(self, *args: Any) -> str:
        """The lowered StableHLO text of the program for these arguments."""
        return self.flat.lower(*self.place(*args)).as_text()


def lower(parallel_graph: ParallelGraph, mesh: Mesh | None = None, *,
          fused_kernels: FusedKernels | None = None, adapter: Any = None) -> LoweredFunction:
    """Lower a ParallelGraph to a jitted ``shard_map`` function (see the module docstring).

    ``mesh``: a ``jax.sharding.Mesh`` with the plan's axis names and sizes (default: the first
    ``device_num`` devices, row-major). Every node is checked at trace time: one that cannot
    run on its local shapes raises :class:`~autopar.errors.AutoParallelError` naming it.
    ``fused_kernels``: None (default) runs the program as rewritten; ``True`` / ``"auto"``
    applies the fused-kernel rules of :mod:`autopar.kernel_rules` first (``False`` adds none;
    nodes the rewrite already fused stay fused). ``adapter``: an
    :class:`autopar.uneven.UnevenBatch` for a batch split unevenly (``parallelize``'s
    ``uneven_batch="all_gather_v"``).
    """
    if not isinstance(parallel_graph, ParallelGraph):
        raise AutoParallelTypeError("parallel_graph", parallel_graph,
                                    "lower takes the ParallelGraph from autopar.rewrite.rewrite")
    pg = parallel_graph
    jmesh = jax_mesh(pg.mesh) if mesh is None else user_mesh(mesh, pg.mesh)
    if fused_kernels is not None:
        pg = fuse_kernels(pg, fused_kernels)
    _check_lowerable(pg)
    return LoweredFunction(pg, jmesh, adapter)


def _check_lowerable(pg: ParallelGraph) -> None:
    """Fail early, before any tracing, on nodes that cannot be lowered (a loop's body's
    too)."""
    for node in pg.nodes:
        if node.kind == LOOP_KIND:
            for program in body_programs(node):
                _check_lowerable(program)
        elif node.step is None and not node.is_fused:
            local_params(node, pg)
