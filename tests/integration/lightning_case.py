"""A LightningModule written for the Lightning tests, and a runner used under torchrun:
`python -m tests.integration.lightning_case OUT_DIR` trains it under NnScalerStrategy (dp, tp, pp,
resume) and Lightning's DDP, saving a checkpoint after each run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

DIM, SAMPLES, BATCH, LR = 16, 64, 4, 0.05


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Regressor(pl.LightningModule):
    """Two residual blocks and a head; forward returns the mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 4)
        self.dummy_forward_args = {"x": torch.randn(BATCH, 8, DIM), "y": torch.randn(BATCH, 8, 4)}

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(self.head(x), y)

    def training_step(self, batch, batch_idx):
        loss = self(**batch)
        self.log("train_loss", loss, sync_dist=True)
        self.log("replicas", torch.tensor(1.0), sync_dist=True, reduce_fx="sum")
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(**batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Pairs(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 8, DIM, generator=g)
        self.y = torch.randn(SAMPLES, 8, 4, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def loader() -> DataLoader:
    return DataLoader(Pairs(), batch_size=BATCH, shuffle=False)


def reference_weights(
    steps: int, replicas: int, steps_per_epoch: int | None = None, epochs: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """Single-device SGD on the replicas' batches together (what data parallelism averages). Lightning
    gives each replica a DistributedSampler(shuffle=True, seed=0): replica k reads perm[k::replicas]
    of one permutation, so step s of all replicas together is perm[s*B*R : (s+1)*B*R]. `epochs`: the
    epoch number of each epoch run (the sampler's seed), where a resumed run skips one."""
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = Pairs()
    per_step = BATCH * replicas
    per_epoch = steps_per_epoch or SAMPLES // per_step
    for s in range(steps):
        epoch, k = divmod(s, per_epoch)  # the sampler's seed is 0 + epoch
        epoch = epochs[epoch] if epochs else epoch
        perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        idx = perm[k * per_step : (k + 1) * per_step]
        loss = model(data.x[idx], data.y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainer(strategy, steps: int, root: Path, **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=2,
        val_check_interval=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kw,
    )


def _nnscaler(policy: str, plan: int, root: Path, name: str, **cfg):
    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning.pytorch import NnScalerPrecision, NnScalerStrategy

    cc = ComputeConfig(plan, 2, **cfg)
    strategy = NnScalerStrategy(compute_config=cc, pas_policy=policy, gen_savedir=str(root / "gen" / name))
    return strategy, [NnScalerPrecision("32-true")]


def main(out: Path) -> None:
    pp = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2, "pipeline_nstages": 2}}
    runs = [("dp", "dp", 1, {}), ("tp", "tp", 2, {}), ("pp", "pp", 2, pp)]
    for name, policy, plan, cfg in runs:
        strategy, plugins = _nnscaler(policy, plan, out, name, **cfg)
        trainer = _trainer(strategy, 3, out, plugins=plugins)
        trainer.fit(Regressor(), loader(), loader())
        trainer.save_checkpoint(out / f"{name}.ckpt")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        (out / f"{name}_metrics.json").write_text(json.dumps(metrics))
        strategy.state_dict_type = "deduped"  # the same state, one copy per piece over the replicas
        trainer.save_checkpoint(out / f"{name}_deduped.ckpt")
    # interrupted at the end of an epoch of 2 steps, resumed for 2 more
    strategy, plugins = _nnscaler("tp", 2, out, "tp")
    trainer = _trainer(strategy, 2, out, plugins=plugins, limit_train_batches=2)
    trainer.fit(Regressor(), loader(), loader())
    trainer.save_checkpoint(out / "tp_step2.ckpt")
    strategy, plugins = _nnscaler("tp", 2, out, "tp")
    trainer = _trainer(strategy, 4, out, plugins=plugins, limit_train_batches=2)
    trainer.fit(Regressor(), loader(), loader(), ckpt_path=str(out / "tp_step2.ckpt"))
    trainer.save_checkpoint(out / "tp_resumed.ckpt")
    strategy, plugins = _nnscaler("tp", 2, out, "tp")
    trainer = _trainer(strategy, 4, out, plugins=plugins, limit_train_batches=2)
    trainer.fit(Regressor(), loader(), loader())
    trainer.save_checkpoint(out / "tp_straight.ckpt")
    # dp resumed (one more step) from its sharded and from its deduped checkpoint
    for kind in ("", "_deduped"):
        strategy, plugins = _nnscaler("dp", 1, out, "dp")
        trainer = _trainer(strategy, 4, out, plugins=plugins)
        trainer.fit(Regressor(), loader(), loader(), ckpt_path=str(out / f"dp{kind}.ckpt"))
        trainer.save_checkpoint(out / f"dp{kind}_resumed.ckpt")
    # Lightning's own data parallelism, the yardstick of dp
    trainer = _trainer("ddp", 3, out)
    trainer.fit(Regressor(), loader(), loader())
    trainer.save_checkpoint(out / "ddp.ckpt")
    torch.distributed.destroy_process_group()  # gloo may abort at exit with the group still up


if __name__ == "__main__":
    main(Path(sys.argv[1]))
