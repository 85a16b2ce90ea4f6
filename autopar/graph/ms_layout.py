"""MindSpore's user-facing ``Layout(device_matrix, alias_name)`` and its conversion to split counts.

As in MindSpore 2.x (``mindspore/parallel/shard.py``): a layout names the axes of a device
matrix; calling it with one alias (or a tuple of aliases, or ``"None"``) per tensor dimension
builds the tensor map, counted from the right (the last alias is 0). autopar's strategies are
split counts, so a layout becomes, per dimension, the product of the device-matrix sizes its
aliases name (``"None"``: 1). Which devices hold which block is then autopar's choice (the
search assigns mesh axes), not the alias order.

>>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
>>> layout("dp", "mp").to_dict()
{'device_matrix': (2, 2, 2), 'tensor_map': (2, 0), 'interleaved_parallel': False}
>>> layout(("dp", "mp"), "None").split_counts()
(4, 1)
"""

from __future__ import annotations

import math
from typing import Any

from autopar.errors import AutoParallelError, AutoParallelTypeError, found, safe_repr

__all__ = ["Layout", "to_strategy", "has_layout", "layout_devices", "INTERLEAVED"]

INTERLEAVED = "interleaved_parallel"
_NONE = "None"


class Layout:
    """A device matrix with one alias per axis; ``layout(*aliases)`` maps a tensor onto it."""

    def __init__(self, device_matrix: Any, alias_name: Any) -> None:
        if not isinstance(device_matrix, tuple):
            raise AutoParallelTypeError("device_matrix", device_matrix,
                                        "must be a tuple of ints, e.g. (2, 4)")
        if not isinstance(alias_name, tuple):
            raise AutoParallelTypeError("alias_name", alias_name,
                                        "must be a tuple of str, e.g. ('dp', 'mp')")
        if len(device_matrix) != len(alias_name):
            raise AutoParallelError("alias_name", alias_name, f"needs one name per axis of "
                                    f"device_matrix {device_matrix}")
        for i, d in enumerate(device_matrix):
            if not isinstance(d, int) or isinstance(d, bool):
                raise AutoParallelTypeError("device_matrix", device_matrix,
                                            f"axis sizes must be ints, {found(d, f'[{i}]')}")
            if d < 1:
                raise AutoParallelError("device_matrix", device_matrix,
                                        f"axis sizes must be >= 1, found {safe_repr(d)}")
        for i, a in enumerate(alias_name):
            if not isinstance(a, str):
                raise AutoParallelTypeError("alias_name", alias_name,
                                            f"names must be str, {found(a, f'[{i}]')}")
            if not a or a == _NONE:
                raise AutoParallelError("alias_name", alias_name, f"{a!r} cannot name an axis "
                                        "(empty, or 'None', which means no sharding)")
        if len(set(alias_name)) != len(alias_name):
            raise AutoParallelError("alias_name", alias_name, "each name must be different")
        if INTERLEAVED in alias_name and alias_name[-1] != INTERLEAVED:
            raise AutoParallelError("alias_name", alias_name, f"{INTERLEAVED!r} must be the "
                                    "last name (the virtual split inside one device)")
        self._device_matrix: tuple[int, ...] = device_matrix
        self._alias_name: tuple[str, ...] = alias_name
        self._tensor_map: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------ MindSpore's API
    def __call__(self, *tensor_map: Any) -> "Layout":
        """A copy with the tensor map of one alias (or tuple of aliases, or "None") per dim."""
        used: list[str] = []
        out = tuple(tuple(self._index(a, used) for a in e) if isinstance(e, tuple)
                    else self._index(e, used) for e in tensor_map)
        new = Layout(self._device_matrix, self._alias_name)
        new._tensor_map = out
        return new

    def _index(self, alias: Any, used: list[str]) -> int:
        if isinstance(alias, str) and alias == _NONE:  # (an array's == gives no truth)
            return -1
        if not isinstance(alias, str) or alias not in self._alias_name:
            raise AutoParallelError("alias", alias, f"not an axis of this layout; the names "
                                    f"are {self._alias_name} (or 'None': not split)")
        if alias in used:
            raise AutoParallelError("alias", alias, "an axis can shard a tensor only once "
                                    "(it is already used by another dimension)")
        used.append(alias)
        return len(self._alias_name) - 1 - self._alias_name.index(alias)

    def to_dict(self) -> dict[str, Any]:
        """``{"device_matrix", "tensor_map", "interleaved_parallel"}`` as MindSpore gives it."""
        if self._tensor_map is None:
            raise AutoParallelError("layout", self, "the tensor map is not set: call the "
                                    "layout with one alias per dimension, e.g. layout('dp', "
                                    "'None')")
        return {"device_matrix": self._device_matrix, "tensor_map": self._tensor_map,
                "interleaved_parallel": INTERLEAVED in self._alias_name}

    # ------------------------------------------------------------------ autopar's view
    @property
    def device_matrix(self) -> tuple[int, ...]:
        return self._device_matrix

    @property
    def alias_name(self) -> tuple[str, ...]:
        return self._alias_name

    @property
    def tensor_map(self) -> tuple[Any, ...] | None:
        return self._tensor_map

    @property
    def device_num(self) -> int:
        """The product of the device matrix (MindSpore: the devices of one pipeline stage)."""
        return math.prod(self._device_matrix)

    def split_counts(self) -> tuple[int, ...]:
        """One split count per tensor dimension: the product of the axes its aliases name."""
        d = self.to_dict()
        if d["interleaved_parallel"]:
            raise AutoParallelError("layout", self, f"{INTERLEAVED!r} (a virtual split inside "
                                    "one device) is not supported by autopar: its operators "
                                    "compute each device's block in one piece",
                                    f"Drop {INTERLEAVED!r} from alias_name")
        size = self._device_matrix[::-1]  # tensor-map index k names axis len-1-k

        def count(m: Any) -> int:
            return math.prod(size[k] for k in m if k >= 0) if isinstance(m, tuple) \
                else (size[m] if m >= 0 else 1)
        return tuple(count(m) for m in self._tensor_map)  # type: ignore[union-attr]

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Layout) and (self._device_matrix, self._alias_name,
                                              self._tensor_map) == \
            (other._device_matrix, other._alias_name, other._tensor_map)

    def __hash__(self) -> int:
        return hash((self._device_matrix, self._alias_name, self._tensor_map))

    def __repr__(self) -> str:
        tm = "" if self._tensor_map is None else f", tensor_map={self._tensor_map}"
        return f"Layout({self._device_matrix}, {self._alias_name}{tm})"


