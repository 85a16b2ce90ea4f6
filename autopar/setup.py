"""``Setup``: what a public entry point reads once, handed to everything below it.

The stores a job is configured through -- the auto-parallel context (checked by its mode
restrictions, with the keys the user set and the fusion settings derived from it:
:func:`autopar.resolve.resolve_context`), the algorithm parameters (:mod:`autopar.algo`), the
HCCL gradient split strategy (:mod:`autopar.split_strategies`) and the cluster that prices the plans
(:func:`autopar.clusters.resolve_cluster`, process 0's where a program is built under
``jax.distributed``) -- are read
by the public entry points only (``search``, ``parallelize``, ``train_step``,
``pipeline_train_step``, the tuned step; ``simulate`` and the split advisor, which read the
context as set, unchecked), each exactly once, into one frozen
:class:`Setup`. The planner, the function builder, the training steps and the stage planner
take it as an argument and read no store themselves (``tests/test_architecture.py``: the
context readers are named there; ``tests/test_setup.py`` counts the reads of one
``train_step``).

The cluster is resolved on first use and kept: a strategy file loaded with no cluster named
is priced on the file's own (the request is kept beside it, :attr:`Setup.cluster_named`), so
a load never calibrates.

>>> import autopar as ap
>>> with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
...     s = resolve_setup("accelerator-8x")
>>> s.device_num, s.config.parallel_mode, s.cluster.name, s.cluster_named
(8, 'auto_parallel', 'accelerator-8x', True)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from autopar.algo import AlgoParameters, current_algo_parameters
from autopar.clusters import plan_cluster, resolve_cluster
from autopar.comm_groups import WORLD_GROUP
from autopar.config import AutoParallelConfig
from autopar.resolve import ResolvedContext, read_context, resolve_context
from autopar.split_strategies import SplitStrategy, get_split_strategy
from autopar.strategies.cost import Cluster

__all__ = ["Setup", "resolve_setup"]


@dataclass(frozen=True)
class Setup:
    """The resolved configuration of one entry point's work (see the module docstring).

    ``resolved``: the auto-parallel context, mode restrictions checked, with the keys the
    user set and the fusion settings; ``algo``: the algorithm parameters;
    :attr:`split`: HCCL's effective gradient split strategy of the world group (read on
    first use: only the training steps bucket gradients); ``cluster_request``: the
    ``cluster=`` argument as given (None: the calibrated or default cluster, or a loaded
    strategy file's own); :attr:`cluster`: the resolved
    :class:`~autopar.strategies.cost.Cluster`."""

    resolved: ResolvedContext
    algo: AlgoParameters
    cluster_request: Any = field(default=None, compare=False)

    @property
    def config(self) -> AutoParallelConfig:
        """The checked configuration."""
        return self.resolved.config

    @property
    def explicit(self) -> frozenset[str]:
        """The configuration keys the user set."""
        return self.resolved.explicit

    @property
    def device_num(self) -> int:
        """The devices a plan spans: 1 under ``stand_alone``, else ``device_num``."""
        c = self.config
        return 1 if c.parallel_mode == "stand_alone" else int(c.device_num)

    @property
    def cluster_named(self) -> bool:
        """Whether the entry point was given a cluster (else a loaded file's own prices)."""
        return self.cluster_request is not None

    @cached_property
    def split(self) -> SplitStrategy:
        """HCCL's gradient split strategy of the world group, read once."""
        return get_split_strategy(WORLD_GROUP)

    def cluster_for(self, plan: Any) -> Cluster:
        """The cluster that prices work on ``plan``: the entry point's when it named one, else
        the plan's own (a simulation agrees with the search), else :attr:`cluster`
        (:func:`autopar.clusters.cluster_for`, the cluster resolved once)."""
        own = None if self.cluster_named else plan_cluster(plan)
        return self.cluster if own is None else own

    @cached_property
    def cluster(self) -> Cluster:
        """The cluster that prices the plans: resolved once, on first use. An entry point
        that builds a program uses it first inside :func:`autopar.multihost.together`, so
        under ``jax.distributed`` it is process 0's; a search on one process alone runs no
        collective."""
        return resolve_cluster(self.cluster_request)

    def with_config(self, **changes: Any) -> "Setup":
        """This setup with configuration keys replaced (a stage's own strategy files); the
        cluster, once resolved, is kept."""
        out = replace(self, resolved=replace(self.resolved,
                                             config=self.config.model_copy(update=changes)))
        for kept in ("cluster", "split"):  # (what was read stays read)
            if kept in self.__dict__:
                out.__dict__[kept] = self.__dict__[kept]
        return out


def resolve_setup(cluster: Any = None, *, check: bool = True) -> Setup:
    """Read the stores once: the context (its mode restrictions checked) and the algorithm
    parameters; ``cluster``: the entry point's ``cluster=`` argument (resolved on first
    use, as the HCCL split strategy). ``check=False``: the context as set, neither checked
    nor warned about (:func:`autopar.resolve.read_context`: the simulation and the split
    advisor price what a setting would do, on any context)."""
    return Setup(resolve_context() if check else read_context(), current_algo_parameters(),
                 cluster)
