"""Hostile input beyond the reliability benchmark's first families: a set of files written
all or nothing, the writer's umask and owner, calibration and batches of no rows on many
devices, values no repr can print, NumPy arrays where keys are compared, paths that are no
paths, a user's scope that starts like an annotation, IntEnum split counts, shapes passed
as values, and a CLI argument holding a line break. Each test fails without its fix."""

from __future__ import annotations

import enum
import errno
import os
import stat
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar as ap
from autopar import files
from autopar.errors import AutoparError, safe_repr, same_value
from autopar.models import mlp
from test_pipeline import tiny_loss  # (mean((tanh(x @ w1) @ w2 - y) ** 2), one scope per layer)

KEY = jax.random.key(0)
CLUSTER = "accelerator-8x"
HUGE = 10 ** 5000
PIPE = dict(device_num=8, parallel_mode="semi_auto_parallel", gradients_mean=True)


def _deep(n: int) -> list:
    v: list = []
    for _ in range(n):
        v = [v]
    return v


def _litter(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def _fail_on_call(monkeypatch, module, name: str, k: int) -> list[int]:
    """``module.name`` raising ENOSPC on its ``k``-th call (1-based); the calls counted."""
    real, calls = getattr(module, name), [0]

    def fake(*args, **kw):
        calls[0] += 1
        if calls[0] == k:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(module, name, fake)
    return calls


# ---------------------------------------------------------------------------- (4) file sets


def test_a_set_of_files_is_written_all_or_nothing(tmp_path, monkeypatch):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text("old a")
    b.write_text("old b")
    _fail_on_call(monkeypatch, files.os, "fsync", 2)  # the second temporary: a full disk
    with pytest.raises(ap.AutoParallelError, match="b.json.*No space left.*no file of the set"):
        files.write_files_atomic([(a, "new a", "k"), (b, "new b", "k"), (c, "new c", "k")])
    assert (a.read_text(), b.read_text(), c.exists()) == ("old a", "old b", False)
    assert _litter(tmp_path) == []
    monkeypatch.undo()
    _fail_on_call(monkeypatch, files.os, "replace", 3)  # b's: a put back, new c removed
    with pytest.raises(ap.AutoParallelError, match="b.json"):
        files.write_files_atomic([(a, "new a", "k"), (c, "new c", "k"), (b, "new b", "k")])
    assert (a.read_text(), b.read_text(), c.exists()) == ("old a", "old b", False)
    assert _litter(tmp_path) == []
    monkeypatch.undo()
    files.write_files_atomic([(a, "new a", "k"), (b, b"new b", "k")])
    assert (a.read_text(), b.read_text(), _litter(tmp_path)) == ("new a", "new b", [])
    with pytest.raises(ap.AutoParallelError, match="named twice"):
        files.write_files_atomic([(a, "x", "k"), (tmp_path / "." / "a.json", "y", "k")])


def test_a_pipelined_step_whose_second_stage_file_fails_changes_no_file(tmp_path,
                                                                         monkeypatch):
    """Stage files were saved one by one: with the second on a full disk, the first was
    already replaced (docs/strategy_files.md promises a failed call leaves files as they
    were)."""
    k = jax.random.split(KEY, 4)
    params = {"w1": jax.random.normal(k[0], (8, 16)), "w2": jax.random.normal(k[1], (16, 8))}
    x, y = jax.random.normal(k[2], (16, 8)), jax.random.normal(k[3], (16, 8))
    for s in range(2):
        (tmp_path / f"s_stage{s}.json").write_text(f"OLD {s}")
    _fail_on_call(monkeypatch, files.os, "fsync", 2)
    with ap.auto_parallel_context(pipeline_stages=2, strategy_ckpt_save_file=str(
            tmp_path / "s.json"), **PIPE):
        with pytest.raises(ap.AutoParallelError, match="s_stage1.json.*No space left"):
            ap.pipeline.pipeline_train_step(tiny_loss, params, (x, y))
    assert [(tmp_path / f"s_stage{s}.json").read_text() for s in range(2)] == ["OLD 0",
                                                                               "OLD 1"]
    assert _litter(tmp_path) == []


def test_compare_out_is_all_or_nothing_and_leaves_no_new_directory(tmp_path, monkeypatch):
    from autopar.compare import write_comparison

    m = mlp(widths=(16, 32, 16), batch=8)
    graph = ap.trace(m.loss, *m.example_args(KEY))
    rows = ap.compare_modes(graph, device_num=8, cluster=CLUSTER, modes=["dynamic_programming"])
    out = tmp_path / "new" / "deeper"
    _fail_on_call(monkeypatch, files.os, "fsync", 1)
    with pytest.raises(ap.AutoParallelError, match="compare.json.*No space left"):
        write_comparison(rows, out, title="t", meta={})
    assert list(tmp_path.iterdir()) == []  # the directories made for it are gone again
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "compare.json").write_text("OLD")
    monkeypatch.undo()
    _fail_on_call(monkeypatch, files.os, "fsync", 2)
    with pytest.raises(ap.AutoParallelError, match="compare.md"):
        write_comparison(rows, tmp_path / "old", title="t", meta={})
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["compare.json"]
    assert (tmp_path / "old" / "compare.json").read_text() == "OLD"


