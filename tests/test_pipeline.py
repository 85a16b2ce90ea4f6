"""Pipeline parallelism: stage partition (search and fixed), the GPipe / 1F1B schedule tables,
the pipelined step on 8 devices against one device (p = 2 and 4, both schedules, with and
without gradient accumulation), collective_permute in the lowered program, memory of the
two schedules, and the typed errors of every bad input."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar as ap
from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.models import mlp, tfm_stack, transformer
from autopar.pipeline import PackedParams, pipeline_train_step
from autopar.pipeline.schedules import BWD, FWD, IDLE, bubble_fraction, schedule
from autopar.planner import partition_stages
from autopar.strategies.stages import stage_graph, stage_units

import numerics

KEY = jax.random.key(0)
PIPE = dict(device_num=8, parallel_mode="semi_auto_parallel", gradients_mean=True)


def small_tfm(batch=8, layers=4):
    return transformer(layers=layers, hidden=16, heads=2, seq=8, vocab=32, batch=batch)


def graph_of(model):
    return ap.trace(model.loss, *jax.eval_shape(model.example_args, KEY))


# ---------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 7)])
def test_schedule_tables_are_valid_and_the_two_orders_differ(p, m):
    tables = {name: schedule(name, p, m) for name in ("gpipe", "1f1b")}
    for name, s in tables.items():
        assert s.ticks == 2 * (m + p - 1)
        f_at, b_at = {}, {}
        for t in range(s.ticks):
            for st in range(p):
                o, k = int(s.op[t, st]), int(s.micro[t, st])
                if o == FWD:
                    f_at[(st, k)] = t
                elif o == BWD:
                    b_at[(st, k)] = t
        assert len(f_at) == len(b_at) == p * m          # every micro-batch once each way
        for (st, k), t in f_at.items():
            assert st == 0 or f_at[(st - 1, k)] < t
            assert b_at[(st, k)] > t
            assert st == p - 1 or b_at[(st + 1, k)] < b_at[(st, k)]
        assert s.tick_bubble() == pytest.approx(bubble_fraction(p, m))
    # GPipe keeps every micro-batch in flight; 1F1B at most p - s on stage s
    assert tables["gpipe"].peak_in_flight == (m,) * p
    assert tables["1f1b"].peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert tables["gpipe"].act_slots == m
    assert tables["1f1b"].act_slots <= p


def test_schedule_slots_never_overwrite_a_live_buffer():
    """Replay the tables: every read finds the micro-batch it expects in its slot."""
    p = 4
    s = schedule("1f1b", p, 8)
    for is_act in (True, False):
        read, write = (s.x_slot, s.x_write) if is_act else (s.g_slot, s.g_write)
        n_slots = s.act_slots if is_act else s.grad_slots
        for st in range(p):
            holder: dict[int, int] = {}
            for t in range(s.ticks):
                op = int(s.op[t, st])
                reads = (op != IDLE and st > 0) if is_act else (op == BWD and st < p - 1)
                if reads:
                    assert holder[int(read[t, st])] == int(s.micro[t, st])
                w = int(write[t, st])
                if w < n_slots:
                    src = st - 1 if is_act else st + 1
                    assert int(s.op[t, src]) == (FWD if is_act else BWD)
                    holder[w] = int(s.micro[t, src])


@pytest.mark.parametrize("bad,err", [
    (dict(name="interleaved"), AutoParallelError), (dict(name=3), AutoParallelTypeError),
    (dict(stages=0), AutoParallelError), (dict(stages=2.0), AutoParallelTypeError),
    (dict(micro_batches=1), AutoParallelError), (dict(micro_batches=True),
                                                 AutoParallelTypeError)])
def test_schedule_bad_inputs(bad, err):
    args = dict(name="1f1b", stages=2, micro_batches=4) | bad
    with pytest.raises(err):
        schedule(args["name"], args["stages"], args["micro_batches"])


# ---------------------------------------------------------------------------- stages


def test_units_follow_top_level_scopes_and_search_balances_layers():
    g = graph_of(small_tfm(layers=8))
    names = [u.name for u in stage_units(g)]
    assert names == ["embed"] + [f"block{i}" for i in range(8)] + ["ln_f", "head", "loss"]
    part = partition_stages(g, 4, device_num=8, micro_batches=8)
    per_stage = [sum(n.startswith("block") and n.endswith("/dot_general_0") and "/mlp/" in n
                     for n in nodes) for nodes in part.stage_nodes]
    assert sum(per_stage) == 8 and max(per_stage) - min(per_stage) <= 1
    # only the residual stream crosses each cut
    assert all(len(c) == 1 for c in part.crossing)
    assert part.source == "search"


def test_search_minimises_alpas_objective_over_all_cuts():
    """The DP's cuts are optimal: no other cut of the units gives a smaller step estimate."""
    import itertools

    g = graph_of(small_tfm(layers=4))
    m = 4
    part = partition_stages(g, 3, device_num=6, micro_batches=m)

    def estimate(cuts):
        q = partition_stages(g, 3, device_num=6, boundaries=list(cuts))
        return sum(q.stage_seconds) + sum(q.send_seconds) + (m - 1) * max(q.stage_seconds)

    best = min(estimate(c) for c in itertools.combinations(range(1, len(part.units)), 2))
    assert estimate(part.cuts) == pytest.approx(best, rel=1e-9)


