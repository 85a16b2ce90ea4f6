"""The computation graph: trace a JAX function into nodes with shapes, FLOPs and bytes."""

from autopar.graph.annotate import matmul, shard
from autopar.graph.ir import Graph, Node, Strategy, TensorSpec, Value
from autopar.graph.ms_layout import Layout
from autopar.graph.tracer import trace

__all__ = ["Graph", "Layout", "Node", "Strategy", "TensorSpec", "Value", "matmul", "shard",
           "trace"]
