"""Save and restore a training state across plans (autopar.save_checkpoint / load_checkpoint):
time, and the host memory a restore takes at its peak, against the state's size.

An MLP of three ``n x n`` layers, Adam (state = 3 x the parameters), trained under plan A
(data parallel on 8 devices, the parallel optimizer sharding every parameter and its state 8
ways) is saved, then restored under plan B (auto_parallel on 4 devices). On CPU the devices'
memory is the host's, so the restore's peak is the process's resident memory above what it
held before, sampled every millisecond while orbax reads. Goal (issue 41): that peak is at most
1.5 x the bytes of the shards this process holds once restored (what plan B places on its
devices, replicas counted), never the whole state gathered on top of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._common import (ROOT, Col, DocTables, DocTexts, markdown_table, run_main,
                                setup_devices, write_results)

GOAL = 1.5
_COLUMNS = ["n", "state_mib", "held_mib", "save_s", "restore_s", "restore_peak_mib",
            "peak_over_held", "meets_goal"]
_DOC_COLUMNS = (Col("n", "n"), Col("state MiB", "state_mib", ".1f"),
                Col("held after restore MiB", "held_mib", ".1f"),
                Col("save s", "save_s", ".3f"), Col("restore s", "restore_s", ".3f"),
                Col("restore peak MiB", "restore_peak_mib", ".1f"),
                Col("peak / held", "peak_over_held", ".2f"), Col("<= 1.5", "meets_goal"))


def doc_tables(results: dict[str, dict]) -> DocTexts:
    """docs/checkpoints.md's table, from checkpoint.json."""
    return {("docs/checkpoints.md", "checkpoint"):
            markdown_table(results["checkpoint"]["rows"], _DOC_COLUMNS)}


DOC_TABLES = DocTables(("checkpoint",), doc_tables)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The largest resident size above the start, sampled every millisecond."""

    def __enter__(self) -> "_Peak":
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def over(self) -> int:
        return self.peak - self.base


def _held(tree) -> int:
    import jax
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def _steps(n: int):
    import jax
    import optax

    import autopar as ap
    from autopar.models import mlp

    m = mlp(widths=(n, n, n, n), batch=8)
    params, x = m.example_args(jax.random.key(0))
    opt = optax.adam(1e-3)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel",
                                  gradients_mean=True, enable_parallel_optimizer=True,
                                  parallel_optimizer_config={"parallel_optimizer_threshold": 0}):
        a = ap.train_step(m.loss, params, (x,), opt)
    with ap.auto_parallel_context(device_num=4, parallel_mode="auto_parallel",
                                  gradients_mean=True):
        b = ap.train_step(m.loss, params, (x,), opt)
    return a, b, params


def _save(n: int, where: Path) -> dict:
    import jax

    import autopar as ap

    a, _, params = _steps(n)
    params = a.prepare(params)
    state = a.init(params)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, state)))
    t0 = time.perf_counter()
    ap.save_checkpoint(where, params, state, a)
    return {"n": n, "state_mib": state_bytes / 2**20, "save_s": time.perf_counter() - t0}


def _restore(n: int, where: Path) -> dict:
    """In a fresh process (its allocator has nothing freed to reuse): plan B's step built
    first, then the restore watched."""
    import jax

    import autopar as ap

    import numpy as np
    import orbax.checkpoint as ocp

    _, b, _ = _steps(n)
    with ocp.StandardCheckpointer() as ckpt:  # orbax's first use (imports, thread pools),
        ckpt.save(where.parent / "tiny", {"x": np.zeros(4)})  # on an array too small to
        ckpt.restore(where.parent / "tiny")                  # leave freed pages behind
    with _Peak() as peak:
        t0 = time.perf_counter()
        restored = ap.load_checkpoint(where, b)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t0
    held = _held(restored)
    return {"held_mib": held / 2**20, "restore_s": restore_s,
            "restore_peak_mib": peak.over / 2**20, "peak_over_held": peak.over / held,
            "meets_goal": bool(peak.over / held <= GOAL)}


def _child(n: int, where: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_checkpoint", "--restore",
                          str(n), str(where)], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=False)
    if out.returncode:
        raise SystemExit(f"restore of n={n} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(quick: bool = False) -> None:
    rows = []
    for n in ((256, 512) if quick else (512, 1024, 2048)):
        where = Path(tempfile.mkdtemp(prefix="autopar-bench-ckpt-"))
        try:
            _save(n, where / "warm")  # (compiles and orbax's first use out of the figures)
            row = _save(n, where / "ck")
            rows.append({**row, **_child(n, where / "ck")})
        finally:
            shutil.rmtree(where, ignore_errors=True)
    write_results("checkpoint", rows, _COLUMNS, meta={
        "note": "plan A: data parallel + parallel optimizer on 8 devices; plan B: "
                "auto_parallel on 4; Adam state; restore peak = resident memory above the "
                "start, sampled every ms; held = bytes of the restored shards on this "
                f"process's devices; goal peak / held <= {GOAL}"})
    DOC_TABLES.write()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--restore"]:
        setup_devices(8)
        print(json.dumps(_restore(int(sys.argv[2]), Path(sys.argv[3]))))
    else:
        run_main(main)
