"""AllGatherV: the seed's worked example, random layouts vs NumPy, collectives, errors."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.kernels import AllGatherVLayout, all_gather_v, allgatherv

# The seed (AllGatherV, 2 ranks): rank 0 sends its first 4 elements, rank 1 its first 2.
SEED_INPUTS = ([[0, 1, 2, 3], [4, 5, 6, 7]], [[3, 2, 1, 0], [7, 6, 5, 4], [7, 6, 5, 4]])
SEED_OUTPUT = [[0, 1, 2, 3], [3, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def reference(inputs: list[np.ndarray], counts: list[int], displs: list[int],
              shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(int(np.prod(shape)), inputs[0].dtype)
    for a, c, d in zip(inputs, counts, displs):
        out[d:d + c] = np.asarray(a).reshape(-1)[:c]
    return out.reshape(shape)


@pytest.mark.parametrize("dtype", [np.float16, np.int8, jnp.bfloat16])
@pytest.mark.parametrize("method", ["auto", "padded", "balanced"])
def test_seed_worked_example(dtype: Any, method: str) -> None:
    inputs = [np.asarray(a, dtype) for a in SEED_INPUTS]
    # y = tensor([0, 1, 2, 3, 4]): shape [5] = the sum of the ranks' first dims (2 + 3).
    outs = allgatherv(inputs, [4, 2], [4, 2], [0, 4], (5,), method=method)
    assert len(outs) == 2
    for rank, out in enumerate(outs):
        assert out.shape == (5, 4) and out.dtype == dtype
        assert out.devices() == {jax.devices()[rank]}
        np.testing.assert_array_equal(np.asarray(out, np.float32), SEED_OUTPUT)


def test_seed_example_with_full_y_shape() -> None:
    inputs = [np.asarray(a, np.float16) for a in SEED_INPUTS]
    outs = allgatherv(inputs, [4, 2], [4, 2], [0, 4], (5, 4))
    np.testing.assert_array_equal(np.asarray(outs[0]), SEED_OUTPUT)


@st.composite
def layouts(draw: Any, sizes: tuple[int, ...] = (1, 2, 3, 4, 8)) -> dict[str, Any]:
    """Ranks of different sizes, counts up to each rank's data, displacements in any order
    with gaps, and an output that may be longer than the data."""
    p = draw(st.sampled_from(sizes))
    trail = draw(st.integers(1, 3))
    rows = [draw(st.integers(0, 5)) for _ in range(p)]
    counts = [draw(st.integers(0, r * trail)) for r in rows]
    order = draw(st.permutations(range(p)))
    displs, at = [0] * p, 0
    for r in order:
        at += draw(st.integers(0, 3))
        displs[r] = at
        at += counts[r]
    out_rows = -(-at // trail) + draw(st.integers(0, 2))
    return {"p": p, "rows": rows, "trail": trail, "counts": counts, "displs": displs,
            "shape": (max(out_rows, 1), trail), "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=15, deadline=None, derandomize=True)
@given(case=layouts(), method=st.sampled_from(["padded", "balanced"]))
def test_allgatherv_matches_numpy(case: dict[str, Any], method: str) -> None:
    rng = np.random.default_rng(case["seed"])
    inputs = [rng.standard_normal((r, case["trail"])).astype(np.float32) for r in case["rows"]]
    outs = allgatherv(inputs, case["counts"], case["counts"], case["displs"], case["shape"],
                      method=method)
    want = reference(inputs, case["counts"], case["displs"], case["shape"])
    assert len(outs) == case["p"]
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out), want)


@functools.cache
def device_fn(p: int, counts: tuple[int, ...], displs: tuple[int, ...],
              shape: tuple[int, ...], method: str, traced_count: bool) -> Callable:
    mesh = jax.make_mesh((p,), ("r",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:p])

    def body(x: jax.Array, count: jax.Array) -> jax.Array:
        send = count[0] if traced_count else None
        return all_gather_v(x[0], send, counts, displs, shape, "r", method=method)[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("r"), P("r")), out_specs=P("r")))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("method", ["padded", "balanced"])
@pytest.mark.parametrize("traced_count", [False, True])
def test_all_gather_v_inside_shard_map(p: int, method: str, traced_count: bool) -> None:
    # Skewed counts: rank r sends 3 * r + 1 rows of 2, packed back to back.
    counts = tuple(2 * (3 * r + 1) for r in range(p))
    displs = tuple(int(sum(counts[:r])) for r in range(p))
    shape = (sum(counts) // 2, 2)
    rng = np.random.default_rng(p)
    rows = max(counts) // 2
    data = rng.standard_normal((p, rows, 2)).astype(np.float32)
    f = device_fn(p, counts, displs, shape, method, traced_count)
    out = f(data, np.asarray(counts, np.int32))
    want = reference(list(data), list(counts), list(displs), shape)
    for r in range(p):
        np.testing.assert_array_equal(np.asarray(out[r]), want)


def test_traced_send_count_smaller_than_recv_count_sends_zeros() -> None:
    f = device_fn(2, (4, 2), (0, 4), (2, 4), "padded", True)
    data = np.arange(16, dtype=np.float32).reshape(2, 2, 4) + 1
    out = np.asarray(f(data, np.asarray([3, 2], np.int32)))
    assert (out[0] == out[1]).all()
    out = out[0]
    np.testing.assert_array_equal(out, [[1, 2, 3, 0], [9, 10, 0, 0]])


def count_ops(text: str) -> dict[str, int]:
    names = ("collective_permute", "all_gather", "all_reduce", "all_to_all")
    return {n: len(re.findall(rf"stablehlo\.{n}\b", text)) for n in names}


def test_collectives_of_each_method() -> None:
    p, counts, displs, shape = 4, (2, 2, 2, 26), (0, 2, 4, 6), (32,)
    x = jax.ShapeDtypeStruct((p, 26), jnp.float32)
    c = jax.ShapeDtypeStruct((p,), jnp.int32)
    padded = count_ops(device_fn(p, counts, displs, shape, "padded", False).lower(x, c).as_text())
    assert padded == {"collective_permute": 0, "all_gather": 1, "all_reduce": 0, "all_to_all": 0}
    balanced = count_ops(
        device_fn(p, counts, displs, shape, "balanced", False).lower(x, c).as_text())
    assert balanced["all_gather"] == 1 and balanced["all_reduce"] == 0
    assert 1 <= balanced["collective_permute"] <= p - 1


def test_auto_picks_balanced_for_skewed_and_padded_for_even_counts() -> None:
    big = 1 << 20
    skewed = AllGatherVLayout.build([big, 16, 16, 16], [0, big, big + 16, big + 32],
                                    (big + 48,))
    assert skewed.choose("auto") == "balanced"
    even = AllGatherVLayout.build([big] * 4, [0, big, 2 * big, 3 * big], (4 * big,))
    assert even.choose("auto") == "padded"
    # Tiny outputs stay on one all_gather: the fixed cost per collective dominates.
    tiny = AllGatherVLayout.build([5, 5, 5, 4], [0, 5, 10, 15], (19,))
    assert tiny.choose("auto") == "padded"
    # A large batch not divisible by the ranks (the NPU's motivating case): the padded
    # method would need a compaction pass over the whole output, the balanced one does not.
    rows = [256] * 7 + [252]
    counts = [r * 512 for r in rows]
    ragged = AllGatherVLayout.build(counts, np.cumsum([0] + counts[:-1]).tolist(),
                                    (sum(rows), 512))
    assert ragged.choose("auto") == "balanced"


def _seed_args(**changes: Any) -> dict[str, Any]:
    args = {"inputs": [np.asarray(a, np.float16) for a in SEED_INPUTS], "send_counts": [4, 2],
            "recv_counts": [4, 2], "rdispls": [0, 4], "y_shape": (5, 4)}
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, exc, key, rule", [
    ({"send_counts": [4, 3]}, AutoParallelError, "send_counts[1]", "must equal recv_counts[1]"),
    ({"send_counts": [4, 2, 0]}, AutoParallelError, "send_counts", "one entry per rank"),
    ({"recv_counts": [4]}, AutoParallelError, "recv_counts", "one entry per rank"),
    ({"rdispls": [0, 4, 8]}, AutoParallelError, "rdispls", "one entry per rank"),
    ({"recv_counts": [4, -2], "send_counts": [4, -2]}, AutoParallelError, "recv_counts[1]",
     ">= 0"),
    ({"recv_counts": [9, 2], "send_counts": [9, 2], "rdispls": [0, 10]}, AutoParallelError,
     "send_counts[0]", "exceeds the 8 elements of inputs[0]"),
    ({"rdispls": [0, 3]}, AutoParallelError, "rdispls", "overlaps"),
    ({"rdispls": [0, 19]}, AutoParallelError, "rdispls", "runs past"),
    ({"y_shape": (1, 4)}, AutoParallelError, "rdispls", "runs past"),
    ({"recv_counts": [4.0, 2], "send_counts": [4.0, 2]}, AutoParallelTypeError,
     "recv_counts[0]", "int"),
    ({"rdispls": "04"}, AutoParallelTypeError, "rdispls", "sequence of ints"),
    ({"y_shape": ()}, AutoParallelTypeError, "y_shape", "non-empty"),
    ({"inputs": []}, AutoParallelTypeError, "inputs", "non-empty list"),
    ({"inputs": [np.zeros((2, 4), np.float16), [[1, 2]]]}, AutoParallelTypeError, "inputs[1]",
     "array"),
    ({"inputs": [np.zeros((2, 4), np.float16), np.zeros((3, 4), np.float32)]},
     AutoParallelTypeError, "inputs[1]", "dtype"),
    ({"inputs": [np.zeros((2, 4), np.float16), np.zeros((3, 5), np.float16)]},
     AutoParallelError, "inputs[1].shape", "trailing dims"),
    ({"inputs": [np.full((2, 4), "a"), np.full((3, 4), "b")]}, AutoParallelTypeError,
     "inputs[0]", "numeric"),  # (was JAX's own TypeError)
])
def test_allgatherv_errors_name_the_argument(changes: dict, exc: type, key: str,
                                             rule: str) -> None:
    with pytest.raises(exc) as info:
        allgatherv(**_seed_args(**changes))
    message = str(info.value)
    assert message.startswith(key + "="), message
    assert rule in message, message


def test_allgatherv_rejects_more_ranks_than_devices_and_unknown_method() -> None:
    n = len(jax.devices())
    with pytest.raises(AutoParallelError, match="one device per rank"):
        allgatherv([np.zeros(1, np.float32)] * (n + 1), [1] * (n + 1), [1] * (n + 1),
                   list(range(n + 1)), (n + 1,))
    with pytest.raises(AutoParallelError, match="method"):
        allgatherv(**_seed_args(), method="ring")


def test_all_gather_v_device_errors() -> None:
    mesh = jax.make_mesh((2,), ("r",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def run(counts: Any, displs: Any, x_shape: tuple[int, ...] = (2, 4)) -> Any:
        f = jax.shard_map(lambda x: all_gather_v(x, None, counts, displs, (5, 4), "r"),
                          mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        return jax.eval_shape(f, jax.ShapeDtypeStruct(x_shape, jnp.float32))

    assert run([4, 2], [0, 4]).shape == (5, 4)
    with pytest.raises(AutoParallelError, match=re.escape("recv_counts[0]=9")):
        run([9, 2], [0, 10])                     # more than the 8 elements x holds
    with pytest.raises(AutoParallelError, match="one entry per rank"):
        run([4, 2, 1], [0, 4, 6])               # 3 counts on a 2-rank axis
    with pytest.raises(AutoParallelError, match="axis_name"):
        all_gather_v(jnp.zeros(4), None, [4], [0], (4,), "r")
