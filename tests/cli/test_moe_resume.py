"""A checkpoint saved under expert parallelism 2 resumes under expert parallelism 4 (issue 30).

(A) `tp` with pas_config.ep_size 2, plan_ngpus 2 on 4 ranks (two data-parallel replicas of an ep 2
plan) trains 6 AdamW steps of a tiny MoE LM (tests/cli/moe_model.py, configs/moe.yaml; global batch
8 under both plans), saving a sharded checkpoint at step 3. (B) resumes that checkpoint with ep_size
4, plan_ngpus 4 on 4 ranks: each rank's expert of each layer (weights and AdamW state) is resharded
from the ep 2 ranks' shards. (C) is the uninterrupted ep 4 run from the same state: the step-3
checkpoint merged into one single-device file (`Trainer.merge_checkpoint`, what the `merge` CLI verb
writes) and loaded into the same ep 4 plan, so nothing of the ep 2 layout is left in what it reads.
From step 3 on both run the same program on the same weights, optimizer state, data position and RNG,
so B's losses must equal C's bit for bit. Both loads end in `load_merged_state_dict` (B merges the
shards in memory, C reads the merged file), so that equality guards the file round trip and the
restored data / RNG position; that the resharded state is the right one is checked by B staying close
to A's own ep 2 continuation (the same sums in another reduction order), which (D) a merged file with
two experts' AdamW state swapped fails by far more than the tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nnscaler.cli import Trainer
from tests.cli.common import CONFIGS
from tests.dist_util import spawn

SAVE_AT, STEPS = 3, 6


def _argv(tmp, name: str, ep: int, **extra) -> list[str]:
    argv = ["-f", str(CONFIGS / "moe.yaml"), "--compute_config.plan_ngpus", str(ep)]
    argv += ["--compute_config.runtime_ngpus", "4", "--compute_config.pas_config.ep_size", str(ep)]
    argv += ["--max_train_steps", str(STEPS), "--gen_savedir", str(tmp / f"gen_{name}")]
    argv += ["--checkpoint.save_dir", str(tmp / f"ckpt_{name}")]
    for key, value in extra.items():
        argv += [f"--{key}", str(value)]
    return argv


def _runs(rank: int, world: int, tmp) -> dict[str, list[float]]:
    """A, then (rank 0) the merged files of its step-3 checkpoint, then B, C and D: each run's losses
    and the experts per layer this rank held."""
    losses = {}
    trainer = Trainer(_argv(tmp, "a", 2, **{"checkpoint.every_n_train_steps": SAVE_AT}))
    trainer.run()
    losses["a"], losses["a_experts"] = trainer.losses, _local_experts(trainer.model)
    saved = tmp / "ckpt_a" / f"0000-{SAVE_AT:04d}"
    if rank == 0:
        Trainer.merge_checkpoint(str(saved), str(tmp / "merged" / "merged.ckpt"))
        _swap_expert_state(tmp / "merged" / "merged.ckpt", tmp / "merged" / "swapped.ckpt")
    dist.barrier()
    sources = {"b": saved, "c": tmp / "merged" / "merged.ckpt", "d": tmp / "merged" / "swapped.ckpt"}
    for name, source in sources.items():
        trainer = Trainer(_argv(tmp, name, 4, **{"checkpoint.resume_from": source}))
        trainer.run()
        losses[name] = trainer.losses
        losses[f"{name}_experts"] = _local_experts(trainer.model)
    return losses


def _swap_expert_state(src, dst) -> None:
    """A negative control: the merged checkpoint with the AdamW state of layer 0's experts 0 and 1
    swapped (what a resharding that put an expert's state on another expert would load)."""
    data = torch.load(src, weights_only=False)
    opt = data["optimizer"]
    index = opt["param_groups"][0]["param_names"].index("blocks.0.experts.gate_up_proj")
    for key in ("exp_avg", "exp_avg_sq"):
        opt["state"][index][key] = opt["state"][index][key][[1, 0, 2, 3]].clone()
    torch.save(data, dst)


def _local_experts(model: torch.nn.Module) -> list[int]:
    """The experts this rank holds of each MoE layer (dim 0 of its gate_up_proj shards)."""
    return [p.shape[0] for n, p in model.named_parameters() if n.endswith("gate_up_proj")]


@pytest.mark.timeout(600)
def test_resume_ep2_checkpoint_under_ep4(tmp_path):
    """B == C bit for bit; B close to A's ep 2 continuation; D (swapped expert state) far from B."""
    per_rank = spawn(_runs, 4, tmp_path, tmp_path, timeout=550)
    runs = per_rank[0]
    print(runs)
    assert all(r["a_experts"] == [2, 2] and r["b_experts"] == r["c_experts"] == [1, 1] for r in per_rank), [
        (r["a_experts"], r["b_experts"], r["c_experts"]) for r in per_rank
    ]
    assert len(runs["a"]) == STEPS and len(runs["b"]) == len(runs["c"]) == STEPS - SAVE_AT
    assert runs["b"] == runs["c"], f"resharded ep 2 -> ep 4 {runs['b']} vs merged into ep 4 {runs['c']}"
    torch.testing.assert_close(runs["b"], runs["a"][SAVE_AT:], rtol=1e-5, atol=1e-5)
    worst = max(abs(d - b) for d, b in zip(runs["d"], runs["b"]))
    assert worst > 1e-4, f"swapping two experts' AdamW state changed the losses by only {worst}"
    assert runs["a"][-1] < runs["a"][0]  # it learns
