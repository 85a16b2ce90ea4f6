"""Multi-process: `autopar run` under jax.distributed with 2 processes x 4 CPU devices (gloo
collectives on loopback) gives the same losses and parameters as one process with 8 devices."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import numerics

OPTIONS = dict(layers=1, hidden=32, heads=2, seq=8, vocab=64, batch=8)
MODEL = ["--model", "transformer", *(a for k, v in OPTIONS.items() for a in ("-o", f"{k}={v}"))]
STEPS = 2
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _autopar(*args: str) -> list[str]:
    return [sys.executable, "-m", "autopar", "run", *MODEL, "--devices", "8", "--steps",
            str(STEPS), "--check", *args]


def _launch(n: int, tmp_path) -> list[subprocess.CompletedProcess]:
    """Start ``n`` processes of one job; wait for all (timeout), fail with their output."""
    port = _free_port()
    return _job([_autopar("--num-processes", str(n), "--process-id", str(i), "--coordinator",
                          f"127.0.0.1:{port}", "--json", str(tmp_path / f"p{i}.json"))
                 for i in range(n)], tmp_path)


def _job(cmds: list[list[str]], tmp_path) -> list[subprocess.CompletedProcess]:
    """Run the processes of one job to the end. Where one fails, or the time runs out, kill
    the others (they would wait for it in a collective) and fail with each one's output."""
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(len(cmds))]
    procs = []
    for cmd, (out, err) in zip(cmds, logs):
        with out.open("w") as o, err.open("w") as e:  # (the child keeps its own copies)
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e))
    deadline = time.monotonic() + TIMEOUT
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and \
            not any(p.poll() for p in procs):
        time.sleep(0.2)
    for p in procs:
        p.kill()
    done = [subprocess.CompletedProcess(p.args, p.wait(), out.read_text(), err.read_text())
            for p, (out, err) in zip(procs, logs)]
    if any(r.returncode for r in done):
        why = "failed" if time.monotonic() < deadline else f"did not finish in {TIMEOUT} s"
        pytest.fail(f"multi-process run {why}\n" + "\n".join(
            f"--- process {i} (exit {r.returncode})\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}"
            for i, r in enumerate(done)))
    return done


def _reference() -> numerics.Reference:
    """What `run --json` reports (losses, parameter sums) for the steps of the CLI's SGD on one
    device, in float64 and float32, computed here: the subprocesses cannot run float64."""
    from autopar.cli_util import load_model

    fn, ex, _ = load_model("transformer", OPTIONS)
    steps = numerics.optimizer_steps(fn, steps=STEPS)

    def report(*args):
        params, losses = steps(*args)
        return {"losses": losses,
                "param_sums": [np.sum(np.asarray(x), dtype=np.float64)
                               for x in jax.tree.leaves(params)]}

    return numerics.reference(report, *ex, jit=False)


def test_two_processes_equal_one_process(tmp_path):
    from autopar.cli import main

    assert main(_autopar("--json", str(tmp_path / "one.json"))[3:]) == 0  # in this process
    ref = json.loads((tmp_path / "one.json").read_text())
    outs = _launch(2, tmp_path)
    got = json.loads((tmp_path / "p0.json").read_text())
    assert not (tmp_path / "p1.json").exists()  # only process 0 writes results
    assert got["processes"] == 2 and ref["processes"] == 1
    assert got["mode"] == ref["mode"] and got["collectives"] == ref["collectives"]
    want = _reference()
    for run, res in (("two processes", got), ("one process", ref)):
        numerics.check({k: res[k] for k in ("losses", "param_sums")}, want, run)
    assert got["match"] is True  # the CLI's own check against one device agrees
    assert "-> OK" in outs[0].stdout  # process 0 reports; process 1 only runs
    assert "-> OK" not in outs[1].stdout and "train steps" not in outs[1].stderr
    for out in outs:  # gloo's per-communicator connection reports are filtered out of stdout
        assert "Gloo" not in out.stdout and "peer ranks" not in out.stdout, out.stdout


def _workers(source: str, tmp_path) -> list[tuple[tuple[str, str], dict]]:
    """Run ``source`` as processes 0 and 1 of one job (argv: coordinator, rank, tmp_path):
    each one's (stdout, stderr) and the JSON it printed after ``RESULT``."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    where = f"127.0.0.1:{_free_port()}"
    outs = [(r.stdout, r.stderr) for r in _job(
        [[sys.executable, str(script), where, str(i), str(tmp_path)] for i in range(2)],
        tmp_path)]
    return [(o, json.loads(o[0].split("RESULT ", 1)[1])) for o in outs]


_WORKER = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import numpy as np, autopar as ap
from jax.experimental import multihost_utils
rank = jax.process_index()
params = {"w": np.full((8, 4), 1.0 + rank, np.float32)}  # each process its own values
x = np.ones((16, 8), np.float32)
loss = lambda p, x: (x @ p["w"]).sum()
out = {}
with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                              parameter_broadcast=True, gradients_mean=True):
    step = ap.train_step(loss, params, (x,))
    held = multihost_utils.process_allgather(step.prepare(params)["w"], tiled=True)
    out["w"] = sorted(set(np.asarray(held).ravel().tolist()))
    try:
        ap.train_step(loss, params, (x,), backend="pmap")
        out["pmap"] = "built"
    except ap.AutoParallelError as e:
        out["pmap"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_parameter_broadcast_and_pmap_across_processes(tmp_path):
    """parameter_broadcast=True gave each process's own host values to its devices (JAX then
    refused them as differing); the pmap backend under jax.distributed raised JAX's
    ValueError. Now process 0's values everywhere, and a typed error naming shard_map."""
    for _, res in _workers(_WORKER, tmp_path):
        assert res["w"] == [1.0]  # process 0's value on every device of both processes
        assert "runs in one process" in res["pmap"] and "shard_map" in res["pmap"]


