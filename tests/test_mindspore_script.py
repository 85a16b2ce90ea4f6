"""A MindSpore 2.5 script's parallel configuration runs unchanged with autopar imported in
MindSpore's place (issue 17): its ``set_auto_parallel_context`` block, ``set_algo_parameters``
call and ``shard`` / ``Layout`` calls are written as in MindSpore's documentation, only the
import line differs. Each is checked for its effect, and the step for its numerics.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

import autopar as ms  # the script's `import mindspore as ms`
from autopar import Layout  # `from mindspore import Layout`
from autopar import get_group_size, get_rank  # `from mindspore.communication import ...`
import numerics


def _args():
    k = jax.random.split(jax.random.key(11), 3)
    params = {"w1": jax.random.normal(k[0], (16, 32)) / 4,
              "w2": jax.random.normal(k[1], (32, 16)) / 6}
    return params, jax.random.normal(k[2], (16, 16))


def test_a_mindspore_script_runs_after_swapping_the_import(tmp_path):
    save_file = str(tmp_path / "strategy.json")
    # ---- as in the MindSpore script
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL,
                                 device_num=8, gradients_mean=True,
                                 dataset_strategy="data_parallel",
                                 strategy_ckpt_config={"save_file": save_file,
                                                       "only_trainable_params": True},
                                 comm_fusion={"allreduce": {"mode": "auto", "config": None}},
                                 enable_alltoall=False, communi_parallel_mode="all_group_parallel",
                                 pipeline_segments=1)
    ms.set_algo_parameters(fully_use_devices=True, elementwise_op_strategy_follow=False)
    layout = Layout((2, 4), ("dp", "mp"))

    def net(params, x):
        h = ms.shard(jnp.matmul, in_strategy=(layout("dp", "None"), layout("None", "mp")),
                     out_strategy=None,
                     parameter_plan={"self.w2": layout("mp", "None")})(x, params["w1"])
        return jnp.mean((jnp.tanh(h) @ params["w2"]) ** 2)
    # ---- autopar's own part: the training step
    params, x = _args()
    step = ms.train_step(net, params, (x,))
    assert (get_rank(), get_group_size()) == (0, 8)
    assert ms.get_auto_parallel_context("parallel_mode") == "semi_auto_parallel"
    assert ms.get_algo_parameters("fully_use_devices") is True
    assert step.plan.strategy("dot_general_0") == ((2, 1), (1, 4))  # the Layouts' splits
    assert step.plan.split_counts("params/w2") == (4, 1)  # the parameter_plan's layout
    with open(save_file) as fh:
        saved = json.load(fh)
    assert saved["parallel_strategy_item"]["dot_general_0"]["parallel_strategy"] == [[2, 1],
                                                                                     [1, 4]]
    run = numerics.optimizer_steps(net, steps=2)
    want = numerics.reference(lambda *a: run(*a)[0], params, x, jit=False)
    p, st = params, step.init(params)
    for _ in range(2):
        p, st, _ = step(p, st, x)
    numerics.check(p, want)
