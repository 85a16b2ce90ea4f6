"""Random layouts for the redistribution property tests (hypothesis)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from autopar.strategies.layout import DeviceMesh, TensorLayout


def draw_layout(draw: Any, mesh: DeviceMesh, rank: int,
                partial_from: tuple[str, ...] | None = None) -> TensorLayout:
    """Any of the mesh's axes on any of ``rank`` dims, in any order, or left out, or (only
    axes of ``partial_from``; None: any axis) a pending partial sum."""
    dims: list[list[str]] = [[] for _ in range(rank)]
    partial = []
    for a in draw(st.permutations(mesh.names)):
        keep = partial_from is None or a in partial_from
        where = draw(st.integers(-2 if keep else -1, rank - 1))
        if where >= 0:
            dims[where].append(a)
        elif where == -2:
            partial.append(a)
    return TensorLayout(tuple(tuple(d) for d in dims), tuple(partial))
