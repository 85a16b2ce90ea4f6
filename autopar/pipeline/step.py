"""``pipeline_train_step``: a pipelined training step (GPipe or 1F1B) on one JAX mesh.

The loss is traced at micro-batch size, cut into ``p`` stages
(:func:`autopar.strategies.stages.partition_stages`: searched, or fixed by the user), and
each stage is searched, rewritten (:mod:`autopar.pipeline.plan`) and lowered for its
``D = device_num / p`` devices with the ordinary spine (``autopar.search`` on the stage's
subgraph, ``autopar.rewrite.rewrite``, ``lower.run_body``). This equals MindSpore's recursive
programming rolled back by ``log2(p)`` levels of cuts: the outermost mesh axis becomes the
stage axis, the inner axes are searched per stage.

**One SPMD program.** The mesh is ``('stage', a0, a1, ...)`` of shape ``(p, *intra)``. One
``jax.shard_map`` runs a ``lax.scan`` over the schedule's ticks
(:mod:`autopar.pipeline.schedules`). At each tick every device reads its stage's row of the
tick table and enters one branch of a ``lax.switch``: idle, forward of stage ``s`` or backward of
stage ``s`` (``2p + 1`` branches, stage-heterogeneous code, all with the same signature
thanks to the padded flat buffers of :mod:`autopar.pipeline.buffers`). Then two
``lax.ppermute`` over ``'stage'`` move the activations one stage forward and their
gradients one stage back; the receiving stage stores them in the slot the schedule assigned.
Intra-stage collectives run inside the branches, over the intra axes only, so every member
of a group takes the same branch.

**Backward rematerialises.** A backward branch re-runs its stage's forward under
``jax.vjp`` from the stored stage input (GPipe's re-materialisation): the only per
micro-batch state kept across ticks is each stage's input activation, the same shape for
every stage, so slot memory is exactly what the schedule needs (``m`` slots for GPipe,
``p`` for 1F1B).

**Gradients.** Every backward adds into a per-stage gradient buffer (the micro-batches of
all ``grad_accumulation_step`` rounds), then each sync group is all-reduced once over the
intra-stage axes where its parameters are replicated (``comm_fusion`` is not applied:
warned); the optimizer (optax, SGD 0.1 by default) updates the packed buffers, so it must be
elementwise (:func:`autopar.pipeline.buffers.check_elementwise_optimizer` refuses
``clip_by_global_norm``, LAMB / LARS, adafactor, ... at construction). The loss must be a
mean over batch rows (mean of the micro-batch means), as in MindSpore; the result equals
one device on the whole batch (``gradients_mean=True``; ``False`` multiplies by the stage's
data-parallel degree as :func:`autopar.train_step` does).

**Parallel optimizer.** With ``enable_parallel_optimizer`` a stage's large parameters are
stored sharded over their whole intra-stage data-parallel group (segments of the packed
buffers, reduce-scattered and all-gathered there, :mod:`autopar.optimizer_shard`'s rule);
``optimizer_weight_shard_size`` other than -1 is refused (``AutoParallelError``).

>>> import jax, autopar as ap
>>> from autopar.models import mlp
>>> m = mlp(widths=(8, 16, 16, 8), batch=8)
>>> params, x = m.example_args(jax.random.key(0))
>>> with ap.auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel",
...                               pipeline_stages=2, gradients_mean=True):
...     step = pipeline_train_step(m.loss, params, (x,), micro_batches=4)
>>> state = step.init(params)
>>> params2, state, loss = step(params, state, x)
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from autopar.config import AutoParallelConfig
from autopar.resolve import pipeline_schedule
from autopar.setup import Setup, resolve_setup
from autopar.errors import (AutoParallelError, AutoParallelTypeError, AutoParallelWarning,
                            user_stacklevel)
from autopar.grad_sync import (LOW_PRECISION, data_parallel_degree, fp32_collective,
                               fp32_sync_active, gradient_scale, replicated_axes)
from autopar.graph.tracer import trace, traced_dtype
from autopar.inspection import ProgramInspection
from autopar.lower import apply_step, put_on, run_body
from autopar.optimizer_shard import ShardDecision, decide_sharding
from autopar.pipeline.buffers import (BoundaryCodec, PackedParams, StagePacking,
                                      check_elementwise_optimizer)
from autopar.pipeline.plan import PipelinePlan, plan_stages, stage_saves
from autopar.pipeline.schedules import FWD, IDLE, schedule as build_schedule
from autopar.pipeline.simulation import schedule_note
from autopar.planner import save_strategies
from autopar.step_inputs import (ParamSplit, broadcast_parameters, check_arrays, check_loss,
                                 check_opt_state, check_trainable, is_prng_key,
                                 step_arguments, warn_gradients_mean)
from autopar.strategies.layout import DeviceMesh, TensorLayout, axis_name, jax_mesh
from autopar.strategies.redistribution import redistribute
from autopar.strategies.modes import PIPELINE_MODES
from autopar.strategies.plan import Plan
from autopar.strategies.stages import check_stages

__all__ = ["pipeline_train_step", "PipelineTrainStep"]


def _convert(x: Any, shape: tuple[int, ...], dtype: str, src: TensorLayout, dst: TensorLayout,
             mesh: DeviceMesh, alltoall: bool) -> Any:
    if src == dst:
        return x
    for st in redistribute(shape, np.dtype(dtype).itemsize, src, dst, mesh, alltoall):
        x = apply_step(x, st, mesh)
    return x


def _is_float(dt: str) -> bool:
    return bool(jnp.issubdtype(np.dtype(dt), jnp.inexact))


class PipelineTrainStep(ProgramInspection):
    """``step(params, opt_state, *batch) -> (params, opt_state, loss)`` pipelined (``has_aux``:
    ``(loss, aux)``, aux stacked per micro-batch); ``init``,
    ``grads``, ``pack`` / ``unpack``, ``as_text``, ``collective_counts``, ``plan``;
    ``configuration``: under ``auto_pipeline=True``, the configuration search that chose
    the stages (:class:`autopar.pipeline.configure.ConfigurationSearch`), else None."""

    configuration: Any = None

    def __init__(self, loss_fn: Callable[..., Any], params: Any, batch: tuple[Any, ...],
                 optimizer: optax.GradientTransformation, *, setup: Setup,
                 stages: int | None = None, micro_batches: int | None = None,
                 schedule: str | None = None, boundaries: Sequence[str | int] | None = None,
                 mode: str | None = None, fixed: Mapping[str, Any] | None = None,
                 has_aux: bool = False, plans: Sequence[Plan] | None = None) -> None:
        """Built by :func:`pipeline_train_step` (or :func:`autopar.train_step`), which reads
        the stores once and passes its ``setup``, then saves the stages' strategy files
        (nothing here reads a store or writes a file). ``plans``: the stage plans the
        configuration search found for this step (a stage takes its own where it was
        searched on the stage's graph; :func:`autopar.pipeline.plan.search_stages`)."""
        self._read_config(setup.config, stages, micro_batches, schedule)
        self.has_aux = bool(has_aux)
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self._construct(params, batch, setup, boundaries, mode, fixed, plans)

    def _construct(self, params: Any, batch: tuple[Any, ...], setup: Setup,
                   boundaries: Sequence[str | int] | None, mode: str | None,
                   fixed: Mapping[str, Any] | None, plans: Sequence[Plan] | None) -> None:
        """Trace, cut into stages and plan them, place the parameters, build the program."""
        config = setup.config
        micro = self._micro_batches(batch)
        p_sds = self._check_parameters(params, self.optimizer, config)
        self.graph = self._trace(self.loss_fn, p_sds, micro)
        found = plan_stages(self.graph, self.stages, setup=setup,
                            micro_batches=self.micro_batches, boundaries=boundaries,
                            mode=mode, fixed=fixed, optimizer=self.optimizer, searched=plans)
        self.stage_graphs, self.parallel_graphs = found.graphs, found.parallel_graphs
        note = ""
        if self._default_schedule and "pipeline_config" not in setup.explicit \
                and self.stages > 1:
            note = schedule_note(self.graph, self.stages, device_num=self.device_num,
                                 cluster=setup.cluster, fp32=self._fp32,
                                 micro_batches=self.micro_batches,
                                 schedule=self.schedule_table.name, plans=found.plans)
        self.plan = PipelinePlan(found.partition, self.schedule_table, found.plans,
                                 self.micro_batches, self.grad_accumulation_step,
                                 (note,) if note else ())
        self.plans, self.partition = self.plan.plans, found.partition
        self.intra_mesh = found.parallel_graphs[0].mesh
        self.mesh = self._pipeline_mesh()
        self._place_parameters(p_sds, config)
        self._setup_boundaries()
        self._setup_gradient_scales()
        self._build()

    # ------------------------------------------------------------------ construction
    def _read_config(self, cfg: AutoParallelConfig, stages: int | None,
                     micro_batches: int | None, schedule: str | None) -> None:
        """Stages, micro-batches, schedule (default: pipeline_config's pipeline_scheduler)
        and the context keys the step uses, checked."""
        self._default_schedule = schedule is None
        schedule = pipeline_schedule(cfg) if schedule is None else schedule
        n = cfg.device_num
        p = check_stages(cfg.pipeline_stages if stages is None else stages, n)
        if p > 1 and cfg.parallel_mode not in PIPELINE_MODES:
            raise AutoParallelError("parallel_mode", cfg.parallel_mode, "pipeline_stages > 1 "
                                    f"needs one of {list(PIPELINE_MODES)}",
                                    "set parallel_mode='semi_auto_parallel'")
        if isinstance(cfg.dataset_strategy, tuple):
            raise AutoParallelError("dataset_strategy", cfg.dataset_strategy, "a per-input "
                                    "strategy tuple is not supported with pipeline stages "
                                    "(each stage splits its batch over its own devices)",
                                    "Use dataset_strategy='data_parallel' or 'full_batch'")
        m = p if micro_batches is None else micro_batches
        self.schedule_table = build_schedule(schedule, p, m)   # validates schedule and m
        self.stages, self.micro_batches = p, m
        self.grad_accumulation_step = int(cfg.grad_accumulation_step)
        self.device_num, self.devices_per_stage = n, n // p
        self.gradients_mean = bool(cfg.gradients_mean)
        self.loss_repeated_mean = bool(cfg.loss_repeated_mean)
        self.alltoall = bool(cfg.enable_alltoall)
        self.parameter_broadcast = bool(cfg.parameter_broadcast)
        self._fp32 = fp32_sync_active(cfg.gradient_fp32_sync, cfg.parallel_mode)
        shard_size = cfg.parallel_optimizer_config.optimizer_weight_shard_size
        if cfg.enable_parallel_optimizer and shard_size != -1:
            raise AutoParallelError("optimizer_weight_shard_size", shard_size, "a pipelined "
                                    "step (pipeline_stages > 1) shards a parameter over its "
                                    "whole data-parallel group in its stage only",
                                    "Leave optimizer_weight_shard_size at -1 (the default) "
                                    "with pipeline_stages > 1")

    def _micro_batches(self, batch: tuple[Any, ...]) -> list[jax.ShapeDtypeStruct]:
        """The example batch's leaves as ``g * m`` micro-batches of ``B / (g m)`` rows."""
        b_leaves, self._b_tree = jax.tree_util.tree_flatten(batch)
        self._b_shapes = [tuple(np.shape(x)) for x in b_leaves]
        self._b_dtypes = [traced_dtype(x) for x in b_leaves]
        g, m = self.grad_accumulation_step, self.micro_batches
        parts = g * m
        for shp in self._b_shapes:
            if not shp:
                raise AutoParallelError("batch", "a scalar input", "every batch input is cut "
                                        "into micro-batches along dim 0, and a scalar has no "
                                        "dim 0", "Pass it as a parameter or close over it")
            if shp[0] % parts:
                raise AutoParallelError("batch size", shp[0], f"must divide into "
                                        f"grad_accumulation_step x micro_batches = {g} x {m} "
                                        f"= {parts} equal micro-batches", f"Use a batch size "
                                        f"that is a multiple of {parts}")
        return [jax.ShapeDtypeStruct((s[0] // parts,) + s[1:], d)
                for s, d in zip(self._b_shapes, self._b_dtypes)]

    def _check_parameters(self, params: Any, optimizer: optax.GradientTransformation,
                          cfg: AutoParallelConfig) -> list[jax.ShapeDtypeStruct]:
        """The parameters' shapes; the floating-point leaves are trained, the integer and
        boolean ones carried (:func:`autopar.step_inputs.is_trained`: in buffers of their
        own, which the optimizer never sees); a typed PRNG key cannot be packed and is
        refused by name. The optimizer runs on the packed ``[p, D, N]`` buffers, so a
        non-elementwise one is refused; ``comm_fusion`` is warned about (not applied)."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            if is_prng_key(leaf):
                raise AutoParallelTypeError(f"params{jax.tree_util.keystr(path)}", leaf,
                                            "a typed PRNG key cannot be packed into a "
                                            "pipelined step's per-dtype parameter buffers "
                                            "(pipeline_stages > 1)", "Keep it out of params, "
                                            "or carry its raw uint32 data "
                                            "(jax.random.key_data), or set pipeline_stages=1")
        check_arrays("params", params)
        check_trainable("params", params)
        self.split = ParamSplit(params, keys_in_program=False)
        p_leaves, self._p_tree = jax.tree_util.tree_flatten(params)
        self._p_dtypes = [traced_dtype(x) for x in p_leaves]
        check_elementwise_optimizer(optimizer, len({d for d in self._p_dtypes if _is_float(d)}),
                                    (self.stages, self.devices_per_stage))
        fusion = cfg.comm_fusion.fused()
        if fusion:  # (pointing at the user's call, through any facade)
            warnings.warn(f"comm_fusion={fusion!r} is ignored by a pipelined step (also when "
                          "set through all_reduce_fusion_config): it issues one collective per "
                          "gradient-sync group of each stage's packed buffer. Unset comm_fusion "
                          "to silence this.", AutoParallelWarning,
                          stacklevel=user_stacklevel())
        return [jax.ShapeDtypeStruct(np.shape(x), d) for x, d in zip(p_leaves, self._p_dtypes)]

    def _trace(self, loss_fn: Callable[..., Any], p_sds: list[jax.ShapeDtypeStruct],
               micro: list[jax.ShapeDtypeStruct]) -> Any:
        """The loss traced at micro-batch size; it must return one scalar (``has_aux``: a
        pair ``(loss, aux)``, each aux leaf made by an operator)."""
        graph = trace(loss_fn, jax.tree_util.tree_unflatten(self._p_tree, p_sds),
                      *jax.tree_util.tree_unflatten(self._b_tree, micro))
        check_loss(loss_fn, [graph.spec(v) for v in graph.outputs], graph.out_tree,
                   self.has_aux)
        self._aux_tree = graph.out_tree.children()[1] if self.has_aux else None
        self._aux_names = list(graph.outputs[1:]) if self.has_aux else []
        for v in self._aux_names:
            if graph.values[v].kind != "activation":
                raise AutoParallelError("loss_fn aux", v, "with pipeline_stages > 1 every "
                                        "aux leaf must be computed by the loss (an input or "
                                        "constant returned as is does not travel the stages)",
                                        "Return it from outside the step")
        return graph

    def _pipeline_mesh(self) -> Mesh:
        """The ``('stage', a0, a1, ...)`` mesh over the first ``device_num`` devices."""
        return jax_mesh(DeviceMesh((("stage", self.stages), *self.intra_mesh.axes)))

    def _place_parameters(self, p_sds: list[jax.ShapeDtypeStruct],
                          cfg: AutoParallelConfig) -> None:
        """Each parameter's owner stage and layout, the parallel optimizer's decisions, and
        the packing of every stage's parameters into its ``[p, D, N]`` buffers."""
        graph, pgs, p = self.graph, self.parallel_graphs, self.stages
        names = list(graph.inputs[:len(p_sds)])
        stage_of, layouts = [], []
        for i, v in enumerate(names):
            owner = next((s for s in range(p) if v in pgs[s].inputs), 0)
            stage_of.append(owner)
            layouts.append(pgs[owner].values[v].layout if v in pgs[owner].values
                           else TensorLayout.replicated(len(p_sds[i].shape)))
        self._param_names = names
        self.shard_decisions = self._shard_decisions(names, layouts, p_sds, cfg)
        self.packing = StagePacking([tuple(x.shape) for x in p_sds], self._p_dtypes, stage_of,
                                    layouts, names, p, self.intra_mesh,
                                    [d.sharded for d in self.shard_decisions])
        self.accumulation_shard = bool(
            cfg.parallel_optimizer_config.gradient_accumulation_shard) and \
            self.packing.any_sharded

    def _shard_decisions(self, names: list[str], layouts: list[TensorLayout],
                         p_sds: list[jax.ShapeDtypeStruct], cfg: AutoParallelConfig
                         ) -> list[ShardDecision]:
        """The parallel optimizer: autopar.optimizer_shard's rule, per parameter of its
        stage; a parameter that is not a float is never sharded (no gradient)."""
        intra, po = self.intra_mesh, cfg.parallel_optimizer_config
        out = []
        for v, lay, x, dt in zip(names, layouts, p_sds, self._p_dtypes):
            out.append(decide_sharding(
                v, tuple(x.shape), lay.local_shape(tuple(x.shape), intra),
                np.dtype(dt).itemsize, replicated_axes(lay, intra), intra.sizes,
                enabled=bool(cfg.enable_parallel_optimizer) and _is_float(dt),
                threshold_kb=po.parallel_optimizer_threshold))
            if cfg.enable_parallel_optimizer and not _is_float(dt):
                d = out[-1]
                out[-1] = ShardDecision(d.name, False, d.axes, d.nbytes, f"dtype {dt} is not "
                                        "a float (no gradient, nothing to update)")
        return out

    def _setup_boundaries(self) -> None:
        """The layout each crossing value travels in (its consumer's), and the codec of the
        padded boundary buffers."""
        graph, pgs, p, part = self.graph, self.parallel_graphs, self.stages, self.partition
        self._wire: list[dict[str, TensorLayout]] = []
        for b in range(p - 1):
            wire = {}
            for v in part.crossing[b]:
                c = next((c for c in range(b + 1, p) if v in pgs[c].inputs), None)
                wire[v] = pgs[c].values[v].layout if c is not None else \
                    TensorLayout.replicated(graph.spec(v).rank)
            self._wire.append(wire)
        self.codec = BoundaryCodec([[(v, self._wire[b][v].local_shape(graph.spec(v).shape,
                                                                       self.intra_mesh),
                                      graph.spec(v).dtype) for v in part.crossing[b]]
                                    for b in range(p - 1)])
        self._batch_names = list(graph.inputs[len(self._param_names):])

    def _setup_gradient_scales(self) -> None:
        """gradients_mean / loss_repeated_mean per stage, as train_step: each stage's
        data-parallel degree and its gradient scale."""
        self._scales = []
        self.stage_data_parallel = []
        for pg in self.parallel_graphs:
            dp = data_parallel_degree([pg.values[v] for v in pg.inputs
                                       if pg.values[v].kind == "data"], pg.mesh)
            self.stage_data_parallel.append(dp)
            self._scales.append(gradient_scale(dp, self.devices_per_stage,
                                               gradients_mean=self.gradients_mean,
                                               loss_repeated_mean=self.loss_repeated_mean))
        self.data_parallel_degree = max(self.stage_data_parallel)

    # ------------------------------------------------------------------ one stage, locally
    def _forward(self, s: int, pflat: dict[str, Any], xbuf: dict[str, Any],
                 batch: Sequence[Any]) -> tuple[dict[str, Any], Any, tuple[Any, ...]]:
        pg, graph, intra = self.parallel_graphs[s], self.graph, self.intra_mesh
        leaves = self.packing.local_leaves(s, pflat)
        recv = self.codec.decode(s - 1, xbuf) if s > 0 else {}
        leaf_of = {v: i for i, v in enumerate(self._param_names)}
        flat = []
        for v in pg.inputs:
            val = pg.values[v]
            if v in leaf_of:
                flat.append(leaves[leaf_of[v]])
            elif v in self._batch_names:
                x = batch[self._batch_names.index(v)]
                flat.append(_convert(x, val.spec.shape, val.spec.dtype,
                                     TensorLayout.replicated(val.spec.rank), val.layout, intra,
                                     self.alltoall))
            else:
                flat.append(recv[v])
        outs = run_body(pg, *flat)
        sg = self.stage_graphs[s]
        produced = {v: (x, pg.values[pv].layout) for v, pv, x in zip(sg.outputs, pg.outputs,
                                                                        outs)}
        if s == self.stages - 1:
            aux = []
            for v in self._aux_names:  # (made here, or passed through from an earlier stage)
                x, src = produced[v] if v in produced else (recv[v], self._wire[s - 1][v])
                spec = graph.spec(v)
                aux.append(_convert(x, spec.shape, spec.dtype, src,
                                    TensorLayout.replicated(spec.rank), intra, self.alltoall))
            return self.codec.zeros(), produced[graph.outputs[0]][0].astype(jnp.float32), \
                tuple(aux)
        send = {}
        for v in self.partition.crossing[s]:
            x, src = produced[v] if v in produced else (recv[v], self._wire[s - 1][v])
            spec = graph.spec(v)
            send[v] = _convert(x, spec.shape, spec.dtype, src, self._wire[s][v], intra,
                               self.alltoall)
        return self.codec.encode(s, send), jnp.zeros((), jnp.float32), ()

    def _backward(self, s: int, pflat: dict[str, Any], xbuf: dict[str, Any],
                  gbuf: dict[str, Any], batch: Sequence[Any]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
        pd = {k: v for k, v in pflat.items() if _is_float(k)}
        pn = {k: v for k, v in pflat.items() if not _is_float(k)}
        xd = {k: v for k, v in xbuf.items() if _is_float(k)}
        xn = {k: v for k, v in xbuf.items() if not _is_float(k)}

        def f(pd_: dict[str, Any], xd_: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            y, loss, _ = self._forward(s, {**pd_, **pn}, {**xd_, **xn}, batch)
            return {k: v for k, v in y.items() if _is_float(k)}, loss

        (y, loss), vjp = jax.vjp(f, pd, xd)
        last = s == self.stages - 1
        ct_y = {k: (jnp.zeros_like(v) if last else gbuf[k]) for k, v in y.items()}
        ct_loss = jnp.asarray(self._seed if last else 0.0, loss.dtype)
        gp, gx = vjp((ct_y, ct_loss))
        ct = {k: gx.get(k, jnp.zeros_like(v)) for k, v in xbuf.items()}
        return gp, ct

    # ------------------------------------------------------------------ the program
    def _build(self) -> None:
        """The jitted functions: ``grads`` (the ``shard_map`` program), ``step`` (then the
        optax update of the packed buffers), ``pack`` and ``unpack``."""
        m, g = self.micro_batches, self.grad_accumulation_step
        self._seed = 1.0 / (self.devices_per_stage * g * m)
        self.param_spec = PartitionSpec("stage", axis_name(self.intra_mesh.names), None)
        self.param_sharding = NamedSharding(self.mesh, self.param_spec)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec())
        specs = (self.param_spec,) * len(self.packing.dtypes)
        sharded = jax.shard_map(self._program_body(), mesh=self.mesh,
                                in_specs=specs + (PartitionSpec(),) * len(self._b_shapes),
                                out_specs=specs + (PartitionSpec(),) * (1 + len(self._aux_names)),
                                check_vma=False)
        self._jit(sharded)

    def _tick_tables(self) -> list[np.ndarray]:
        """The schedule's per-tick rows (op, micro-batch, slots), repeated for the
        ``grad_accumulation_step`` rounds (micro-batch numbers continue)."""
        sched, m, g = self.schedule_table, self.micro_batches, self.grad_accumulation_step
        return [np.concatenate([a + (r * m if k == 1 else 0) for r in range(g)])
                for k, a in enumerate((sched.op, sched.micro, sched.x_slot, sched.g_slot,
                                       sched.x_write, sched.g_write))]

    def _tick_branches(self) -> list[Callable[..., Any]]:
        """The ``2p + 1`` branches of a tick, all with one signature: idle, the forward of
        each stage, the backward of each stage (adding into the gradient buffer)."""
        codec, packing = self.codec, self.packing

        def idle(pf, xin, gin, bk, gacc, lacc, k, aacc):  # noqa: ANN001, ANN202
            return codec.zeros(), codec.zeros(), gacc, lacc, aacc

        def fwd_branch(s: int) -> Callable[..., Any]:
            def run(pf, xin, gin, bk, gacc, lacc, k, aacc):  # noqa: ANN001, ANN202
                y, loss, aux = self._forward(s, pf, xin, bk)
                aacc = tuple(lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), k, 0)
                             for a, x in zip(aacc, aux)) if aux else aacc
                return y, codec.zeros(), gacc, lacc + loss, aacc
            return run

        def bwd_branch(s: int) -> Callable[..., Any]:
            def run(pf, xin, gin, bk, gacc, lacc, k, aacc):  # noqa: ANN001, ANN202
                gp, ct = self._backward(s, pf, xin, gin, bk)
                if self.accumulation_shard:  # reduce-scatter every micro-batch's gradient
                    gp = {k: packing.scatter(s, k, v, self._fp32 and k in LOW_PRECISION)
                          for k, v in gp.items()}
                return codec.zeros(), ct, {d: gacc[d] + gp[d] for d in gacc}, lacc, aacc
            return run

        return [idle] + [fwd_branch(s) for s in range(self.stages)] + [
            bwd_branch(s) for s in range(self.stages)]

    def _gather_branch(self, s: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """Stage ``s``'s parameters gathered from their parallel-optimizer shards."""
        def run(store: dict[str, Any]) -> dict[str, Any]:
            return self.packing.gather(s, store)
        return run

    def _sync_branch(self, s: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """Stage ``s``'s accumulated gradients synchronised: one ``psum`` per sync group
        over the intra-stage axes (reduce-scattered where sharded), then scaled."""
        packing, scale = self.packing, self._scales[s]

        def run(gacc: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for dt, buf in gacc.items():
                fp32 = self._fp32 and dt in LOW_PRECISION
                if packing.any_sharded and not self.accumulation_shard:
                    buf = packing.scatter(s, dt, buf, fp32)   # -> the storage layout
                for seg in packing.segments[s][dt]:
                    if seg.sharded:
                        continue
                    part = fp32_collective(lambda xs: [lax.psum(xs[0], seg.axes)],
                                           [buf[seg.start:seg.stop]], fp32)[0]
                    buf = lax.dynamic_update_slice_in_dim(buf, part, seg.start, 0)
                out[dt] = buf * jnp.asarray(scale, buf.dtype) if scale != 1.0 else buf
            return out
        return run

    def _tick(self, s: Any, pf: dict[str, Any], batch: Sequence[Any],
              branches: list[Callable[..., Any]]) -> Callable[[tuple, tuple], tuple]:
        """One tick on stage ``s``: read the stage's row, run its branch, move activations
        one stage forward and their gradients one stage back, store them in their slots."""
        p = self.stages
        fwd_perm = [(i, i + 1) for i in range(p - 1)]
        bwd_perm = [(i + 1, i) for i in range(p - 1)]

        def tick(carry: tuple, row: tuple) -> tuple:
            sx, sg, gacc, lacc, aacc = carry
            op, k, xs, gs, xw, gw = (r[s] for r in row)
            bk = [lax.dynamic_index_in_dim(x, k, 0, keepdims=False) for x in batch]
            xin = {dt: lax.dynamic_index_in_dim(v, xs, 0, keepdims=False)
                   for dt, v in sx.items()}
            gin = {dt: lax.dynamic_index_in_dim(v, gs, 0, keepdims=False)
                   for dt, v in sg.items()}
            idx = jnp.where(op == IDLE, 0, jnp.where(op == FWD, 1 + s, 1 + p + s))
            y, ct, gacc, lacc, aacc = lax.switch(idx, branches, pf, xin, gin, bk, gacc, lacc,
                                                 k, aacc)
            if p > 1:
                y = {dt: lax.ppermute(v, "stage", fwd_perm) for dt, v in y.items()}
                ct = {dt: lax.ppermute(v, "stage", bwd_perm) for dt, v in ct.items()}
            sx = {dt: lax.dynamic_update_index_in_dim(v, y[dt], xw, 0)
                  for dt, v in sx.items()}
            sg = {dt: lax.dynamic_update_index_in_dim(v, ct[dt], gw, 0)
                  for dt, v in sg.items()}
            return (sx, sg, gacc, lacc, aacc), None
        return tick

    def _program_body(self) -> Callable[..., tuple[Any, ...]]:
        """The ``shard_map`` body: gather the stage's parameters, scan the ticks, sync the
        gradients; ``(*gradient buffers, loss)``."""
        p, m, g = self.stages, self.micro_batches, self.grad_accumulation_step
        sched, codec, packing = self.schedule_table, self.codec, self.packing
        fdt = [dt for dt in packing.dtypes if _is_float(dt)]
        tables, branches = self._tick_tables(), self._tick_branches()

        def body(*args: Any) -> tuple[Any, ...]:
            nb = len(packing.dtypes)
            store = {dt: x.reshape(-1) for dt, x in zip(packing.dtypes, args[:nb])}
            batch = args[nb:]
            s = lax.axis_index("stage")
            pf = lax.switch(s, [self._gather_branch(q) for q in range(p)], store) \
                if packing.any_sharded else store
            stash_x = {dt: jnp.zeros((sched.act_slots + 1, n), dt)
                       for dt, n in codec.sizes.items()}
            stash_g = {dt: jnp.zeros((sched.grad_slots + 1, n), dt)
                       for dt, n in codec.sizes.items()}
            acc_sizes = packing.store_sizes if self.accumulation_shard else packing.sizes
            gacc = {dt: jnp.zeros((acc_sizes[dt],), dt) for dt in fdt}
            tick = self._tick(s, pf, batch, branches)
            rows = tuple(jnp.asarray(t) for t in tables)
            (_, _, gacc, lacc, aacc), _ = lax.scan(tick, (stash_x, stash_g, gacc,
                                                          jnp.zeros((), jnp.float32),
                                                          self._aux_zeros()), rows)
            gacc = lax.switch(s, [self._sync_branch(q) for q in range(p)], gacc)
            loss = lax.psum(lacc, "stage") / (g * m)
            grads = tuple((gacc[dt] if dt in gacc else jnp.zeros_like(store[dt])).reshape(1, 1, -1)
                          for dt in packing.dtypes)
            return grads + (loss,) + tuple(lax.psum(a, "stage") for a in aacc)
        return body

    def _aux_zeros(self) -> tuple[Any, ...]:
        """Each aux leaf's buffer: one row per micro-batch (booleans held as int32: the
        last stage's rows are summed over the stage axis)."""
        parts = self.grad_accumulation_step * self.micro_batches
        out = []
        for v in self._aux_names:
            spec = self.graph.spec(v)
            dt = jnp.int32 if spec.dtype == "bool" else spec.dtype
            out.append(jnp.zeros((parts,) + tuple(spec.shape), dt))
        return tuple(out)

    def _value(self, out: Sequence[Any]) -> Any:
        """The loss, or under ``has_aux`` ``(loss, aux)``: each aux leaf every
        micro-batch's, stacked along a new leading dim (as train_step's accumulation)."""
        if not self.has_aux:
            return out[0]
        aux = [a.astype(self.graph.spec(v).dtype) for a, v in zip(out[1:], self._aux_names)]
        return out[0], jax.tree_util.tree_unflatten(self._aux_tree, aux)

    def _jit(self, sharded: Callable[..., Any]) -> None:
        """``grads`` and ``step`` jitted around the program; ``pack`` / ``unpack``."""
        packing, parts = self.packing, self.grad_accumulation_step * self.micro_batches

        def grads(buffers: tuple[Any, ...], batch: list[Any]) -> tuple[Any, tuple[Any, ...]]:
            mb = [x.reshape((parts, x.shape[0] // parts) + x.shape[1:]) for x in batch]
            out, nb = sharded(*buffers, *mb), len(packing.dtypes)
            return self._value(out[nb:]), tuple(out[:nb])

        def step(packed: PackedParams, opt_state: Any, batch: list[Any]) -> tuple:
            loss, gr = grads(packed.buffers, batch)
            masked = self._masked(packed.buffers)
            updates, opt_state = self.optimizer.update(self._masked(gr), opt_state, masked)
            new = optax.apply_updates(masked, updates).buffers
            new = PackedParams(tuple(lax.with_sharding_constraint(
                (x if x is not None else old).astype(dt), self.param_sharding)
                for x, old, dt in zip(new, packed.buffers, packing.dtypes)))
            return new, opt_state, loss

        self._grads = jax.jit(grads)
        self._step = jax.jit(step)
        self._pack = jax.jit(lambda leaves: PackedParams(packing.pack(leaves)),
                             out_shardings=PackedParams((self.param_sharding,) *
                                                        len(packing.dtypes)))
        self._unpack = jax.jit(lambda bufs: packing.unpack(bufs))

    # ------------------------------------------------------------------ public
    def pack(self, params: Any) -> PackedParams:
        """The parameter pytree as the step's packed, stage-sharded buffers."""
        if isinstance(params, PackedParams):
            return params
        check_arrays("params", params)
        leaves, tree = jax.tree_util.tree_flatten(params)
        if tree != self._p_tree:
            raise AutoParallelError("params", f"{len(leaves)} leaves", "must have the "
                                    f"structure of the example parameters ({self._p_tree})")
        for v, x, dt in zip(self._param_names, leaves, self._p_dtypes):
            want = self.graph.spec(v).shape
            if tuple(np.shape(x)) != want or traced_dtype(x) != dt:
                raise AutoParallelError(f"parameter {v!r}", (tuple(np.shape(x)), traced_dtype(x)),
                                        f"must have shape {want} and dtype {dt}, as in the "
                                        "example")
        return self._pack(leaves)

    def prepare(self, params: Any) -> PackedParams:
        """As :meth:`TrainStep.prepare`: the parameters placed for the step (packed); with
        ``parameter_broadcast`` set, rank 0's values are broadcast first
        (:func:`autopar.step_inputs.broadcast_parameters`)."""
        if self.parameter_broadcast and not isinstance(params, PackedParams):
            params = broadcast_parameters(params, self.mesh)
        return self.pack(params)

    def unpack(self, packed: PackedParams) -> Any:
        """Packed buffers back to the parameter pytree."""
        if not isinstance(packed, PackedParams):
            raise AutoParallelTypeError("packed", packed, "PackedParams from .pack()")
        return jax.tree_util.tree_unflatten(self._p_tree, self._unpack(packed.buffers))

    def _batch(self, batch: Sequence[Any]) -> list[Any]:
        """The call's batch checked against the example's (arrays, structure, shapes and
        dtypes) and placed replicated on the pipeline mesh."""
        check_arrays("batch", tuple(batch))
        leaves, tree = jax.tree_util.tree_flatten(tuple(batch))
        if tree != self._b_tree:
            raise AutoParallelError("batch", f"{len(batch)} inputs", f"must have the structure "
                                    f"of the example batch ({self._b_tree})")
        for x, shp, dt in zip(leaves, self._b_shapes, self._b_dtypes):
            if tuple(np.shape(x)) != shp or traced_dtype(x) != dt:
                raise AutoParallelError("batch input", (tuple(np.shape(x)), traced_dtype(x)),
                                        f"must have shape {shp} and dtype {dt}, as in the "
                                        "example")
        return put_on(leaves, [self.batch_sharding] * len(leaves))

    def _masked(self, buffers: Sequence[Any]) -> PackedParams:
        """The packed buffers as the optimizer sees them: None (an empty subtree) for the
        buffers of carried (non-float) dtypes."""
        return PackedParams(tuple(b if _is_float(dt) else None
                                  for b, dt in zip(buffers, self.packing.dtypes)))

    def init(self, params: Any) -> Any:
        """The optimizer state, over the packed buffers of the trained (floating-point)
        leaves (``optimizer.init`` of :meth:`pack` with the other buffers None)."""
        return self.optimizer.init(self._masked(self.pack(params).buffers))

    def grads(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        """``(loss, gradients)`` as fed to the optimizer, as a parameter pytree (None at
        every carried leaf, as :meth:`autopar.train.TrainStep.grads`)."""
        loss, gr = self._grads(self.pack(params).buffers, self._batch(batch))
        leaves = jax.tree_util.tree_leaves(self.unpack(PackedParams(gr)))
        return loss, self.split.optimizer_tree([leaves[k] for k in self.split.trained])

    def __call__(self, params: Any, opt_state: Any, *batch: Any) -> tuple[Any, Any, Any]:
        """One step. ``params``: the pytree (returned as a pytree) or :class:`PackedParams`
        (returned packed: no repacking, the fast path for training loops)."""
        new, opt_state, loss = self._step(*self._step_args(params, opt_state, batch))
        return (new if isinstance(params, PackedParams) else self.unpack(new)), opt_state, loss

    def _step_args(self, params: Any, opt_state: Any, batch: Sequence[Any]
                   ) -> tuple[PackedParams, Any, list[Any]]:
        """``(packed params, opt_state, placed batch)``, each checked; ``opt_state`` must be
        what :meth:`init` makes (:func:`~autopar.step_inputs.check_opt_state`, the rule of
        :class:`autopar.train.TrainStep`, over the packed buffers the optimizer runs on)."""
        packed = self.pack(params)
        check_opt_state(self.optimizer, self._masked(packed.buffers), opt_state,
                        self.__dict__.setdefault("_state_specs", {}))
        return packed, opt_state, self._batch(batch)

    def lower(self, params: Any, opt_state: Any, *batch: Any) -> Any:
        """The ``jax.stages.Lowered`` step (``.as_text()``, ``.compile().memory_analysis()``)."""
        return self._step.lower(*self._step_args(params, opt_state, batch))

    def __repr__(self) -> str:
        return (f"PipelineTrainStep({getattr(self.loss_fn, '__name__', 'fn')!r}, "
                f"{self.stages} stages x {self.devices_per_stage} devices, "
                f"{self.micro_batches} micro-batches, {self.schedule_table.name})")



def pipeline_train_step(loss_fn: Callable[..., Any], params: Any, batch: Any,
                        optimizer: optax.GradientTransformation | None = None, *,
                        stages: int | None = None, micro_batches: int | None = None,
                        schedule: str | None = None,
                        boundaries: Sequence[str | int] | None = None,
                        mode: str | None = None, fixed: Mapping[str, Any] | None = None,
                        cluster: Any = None, has_aux: bool = False) -> PipelineTrainStep:
    """A pipelined training step for ``loss_fn(params, *batch)`` under the current context.

    ``stages``: pipeline stages ``p`` (default: the context's ``pipeline_stages``; must divide
    ``device_num``). ``micro_batches``: ``m >= p`` (default ``p``, the fewest MindSpore's
    ``micro_size`` allows); the batch (every leaf's dim 0) must divide into
    ``grad_accumulation_step x m`` equal micro-batches. ``schedule``: ``"1f1b"`` or ``"gpipe"``
    (default: the context's ``pipeline_config["pipeline_scheduler"]``, ``"1f1b"`` as in
    MindSpore). ``boundaries``: the unit names (top-level named scopes) or
    indices where stages 1..p-1 begin (default: searched). ``optimizer`` / ``mode`` /
    ``fixed`` / ``cluster``: as :func:`autopar.train_step` (``mode`` and ``fixed`` act per
    stage; ``fixed`` keys are node names of the whole graph).

    The optimizer runs on the packed ``[p, D, N]`` parameter buffers, not on the pytree: it
    must be **elementwise** (an element's update depends only on that element's gradient,
    parameter and state: SGD, momentum, Adam(W), RMSProp, ``optax.clip``). A transform that
    reduces over a parameter or all of them (``clip_by_global_norm``, LAMB / LARS, adafactor)
    or masks the parameter tree is refused with :class:`AutoParallelError` (``optimizer``)
    by a probe at construction. ``comm_fusion`` is not applied (one collective per
    gradient-sync group; an :class:`AutoParallelWarning` says so).

    As in :func:`autopar.train_step`, the floating-point leaves of ``params`` are trained and
    the integer and boolean ones carried (their own packed buffers, which the optimizer never
    sees; ``grads`` holds None there); a typed PRNG key cannot be packed and is refused by
    name (:class:`~autopar.errors.AutoParallelTypeError`). ``has_aux``: ``loss_fn`` returns
    ``(loss, aux)`` and the step's value is ``(loss, aux)``, each aux leaf every
    micro-batch's (computed on the stage that makes it, carried to the last), stacked along a
    new leading dim of ``grad_accumulation_step x micro_batches`` (as
    :func:`autopar.train_step` under gradient accumulation). ``gradients_mean`` left unset is
    warned about as there.
    """
    batch, optimizer = step_arguments(loss_fn, batch, optimizer,
                                      "pipeline_train_step needs a callable")
    if not isinstance(has_aux, bool):
        raise AutoParallelTypeError("has_aux", has_aux, "True or False: whether loss_fn "
                                    "returns (loss, aux)")
    setup = resolve_setup(cluster)  # the stores, read once: every stage takes this setup
    step = PipelineTrainStep(loss_fn, params, batch, optimizer, setup=setup, stages=stages,
                             micro_batches=micro_batches, schedule=schedule,
                             boundaries=boundaries, mode=mode, fixed=fixed, has_aux=has_aux)
    save_strategies(stage_saves(step.plans, step.stage_graphs, setup))  # all or none
    warn_gradients_mean(step.data_parallel_degree, "gradients_mean" in setup.explicit)
    return step
