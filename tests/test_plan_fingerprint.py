"""A plan's graph fingerprint is hashed only when read (issue #18): search does not pay for it,
and the string, equality and copies are as when it was hashed at search time."""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import autopar as ap
from autopar.models import mlp
from autopar.strategies.plan import Fingerprint


def _graph() -> ap.Graph:
    m = mlp(widths=(64, 256, 64), batch=64)
    shapes = jax.eval_shape(m.example_args, jax.random.key(0))
    return ap.trace(m.loss, *jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


@pytest.fixture(autouse=True)
def _auto():
    ap.set_auto_parallel_context(device_num=8, parallel_mode="auto_parallel")


@pytest.mark.parametrize("mode", ["recursive_programming", "dynamic_programming"])
def test_search_does_not_hash_and_reading_gives_the_graphs_fingerprint(mode):
    g = _graph()
    plan = ap.search(g, mode=mode)
    assert g._fingerprint is None            # not hashed by the search
    assert plan.searched_on(g) and g._fingerprint is None   # same object: no hashing either
    assert plan.fingerprint == g.fingerprint() == _graph().fingerprint()
    assert plan.searched_on(_graph())        # an equal graph (another object) is recognised


def test_equality_includes_the_fingerprint():
    g, h = _graph(), _graph()
    a, b = ap.search(g, mode="dynamic_programming"), ap.search(h, mode="dynamic_programming")
    assert a == dataclasses.replace(a)       # same graph object: equal without hashing
    b = dataclasses.replace(b, search_seconds=a.search_seconds)
    assert a == b                            # other objects, equal fingerprints
    other = dataclasses.replace(b, graph_fingerprint="0" * 32)
    assert other.fingerprint == "0" * 32 and other != b and not other.searched_on(h)


def test_copies_share_the_fingerprint_and_repr_shows_the_string():
    g = _graph()
    plan = ap.search(g, mode="dynamic_programming")
    assert copy.deepcopy(plan.graph_fingerprint) is plan.graph_fingerprint
    assert dataclasses.asdict(plan)["graph_fingerprint"] is plan.graph_fingerprint
    assert repr(plan.graph_fingerprint) == repr(g.fingerprint())
    f = Fingerprint("ab" * 16)
    assert f.value == "ab" * 16 and f == Fingerprint("ab" * 16) and hash(f) == hash("ab" * 16)
