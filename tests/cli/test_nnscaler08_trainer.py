"""The Trainer behaviours nnScaler 0.8's own CLI tests rely on (docs/runtime.md, "Coming from
nnScaler 0.8"): its public step counts, per-step validation hooks with mean losses, tracing_from_weights,
optimizer gradients visible to before_gnorm_clip under ZeRO, and resumable dataloaders."""

from __future__ import annotations

import math

import pytest
import torch

from nnscaler.cli import Trainer
from nnscaler.cli.configs import OptionalComputeConfig
from nnscaler.config import ComputeConfig
from nnscaler.runtime import merge_state_dicts
from tests.cli.common import gpt_args
from tests.dist_util import spawn

ONE_RANK = {"checkpoint.no_save": None}
SEEN: dict[str, list] = {"val": [], "weights": [], "grads": []}


class CountingLoader(torch.utils.data.DataLoader):
    """A resumable DataLoader: its state is the batches of this epoch it has given out."""

    loaded: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches, self._skip = 0, 0

    def __iter__(self):
        it = super().__iter__()  # created now: draws its seed where a plain DataLoader does
        skip, self._skip, self.batches = self._skip, 0, 0
        return self._count(it, skip)

    def _count(self, it, skip):
        for _ in range(skip):
            next(it)
            self.batches += 1
        for batch in it:
            self.batches += 1
            yield batch

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        CountingLoader.loaded.append(state)
        self._skip = state["batches"]


def record_val(trainer, aggregated_outputs, val_loss) -> None:
    SEEN["val"].append(val_loss)


def record_weights(trainer) -> None:
    SEEN["weights"].append(
        {k: v.clone() for k, v in merge_state_dicts([trainer.model.state_dict()])[0].items()}
    )


def record_grads(trainer) -> None:
    params = trainer.optimizer.param_groups[0]["params"]
    SEEN["grads"].append([None if p.grad is None else p.grad.clone() for p in params])


def _run(tmp_path, name: str, **overrides) -> Trainer:
    trainer = Trainer(gpt_args(tmp_path / name, "dp", 1, 1, **overrides))
    trainer.run()
    return trainer


def test_step_counts_and_dataloader_resumed_are_public(tmp_path):
    # 64 samples, micro-batch 4, 2 micro-batches per step: 8 steps per epoch (a short last step counts)
    trainer = _run(tmp_path, "a", max_train_steps=20, max_epochs=2, **ONE_RANK)
    assert trainer.total_train_steps_per_epoch == 8
    assert trainer.max_train_steps == 16  # the smaller of max_train_steps and max_epochs' steps
    assert len(trainer.losses) == 16
    assert trainer.dataloader_resumed is False
    short = _run(tmp_path, "b", max_train_steps=3, **{"dataset.train_args.size": 60}, **ONE_RANK)
    assert short.total_train_steps_per_epoch == math.ceil(15 / 2) and short.max_train_steps == 3


def test_validation_hook_runs_per_step_with_the_mean_loss(tmp_path):
    val = {
        "dataset.val_args.size": 16,
        "dataset.val_args.vocab": 64,
        "dataset.val_args.block": 16,
        "val_every_n_train_steps": 2,
        "max_train_steps": 2,
        "hook.after_aggregate_val_step_outputs": "tests.cli.test_nnscaler08_trainer.record_val",
    }
    runs = {}
    for how in ("mean", "sum"):
        SEEN["val"].clear()
        trainer = _run(tmp_path, how, **{"optimizer.loss_reduction": how}, **val, **ONE_RANK)
        runs[how] = (list(SEEN["val"]), trainer.last_val_loss, trainer.losses)
    # 16 samples / (4 per micro-batch * 2 per step): 2 validation steps, each reported on its own
    assert len(runs["mean"][0]) == 2
    assert runs["sum"][0] == runs["mean"][0]  # loss_reduction shapes the training loss only
    assert runs["mean"][1] == pytest.approx(sum(runs["mean"][0]) / 2, rel=1e-6)
    assert runs["sum"][1] == runs["mean"][1]
    assert runs["sum"][2][0] == pytest.approx(2 * runs["mean"][2][0], rel=1e-6)


