"""Frozen parameters stay frozen (fine-tuning, LoRA through peft).

A parameter with `requires_grad=False` when the model is parallelized keeps it through capture, the
IR's JSON form, partition and codegen; at run time it gets no gradient, no reducer bucket and no
optimizer state, under data / tensor / pipeline parallelism, ZeRO 1/2/3 and mixed precision, and it
is saved, merged and loaded like any other parameter. Models: tests/zoo_finetune.py.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from nnscaler.graph.capture import capture
from nnscaler.graph.ir import graph_from_json, graph_to_json
from tests import zoo
from tests.dist_util import spawn
from tests.parity import DUMMY_SEED, SEED, ParityCase, run_parity_many
from tests.zoo_finetune import FINETUNE_MODELS, frozen_names

GPT_POS = FINETUNE_MODELS["gpt_frozen_pos"]
GPT_EMB = FINETUNE_MODELS["gpt_frozen_embeddings"]
LORA = FINETUNE_MODELS["lora_llama"]
LORA_LAST = FINETUNE_MODELS["lora_llama_last_layer"]

SGD = {"optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.9}}  # momentum: SGD keeps state too
PIPE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}
CASES = [
    # (a) a frozen position table (and a frozen parameter forward never reads)
    ParityCase(GPT_POS, "dp", 1, **SGD),
    ParityCase(GPT_POS, "tp", 2, **SGD),
    # a frozen embedding tied to the LM head: ZeRO-3 and pipeline stages holding it both
    ParityCase(GPT_EMB, "dp", 1, {"use_zero": True, "zero_stage": 3}, **SGD),
    ParityCase(GPT_EMB, "pp", 2, PIPE, nmicros=2, **SGD),
    ParityCase(GPT_EMB, "tp", 2, **SGD),
    ParityCase(GPT_EMB, "autodist", 2, **SGD),
    # (b) LoRA through peft: every base weight frozen
    ParityCase(LORA, "dp", 1, **SGD),
    ParityCase(LORA, "tp", 2, **SGD),
    ParityCase(LORA, "pp", 2, PIPE, nmicros=2, **SGD),
    ParityCase(LORA, "autodist", 2, **SGD),
    ParityCase(LORA, "dp", 1, {"use_zero": True}),  # AdamW
    ParityCase(LORA, "dp", 1, {"use_zero": True, "zero_stage": 2}, **SGD),
    ParityCase(
        LORA,
        "dp",
        1,
        {"use_zero": True, "reduce_grads_in_fp32": True},
        optimizer="mp_adamw",
        module_dtype=torch.bfloat16,
    ),
    # a first pipeline stage without one trainable parameter
    ParityCase(LORA_LAST, "pp", 2, PIPE, nmicros=2, **SGD),
]


def _initial(case: ParityCase) -> tuple[dict[str, torch.Tensor], set[str], set[str]]:
    """The model's initial state (cast as the case casts it), its frozen and its trainable names."""
    model, _ = zoo.build(case.model_name, seed=SEED)
    if case.module_dtype is not None:
        model = model.to(case.module_dtype)
    frozen = set(frozen_names(model))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, frozen, trainable


def _check_frozen(case: ParityCase, results: list[dict[str, Any]]) -> None:
    initial, frozen, trainable = _initial(case)
    label = case.label
    assert frozen and trainable, f"{label}: the model should have frozen and trainable parameters"
    union = lambda key: {n for r in results for n in r[key]}  # noqa: E731 - over the ranks
    assert union("frozen") == frozen, f"{label}: registered frozen {union('frozen')} != {frozen}"
    for r in results:
        assert not r["frozen_with_grad"], (
            f"{label}: rank {r['rank']}: frozen {r['frozen_with_grad']} got grads"
        )
        assert not set(r["reduced"]) & frozen, f"{label}: rank {r['rank']} reduces frozen {r['reduced']}"
        assert set(r["optimizer_names"]) <= trainable, f"{label}: rank {r['rank']}: {r['optimizer_names']}"
    assert union("optimizer_names") == trainable, f"{label}: the optimizer misses trainable parameters"
    assert union("optimizer_state_names") == trainable, (
        f"{label}: optimizer state for {union('optimizer_state_names')}"
    )
    if case.plan_ngpus == 1 and not case.nmicros:  # data parallel: every rank reduces its trainable ones
        assert all(set(r["reduced"]) == trainable for r in results), f"{label}: reducer buckets"
    merged = next(r["merged"] for r in results if r["rank"] == 0)
    changed = [n for n in frozen if not torch.equal(merged[n], initial[n])]
    assert not changed, f"{label}: frozen parameters changed: {changed}"
    moved = [n for n in trainable if not torch.equal(merged[n], initial[n])]
    assert moved, f"{label}: no trainable parameter moved"


