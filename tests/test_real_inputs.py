"""Real inputs (issue 9): shapes other than the traced one, aliased dummy inputs, tensors made in
forward. Each module is compiled once from the parity harness's dummy batch (4 samples, full length)
and then trained on the other shapes, against the single-device model on the same batches."""

from __future__ import annotations

import re

import pytest
import torch

from tests.dist_util import spawn
from tests.parity import run_parity

PP = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}

CASES = {
    # id: (model, policy, plan_ngpus, runtime_ngpus, optimizer, config, per-step (batch, sequence length))
    # shapes: none is the traced (4, full); batch 1 and odd sizes included
    "gpt-dp-shapes": ("gpt", "dp", 1, 2, "sgd", {}, [(2, 16), (3, 7), (1, 12), (5, 4)]),
    "llama-aliased-tp-shapes": (
        "tests.models_inputs:build_llama_aliased",
        "tp",
        2,
        2,
        "sgd",
        {},
        [(2, 8), (3, 13), (1, 16), (4, 5)],
    ),
    "gpt-pp-shapes": ("gpt", "pp", 2, 2, "sgd", PP, [(2, 9), (6, 16), (4, 3)]),
    "llama-aliased-dp": ("tests.models_inputs:build_llama_aliased", "dp", 1, 2, "adamw", {}, None),
    "llama-aliased-pp": ("tests.models_inputs:build_llama_aliased", "pp", 2, 2, "sgd", PP, None),
    # forward(x, y): the stage methods' micro-batch dict must not be shadowed by an input named x
    "xy-pp-shapes": ("tests.models_inputs:build_xy_blocks", "pp", 2, 2, "sgd", PP, [(2, 5), (6, 12)]),
    # ALiBi slopes and a loss weight made with torch.tensor in forward
    "alibi-dp-shapes": ("tests.models_inputs:build_alibi", "dp", 1, 2, "sgd", {}, [(3, 5), (1, 12), (2, 7)]),
    "alibi-tp-shapes": ("tests.models_inputs:build_alibi", "tp", 2, 2, "sgd", {}, [(3, 5), (1, 12), (2, 7)]),
    "alibi-hybrid": ("tests.models_inputs:build_alibi", "hybrid", 2, 2, "sgd", PP, [(2, 12), (4, 6)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_real_inputs_parity(case, tmp_path):
    model, policy, plan, runtime, optimizer, config, shapes = CASES[case]
    nmicros = config.get("pas_config", {}).get("pipeline_nmicros") if config.get("use_end2end") else None
    config = dict(config)
    if policy == "hybrid":
        config["pas_config"] = {**config["pas_config"], "pipeline_nstages": 2}
    run_parity(
        model,
        policy,
        plan,
        runtime,
        steps=2,
        tmp_path=tmp_path,
        optimizer=optimizer,
        atol=1e-6 if optimizer == "sgd" else 1e-5,
        config_kwargs=config,
        nmicros=nmicros,
        shapes=shapes,
    )


# ---- clear errors for shapes a plan cannot take -----------------------------------------------------


def _errors_rank(rank: int, world_size: int, gen_savedir: str) -> dict[str, str]:
    import nnscaler
    from tests import zoo

    nnscaler.init()
    model, make_batch = zoo.build("gpt")
    out = {}

    def message(pm, batch) -> str:
        try:
            pm(**batch)
        except ValueError as e:
            return str(e)
        return "no error"

    # the `data` policy splits the batch over the 2 ranks of the plan: the batch must divide by 2
    pm = nnscaler.parallelize(
        model,
        make_batch(1, 4),
        "data",
        nnscaler.ComputeConfig(2, 2),
        gen_savedir=gen_savedir,
        instance_name="data",
    )
    ok = make_batch(2, 6)
    out["data_ok"] = float(pm(**ok).detach()) - float(model(**ok).detach())
    out["data_odd"] = message(pm, make_batch(2, 3))
    # constant_folding=True fixes every input size
    pm = nnscaler.parallelize(
        model,
        make_batch(1, 4),
        "tp",
        nnscaler.ComputeConfig(2, 2, constant_folding=True),
        gen_savedir=gen_savedir,
        instance_name="folded",
    )
    out["folded_same"] = float(pm(**make_batch(3, 4)).detach()) - float(model(**make_batch(3, 4)).detach())
    out["folded_other"] = message(pm, make_batch(2, 2))
    # longer than the model's position table: export found `idx_size1 <= 32`
    long = {k: torch.cat([v, v, v], dim=1) for k, v in make_batch(4, 2).items()}
    pm = nnscaler.parallelize(
        model,
        make_batch(1, 4),
        "tp",
        nnscaler.ComputeConfig(2, 2),
        gen_savedir=gen_savedir,
        instance_name="tp",
    )
    out["too_long"] = message(pm, long)
    # pipelines: the micro-batches of one train_step must share a shape
    pm = nnscaler.parallelize(
        model,
        make_batch(1, 4),
        "pp",
        nnscaler.ComputeConfig(2, 2, use_end2end=True, pas_config={"pipeline_nmicros": 2}),
        gen_savedir=gen_savedir,
        instance_name="pp",
    )
    short = {k: v[:, :8] for k, v in make_batch(5, 2).items()}
    try:
        pm.train_step([make_batch(5, 2), short])
        out["pp_mixed"] = "no error"
    except ValueError as e:
        out["pp_mixed"] = str(e)
    return out


def test_shape_errors(tmp_path):
    results = spawn(_errors_rank, 2, tmp_path, str(tmp_path / "gen"))
    for r in results:
        assert abs(r["data_ok"]) < 1e-5 and abs(r["folded_same"]) < 1e-5
        # names the argument, its shape and the rule
        assert re.search(r"idx has shape \[3, 16\].*`idx_size0 % 2 == 0`", r["data_odd"]), r["data_odd"]
        assert "idx has shape [2, 16], but dim 0 must be 4" in r["folded_other"], r["folded_other"]
        assert "constant_folding=True" in r["folded_other"]
        assert "idx has shape [2, 48]" in r["too_long"] and "idx_size1 <= 32" in r["too_long"], r["too_long"]
        assert "micro-batch 1 has idx of shape [2, 8]" in r["pp_mixed"], r["pp_mixed"]


# ---- single process: constants stay out of checkpoints, views of one tensor stay two inputs ----------


def test_forward_constants_are_nonpersistent_buffers(tmp_path):
    import nnscaler
    from tests import zoo

    model, make_batch = zoo.build("tests.models_inputs:build_alibi")
    pm = nnscaler.parallelize(
        model, make_batch(1, 4), "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=tmp_path
    )
    constants = {n: b for n, b in pm.named_buffers() if "lifted_tensor" in n}
    assert len(constants) == 3, sorted(dict(pm.named_buffers()))
    slopes = constants["blocks_0_attn_lifted_tensor_0"]
    torch.testing.assert_close(slopes, torch.tensor([2.0 ** (-8.0 * (h + 1) / 4) for h in range(4)]))
    assert not [k for k in pm.state_dict() if "lifted_tensor" in k]
    saved = {k for k in pm.state_dict() if not k.endswith("_extra_state")}
    assert saved and saved <= set(model.state_dict()), saved - set(model.state_dict())
    batch = make_batch(2, 3)
    torch.testing.assert_close(pm(**batch), model(**batch))


def test_views_of_one_tensor_are_two_inputs(tmp_path):
    """The dummy's idx and targets are views of one token tensor; later calls pass unrelated tensors."""
    import nnscaler
    from tests import zoo

    model, _ = zoo.build("gpt")
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    dummy = {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
    pm = nnscaler.parallelize(model, dummy, "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=tmp_path)
    g = torch.Generator().manual_seed(1)
    batch = {
        "idx": torch.randint(0, 128, (3, 10), generator=g),
        "targets": torch.randint(0, 128, (3, 10), generator=g),
    }
    torch.testing.assert_close(pm(**batch), model(**batch))
    swapped = {"idx": batch["targets"], "targets": batch["idx"]}
    torch.testing.assert_close(pm(**swapped), model(**swapped))
