"""DeviceMesh and TensorLayout: how tensors live on an abstract mesh of devices.

A :class:`DeviceMesh` is abstract: axis names and sizes only. ``device_num`` is factorised
into prime-size axes, outermost first (8 -> ``a0:2, a1:2, a2:2``; 12 -> ``a0:2, a1:2,
a2:3``), and devices are numbered row-major, so the last axes connect devices of one node.
:func:`jax_mesh` places it on JAX devices; :func:`axis_name` names a group of its axes as
``jax`` does.

A :class:`TensorLayout` says, for each tensor dimension, the mesh axes it is split over (outer axis
first), and the axes over which the tensor is a pending partial sum. Axes used by neither are
replicated. Short form like DTensor's: ``S(0)[a0]`` = dim 0 split over a0, ``P[a1]`` = partial
over a1, ``R`` = replicated.

>>> mesh = DeviceMesh.for_devices(8)
>>> lay = TensorLayout(((("a0",)), ("a1", "a2")))
>>> str(lay), lay.split_counts(mesh)
('S(0)[a0]S(1)[a1,a2]', (2, 4))
>>> lay.partition_spec()
P('a0', ('a1', 'a2'))
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Sequence

from autopar.errors import AutoParallelError, AutoParallelTypeError
from autopar.limits import MAX_DEVICES

__all__ = ["DeviceMesh", "TensorLayout", "axis_name", "jax_mesh", "prime_factors"]


def prime_factors(n: int) -> list[int]:
    """Prime factors in ascending order: 12 -> [2, 2, 3]."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def axis_name(axes: Iterable[str]) -> Any:
    """How ``jax`` names a group of mesh axes (a collective's ``axis_name``, a
    ``PartitionSpec`` entry): one axis by its name, several as a tuple, outer first (the
    mixed radix ``jax.lax`` uses), none as None.

    >>> axis_name(("a1",)), axis_name(("a0", "a2")), axis_name(())
    ('a1', ('a0', 'a2'), None)
    """
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclass(frozen=True)
class DeviceMesh:
    """Abstract device mesh: ordered (name, size) axes; no devices are touched."""

    axes: tuple[tuple[str, int], ...]

    @staticmethod
    def for_devices(device_num: int) -> "DeviceMesh":
        if not isinstance(device_num, int) or isinstance(device_num, bool):
            raise AutoParallelTypeError("device_num", device_num, "must be an int")
        if not 1 <= device_num <= MAX_DEVICES:
            raise AutoParallelError("device_num", device_num, f"must be in [1, {MAX_DEVICES}]")
        return DeviceMesh(tuple((f"a{i}", p) for i, p in enumerate(prime_factors(device_num))))

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @cached_property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @cached_property
    def device_num(self) -> int:
        return math.prod(s for _, s in self.axes)

    def size_of(self, axes: Iterable[str]) -> int:
        sizes, n = self.sizes, 1
        for a in axes:
            n *= sizes[a]
        return n

    def span(self, axes: Iterable[str]) -> int:
        """How many consecutive device numbers a group over ``axes`` spans: the product of
        the sizes from its outermost axis to the innermost mesh axis (1 for no axes; devices
        are numbered row-major). Which link a group uses follows from it
        (:meth:`CostModel.intra_node <autopar.strategies.cost.CostModel.intra_node>`).

        >>> DeviceMesh.for_devices(8).span(("a1",))
        4
        """
        names = set(axes)
        n = 1
        for name, size in reversed(self.axes):
            if not names:
                break
            n *= size
            names.discard(name)
        return n

    @functools.lru_cache(maxsize=64)
    def inner_axes(self, devices_per_node: int) -> frozenset[str]:
        """Axes whose devices share a node: those whose groups span at most a node."""
        return frozenset(a for a in self.names if self.span((a,)) <= devices_per_node)

    def assign(self, splits: Iterable[int]) -> tuple[tuple[str, ...], ...] | None:
        """Canonical axes for split counts, or None if they do not fit the mesh.

        As MindSpore's device matrix ``[repeat, s1, s2, ...]``: the outermost axes hold the
        repeated (replicated) calculation, the following axes go to the splits in order.
        (2, 4) on 8 devices -> (('a0',), ('a1', 'a2')); (1, 4) -> ((), ('a1', 'a2')).
        """
        return self._assign(tuple(splits))

    @functools.lru_cache(maxsize=8192)
    def _assign(self, splits: tuple[int, ...]) -> tuple[tuple[str, ...], ...] | None:
        """:meth:`assign`, kept per mesh and split counts (the searches ask again and
        again: every candidate of every round)."""
        total = math.prod(splits)
        if total == 0 or self.device_num % total:
            return None
        free = list(self.axes)
        for p in prime_factors(self.device_num // total):  # reserve the repeat axes first
            idx = next((i for i, (_, size) in enumerate(free) if size == p), None)
            if idx is None:
                return None
            free.pop(idx)
        out = []
        for s in splits:
            got: list[str] = []
            for p in prime_factors(s):
                idx = next((i for i, (_, size) in enumerate(free) if size == p), None)
                if idx is None:
                    return None
                got.append(free.pop(idx)[0])
            out.append(tuple(sorted(got, key=self.names.index)))
        return tuple(out)

    def __str__(self) -> str:
        return "x".join(f"{n}:{s}" for n, s in self.axes) or "(1 device)"


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Per tensor dim, the mesh axes it is split over; plus pending partial-sum axes."""

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    @staticmethod
    def replicated(rank: int) -> "TensorLayout":
        return TensorLayout(tuple(() for _ in range(rank)))

    @property
    def rank(self) -> int:
        return len(self.dims)

    def used_axes(self) -> frozenset[str]:
        return frozenset(a for d in self.dims for a in d) | frozenset(self.partial)

    def split_counts(self, mesh: DeviceMesh) -> tuple[int, ...]:
        return tuple(mesh.size_of(d) for d in self.dims)

    def local_shape(self, shape: tuple[int, ...], mesh: DeviceMesh) -> tuple[int, ...]:
        return tuple(n // mesh.size_of(d) for n, d in zip(shape, self.dims))

    def strategy(self, mesh: DeviceMesh) -> tuple[int, ...]:
        """The MindSpore strategy entry of this tensor: split count per dim."""
        return self.split_counts(mesh)

    @staticmethod
    def from_strategy(entry: tuple[int, ...], mesh: DeviceMesh) -> "TensorLayout":
        """Canonical layout of a MindSpore strategy entry (repeated axes stay replicated).

        >>> TensorLayout.from_strategy((2, 1), DeviceMesh.for_devices(8))
        TensorLayout(dims=(('a2',), ()), partial=())
        """
        axes = mesh.assign(entry)
        if axes is None or mesh.device_num % math.prod(entry) != 0:
            raise AutoParallelError("strategy", entry, f"split counts must multiply to a "
                                    f"divisor of device_num={mesh.device_num}")
        return TensorLayout(axes)

    def partition_spec(self) -> Any:
        """jax.sharding.PartitionSpec of this layout (partial sums cannot be expressed)."""
        from jax.sharding import PartitionSpec

        if self.partial:
            raise AutoParallelError("layout", str(self), "a partial-sum layout has no "
                                    "PartitionSpec; resolve the partial sum first")
        return PartitionSpec(*[axis_name(d) for d in self.dims])

    def __str__(self) -> str:
        parts = [f"S({i})[{','.join(d)}]" for i, d in enumerate(self.dims) if d]
        if self.partial:
            parts.append(f"P[{','.join(self.partial)}]")
        return "".join(parts) or "R"


def jax_mesh(mesh: DeviceMesh, devices: Sequence[Any] | None = None) -> Any:
    """The ``jax.sharding.Mesh`` of an abstract mesh: the first ``device_num`` devices (default
    ``jax.devices()``), row-major, with the mesh's axis names. Any axes will do, e.g. a
    pipeline's ``(("stage", p), *stage_mesh.axes)``.

    >>> jax_mesh(DeviceMesh.for_devices(4)).shape  # doctest: +SKIP
    OrderedDict([('a0', 2), ('a1', 2)])
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devs = list(jax.devices() if devices is None else devices)
    n = mesh.device_num
    if len(devs) < n:
        raise AutoParallelError(
            "device_num", n, f"only {len(devs)} JAX devices are available",
            "Lower device_num, or on CPU start with jax.config.update('jax_num_cpu_devices', "
            f"{n}) (or XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    shape = tuple(s for _, s in mesh.axes)
    return Mesh(np.array(devs[:n], dtype=object).reshape(shape), mesh.names)