# ---------------------------------------------------------------------------- (5) (9) writer


def _umask() -> int:
    with open("/proc/self/status") as fh:
        return int(next(x for x in fh if x.startswith("Umask:")).split()[1], 8)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="no /proc here")
def test_the_writer_never_sets_the_process_umask(tmp_path, monkeypatch):
    """The writer read the umask with os.umask(0); os.umask(old): for a moment every thread
    of the process created files 0666 (2 in 12,000 saves from threads; nearly all when
    the window was widened). The kernel applies it now."""
    mask = _umask()

    def no_umask(*_):
        raise AssertionError("os.umask called: it changes the mask of every thread")

    monkeypatch.setattr(os, "umask", no_umask)
    errors: list[BaseException] = []

    def save(k: int) -> None:
        try:
            for i in range(20):
                files.write_text_atomic(tmp_path / f"t{k}-{i}.json", "{}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    modes = {stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("t*.json")}
    assert modes == {0o666 & ~mask} and _umask() == mask


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can save over another user's file")
def test_root_saving_over_another_users_file_keeps_its_owner(tmp_path):
    p = tmp_path / "theirs.json"
    p.write_text("old")
    os.chown(p, 65534, 65534)
    p.chmod(0o640)
    files.write_text_atomic(p, "new")
    st = p.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), p.read_text()) == (
        65534, 65534, 0o640, "new")


# ---------------------------------------------------------------------------- (6) sizes


def test_calibration_messages_hold_at_least_one_element_per_device():
    """4 KiB gathered from 64 devices was 16 elements per device, rounded down to a
    multiple of 64: zero ('all_gather_dim cannot be zero', calibrate --devices 64)."""
    from autopar.calibration import MESSAGE_SIZES, group_sizes, message_elements
    from autopar.strategies.cost import COLLECTIVE_KINDS

    for n in (64, 4096, 12, 97):
        for p in group_sizes(n):
            for kind in COLLECTIVE_KINDS:
                for size in MESSAGE_SIZES:
                    elems = message_elements(kind, size, p)
                    assert elems >= p and elems % p == 0, (kind, size, p)
    assert message_elements("all_gather", 4096, 64) == 64


def test_a_batch_of_no_rows_runs_under_every_plan():
    """A batch of zero rows broke lowering for plans that gather it (XLA refuses an empty
    gather dim); it runs now, as one device gives it."""
    loss = lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"]  # noqa: E731
    params = {"w1": np.ones((16, 32), np.float32), "w2": np.ones((32, 16), np.float32)}
    x = np.ones((0, 16), np.float32)
    for mode in ("dynamic_programming", "recursive_programming"):
        with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
            f = ap.parallelize(loss, params, x, mode=mode, cluster=CLUSTER)
            assert f.parallel_graph.comm_counts(), "the plan moves the batch"
            assert np.asarray(f(params, x)).shape == (0, 16)
            g = ap.parallelize(jax.grad(lambda p, x: loss(p, x).sum()), params, x,
                               mode=mode, cluster=CLUSTER)
            assert all(float(np.abs(np.asarray(v)).max()) == 0 for v in
                       jax.tree.leaves(g(params, x)))


# ---------------------------------------------------------------------------- (7) reprs


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr fails")


def test_safe_repr_bounds_what_repr_cannot_print():
    assert safe_repr(HUGE) == "<an int of about 5001 digits>"
    assert safe_repr(-HUGE) == "<a negative int of about 5001 digits>"
    assert safe_repr(_deep(100_000)) == "[[[[[[[...]]]]]]]"
    assert safe_repr(_BadRepr()).startswith("<")
    assert len(safe_repr(list(range(10 ** 5)))) < 260
    assert safe_repr("a\nb") == "'a\\nb'"


