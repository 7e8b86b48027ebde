"""The writers killed by the crash-consistency test and benchmark, each as a `Scenario`.

- `trainer`: the Trainer's own save path (`nnscaler.cli.resume.save`: step directory, `last` and
  `best` pointers, pruning with keep_last_n_checkpoints=1) of a one-rank run; the next run's
  `check_before_start` + `resume` must load the previous or the new weights and report leftovers.
- `runtime`: `write_rank_dir` (with `atomic_save` per file) replacing an existing checkpoint directory.
- `hf_export`: `save_pretrained` of a tiny Qwen2 in several shards over an earlier export, beside the
  user's files; `load_pretrained` must read the earlier or the new weights, the user's files intact.
- `codegen`: `parallelize` regenerating an output directory for a changed model; the code either
  verifies and is the earlier or the new compile's, or is refused (ConfigError) and regenerated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from nnscaler.errors import ConfigError

__all__ = ["SCENARIOS", "make"]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _clone(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _which(found: dict[str, Any], previous: dict[str, Any], new: dict[str, Any] | None, what: str) -> str:
    if _same(found, previous):
        return "previous"
    if new is not None and _same(found, new):
        return "new"
    raise AssertionError(f"{what} holds neither the previous nor the new tensors")


class _Warnings(logging.Handler):
    """Collects the warnings of one logger while a block runs."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.logger, self.lines = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> _Warnings:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ---- the Trainer ---------------------------------------------------------------------------------


class TrainerSave:
    name = "trainer"

    def setup(self, root: Path) -> None:
        from nnscaler.cli import Trainer
        from nnscaler.cli.configs import ResumeOptions
        from tests.cli.common import gpt_args

        overrides = {"checkpoint.every_n_train_steps": 2, "checkpoint.keep_last_n_checkpoints": 1}
        self.trainer = Trainer(gpt_args(root, "dp", 1, 1, max_train_steps=2, **overrides))
        self.trainer.run()
        self.state_dir = root / "ckpt"
        cfg = self.trainer.train_args.checkpoint
        self.cfg, self.resume_cfg = cfg, dataclasses.replace(cfg, resume_from=ResumeOptions("last"))
        self.previous = _clone(self.trainer.model.state_dict())
        self.opt = self.trainer.optimizer.state_dict()
        self.status = dict(self.trainer.train_status)
        self.new: dict[str, Any] | None = None

    def write(self) -> None:
        from nnscaler.cli import resume

        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.add_(1.0)
        self.trainer.train_status["step"] += 1
        resume.save(self.trainer, 0)

    def _resume(self) -> tuple[dict[str, Any], list[str]]:
        """What the next run does first: put right and report, then resume from `last`."""
        from nnscaler.cli import resume

        t = self.trainer
        t.train_args.checkpoint = self.resume_cfg
        try:
            with _Warnings("nnscaler.cli.checkpoint") as warned:
                resume.check_before_start(self.resume_cfg, 0)
            resume.resume(t)
            return _clone(t.model.state_dict()), warned.lines
        finally:
            t.train_args.checkpoint = self.cfg
            t.model.load_state_dict(self.previous)
            t.optimizer.load_state_dict(self.opt)
            t.train_status.clear()
            t.train_status.update(self.status)

    def learn_new(self) -> None:
        self.new = self._resume()[0]

    def check(self) -> str:
        from nnscaler.cli import checkpoint as ck

        leftovers = _hidden(self.state_dir)
        found, warned = self._resume()
        assert not _hidden(self.state_dir), f"left after recovery: {_hidden(self.state_dir)}"
        for name in leftovers:
            assert any(name in line for line in warned), f"{name} was left and not reported: {warned}"
        for d in ck.step_dirs(self.state_dir):  # every complete step directory reads
            ck.load_file(ck.rank_file(d, 0))
        return _which(found, self.previous, self.new, f"{self.state_dir / 'last'} (resumed)")


# ---- the runtime's checkpoint directory ---------------------------------------------------------


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 256, generator=g) for i in range(4)}


class RuntimeDir:
    name = "runtime"

    def setup(self, root: Path) -> None:
        from nnscaler.runtime.checkpoint.files import write_rank_dir

        self.state_dir = root / "rt"
        self.final = self.state_dir / "step"
        self.previous = {"0.ckpt": _weights(0), "1.ckpt": _weights(1)}
        self.new = {"0.ckpt": _weights(2), "1.ckpt": _weights(3)}
        self.state_dir.mkdir(parents=True)
        write_rank_dir(self.final, *self._temps(), 0, self.previous)

    def _temps(self) -> tuple[Path, Path]:
        return self.state_dir / ".tmp-step", self.state_dir / ".old-step"

    def write(self) -> None:
        from nnscaler.runtime.checkpoint.files import write_rank_dir

        tmp, old = self._temps()
        shutil.rmtree(tmp, ignore_errors=True)  # as its callers do: a stale temporary directory
        write_rank_dir(self.final, tmp, old, 0, self.new)

    def learn_new(self) -> None:
        pass

    def check(self) -> str:
        from nnscaler.runtime.checkpoint.files import load_file

        assert self.final.is_dir(), f"{self.final} is missing (left: {sorted(os.listdir(self.state_dir))})"
        kinds = {
            _which(load_file(self.final / name), self.previous[name], self.new[name], str(self.final / name))
            for name in self.previous
        }
        assert len(kinds) == 1, f"{self.final} mixes files of the previous and the new checkpoint"
        return kinds.pop()


# ---- Hugging Face export ------------------------------------------------------------------------

