"""Token data for the Llama example: the offline byte tokenizer, the saved-dataset format and the
datasets the trainer reads.

A saved dataset (bookcorpus.py) is a directory with `tokens.npy` (int32, one row per sequence of
`seq_len` tokens) and `meta.json` (source, tokenizer, vocab_size, seq_len, rows).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

IGNORE_INDEX = -100
"""Label of positions without a target (the last token of each sequence)."""
BOS, EOS = 256, 257
BYTE_VOCAB = 258
"""The offline byte tokenizer: bytes 0..255, then BOS and EOS."""


def byte_encode(text: str) -> list[int]:
    """One document as BOS, its UTF-8 bytes, EOS."""
    return [BOS, *text.encode("utf-8"), EOS]


def byte_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass
class DatasetMeta:
    """meta.json of a saved dataset."""

    source: str
    tokenizer: str
    vocab_size: int
    seq_len: int
    rows: int


def save_dataset(path: str | Path, rows: np.ndarray, meta: DatasetMeta) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / "tokens.npy", rows.astype(np.int32))
    (path / "meta.json").write_text(json.dumps(asdict(meta), indent=1))


def load_meta(path: str | Path) -> DatasetMeta:
    file = Path(path) / "meta.json"
    if not file.exists():
        raise FileNotFoundError(
            f"--dataset_path {path}: no meta.json there; create the dataset with examples/llama3_8B_128K/bookcorpus.py"
        )
    return DatasetMeta(**json.loads(file.read_text()))


def sample(row: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward's arguments for one sequence: next-token labels, none for the last position."""
    labels = torch.full_like(row, IGNORE_INDEX)
    labels[:-1] = row[1:]
    return {"input_ids": row, "labels": labels}


class TokenDataset(torch.utils.data.Dataset):
    """The rows of a saved dataset (memory-mapped), each `{input_ids, labels}`."""

    def __init__(self, path: str):
        self.meta = load_meta(path)
        self.tokens = np.load(Path(path) / "tokens.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return sample(torch.from_numpy(np.array(self.tokens[i], dtype=np.int64)))


class DummyDataset(torch.utils.data.Dataset):
    """`rows` sequences of `seq_len` zeros: what `--run_mode compile` traces with when no
    --dataset_path is given (only shapes matter)."""

    def __init__(self, seq_len: int, rows: int = 1):
        self.seq_len, self.rows = seq_len, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return sample(torch.zeros(self.seq_len, dtype=torch.long))