@pytest.mark.parametrize("value", [HUGE, (HUGE,), _deep(1000), _deep(100_000), _BadRepr()],
                         ids=["int", "(int,)", "nest 1000", "nest 100000", "bad repr"])
def test_errors_built_from_values_no_repr_prints_are_typed(value):
    """ValueError (an int past 4,300 digits) or RecursionError (1,000 deep) from about 20
    error messages: the context, algo parameters, HCCL, Layout, the simulators, fixed=."""
    m = mlp(widths=(16, 32, 16), batch=8)
    params, x = m.example_args(KEY)
    graph = ap.trace(m.loss, params, x)
    node = graph.nodes[0].name
    calls = [
        lambda: ap.set_auto_parallel_context(device_num=value),
        lambda: ap.set_auto_parallel_context(search_mode="dynamic_programming",
                                             auto_parallel_search_mode=value),
        lambda: ap.set_auto_parallel_context(parallel_optimizer_config={"x": value}),
        lambda: ap.set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index",
                                                                        "config": [value]}}),
        lambda: ap.get_auto_parallel_context(value),
        lambda: ap.set_algo_parameters(fully_use_devices=value),
        lambda: ap.hccl.create_group("g", [0, value]),
        lambda: ap.Layout((2, 4), ("dp", "mp"))(value, "mp"),
        lambda: ap.Layout((2, 4), ("dp", value)),
        lambda: ap.search(graph, fixed={node: ((value, 1), (1, 8))}, cluster=CLUSTER),
        lambda: ap.simulation.simulate_schedule([1.0, 1.0], [1.0, 1.0], micro_batches=value),
        lambda: ap.simulation.simulate_pipeline(graph, 2, micro_batches=value,
                                                cluster=CLUSTER),
        lambda: ap.trace(m.loss, params, x, param_argnums=[value]),
    ]
    for call in calls:
        with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
            with pytest.raises(AutoparError) as info:
                call()
        str(info.value).encode("utf-8")
        assert len(str(info.value)) < 2000


# ---------------------------------------------------------------------------- (8) smaller


def test_an_unhashable_optimizer_level_beside_gradient_accumulation_shard_is_typed():
    for level in ([], {}, np.array([1, 2])):
        with pytest.raises(AutoparError, match="optimizer_level"):
            ap.set_auto_parallel_context(parallel_optimizer_config={
                "optimizer_level": level, "gradient_accumulation_shard": True})
    ap.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level2"})
    with pytest.raises(ap.AutoParallelError, match="gradient_accumulation_shard"):
        ap.set_auto_parallel_context(parallel_optimizer_config={
            "gradient_accumulation_shard": False})


@pytest.mark.parametrize("keys,name", [
    ({"search_mode": "dynamic_programming", "auto_parallel_search_mode": "ARRAY"},
     "auto_parallel_search_mode"),
    ({"search_mode": "ARRAY", "sharding_propagation": True}, "sharding_propagation"),
    ({"all_reduce_fusion_config": [1, 2], "comm_fusion": {"allreduce": {
        "mode": "ARRAY", "config": [1, 2]}}}, "all_reduce_fusion_config"),
    ({"strategy_ckpt_load_file": "a.json", "strategy_ckpt_config": {"load_file": "ARRAY"}},
     "strategy_ckpt_load_file"),
    ({"strategy_ckpt_save_file": "a.json", "strategy_ckpt_config": {"save_file": "ARRAY"}},
     "strategy_ckpt_save_file")])
def test_a_numpy_array_where_two_keys_are_compared_is_typed(keys, name):
    """``a != b`` of an array is an array, whose truth raised ValueError."""
    arr = np.array(["x", "y"])
    kw = {k: ({kk: ({m: arr if w == "ARRAY" else w for m, w in vv.items()}
                    if isinstance(vv, dict) else arr if vv == "ARRAY" else vv)
                   for kk, vv in v.items()} if isinstance(v, dict) else
              arr if isinstance(v, str) and v == "ARRAY" else v) for k, v in keys.items()}
    with pytest.raises(AutoparError, match=name):
        ap.set_auto_parallel_context(**kw)
    assert same_value(arr, "x") is False
    with pytest.raises(ap.AutoParallelError, match="alias"):
        ap.Layout((2, 4), ("dp", "mp"))(arr, "mp")


