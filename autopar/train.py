"""``train_step(loss_fn, params, batch)``: one parallel training step (forward, backward,
gradient synchronisation, optimizer update) as one jitted program on ``device_num`` devices.

The loss is traced, searched, rewritten and lowered exactly as :func:`autopar.parallelize`
does. Inside one ``jax.shard_map``, every device computes its **local** gradients with
``jax.vjp`` of the per-device program (every tensor-parallel collective transposes into its
dual: AllGather <-> ReduceScatter, AllReduce of a partial cotangent), seeding ``1 / device_num``
so that a gradient is partial over the mesh axes where its parameter is replicated -- except
those over which everything between it and the loss is repeated work, where every device holds
the same gradient and the step multiplies by their size instead
(:func:`autopar.cotangents.alike_axes`). The rest, its sync axes (``.sync_axes``), are summed
**explicitly**
(:mod:`autopar.grad_sync`), in the buckets of :func:`autopar.simulation.gradient_buckets` under the
context (``.buckets``): one collective per bucket and sync-axes group (``.sync_groups``).
With fusion configured (comm_fusion allreduce / all_reduce_fusion_config / an HCCL split
strategy), each bucket is synchronised at a sync point inside backward, as soon as its last
gradient exists, and XLA keeps exactly those buckets in the compiled program
(``.compiled_text``); fusion closed (nothing set) lowers one all-reduce per gradient, which
XLA's CPU combiner is then free to merge. ``grad_accumulation_step = g``: the batch given is g
micro-batches (dim 0 = g x the traced micro-batch), a ``lax.scan`` accumulates their local
gradients, which are synchronised once. ``enable_parallel_optimizer``: see
:mod:`autopar.optimizer_shard`. The optax update runs outside the ``shard_map`` on the
synchronised gradients (exact for every optimizer). Only the parameters' floating-point
leaves are differentiated and updated; the others (integers, booleans, PRNG keys) are
carried unchanged, and ``has_aux`` returns the loss's auxiliary outputs too (both:
:func:`train_step`). ``train_step`` reads the context once, at
its entry, and hands that configuration to :class:`TrainStep` (under ``pipeline_stages > 1``
to :class:`autopar.pipeline.step.PipelineTrainStep`). The context keys:

- ``gradients_mean=True``: the synchronised gradient is the gradient of the global loss
  (the single-device reference). ``gradients_mean=False`` (MindSpore's default): the summed
  gradient MindSpore produces when every device differentiates its own per-device mean loss,
  i.e. ``dp x`` the reference, where ``dp`` is the data-parallel degree (the number of pieces
  dim 0 of the batch is split into, :attr:`TrainStep.data_parallel_degree`). A step built
  with ``dp > 1`` and the key never set warns of it once per process
  (:func:`autopar.step_inputs.warn_gradients_mean`).
- ``loss_repeated_mean=True`` (default): a loss computed redundantly on ``r = device_num / dp``
  devices contributes once (mean over the repeats). ``False``: the repeats are summed, so the
  gradient is multiplied by ``r`` (1 under pure data parallel, where nothing is repeated).
- ``gradient_fp32_sync=True`` (default; semi_auto_parallel and auto_parallel only, as in
  MindSpore -- elsewhere gradients are all-reduced in their own dtype): bf16/fp16 gradients
  are cast to fp32 for their AllReduce / ReduceScatter and cast back to the parameter dtype
  before the optimizer.
- ``parameter_broadcast``: autopar takes one global parameter pytree, so every device starts
  from the same values by construction; :func:`autopar.step_inputs.broadcast_parameters` makes this
  explicit for arrays whose per-device copies may differ (rank 0's copy wins), and
  :meth:`TrainStep.prepare` applies it when the key is set.
- ``dataset_strategy`` / ``full_batch`` / ``enable_alltoall``: chosen by the search (the
  batch inputs' layouts, the redistribution steps); the step runs whatever the plan says.

``backend="pmap"`` (``parallel_mode="data_parallel"`` only) runs the same step with
``jax.pmap``: the batch is reshaped to ``[device_num, batch / device_num, ...]``, each device
differentiates its own loss, and ``lax.psum`` synchronises the gradients (divided by
``device_num`` under ``gradients_mean``). This assumes the loss is a mean over batch rows (as
MindSpore's data parallel does); it then gives the same numbers as the ``shard_map`` path.

>>> import jax, autopar as ap
>>> from autopar.models import mlp
>>> m = mlp(widths=(8, 16, 8), batch=8)
>>> params, x = m.example_args(jax.random.key(0))
>>> with ap.auto_parallel_context(device_num=4, parallel_mode="data_parallel",
...                               gradients_mean=True):
...     step = ap.train_step(m.loss, params, (x,))
>>> state = step.init(params)
>>> params2, state, loss = step(params, state, x)
>>> step.data_parallel_degree
4
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.config import AutoParallelConfig
from autopar.cotangents import alike_axes
from autopar.planner import StrategySave, save_strategies, strategy_saves
from autopar.setup import Setup, resolve_setup
from autopar.errors import AutoParallelError, AutoParallelTypeError, user_stacklevel
from autopar.fusion import GradientBuckets, buckets_from_ends, gradient_buckets
from autopar.grad_sync import (LOW_PRECISION, METHODS, data_parallel_degree, fp32_sync_active,
                               gradient_scale, replicated_axes, sync_gradients, sync_groups,
                               sync_point, sync_sites)
from autopar.kernel_rules import FusedKernels, check_fused_kernels
from autopar.lower import alike_psums, put_on, run_body
from autopar.graph.tracer import flatten, traced_dtype
from autopar.inspection import ProgramInspection
from autopar.optimizer_shard import (ShardDecision, decide_sharding, gather_parameters,
                                     scatter_gradients, state_shardings, storage_spec,
                                     warn_fallbacks)
from autopar.parallel_graph import ParallelGraph
from autopar.parallel_function import parallel_function
from autopar.pipeline.configure import configured
from autopar.pipeline.plan import stage_saves
from autopar.pipeline.step import PipelineTrainStep
from autopar.strategies.plan import Plan
from autopar.step_inputs import (DEFAULT_LEARNING_RATE, ParamSplit, broadcast_parameters,
                                 check_arrays, check_loss, check_opt_state, check_trainable,
                                 step_arguments, warn_gradients_mean, without_keys)

#: ``DEFAULT_LEARNING_RATE`` (defined with the other step inputs) stays part of this module's
#: interface: train_step's default optimizer is ``optax.sgd(DEFAULT_LEARNING_RATE)``.
__all__ = ["train_step", "TrainStep", "train_body", "check_step_arguments", "micro_batch",
           "DEFAULT_LEARNING_RATE"]

BACKENDS = ("shard_map", "pmap")


def train_body(pg: ParallelGraph, *flat: Any,
               before_node: Callable[[int, Any, dict[str, Any]], None] | None = None) \
        -> tuple[Any, ...]:
    """``lower.run_body`` for training: an AllReduce whose cotangent is alike over its axes
    (the loss's) is differentiated without a second AllReduce
    (:func:`autopar.lower.alike_psums`); ``before_node`` inserts the gradient sync points;
    everything else is the same program."""
    return run_body(pg, *flat, run_step=alike_psums(pg), before_node=before_node)


class TrainStep(ProgramInspection):
    """A jitted parallel training step: ``step(params, opt_state, *batch) -> (params,
    opt_state, loss)`` (``has_aux``: ``(params, opt_state, (loss, aux))``); ``.init``,
    ``.prepare``, ``.grads``, ``.plan``, ``.parallel_graph``, ``.as_text``,
    ``.compiled_text``, and the gradient-sync set-up (``.buckets``, ``.sync_groups``,
    ``.sharding``). ``.tuning``: the measurements that chose the plan
    (:class:`autopar.tune.Tuning`) when the step was tuned (``train_step(..., tune=k)``),
    else None. ``.split``: which parameter leaves are trained and which carried
    (:class:`autopar.step_inputs.ParamSplit`). ``.configuration``: under
    ``auto_pipeline=True``, the configuration search that chose one stage
    (:class:`autopar.pipeline.configure.ConfigurationSearch`), else None."""

    tuning: Any = None
    configuration: Any = None

    def __init__(self, loss_fn: Callable[..., Any], params: Any, batch: tuple[Any, ...],
                 optimizer: optax.GradientTransformation, *, setup: Setup,
                 mode: str | None, fixed: Mapping[str, Any] | None,
                 backend: str, mesh: Mesh | None, sync_method: str,
                 fused_kernels: FusedKernels = "auto", plan: Plan | None = None,
                 has_aux: bool = False, searched: Plan | None = None) -> None:
        """Built by :func:`train_step`, which reads the stores once and passes its ``setup``
        (:class:`autopar.setup.Setup`; nothing here reads a store). ``plan``: run this plan
        (searched on the loss at the step's micro-batch) instead of searching, as a tuning
        does; ``searched``: the configuration search's plan of this step, taken where it was
        searched on the step's own graph (:func:`~autopar.parallel_function.
        parallel_function`)."""
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.backend = backend
        self.sync_method = sync_method
        self.has_aux = has_aux
        self.setup = setup
        self._read_config(setup.config)
        b_leaves, self._b_tree = jax.tree_util.tree_flatten(tuple(batch))
        self.batch_shapes = [tuple(np.shape(x)) for x in b_leaves]
        micro = micro_batch(batch, self.accumulation)
        self.split = ParamSplit(params, keys_in_program=backend != "pmap")
        traced_fn, traced_params = self.split.traced(loss_fn, params, micro)
        self.function = parallel_function(traced_fn, (traced_params, *micro), None, setup,
                                          mode=mode, fixed=fixed, mesh=mesh,
                                          fused_kernels=fused_kernels, plan=plan,
                                          optimizer=optimizer,
                                          micro_batches=self.accumulation, searched=searched,
                                          recompute=setup.config.recompute)
        self.plan = self.function.plan
        self.parallel_graph = pg = self.function.parallel_graph
        self.mesh: Mesh = self.function.mesh
        self.device_num = pg.device_num
        out_tree = self.function.graph.out_tree
        check_loss(loss_fn, [pg.values[v].spec for v in pg.outputs], out_tree, has_aux)
        self._aux_tree = out_tree.children()[1] if has_aux else None
        self._setup_inputs(params)
        self._setup_sync(self._threshold_kb)
        if backend == "pmap":
            self._build_pmap(batch)
        else:
            self._build_shard_map()

    def _read_config(self, cfg: AutoParallelConfig) -> None:
        """The context keys the step uses, from the configuration :func:`train_step` read."""
        self.gradients_mean = bool(cfg.gradients_mean)
        self.gradient_fp32_sync = bool(cfg.gradient_fp32_sync)
        self.loss_repeated_mean = bool(cfg.loss_repeated_mean)
        self.parameter_broadcast = bool(cfg.parameter_broadcast)
        self.parallel_mode = cfg.parallel_mode
        self.accumulation = int(cfg.grad_accumulation_step)
        self.parallel_optimizer = bool(cfg.enable_parallel_optimizer)
        po = cfg.parallel_optimizer_config
        self.accumulation_shard = bool(po.gradient_accumulation_shard)
        self._threshold_kb = po.parallel_optimizer_threshold
        self._shard_size = int(po.optimizer_weight_shard_size)

    def _setup_inputs(self, params: Any) -> None:
        """Parameters and batch inputs: dtypes, the data-parallel degree and the gradient
        scale it gives, low-precision casts, and the shardings of the plan's layouts. The
        parameters of the program are the leaves but typed PRNG keys (``self.split``)."""
        pg = self.parallel_graph
        p_leaves = self.split.graph_leaves(jax.tree_util.tree_leaves(params))
        self._p_tree = self.split.tree
        self._n_params = len(p_leaves)
        self._trained = [k in self.split.trained for k in range(self._n_params)]
        self._p_dtypes = [traced_dtype(x) for x in p_leaves]  # (a Python float leaf too)
        self._n_batch = len(pg.inputs) - self._n_params
        batch_vals = [pg.values[v] for v in pg.inputs[self._n_params:]]
        self.data_parallel_degree = data_parallel_degree(batch_vals, pg.mesh)
        for v in batch_vals:  # the search only splits evenly; never run an uneven split
            split = pg.mesh.size_of(v.layout.dims[0]) if v.spec.shape else 1
            if v.spec.shape and v.spec.shape[0] % split:
                raise _uneven(v.spec.shape[0], split, v.name)
        dp = self.data_parallel_degree
        self.repeat = max(1, self.device_num // dp)
        self.grad_scale = gradient_scale(dp, self.device_num, gradients_mean=self.gradients_mean,
                                         loss_repeated_mean=self.loss_repeated_mean)
        fp32 = fp32_sync_active(self.gradient_fp32_sync, self.parallel_mode)
        self._cast = [fp32 and d in LOW_PRECISION for d in self._p_dtypes]
        self.param_shardings = [NamedSharding(self.mesh, pg.values[v].layout.partition_spec())
                                for v in pg.inputs[:self._n_params]]
        self.batch_shardings = [NamedSharding(self.mesh, v.layout.partition_spec())
                                for v in batch_vals]

    # ------------------------------------------------------------------ gradient sync set-up

    def _setup_sync(self, threshold_kb: int) -> None:
        """Sync axes, parallel-optimizer decisions (an optimizer_weight_shard_size that does
        not fit a parameter's group is warned about) and the buckets of all three kinds."""
        pg, n_p = self.parallel_graph, self._n_params
        names = list(pg.inputs[:n_p])
        sizes = pg.mesh.sizes
        self.sharding: list[ShardDecision] = []
        for v, trained in zip(names, self._trained):  # (a carried leaf: no gradient, kept)
            val = pg.values[v]
            self.sharding.append(decide_sharding(
                v, val.spec.shape, val.local_shape, val.spec.itemsize,
                replicated_axes(val.layout, pg.mesh), sizes,
                enabled=self.parallel_optimizer and trained, threshold_kb=threshold_kb,
                shard_size=self._shard_size))
        warn_fallbacks(self.sharding, stacklevel=user_stacklevel())  # (the user's line)
        self._sharded = [d.sharded for d in self.sharding]
        self.sync_axes, self._alike_factor = self._sync_axes(names)
        self.storage_shardings = [
            NamedSharding(self.mesh, storage_spec(s.spec, d.axes, len(pg.values[v].spec.shape)))
            if d.sharded else s for v, s, d in zip(names, self.param_shardings, self.sharding)]
        trained = {n for n, t in zip(names, self._trained) if t}
        order = [n for n in self.function.graph.gradient_order() if n in trained]
        order += [n for n in names if n in trained and n not in set(order)]
        self.gradient_order = tuple(order)
        nbytes = {v: math.prod(pg.values[v].local_shape) * pg.values[v].spec.itemsize
                  for v in names}
        pos = {v: i for i, v in enumerate(names)}

        def buckets(kind: str, members: list[str]) -> GradientBuckets | None:
            if not members:
                return None
            return gradient_buckets([(m, int(nbytes[m])) for m in members], kind=kind,
                                    resolved=self.setup.resolved, split=self.setup.split)

        ar = [n for n in order if not self._sharded[pos[n]]]
        rs = [n for n in order if self._sharded[pos[n]]]
        full = buckets("allreduce", order) if rs else None  # (index splits count every one)
        self.buckets: dict[str, GradientBuckets | None] = {
            "allreduce": _index_over(full, ar) if full is not None and full.mode in (
                "index", "hccl_index") else buckets("allreduce", ar),
            "reducescatter": buckets("reducescatter", rs),
            "allgather": buckets("allgather", rs[::-1])}
        self._bucket_idx = {k: ([[pos[n] for n in bk.gradients] for bk in b] if b else [])
                            for k, b in self.buckets.items()}
        ar_b = self.buckets["allreduce"]
        self._chain = {"allreduce": ar_b is not None and ar_b.mode != "none"}
        # each gradient's axes for its all-reduce (unsharded) / reduce-scatter (sharded, over
        # its shard group) / all-reduce of its shard across the groups (optimizer_weight_
        # shard_size below the group: over the replica axes)
        self._ar_axes = [a if not s else () for a, s in zip(self.sync_axes, self._sharded)]
        self._rs_axes = [d.axes if d.sharded else () for d in self.sharding]
        self._xr_axes = [d.replicas if d.sharded else () for d in self.sharding]
        # a carried leaf (no gradient): a bucket of its own with no axes, never synchronised
        self._carried_idx = [[i] for i in range(n_p) if not self._trained[i]]
        self.sync_groups = sync_groups(self._ar_axes, self._bucket_idx["allreduce"]
                                       + [[i] for i in range(n_p) if self._sharded[i]]
                                       + self._carried_idx)

    def _sync_axes(self, names: list[str]) -> tuple[list[tuple[str, ...]], list[int]]:
        """Each gradient's sync axes -- the axes its parameter is replicated on, less (when
        it is not sharded by the parallel optimizer) those over which its cotangent is the
        same on every device (:func:`autopar.cotangents.alike_axes`: work repeated there) --
        and the factor that replaces summing over the latter (their size)."""
        pg = self.parallel_graph
        alike = alike_axes(pg)
        axes, factors = [], []
        for v, sharded, trained in zip(names, self._sharded, self._trained):
            rep = replicated_axes(pg.values[v].layout, pg.mesh) if trained else ()
            skip = () if sharded else tuple(a for a in rep if a in alike[v])
            axes.append(tuple(a for a in rep if a not in skip))
            factors.append(pg.mesh.size_of(skip))
        return axes, factors

    def _sync(self, g: list[Any], *, scatter: bool = True, reduce: bool = True,
              across: bool = True) -> list[Any]:
        """All-reduce (non-sharded, ``reduce``) and reduce-scatter (sharded, ``scatter``) the
        local gradients; then (``across``) all-reduce the sharded ones' shards across their
        shard groups (only under an optimizer_weight_shard_size below the group)."""
        n_p, sh = self._n_params, self._sharded
        out = list(g)
        if reduce:
            idx = self._bucket_idx["allreduce"] + [[i] for i in range(n_p) if sh[i]] + \
                self._carried_idx
            out = sync_gradients(out, self._ar_axes, idx, method=self.sync_method,
                                 chain=self._chain["allreduce"], fp32=self._cast)
        rs_idx = self._bucket_idx["reducescatter"] + [[i] for i in range(n_p) if not sh[i]]
        if scatter and any(sh):
            out = scatter_gradients(out, self._rs_axes, rs_idx, fp32=self._cast)
        if across and any(self._xr_axes):  # in the reduce-scatter buckets
            out = sync_gradients(out, self._xr_axes, rs_idx, method=self.sync_method,
                                 chain=False, fp32=self._cast)
        return out

    # ------------------------------------------------------------------ shard_map path

    def _build_shard_map(self) -> None:
        """The jitted step: one ``shard_map`` of :meth:`_local_body`, then the optax update."""
        p_specs = tuple(s.spec for s in self.storage_shardings)
        b_specs = tuple(s.spec for s in self._feed_shardings())
        g_specs = tuple(p_specs[k] for k in self.split.trained)
        pg, lead = self.parallel_graph, (None,) if self.accumulation > 1 else ()
        aux_specs = tuple(PartitionSpec(*lead, *pg.values[v].layout.partition_spec())
                          for v in pg.outputs[1:])  # (per micro-batch: stacked)
        sharded = jax.shard_map(self._local_body(), mesh=self.mesh, in_specs=p_specs + b_specs,
                                out_specs=(PartitionSpec(),) + g_specs + aux_specs,
                                check_vma=False)
        self._grads, self._step = self._jit_step(sharded)

    def _local_body(self) -> Callable[..., tuple[Any, ...]]:
        """Each device's program: gather sharded parameters, local gradients (accumulated
        over micro-batches), synchronised and scaled: ``(loss, *gradients of the trained
        leaves, *aux leaves)``."""
        n_p, dtypes, sh, acc = self._n_params, self._p_dtypes, self._sharded, self.accumulation
        scales = [self.grad_scale / acc * f for f in self._alike_factor]
        in_backward, local_grads = self._local_grads()

        def body(*flat: Any) -> tuple[Any, ...]:
            p, b = list(flat[:n_p]), list(flat[n_p:])
            if any(sh):
                p = gather_parameters(p, self._rs_axes, self._bucket_idx["allgather"] +
                                      [[i] for i in range(n_p) if not sh[i]])
            if acc == 1:
                loss, g, aux = local_grads(p, b)
                g = self._sync(g, reduce=not in_backward)
            else:
                loss, g, aux = self._accumulated_grads(local_grads, p, b)
            g = [(g[k] * scales[k] if scales[k] != 1.0 else g[k]).astype(dtypes[k])
                 for k in self.split.trained]
            return (loss, *g, *aux)
        return body

    def _local_grads(self) -> tuple[bool, Callable[[list[Any], list[Any]], tuple[Any, ...]]]:
        """``(in_backward, local_grads)``: ``local_grads(params, batch)`` is ``(loss, local
        gradients, aux)`` by ``jax.vjp`` of the trained parameters (a carried one's entry:
        zeros, never synchronised nor returned); with configured buckets and no accumulation
        (``in_backward``), each bucket is all-reduced at its sync point inside backward."""
        pg, N = self.parallel_graph, self.device_num
        ar_axes = self._ar_axes
        ar_buckets = [[i for i in bk if ar_axes[i]] for bk in self._bucket_idx["allreduce"]]
        # configured buckets (acc == 1): synchronised inside backward at sync points
        in_backward = self.accumulation == 1 and self._chain["allreduce"]
        sites = sync_sites(pg, ar_buckets) if in_backward else {}
        before = self._sync_points(ar_buckets, sites) if sites else None

        trained = self.split.trained

        def local_grads(p: list[Any], b: list[Any]) -> tuple[Any, list[Any], list[Any]]:
            def program(*tp: Any) -> tuple[Any, list[Any]]:
                full = list(p)
                for k, x in zip(trained, tp):
                    full[k] = x
                out = train_body(pg, *full, *b, before_node=before)
                return out[0], list(out[1:])

            loss, vjp, aux = jax.vjp(program, *(p[k] for k in trained), has_aux=True)
            # every device seeds 1/N: cotangents of replicated values are partial over the
            # axes they are replicated on, so a gradient is partial over its sync axes
            g = [jnp.zeros_like(x) for x in p]
            for k, x in zip(trained, vjp(jnp.asarray(1.0 / N, loss.dtype))):
                g[k] = x
            return loss, g, aux
        return in_backward, local_grads

    def _sync_points(self, ar_buckets: list[list[int]], sites: dict[int, Any]
                     ) -> Callable[[int, Any, dict[str, Any]], None]:
        """The ``before_node`` hook of :func:`train_body` that runs each bucket's sync point
        (:func:`autopar.grad_sync.sync_point`) at its site in the program."""
        ar_axes, cast, method = self._ar_axes, self._cast, self.sync_method
        names = self.parallel_graph.inputs[:self._n_params]

        def point(k: int) -> Callable[..., Any]:
            members = ar_buckets[k]

            def sync(cts: list[Any]) -> list[Any]:
                return sync_gradients(cts, [ar_axes[i] for i in members], [list(range(
                    len(members)))], method=method, chain=False, fp32=[cast[i] for i in members])
            return sync_point(sync)

        points = {k: point(k) for at in sites for k, _ in sites[at]}

        def before(i: int, node: Any, env: dict[str, Any]) -> None:
            for k, live in sites.get(i, ()):
                ps = tuple(env[names[m]] for m in ar_buckets[k])
                acts = tuple(env[v] for v in live)
                ps, acts = points[k](ps, acts)
                env.update(zip((names[m] for m in ar_buckets[k]), ps))
                env.update(zip(live, acts))
        return before

    def _accumulated_grads(self, local_grads: Callable[..., Any], p: list[Any],
                           micro: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """``grad_accumulation_step`` micro-batches (``micro``: ``(acc, micro-batch, ...)``,
        micro-batch k = global rows k*B/acc...) summed by a ``lax.scan``, synchronised once;
        with ``gradient_accumulation_shard`` the sums are kept reduce-scattered. The aux
        leaves come back per micro-batch, stacked along a new leading dim."""
        sh, gather_axes, sizes = self._sharded, self._rs_axes, self.parallel_graph.mesh.sizes
        shard_acc = self.accumulation_shard and any(sh)

        def one(carry: list[Any], mb: list[Any]) -> tuple[list[Any], Any]:
            loss, g, aux = local_grads(p, mb)
            if shard_acc:  # gradient_accumulation_shard: keep sharded sums (summed across
                g = self._sync(g, reduce=False, across=False)  # the groups once, at the end)
            return [c + x for c, x in zip(carry, g)], (loss, aux)

        zeros = [jnp.zeros(_acc_shape(x.shape, sh[i] and shard_acc, gather_axes[i], sizes),
                           x.dtype) for i, x in enumerate(p)]
        g, (losses, aux) = lax.scan(one, zeros, micro)
        return jnp.mean(losses), self._sync(g, scatter=not shard_acc), aux

    def _jit_step(self, sharded: Callable[..., Any]) -> tuple[Any, Any]:
        """``(grads, step)`` jitted around the ``shard_map`` program: the optax update runs
        outside it, on the synchronised gradients; the parameters and, with the parallel
        optimizer, the optimizer state stay on their storage layouts. The optimizer sees
        the trained leaves only (``split.optimizer_tree``: None at every carried one), which
        the step returns as they came. ``value``: the loss, or ``(loss, aux)``."""
        storage, opt, split = self.storage_shardings, self.optimizer, self.split
        sh, dtypes, trained = self._sharded, self._p_dtypes, split.trained
        n_g, aux_tree = len(trained), self._aux_tree

        def grads(p_leaves: list[Any], b_leaves: list[Any]) -> tuple[Any, list[Any]]:
            out = sharded(*p_leaves, *b_leaves)
            if aux_tree is None:
                return out[0], list(out[1:])
            return (out[0], jax.tree_util.tree_unflatten(aux_tree, out[1 + n_g:])), \
                list(out[1:1 + n_g])

        updated = frozenset(trained)  # (the carried leaves keep their dtype: keys have none)

        def step(p_leaves: list[Any], opt_state: Any, b_leaves: list[Any]) -> tuple:
            value, g = grads(p_leaves, b_leaves)
            params = split.optimizer_tree([p_leaves[k] for k in trained])
            updates, opt_state = opt.update(split.optimizer_tree(g), opt_state, params)
            new = list(p_leaves)  # (the carried leaves as they came)
            for k, x in zip(trained, jax.tree_util.tree_leaves(
                    optax.apply_updates(params, updates))):
                new[k] = x
            new = [lax.with_sharding_constraint(x.astype(d) if k in updated else x, s)
                   for k, (x, d, s) in enumerate(zip(new, dtypes, storage))]
            if any(sh):  # the optimizer state stays on the parameters' storage layout
                st = state_shardings(opt, opt_state, split.optimizer_tree(
                    [storage[k] for k in trained]), self.mesh, split.optimizer_tree(
                    [jax.ShapeDtypeStruct(p_leaves[k].shape, np.float32) for k in trained]))
                opt_state = jax.tree.map(lax.with_sharding_constraint, opt_state, st)
            return new, opt_state, value

        return jax.jit(grads), jax.jit(step)

    def _check_inputs(self, params: Any, batch: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The leaves of ``params`` the program takes (every one but typed PRNG keys) and
        of ``batch``, checked against the example's: the structure, every shape and dtype
        (both backends)."""
        leaves = self._param_leaves(params)
        self.split.key_leaves(leaves)  # (checked: the step hands them back as they are)
        leaves = self.split.graph_leaves(leaves)
        b_leaves, b_tree = flatten("batch", tuple(batch))
        if b_tree != self._b_tree:  # (the same shapes in another order: a silent swap)
            raise AutoParallelError("batch", f"{len(b_leaves)} leaves", f"must have the "
                                    f"structure of the example batch ({self._b_tree})")
        if [tuple(np.shape(x)) for x in b_leaves] != self.batch_shapes:
            raise AutoParallelError("batch", [tuple(np.shape(x)) for x in b_leaves],
                                    f"shapes must be {self.batch_shapes}, as in the example")
        pg = self.parallel_graph
        for k, (v, x) in enumerate(zip(pg.inputs, list(leaves) + list(b_leaves))):
            spec = pg.values[v].spec
            if k < len(leaves) and tuple(np.shape(x)) != spec.shape:
                raise AutoParallelError(f"argument {v!r}", tuple(np.shape(x)), f"shape must "
                                        f"be {spec.shape}, as in the example")
            if traced_dtype(x) != spec.dtype:
                raise AutoParallelError(f"argument {v!r}", traced_dtype(x), f"dtype must "
                                        f"be {spec.dtype}, as in the example")
        return leaves, b_leaves

    def _param_leaves(self, params: Any) -> list[Any]:
        """The leaves of ``params``, which must have the example parameters' structure."""
        leaves, tree = jax.tree_util.tree_flatten(params)
        if tree != self._p_tree:
            raise AutoParallelError("params", f"{len(leaves)} leaves", f"must have the "
                                    f"structure of the example parameters ({self._p_tree})")
        return leaves

    def _place(self, params: Any, batch: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        leaves, b_leaves = self._check_inputs(params, batch)
        p = put_on(leaves, self.storage_shardings)
        acc = self.accumulation
        if acc > 1:  # micro-batch k is global rows [k*B/acc, (k+1)*B/acc) of every input
            b_leaves = [(np.reshape if isinstance(x, np.ndarray) else jnp.reshape)(
                x, (acc, np.shape(x)[0] // acc) + tuple(np.shape(x)[1:])) for x in b_leaves]
        return p, put_on(b_leaves, self._feed_shardings())

    def _feed_shardings(self) -> list[NamedSharding]:
        """How batch inputs enter the step: their plan layouts; with gradient accumulation a
        leading micro-batch dim (not split) in front."""
        if self.accumulation == 1:
            return list(self.batch_shardings)
        return [NamedSharding(self.mesh, PartitionSpec(None, *s.spec))
                for s in self.batch_shardings]

    # ------------------------------------------------------------------ pmap path

    def _build_pmap(self, batch: tuple[Any, ...]) -> None:
        if self.has_aux:
            raise AutoParallelError("has_aux", True, "the pmap lowering differentiates each "
                                    "device's own loss on its rows, so an aux output would be "
                                    "each device's, not the global batch's",
                                    "Use backend='shard_map'")
        if self.parallel_mode != "data_parallel":
            raise AutoParallelError("backend", "pmap", "the pmap lowering runs "
                                    f"parallel_mode='data_parallel' only (got "
                                    f"{self.parallel_mode!r})", "Use backend='shard_map'")
        if jax.process_count() > 1:
            raise AutoParallelError("backend", "pmap", "the pmap lowering runs in one process "
                                    f"(this is one of {jax.process_count()} under "
                                    "jax.distributed)", "Use backend='shard_map'")
        if any(self._sharded):
            raise AutoParallelError("backend", "pmap", "the pmap lowering does not run the "
                                    "parallel optimizer (enable_parallel_optimizer=True shards "
                                    f"{sum(self._sharded)} parameters)",
                                    "Use backend='shard_map'")
        n = self.device_num
        for x in jax.tree_util.tree_leaves(batch):
            if not np.shape(x):
                raise AutoParallelError("backend", "pmap", "the pmap lowering splits dim 0 of "
                                        "every batch input over the devices, and a batch input "
                                        "is a scalar", "Use backend='shard_map'")
            if np.shape(x)[0] % n:
                raise _uneven(np.shape(x)[0], n, "batch")
        loss_fn, dtypes, cast, split = self.loss_fn, self._p_dtypes, self._cast, self.split
        mean, trained = self.gradients_mean, split.trained
        buckets = self._bucket_idx["allreduce"] + self._carried_idx
        chain = self._chain["allreduce"]
        method, axes = self.sync_method, [("dp",) if t else () for t in self._trained]

        def local_grads(params: Any, *b: Any) -> tuple[Any, Any]:
            leaves = jax.tree_util.tree_leaves(params)
            graph, keys = split.graph_leaves(leaves), [leaves[i] for i in split.keys]

            def loss_of(tp: list[Any]) -> Any:  # of the trained leaves; the rest carried
                full = list(graph)
                for k, x in zip(trained, tp):
                    full[k] = x
                return loss_fn(split.unflatten(full, keys), *b)

            loss, gt = jax.value_and_grad(loss_of)([graph[k] for k in trained])
            g = list(graph)  # (a carried leaf's entry: no sync axes, dropped below)
            for k, x in zip(trained, gt):
                g[k] = x
            # the context's buckets, one psum each over the pmap axis (as the shard_map path)
            g = sync_gradients(g, axes, buckets, method=method, chain=chain, fp32=cast)
            g = [(g[k] / n if mean else g[k]).astype(dtypes[k]) for k in trained]
            return lax.pmean(loss, "dp"), split.optimizer_tree(g)

        def local_step(params: Any, opt_state: Any, *b: Any) -> tuple:
            loss, g = local_grads(params, *b)
            masked = split.masked(params)
            updates, opt_state = self.optimizer.update(g, opt_state, masked)
            leaves = jax.tree_util.tree_leaves(params)
            new = split.graph_leaves(leaves)
            for k, x in zip(trained, jax.tree_util.tree_leaves(
                    optax.apply_updates(masked, updates))):
                new[k] = x
            return split.unflatten(new, [leaves[i] for i in split.keys]), opt_state, loss

        devices = list(np.asarray(self.mesh.devices).flat)
        k = len(batch)
        self._pgrads = jax.pmap(local_grads, axis_name="dp", in_axes=(None,) + (0,) * k,
                                devices=devices)
        self._pstep = jax.pmap(local_step, axis_name="dp", in_axes=(None, None) + (0,) * k,
                               devices=devices)

    def _split(self, params: Any, batch: Sequence[Any]) -> list[Any]:
        """The pmap path's batch, checked as the shard_map path's, dim 0 split per device."""
        self._check_inputs(params, batch)
        n = self.device_num
        return [jax.tree.map(lambda x: jnp.reshape(x, (n, x.shape[0] // n) + x.shape[1:]), b)
                for b in batch]

    # ------------------------------------------------------------------ public

    def init(self, params: Any) -> Any:
        """The optimizer state for the trained leaves of ``params`` (``optimizer.init`` of
        ``split.masked(params)``: None at every carried leaf); with the parallel optimizer
        its parameter-shaped leaves are placed sharded like their parameters."""
        masked = self.split.masked(params)
        state = self.optimizer.init(masked)
        if self.backend == "pmap" or not any(self._sharded):
            return state
        st = state_shardings(self.optimizer, state, self.split.optimizer_tree(
            [self.storage_shardings[k] for k in self.split.trained]), self.mesh,
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.float32), masked))
        return jax.tree.map(jax.device_put, state, st)

    def prepare(self, params: Any) -> Any:
        """``params`` placed on their storage layouts (the plan's, or sharded by the parallel
        optimizer); with ``parameter_broadcast`` set, rank 0's values are broadcast first
        (:func:`autopar.step_inputs.broadcast_parameters`)."""
        leaves = jax.tree_util.tree_leaves(params)
        graph, keys = self.split.graph_leaves(leaves), [leaves[i] for i in self.split.keys]
        if self.parameter_broadcast:
            graph = broadcast_parameters(graph, self.mesh)
        return self.split.unflatten(put_on(graph, self.storage_shardings), keys)

    def grads(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        """``(value, synchronised gradients)`` as the step feeds them to the optimizer, as
        ``jax.value_and_grad(loss_fn, has_aux=self.has_aux)`` gives them: ``value`` the loss
        or ``(loss, aux)``; the gradients a tree like ``params`` with None at every carried
        (non-float) leaf."""
        if self.backend == "pmap":
            loss, g = self._pgrads(params, *self._split(params, batch))
            return loss[0], jax.tree.map(lambda x: x[0], g)
        p, b = self._place(params, batch)
        value, g = self._grads(p, b)
        return value, self.split.optimizer_tree(g)

    def __call__(self, params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        """One step: ``(params, opt_state, value)``, ``value`` the loss or, under
        ``has_aux``, ``(loss, aux)``; the carried leaves of ``params`` come back unchanged."""
        self._check_state(params, opt_state)
        if self.backend == "pmap":
            p, s, loss = self._pstep(params, opt_state, *self._split(params, batch))
            first = lambda x: x[0]  # noqa: E731 - replicated over the pmap axis
            return jax.tree.map(first, p), jax.tree.map(first, s), loss[0]
        p, b = self._place(params, batch)
        new, opt_state, value = self._step(p, opt_state, b)
        leaves = jax.tree_util.tree_leaves(params)
        return self.split.unflatten(new, [leaves[i] for i in self.split.keys]), opt_state, value

    def _check_state(self, params: Any, opt_state: Any) -> None:
        """``opt_state`` must be what ``init(params)`` makes (:func:`check_opt_state`, over
        the trained leaves)."""
        check_arrays("params", without_keys(params), none=True)
        self._param_leaves(params)
        check_opt_state(self.optimizer, self.split.masked(params), opt_state,
                        self.__dict__.setdefault("_state_specs", {}))

    def lower(self, params: Any, opt_state: Any, *batch: Any) -> Any:
        """The ``jax.stages.Lowered`` step (forward, backward, sync, update): ``.as_text()``,
        ``.compile()``; :meth:`as_text`, :meth:`compiled_text` and
        :meth:`collective_counts` read it."""
        if self.backend == "pmap":
            return self._pstep.lower(params, opt_state, *self._split(params, batch))
        p, b = self._place(params, batch)
        return self._step.lower(p, opt_state, b)

    def __repr__(self) -> str:
        return (f"TrainStep({getattr(self.loss_fn, '__name__', 'fn')!r}, {self.plan.mode}, "
                f"{self.device_num} devices, backend={self.backend}, dp="
                f"{self.data_parallel_degree}, grad_scale={self.grad_scale})")


def _index_over(full: GradientBuckets, members: list[str]) -> GradientBuckets | None:
    """The all-reduce buckets of ``members`` (the gradients the parallel optimizer leaves to
    all-reduce) under index splits made for every gradient: MindSpore's and HCCL's indices
    count the whole backward order (docs/fusion.md), so the buckets are cut there and keep
    only their members."""
    if not members:
        return None
    ends, count = [], 0
    keep = set(members)
    for b in full.buckets:
        count += sum(1 for g in b.gradients if g in keep)
        if count and (not ends or ends[-1] != count):
            ends.append(count)
    gs = [(g.name, g.nbytes) for g in full.gradients if g.name in keep]
    return buckets_from_ends(gs, ends, kind=full.kind, mode=full.mode,
                             source=f"{full.source}, over the whole backward order; the "
                             "parallel optimizer's sharded gradients left out")


def micro_batch(batch: tuple[Any, ...], g: int) -> tuple[Any, ...]:
    """The example batch of one micro-step: dim 0 of every leaf divided by ``g``."""
    if g == 1:
        return batch
    leaves, tree = jax.tree_util.tree_flatten(batch)
    out = []
    for x in leaves:
        shape = tuple(np.shape(x))
        if not shape or shape[0] % g:
            raise AutoParallelError("grad_accumulation_step", g, f"every batch input needs a "
                                    f"leading dim divisible by it (got shape {shape})",
                                    f"Pass the whole batch of {g} micro-batches, dim 0 = "
                                    f"{g} x micro-batch size")
        out.append(jax.ShapeDtypeStruct((shape[0] // g,) + shape[1:], x.dtype))
    return tuple(jax.tree_util.tree_unflatten(tree, out))


def _acc_shape(shape: tuple[int, ...], sharded: bool, axes: tuple[str, ...],
               sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Shape of one accumulated gradient: the local block, or its reduce-scattered shard."""
    if not sharded:
        return shape
    return (shape[0] // math.prod(sizes[a] for a in axes),) + shape[1:]


def _uneven(size: int, degree: int, where: str) -> AutoParallelError:
    return AutoParallelError("batch size", size, f"input {where!r}: the batch size {size} does "
                             f"not divide evenly over the data-parallel degree {degree}",
                             f"Use a batch size that is a multiple of {degree}")


def train_step(loss_fn: Callable[..., Any], params: Any, batch: Any,
               optimizer: optax.GradientTransformation | None = None, *,
               mode: str | None = None, fixed: Mapping[str, Any] | None = None,
               cluster: Any = None, backend: str = "shard_map",
               mesh: Mesh | None = None, sync_method: str = "tuple",
               fused_kernels: FusedKernels = "auto", has_aux: bool = False) -> TrainStep:
    """Build a parallel training step for ``loss_fn(params, *batch)`` under the current context.

    ``step(params, opt_state, *batch) -> (params, opt_state, loss)``; ``step.init(params)``
    makes the optimizer state, ``step.grads(params, *batch) -> (loss, grads)``.

    ``params``: a pytree whose **floating-point leaves are trained**; its other leaves are
    **carried**: an integer (a step counter), a boolean, a PRNG key (``jax.random.key``, or a
    raw ``uint32`` one). The loss receives them as they are, the optimizer never sees them
    (its state and ``step.grads`` hold None there, as ``eqx.filter_grad`` does), and the
    step returns them unchanged. A None leaf is an empty subtree (``eqx.partition``). A typed
    key never enters the partitioned program: a loss that reads one (draws random numbers
    with it) is refused by name, since autopar cannot partition JAX's random primitives; a
    tree with no floating-point leaf has nothing to train (``jax.grad`` refuses it too): an
    :class:`~autopar.errors.AutoParallelTypeError`.

    ``has_aux``: ``loss_fn`` returns ``(loss, aux)``, ``aux`` a pytree of arrays (new
    BatchNorm statistics, metrics), as for ``jax.value_and_grad(loss_fn, has_aux=True)``;
    the step then returns ``(params, opt_state, (loss, aux))`` and ``step.grads`` returns
    ``((loss, aux), grads)``: the loss's place holds the pair, as value_and_grad's value
    does. ``aux`` comes back as global arrays (laid out as the plan computed them), the
    values of one device on the whole batch; under ``grad_accumulation_step = g`` each
    micro-batch's, stacked along a new leading dim of size ``g`` (the pipelined step's:
    ``g x micro_batches``). The ``pmap`` backend refuses it (``AutoParallelError`` naming
    ``has_aux``): it computes a loss per device only.

    ``batch``: a tuple of example arrays (a single array is taken as ``(array,)``).
    ``optimizer``: an optax ``GradientTransformation`` (default
    ``optax.sgd(DEFAULT_LEARNING_RATE)``). ``mode`` / ``fixed`` / ``cluster`` / ``mesh``: as
    for :func:`autopar.parallelize`. ``backend``: ``"shard_map"`` (any plan) or ``"pmap"``
    (``parallel_mode="data_parallel"`` only). ``sync_method``: ``"tuple"`` (a psum over each
    bucket's arrays) or ``"concat"`` (one flat psum per bucket). ``fused_kernels``: as for
    :func:`autopar.parallelize`. See the module docstring for the semantics of
    each context key. Under ``pipeline_stages > 1`` the step is
    :func:`autopar.pipeline_train_step` (stages searched, micro-batches, 1F1B) with the
    same call conventions, except that its optimizer runs on packed per-stage buffers and
    must therefore be elementwise (SGD, momentum, Adam(W), RMSProp; ``clip_by_global_norm``,
    LAMB / LARS, adafactor are refused with an ``AutoParallelError``) and that
    ``comm_fusion`` is not applied there (warned).

    ``gradients_mean`` left unset under a plan with a data-parallel degree ``dp > 1``:
    MindSpore's default (False) makes the gradients ``dp x`` those of the global loss; an
    :class:`~autopar.errors.AutoParallelWarning` says so once per process (set the key,
    True or False, to silence it).
    """
    batch, optimizer = check_step_arguments(loss_fn, params, batch, optimizer,
                                            backend=backend, sync_method=sync_method,
                                            fused_kernels=fused_kernels, has_aux=has_aux)
    setup = resolve_setup(cluster)  # the stores, read once: everything below takes this
    found, micro = None, None
    if setup.config.auto_pipeline:  # stages, micro-batches and schedule searched first
        setup, micro, found = configured(setup, loss_fn, params, batch, optimizer, mode, fixed)
    step = build_train_step(setup, loss_fn, params, batch, optimizer, mode=mode, fixed=fixed,
                            backend=backend, mesh=mesh, sync_method=sync_method,
                            fused_kernels=fused_kernels, has_aux=has_aux, micro_batches=micro,
                            searched=found.best.plans if found is not None else None)
    save_strategies(step_saves(step, setup))  # load or search; build; then save
    warn_gradients_mean(step.data_parallel_degree, "gradients_mean" in setup.explicit)
    step.configuration = found
    return step


def build_train_step(setup: Setup, loss_fn: Callable[..., Any], params: Any,
                     batch: tuple[Any, ...], optimizer: optax.GradientTransformation, *,
                     mode: str | None, fixed: Mapping[str, Any] | None, backend: str,
                     mesh: Mesh | None, sync_method: str, fused_kernels: FusedKernels,
                     has_aux: bool, micro_batches: int | None = None,
                     searched: tuple[Plan, ...] | None = None) -> Any:
    """:func:`train_step` on checked arguments and the ``setup`` its entry point resolved:
    the plain or the pipelined step (of ``micro_batches``, default its stages), built; no
    file written (the entry point then saves :func:`step_saves`) and no warning given.
    ``searched``: the stage plans the configuration search chose, not searched again."""
    if setup.config.pipeline_stages > 1:  # the pipelined step (autopar.pipeline)
        _check_pipelined(setup.config.pipeline_stages, backend=backend, mesh=mesh,
                         sync_method=sync_method, fused_kernels=fused_kernels)
        return PipelineTrainStep(loss_fn, params, batch, optimizer, setup=setup,
                                 micro_batches=micro_batches, mode=mode, fixed=fixed,
                                 has_aux=has_aux, plans=searched)
    return TrainStep(loss_fn, params, batch, optimizer, setup=setup, mode=mode, fixed=fixed,
                     backend=backend, mesh=mesh, sync_method=sync_method,
                     fused_kernels=fused_kernels, has_aux=has_aux,
                     searched=searched[0] if searched and len(searched) == 1 else None)


def step_saves(step: Any, setup: Setup,
               tuning: Mapping[str, Any] | None = None) -> tuple[StrategySave, ...]:
    """The strategy files of a built step (:func:`build_train_step`'s), for its entry point to
    write (:func:`autopar.planner.save_strategies`): the pipelined step's one per stage
    (:func:`autopar.pipeline.plan.stage_saves`), the plain step's one, with ``tuning`` (the
    measurements that chose its plan) when given."""
    if isinstance(step, PipelineTrainStep):
        return stage_saves(step.plans, step.stage_graphs, setup)
    return strategy_saves(step.plan, step.function.graph, setup, tuning=tuning)


def check_step_arguments(loss_fn: Any, params: Any, batch: Any, optimizer: Any, *,
                         backend: Any, sync_method: Any, fused_kernels: Any,
                         has_aux: Any = False
                         ) -> tuple[tuple[Any, ...], optax.GradientTransformation]:
    """:func:`train_step`'s checks of its arguments (those of a tuned step too): ``(batch as
    a tuple, the optimizer or the default SGD)``. A PRNG key among the parameters is
    carried (:func:`autopar.step_inputs.is_trained`); a tree with nothing to train is
    refused (:func:`autopar.step_inputs.check_trainable`)."""
    batch, optimizer = step_arguments(loss_fn, batch, optimizer,
                                      "train_step needs a callable loss")
    check_arrays("params", without_keys(params), none=True)
    check_trainable("params", params)
    if not isinstance(has_aux, bool):
        raise AutoParallelTypeError("has_aux", has_aux, "True or False: whether loss_fn "
                                    "returns (loss, aux)")
    if backend not in BACKENDS:
        raise AutoParallelError("backend", backend, f"must be one of {BACKENDS}")
    if sync_method not in METHODS:
        raise AutoParallelError("sync_method", sync_method, f"must be one of {list(METHODS)}")
    check_fused_kernels(fused_kernels)
    return batch, optimizer


def _check_pipelined(stages: int, **given: Any) -> None:
    """Under ``pipeline_stages > 1`` the pipeline builds its own mesh and step: the options
    of the plain step must keep their defaults."""
    for key, default in (("backend", "shard_map"), ("mesh", None), ("sync_method", "tuple"),
                         ("fused_kernels", "auto")):
        value = given[key]
        if value != default:
            raise AutoParallelError(key, value if key != "mesh" else "a Mesh",
                                    f"pipeline_stages={stages} builds its own "
                                    f"('stage', ...) mesh and step; {key} must be "
                                    f"{default!r} there", f"Drop {key}=")
