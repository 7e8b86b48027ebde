"""`ComputeConfig.torch_compile` beyond the small gpt: the families where wrong results hid before.

Each case trains under torch.compile ("aot_eager", as tests/test_torch_compile.py: dynamo capture,
functionalisation and compiled autograd, without inductor's minute-long kernel generation) and is
compared with one-device training by the parity harness (tests/parity.py): every merged parameter
after SGD steps, the losses after AdamW. All cases run in one pair of processes, started once.

- LoRA over a tiny Llama (frozen base weights), dp over 2 replicas (SGD) and tp (AdamW);
- T5 (encoder-decoder, `_shift_right` writes into a slice) in 2 pipeline stages;
- writes into slices, scatter and index_put (tests/models_writes.py) split on their last dims;
- a mixture of experts under expert parallelism: its dispatch (split sizes read from the routing)
  runs eagerly by design, and those calls are the only graph breaks;
- a torch.library custom op and a register_op function (tests/user_ops.py) under tp;
- gpt with its blocks recomputed (torch.utils.checkpoint regions of layer functions) under tp;
- gpt with attention dropout on head shards and recomputed blocks: the regions replaying the shard
  generator run eagerly (rng.checkpoint) and training is bit-identical to the eager parallel run;
- an opaque leaf module (data-dependent code) called eagerly from the compiled forward (one process).

Mamba also matches (tp 2, one graph, no break) but its trace takes ~50 s here, beyond this file's
budget; tests/test_families_parity.py covers it eagerly.
"""

from __future__ import annotations

import inspect
import sys
import time

import pytest
import torch

from tests.dist_util import spawn
from tests.parity import ADAMW_PARAM_ATOL, OPTIMIZERS, ParityCase, compare, train_parallel, train_reference

COMPILE = {"torch_compile": {"backend": "aot_eager"}}
PIPE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}
STEPS = 2
LORA = "tests.zoo_finetune:build_lora_llama"
MOE_DISPATCH = "expert_parallel_experts"
"""The function named by the only graph breaks the expert-parallel case may have."""

CASES = [
    ParityCase(LORA, "dp", 1, COMPILE, optimizer="sgd"),
    ParityCase(LORA, "tp", 2, COMPILE),
    ParityCase("tests.zoo_families:build_t5", "pp", 2, {**COMPILE, **PIPE}, nmicros=2, optimizer="sgd"),
    ParityCase(
        "tests.models_writes:build_writes", "tests.models_writes.pas_last", 2, COMPILE, optimizer="sgd"
    ),
    ParityCase(
        "tests.models_moe:build_hand", "tp", 2, {**COMPILE, "pas_config": {"ep_size": 2}}, optimizer="sgd"
    ),
    ParityCase("userops", "tp", 2, COMPILE, optimizer="sgd"),
    ParityCase("gpt", "tp", 2, {**COMPILE, "pas_config": {"recompute_modules": "Block"}}, optimizer="sgd"),
]


def _dynamo_stats() -> dict:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": {
            reason.split("\n")[0] + " " + _debug_context(reason): n
            for reason, n in counters["graph_break"].items()
        },
    }


def _debug_context(reason: str) -> str:
    marker = "Developer debug context:"
    return reason.split(marker, 1)[1].strip().split("\n")[0] if marker in reason else ""


def _reset_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _dropout_run(gen_savedir: str, compiled: bool) -> dict:
    """gpt (attention dropout 0.3, blocks recomputed) under tp 2: three forward / backward passes."""
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import rng
    from tests.test_dropout_tp import _gpt_with_attention_dropout

    _reset_dynamo()
    model, batch = _gpt_with_attention_dropout()
    extra = COMPILE if compiled else {}
    cfg = ComputeConfig(2, 2, pas_config={"recompute_modules": "Block"}, **extra)
    pm = parallelize(model, batch, "tp", cfg, gen_savedir=gen_savedir)
    rng._GENERATORS.clear()  # both runs start the shard streams from the seed
    torch.manual_seed(99)
    losses = []
    for _ in range(3):
        loss = pm(**batch)
        loss.backward()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": {n: p.grad.clone() for n, p in pm.named_parameters()},
        "code": inspect.getsource(sys.modules[type(pm).__module__]),
        "dynamo": _dynamo_stats(),
    }


