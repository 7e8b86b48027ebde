"""Train the example GPT through Lightning with nnscaler's `NnScalerStrategy` (nanoGPT style).

    python examples/nanogpt/train_nnscaler.py examples/nanogpt/config/train_shakespeare_char.py
    torchrun --nproc_per_node 4 examples/nanogpt/train_nnscaler.py \\
        examples/nanogpt/config/train_shakespeare_char.py --plan_ngpus=2 --runtime_ngpus=4
    torchrun --nproc_per_node 2 examples/nanogpt/train_nnscaler.py --policy=pp --plan_ngpus=2 --nmicros=2

Configuration is nanoGPT's: the defaults below, then each python file named on the command line
(assignments that override them), then `--key=value` flags (values read as Python literals, else as
strings). `runtime_ngpus=-1` means $WORLD_SIZE (1 without torchrun). Without torchrun, Lightning
starts `runtime_ngpus` processes itself. The data is examples/nanogpt/prepare.py's character data
(prepared on first use). At the end rank 0 merges the checkpoint written to {out_dir}/last.ckpt
into {out_dir}/merged.ckpt, loads it into a plain GPT and prints its validation loss and a sample.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

try:
    import lightning.pytorch as pl  # noqa: E402
except ModuleNotFoundError as exc:  # an optional dependency: say how to get it
    raise SystemExit(
        f"train_nnscaler.py needs PyTorch Lightning ({exc}); install it with `pip install -e .[lightning]` "
        "(or `pip install lightning`)"
    ) from None
from torch.utils.data import DataLoader  # noqa: E402

from examples.nanogpt.cli_data import CharDataset  # noqa: E402
from examples.nanogpt.generate import generate  # noqa: E402
from examples.nanogpt.model import GPT, GPTConfig  # noqa: E402
from examples.nanogpt.prepare import DEFAULT_DATA_DIR, decode, encode, ensure_data, load_meta  # noqa: E402
from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.integration.lightning.pytorch import NnScalerPrecision, NnScalerStrategy  # noqa: E402

DEFAULTS: dict[str, Any] = dict(
    out_dir="out-nanogpt-lightning",
    data_dir=str(DEFAULT_DATA_DIR),
    offline=False,  # True: never try to download tinyshakespeare
    plan_ngpus=1,
    runtime_ngpus=-1,  # -1: $WORLD_SIZE
    policy="tp",  # dp, tp, pp, autodist, ... (pp: a pipeline of plan_ngpus stages)
    nmicros=2,  # micro-batches per step (pp); batch_size must be a multiple
    precision="32-true",  # one of NnScalerPrecision's: 32-true 16-true bf16-true 16-mixed bf16-mixed
    state_dict_type="sharded",
    max_steps=200,
    batch_size=16,  # rows per step on one data-parallel replica
    block_size=64,
    n_layer=4,
    n_head=4,
    n_embd=128,
    dropout=0.0,
    learning_rate=1e-3,
    eval_interval=100,
    eval_iters=8,
    sample_tokens=200,
    seed=0,
    gen_savedir="./.nnscaler",
    reuse="moo",  # regenerate the parallel code when the model, policy or config changed
)


def configure(argv: list[str]) -> dict[str, Any]:
    """DEFAULTS, overridden by config files (python assignments) and `--key=value` flags, in order."""
    cfg = dict(DEFAULTS)
    for arg in argv:
        if not arg.startswith("--"):
            scope = dict(cfg)
            exec(Path(arg).read_text(), scope)
            unknown = sorted(k for k in scope if k not in DEFAULTS and not k.startswith("__"))
            if unknown:
                raise SystemExit(f"{arg}: unknown settings {unknown}; known: {sorted(DEFAULTS)}")
            cfg.update({k: scope[k] for k in DEFAULTS})
            continue
        key, sep, text = arg[2:].partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"{arg}: expected --key=value with key one of {sorted(DEFAULTS)}")
        try:
            value = ast.literal_eval(text)
        except (SyntaxError, ValueError):
            value = text
        if DEFAULTS[key] is not None and type(value) is not type(DEFAULTS[key]):
            if not (isinstance(DEFAULTS[key], float) and isinstance(value, int)):
                raise SystemExit(f"--{key}={text}: expected a {type(DEFAULTS[key]).__name__}")
            value = float(value)
        cfg[key] = value
    if cfg["runtime_ngpus"] == -1:
        cfg["runtime_ngpus"] = int(os.environ.get("WORLD_SIZE", 1))
    return cfg


class LitGPT(pl.LightningModule):
    """The GPT as a LightningModule: forward is the GPT's loss, which nnscaler traces."""

    def __init__(self, config: GPTConfig, lr: float, batch_size: int) -> None:
        super().__init__()
        self.gpt = GPT(config)
        self.lr = lr
        shape = (batch_size, config.block_size)
        self.dummy_forward_args = {
            "idx": torch.zeros(shape, dtype=torch.long),
            "targets": torch.zeros(shape, dtype=torch.long),
        }

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx, targets)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**batch)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def plain_gpt(merged_file: Path, config: GPTConfig) -> GPT:
    """The merged Lightning checkpoint's weights in a single-device GPT."""
    state = torch.load(merged_file, weights_only=False)["state_dict"]
    model = GPT(config)
    model.load_state_dict({k.removeprefix("gpt."): v for k, v in state.items()})
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    cfg = configure(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", 0))
    ensure_data(cfg["data_dir"], offline=cfg["offline"], verbose=rank == 0)
    meta = load_meta(cfg["data_dir"])
    torch.manual_seed(cfg["seed"])  # the same initial weights on every rank
    config = GPTConfig(
        block_size=cfg["block_size"],
        vocab_size=meta["vocab_size"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
        dropout=cfg["dropout"],
    )
    pipelined = cfg["policy"] == "pp"
    pas = {"pipeline_nmicros": cfg["nmicros"], "pipeline_nstages": cfg["plan_ngpus"]} if pipelined else {}
    compute = ComputeConfig(cfg["plan_ngpus"], cfg["runtime_ngpus"], use_end2end=pipelined, pas_config=pas)
    strategy = NnScalerStrategy(
        compute_config=compute,
        pas_policy=cfg["policy"],
        gen_savedir=cfg["gen_savedir"],
        reuse=cfg["reuse"],
        state_dict_type=cfg["state_dict_type"],
    )
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", cfg["runtime_ngpus"]))
    trainer = pl.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=devices,
        num_nodes=max(cfg["runtime_ngpus"] // devices, 1),
        strategy=strategy,
        plugins=[NnScalerPrecision(cfg["precision"])],
        max_steps=cfg["max_steps"],
        val_check_interval=min(cfg["eval_interval"], cfg["max_steps"]),
        check_val_every_n_epoch=None,
        limit_val_batches=cfg["eval_iters"],
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=cfg["out_dir"],
    )

    def data(split: str) -> DataLoader:
        ds = CharDataset(cfg["data_dir"], split, cfg["block_size"], cfg["offline"])
        return DataLoader(ds, batch_size=cfg["batch_size"], shuffle=split == "train", drop_last=True)

    trainer.fit(LitGPT(config, cfg["learning_rate"], cfg["batch_size"]), data("train"), data("val"))
    out = Path(cfg["out_dir"])
    trainer.save_checkpoint(out / "last.ckpt")  # a directory of per-rank files
    if trainer.is_global_zero:
        NnScalerStrategy.merge_checkpoint([out / "last.ckpt"], out / "merged.ckpt")
        plain = plain_gpt(out / "merged.ckpt", config)
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"metrics after {trainer.global_step} steps: {metrics}")
        print(f"merged single-device checkpoint: {out / 'merged.ckpt'}")
        if cfg["sample_tokens"] > 0:
            prompt = "\n" if "\n" in meta["stoi"] else meta["itos"][0]
            ids = generate(plain, encode(prompt, meta["stoi"]), cfg["sample_tokens"], seed=cfg["seed"])
            print(f"sample:\n{decode(ids, meta['itos'])}\n---", flush=True)


if __name__ == "__main__":
    main()
