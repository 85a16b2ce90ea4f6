"""A NumPy model of SPMD shards: lay a global array out on a mesh, apply redistribution steps.

Devices are coordinates over the mesh axes. A layout splits each dim over its axes (outer axis
first, mixed radix); partial axes hold summands that add up to the global value.
"""

from __future__ import annotations

import itertools

import numpy as np

from autopar.strategies.layout import DeviceMesh, TensorLayout
from autopar.strategies.redistribution import Step

Coord = tuple[int, ...]


def devices(mesh: DeviceMesh) -> list[Coord]:
    return list(itertools.product(*[range(s) for _, s in mesh.axes]))


def _index(coord: Coord, axes: tuple[str, ...], mesh: DeviceMesh) -> int:
    idx = 0
    for a in axes:
        idx = idx * mesh.sizes[a] + coord[mesh.names.index(a)]
    return idx


def _block(x: np.ndarray, dim: int, parts: int, k: int) -> np.ndarray:
    n = x.shape[dim] // parts
    return np.take(x, np.arange(k * n, (k + 1) * n), axis=dim)


def shard(x: np.ndarray, layout: TensorLayout, mesh: DeviceMesh,
          rng: np.random.Generator | None = None) -> dict[Coord, np.ndarray]:
    out = {}
    summands: dict[Coord, np.ndarray] = {}
    if layout.partial:
        groups = list(itertools.product(*[range(mesh.sizes[a]) for a in layout.partial]))
        rng = rng or np.random.default_rng(0)
        parts = [rng.standard_normal(x.shape) for _ in groups[:-1]]
        parts.append(x - sum(parts) if parts else x)
        summands = dict(zip(groups, parts))
    for c in devices(mesh):
        v = x
        if layout.partial:
            v = summands[tuple(c[mesh.names.index(a)] for a in layout.partial)]
        for d, axes in enumerate(layout.dims):
            if axes:
                v = _block(v, d, mesh.size_of(axes), _index(c, axes, mesh))
        out[c] = v
    return out


def _group(c: Coord, axes: tuple[str, ...], mesh: DeviceMesh) -> list[Coord]:
    """Devices that differ from c only on `axes`, in mixed-radix order of `axes`."""
    pos = [mesh.names.index(a) for a in axes]
    out = []
    for vals in itertools.product(*[range(mesh.sizes[a]) for a in axes]):
        cc = list(c)
        for p, v in zip(pos, vals):
            cc[p] = v
        out.append(tuple(cc))
    return out


def apply(step: Step, local: dict[Coord, np.ndarray], mesh: DeviceMesh) -> dict[Coord,
                                                                              np.ndarray]:
    out = {}
    for c, v in local.items():
        grp = _group(c, step.axes, mesh)
        k, p = _index(c, step.axes, mesh), mesh.size_of(step.axes)
        if step.kind == "all_reduce":
            out[c] = sum(local[g] for g in grp)
        elif step.kind == "reduce_scatter":
            out[c] = _block(sum(local[g] for g in grp), step.dim, p, k)
        elif step.kind == "all_gather":
            out[c] = np.concatenate([local[g] for g in grp], axis=step.dim)
        elif step.kind == "slice":
            out[c] = _block(v, step.dim, p, k)
        elif step.kind == "all_to_all":
            full = np.concatenate([local[g] for g in grp], axis=step.src_dim)
            out[c] = _block(full, step.dim, p, k)
        else:  # pragma: no cover
            raise ValueError(step.kind)
    return out
