"""A plan is a frozen value: no field and no mapping of it changes once it is made; a change is
a new plan (``dataclasses.replace``, ``Plan.with_notes``), and copies, pickles and JSON read it
as the plain dicts it held before."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import jax
import pytest

import autopar as ap
from autopar.models import mlp
from autopar.strategies.plan import Pricing, ReadOnlyDict


@pytest.fixture(scope="module")
def plan() -> ap.Plan:
    m = mlp(widths=(64, 256, 64), batch=64)
    g = ap.trace(m.loss, *jax.eval_shape(m.example_args, jax.random.key(0)))
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        return ap.search(g, cluster="accelerator-8x")


def test_a_plan_refuses_every_change(plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pricing.micro_batches = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.notes.append("x")  # type: ignore[attr-defined]
    for mapping in (plan.nodes, plan.layouts, plan.stages):
        assert isinstance(mapping, ReadOnlyDict)
        for change in (lambda d: d.__setitem__("x", 1), lambda d: d.update({"x": 1}),
                       lambda d: d.pop("x", None), lambda d: d.setdefault("x", 1),
                       lambda d: d.clear(), lambda d: d.popitem()):
            with pytest.raises(TypeError, match="read-only"):
                change(mapping)
        with pytest.raises(TypeError, match="read-only"):
            mapping |= {"x": 1}


def test_a_change_is_a_new_plan(plan):
    notes = plan.notes
    noted = plan.with_notes("a", "b")
    assert noted.notes == notes + ("a", "b") and plan.notes == notes
    staged = dataclasses.replace(plan, stages={name: 1 for name in plan.nodes})
    assert isinstance(staged.stages, ReadOnlyDict) and set(staged.stages.values()) == {1}
    assert plan.stages == {} and staged.decisions() == plan.decisions() and staged != plan
    listed = dataclasses.replace(plan, notes=["x"])  # a list given is made a tuple
    assert listed.notes == ("x",)


def test_a_plan_reads_copies_and_serialises_as_before(plan):
    assert plan.nodes == dict(plan.nodes) and repr(plan.layouts) == repr(dict(plan.layouts))
    assert copy.deepcopy(plan) == plan and copy.copy(plan) == plan
    unhashed = dataclasses.replace(plan, graph_fingerprint=plan.fingerprint)
    again = pickle.loads(pickle.dumps(unhashed))
    assert again == unhashed and isinstance(again.nodes, ReadOnlyDict)
    stages = dataclasses.replace(plan, stages={"b": 2, "a": 1}).stages
    assert json.dumps(stages) == '{"b": 2, "a": 1}'  # the order given, as a dict's
    assert dataclasses.asdict(plan)["stages"] == {}


def test_the_pricing_record_prices_the_plan_again(plan):
    assert isinstance(plan.pricing, Pricing)
    args = plan.pricing.problem_args()
    assert args["micro_batches"] == 1 and args["optimizer_state"] is None
    assert set(args) == {f.name for f in dataclasses.fields(Pricing)}
