"""What examples/nanogpt/train_cli.yaml names: the char dataset, the model config, the end-of-run report.

    torchrun --nproc_per_node 4 -m nnscaler.cli.train -f examples/nanogpt/train_cli.yaml

Every process calls `ensure_data` (file-locked: the first prepares missing data, the others reuse it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.nanogpt.generate import generate, merged_gpt
from examples.nanogpt.model import GPTConfig
from examples.nanogpt.prepare import DEFAULT_DATA_DIR, decode, encode, ensure_data, load_meta

__all__ = ["CharDataset", "gpt_config", "report"]


class CharDataset(torch.utils.data.Dataset):
    """`split`.bin cut into windows of `block_size` + 1 characters: sample i is
    {"idx": window[:-1], "targets": window[1:]}, the arguments of `GPT.forward`."""

    def __init__(
        self, data_dir: str | None = None, split: str = "train", block_size: int = 64, offline: bool = False
    ):
        if split not in ("train", "val"):
            raise ValueError(f"CharDataset: split must be 'train' or 'val', got {split!r}")
        self.data_dir = Path(data_dir or DEFAULT_DATA_DIR)
        ensure_data(self.data_dir, offline=offline, verbose=False)
        self.data = np.memmap(self.data_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        self.block_size = block_size
        if len(self.data) <= block_size:
            raise ValueError(f"CharDataset: {split}.bin has {len(self.data)} ids, fewer than block_size + 1")

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.block_size
        window = torch.from_numpy(self.data[start : start + self.block_size + 1].astype(np.int64))
        return {"idx": window[:-1], "targets": window[1:]}


def gpt_config(data_dir: str | None = None, offline: bool = False, **fields: Any) -> GPTConfig:
    """GPTConfig(**fields) with vocab_size = the prepared data's character vocabulary."""
    data_dir = data_dir or DEFAULT_DATA_DIR
    ensure_data(data_dir, offline=offline, verbose=False)
    return GPTConfig(vocab_size=load_meta(data_dir)["vocab_size"], **fields)


def report(trainer: Any, sample_tokens: int = 200) -> None:
    """on_train_end hook: rank 0 prints the first and last training loss, the last validation loss
    and a sample from the trained weights (merged into a plain GPT). Every rank must call it."""
    args = trainer.train_args
    config = args.create_model().config
    plain = merged_gpt(trainer.model, config)
    if plain is None or not trainer.losses:
        return
    losses = trainer.losses
    meta = load_meta(args.dataset.train_args.get("data_dir") or DEFAULT_DATA_DIR)
    print(f"data: {meta['source']}, vocab {meta['vocab_size']}")
    print(f"train loss: first {losses[0]:.4f}  last {losses[-1]:.4f}  ({len(losses)} steps)")
    if trainer.last_val_loss is not None:
        print(f"val loss: {trainer.last_val_loss:.4f}")
    prompt = "\n" if "\n" in meta["stoi"] else meta["itos"][0]
    ids = generate(plain, encode(prompt, meta["stoi"]), sample_tokens, seed=args.seed or 0)
    print(
        f"sample ({sample_tokens} characters, top-10 sampling):\n{decode(ids, meta['itos'])}\n---", flush=True
    )
