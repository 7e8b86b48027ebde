"""Offline, the standard recipes split the traced batch as the search does: no recipe has more
data-parallel replicas than the batch has samples (a replica needs a whole sample; the search refuses
such plan sizes), so the report's best recipe is one that could run (issue 42: the 8B plan was
compared with DP x8 over a batch of 4)."""

from __future__ import annotations

from nnscaler.graph.capture import capture
from nnscaler.policies.autodist import load_cluster
from nnscaler.policies.autodist.offline import plan_offline
from nnscaler.policies.autodist.recipes import standard_recipes
from tests import zoo


def test_no_recipe_has_more_replicas_than_samples():
    model, make_batch = zoo.build_gpt()
    graph = capture(model, make_batch(0, 2), static_shapes=True, both_modes=False)
    result = plan_offline(graph, load_cluster("h100x8"), 8)
    assert result.setup.dp_size <= 2
    recipes = standard_recipes(graph, result.setup, 8, result.best.nmicros)
    names = [r.name for r in recipes]
    assert recipes and all(r.dp <= 2 for r in recipes), names
    assert not any(n.startswith("DP x8") for n in names), names
    assert any("DP2" in n for n in names), names  # the realisable ones stay
