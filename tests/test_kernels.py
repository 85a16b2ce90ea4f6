"""Fused ring kernels: mm_reduce_scatter, all_gather_matmul and the NPU-compatible wrapper.

Every result is checked against a NumPy reference over hypothesis-drawn (small) shapes on
axes of 1, 2, 4 and 8 emulated devices; the communication is checked in the lowered text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.kernels import all_gather_matmul, mm_reduce_scatter, npu_mm_reduce_scatter_base

AXIS = "tp"
FAST = settings(max_examples=15, deadline=None, derandomize=True)
FEW = settings(max_examples=8, deadline=None, derandomize=True)


@functools.cache
def mesh(p: int) -> jax.sharding.Mesh:
    return jax.make_mesh((p,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:p])


def divisors(p: int) -> list[int]:
    return [d for d in range(1, p + 1) if p % d == 0]


def permute_shifts(text: str, p: int) -> dict[int, int]:
    """Ring shift (+1 right, -1 left) -> number of collective_permutes in lowered text."""
    out: dict[int, int] = {}
    for pairs in re.findall(r"source_target_pairs = dense<(\[\[.*?\]\])>", text):
        src, dst = np.asarray(json.loads(pairs)).T
        shifts = {int((d - s_) % p) for s_, d in zip(src, dst)}
        assert len(shifts) == 1, pairs
        shift = shifts.pop()
        key = +1 if shift == 1 else -1 if shift == p - 1 else shift
        out[key] = out.get(key, 0) + 1
    return out


def ring_shifts(p: int, bidirectional: bool) -> dict[int, int]:
    """Expected permutes per direction: one way p - 1 to the right; both ways p // 2 right
    and the rest left."""
    if not bidirectional or p == 2:
        return {+1: p - 1}
    return {+1: p // 2, -1: p - 1 - p // 2}


@functools.cache
def rs_fn(p: int, bidirectional: bool, chunks: int | None, with_bias: bool) -> Callable:
    """Jitted shard_map of mm_reduce_scatter: global x (m, p*k), w (p*k, n) -> (m, n)."""

    def body(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        return mm_reduce_scatter(x, w, AXIS, bias=b if with_bias else None,
                                 bidirectional=bidirectional, chunks=chunks)

    return jax.jit(jax.shard_map(body, mesh=mesh(p), in_specs=(P(None, AXIS), P(AXIS, None), P()),
                                 out_specs=P(AXIS, None)))


@functools.cache
def ag_fn(p: int, bidirectional: bool, chunks: int | None) -> Callable:
    """Jitted shard_map of all_gather_matmul: global x (p*ml, k), w (k, p*n) -> (p*ml, p*n)."""

    def body(x: jax.Array, w: jax.Array) -> jax.Array:
        return all_gather_matmul(x, w, AXIS, bidirectional=bidirectional, chunks=chunks)

    return jax.jit(jax.shard_map(body, mesh=mesh(p), in_specs=(P(AXIS, None), P(None, AXIS)),
                                 out_specs=P(None, AXIS)))


def randn(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def count_ops(text: str) -> dict[str, int]:
    names = ("collective_permute", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")
    return {n: len(re.findall(rf"stablehlo\.{n}\b", text)) for n in names}


@st.composite
def ring_case(draw: Any, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Any]:
    p = draw(st.sampled_from(sizes))
    return {
        "p": p,
        "rows": draw(st.integers(1, 4)),          # rows per block
        "k": draw(st.integers(1, 5)),             # local contraction size
        "n": draw(st.integers(1, 6)),
        "bidirectional": draw(st.booleans()),
        "chunks": draw(st.sampled_from([None] + divisors(p))),
        "seed": draw(st.integers(0, 2**16)),
    }


# --------------------------------------------------------------------------- mm_reduce_scatter

@FAST
@given(case=ring_case(), with_bias=st.booleans())
def test_mm_reduce_scatter_matches_numpy_fp32(case: dict[str, Any], with_bias: bool) -> None:
    p, rows, k, n = case["p"], case["rows"], case["k"], case["n"]
    rng = np.random.default_rng(case["seed"])
    x = randn(rng, (rows * p, k * p), np.float32)
    w = randn(rng, (k * p, n), np.float32)
    b = randn(rng, (n,), np.float32)
    out = rs_fn(p, case["bidirectional"], case["chunks"], with_bias)(x, w, b)
    want = x.astype(np.float64) @ w + (b if with_bias else 0)
    assert out.shape == (rows * p, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("p", [3, 6])
def test_rings_on_odd_and_uneven_axis_sizes(p: int) -> None:
    """Both kernels, one way and both ways, every chunks value, on axes that are not powers
    of two (the two directions of a bidirectional ring then differ in length)."""
    rng = np.random.default_rng(p)
    x, w, b = randn(rng, (2 * p, 3 * p), np.float32), randn(rng, (3 * p, 4), np.float32), \
        randn(rng, (4,), np.float32)
    xg, wg = randn(rng, (2 * p, 3), np.float32), randn(rng, (3, 2 * p), np.float32)
    for bidirectional in (False, True):
        for chunks in divisors(p):
            out = rs_fn(p, bidirectional, chunks, True)(x, w, b)
            np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w + b,
                                       rtol=1e-5, atol=1e-5)
            out = ag_fn(p, bidirectional, chunks)(xg, wg)
            np.testing.assert_allclose(np.asarray(out), xg.astype(np.float64) @ wg,
                                       rtol=1e-5, atol=1e-5)
    text = rs_fn(p, True, None, True).lower(x, w, b).as_text()
    assert permute_shifts(text, p) == ring_shifts(p, True)

@FEW
@given(case=ring_case((2, 4, 8)), dtype=st.sampled_from([jnp.bfloat16, jnp.float16]))
def test_mm_reduce_scatter_low_precision(case: dict[str, Any], dtype: Any) -> None:
    p, rows, k, n = case["p"], case["rows"], case["k"] + 3, case["n"]
    rng = np.random.default_rng(case["seed"])
    x = randn(rng, (rows * p, k * p), dtype)
    w = randn(rng, (k * p, n), dtype)
    b = randn(rng, (n,), dtype)
    out = rs_fn(p, case["bidirectional"], case["chunks"], True)(x, w, b)
    assert out.dtype == dtype
    want = x.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
    # fp32 accumulation, one rounding to the 16-bit output: relative error ~ 2**-8.
    scale = np.sqrt(k * p) + 1
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2, atol=1e-2 * scale)


def test_mm_reduce_scatter_equals_psum_scatter() -> None:
    p = 8
    rng = np.random.default_rng(0)
    x, w = randn(rng, (32, 24), np.float32), randn(rng, (24, 5), np.float32)

    def both(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        ref = lax.psum_scatter(x @ w, AXIS, scatter_dimension=0, tiled=True)
        return mm_reduce_scatter(x, w, AXIS), ref

    f = jax.jit(jax.shard_map(both, mesh=mesh(p), in_specs=(P(None, AXIS), P(AXIS, None)),
                              out_specs=(P(AXIS, None), P(AXIS, None))))
    got, ref = f(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_mm_reduce_scatter_lowers_to_collective_permutes_only(p: int, bidirectional: bool) -> None:
    x = jax.ShapeDtypeStruct((4 * p, 3 * p), jnp.float32)
    w = jax.ShapeDtypeStruct((3 * p, 6), jnp.float32)
    b = jax.ShapeDtypeStruct((6,), jnp.float32)
    text = rs_fn(p, bidirectional, None, True).lower(x, w, b).as_text()
    # p - 1 transfers per device either way; both ways they run in two chains, one per
    # direction, of ceil((p - 1) / 2) and floor((p - 1) / 2) hops.
    assert count_ops(text) == {"collective_permute": p - 1, "all_reduce": 0,
                               "reduce_scatter": 0, "all_gather": 0, "all_to_all": 0}
    assert permute_shifts(text, p) == ring_shifts(p, bidirectional)


def test_mm_reduce_scatter_chunks_change_matmuls_not_communication() -> None:
    p = 8
    x = jax.ShapeDtypeStruct((2 * p, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    b = jax.ShapeDtypeStruct((4,), jnp.float32)
    for chunks in divisors(p):
        text = rs_fn(p, False, chunks, False).lower(x, w, b).as_text()
        assert count_ops(text)["collective_permute"] == p - 1
        assert len(re.findall(r"stablehlo\.dot_general\b", text)) == chunks


def test_mm_reduce_scatter_axis_size_one_has_no_communication() -> None:
    x = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    b = jax.ShapeDtypeStruct((2,), jnp.float32)
    ops = count_ops(rs_fn(1, True, None, True).lower(x, w, b).as_text())
    assert sum(ops.values()) == 0


def _trace(kernel: Callable, x: Any, w: Any, p: int = 4, **kw: Any) -> Any:
    """Trace `kernel(x, w, AXIS, **kw)` inside shard_map with replicated operands."""
    f = jax.shard_map(lambda a, b: kernel(a, b, AXIS, **kw), mesh=mesh(p), in_specs=(P(), P()),
                      out_specs=P(AXIS), check_vma=False)
    return jax.eval_shape(f, x, w)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("x, w, kw, exc, key", [
    (S((8,), jnp.float32), S((8, 2), jnp.float32), {}, AutoParallelError, "x.shape"),
    (S((8, 3), jnp.float32), S((4, 2), jnp.float32), {}, AutoParallelError, "w.shape"),
    (S((6, 3), jnp.float32), S((3, 2), jnp.float32), {}, AutoParallelError, "x.shape"),
    (S((8, 3), jnp.float32), S((3, 2), jnp.bfloat16), {}, AutoParallelTypeError, "w"),
    (S((8, 3), jnp.int32), S((3, 2), jnp.int32), {}, AutoParallelTypeError, "x"),
    (S((8, 3), jnp.float32), S((3, 2), jnp.float32), {"bias": S((3,), jnp.float32)},
     AutoParallelError, "bias.shape"),
    (S((8, 3), jnp.float32), S((3, 2), jnp.float32), {"chunks": 3}, AutoParallelError, "chunks"),
    (S((8, 3), jnp.float32), S((3, 2), jnp.float32), {"chunks": 2.0}, AutoParallelTypeError,
     "chunks"),
    (S((8, 3), jnp.float32), S((3, 2), jnp.float32), {"bidirectional": "no"},
     AutoParallelTypeError, "bidirectional"),  # (any truthy value was read as True)
])
def test_mm_reduce_scatter_rejects_bad_operands(x: Any, w: Any, kw: dict, exc: type,
                                                key: str) -> None:
    with pytest.raises(exc, match=re.escape(key)):
        if "bias" in kw:
            bias = kw.pop("bias")
            f = jax.shard_map(lambda a, b, c: mm_reduce_scatter(a, b, AXIS, bias=c),
                              mesh=mesh(4), in_specs=(P(), P(), P()), out_specs=P(AXIS),
                              check_vma=False)
            jax.eval_shape(f, x, w, bias)
        else:
            _trace(mm_reduce_scatter, x, w, **kw)


def test_kernels_outside_shard_map_name_the_axis() -> None:
    x = jnp.ones((4, 2))
    with pytest.raises(AutoParallelError, match="axis_name"):
        mm_reduce_scatter(x, jnp.ones((2, 3)), "nope")
    with pytest.raises(AutoParallelError, match="axis_name"):
        all_gather_matmul(x, jnp.ones((2, 3)), "nope")


# --------------------------------------------------------------------------- all_gather_matmul

@FAST
@given(case=ring_case())
def test_all_gather_matmul_matches_numpy_fp32(case: dict[str, Any]) -> None:
    p, rows, k, n = case["p"], case["rows"], case["k"], case["n"]
    rng = np.random.default_rng(case["seed"])
    x = randn(rng, (rows * p, k), np.float32)
    w = randn(rng, (k, n * p), np.float32)
    out = ag_fn(p, case["bidirectional"], case["chunks"])(x, w)
    assert out.shape == (rows * p, n * p)
    np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


@FEW
@given(case=ring_case((2, 4, 8)), dtype=st.sampled_from([jnp.bfloat16, jnp.float16]))
def test_all_gather_matmul_low_precision(case: dict[str, Any], dtype: Any) -> None:
    p, rows, k, n = case["p"], case["rows"], case["k"] + 3, case["n"]
    rng = np.random.default_rng(case["seed"])
    x = randn(rng, (rows * p, k), dtype)
    w = randn(rng, (k, n * p), dtype)
    out = ag_fn(p, case["bidirectional"], case["chunks"])(x, w)
    assert out.dtype == dtype
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2,
                               atol=1e-2 * (np.sqrt(k) + 1))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_all_gather_matmul_lowers_to_collective_permutes_only(p: int, bidirectional: bool) -> None:
    x = jax.ShapeDtypeStruct((2 * p, 6), jnp.float32)
    w = jax.ShapeDtypeStruct((6, 3 * p), jnp.float32)
    text = ag_fn(p, bidirectional, None).lower(x, w).as_text()
    assert count_ops(text) == {"collective_permute": p - 1, "all_reduce": 0,
                               "reduce_scatter": 0, "all_gather": 0, "all_to_all": 0}
    one_way = {-1 if p > 2 else +1: p - 1}                         # blocks travel left
    assert permute_shifts(text, p) == (ring_shifts(p, True) if bidirectional else one_way)


def test_all_gather_matmul_rejects_bad_operands() -> None:
    with pytest.raises(AutoParallelError, match=re.escape("w.shape")):
        _trace(all_gather_matmul, S((2, 3), jnp.float32), S((4, 5), jnp.float32))
    with pytest.raises(AutoParallelTypeError, match="w"):
        _trace(all_gather_matmul, S((2, 3), jnp.float32), S((3, 5), jnp.float16))
    with pytest.raises(AutoParallelError, match="chunks"):
        _trace(all_gather_matmul, S((2, 3), jnp.float32), S((3, 5), jnp.float32), chunks=0)
    with pytest.raises(AutoParallelTypeError, match="bidirectional"):
        _trace(all_gather_matmul, S((2, 3), jnp.float32), S((3, 5), jnp.float32),
               bidirectional=None)
    # empty row blocks gather to nothing, for every chunks (the pipelined ring divided by 0)
    for chunks in (None, 1, 2):
        out = _trace(all_gather_matmul, S((0, 3), jnp.float32), S((3, 5), jnp.float32),
                     chunks=chunks)
        assert out.shape == (0, 5)


# --------------------------------------------------------------------------- npu wrapper

@functools.cache
def npu_fn(p: int, world_size: int) -> Callable:
    body = functools.partial(npu_mm_reduce_scatter_base, hcom=AXIS, world_size=world_size)
    return jax.jit(jax.shard_map(lambda a, b: body(a, b), mesh=mesh(p),
                                 in_specs=(P(None, AXIS), P(AXIS, None)), out_specs=P(AXIS, None)))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_npu_mm_reduce_scatter_base_seed_shapes(world_size: int) -> None:
    # The seed's example: x1 (128, 512), x2 (512, 64), float16, on every rank.
    rng = np.random.default_rng(world_size)
    a = randn(rng, (128, 512 * world_size), jnp.float16)
    b = randn(rng, (512 * world_size, 64), jnp.float16)
    out = npu_fn(world_size, world_size)(a, b)
    assert out.shape == (128, 64) and out.dtype == jnp.float16
    assert out.sharding.shard_shape(out.shape) == (128 // world_size, 64)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2,
                               atol=1e-2 * np.sqrt(512 * world_size))


def _npu(input: Any = None, x2: Any = None, hcom: Any = AXIS, world_size: Any = 8,
         axis: int = 8, **kw: Any) -> Any:
    input = S((16, 256), jnp.float16) if input is None else input
    x2 = S((256, 32), jnp.float16) if x2 is None else x2
    f = jax.shard_map(lambda a, b: npu_mm_reduce_scatter_base(a, b, hcom, world_size, **kw),
                      mesh=mesh(axis), in_specs=(P(), P()), out_specs=P(AXIS),
                      check_vma=False)
    return jax.eval_shape(f, input, x2)


def test_npu_valid_call_traces() -> None:
    assert _npu().shape == (2 * 8, 32)      # (16 / 8 = 2 rows per rank) x 8 ranks


@pytest.mark.parametrize("kw, exc, key, rule", [
    ({"input": S((16, 256, 1), jnp.float16)}, AutoParallelError, "input.shape", "2-D"),
    ({"x2": S((256,), jnp.float16)}, AutoParallelError, "x2.shape", "2-D"),
    ({"input": S((16, 256), jnp.float32), "x2": S((256, 32), jnp.float32)},
     AutoParallelTypeError, "input.dtype", "float16 or bfloat16"),
    ({"x2": S((256, 32), jnp.bfloat16)}, AutoParallelTypeError, "x2.dtype", "must equal"),
    ({"x2": S((128, 32), jnp.float16)}, AutoParallelError, "x2.shape", "first dim"),
    ({"x2": S((32, 256), jnp.float16)}, AutoParallelError, "x2.shape", "x2.T"),
    ({"input": S((16, 128), jnp.float16), "x2": S((128, 32), jnp.float16)},
     AutoParallelError, "input.shape", "[256, 65535)"),
    ({"input": S((16, 65535), jnp.float16), "x2": S((65535, 2), jnp.float16)},
     AutoParallelError, "input.shape", "[256, 65535)"),
    ({"input": S((12, 256), jnp.float16)}, AutoParallelError, "input.shape", "divisible"),
    ({"world_size": 3}, AutoParallelError, "world_size", "[2, 4, 8]"),
    ({"world_size": 16, "axis": 8}, AutoParallelError, "world_size", "[2, 4, 8]"),
    ({"world_size": True}, AutoParallelTypeError, "world_size", "int"),
    ({"world_size": "8"}, AutoParallelTypeError, "world_size", "int"),
    ({"world_size": 4, "axis": 8}, AutoParallelError, "world_size", "must equal the size"),
    ({"hcom": 0}, AutoParallelTypeError, "hcom", "str"),
    ({"hcom": "hccl_world_group"}, AutoParallelError, "hcom", "mesh axis"),
    ({"reduce_op": "max"}, AutoParallelError, "reduce_op", "'sum'"),
    ({"reduce_op": None}, AutoParallelTypeError, "reduce_op", "str"),
    ({"bias": S((32,), jnp.float16)}, AutoParallelError, "bias", "None"),
    ({"comm_turn": 1}, AutoParallelError, "comm_turn", "only 0"),
    ({"comm_turn": 0.0}, AutoParallelTypeError, "comm_turn", "int"),
    ({"input": [[1.0]]}, AutoParallelTypeError, "input", "tensor"),
])
def test_npu_constraint_errors_name_argument_and_rule(kw: dict, exc: type, key: str,
                                                      rule: str) -> None:
    if "bias" in kw:
        bias = kw.pop("bias")
        f = jax.shard_map(lambda a, b, c: npu_mm_reduce_scatter_base(a, b, AXIS, 8, bias=c),
                          mesh=mesh(8), in_specs=(P(), P(), P()), out_specs=P(AXIS),
                          check_vma=False)
        call = lambda: jax.eval_shape(f, S((16, 256), jnp.float16), S((256, 32), jnp.float16),
                                      bias)
    else:
        call = lambda: _npu(**kw)
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(key + "="), message
    assert rule in message, message
    assert isinstance(info.value, ValueError if exc is AutoParallelError else TypeError)
