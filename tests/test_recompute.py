"""Activation recompute: pas_config recompute_modules turns modules into torch.utils.checkpoint
regions in the generated code; training is exactly the same as without."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.codegen import generate_code
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from tests import zoo
from tests.parity import run_parity


def _code(name, policy, cfg):
    model, make_batch = zoo.build(name)
    graph = capture(model, make_batch(0, 4))
    plan = make_plan(graph, policy, cfg)
    shapes = {k: v.meta.shape for k, v in graph.values.items() if v.meta is not None}
    return plan, generate_code(apply_plan(graph, plan), 0, cfg, graph.module_class, policy, shapes, "test")


def test_recompute_modules_by_class_become_checkpoint_regions():
    plan, code = _code("gpt", "tp", ComputeConfig(2, 2, pas_config={"recompute_modules": "Block"}))
    assert plan.recompute == ("transformer.h.0", "transformer.h.1")
    # both blocks share a layer function: each call of it is checkpointed
    assert code.count('ckpt.checkpoint(self._layer_Block, _LayerParams(self, "transformer_h_') == 2
    assert "def _layer_Block(" in code


def test_unknown_recompute_module_is_an_error():
    with pytest.raises(PlanError, match="recompute_modules entry 'NoSuchBlock' matches no module"):
        _code("gpt", "dp", ComputeConfig(1, 1, pas_config={"recompute_modules": "NoSuchBlock"}))


@pytest.mark.parametrize(
    "model,policy,plan_ngpus,runtime_ngpus,modules",
    [
        ("gpt", "tp", 2, 2, "Block"),
        ("llama", "dp", 1, 2, "LlamaDecoderLayer"),
    ],
)
def test_recompute_parity(model, policy, plan_ngpus, runtime_ngpus, modules, tmp_path):
    run_parity(
        model,
        policy,
        plan_ngpus,
        runtime_ngpus,
        tmp_path=tmp_path,
        config_kwargs={"pas_config": {"recompute_modules": modules}},
    )
