"""Cost-model clusters for tests."""

from autopar.strategies.cost import Cluster

#: Compute so slow and links so fast that the search splits every operator it can: at test
#: sizes the real presets replicate most of a small model, which would test little.
COMPUTE_BOUND = Cluster(name="compute-bound", devices_per_node=8, peak_flops=1e6,
                        memory_bandwidth=1e6, memory_bytes=32e9, intra_bandwidth=1e12,
                        intra_alpha=1e-9, inter_bandwidth=1e12, inter_alpha=1e-9)

#: The same, with memory as fast as the links: only FLOPs cost, so the optimizer update of a
#: replicated parameter is free and plans keep parameters replicated where matmuls allow,
#: with their gradients synchronised (COMPUTE_BOUND stores every parameter split instead).
FLOP_BOUND = COMPUTE_BOUND.model_copy(update={"name": "flop-bound", "memory_bandwidth": 1e12})