def test_a_coordinator_problem_is_one_line_before_xla_would_abort():
    """XLA's client aborts the process (SIGABRT, a C++ stack) when no coordinator answers, the
    port is taken or the host does not resolve; the processes meet first and say it in one
    line (autopar.multihost.join)."""
    from autopar.errors import AutoParallelError
    from autopar.multihost import join

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AutoParallelError, match="process 0 cannot serve the job at "
                           f"127.0.0.1:{port} .Address already in use"):
            join(f"127.0.0.1:{port}", 2, 0, timeout_s=1)
    free = _free_port()
    with pytest.raises(AutoParallelError, match=f"process 1: no process 0 answered at "
                       f"127.0.0.1:{free} within 1 s"):
        join(f"127.0.0.1:{free}", 2, 1, timeout_s=1)
    with pytest.raises(AutoParallelError, match="cannot resolve 'nosuchhost.invalid'"):
        join("nosuchhost.invalid:1", 2, 1, timeout_s=1)


_AGREEMENT_WORKER = r"""
import hashlib, json, os, sys
rank = int(sys.argv[2])
os.environ["AUTOPAR_CACHE_DIR"] = os.path.join(sys.argv[3], f"cache{rank}")
os.environ.pop("AUTOPAR_CLUSTER", None)  # (the suite names a preset)
from autopar.cli import main  # joins the job (jax.distributed), measures, process 0 caches
assert main(["calibrate", "--devices", "4", "--num-processes", "2", "--process-id", str(rank),
             "--coordinator", sys.argv[1], "--quick", "--budget", "1",
             "--out", os.path.join(sys.argv[3], f"cal{rank}.json")]) == 0
import jax, numpy as np, autopar as ap
out = {}
cal = ap.calibrate(progress=False)  # process 0's cached calibration, on every process
out["calibrated"] = [cal.name, cal.calibration.process_count,
                     hashlib.sha256(cal.model_dump_json().encode()).hexdigest()]
cache = os.environ["AUTOPAR_CACHE_DIR"]
out["cached"] = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
loss = lambda p, x: (jax.nn.relu(x @ p["w1"]) @ p["w2"]).sum()
params = {"w1": np.full((64, 256), 1 / 64, np.float32),
          "w2": np.full((256, 64), 1 / 256, np.float32)}
x = np.ones((16, 64), np.float32)
with ap.auto_parallel_context(device_num=4, parallel_mode="auto_parallel", gradients_mean=True):
    if rank == 0:  # a look at a plan on one process alone: no collective to wait for
        out["alone"] = ap.search(ap.trace(loss, params, x)).cluster
    out["default"] = ap.parallelize(loss, params, x).plan.cluster
    os.environ["AUTOPAR_CLUSTER"] = ("cpu-emulated", "accelerator-8x")[rank]
    f = ap.parallelize(loss, params, x)
    out["named"] = [f.plan.cluster, float(f(params, x))]
    with ap.auto_parallel_context(pipeline_stages=2):  # the pipelined step's stages too
        out["stages"] = [p.cluster for p in ap.train_step(loss, params, (x,)).plans]
    try:
        ap.parallelize(loss, params, x,
                       mode=("dynamic_programming", "recursive_programming")[rank])
        out["differs"] = "built"
    except ap.AutoParallelError as e:
        out["differs"] = str(e)
from autopar.multihost import agree_made
out["made"] = agree_made(lambda: f"made on {rank}")


def fails() -> str:
    raise ap.AutoParallelError("figure", -rank - 1, "must be >= 0")


try:
    agree_made(fails)
except ap.AutoParallelError as e:
    out["fails"] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_every_process_plans_on_process_0s_cluster(tmp_path):
    """Each process of a job resolved its own cluster (its AUTOPAR_CLUSTER, its cache, its
    clock): different plans, a job that hangs in a collective. Now `autopar calibrate
    --num-processes` measures together (process 0's loop lengths and fit; process 0 caches
    and reports it), process 0's cache and cluster price the plans every process builds
    together (a notice where one asked for another), a search on one process alone runs
    no collective, and a plan that still differs raises the same error on every
    process."""
    outs, res = zip(*_workers(_AGREEMENT_WORKER, tmp_path))
    first, second = res
    assert (tmp_path / "cal0.json").is_file() and not (tmp_path / "cal1.json").exists()
    assert "calibrated-cpu-2x2: " in outs[0][0] and "calibrated-cpu-2x2" not in \
        outs[1][0].split("RESULT ")[0]  # process 0 reports
    assert first["calibrated"] == second["calibrated"]  # the same fit, byte for byte
    assert first["calibrated"][:2] == ["calibrated-cpu-2x2", 2]
    assert len(first["cached"]) == 1 and second["cached"] == []  # process 0 keeps it
    assert first["default"] == second["default"] == "calibrated-cpu-2x2"  # process 0's cache
    assert first["alone"] == "calibrated-cpu-2x2" and "alone" not in second
    assert first["named"] == second["named"] == ["cpu-emulated", 1024.0]
    assert first["stages"] == second["stages"] == ["cpu-emulated"] * 2
    notice = "process 0's cluster 'cpu-emulated' prices the plans"
    assert notice in outs[1][1] and notice not in outs[0][1]
    for r in res:
        assert "plan='process(es) [1]' is invalid" in r["differs"], r["differs"]
        # what process 0 alone makes (a calibration's cluster), and its error, everywhere
        assert r["made"] == "made on 0" and "figure=-1 is invalid" in r["fails"], r


def test_processes_given_different_arguments_fail_together_at_once(tmp_path):
    """Another --steps on one process (or another --mode, where only one process's search
    failed) left every process waiting for the others forever: they now compare their
    arguments when the job forms, and each fails in one line."""
    port = _free_port()
    procs = [subprocess.Popen(
        _autopar("--num-processes", "2", "--process-id", str(i), "--coordinator",
                 f"127.0.0.1:{port}", *(["--steps", "3"] if i else [])),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err
        lines = [x for x in err.splitlines() if "error:" in x]
        assert len(lines) == 1 and "arguments='process(es) [1]'" in lines[0], err


_CHECKPOINT_WORKER = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
import numpy as np, optax, autopar as ap
from autopar.models import mlp
from orbax.checkpoint._src.serialization import serialization as ser  # (orbax 0.12)
readers, nbytes, read = set(), [0], ser._read_array_index_and_device_put


async def reading(devices, index, t, **kwargs):  # each block orbax reads: whose, how big
    readers.update(d.process_index for d in devices)
    shape = [len(range(*i.indices(n))) for i, n in zip(index, kwargs["global_shape"])]
    nbytes[0] += int(np.prod(shape)) * t.dtype.numpy_dtype.itemsize
    return await read(devices, index, t, **kwargs)


ser._read_array_index_and_device_put = reading
m = mlp(widths=(8, 16, 16, 8), batch=8)
params, x = m.example_args(jax.random.key(0))
with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel", gradients_mean=True,
                              enable_parallel_optimizer=True,
                              parallel_optimizer_config={"parallel_optimizer_threshold": 0}):
    step = ap.train_step(m.loss, params, (x,), optax.adam(1e-2))
p, s = ap.load_checkpoint(sys.argv[3] + "/ck1", step)
blocks = {(k, str(b.index)): b.data.nbytes
          for k, a in enumerate(jax.tree.leaves((p, s))) for b in a.addressable_shards}
out = {"readers": sorted(readers), "read": nbytes[0], "held": sum(blocks.values()),
       "whole": sum(a.nbytes for a in jax.tree.leaves((p, s))),
       "placed": [a.sharding for a in jax.tree.leaves(p)] == step.storage_shardings,
       "sharded": sum(not a.is_fully_replicated for a in jax.tree.leaves((p, s)))}
for _ in range(3):
    p, s, _ = step(p, s, x)
ap.save_checkpoint(sys.argv[3] + "/ck2", p, s, step)
print("RESULT " + json.dumps(out))
"""


