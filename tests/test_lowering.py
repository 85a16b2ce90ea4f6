"""Rewrite + lowering: sharded programs equal the single-device reference, the communication
inserted is exactly what the plan says, and every redistribution step matches the NumPy model.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import autopar as ap
from autopar.lower import apply_step, jax_mesh
from autopar.models import mlp, resnet50, tfm_stack, transformer
from clusters import COMPUTE_BOUND
import numerics
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.redistribution import redistribute

import shards

KEY = jax.random.key(0)


MODELS = {
    "mlp": lambda: mlp(widths=(16, 64, 16), batch=8),
    "tfm_stack": lambda: tfm_stack(blocks=1, batch=2, seq=8, hidden=32, heads=2),
    "transformer": lambda: transformer(layers=1, hidden=32, heads=2, seq=8, vocab=64, batch=4),
}
_CACHE: dict[str, tuple] = {}
_GRAD_REFS: dict[str, numerics.Reference] = {}


def model_case(name: str) -> tuple:
    """(model, concrete args, reference loss (float64 + one device), first matmul, graph)."""
    if name not in _CACHE:
        m = MODELS[name]()
        args = m.example_args(KEY)
        g = ap.trace(m.loss, *args)
        first = next(n for n in g.nodes if n.op == "dot_general")
        _CACHE[name] = (m, args, numerics.reference(m.loss, *args), first, g)
    return _CACHE[name]


def grad_reference(name: str) -> numerics.Reference:
    """The float64 and one-device gradients of the zoo model ``name``, computed once."""
    if name not in _GRAD_REFS:
        m, args, _, _, _ = model_case(name)
        _GRAD_REFS[name] = numerics.reference(jax.grad(m.loss), *args)
    return _GRAD_REFS[name]


def column_split(node: ap.graph.Node, graph: ap.Graph, n: int) -> tuple:
    """A strategy splitting the rhs's last (free) dim n ways: MindSpore's column parallel."""
    lhs, rhs = (graph.spec(v).rank for v in node.inputs)
    return ((1,) * lhs, (1,) * (rhs - 1) + (n,))


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def collectives(text: str) -> dict[str, int]:
    kinds = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "collective_permute")
    return {k: len(re.findall(rf"stablehlo\.{k}\b", text)) for k in kinds}


# ------------------------------------------------------------------ zoo models, every mode

CONFIGS = {
    "recursive_programming": dict(parallel_mode="auto_parallel",
                                  search_mode="recursive_programming"),
    "dynamic_programming": dict(parallel_mode="auto_parallel", search_mode="dynamic_programming"),
    "sharding_propagation": dict(parallel_mode="auto_parallel",
                                 search_mode="sharding_propagation"),
    "data_parallel": dict(parallel_mode="data_parallel"),
    "semi_auto_parallel": dict(parallel_mode="semi_auto_parallel"),
}


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_forward_equals_reference(name, config, devices):
    m, args, ref, first, g = model_case(name)
    kw = CONFIGS[config]
    ap.set_auto_parallel_context(device_num=devices, **kw)
    fixed = None
    if config in ("sharding_propagation", "semi_auto_parallel"):
        fixed = {first.name: column_split(first, g, devices)}
    cluster = COMPUTE_BOUND if kw["parallel_mode"] == "auto_parallel" else None
    f = ap.parallelize(m.loss, *args, fixed=fixed, cluster=cluster)
    assert f.parallel_graph.device_num == devices
    numerics.check(f(*args), ref)
    if fixed:
        assert f.plan.strategy(first.name) == fixed[first.name]


def test_resnet50_forward_equals_reference():
    m = resnet50(num_classes=16, batch=4, image_size=32)
    args = m.example_args(KEY)
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                 search_mode="dynamic_programming")
    f = ap.parallelize(m.loss, *args, cluster=COMPUTE_BOUND)
    assert any(n.kind == "conv" and max(f.plan.nodes[n.name].splits) > 1
               for n in f.parallel_graph.nodes if not n.is_comm)
    numerics.assert_close(f(*args), m.loss, *args)


def test_split_iota_is_offset_by_block():
    """An iota whose values are written out (XLA fuses one read only by elementwise
    operators, and the model prices that free, so the transformer's mask iota stays whole)
    is split on the compute-bound cluster: each device numbers its own block."""
    def f(x):
        return x * 2.0, jax.lax.broadcasted_iota(jnp.float32, (64, 32), 0)

    x = jnp.ones((64, 32))
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")
    fn = ap.parallelize(f, x, cluster=COMPUTE_BOUND)
    pg = fn.parallel_graph
    iota = [n for n in pg.nodes if n.op == "iota"]
    assert iota and pg.values[iota[0].outputs[0]].layout.used_axes()
    for got, want in zip(fn(x), f(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_split_gather_alltoall_are_exercised():
    """The compute-bound transformer plan splits the embedding gather and moves splits with
    all_to_all: the cases the generic tests could miss."""
    m, args, ref, _, _ = model_case("transformer")
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                 search_mode="dynamic_programming", enable_alltoall=True)
    f = ap.parallelize(m.loss, *args, cluster=COMPUTE_BOUND)
    pg = f.parallel_graph
    split = {n.op for n in pg.nodes if not n.is_comm
             and any(pg.values[o].layout.used_axes() for o in n.outputs)}
    assert {"gather", "reshape", "transpose", "split", "dot_general"} <= split
    assert "all_to_all" in pg.comm_counts()
    numerics.check(f(*args), ref)


def close_scaled(a, b, rtol=1e-5, scale=1e-6):
    """rtol 1e-5 plus an absolute tolerance of 1e-6 x the tensor's largest reference magnitude.

    A sharded program sums partial products (and the backward sums cotangents) in another
    order than one device: each element is off by a few float32 ulps *of the terms summed*,
    so an element that is tiny because large terms cancel (a gradient entry of 1e-7 in a
    tensor whose entries reach 2) has a large relative error with no bug anywhere. Measured on
    the zoo transformer: max absolute difference 6e-7 at max |ref| 2.2, rtol-only failures
    only on elements below 1e-4 |ref|max.
    """
    b = np.asarray(b)
    atol = scale * float(np.max(np.abs(b))) if b.size else 0.0
    np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name,config", [("tfm_stack", "dynamic_programming"),
                                         ("transformer", "dynamic_programming"),
                                         ("transformer", "recursive_programming"),
                                         ("transformer", "data_parallel")])
def test_gradients_flow_through_the_sharded_program(name, config):
    m, args, _, _, _ = model_case(name)
    ref = grad_reference(name)
    kw = dict(CONFIGS[config])
    auto = kw["parallel_mode"] == "auto_parallel"
    if auto:  # exercise the transpose of all_to_all too
        kw["enable_alltoall"] = True
    ap.set_auto_parallel_context(device_num=8, **kw)
    f = ap.parallelize(m.loss, *args, cluster=COMPUTE_BOUND if auto else None)
    numerics.check(jax.grad(f)(*args), ref)


# ------------------------------------------------------------------ property: random MLPs


@st.composite
def mlp_cases(draw):
    devices = draw(st.sampled_from([1, 2, 4, 8]))
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.sampled_from([4, 8, 12, 16])) for _ in range(depth + 1))
    batch = draw(st.sampled_from([2, 4, 8]))
    bias = draw(st.booleans())
    activation = draw(st.sampled_from(["gelu", "relu", "tanh", "identity"]))
    strategies = []
    for k, n in zip(widths, widths[1:]):
        splits = []
        left = devices
        for size in (batch, k, n):
            s = draw(st.sampled_from([d for d in (1, 2, 4, 8) if size % d == 0
                                      and left % d == 0]))
            splits.append(s)
            left //= s
        b, c, o = splits
        strategies.append(((b, c), (c, o)))
    mode = draw(st.sampled_from(["semi_auto_parallel", "sharding_propagation"]))
    return devices, widths, batch, bias, activation, tuple(strategies), mode


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(mlp_cases())
def test_random_mlp_strategies_match_reference(case):
    devices, widths, batch, bias, activation, strategies, mode = case
    m = mlp(widths=widths, batch=batch, bias=bias, activation=activation)
    args = m.example_args(KEY)
    with ap.auto_parallel_context(device_num=devices, **(
            dict(parallel_mode="semi_auto_parallel") if mode == "semi_auto_parallel" else
            dict(parallel_mode="auto_parallel", search_mode=mode))):
        g = ap.trace(m.apply, *args)
        dots = [n.name for n in g.nodes if n.op == "dot_general"]
        fixed = dict(zip(dots, strategies))
        f = ap.parallelize(m.apply, *args, fixed=fixed)
    for name, s in fixed.items():
        assert f.plan.strategy(name) == s
    out = f(*args)
    numerics.assert_close(out, m.apply, *args, single=m.apply(*args), jit=False)
    assert out.shape == (batch, widths[-1])


# ------------------------------------------------------------------ redistribution steps


def _random_layouts(rng: np.random.Generator, mesh: DeviceMesh, rank: int
                    ) -> tuple[TensorLayout, TensorLayout]:
    src: list[list[str]] = [[] for _ in range(rank)]
    dst: list[list[str]] = [[] for _ in range(rank)]
    partial = []
    for a in mesh.names:
        r = rng.integers(0, rank + 2)  # a dim, partial (rank) or unused (rank + 1)
        if r < rank:
            src[r].append(a)
        elif r == rank:
            partial.append(a)
        r = rng.integers(0, rank + 1)
        if r < rank:
            dst[r].append(a)
    for d in src + dst:
        rng.shuffle(d)  # any axis order within a dim, not only the mesh order
    keep = [a for a in partial if rng.random() < 0.25]
    return (TensorLayout(tuple(map(tuple, src)), tuple(partial)),
            TensorLayout(tuple(map(tuple, dst)), tuple(keep)))


def _run_steps(x: np.ndarray, src: TensorLayout, steps: tuple, mesh: DeviceMesh) -> None:
    local = shards.shard(x, src, mesh, np.random.default_rng(1))
    coords = shards.devices(mesh)
    stacked = np.stack([local[c] for c in coords]).astype(np.float32)
    spec = P(mesh.names) if mesh.names else P()

    def body(block):
        y = block[0]
        for s in steps:
            y = apply_step(y, s, mesh)
        return y[None]

    f = jax.jit(jax.shard_map(body, mesh=jax_mesh(mesh), in_specs=spec, out_specs=spec,
                              check_vma=False))
    got = np.asarray(f(stacked))
    want = local
    for s in steps:
        want = shards.apply(s, want, mesh)
    for i, c in enumerate(coords):
        np.testing.assert_allclose(got[i], want[c], rtol=1e-5, atol=1e-5)


def test_every_step_kind_through_lax_matches_numpy_model():
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    for case in range(36):
        mesh = DeviceMesh.for_devices([4, 8, 6][case % 3])
        rank = int(rng.integers(1, 4))
        src, dst = _random_layouts(rng, mesh, rank)
        shape = tuple(mesh.device_num * int(rng.integers(1, 3)) for _ in range(rank))
        steps = redistribute(shape, 4, src, dst, mesh, enable_alltoall=bool(case % 2))
        seen |= {s.kind for s in steps}
        x = rng.standard_normal(shape)
        _run_steps(x, src, steps, mesh)
    assert seen == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice"}


# ------------------------------------------------------------------ communication counts


def test_megatron_mlp_forward_has_one_all_reduce():
    m = mlp(widths=(64, 1024, 64), batch=8, bias=False)
    args = m.example_args(KEY)
    fixed = {"layer0/dot_general_0": ((1, 1), (1, 8)),
             "layer1/dot_general_0": ((1, 8), (8, 1))}
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                 search_mode="sharding_propagation",
                                 dataset_strategy="full_batch")
    f = ap.parallelize(m.apply, *args, fixed=fixed)
    assert f.plan.split_counts("params/layer0/w") == (1, 8)
    assert f.plan.split_counts("params/layer1/w") == (8, 1)
    assert collectives(f.as_text(*args)) == {"all_reduce": 1, "reduce_scatter": 0,
                                             "all_gather": 0, "all_to_all": 0,
                                             "collective_permute": 0}
    assert f.parallel_graph.comm_counts() == {"all_reduce": 1}
    numerics.assert_close(f(*args), m.apply, *args, single=m.apply(*args), jit=False)


def test_data_parallel_mlp_has_only_the_loss_all_reduce():
    m = mlp(widths=(32, 64, 32), batch=16)
    args = m.example_args(KEY)
    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel")
    f = ap.parallelize(m.loss, *args)
    assert collectives(f.as_text(*args)) == {"all_reduce": 1, "reduce_scatter": 0,
                                             "all_gather": 0, "all_to_all": 0,
                                             "collective_permute": 0}
    assert f.collective_counts(*args)["all_reduce"] == 1
    (comm,) = f.parallel_graph.comm_nodes()
    assert comm.note.endswith("for loss/div_0")
    numerics.assert_close(f(*args), m.loss, *args, single=m.loss(*args), jit=False)


# ------------------------------------------------------------------ structure, printing, errors


def test_parallel_graph_dump_and_layouts():
    m = mlp(widths=(64, 1024, 64), batch=8, bias=False, activation="identity")
    args = m.example_args(KEY)
    g = ap.trace(m.apply, *args)
    ap.set_auto_parallel_context(device_num=8, parallel_mode="semi_auto_parallel",
                                 dataset_strategy="full_batch")
    plan = ap.search(g, fixed={"layer0/dot_general_0": ((1, 1), (1, 8)),
                               "layer1/dot_general_0": ((1, 8), (8, 1))})
    pg = ap.rewrite.rewrite(g, plan)
    text = str(pg)
    assert "AllReduce[a0,a1,a2]" in text and "%layer1/dot_general_0" in text
    assert "[64,128]" in text and "S(1)[a0,a1,a2]" in text and "P[a0,a1,a2]" in text
    assert pg.values["params/layer0/w"].local_shape == (64, 128)
    assert pg.values["layer1/dot_general_0"].layout.partial == ("a0", "a1", "a2")
    (out,) = pg.outputs
    assert pg.values[out].layout == TensorLayout(((), ())) and pg.values[out].kind == "comm"
    assert pg.comm_bytes() == 8 * 64 * 4
    assert "AllReduce 1" in pg.summary()


def test_redistribution_is_shared_between_consumers():
    def f(w, x):
        h = x @ w
        return jnp.sum(h * 2.0) + jnp.sum(h * 3.0)

    w, x = jnp.ones((8, 16)), jnp.ones((4, 8))
    g = ap.trace(f, w, x)
    ap.set_auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel",
                                 dataset_strategy="full_batch")
    plan = ap.search(g, fixed={"dot_general_0": ((1, 4), (4, 1)), "mul_0": ((1, 1), ()),
                               "mul_1": ((1, 1), ()), "reduce_sum_0": ((1, 1),),
                               "reduce_sum_1": ((1, 1),), "add_0": ((), ())})
    pg = ap.rewrite.rewrite(g, plan)
    assert pg.comm_counts() == {"all_reduce": 1, "slice": 1}  # both muls read one all-reduced h
    close(ap.lower.lower(pg)(w, x), f(w, x))
    # the plan's price is the program's: h's all-reduce once (and so is the objective)
    assert plan.cost.redistribution == pytest.approx(_priced_comm(g, plan, pg), rel=1e-12)
    assert plan.objective == pytest.approx(plan.cost.total, rel=1e-12)


def _priced_comm(g, plan, pg):
    """The rewritten program's communication nodes, each priced by the plan's cost model
    (with its transpose in backward when the value carries a gradient)."""
    from autopar.strategies.cost import CostModel, get_cluster
    from autopar.strategies.problem import requires_grad
    from autopar.strategies.redistribution import transpose_step

    cm, grad = CostModel(get_cluster(plan.cluster)), requires_grad(g)
    total = 0.0
    for n in pg.comm_nodes():
        total += cm.step_time(n.step, plan.mesh)
        back = transpose_step(n.step)
        if back is not None and grad[pg.values[n.outputs[0]].origin]:
            total += cm.step_time(back, plan.mesh)
    return total


def test_single_device_program_has_no_communication():
    m, args, ref, _, _ = model_case("mlp")
    ap.set_auto_parallel_context(device_num=1, parallel_mode="stand_alone")
    f = ap.parallelize(m.loss, *args)
    assert f.parallel_graph.comm_counts() == {}
    numerics.check(f(*args), ref)


def test_errors_name_the_problem():
    m, args, _, _, g = model_case("mlp")
    ap.set_auto_parallel_context(device_num=4, parallel_mode="data_parallel")
    f = ap.parallelize(m.loss, *args)
    bad = jax.tree.map(lambda a: a, args)
    with pytest.raises(ap.AutoParallelError, match="shape must be"):
        f(bad[0], jnp.ones((3, 16)))
    with pytest.raises(ap.AutoParallelError, match="structure"):
        f(args[0])
    other = ap.trace(lambda w, x: x @ w, jnp.ones((4, 4)), jnp.ones((2, 4)))
    with pytest.raises(ap.AutoParallelError, match="another graph"):
        ap.rewrite.rewrite(other, f.plan)
    with pytest.raises(ap.AutoParallelError, match="mesh"):
        ap.lower.lower(f.parallel_graph, jax_mesh(DeviceMesh.for_devices(2)))
    with pytest.raises(TypeError):
        ap.lower.lower(g)
    # an operator kind the lowering does not know, with split tensors, is refused by name
    pg = f.parallel_graph
    node = next(n for n in pg.nodes if n.op == "dot_general")
    odd = dataclasses.replace(node, op="mystery", kind="mystery")
    broken = dataclasses.replace(pg, nodes=tuple(odd if n is node else n for n in pg.nodes))
    with pytest.raises(ap.AutoParallelError, match=r"layer0/dot_general_0.*mystery"):
        ap.lower.lower(broken)


def test_lower_reuses_a_given_mesh_and_as_text_is_stablehlo():
    m, args, ref, _, _ = model_case("mlp")
    ap.set_auto_parallel_context(device_num=8, parallel_mode="data_parallel")
    mesh = jax_mesh(DeviceMesh.for_devices(8), jax.devices()[::-1])
    f = ap.parallelize(m.loss, *args, mesh=mesh)
    assert f.mesh is mesh
    numerics.check(f(*args), ref)
    assert "stablehlo" in f.as_text(*args)
    assert f.lowered.in_shardings[-1].spec == P(("a0", "a1", "a2"), None)


def test_constants_are_sliced_and_pytree_outputs_keep_their_layouts():
    table = np.arange(96.0, dtype=np.float32).reshape(6, 16)

    def f(w, x):
        h = (x @ w) * table
        return {"h": h, "w": w, "k": 3.0, "s": jnp.sum(h)}

    w, x = jnp.ones((8, 16)), jnp.arange(48.0, dtype=jnp.float32).reshape(6, 8)
    ap.set_auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel")
    pf = ap.parallelize(f, w, x, fixed={"dot_general_0": ((1, 1), (1, 2)),
                                         "mul_0": ((2, 2), (2, 2))})
    sliced = [n for n in pf.parallel_graph.comm_nodes() if n.note.startswith("const:")]
    assert sliced and all(n.op == "slice" for n in sliced)
    out, ref = pf(w, x), f(w, x)
    assert set(out) == {"h", "w", "k", "s"}
    jax.tree.map(close, out, ref)
    assert out["h"].sharding.spec == P("a0", "a1")  # outputs stay split: no gather at the end


# ------------------------------------------------------------------ fused kernels (issue 7 part 5)


def _row_parallel():
    """tanh(x @ w1) @ w2 with w1 column-split and w2 row-split 4 ways, output rows split:
    the second matmul's partial output is reduce-scattered and the first's input gathered."""
    def f(w1, w2, x):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2)

    args = (jax.random.normal(KEY, (32, 64)) / 32 ** 0.5,
            jax.random.normal(jax.random.key(1), (64, 32)) / 8.0,
            jax.random.normal(jax.random.key(2), (16, 32)))
    g = ap.trace(f, *args)
    d0, d1 = (n.name for n in g.nodes if n.op == "dot_general")
    fixed = {d0: ((1, 1), (1, 4)), d1: ((1, 4), (4, 1)), g.nodes[-1].name: ((4, 1),)}
    with ap.auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel"):
        plan = ap.search(g, fixed=fixed)
    return f, args, g, plan


def test_fused_kernels_replace_matmul_collective_pairs_and_stay_differentiable():
    from autopar.lower import lower

    f, args, g, plan = _row_parallel()
    plain = ap.rewrite.rewrite(g, plan, fused_kernels=False)
    fused = ap.rewrite.rewrite(g, plan, fused_kernels=True)
    assert "mm_reduce_scatter" not in plain.comm_counts()
    counts = fused.comm_counts()
    assert counts["mm_reduce_scatter"] == 1 and counts["all_gather_matmul"] == 1
    assert "reduce_scatter" not in counts
    assert "MatMulReduceScatter" in str(fused) and "AllGatherMatMul" in str(fused)
    lo_p, lo_f = lower(plain), lower(fused)
    want = jax.jit(f)(*args)
    close(lo_p(*args), want)
    close(lo_f(*args), want)
    cp, cf = collectives(lo_p.as_text(*args)), collectives(lo_f.as_text(*args))
    assert cp["reduce_scatter"] == 1 and cp["collective_permute"] == 0
    assert cf["reduce_scatter"] == 0 and cf["collective_permute"] == 2 * 3  # two rings, p-1
    assert cf["all_gather"] == cp["all_gather"] - 1
    loss = lambda lo: lambda *a: jnp.sum(lo(*a) ** 2)  # noqa: E731
    g_ref = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(*args)
    g_f = jax.grad(loss(lo_f), argnums=(0, 1, 2))(*args)
    g_p = jax.grad(loss(lo_p), argnums=(0, 1, 2))(*args)
    jax.tree.map(close_scaled, g_f, g_ref)
    jax.tree.map(close_scaled, g_f, g_p)
    # lower(fused_kernels=True) applies the same rule to an unfused program
    assert lower(plain, fused_kernels=True).parallel_graph.comm_counts() == counts


def test_comm_bytes_counts_fused_collectives_and_auto_uses_the_plans_cluster():
    from autopar.strategies.cost import get_cluster

    _, _, g, plan = _row_parallel()
    plain = ap.rewrite.rewrite(g, plan, fused_kernels=False)
    fused = ap.rewrite.rewrite(g, plan, fused_kernels=True)
    assert len(fused.fused_nodes()) == 2 and plain.comm_bytes() > 0
    assert fused.comm_bytes() == plain.comm_bytes()  # fusing moves the same bytes
    # a plan priced on a custom cluster (not a preset name): "auto" prices with that cluster
    custom = get_cluster("accelerator-8x").model_copy(update={"name": "my-cluster"})
    fixed = {n.name: plan.nodes[n.name].strategy for n in g.nodes}
    with ap.auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel"):
        plan_c = ap.search(g, fixed=fixed, cluster=custom)
    assert len(ap.rewrite.rewrite(g, plan_c, fused_kernels="auto").fused_nodes()) == 2


def test_fused_kernels_auto_follows_the_overlap_model():
    from autopar.kernel_rules import predict

    _, _, g, plan = _row_parallel()
    # cpu-emulated: 8 emulated devices share 2 cores, nothing overlaps -> never fused
    assert ap.rewrite.rewrite(g, plan, cluster="cpu-emulated").fused_nodes() == ()
    # accelerator preset: the overlapped ring hides the matmul blocks behind the transfers
    assert len(ap.rewrite.rewrite(g, plan, cluster="accelerator-8x").fused_nodes()) == 2
    big = dict(flops=2 * 8192 * 4096 * 4096, x_bytes=8192 * 4096 * 2, out_bytes=8192 * 4096 * 2,
               comm_bytes=8192 * 4096 * 2, p=8, intra=True, itemsize=2)
    acc = predict("all_gather_matmul", cluster="accelerator-8x", **big)
    cpu = predict("all_gather_matmul", cluster="cpu-emulated", **big)
    assert acc["gain"] > 1.0 > cpu["gain"]


def test_fused_nodes_run_the_ring_schedule_the_model_picks():
    """Each fused node records (bidirectional, chunks) from best_schedule on the cluster and
    lowers to that ring: both ways on the accelerator preset (ceil((p-1)/2) rounds, same
    p - 1 transfers), one matmul per ring where nothing overlaps; results stay exact."""
    from autopar.kernel_rules import DEFAULT_SCHEDULE, best_schedule, predict
    from autopar.lower import lower

    f, args, g, plan = _row_parallel()
    want = jax.jit(f)(*args)
    acc = ap.rewrite.rewrite(g, plan, cluster="accelerator-8x")
    cpu = ap.rewrite.rewrite(g, plan, fused_kernels=True, cluster="cpu-emulated")
    for pg, bidirectional in ((acc, True), (cpu, False)):
        nodes = pg.fused_nodes()
        assert len(nodes) == 2
        assert all(n.params["bidirectional"] is bidirectional for n in nodes)
        assert all(("both ways" if bidirectional else "one way") in n.note for n in nodes)
        lo = lower(pg)
        close(lo(*args), want)
        text = lo.as_text(*args)
        assert collectives(text)["collective_permute"] == 2 * 3   # p - 1 per kernel
    g_ref = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(*args)
    g_acc = jax.grad(lambda *a: jnp.sum(lower(acc)(*a) ** 2), argnums=(0, 1, 2))(*args)
    jax.tree.map(close_scaled, g_acc, g_ref)                      # both-ways rings transpose
    # ring steps of the both-ways schedule: 2 to the right and 1 to the left per kernel (p=4)
    pairs = re.findall(r"source_target_pairs = dense<(\[\[.*?\]\])>", lower(acc).as_text(*args))
    assert len(set(pairs)) == 2
    # no overlap: mm_reduce_scatter in one matmul (block matmuls would copy x's rows for
    # nothing); all_gather_matmul picks the smaller of its two re-layout passes
    rs = [n for n in cpu.fused_nodes() if n.op == "mm_reduce_scatter"]
    assert [n.params["chunks"] for n in rs] == [1]
    shapes = dict(flops=2.0 * 4096 * 1024 * 1024, x_bytes=4096 * 1024 * 4.0,
                  out_bytes=4096 * 1024 * 4.0, comm_bytes=4096 * 1024 * 4.0, p=8, intra=True)
    one = predict("all_gather_matmul", cluster="accelerator-8x", **shapes)
    both = predict("all_gather_matmul", cluster="accelerator-8x", bidirectional=True, **shapes)
    assert both["fused"] < one["fused"]                      # 4 rounds instead of 7
    serial = [predict("all_gather_matmul", cluster="cpu-emulated", bidirectional=b, **shapes)
              for b in (False, True)]
    assert serial[0]["fused"] == serial[1]["fused"]          # one core pool moves both ways
    sched, cost = best_schedule("all_gather_matmul", cluster="accelerator-8x", **shapes)
    assert sched == {"bidirectional": True, "chunks": None} and cost["fused"] == both["fused"]
    assert set(DEFAULT_SCHEDULE) == set(sched)
    with pytest.raises(ap.AutoParallelError, match="chunks"):
        predict("all_gather_matmul", cluster="accelerator-8x", chunks=3, **shapes)


@pytest.mark.parametrize("bad,exc", [("yes", ap.AutoParallelError), (1, ap.AutoParallelTypeError),
                                     (None, ap.AutoParallelTypeError)])
def test_fused_kernels_option_is_validated(bad, exc):
    from autopar.lower import lower

    _, _, g, plan = _row_parallel()
    with pytest.raises(exc, match="fused_kernels"):
        ap.rewrite.rewrite(g, plan, fused_kernels=bad)
    pg = ap.rewrite.rewrite(g, plan, fused_kernels=False)
    if bad is not None:  # None means "as rewritten" for lower
        with pytest.raises(exc, match="fused_kernels"):
            lower(pg, fused_kernels=bad)


def test_parallelize_and_train_step_take_the_fused_kernels_option():
    f, args, g, plan = _row_parallel()
    fixed = {n: s.strategy for n, s in plan.nodes.items()}

    def loss(params, x):
        return jnp.mean(f(params[0], params[1], x) ** 2)

    params, x = (args[0], args[1]), args[2]
    lg = ap.trace(loss, params, x)
    d0, d1 = (n.name for n in lg.nodes if n.op == "dot_general")
    lfixed = {d0: ((1, 1), (1, 4)), d1: ((1, 4), (4, 1))}
    with ap.auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel",
                                  gradients_mean=True):
        on = ap.parallelize(f, *args, fixed=fixed, fused_kernels=True)
        off = ap.parallelize(f, *args, fixed=fixed, fused_kernels=False)
        step = ap.train_step(loss, params, (x,), fixed=lfixed, fused_kernels=True)
        for bad, exc in (("always", ap.AutoParallelError), (1, ap.AutoParallelTypeError)):
            with pytest.raises(exc, match="fused_kernels"):
                ap.parallelize(f, *args, fused_kernels=bad)
            with pytest.raises(exc, match="fused_kernels"):
                ap.train_step(loss, params, (x,), fused_kernels=bad)
    assert len(on.parallel_graph.fused_nodes()) == 2 and not off.parallel_graph.fused_nodes()
    close(on(*args), off(*args))
    c_on, c_off = on.collective_counts(*args), off.collective_counts(*args)
    assert c_on["collective_permute"] == 6 and c_on["reduce_scatter"] == 0
    assert c_off["collective_permute"] == 0 and c_off["reduce_scatter"] == 1
    # the training step runs the fused ring kernels and its gradients equal one device's
    assert step.parallel_graph.fused_nodes()
    numerics.assert_close(step.grads(params, x), jax.value_and_grad(loss), params, x)


def test_reshape_merging_an_inner_split_dim_is_refused_clearly():
    """(8, 4, 8) -> (8, 32): splitting the merged group's leading dim runs and matches; its
    inner dim would give strided pieces no layout describes, so it is refused by name."""
    def f(x):
        return jnp.sum(jnp.tanh(x.reshape(8, 32)) * jnp.arange(32.0))

    x = jax.random.normal(KEY, (8, 4, 8))
    ap.set_auto_parallel_context(device_num=4, parallel_mode="semi_auto_parallel")
    g = ap.trace(f, x)
    r = next(n.name for n in g.nodes if n.op == "reshape")
    pf = ap.parallelize(f, x, fixed={r: ((1, 4, 1),)})
    close(pf(x), jax.jit(f)(x))
    with pytest.raises(ap.AutoParallelError, match="inner factor.*leading dim"):
        ap.parallelize(f, x, fixed={r: ((1, 1, 4),)})


def test_batch_that_does_not_divide_the_degree_is_split_by_a_divisor():
    """data_parallel on 4 devices, batch 6: split 2 ways (exact), never 4 uneven shards."""
    m = mlp(widths=(8, 16, 8), batch=6)
    args = m.example_args(KEY)
    ap.set_auto_parallel_context(device_num=4, parallel_mode="data_parallel")
    f = ap.parallelize(m.loss, *args)
    x = f.parallel_graph.values[f.parallel_graph.inputs[-1]]
    assert x.spec.shape[0] == 6 and x.local_shape[0] == 3
    numerics.assert_close(f(*args), m.loss, *args)
