"""An epoch whose last micro-batch is short (29 samples in micro-batches of 4 leave 1): checked at
setup, so that it never fails mid-training.

`short_micro_batch` finds it (before compiling) from the dataset, the sampler and `drop_last`.
`check_short_micro_batch` (after compiling) fetches that very micro-batch the way the Trainer's
DataLoader does (torch's fetcher: `dataset.__getitems__` when the dataset has it, else `dataset[i]`;
then the loader's `collate_fn`) and checks it against the input contract of the generated code: the `self.input_sizes(...)` and `self.check_shape(...)` calls
its forward (or pipeline `micro_batch_inputs`) starts with. A plan that splits the batch (the `data`
policy over 2 ranks: `idx_size0 % 2 == 0`) cannot take 1 sample: refused, naming `drop_last`. A
short micro-batch the code accepts runs, with one warning (its mean loss weighs as much as a full
micro-batch's; nnScaler 0.8 warns the same way). A run that stops before the end of the first epoch
(`max_train_steps`; `max_val_steps` for validation) never reaches it: not checked.
"""

from __future__ import annotations

import ast
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nnscaler.errors import ConfigError
from nnscaler.runtime import ParallelModule

__all__ = ["ShortMicroBatch", "short_micro_batch", "reaches", "check_short_micro_batch", "input_contract"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShortMicroBatch:
    """The last micro-batch of replica 0's share of a dataset, when it is short."""

    stage: str
    samples: int
    share: int
    micro_batch_size: int
    num_replicas: int
    indices: tuple[int, ...]
    """The dataset indices of its samples (replica 0, epoch 0)."""

    def describe(self) -> str:
        full = self.share // self.micro_batch_size
        return (
            f"dataset.{self.stage}_args: the {self.stage} set has {self.samples} samples, {self.share} per "
            f"data-parallel replica ({self.num_replicas} replica(s)), which is {full} micro-batches of "
            f"{self.micro_batch_size} and a last one of {len(self.indices)}"
        )

    def fix(self) -> str:
        multiple = self.micro_batch_size * self.num_replicas
        return (
            f"set dataloader.{self.stage}_args.drop_last: true (each replica skips its last {len(self.indices)} "
            f"sample(s) per epoch), or give the dataset a multiple of micro_batch_size x replicas = {multiple} samples"
        )


def _loader_kwargs(args: Any, stage: str) -> dict[str, Any]:
    return getattr(args.dataloader, f"{stage}_args") or args.dataloader.train_args


def short_micro_batch(args: Any, dataset: Any, stage: str, num_replicas: int) -> ShortMicroBatch | None:
    """The short last micro-batch of `dataset` under these args (None: none, or drop_last, or a
    dataset without a length)."""
    if dataset is None or _loader_kwargs(args, stage).get("drop_last", False):
        return None
    sampler = args.create_sampler(dataset, stage, num_replicas, 0)
    if sampler is None or not hasattr(sampler, "__len__"):  # an IterableDataset: its length is unknown
        return None
    share, mbs = len(sampler), args.micro_batch_size
    short = share % mbs
    if not short:
        return None
    indices = tuple(list(sampler)[share - short :])
    return ShortMicroBatch(stage, len(dataset), share, mbs, num_replicas, indices)


def input_contract(source: str) -> tuple[dict[str, tuple], list[str]]:
    """From generated code: each input's expected sizes (`self.input_sizes(name, x, expected)`) and
    the rules on them (`self.check_shape(cond, rule, ...)`), as written."""
    sizes: dict[str, tuple] = {}
    rules: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            continue
        try:
            if node.func.attr == "input_sizes" and len(node.args) >= 3:
                sizes[ast.literal_eval(node.args[0])] = tuple(ast.literal_eval(node.args[2]))
            elif node.func.attr == "check_shape" and len(node.args) >= 2:
                rules.append(ast.literal_eval(node.args[1]))
        except ValueError:  # not a literal: not a contract we can read
            continue
    return sizes, list(dict.fromkeys(rules))


def _flat_sizes(forward_args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each tensor of the forward's arguments by its generated name (`data_idx` for data["idx"])."""
    leaves, _ = pytree.tree_flatten_with_path(forward_args)
    out = {}
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            name = "_".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            out[name] = tuple(leaf.shape)
    return out


def _violations(source: str, forward_args: dict[str, Any]) -> list[str]:
    expected, rules = input_contract(source)
    given = _flat_sizes(forward_args)
    env: dict[str, int] = {}
    broken = []
    for name, want in expected.items():
        if name not in given:
            continue
        shape = given[name]
        env.update({f"{name}_size{d}": s for d, s in enumerate(shape)})
        fixed = [
            f"dim {d} must be {w}" for d, (s, w) in enumerate(zip(shape, want)) if w is not None and s != w
        ]
        if len(shape) != len(want) or fixed:
            broken.append(
                f"{name} has shape {list(shape)} but {', '.join(fixed) or 'another number of dims'}"
            )
    for rule in rules:
        try:
            holds = eval(rule, {"__builtins__": {}}, dict(env))  # noqa: S307 - a size rule the codegen wrote
        except Exception:  # noqa: BLE001 - names of other values: not a rule on the inputs
            continue
        if not holds:
            broken.append(f"it needs {rule}")
    return broken


def _fetch(args: Any, dataset: Any, stage: str, indices: tuple[int, ...]) -> Any:
    """The micro-batch of these dataset indices, through a DataLoader as the Trainer's loader builds it
    (its fetcher calls `__getitems__` when the dataset has one; its collate_fn), in this process."""
    collate = dict(args.create_kwarg(_loader_kwargs(args, stage))).get("collate_fn")
    if isinstance(collate, str):
        from nnscaler.cli.loading import load_type

        collate = load_type(collate)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=len(indices), sampler=list(indices), collate_fn=collate, num_workers=0
    )
    return next(iter(loader))


def reaches(args: Any, short: ShortMicroBatch) -> bool:
    """Whether the run gets to `short` (the last micro-batch of an epoch): training runs a whole epoch
    (max_train_steps at least an epoch's optimizer steps, or only max_epochs), validation a whole pass
    (no max_val_steps, or at least a pass's steps). A resumed run is judged from step 0."""
    micro_batches = -(-short.share // short.micro_batch_size)
    steps = -(-micro_batches // args.update_freq)  # a short last step counts, as the Trainer's do
    limit = args.max_train_steps if short.stage == "train" else args.max_val_steps
    return not limit or limit >= steps


def check_short_micro_batch(
    args: Any,
    dataset: Any,
    stage: str,
    num_replicas: int,
    model: torch.nn.Module,
    forward_args: Any,
    rank: int,
) -> None:
    """ConfigError when the compiled `model` cannot take the `stage` set's short last micro-batch;
    else one warning (rank 0) when there is one."""
    short = short_micro_batch(args, dataset, stage, num_replicas)
    if short is None:
        return
    if not reaches(args, short):
        logger.debug("%s: the run stops before it (not checked)", short.describe())
        return
    source = None
    if isinstance(model, ParallelModule):
        file = getattr(sys.modules.get(type(model).__module__), "__file__", None)
        source = Path(file).read_text() if file else None
    if source is not None and forward_args is not None:
        sample = _fetch(args, dataset, short.stage, short.indices)
        broken = _violations(source, forward_args(sample))
        if broken:
            raise ConfigError(
                f"{short.describe()}, which the generated code cannot take ({'; '.join(broken[:3])}): it would "
                f"fail at the end of the first epoch. {short.fix()[0].upper()}{short.fix()[1:]}"
            )
    if rank != 0:
        return
    logger.warning(
        "%s: it runs, and its mean loss weighs as much as a full micro-batch's; to skip it, %s",
        short.describe(),
        short.fix(),
    )
