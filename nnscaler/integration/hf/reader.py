"""Lazy reads from a Hugging Face checkpoint directory: only the slices a rank owns.

`HFCheckpoint(path)` reads `model.safetensors.index.json` (or finds a single `model.safetensors`),
knows each tensor's file and shape from the safetensors headers, and `read_rows` reads rows
`[r0, r1)` of one rank's shard of a tensor through `safe_open(...).get_slice(name)[...]`: nothing
outside them is read into memory. `bytes_read` counts what was read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nnscaler.errors import CheckpointError
from nnscaler.runtime.shard import Shard, local_shape

__all__ = ["HFCheckpoint", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _unreadable(target: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"load_pretrained: {target} cannot be read ({type(err).__name__}: {err}); the file is truncated or "
        "damaged: copy or export the checkpoint again"
    )


class HFCheckpoint:
    """A checkpoint directory of safetensors files, opened lazily (use as a context manager)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(
                f"load_pretrained: {self.path} is not a directory (give the checkpoint folder)"
            )
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (ValueError, AttributeError) as err:
                raise CheckpointError(
                    f"load_pretrained: {index} cannot be read ({err}); it is truncated or damaged: export the "
                    "checkpoint again, or remove the index to read a single model.safetensors"
                ) from err
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"load_pretrained: {index} has no 'weight_map'")
            self.file_of: dict[str, str] = dict(weight_map)
        elif (self.path / SINGLE_FILE).exists():
            self.file_of = {}
        else:
            raise CheckpointError(
                f"load_pretrained: {self.path} holds neither {INDEX_FILE} nor {SINGLE_FILE} (a Hugging Face "
                "checkpoint saved with safe_serialization; .bin checkpoints are not read)"
            )
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}
        if not self.file_of:
            self.file_of = {k: SINGLE_FILE for k in self._handle(SINGLE_FILE).keys()}
        self.bytes_read = 0
        self.tensors_read = 0

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self._open.clear()

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            target = self.path / file
            if not target.exists():
                raise CheckpointError(f"load_pretrained: {target} is named in {INDEX_FILE} but missing")
            try:
                handle = safe_open(str(target), framework="pt", device="cpu")
            except Exception as err:  # safetensors' own error names no file
                raise _unreadable(target, err) from err
            self._open[file] = self._stack.enter_context(handle)
        return self._open[file]

    def keys(self) -> Iterator[str]:
        return iter(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.file_of[name]
        try:
            return tuple(self._handle(file).get_slice(name).get_shape())
        except CheckpointError:
            raise
        except Exception as err:  # e.g. a key the index names but the file lacks
            raise CheckpointError(
                f"load_pretrained: {self.path / file} has no readable tensor {name!r} ({err}); the index and "
                "its files do not match: export the checkpoint again"
            ) from err

    def _take(self, piece: torch.Tensor) -> torch.Tensor:
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def read_rows(self, name: str, shard: Shard | None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows `[r0, r1)` (dim 0) of this rank's shard of tensor `name` (None: the whole shard)."""
        handle = self._handle(self.file_of[name])
        self.tensors_read += 1
        full = self.shape(name)
        if not full:  # a scalar
            return self._take(handle.get_tensor(name))
        r0, r1 = rows if rows is not None else (0, local_shape(full, shard)[0])
        lazy = handle.get_slice(name)
        whole = [slice(None)] * len(full)
        if shard is None:
            return self._take(lazy[tuple([slice(r0, r1)] + whole[1:])])
        dim, index, ways, blocks = shard
        chunk = full[dim] // (ways * blocks)
        block = full[dim] // blocks
        pieces = []
        for b in range(blocks):
            start = b * block + index * chunk  # where this block's piece starts in the full tensor
            idx = list(whole)
            if dim == 0:  # local rows b*chunk .. (b+1)*chunk come from this block
                lo, hi = max(r0, b * chunk), min(r1, (b + 1) * chunk)
                if lo >= hi:
                    continue
                idx[0] = slice(start + lo - b * chunk, start + hi - b * chunk)
            else:
                idx[0], idx[dim] = slice(r0, r1), slice(start, start + chunk)
            pieces.append(self._take(lazy[tuple(idx)]))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