_USER_FILES = {"README.md": "# my model\n", "tokenizer.json": '{"tokens": []}\n', "notes/todo.txt": "x\n"}


class HFExport:
    name = "hf_export"
    shard = "40KB"

    def setup(self, root: Path) -> None:
        from nnscaler.integration.hf import save_pretrained
        from tests.integration.hf_case import build_qwen2

        self.state_dir = root / "export"
        for name, text in _USER_FILES.items():
            (self.state_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (self.state_dir / name).write_text(text)
        old = build_qwen2(0, layers=1)
        save_pretrained(old, self.state_dir, max_shard_size=self.shard)
        self.module = build_qwen2(1, layers=1)
        self.previous, self.new = _clone(old.state_dict()), _clone(self.module.state_dict())
        self.fresh = build_qwen2(2, layers=1)

    def write(self) -> None:
        from nnscaler.integration.hf import save_pretrained

        save_pretrained(self.module, self.state_dir, max_shard_size=self.shard)

    def learn_new(self) -> None:
        pass

    def check(self) -> str:
        from nnscaler.integration.hf import load_pretrained, save_pretrained

        load_pretrained(self.fresh, self.state_dir)
        found = _which(self.fresh.state_dict(), self.previous, self.new, str(self.state_dir))
        for name, text in _USER_FILES.items():
            assert (self.state_dir / name).read_text() == text, f"the user's {name} was changed"
        # the next export cleans up and names what it removed: only the user's files and its own are left
        hidden = _hidden(self.state_dir)
        with _Warnings("nnscaler.integration.hf.export_files") as warned:
            save_pretrained(self.module, self.state_dir, max_shard_size=self.shard)
        for name in hidden:
            assert any(name in line for line in warned.lines), (
                f"{name} was left and not reported: {warned.lines}"
            )
        index = json.loads((self.state_dir / "model.safetensors.index.json").read_text())
        expected = set(index["weight_map"].values()) | {"model.safetensors.index.json", "config.json"}
        expected |= {n.split("/")[0] for n in _USER_FILES}
        left = sorted(set(p.name for p in self.state_dir.iterdir()) - expected)
        assert not left, f"the next export left {left} in {self.state_dir}"
        return found


# ---- generated code ------------------------------------------------------------------------------


class MLP(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(hidden)
        self.a, self.b = torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sum()


def _files(outdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in outdir.iterdir() if p.is_file() and not p.name.startswith(".")}


class Codegen:
    name = "codegen"

    def setup(self, root: Path) -> None:
        from nnscaler.config import ComputeConfig

        self.gen = root / "gen"
        self.cfg = ComputeConfig(1, 1)
        self.args = {"x": torch.randn(3, 4)}
        self.model = MLP(16)
        self._parallelize(MLP(8), "override", load=False)
        (self.state_dir,) = [p.parent for p in self.gen.rglob("fingerprint.json")]
        self.previous = _files(self.state_dir)

    def _parallelize(self, model: torch.nn.Module, reuse: str, load: bool, gen: Path | None = None) -> Any:
        from nnscaler.parallel import parallelize

        gen = gen or self.gen
        return parallelize(model, self.args, "dp", self.cfg, gen_savedir=gen, reuse=reuse, load_module=load)

    def write(self) -> None:
        self._parallelize(self.model, "moo", load=False)

    def learn_new(self) -> None:
        self.new = _files(self.state_dir)
        assert self.new != self.previous

    def check(self) -> str:
        from nnscaler.parallel.artifacts import read_saved
        from nnscaler.parallel.parallelize import load_generated_class

        saved = read_saved(self.state_dir)
        if saved.data is None:  # no (or a damaged) fingerprint: nothing claims to be complete
            try:
                load_generated_class(self.state_dir, 0)
            except (ConfigError, ModuleNotFoundError):
                return "regenerate"
            raise AssertionError(f"gencode0.py in {self.state_dir} loaded without a fingerprint")
        load_generated_class(self.state_dir, 0)  # verified against the fingerprint
        files = _files(self.state_dir)
        recorded = {n: files.get(n) for n in saved.artifacts or {}} | {
            "fingerprint.json": files.get("fingerprint.json")
        }
        for label, state in (("previous", self.previous), ("new", self.new)):
            if all(state.get(n) == data for n, data in recorded.items()):
                return label
        raise AssertionError(f"{self.state_dir}: its fingerprint verifies files of neither compile")

    def next_run(self) -> list[str]:
        """A real parallelize of the new model where the last kill left the directory: it names what
        an interrupted compile left, removes its temporary files, and the code it reuses or
        regenerates computes what the model does. Returns the warnings."""
        hidden = _hidden(self.state_dir)
        unfinished = read_saved_data(self.state_dir) is None
        with _Warnings("nnscaler.parallel.reuse") as warned:
            pm = self._parallelize(self.model, "moo", load=True)
        assert torch.allclose(pm(**self.args), self.model(**self.args))
        assert not _hidden(self.state_dir), f"left after the next compile: {_hidden(self.state_dir)}"
        for name in hidden:
            assert any(name in line for line in warned.lines), (
                f"{name} was left and not reported: {warned.lines}"
            )
        if unfinished:
            assert any("without fingerprint.json" in line for line in warned.lines), warned.lines
        return warned.lines


def read_saved_data(outdir: Path) -> Any:
    from nnscaler.parallel.artifacts import read_saved

    return read_saved(outdir).data


SCENARIOS = {"trainer": TrainerSave, "runtime": RuntimeDir, "hf_export": HFExport, "codegen": Codegen}


def make(name: str) -> Any:
    return SCENARIOS[name]()
