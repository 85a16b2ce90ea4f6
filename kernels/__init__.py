"""autopar.kernels: fused communication kernels for use inside ``jax.shard_map``.

* :func:`mm_reduce_scatter` -- ``psum_scatter(x @ w)`` as a pipelined ring of ``ppermute``.
* :func:`all_gather_matmul` -- ``all_gather(x) @ w`` as a pipelined ring of ``ppermute``.
* :func:`all_gather_v` / :func:`allgatherv` -- AllGatherV (variable counts per rank), on
  the device inside ``shard_map`` / from the host with one array per rank.
* :func:`npu_mm_reduce_scatter_base` -- the ``torch_npu`` operator's signature and rules.
"""

from autopar.kernels.all_gather_matmul import all_gather_matmul
from autopar.kernels.all_gather_v import AllGatherVLayout, all_gather_v, allgatherv
from autopar.kernels.mm_reduce_scatter import mm_reduce_scatter
from autopar.kernels.npu import npu_mm_reduce_scatter_base

__all__ = [
    "AllGatherVLayout",
    "all_gather_matmul",
    "all_gather_v",
    "allgatherv",
    "mm_reduce_scatter",
    "npu_mm_reduce_scatter_base",
]