def test_fixed_boundaries_by_scope_name_and_index():
    g = graph_of(small_tfm(layers=4))
    part = partition_stages(g, 2, device_num=8, boundaries=["block2"])
    assert part.first_units() == ("embed", "block2") and part.source == "user"
    assert partition_stages(g, 2, device_num=8, boundaries=[3]).cuts == part.cuts
    sg = stage_graph(g, part, 1)
    assert [v for v in sg.inputs if sg.values[v].kind != "param"] == [
        "targets", part.crossing[0][0]]
    assert sg.outputs == g.outputs


@pytest.mark.parametrize("kwargs,err", [
    (dict(stages=3), AutoParallelError),                       # does not divide 8
    (dict(stages="2"), AutoParallelTypeError),
    (dict(boundaries=["block1", "block3"]), AutoParallelError),   # 2 cuts for 2 stages
    (dict(boundaries=["nope"]), AutoParallelError),
    (dict(boundaries=[0]), AutoParallelError),                 # stage 0 would be empty
    (dict(boundaries=[99]), AutoParallelError),
    (dict(boundaries="block1"), AutoParallelTypeError),
    (dict(boundaries=[1.5]), AutoParallelTypeError),
    (dict(stages=4, boundaries=["block2", "block1", "ln_f"]), AutoParallelError),
    (dict(stages=8), AutoParallelError),                       # 5 units < 8 stages
])
def test_partition_bad_inputs(kwargs, err):
    g = graph_of(small_tfm(layers=1))   # embed, block0, ln_f, head, loss: 5 units
    args = dict(stages=2) | kwargs
    with pytest.raises(err):
        partition_stages(g, args.pop("stages"), device_num=8, **args)


def test_parameter_shared_across_stages_is_refused():
    def loss(params, x):
        h = x
        for i in range(2):
            with jax.named_scope(f"layer{i}"):
                h = jnp.tanh(h @ params["w"])
        return jnp.mean(h ** 2)

    g = ap.trace(loss, {"w": jnp.ones((4, 4))}, jnp.ones((8, 4)))
    with pytest.raises(AutoParallelError, match="shared across pipeline stages"):
        partition_stages(g, 2, device_num=2)


# ---------------------------------------------------------------------------- numerics


def _reference(model, params, batch):
    """(loss, gradients) of one device, in float64 and float32."""
    return numerics.reference(jax.value_and_grad(model.loss), params, *batch)


CASES = {
    # name: (model, stages, schedule, micro_batches, grad_accumulation_step)
    "mlp-p2-gpipe": (lambda: mlp(widths=(8, 16, 16, 8), batch=8), 2, "gpipe", 2, 1),
    "mlp-p4-1f1b-acc2": (lambda: mlp(widths=(8, 16, 16, 16, 8), batch=16), 4, "1f1b", 4, 2),
    "tfm-p4-gpipe-acc2": (lambda: small_tfm(batch=16, layers=2), 4, "gpipe", 4, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pipelined_gradients_equal_one_device(case):
    build, p, sched, m, g = CASES[case]
    model = build()
    params, *batch = model.example_args(KEY)
    with ap.auto_parallel_context(pipeline_stages=p, grad_accumulation_step=g, **PIPE):
        step = pipeline_train_step(model.loss, params, tuple(batch), micro_batches=m,
                                   schedule=sched)
    numerics.check(step.grads(params, *batch), _reference(model, params, batch))
    assert step.plan.schedule.name == sched and len(step.plans) == p


def test_tfm_stack_pipelined_equals_the_mean_of_its_micro_batches():
    """tfm_stack's batch is baked into the model (rows = batch x seq), so the pipelined
    batch is m independent micro-batches of the model's size."""
    model = tfm_stack(blocks=2, batch=1, seq=4, hidden=8, heads=2)
    params = model.init(KEY)
    xs = [model.example_batch(jax.random.key(i))[0] for i in range(4)]
    full = jnp.concatenate(xs)
    ref = numerics.reference(
        jax.value_and_grad(lambda p, xs: sum(model.loss(p, x) for x in xs) / 4), params, xs)
    with ap.auto_parallel_context(pipeline_stages=2, **PIPE):
        step = pipeline_train_step(model.loss, params, (full,), micro_batches=4,
                                   schedule="1f1b")
    numerics.check(step.grads(params, full), ref)


@pytest.fixture(scope="module")
def tfm_step():
    model = small_tfm(batch=8, layers=2)
    params, *batch = model.example_args(KEY)
    with ap.auto_parallel_context(pipeline_stages=2, **PIPE):
        step = pipeline_train_step(model.loss, params, tuple(batch),
                                   optax.sgd(0.1, momentum=0.9), micro_batches=4,
                                   schedule="1f1b")
    return model, params, batch, step


def test_momentum_steps_equal_one_device_on_pytree_and_packed_paths(tfm_step):
    """Transformer, 2 stages x 4 devices, 1F1B: two SGD-momentum steps (optimizer state in
    the packed buffers) equal one device's."""
    model, params, batch, step = tfm_step
    steps = numerics.optimizer_steps(model.loss, optax.sgd(0.1, momentum=0.9), 2)
    ref = numerics.reference(lambda *a: steps(*a)[0], params, *batch, jit=False)
    state = step.init(params)
    p1, s1, _ = step(params, state, *batch)          # pytree in, pytree out
    p1, s1, _ = step(p1, s1, *batch)
    packed, s2 = step.pack(params), step.init(params)
    for _ in range(2):                                # packed in, packed out
        packed, s2, _ = step(packed, s2, *batch)
    assert isinstance(packed, PackedParams)
    numerics.check(p1, ref, "pytree path")
    numerics.check(step.unpack(packed), ref, "packed path")


def test_packed_parameters_live_on_their_stage_only(tfm_step):
    model, params, batch, step = tfm_step
    packed = step.pack(params)
    total = sum(x.size for x in jax.tree.leaves(params))
    for buf in packed.buffers:
        assert buf.sharding.spec[0] == "stage"
        local = buf.addressable_shards[0].data.size
        # one stage's parameters (the larger stage) per device: about half of the model
        assert local == step.packing.sizes[str(buf.dtype)] < 0.8 * total
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     step.unpack(packed), params))


