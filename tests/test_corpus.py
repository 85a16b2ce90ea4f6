"""Library code through the search: models of the real-model corpus (benchmarks/corpus.py,
flax.linen, flax.nnx, equinox) trace, and the plan a search returns is never priced dearer
than autopar's data-parallel plan (its own parallel mode, built apart from the search) nor
than any hand plan it weighs."""

from __future__ import annotations

import pytest

import autopar as ap
from autopar.planner import ranked_candidates
from benchmarks.corpus import CORPUS

# one model per library the dev extra installs (keras-hub, with TensorFlow, is the
# benchmark's: python -m benchmarks models)
MODELS = ("linen_decoder", "nnx_mlp", "eqx_decoder")


@pytest.mark.parametrize("name", MODELS)
def test_library_code_is_never_priced_dearer_than_the_hand_plans(name):
    model = CORPUS[name]()
    graph = ap.trace(model.loss, model.params, *model.batch)
    with ap.auto_parallel_context(device_num=8, parallel_mode="data_parallel"):
        dp = ap.search(graph, cluster="cpu-emulated")
    with ap.auto_parallel_context(device_num=8, parallel_mode="auto_parallel"):
        plan = ap.search(graph, cluster="cpu-emulated")
        ranked = ranked_candidates(graph, ap.resolve_context().config, cluster="cpu-emulated")
    assert plan.cost.total <= dp.cost.total * (1 + 1e-9), (plan.cost.total, dp.cost.total)
    names = [n for n, _ in ranked]
    assert "data_parallel" in names and "dynamic_programming" in names
    assert plan.objective == min(p.objective for _, p in ranked)
    if name.endswith("decoder"):  # attention and MLP matmuls: Megatron's layout is weighed
        assert "megatron tp8" in names
