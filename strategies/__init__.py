"""autopar.strategies: mesh, layouts, redistribution, cost model and the search modes."""

from autopar.strategies.cost import CLUSTERS, Cluster, CostModel, get_cluster
from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.plan import NodeStrategy, Plan
from autopar.strategies.redistribution import Step, redistribute

__all__ = ["CLUSTERS", "Cluster", "CostModel", "DeviceMesh", "NodeStrategy", "Plan", "Step",
           "TensorLayout", "get_cluster", "redistribute"]