def test_lowered_step_has_collective_permutes_between_stages(tfm_step):
    model, params, batch, step = tfm_step
    counts = step.collective_counts(params, step.init(params), *batch)
    # one ppermute forward and one backward in the scanned tick body (one dtype)
    assert counts["collective_permute"] == 2
    assert counts["all_reduce"] >= 1          # the gradient sync of data-parallel stages
    text = step.as_text(params, step.init(params), *batch)
    pairs = re.findall(r"source_target_pairs = dense<(\[\[.*?\]\])>", text)
    assert len(pairs) == 2 and pairs[0] != pairs[1]


def test_one_stage_pipeline_has_no_collective_permute():
    model = mlp(widths=(8, 16, 8), batch=8)
    params, x = model.example_args(KEY)
    with ap.auto_parallel_context(**PIPE):
        step = pipeline_train_step(model.loss, params, (x,), stages=1, micro_batches=2)
    assert step.collective_counts(params, step.init(params), x)["collective_permute"] == 0
    numerics.assert_close(step.grads(params, x), jax.value_and_grad(model.loss), params, x)


def test_gpipe_keeps_more_activations_than_1f1b_in_compiled_memory():
    model = mlp(widths=(64, 64, 64, 64), batch=64)
    params, x = model.example_args(KEY)
    temp = {}
    for sched in ("gpipe", "1f1b"):
        with ap.auto_parallel_context(pipeline_stages=2, **PIPE):
            step = pipeline_train_step(model.loss, params, (x,), micro_batches=8,
                                       schedule=sched)
        assert step.plan.schedule.act_slots == (8 if sched == "gpipe" else 2)
        stats = step.lower(params, step.init(params), x).compile().memory_analysis()
        temp[sched] = stats.temp_size_in_bytes
    # 6 more stored boundary activations of [64/8 rows / 4 devices, 64] float32
    assert temp["gpipe"] - temp["1f1b"] >= 6 * (64 // 8 // 4) * 64 * 4


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("ctx,kwargs,err,key", [
    (dict(pipeline_stages=2), dict(micro_batches=1), AutoParallelError, "micro_batches"),
    (dict(pipeline_stages=2), dict(micro_batches="4"), AutoParallelTypeError, "micro_batches"),
    (dict(pipeline_stages=2), dict(schedule="zigzag"), AutoParallelError, "schedule"),
    (dict(pipeline_stages=2), dict(schedule=3), AutoParallelTypeError, "schedule"),
    (dict(), dict(stages=3), AutoParallelError, "pipeline_stages"),
    (dict(), dict(stages=2.5), AutoParallelTypeError, "pipeline_stages"),
    (dict(pipeline_stages=2), dict(micro_batches=3), AutoParallelError, "batch size"),
    (dict(pipeline_stages=2), dict(boundaries=["ln_f", "head"]), AutoParallelError,
     "boundaries"),
    (dict(pipeline_stages=2), dict(boundaries=["block9"]), AutoParallelError, "boundaries"),
    (dict(pipeline_stages=2), dict(optimizer="sgd"), AutoParallelTypeError, "optimizer"),
    (dict(pipeline_stages=2), dict(fixed={"nope": ((1, 1),)}), AutoParallelError, "node"),
    (dict(pipeline_stages=2), dict(fixed=[1]), AutoParallelTypeError, "fixed"),
    (dict(pipeline_stages=2, parallel_mode="data_parallel"), dict(), AutoParallelError,
     "parallel_mode"),
    (dict(pipeline_stages=2, dataset_strategy=((8, 1), (8, 1))), dict(), AutoParallelError,
     "dataset_strategy"),
])
def test_bad_arguments_raise_typed_errors(ctx, kwargs, err, key):
    model = small_tfm(batch=8, layers=1)
    params, *batch = model.example_args(KEY)
    with ap.auto_parallel_context(**(PIPE | ctx)):
        before = ap.get_auto_parallel_context("pipeline_stages")
        with pytest.raises(err, match=re.escape(key)):
            pipeline_train_step(model.loss, params, tuple(batch), **kwargs)
        assert ap.get_auto_parallel_context("pipeline_stages") == before


def test_an_integer_loss_is_refused():
    model = small_tfm(batch=8, layers=1)
    params, *batch = model.example_args(KEY)
    with ap.auto_parallel_context(**(PIPE | dict(pipeline_stages=2))):
        with pytest.raises(AutoParallelTypeError, match="floating-point loss.*found int32"):
            pipeline_train_step(lambda p, *b: model.loss(p, *b).astype(jnp.int32), params,
                                tuple(batch))


def test_a_scalar_batch_input_is_named_as_such():
    """It was refused as 'batch size=0 ... does not divide'."""
    model = small_tfm(batch=8, layers=1)
    params, *batch = model.example_args(KEY)
    with ap.auto_parallel_context(**(PIPE | dict(pipeline_stages=2))):
        with pytest.raises(AutoParallelError, match="a scalar has no dim 0"):
            pipeline_train_step(lambda p, *b: model.loss(p, *b[:-1]) * b[-1], params,
                                (*batch, jnp.float32(2.0)))


def test_not_callable_loss_and_bad_call_arguments(tfm_step):
    model, params, batch, step = tfm_step
    with pytest.raises(AutoParallelTypeError, match="loss_fn"):
        pipeline_train_step(3, params, tuple(batch))
    state = step.init(params)
    with pytest.raises(AutoParallelError, match="params"):
        step({"w": params["head"]["w"]}, state, *batch)
    with pytest.raises(AutoParallelError, match="batch input"):
        step(params, state, batch[0][:4], batch[1])
    with pytest.raises(AutoParallelError, match="batch"):
        step(params, state, batch[0])
    with pytest.raises(AutoParallelTypeError, match="packed"):
        step.unpack(params)


# ---------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 32)])
def test_simulated_pipeline_runs_the_tick_table_in_lockstep(p, m):
    from autopar.pipeline.simulation import simulate_schedule

    ticks = 2 * (m + p - 1)
    # GPipe's forward and backward ticks never mix: its bubble is (p - 1) / (m + p - 1)
    g = simulate_schedule([1.0] * p, [2.0] * p, micro_batches=m, schedule="gpipe")
    assert g.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert g.makespan == pytest.approx(3.0 * (m + p - 1))
    # 1F1B with ops of one length: every tick lasts one op, the tick table's bubble
    one = simulate_schedule([1.0] * p, [1.0] * p, micro_batches=m, schedule="1f1b")
    assert one.makespan == pytest.approx(ticks)
    assert one.bubble == pytest.approx(schedule("1f1b", p, m).tick_bubble())
    # a longer backward: a tick where one stage runs it lasts it, so 1F1B is slower
    f1 = simulate_schedule([1.0] * p, [2.0] * p, micro_batches=m, schedule="1f1b")
    assert f1.makespan > g.makespan and f1.bubble > g.bubble
    # every tick moves the boundary buffers both ways, padded to the largest boundary
    sends = [0.25] + [0.0] * (p - 2)
    moved = simulate_schedule([1.0] * p, [2.0] * p, micro_batches=m, schedule="gpipe",
                              sends=sends)
    assert moved.iteration_time == pytest.approx(g.makespan + ticks * 2 * 0.25)


def test_simulated_pipeline_trace_is_consistent_and_exports_chrome_json(tmp_path):
    from autopar.pipeline.simulation import simulate_pipeline

    g = graph_of(small_tfm(layers=8, batch=2))
    t = simulate_pipeline(g, 4, micro_batches=8, schedule="1f1b", device_num=64)
    by = {(b.stage, b.kind, b.micro): b for b in t.blocks}
    assert len(by) == 2 * 4 * 8
    for (s, kind, k), b in by.items():
        assert b.end > b.start
        if kind == "F" and s:
            assert b.start >= by[(s - 1, "F", k)].end       # + the boundary transfer
        if kind == "B" and s < 3:
            assert b.start >= by[(s + 1, "B", k)].end
    for s in range(4):                                      # one op at a time per stage
        mine = sorted((b for b in t.blocks if b.stage == s), key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(mine, mine[1:]))
    assert t.iteration_time >= t.makespan and 0 < t.bubble < 1
    # the step: its launch, the iteration and the slowest stage's optimizer update
    assert t.update > 0 and t.launch == ap.CLUSTERS["accelerator-8x"].step_overhead
    assert t.step_time == t.launch + t.iteration_time + t.update
    trace = json.loads(t.write_chrome_trace(tmp_path / "pipe.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sum(e["cat"] in ("forward", "backward") for e in xs) == 64
    assert {e["tid"] for e in xs} == {1, 2, 3, 4}
    # more micro-batches shrink the bubble; the same plan for GPipe has the same bubble
    t16 = simulate_pipeline(g, 4, micro_batches=16, schedule="gpipe", device_num=64)
    assert t16.bubble < t.bubble


def test_simulator_bad_inputs():
    from autopar.pipeline.simulation import simulate_pipeline, simulate_schedule

    with pytest.raises(AutoParallelTypeError):
        simulate_schedule([1.0, 1.0], [1.0], micro_batches=2)
    with pytest.raises(AutoParallelError):
        simulate_schedule([1.0, -1.0], [1.0, 1.0], micro_batches=2)
    with pytest.raises(AutoParallelError):
        simulate_schedule([1.0, 1.0], [1.0, 1.0], micro_batches=1)
    with pytest.raises(AutoParallelError):
        simulate_schedule([1.0, 1.0], [1.0, 1.0], micro_batches=2, schedule="wave")
    g = graph_of(small_tfm(layers=2))
    with pytest.raises(AutoParallelError):
        simulate_pipeline(g, 3, device_num=8)
    with pytest.raises(AutoParallelTypeError):
        simulate_pipeline(g, 2, device_num=8, recompute="yes")
    with pytest.raises(AutoParallelTypeError):
        simulate_pipeline(g, 2, device_num=8, plans=[None])


def test_auto_parallel_stages_get_their_own_tensor_parallel_plans():
    """Each stage is searched over its 4 devices (dynamic_programming): the wide first
    layer is split (tensor parallel, its activations redistributed at the stage boundary),
    and the step still equals one device."""
    model = mlp(widths=(8, 512, 512, 8), batch=8)
    params, x = model.example_args(KEY)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  search_mode="dynamic_programming", gradients_mean=True):
        step = pipeline_train_step(model.loss, params, (x,), stages=2, micro_batches=2)
    splits = [max(max(pl.split_counts(v)) for v in pl.parameters) for pl in step.plans]
    assert max(splits) > 1                       # some parameter is split inside its stage
    numerics.assert_close(step.grads(params, x), jax.value_and_grad(model.loss), params, x)
    # the simulator takes the stages' own plans, in order (swapped ones gave a number)
    from autopar.pipeline.simulation import simulate_pipeline

    sim = lambda plans: simulate_pipeline(step.graph, 2, micro_batches=2,  # noqa: E731
                                          device_num=8, plans=plans)
    assert sim(list(step.plans)).iteration_time > 0
    with pytest.raises(AutoParallelError, match="not a plan of stage 0"):
        sim(list(step.plans)[::-1])
    # other micro-batches: the stages are the plans' (a search there may cut elsewhere)
    assert simulate_pipeline(step.graph, 2, micro_batches=8, device_num=8,
                             plans=list(step.plans)).iteration_time > 0


@functools.lru_cache(maxsize=None)
def _adam_reference():
    """Two Adam steps of the parallel-optimizer test's MLP on one device (once for both)."""
    model = mlp(widths=(8, 64, 64, 8), batch=16)
    params, x = model.example_args(KEY)
    steps = numerics.optimizer_steps(model.loss, optax.adam(1e-2), 2)
    return numerics.reference(lambda *a: steps(*a)[0], params, x, jit=False)


@pytest.mark.parametrize("acc_shard", [True, False])
def test_parallel_optimizer_inside_the_pipeline(acc_shard):
    """enable_parallel_optimizer with a pipeline: parameters of >= 1 KB are stored 1/dp per
    device (with their Adam state), gathered per step, their gradients reduce-scattered
    (each micro-batch's with gradient_accumulation_shard, else once); biases (256 B) stay
    replicated. Two Adam steps with grad accumulation equal one device's."""
    from autopar.optimizer_shard import device_bytes

    model = mlp(widths=(8, 64, 64, 8), batch=16)
    params, x = model.example_args(KEY)
    opt = optax.adam(1e-2)
    ref = _adam_reference()
    po = {"parallel_optimizer_threshold": 1, "gradient_accumulation_shard": acc_shard}
    with ap.auto_parallel_context(pipeline_stages=2, grad_accumulation_step=2,
                                  enable_parallel_optimizer=True,
                                  parallel_optimizer_config=po, **PIPE):
        step = pipeline_train_step(model.loss, params, (x,), opt, micro_batches=2)
    sharded = {d.name for d in step.shard_decisions if d.sharded}
    assert sharded == {"params/layer0/w", "params/layer1/w", "params/layer2/w"}
    assert step.accumulation_shard is acc_shard
    packed, state = step.pack(params), step.init(params)
    for _ in range(2):
        packed, state, _ = step(packed, state, x)
    numerics.check(step.unpack(packed), ref)
    # per device: parameters + Adam's two moments, the large ones 1/4 (dp = 4 in a stage)
    work, store = step.packing.sizes["float32"], step.packing.store_sizes["float32"]
    biases = 64 + 8           # the larger stage's unsharded elements
    assert store == biases + (work - biases) // 4
    held = device_bytes((packed, state), jax.devices()[0])
    assert 3 * 4 * store <= held <= 3 * 4 * store + 64          # + Adam's step count
    counts = step.collective_counts(packed, state, x)
    assert counts["reduce_scatter"] >= 1 and counts["all_gather"] >= 1


def test_gradients_mean_false_scales_by_the_stage_data_parallel_degree():
    """As train_step: without gradients_mean the synchronised gradient is the sum MindSpore
    produces, dp x the global one (dp = 4 devices per stage here)."""
    model = mlp(widths=(8, 16, 16, 8), batch=8)
    params, x = model.example_args(KEY)
    with ap.auto_parallel_context(**(PIPE | dict(gradients_mean=False, pipeline_stages=2))):
        step = pipeline_train_step(model.loss, params, (x,), micro_batches=2)
    _, grads = step.grads(params, x)
    numerics.assert_close(jax.tree.map(lambda a: a / 4, grads), jax.grad(model.loss), params, x)


def test_train_step_dispatches_to_the_pipeline_and_keeps_a_strategy_file_per_stage(tmp_path):
    model = mlp(widths=(16, 32, 32, 16), batch=8, loss="mse")
    params, *batch = model.example_args(KEY)
    save = tmp_path / "strategy.json"
    with ap.auto_parallel_context(pipeline_stages=2, strategy_ckpt_save_file=str(save),
                                  **{**PIPE, "parallel_mode": "auto_parallel"}):
        step = ap.train_step(model.loss, params, tuple(batch))
        for key, value in (("backend", "pmap"), ("sync_method", "concat")):
            with pytest.raises(AutoParallelError, match=key):
                ap.train_step(model.loss, params, tuple(batch), **{key: value})
    assert isinstance(step, ap.pipeline.PipelineTrainStep) and len(step.plans) == 2
    numerics.check(step.grads(params, *batch), _reference(model, params, batch))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["strategy_stage0.json", "strategy_stage1.json"]
    texts = [(tmp_path / f).read_text() for f in files]
    assert json.loads(texts[0])["fingerprint"] != json.loads(texts[1])["fingerprint"]
    for s, text in enumerate(texts):  # each stage's file says its stage, as MindSpore's (was 0)
        doc = json.loads(text)
        assert doc["current_stage"] == s
        assert {e["stage"] for e in doc["parallel_strategy_item"].values()} == {s}
    with ap.auto_parallel_context(pipeline_stages=2, strategy_ckpt_load_file=str(save),
                                  **{**PIPE, "parallel_mode": "auto_parallel"}):
        again = ap.train_step(model.loss, params, tuple(batch))
    assert [str(a.nodes) for a in again.plans] == [str(b.nodes) for b in step.plans]
    assert [a.stages for a in again.plans] == [b.stages for b in step.plans]
    assert all("loaded from" in " ".join(p.notes) for p in again.plans)


# ---------------------------------------------------------------------------- review R1


@pytest.mark.parametrize("opt", [
    optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0)),
    optax.lamb(1e-3),
    optax.adafactor(1e-2, min_dim_size_to_factor=2),
], ids=["clip_by_global_norm", "lamb", "adafactor"])
def test_non_elementwise_optimizer_is_refused(opt):
    """The optimizer runs on the packed [p, D, N] buffers: a global-norm clip saw the D
    copies of replicated parameters (update norm 0.0005 instead of 0.001), silently."""
    model = mlp(widths=(8, 16, 16, 8), batch=8)
    params, x = model.example_args(KEY)
    with ap.auto_parallel_context(pipeline_stages=2, **PIPE):
        with pytest.raises(AutoParallelError, match="optimizer.*not elementwise"):
            pipeline_train_step(model.loss, params, (x,), opt, micro_batches=2)