def test_frozen_parameters_parity(tmp_path):
    """Every case against the single-device model (losses and every parameter after SGD / AdamW
    steps), on one pair of processes; frozen parameters bit-identical to their initial values, no
    gradient, no reducer bucket, optimizer state for the trainable ones only."""
    results = run_parity_many(CASES, 2, tmp_path=tmp_path, steps=2)
    for case, case_results in zip(CASES, results):
        _check_frozen(case, case_results)
        if case.policy == "tp":  # the frozen weights are split like trainable ones
            fractions = [r["local_param_fraction"] for r in case_results]
            assert max(fractions) < 0.9, f"{case.label}: weights not split, {fractions}"


def test_capture_keeps_requires_grad_through_json():
    """The captured graph carries each parameter's own requires_grad, also after a JSON round trip;
    values computed from frozen weights and inputs alone need no gradient."""
    model, make_batch = zoo.build(LORA, seed=SEED)
    graph = capture(model, make_batch(DUMMY_SEED, 2), both_modes=False)
    params = dict(model.named_parameters())
    for g in (graph, graph_from_json(graph_to_json(graph))):
        kept = {v.target: v.meta.requires_grad for v in g.values.values() if v.kind == "param"}
        assert kept == {n: p.requires_grad for n, p in params.items()}
        needs = {n.name: g.values[n.outputs[0]].meta.requires_grad for n in g.nodes if n.outputs}
        ops = [n for n in g.nodes if n.outputs and g.values[n.outputs[0]].meta is not None]
        embedding = next(n for n in ops if n.op.startswith("aten.embedding"))
        assert not needs[embedding.name]  # a frozen table and integer ids
        base_q, lora_a = [n for n in ops if n.op.startswith("aten.linear")][:2]  # frozen q_proj, lora_A
        assert not needs[base_q.name] and needs[lora_a.name]
        assert g.values[g.outputs[0].name].meta.requires_grad  # the loss: the adapters train


# ---------------------------------------------------------------------------------------------------
# checkpoints: saved under one plan, merged, loaded under another
# ---------------------------------------------------------------------------------------------------
def _cpu(value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v, value
    )


def _merged(pm, opt) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's state dicts, merged (on every rank)."""
    import torch.distributed as dist

    from nnscaler import merge_state_dicts

    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, (_cpu(pm.state_dict()), _cpu(opt.state_dict())))
    return merge_state_dicts([s for s, _ in states], [o for _, o in states])


def _train_save_load(rank: int, world: int, root: str) -> dict[str, Any]:
    import nnscaler
    from nnscaler import ComputeConfig, build_optimizer, load_merged_state_dict, parallelize

    nnscaler.init()
    model, make_batch = zoo.build(LORA, seed=SEED)
    pm = parallelize(model, make_batch(DUMMY_SEED, 4), "tp", ComputeConfig(2, 2), gen_savedir=f"{root}/tp")
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    frozen = {pm.dist_param_map[n] for n, p in pm.named_parameters() if not p.requires_grad}
    gnorm_names = {n for info in pm.parameters_for_calc_gnorm() for n in info.param_names}
    norms = []
    for step in range(2):
        zoo.extract_loss(pm(**make_batch(step, 4))).backward()
        norms.append(float(opt.clip_gnorm(1.0)))
        opt.step()
        opt.zero_grad()
    saved, saved_opt = _merged(pm, opt)

    # another plan, another seed: everything, frozen weights included, must come from the checkpoint
    other, _ = zoo.build(LORA, seed=SEED + 1)
    cfg = ComputeConfig(1, 2, use_zero=True)
    pm2 = parallelize(other, make_batch(DUMMY_SEED, 4), "dp", cfg, gen_savedir=f"{root}/dp")
    opt2 = build_optimizer(pm2, torch.optim.AdamW, lr=1e-2)
    load_merged_state_dict(pm2, saved, opt2, saved_opt)
    loaded, loaded_opt = _merged(pm2, opt2)
    return {
        "frozen": frozen,
        "gnorm_names": {pm.dist_param_map.get(n, n) for n in gnorm_names},
        "norms": norms,
        "saved": saved,
        "saved_opt": saved_opt,
        "loaded": loaded,
        "loaded_opt": loaded_opt,
    }