def test_a_checkpoint_moves_between_one_process_and_two(tmp_path):
    """3 steps on one process (8 devices, Megatron + the parallel optimizer), saved; restored
    by 2 processes x 4 devices (data parallel + the parallel optimizer: every block read by
    the process whose device holds it), 3 more steps there, saved by both (each its own
    shards), restored on one process (4 devices): the parameters of 6 uninterrupted steps."""
    import autopar as ap
    from test_weights_checkpoint import KEY, _model, _reference, _step, _train

    m = _model()
    params, x = m.example_args(KEY)
    step_a = _step(m, params, x, 8, "megatron_po")
    p, s = _train(step_a, params, step_a.init(params), x)
    ap.save_checkpoint(tmp_path / "ck1", p, s, step_a)
    for rank, (_, res) in enumerate(_workers(_CHECKPOINT_WORKER, tmp_path)):
        assert res["readers"] == [rank] and res["placed"] and res["sharded"] > 0, res
        assert res["read"] == res["held"] < res["whole"], res  # its own blocks, once each
    state = next((tmp_path / "ck2").glob("state-*"))
    for rank in range(2):  # each process wrote its own shards
        assert any((state / f"ocdbt.process_{rank}" / "d").iterdir()), rank
    p2, _ = ap.load_checkpoint(tmp_path / "ck2", _step(m, params, x, 4, "auto"))
    ref = _reference(m, params, x)
    numerics.check(p2, numerics.Reference(ref.f64[0], ref.f32[0]), "1 -> 2 -> 1 processes")
