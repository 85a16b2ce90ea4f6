"""autopar: MindSpore-style auto-parallel configuration for JAX.

>>> import autopar as ap
>>> ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
...                              search_mode="dynamic_programming")
>>> ap.get_auto_parallel_context("device_num")
8
>>> ap.reset_auto_parallel_context()

The top level is the user's API: the context and the algorithm parameters, tracing and
annotations, search, the parallel function and the training steps, calibration, strategy
files, the mode comparison and the errors. The rest lives in named submodules:

- :mod:`autopar.hccl` -- HCCL's communication groups and gradient split strategies;
- :mod:`autopar.simulation` -- the iteration and pipeline simulators, the split advisor,
  gradient buckets;
- :mod:`autopar.pipeline` -- the pipelined step's parts (schedules, stage partition, plans);
- the building blocks by module: :mod:`autopar.rewrite`, :mod:`autopar.lower`,
  :mod:`autopar.resolve`, :mod:`autopar.clusters`, :mod:`autopar.checkpoint`,
  :mod:`autopar.strategies` (planning), :mod:`autopar.graph` (the IR), :mod:`autopar.models`.
"""

from autopar import hccl, pipeline, simulation
from autopar.algo import (
    algo_parameters_context,
    get_algo_parameters,
    reset_algo_parameters,
    set_algo_parameters,
)
from autopar.checkpoint import StrategyFileError, load_strategy, save_strategy
from autopar.clusters import ClusterFileError, calibrate
from autopar.compare import compare_modes
from autopar.context import (
    ParallelMode,
    auto_parallel_context,
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from autopar.errors import (
    AutoparError,
    AutoParallelError,
    AutoParallelTypeError,
    AutoParallelWarning,
    CommGroupError,
    ContextConflictError,
    UnknownKeyError,
    UnsupportedOperatorError,
)
from autopar.export import in_shardings, to_jax_shardings
from autopar.graph import Graph, matmul, shard, trace
from autopar.graph.ms_layout import Layout
from autopar.hccl import get_group_size, get_rank
from autopar.mindspore_import import import_mindspore_strategy
from autopar.parallel_function import parallelize
from autopar.pipeline import pipeline_train_step
from autopar.planner import search
from autopar.resolve import resolve_context
from autopar.strategies import CLUSTERS, Cluster, Plan
from autopar.train import train_step

__version__ = "0.1.0"

__all__ = [
    # the context, the algorithm parameters, the communication queries
    "ParallelMode", "auto_parallel_context", "get_auto_parallel_context",
    "reset_auto_parallel_context", "resolve_context", "set_auto_parallel_context",
    "algo_parameters_context", "get_algo_parameters", "reset_algo_parameters",
    "set_algo_parameters", "get_group_size", "get_rank",
    # trace, plan, run
    "Graph", "Layout", "matmul", "shard", "trace",
    "CLUSTERS", "Cluster", "Plan", "calibrate", "compare_modes", "search",
    "in_shardings", "parallelize", "pipeline_train_step", "to_jax_shardings", "train_step",
    # strategy files
    "import_mindspore_strategy", "load_strategy", "save_strategy",
    # errors
    "AutoParallelError", "AutoParallelTypeError", "AutoParallelWarning", "AutoparError",
    "ClusterFileError", "CommGroupError", "ContextConflictError", "StrategyFileError",
    "UnknownKeyError", "UnsupportedOperatorError",
    # namespaces
    "hccl", "pipeline", "simulation",
]