def test_elementwise_probe_accepts_elementwise_optimizers():
    from autopar.pipeline.buffers import check_elementwise_optimizer

    for opt in (optax.sgd(0.1, momentum=0.9), optax.adamw(1e-3), optax.chain(
            optax.clip(1.0), optax.rmsprop(1e-3))):
        check_elementwise_optimizer(opt, 2, (2, 4))


def test_comm_fusion_warns_and_parameter_broadcast_applies_in_prepare(monkeypatch):
    """comm_fusion is ignored by the pipeline (one psum per sync group): warned, naming the
    key. parameter_broadcast: prepare() broadcasts rank 0's copy before packing, as
    TrainStep.prepare does."""
    import autopar.pipeline.step

    model = mlp(widths=(8, 16, 16, 8), batch=8)
    params, x = model.example_args(KEY)
    with ap.auto_parallel_context(pipeline_stages=2, all_reduce_fusion_config=[1],
                                  parameter_broadcast=True, **PIPE):
        with pytest.warns(ap.AutoParallelWarning, match="comm_fusion"):
            step = pipeline_train_step(model.loss, params, (x,), micro_batches=2)
    calls = []
    real = autopar.pipeline.step.broadcast_parameters

    def spy(tree, mesh=None):
        calls.append(mesh)
        return real(tree, mesh)

    monkeypatch.setattr(autopar.pipeline.step, "broadcast_parameters", spy)
    placed = step.prepare(params)
    assert calls == [step.mesh]
    for got, want in zip(placed.buffers, step.pack(params).buffers):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    step.prepare(placed)           # already packed: nothing to broadcast
    assert len(calls) == 1