class _NoPath:
    def __fspath__(self):
        return 3


def test_a_pathlike_whose_fspath_returns_no_str_is_typed(tmp_path):
    m = mlp(widths=(16, 32, 16), batch=8)
    graph = ap.trace(m.loss, *m.example_args(KEY))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        plan = ap.search(graph, cluster=CLUSTER)
    calls = {"strategy_ckpt_save_file": lambda: ap.save_strategy(plan, graph, _NoPath()),
             "path": lambda: ap.load_strategy(_NoPath(), graph),
             "strategy_ckpt_load_file": lambda: ap.set_auto_parallel_context(
                 strategy_ckpt_load_file=_NoPath()),
             "cluster": lambda: ap.clusters.resolve_cluster(_NoPath()),
             "path ": lambda: ap.import_mindspore_strategy(_NoPath(), graph),
             "path  ": lambda: files.write_text_atomic(_NoPath(), "{}")}
    for key, call in calls.items():
        with pytest.raises(AutoparError) as info:
            call()
        assert key.strip() in str(info.value) or "NoPath" in str(info.value), info.value


def test_a_users_scope_that_starts_like_an_annotation_is_a_plain_scope():
    """'ap.shard#foo' raised ValueError, 'ap.plan#5' KeyError, and 'ap.shard#0[((2, 1), (1,
    4))]' was applied as a strategy: autopar's scopes carry a token of the process."""
    x = np.ones((8, 8), np.float32)
    for name in ("ap.shard#foo", "ap.shard#3[x]", "ap.shard#0[((2, 1), (1, 4))]", "ap.plan#5",
                 "ap.plan#x"):
        def f(a, b, name=name):
            with jax.named_scope(name):
                return a @ b
        (node,) = ap.trace(f, x, x).nodes
        assert node.annotation is None and node.name.startswith(name)
    (node,) = ap.trace(lambda a, b: ap.matmul(a, b, ((2, 1), (1, 4))), x, x).nodes
    assert node.annotation == ((2, 1), (1, 4)) and node.name == "dot_general_0"


def test_intenum_split_counts_are_counts():
    """An IntEnum count is an int: it made the scope's text unparsable (SyntaxError)."""
    class Two(enum.IntEnum):
        TWO = 2

    (node,) = ap.trace(ap.shard(jnp.tanh, ((Two.TWO, 1),)), np.ones((8, 8), np.float32)).nodes
    assert node.annotation == ((2, 1),) and type(node.annotation[0][0]) is int
    with pytest.raises(ap.AutoParallelError, match=r"at most 4096"):
        ap.shard(jnp.tanh, ((HUGE, 1),))


def test_shapes_given_where_values_are_needed_are_typed():
    """A function built from ShapeDtypeStructs took them at call time: JAX's raw error."""
    loss = lambda p, x: (jnp.tanh(x @ p["w"])).sum()  # noqa: E731
    p = {"w": jax.ShapeDtypeStruct((16, 32), jnp.float32)}
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
                                  gradients_mean=True):
        f = ap.parallelize(loss, p, x, cluster=CLUSTER)
        step = ap.train_step(loss, p, (x,), cluster=CLUSTER)
    real = {"w": np.ones((16, 32), np.float32)}
    with pytest.raises(ap.AutoParallelTypeError, match="argument 'x'.*concrete array"):
        f(real, x)
    for call in (lambda: step(p, step.init(p), x), lambda: step.prepare(p)):
        with pytest.raises(ap.AutoParallelTypeError, match="concrete array"):
            call()
    assert float(f(real, np.ones((8, 16), np.float32))) > 0


# ---------------------------------------------------------------------------- (9b) the CLI


def test_a_cli_argument_holding_a_line_break_stays_on_the_one_error_line(capsys, tmp_path):
    from autopar.cli import main

    for argv, shown in ((["tune", "--model", "mlp", "a=b\nc"], "a=b\\nc"),
                        (["search", "--model", "mlp", "--devices", "8", "--load",
                          str(tmp_path / "x\ny.json")], "x\\ny.json"),
                        (["show", str(tmp_path / "a\u2028b.json")], "a\\u2028b.json")):
        try:
            status = main(argv)
        except SystemExit as e:  # (argparse's own errors)
            status = e.code
        assert status == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and err[0].startswith(f"autopar {argv[0]}: error: "), err
        assert shown in err[0], err
