"""autopar.simulation: what a plan's iteration looks like before it runs, in one namespace.

* :func:`simulate` -- one training iteration of a plan (forward, backward, the bucketed
  gradient all-reduces on one stream): seed 001's iteration trace, a Chrome trace, a PNG
  (:mod:`autopar.timeline`);
* :func:`advise_split` / :func:`compare_splits` -- the HCCL gradient split that minimises
  that iteration, against the usual alternatives (:mod:`autopar.split_advisor`);
* :func:`gradient_buckets` -- the buckets the context's ``comm_fusion`` or the HCCL split
  strategy make (:mod:`autopar.fusion`);
* :func:`simulate_pipeline` / :func:`simulate_schedule` -- the stages x micro-batches
  timeline of a pipelined step (:mod:`autopar.pipeline.simulation`).

>>> import autopar.simulation as sim
>>> sorted(sim.__all__)[:3]
['Bucket', 'GradientBuckets', 'IterationTrace']
"""

from autopar.fusion import Bucket, GradientBuckets, gradient_buckets
from autopar.pipeline.simulation import PipelineTrace, simulate_pipeline, simulate_schedule
from autopar.split_advisor import SplitAdvice, SplitComparison, advise_split, compare_splits
from autopar.timeline import IterationTrace, plot_timeline, simulate

__all__ = ["Bucket", "GradientBuckets", "IterationTrace", "PipelineTrace", "SplitAdvice",
           "SplitComparison", "advise_split", "compare_splits", "gradient_buckets",
           "plot_timeline", "simulate", "simulate_pipeline", "simulate_schedule"]
