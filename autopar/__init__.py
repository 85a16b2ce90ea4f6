"""autopar: MindSpore-style auto-parallel configuration for JAX.

>>> import autopar as ap
>>> ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel",
...                              search_mode="dynamic_programming")
>>> ap.get_auto_parallel_context("device_num")
8
>>> ap.reset_auto_parallel_context()
"""

from autopar.comm import (
    DEFAULT_SPLIT_SIZES,
    WORLD_GROUP,
    SplitStrategy,
    create_group,
    destroy_group,
    get_group_rank_from_world_rank,
    get_rank_id,
    get_rank_size,
    get_split_strategy,
    get_world_rank_from_group_rank,
    reset_comm_groups,
    set_split_strategy_by_idx,
    set_split_strategy_by_size,
)
from autopar.config import AutoParallelConfig
from autopar.context import (
    auto_parallel_context,
    current_config,
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
from autopar.graph import Graph, Node, TensorSpec, Value, matmul, shard, trace
from autopar.resolve import FusionSetting, ResolvedContext, resolve_context
from autopar.strategies import CLUSTERS, Cluster, CostModel, DeviceMesh, Layout, Plan
from autopar.clusters import calibrate
from autopar.clusters import ClusterFileError, load_cluster, resolve_cluster, save_cluster
from autopar.planner import search
from autopar.export import in_shardings, to_jax_shardings
from autopar.rewrite import rewrite
from autopar.lower import lower
from autopar.parallelize import parallelize
from autopar import checkpoint
from autopar.checkpoint import (StrategyFileError, load_strategy, read_strategy_file,
                                save_strategy)
from autopar.mindspore_import import MindSporeImport, import_mindspore_strategy
from autopar.compare import ModeResult, compare_modes
from autopar.step_inputs import broadcast_parameters
from autopar.train import TrainStep, train_step
from autopar.grad_sync import sync_gradients
from autopar.fusion import Bucket, GradientBuckets, gradient_buckets
from autopar.timeline import IterationTrace, plot_timeline, simulate
from autopar.advisor import SplitAdvice, SplitComparison, advise_split, compare_splits
from autopar.pipeline import (PackedParams, PipelinePlan, PipelineTrace, PipelineTrainStep,
                              Schedule, pipeline_train_step, simulate_pipeline,
                              simulate_schedule, schedule as pipeline_schedule)
from autopar.strategies.stages import StagePartition
from autopar.planner import partition_stages

__version__ = "0.1.0"

__all__ = [
    "AutoParallelConfig",
    "CLUSTERS",
    "Cluster",
    "ClusterFileError",
    "CostModel",
    "calibrate",
    "load_cluster",
    "resolve_cluster",
    "save_cluster",
    "DeviceMesh",
    "Layout",
    "Plan",
    "search",
    "to_jax_shardings",
    "in_shardings",
    "rewrite",
    "lower",
    "parallelize",
    "StrategyFileError",
    "load_strategy",
    "read_strategy_file",
    "save_strategy",
    "MindSporeImport",
    "import_mindspore_strategy",
    "ModeResult",
    "compare_modes",
    "train_step",
    "TrainStep",
    "broadcast_parameters",
    "sync_gradients",
    "Bucket",
    "GradientBuckets",
    "gradient_buckets",
    "IterationTrace",
    "plot_timeline",
    "simulate",
    "SplitAdvice",
    "SplitComparison",
    "advise_split",
    "compare_splits",
    "AutoParallelError",
    "AutoParallelTypeError",
    "AutoParallelWarning",
    "AutoparError",
    "CommGroupError",
    "ContextConflictError",
    "DEFAULT_SPLIT_SIZES",
    "FusionSetting",
    "Graph",
    "Node",
    "TensorSpec",
    "Value",
    "matmul",
    "shard",
    "trace",
    "ResolvedContext",
    "SplitStrategy",
    "UnknownKeyError",
    "UnsupportedOperatorError",
    "WORLD_GROUP",
    "auto_parallel_context",
    "create_group",
    "current_config",
    "destroy_group",
    "get_auto_parallel_context",
    "get_group_rank_from_world_rank",
    "get_rank_id",
    "get_rank_size",
    "get_split_strategy",
    "get_world_rank_from_group_rank",
    "reset_auto_parallel_context",
    "reset_comm_groups",
    "resolve_context",
    "set_auto_parallel_context",
    "set_split_strategy_by_idx",
    "set_split_strategy_by_size",
    "PackedParams",
    "PipelinePlan",
    "PipelineTrainStep",
    "pipeline_train_step",
    "PipelineTrace",
    "simulate_pipeline",
    "simulate_schedule",
    "Schedule",
    "pipeline_schedule",
    "StagePartition",
    "partition_stages",
]