def _train_all(rank: int, world_size: int, root: str) -> dict:
    """Every parity case (with what dynamo compiled for it), then the dropout runs, eager and compiled."""
    parity = []
    for k, case in enumerate(CASES):
        _reset_dynamo()
        start = time.perf_counter()
        try:
            result = train_parallel(
                rank, world_size, case.model_name, case.policy, case.plan_ngpus, STEPS, 4, f"{root}/case{k}",
                optimizer=case.optimizer, config_kwargs=case.config_kwargs, nmicros=case.nmicros,
            )  # fmt: skip
        except Exception as exc:
            raise RuntimeError(f"compiled case {case.label} failed on rank {rank}: {exc}") from exc
        result["dynamo"], result["seconds"] = _dynamo_stats(), time.perf_counter() - start
        parity.append(result)
    start = time.perf_counter()
    dropout = {c: _dropout_run(f"{root}/dropout_{c}", c) for c in (False, True)}
    return {"parity": parity, "dropout": dropout, "dropout_seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("compile_families")
    return spawn(_train_all, 2, tmp, str(tmp / "gen"), timeout=280)


@pytest.mark.parametrize("k", range(len(CASES)), ids=[c.label.split(" {")[0] for c in CASES])
def test_compiled_family_matches_one_device(per_rank, k):
    case = CASES[k]
    results = [r["parity"][k] for r in per_rank]
    for r in results:
        stats = r["dynamo"]
        assert stats["graphs"] >= 1, (case.label, stats)  # the forward was compiled
        if "ep_size" in str(case.config_kwargs):
            # the dispatch runs eagerly (torch.compiler.disable): it is the only break
            assert stats["breaks"] and all(MOE_DISPATCH in b for b in stats["breaks"]), (case.label, stats)
        else:
            assert not stats["breaks"], (case.label, stats)
        assert not r["frozen_with_grad"], (case.label, r["frozen_with_grad"])
    ref_losses, ref_model = train_reference(
        case.model_name, 2 // case.plan_ngpus, STEPS, 4, case.optimizer, nmicros=case.nmicros
    )
    atol = OPTIMIZERS[case.optimizer][2]
    param_atol = max(atol, ADAMW_PARAM_ATOL) if case.optimizer == "adamw" else atol
    compare(results, ref_losses, ref_model, rtol=1e-5, atol=atol, label=case.label, param_atol=param_atol)


def test_lora_compiled_trains_only_the_adapters(per_rank):
    """The frozen base weights are neither reduced nor given optimizer state under compile."""
    for r in per_rank[0]["parity"][0], per_rank[1]["parity"][0]:
        assert r["frozen"] and all("lora_" not in n for n in r["frozen"]), r["frozen"]
        assert set(r["frozen"]).isdisjoint(r["reduced"]) and set(r["frozen"]).isdisjoint(r["optimizer_names"])


def test_recomputed_shard_dropout_is_eager_and_identical(per_rank):
    """Checkpoint regions drawing shard random numbers go through rng.checkpoint, which dynamo
    leaves eager (its checkpoint takes no custom context_fn): same masks, losses and gradients."""
    for r in per_rank:
        eager, compiled = r["dropout"][False], r["dropout"][True]
        assert (
            "rng.checkpoint(" in compiled["code"] and "context_fn=rng.recompute_contexts(" in compiled["code"]
        )
        assert eager["dynamo"]["graphs"] == 0 and compiled["dynamo"]["graphs"] >= 1, compiled["dynamo"]
        assert any("checkpoint" in b for b in compiled["dynamo"]["breaks"]), compiled["dynamo"]
        assert compiled["losses"] == eager["losses"] and len(set(eager["losses"])) == 3
        for name, grad in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][name], grad, rtol=0, atol=0, msg=name)
    assert per_rank[0]["dropout"][True]["losses"] == per_rank[1]["dropout"][True]["losses"]


def test_leaf_module_runs_eagerly_inside_the_compiled_forward(tmp_path):
    """An opaque leaf module (data-dependent: it loops over `sizes.tolist()`) is called eagerly from
    the compiled forward, one graph break per call, whatever the sizes; training matches eager PyTorch."""
    import copy
    import warnings

    import nnscaler
    from nnscaler import ComputeConfig
    from tests.test_leaf_modules import Net, _batch

    _reset_dynamo()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    cfg = ComputeConfig(1, 1, pas_config={"leaf_modules": "pool"}, **COMPILE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = nnscaler.parallelize(model, _batch(0), "dp", cfg, gen_savedir=tmp_path)
    names = pm.dist_param_map
    for seed, rows, sizes in [(1, 9, (5, 4)), (2, 7, (3, 4)), (3, 7, (6, 1)), (4, 11, (2, 9))]:
        batch = _batch(seed, rows=rows, sizes=sizes)
        loss, ref = pm(**batch), reference(**batch)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=0, atol=0)
        for local, p in pm.named_parameters():
            torch.testing.assert_close(p.grad, reference.get_parameter(names[local]).grad, msg=names[local])
    stats = _dynamo_stats()
    assert stats["graphs"] >= 1 and stats["breaks"], stats
    assert all("disable()" in b and "<function call at" in b for b in stats["breaks"]), stats
