"""The default search's bound on its exact core (issue 38, item 4).

RoPE's slice -> mul / sub -> concatenate diamonds, whose sin / cos tables every block reads,
leave dynamic_programming a core its elimination cannot reduce, and that core grows with
depth (a Llama-2 block at 32 layers / 64 devices took 675 s in the integer program). Past
``CORE_COLUMNS`` the mode starts from recursive_programming's cuts, polishes them the same way
and says so in the plan's notes; below it the core is solved exactly, as before.
"""

from __future__ import annotations

import time

import pytest

from autopar.strategies import dynamic_programming, search
from autopar.strategies.cost import CLUSTERS, CostModel
from autopar.strategies.layout import DeviceMesh
from autopar.strategies.modes import CORE_FALLBACK_NOTE
from benchmarks.llama_rope import trace_llama

_NOTE = CORE_FALLBACK_NOTE.split("(")[0]
_SETTINGS = search.SearchSettings(hand_plan_margin=0.0)  # the search's own plan, compared


@pytest.fixture(scope="module")
def rope():
    return trace_llama(layers=2, hidden=64, heads=2, seq=16, ffn=128, vocab=64, batch=4)


def _plan(graph, mode: str, devices: int = 8):
    return search.search_plan(graph, mode=mode, device_num=devices,
                              cluster=CLUSTERS["accelerator-8x"], settings=_SETTINGS)


def test_rope_leaves_a_core(rope):
    problem = search._problem(rope, DeviceMesh.for_devices(8),
                              CostModel(CLUSTERS["accelerator-8x"]), {}, _SETTINGS, 0.0,
                              lazy=False)
    assert dynamic_programming.core_columns(problem) > 0  # not series-parallel


def test_fallback_is_noted_and_no_dearer_than_recursive_programming(rope, monkeypatch):
    monkeypatch.setattr(dynamic_programming, "CORE_COLUMNS", 0)  # every core over the bound
    t0 = time.perf_counter()
    plan = _plan(rope, "dynamic_programming")
    assert time.perf_counter() - t0 < 20
    assert any(n.startswith(_NOTE) for n in plan.notes)
    rp = _plan(rope, "recursive_programming")
    assert plan.objective <= rp.objective * (1 + 1e-9)


def test_exact_core_under_the_bound(rope):
    plan = _plan(rope, "dynamic_programming")
    assert not any(n.startswith(_NOTE) for n in plan.notes)
    rp = _plan(rope, "recursive_programming")
    assert plan.objective <= rp.objective * (1 + 1e-9)


def test_fallback_within_one_percent_of_exact(monkeypatch):
    tiny = trace_llama(layers=1, hidden=64, heads=2, seq=16, ffn=128, vocab=64, batch=4)
    best = _plan(tiny, "exact").objective
    monkeypatch.setattr(dynamic_programming, "CORE_COLUMNS", 0)
    plan = _plan(tiny, "dynamic_programming")
    assert any(n.startswith(_NOTE) for n in plan.notes)
    assert plan.objective <= best * 1.01  # measured: equal