def tiny_loss(p, x, y):
    """mean((tanh(x @ w1) @ w2 - y) ** 2), one named scope per layer."""
    with jax.named_scope("l1"):
        h = jnp.tanh(x @ p["w1"])
    with jax.named_scope("l2"):
        out = h @ p["w2"]
    with jax.named_scope("loss"):
        return jnp.mean((out - y) ** 2)


def tiny_args():
    k = jax.random.split(KEY, 4)
    params = {"w1": jax.random.normal(k[0], (8, 16)), "w2": jax.random.normal(k[1], (16, 8))}
    return params, jax.random.normal(k[2], (16, 8)), jax.random.normal(k[3], (16, 8))


@pytest.fixture(scope="module")
def tiny_step():
    params, x, y = tiny_args()
    with ap.auto_parallel_context(pipeline_stages=2, **PIPE):
        step = pipeline_train_step(tiny_loss, params, (x, y), micro_batches=4)
    return step, params, x, y


def test_integer_and_boolean_leaves_are_carried_and_keys_or_nothing_to_train_refused():
    """As train_step: integer and boolean leaves are carried (packed in buffers of their own
    that the optimizer never sees -- AdamW's decay would move them -- and handed back
    unchanged); a typed PRNG key cannot be packed, and a tree with no floating-point leaf has
    nothing to train: both refused at construction, naming the leaf."""
    params, x, y = tiny_args()
    carried = {"scale": jnp.int32(3), "on": jnp.array([True, False])}

    def loss(p, x, y):
        return tiny_loss(p, x, y) * p["scale"] + jnp.where(p["on"][0], 0.0, 1.0)

    opt = optax.adamw(1e-2, weight_decay=0.5)
    with ap.auto_parallel_context(pipeline_stages=2, **PIPE):
        step = ap.train_step(loss, params | carried, (x, y), opt)
        state = step.init(params | carried)
        new, _, value = step(params | carried, state, x, y)
        assert int(new["scale"]) == 3 and new["on"].tolist() == [True, False]
        assert step.grads(params | carried, x, y)[1]["scale"] is None
        numerics.check(({k: new[k] for k in params}, [value]), numerics.reference(
            numerics.optimizer_steps(lambda p, x, y: loss(p | carried, x, y), opt), params,
            x, y, jit=False))
        with pytest.raises(AutoParallelTypeError, match=r"params\['key'\].*typed PRNG key"):
            pipeline_train_step(tiny_loss, params | {"key": jax.random.key(0)}, (x, y))
        ints = jax.tree.map(lambda a: a.astype(jnp.int32), params)
        for build in (pipeline_train_step, ap.train_step):
            with pytest.raises(AutoParallelTypeError, match=r"params\['w1'\].*int32"):
                build(tiny_loss, ints, (x, y))
        with pytest.raises(AutoParallelTypeError, match=r"params\['w2'\]"):
            pipeline_train_step(tiny_loss, {**params, "w2": "w"}, (x, y))