def test_checkpoint_keeps_frozen_parameters_across_plans(tmp_path):
    """Merged state dicts hold the frozen parameters (values) and optimizer state for the trainable
    ones only; loaded under another plan (ZeRO) they come back exactly; the gradient norm counts the
    trainable parameters only."""
    results = spawn(_train_save_load, 2, tmp_path, str(tmp_path / "gen"))
    model, make_batch = zoo.build(LORA, seed=SEED)
    frozen, trainable = set(frozen_names(model)), {n for n, p in model.named_parameters() if p.requires_grad}
    initial = model.state_dict()
    # the single-device norms of the same two clipped steps
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_norms = []
    for step in range(2):
        zoo.extract_loss(model(**make_batch(step, 4))).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    r = results[0]
    assert set().union(*(x["frozen"] for x in results)) == frozen
    assert r["gnorm_names"] <= trainable, f"the gradient norm counts {r['gnorm_names'] - trainable}"
    torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
    saved, saved_opt, loaded, loaded_opt = r["saved"], r["saved_opt"], r["loaded"], r["loaded_opt"]
    assert all(torch.equal(saved[n], initial[n]) for n in frozen)
    names = saved_opt["param_groups"][0]["param_names"]
    assert set(names) == trainable and len(saved_opt["state"]) == len(trainable)
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert loaded_opt["param_groups"][0]["param_names"] == names
    for i, state in saved_opt["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(loaded_opt["state"][i][key], value, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# the trainer: resume and merged checkpoints of a fine-tune
# ---------------------------------------------------------------------------------------------------
def _trainer_run(rank: int, world: int, argv: list[str]) -> list[float]:
    from nnscaler.cli import Trainer

    trainer = Trainer(argv)
    trainer.run()
    return trainer.losses


def test_trainer_resume_keeps_frozen_parameters(tmp_path):
    """A frozen position table under the trainer (data parallel, ZeRO, deduped checkpoints, clipped
    AdamW): resuming gives bitwise the same losses, and the merged checkpoints keep the frozen table
    unchanged between steps 2 and 4 with no optimizer state for it."""
    from nnscaler.cli import Trainer
    from tests.cli.common import gpt_args

    common = {
        "model.type": "tests.zoo_finetune.FrozenPosGPT",
        "checkpoint.save_type": "deduped",
        "checkpoint.every_n_train_steps": 2,
        "max_train_steps": 4,
        "compute_config.use_zero": True,
    }
    full = spawn(_trainer_run, 2, tmp_path, gpt_args(tmp_path, "dp", 1, 2, **common))[0]
    ckpts = {int(p.name.split("-")[1]): p for p in (tmp_path / "ckpt").glob("000?-000?")}
    resumed_argv = gpt_args(tmp_path, "dp", 1, 2, **common, **{"checkpoint.resume_from": str(ckpts[2])})
    resumed_argv[resumed_argv.index("--checkpoint.save_dir") + 1] = str(tmp_path / "ckpt2")
    resumed = spawn(_trainer_run, 2, tmp_path, resumed_argv)[0]
    assert len(full) == 4 and resumed == full[2:]  # bitwise
    merged = {}
    for step in (2, 4):
        Trainer.merge_checkpoint(str(ckpts[step]), str(tmp_path / f"merged{step}.ckpt"))
        merged[step] = torch.load(tmp_path / f"merged{step}.ckpt", weights_only=False)
    wpe = "transformer.wpe.weight"
    assert torch.equal(merged[2]["model"][wpe], merged[4]["model"][wpe])
    assert not torch.equal(
        merged[2]["model"]["transformer.wte.weight"], merged[4]["model"]["transformer.wte.weight"]
    )
    names = merged[4]["optimizer"]["param_groups"][0]["param_names"]
    assert wpe not in names and len(merged[4]["optimizer"]["state"]) == len(names)
    assert json.loads((ckpts[4] / "complete.json").read_text())["save_type"] == "deduped"