def test_tracing_from_weights_starts_the_model_from_the_file(tmp_path):
    capture = {"hook.after_setup": "tests.cli.test_nnscaler08_trainer.record_weights", "max_train_steps": 1}
    SEEN["weights"].clear()
    _run(tmp_path, "plain", **capture, **ONE_RANK)
    plain = SEEN["weights"][-1]
    file = tmp_path / "weights.pt"
    torch.save({k: v + 0.5 for k, v in plain.items()}, file)
    _run(tmp_path, "loaded", tracing_from_weights=file, **capture, **ONE_RANK)
    loaded = SEEN["weights"][-1]
    for k, v in plain.items():
        torch.testing.assert_close(loaded[k], v + 0.5, rtol=0, atol=0)
    torch.save({"not_a_weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="do not fit"):
        _run(tmp_path, "bad", tracing_from_weights=tmp_path / "bad.pt", **capture, **ONE_RANK)


def test_tracing_from_weights_prefix_loads_a_sub_module(tmp_path):
    capture = {"hook.after_setup": "tests.cli.test_nnscaler08_trainer.record_weights", "max_train_steps": 1}
    SEEN["weights"].clear()
    _run(tmp_path, "plain", **capture, **ONE_RANK)
    full = {k: v + 1.0 for k, v in SEEN["weights"][-1].items()}
    torch.save(full, tmp_path / "full.pt")
    sub = {k[len("transformer.h.0.") :]: v for k, v in full.items() if k.startswith("transformer.h.0.")}
    torch.save(sub, tmp_path / "block.pt")
    mixed = {
        "model.parallel_modules.0.type": "examples.nanogpt.model.Block",
        "model.parallel_modules.0.forward_args_gen_fn": "tests.cli.common.block_inputs",
        "model.parallel_modules.0.tracing_from_weights": tmp_path / "block.pt",
    }
    _run(tmp_path, "mixed", **mixed, **capture, **ONE_RANK)
    got = SEEN["weights"][-1]
    for block in ("0", "1"):  # every Block took the file's weights
        for name in ("attn.c_attn.weight", "mlp.c_fc.weight"):
            assert torch.equal(got[f"transformer.h.{block}.{name}"], sub[name])
    assert not torch.equal(got["transformer.wte.weight"], full["transformer.wte.weight"])


def two_tokens_per_micro_batch(outputs, sync_group):
    from nnscaler.cli import AggregatedOutputs

    return AggregatedOutputs.aggregate(outputs, sync_group, lambda o: o, ntokens_fn=lambda o: 2)


def _zero_grads(rank: int, world: int, argv: list[str]) -> list[list[torch.Tensor | None]]:
    out = []
    for reduction in ("mean", "per-token-mean"):
        SEEN["grads"].clear()
        extra = ["--optimizer.grad_reduction", reduction]
        extra += [
            "--optimizer.aggregate_outputs_fn",
            "tests.cli.test_nnscaler08_trainer.two_tokens_per_micro_batch",
        ]
        Trainer(argv + extra).run()
        out.append(SEEN["grads"][0])
    return out


def test_before_gnorm_clip_sees_the_optimizer_gradients_under_zero(tmp_path):
    """The optimizer's ZeRO slices hold their reduced gradients when before_gnorm_clip runs, and
    per-token-mean scales them (nnScaler 0.8's Trainer allows it with ZeRO)."""
    hook = {"hook.before_gnorm_clip": "tests.cli.test_nnscaler08_trainer.record_grads"}
    zero = {"compute_config.use_zero": True, "optimizer.clip_gnorm": 0}
    argv = gpt_args(tmp_path, "dp", 1, 2, max_train_steps=1, **zero, **hook, **ONE_RANK)
    for mean, per_token in spawn(_zero_grads, 2, tmp_path, argv):
        assert mean and all(g is not None for g in mean)
        assert any(g.abs().sum() > 0 for g in mean)
        for a, b in zip(mean, per_token):  # 2 tokens per micro-batch: half the mean's gradient
            torch.testing.assert_close(b, a / 2, rtol=1e-6, atol=0)


def test_optional_compute_config_overrides_torch_compile():
    cc = ComputeConfig(1, 1)
    assert OptionalComputeConfig(torch_compile={"backend": "eager"}).resolve(cc).torch_compile == {
        "backend": "eager"
    }
    assert OptionalComputeConfig().resolve(ComputeConfig(1, 1, torch_compile=True)).torch_compile is True
    with pytest.raises(Exception, match="torch_compile"):
        OptionalComputeConfig(torch_compile="yes").resolve(cc)


def test_tensorboard_writes_one_run_per_tag_and_wandb_files_are_complete(tmp_path):
    import wandb  # both are test dependencies (pyproject's `test` extra)

    logs = {
        "log.0.type": "TensorBoardLogger",
        "log.0.args.root_dir": tmp_path / "tb",
        "log.0.args.name": "run",
        "log.1.type": "WandbLogger",
        "log.1.args.dir": tmp_path / "wandb",
        "log.1.args.mode": "offline",
        "log.1.args.project": "p",
        "dataset.val_args.size": 8,
        "val_every_n_train_steps": 2,
        "max_train_steps": 2,
    }
    _run(tmp_path, "logs", **logs, **ONE_RANK)
    for tag in ("train", "val"):  # nnScaler 0.8's layout: <root_dir>/<name>/<tag>/events.out.tfevents.*
        assert len(list((tmp_path / "tb" / "run" / tag).glob("events.out.tfevents.*"))) == 1
    from nnscaler.cli.plot import read_scalars

    assert [s for s, _ in read_scalars(tmp_path / "tb" / "run")["val/loss"]] == [2]
    (db,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    assert db.stat().st_size > 1000  # written out when the Trainer returns
    assert wandb.run is None


def test_a_resumable_dataloader_is_saved_and_restored(tmp_path):
    loader = {"dataloader.type": "tests.cli.test_nnscaler08_trainer.CountingLoader"}
    whole = _run(tmp_path, "whole", max_train_steps=6, **loader, **ONE_RANK).losses
    first = _run(tmp_path, "part", max_train_steps=3, **loader)
    assert not first.dataloader_resumed
    CountingLoader.loaded.clear()
    again = _run(tmp_path, "part", max_train_steps=6, **{"checkpoint.resume_from": "last"}, **loader)
    assert again.dataloader_resumed and CountingLoader.loaded == [{"batches": 6}]  # 3 steps of 2
    assert again.losses == whole[3:]  # the data went on where it stopped, nothing skipped twice
    Trainer.merge_checkpoint(str(tmp_path / "part" / "ckpt" / "0000-0003"), str(tmp_path / "merged.ckpt"))
    assert torch.load(tmp_path / "merged.ckpt", weights_only=False)["dataloader"] == [{"batches": 6}]
    merged = {"checkpoint.resume_from": tmp_path / "merged.ckpt", "max_train_steps": 6}
    assert _run(tmp_path, "from_merged", **merged, **loader).dataloader_resumed
    with pytest.raises(Exception, match="no load_state_dict"):
        _run(tmp_path, "plain_loader", **merged)


def test_sub_module_dummy_inputs_take_the_run_precision(tmp_path):
    """forward_args_gen_fn returns fp32 tensors; under `precision: bf16` they are cast like the samples
    (nnScaler 0.8 does too), so the bf16 sub-module traces and checks on them."""
    mixed = {
        "model.parallel_modules.0.type": "examples.nanogpt.model.Block",
        "model.parallel_modules.0.forward_args_gen_fn": "tests.cli.common.block_inputs",
        "precision": "bf16",
        "max_train_steps": 1,
    }
    trainer = _run(tmp_path, "bf16", **mixed, **ONE_RANK)
    assert len(trainer.losses) == 1 and math.isfinite(trainer.losses[0])


def test_a_listed_module_inside_another_listed_one_goes_with_it(tmp_path):
    """MLP and Block are both listed; every MLP lives in a Block, so only the Blocks become parallel
    modules (nnScaler 0.8's rule), instead of raising that parallel modules cannot be nested."""
    mixed = {
        "model.parallel_modules.0.type": "examples.nanogpt.model.MLP",
        "model.parallel_modules.0.forward_args_gen_fn": "tests.cli.common.block_inputs",
        "model.parallel_modules.1.type": "examples.nanogpt.model.Block",
        "model.parallel_modules.1.forward_args_gen_fn": "tests.cli.common.block_inputs",
        "max_train_steps": 1,
    }
    trainer = _run(tmp_path, "nested", **mixed, **ONE_RANK)
    from nnscaler.cli.mixed import parallel_parts

    assert [n for n, _ in parallel_parts(trainer.model)] == ["transformer.h.0", "transformer.h.1"]
    assert len(trainer.losses) == 1