def has_layout(strategy: Any) -> bool:
    """Whether a strategy (a tuple with one entry per input) holds any :class:`Layout`."""
    return isinstance(strategy, (tuple, list)) and any(isinstance(e, Layout) for e in strategy)


def layout_devices(entries: Any, where: str) -> int | None:
    """The device count the :class:`Layout` entries among ``entries`` assume (their device
    matrices' product: one stage's devices, checked against device_num when a search knows
    it), or None when there are none. Layouts of one call must agree.

    >>> layout_devices((Layout((2, 4), ("dp", "mp"))("dp", "None"), (1, 4)), "matmul")
    8
    """
    counts = sorted({e.device_num for e in entries if isinstance(e, Layout)}) \
        if isinstance(entries, (tuple, list)) else []
    if len(counts) > 1:
        raise AutoParallelError(where, counts, "its Layouts' device matrices have different "
                                "device counts; every device matrix has the devices of the "
                                "stage (device_num)")
    return counts[0] if counts else None


def to_strategy(strategy: Any, where: str, device_num: int | None = None) -> Any:
    """A strategy whose entries may be Layouts -> split-count tuples (other entries as given).

    ``device_num``, when known, must equal each layout's device-matrix product, as MindSpore
    requires (the devices of one stage).

    >>> lay = Layout((2, 4), ("dp", "mp"))
    >>> to_strategy((lay("dp", "None"), lay("None", "mp")), "matmul", 8)
    ((2, 1), (1, 4))
    """
    if not has_layout(strategy):
        return strategy
    out = []
    for i, e in enumerate(strategy):
        if not isinstance(e, Layout):
            out.append(e)
            continue
        if device_num is not None and e.device_num != device_num:
            raise AutoParallelError(f"layout [{i}] of {where}", e, f"the device matrix "
                                    f"{e.device_matrix} has {e.device_num} devices; it must "
                                    f"have device_num={device_num}")
        out.append(e.split_counts())
    return tuple(out)
