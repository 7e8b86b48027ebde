"""`ComputeConfig.torch_compile` (issue 31): the generated forward / stage functions run through
torch.compile and training still matches one process (the parity harness, tests/parity.py).

CPU runs use the "aot_eager" backend: inductor works here (g++ is present) but its first compile of
even the small gpt takes about a minute on this machine's two cores, beyond the tests' budget; the
dynamo capture, the functionalised graph and the compiled autograd are the same for both backends
(benchmarks/compile_speed.py times inductor)."""

from __future__ import annotations

import json

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.runtime.module_parts.compiled import compile_options, compiled_methods
from tests.dist_util import spawn
from tests.parity import ParityCase, compare, train_parallel, train_reference

BACKEND = {"backend": "aot_eager"}
STEPS = 2
CASES = [
    ParityCase("gpt", "dp", 1, {"torch_compile": BACKEND}),
    ParityCase("gpt", "tp", 2, {"torch_compile": BACKEND}),
    ParityCase(
        "gpt",
        "pp",
        2,
        {"torch_compile": BACKEND, "use_end2end": True, "pas_config": {"pipeline_nmicros": 2}},
        nmicros=2,
    ),
    ParityCase("gpt", "dp", 1, {"torch_compile": BACKEND, "use_zero": True, "zero_stage": 2}),
]


def _dynamo_stats() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": int(sum(counters["graph_break"].values())),
    }


def _train_compiled(rank: int, world_size: int, cases: list[ParityCase], root: str) -> list[dict]:
    """Every case's `train_parallel`, with what dynamo compiled for it and the module's wrapped methods."""
    import torch._dynamo

    out = []
    for k, case in enumerate(cases):
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        result = train_parallel(
            rank,
            world_size,
            case.model_name,
            case.policy,
            case.plan_ngpus,
            STEPS,
            4,
            f"{root}/case{k}",
            config_kwargs=case.config_kwargs,
            nmicros=case.nmicros,
        )
        result["dynamo"] = _dynamo_stats()
        out.append(result)
    return out


def test_compiled_parity_dp_tp_pp_zero2(tmp_path):
    per_rank = spawn(_train_compiled, 2, tmp_path, CASES, str(tmp_path / "gen"), timeout=230)
    for k, case in enumerate(CASES):
        results = [r[k] for r in per_rank]
        for r in results:  # compiled whole: the collectives are traced, no graph break
            assert r["dynamo"]["graphs"] >= 1 and r["dynamo"]["breaks"] == 0, (case.label, r["dynamo"])
        ref_losses, ref_model = train_reference(
            case.model_name, 2 // case.plan_ngpus, STEPS, 4, nmicros=case.nmicros
        )
        compare(results, ref_losses, ref_model, rtol=1e-5, atol=1e-5, param_atol=5e-5, label=case.label)


def test_config_field_validated_and_round_trips(tmp_path):
    assert ComputeConfig(1, 1).torch_compile is False
    cfg = ComputeConfig(1, 1, torch_compile={"backend": "aot_eager", "dynamic": False})
    path = tmp_path / "cc.json"
    cfg.safe_dump_to_file(str(path))
    assert json.loads(path.read_text())["torch_compile"] == {"backend": "aot_eager", "dynamic": False}
    assert ComputeConfig.safe_load_from_file(str(path), return_none_on_error=False) == cfg
    for bad, words in [
        ("yes", "must be True, False or a dict"),
        ({"backnd": "inductor"}, r"unknown option\(s\) \['backnd'\]"),
        ({"backend": lambda gm, ex: gm}, r"\['backend'\] must be a backend's name"),
    ]:
        with pytest.raises(ConfigError, match=rf"ComputeConfig\.torch_compile.*{words}"):
            ComputeConfig(1, 1, torch_compile=bad)
    with pytest.raises(ConfigError, match=r"ComputeConfig\.torch_compile cannot be used with ZeRO stage 3"):
        ComputeConfig(1, 2, use_zero=True, zero_stage=3, torch_compile=True)


def test_compile_options_and_methods():
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {}
    assert compile_options({"disable": True, "backend": "eager"}) is None
    assert compile_options({"mode": "reduce-overhead", "disable": False}) == {"mode": "reduce-overhead"}

    class Gen(torch.nn.Module):
        def forward(self, x):
            return x

        def stage10(self, mb):
            return mb

        def stage2(self, mb):
            return mb

        def stages(self):  # not a stage method
            return None

    assert compiled_methods(Gen()) == ["forward", "stage2", "stage10"]
