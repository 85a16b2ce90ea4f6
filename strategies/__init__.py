"""autopar.strategies: mesh, layouts, redistribution, cost model and the search modes."""

from autopar.strategies.cost import CLUSTERS, Cluster, CostModel, get_cluster
from autopar.strategies.layout import DeviceMesh, Layout
from autopar.strategies.plan import NodeStrategy, Plan
from autopar.strategies.redistribution import Step, redistribute

__all__ = ["CLUSTERS", "Cluster", "CostModel", "DeviceMesh", "Layout", "NodeStrategy", "Plan",
           "Step", "get_cluster", "redistribute"]
