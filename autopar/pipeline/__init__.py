"""autopar.pipeline: pipeline parallelism, one concept per module.

* :mod:`~autopar.pipeline.schedules` -- GPipe and 1F1B tick tables: which micro-batch each
  stage runs forward or backward at each tick, buffer slots, in-flight micro-batches.
* :mod:`~autopar.pipeline.buffers` -- stage-local buffers: parameters packed per stage (and
  sharded by the parallel optimizer), padded boundary activation buffers.
* :mod:`~autopar.pipeline.plan` -- the stages and their plans: the partition (searched or
  at given boundaries), each stage searched on its devices (one strategy file per stage) and
  rewritten; :class:`PipelinePlan`.
* :mod:`~autopar.pipeline.step` -- :func:`pipeline_train_step`: one ``shard_map`` over
  ``('stage', a0, ...)``, a scan over ticks, ``lax.switch`` per stage, ``ppermute`` between
  stages; the facade reads the context once and passes its configuration down.
* :mod:`~autopar.pipeline.simulation` -- :func:`simulate_pipeline`: the stages x
  micro-batches timeline, the bubble, a Chrome trace.
* :mod:`~autopar.pipeline.configure` -- :func:`search_configuration`: the stages, the
  micro-batches and the schedule searched with the layouts (``auto_pipeline=True``).

The stage partition itself is :mod:`autopar.strategies.stages` (:func:`partition_stages`,
exported here, reads the context and the cluster for it).
"""

from autopar.pipeline.buffers import PackedParams
from autopar.pipeline.schedules import Schedule, schedule
from autopar.pipeline.simulation import PipelineTrace, simulate_pipeline, simulate_schedule
from autopar.pipeline.plan import PipelinePlan
from autopar.pipeline.step import PipelineTrainStep, pipeline_train_step
from autopar.pipeline.configure import Configuration, ConfigurationSearch, search_configuration
from autopar.planner import partition_stages
from autopar.strategies.stages import StagePartition

__all__ = ["Configuration", "ConfigurationSearch", "PackedParams", "PipelinePlan",
           "PipelineTrace", "PipelineTrainStep", "Schedule", "StagePartition",
           "partition_stages", "pipeline_train_step", "schedule", "search_configuration",
           "simulate_pipeline", "simulate_schedule"]