def test_a_failing_pipelined_build_replaces_no_stage_strategy_file(tmp_path):
    """Stage 1's target is a directory: the typed error names it and stage 0's file keeps
    its old content (every stage is planned and every target checked before any write)."""
    params, x, y = tiny_args()
    (tmp_path / "s_stage0.json").write_text("OLD")
    (tmp_path / "s_stage1.json").mkdir()
    save = str(tmp_path / "s.json")
    with ap.auto_parallel_context(pipeline_stages=2, strategy_ckpt_save_file=save, **PIPE):
        for build in (pipeline_train_step, ap.train_step):
            with pytest.raises(AutoParallelError, match="s_stage1.json.*directory"):
                build(tiny_loss, params, (x, y))
            assert (tmp_path / "s_stage0.json").read_text() == "OLD"
    (tmp_path / "s_stage1.json").rmdir()
    with ap.auto_parallel_context(pipeline_stages=2, strategy_ckpt_save_file=save, **PIPE):
        pipeline_train_step(tiny_loss, params, (x, y))
    for s in range(2):
        assert json.loads((tmp_path / f"s_stage{s}.json").read_text())["fingerprint"]


@pytest.mark.parametrize("bad,err", [("x", AutoParallelTypeError), (None, AutoParallelTypeError),
                                     ({"a": 1}, AutoParallelError), (3.0, AutoParallelError)])
