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

``import autopar`` itself loads only the errors (0.04 s, where the whole facade takes 1.5 s):
each name above is imported on first use (a module ``__getattr__``), so a program that only
traces and searches, such as ``autopar search``, does not load lowering, training, the
pipeline or optax. Any other attribute -- a building-block module such as ``autopar.rewrite``,
or one of its submodules -- loads the whole facade, as a plain ``import autopar`` did before.
"""

import importlib
from typing import TYPE_CHECKING, Any

from autopar.errors import (
    AutoparError,
    AutoParallelError,
    AutoParallelTypeError,
    AutoParallelWarning,
    CommGroupError,
    ContextConflictError,
    MemoryBudgetError,
    UnknownKeyError,
    UnsupportedOperatorError,
)

if TYPE_CHECKING:  # the facade, as type checkers and the import contracts see it
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
    from autopar.export import in_shardings, to_jax_shardings
    from autopar.graph import Graph, matmul, shard, trace
    from autopar.graph.ms_layout import Layout
    from autopar.hccl import get_group_size, get_rank
    from autopar.mindspore_import import import_mindspore_strategy
    from autopar.parallel_function import parallelize
    from autopar.pipeline import pipeline_train_step, search_configuration
    from autopar.planner import explain, search
    from autopar.resolve import resolve_context
    from autopar.strategies import CLUSTERS, Cluster, Plan
    from autopar.tune import train_step
    from autopar.weights import (CheckpointMismatchError, CheckpointStrategyError,
                                 load_checkpoint, load_distributed_checkpoint, save_checkpoint,
                                 transform_checkpoints)

__version__ = "0.1.0"

__all__ = [
    # the context, the algorithm parameters, the communication queries
    "ParallelMode", "auto_parallel_context", "get_auto_parallel_context",
    "reset_auto_parallel_context", "resolve_context", "set_auto_parallel_context",
    "algo_parameters_context", "get_algo_parameters", "reset_algo_parameters",
    "set_algo_parameters", "get_group_size", "get_rank",
    # trace, plan, run
    "Graph", "Layout", "matmul", "shard", "trace",
    "CLUSTERS", "Cluster", "Plan", "calibrate", "compare_modes", "explain", "search",
    "in_shardings", "parallelize", "pipeline_train_step", "search_configuration",
    "to_jax_shardings", "train_step",
    # strategy files
    "import_mindspore_strategy", "load_strategy", "save_strategy",
    # trained weights across plans
    "load_checkpoint", "load_distributed_checkpoint", "save_checkpoint", "transform_checkpoints",
    # errors
    "AutoParallelError", "AutoParallelTypeError", "AutoParallelWarning", "AutoparError",
    "CheckpointMismatchError", "CheckpointStrategyError", "ClusterFileError", "CommGroupError",
    "ContextConflictError", "StrategyFileError",
    "MemoryBudgetError", "UnknownKeyError", "UnsupportedOperatorError",
    # namespaces
    "hccl", "pipeline", "simulation",
]

#: Where each lazily loaded name of ``__all__`` lives: (module, attribute), or (module, None)
#: for a namespace module.
_LAZY: dict[str, tuple[str, str | None]] = {
    **{name: ("autopar.context", name) for name in (
        "ParallelMode", "auto_parallel_context", "get_auto_parallel_context",
        "reset_auto_parallel_context", "set_auto_parallel_context")},
    **{name: ("autopar.algo", name) for name in (
        "algo_parameters_context", "get_algo_parameters", "reset_algo_parameters",
        "set_algo_parameters")},
    **{name: ("autopar.graph", name) for name in ("Graph", "matmul", "shard", "trace")},
    **{name: ("autopar.strategies", name) for name in ("CLUSTERS", "Cluster", "Plan")},
    **{name: ("autopar.export", name) for name in ("in_shardings", "to_jax_shardings")},
    **{name: ("autopar.checkpoint", name) for name in (
        "StrategyFileError", "load_strategy", "save_strategy")},
    **{name: ("autopar.clusters", name) for name in ("ClusterFileError", "calibrate")},
    **{name: ("autopar.hccl", name) for name in ("get_group_size", "get_rank")},
    "Layout": ("autopar.graph.ms_layout", "Layout"),
    "compare_modes": ("autopar.compare", "compare_modes"),
    "import_mindspore_strategy": ("autopar.mindspore_import", "import_mindspore_strategy"),
    "parallelize": ("autopar.parallel_function", "parallelize"),
    "pipeline_train_step": ("autopar.pipeline", "pipeline_train_step"),
    "search_configuration": ("autopar.pipeline", "search_configuration"),
    **{name: ("autopar.planner", name) for name in ("explain", "search")},
    "resolve_context": ("autopar.resolve", "resolve_context"),
    "train_step": ("autopar.tune", "train_step"),  # autopar.train's, plus tune=
    **{name: ("autopar.weights", name) for name in (
        "CheckpointMismatchError", "CheckpointStrategyError", "load_checkpoint",
        "load_distributed_checkpoint", "save_checkpoint", "transform_checkpoints")},
    "hccl": ("autopar.hccl", None),
    "pipeline": ("autopar.pipeline", None),
    "simulation": ("autopar.simulation", None),
}

#: The modules the facade imported eagerly before it was lazy (``_load_all``).
_FACADE = sorted({module for module, _ in _LAZY.values()})


def _load_all() -> None:
    """Import the whole facade, as a plain ``import autopar`` did before it was lazy (so
    ``autopar.rewrite``, ``autopar.strategies.search``, ... are there as before)."""
    for module in _FACADE:
        importlib.import_module(module)
    for name in _LAZY:
        __getattr__(name)


def __getattr__(name: str) -> Any:
    """Load a public name on first use (PEP 562); any other attribute loads the facade."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        _load_all()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