def test_a_bad_batch_input_at_call_time_is_a_typed_error(tiny_step, bad, err):
    """A leaf that is not an array (batch[0]), another structure or shape: typed errors
    from the call, grads and lower, never an AttributeError from the dtype check."""
    step, params, x, y = tiny_step
    state = step.init(params)
    for call in (lambda: step(params, state, bad, y), lambda: step.grads(params, bad, y),
                 lambda: step.lower(params, state, bad, y)):
        with pytest.raises(err, match="batch"):
            call()
    with pytest.raises(AutoParallelTypeError, match=r"params\['w1'\]"):
        step({**params, "w1": "w"}, state, x, y)
    with pytest.raises(AutoParallelError, match="parameter"):
        step({**params, "w1": 1.0}, state, x, y)


def test_opt_state_is_checked_as_train_step_checks_it(tiny_step):
    """opt_state must be what init() makes: None, a state of other parameters or the
    pytree's state (not the packed buffers') raise the typed error TrainStep raises."""
    step, params, x, y = tiny_step
    packed = step.pack(params)
    for bad in (None, optax.sgd(0.1, momentum=0.9).init(params),
                optax.adam(0.1).init(packed)):
        for call in (lambda: step(params, bad, x, y), lambda: step(packed, bad, x, y),
                     lambda: step.lower(params, bad, x, y)):
            with pytest.raises(AutoParallelTypeError, match="opt_state"):
                call()
    new, state, loss = step(packed, step.init(params), x, y)
    assert isinstance(new, PackedParams) and np.isfinite(float(loss))


def test_the_schedule_comes_from_pipeline_config():
    """MindSpore's pipeline_config['pipeline_scheduler'] picks the schedule; an argument wins."""
    model = mlp(widths=(8, 16, 8), batch=8)
    params, x = model.example_args(KEY)
    for scheduler in ("gpipe", "1f1b"):
        with ap.auto_parallel_context(**PIPE, pipeline_stages=2,
                                      pipeline_config={"pipeline_scheduler": scheduler}):
            step = pipeline_train_step(model.loss, params, (x,), micro_batches=2)
            assert step.schedule_table.name == scheduler
            other = "1f1b" if scheduler == "gpipe" else "gpipe"
            step = pipeline_train_step(model.loss, params, (x,), micro_batches=2,
                                       schedule=other)
            assert step.schedule_table.name == other


def test_the_pipelined_step_and_the_context_agree_on_the_modes():
    """One rule (strategies.modes.PIPELINE_MODES): hybrid_parallel with stages is refused by
    both, not accepted by the step and then refused by the search."""
    model = mlp(widths=(8, 16, 8), batch=8)
    params, x = model.example_args(KEY)
    with ap.auto_parallel_context(device_num=8, parallel_mode="hybrid_parallel"):
        with pytest.raises(ap.AutoParallelError, match="parallel_mode"):
            pipeline_train_step(model.loss, params, (x,), stages=2, micro_batches=2)
    with ap.auto_parallel_context(device_num=8, parallel_mode="hybrid_parallel",
                                  pipeline_stages=2):
        with pytest.raises(ap.ContextConflictError, match="pipeline_stages"):
            ap.resolve_context()


def test_the_default_schedule_says_when_the_other_is_priced_faster():
    """1F1B (MindSpore's default) runs in lockstep: where GPipe is priced faster, the step's
    plan says so with both prices; a schedule the user chose gets no note."""
    from autopar.pipeline.simulation import pipeline_trace

    m = transformer(layers=4, hidden=256, heads=4, seq=64, vocab=256, batch=8)
    params, *batch = jax.eval_shape(m.example_args, jax.random.key(0))
    clus = ap.CLUSTERS["accelerator-8x"]
    steps = {}
    for chosen in (None, "1f1b"):
        extra = {} if chosen is None else {"pipeline_config": {"pipeline_scheduler": chosen}}
        with ap.auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                      pipeline_stages=2, gradients_mean=True, **extra):
            steps[chosen] = pipeline_train_step(m.loss, params, tuple(batch), micro_batches=4,
                                                cluster=clus)
    step = steps[None]
    times = {name: pipeline_trace(step.graph, 2, device_num=8, cluster=clus, fp32=False,
                                  micro_batches=4, schedule=name,
                                  plans=list(step.plans)).step_time
             for name in ("1f1b", "gpipe")}
    assert times["gpipe"] < times["1f1b"]
    note, = step.plan.notes
    assert "gpipe" in note and f"{times['1f1b'] * 1e3:.4g} ms" in note and note in str(step.plan)
    assert steps["1f1b"].plan.notes == ()
