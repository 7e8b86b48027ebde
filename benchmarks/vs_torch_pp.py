"""Step time, peak memory and measured bubble of nnscaler's pipeline schedules against
`torch.distributed.pipelining`, side by side on this CPU.

The same Llama (vs_torch_common.LlamaLM, 8 layers by default), 4 pipeline ranks over gloo, one thread
per process, the same micro-batches, AdamW; the same stage split on both sides (stage k of n starts at
layer k * layers / n; the embedding on the first stage, the final norm, head and loss on the last):
- ours: `nnscaler.parallelize(model, micro_batch, 'pp', ComputeConfig(4, 4, use_end2end=True,
  pas_config={'pipeline_scheduler': s, 'pipeline_nmicros': m, 'pipeline_stages': [...]}))` and
  `pm.train_step(micro_batches)`;
- torch: each rank's stages as `PipelineStage`s of hand-cut stage modules (the same weights) run by
  the matching schedule: 1f1b -> `Schedule1F1B`, 1f1b_interleaved (two stages per rank) ->
  `ScheduleInterleaved1F1B`, zb_h1 -> `ScheduleInterleavedZeroBubble` (one stage per rank), zbv
  (two stages per rank in a V) -> `ScheduleZBVZeroBubble`, dualpipev -> `ScheduleDualPipeV`. A
  zero-bubble row runs our side only when our scheduler name is in
  `nnscaler.policies.plan.SCHEDULERS`; otherwise it prints as pending (torch's side alone).

Bubble: each rank's compute time is the wall time inside the stage forwards and backwards (ours: the
generated `stage*` methods and `PipelineStep.backward*`; torch's: `forward_one_chunk`,
`backward_one_chunk`, `backward_weight_one_chunk`), timed by wrappers installed in this benchmark's
processes; a rank's bubble share is 1 - compute / step wall time, averaged over the timed steps.

    python benchmarks/vs_torch_pp.py [--schedules 1f1b 1f1b_interleaved zb_h1 zbv dualpipev] [--nmicros 8] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.vs_torch_common import (  # noqa: E402
    add_llama_args,
    build_llama,
    compare,
    describe_llama,
    finish_rank,
    init_rank,
    launch,
    llama_batch,
    machine,
    measure,
    side_summary,
)

WORLD = 4
TORCH_SCHEDULES = {
    # ours -> (torch's schedule class, stages per rank, placement of a rank's stages)
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "1f1b_interleaved": ("ScheduleInterleaved1F1B", 2, "loop"),
    "zb_h1": ("ScheduleInterleavedZeroBubble", 1, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


def stage_ids(rank: int, per_rank: int, placement: str) -> list[int]:
    """The global stage indices a rank holds: r, r + p, ... (loop) or r, 2p - 1 - r (V shape)."""
    if placement == "v":
        return [rank, 2 * WORLD - 1 - rank]
    return [rank + k * WORLD for k in range(per_rank)]


def stage_starts(layers: int, nstages: int) -> list[int]:
    if layers % nstages:
        raise SystemExit(f"--layers {layers} must be a multiple of the {nstages} stages")
    return [k * layers // nstages for k in range(nstages)]


class LlamaStage(nn.Module):
    """Layers [lo, hi) of LlamaLM as one stage of torch's pipeline (the embedding on the first stage,
    the final norm and head on the last), sharing the model's modules."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = model.lm.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        rope = self.rotary(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ComputeTimer:
    """Wall seconds spent inside wrapped compute methods (`seconds`) and inside the pipeline's train
    step (`window`, the optimizer step left out)."""

    def __init__(self) -> None:
        self.depth, self.seconds, self.window_s = 0, 0.0, 0.0

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.window_s = time.perf_counter() - t0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.depth -= 1

        return timed


def micro_batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    return [llama_batch(args, batch=args.micro_batch, seed=1000 + i) for i in range(args.nmicros)]


def _ours_config(args: argparse.Namespace, schedule: str) -> Any:
    import nnscaler

    nstages = WORLD * TORCH_SCHEDULES[schedule][1]
    starts = [f"lm.model.layers.{i}" for i in stage_starts(args.layers, nstages)[1:]]
    pas = {"pipeline_scheduler": schedule, "pipeline_nmicros": args.nmicros, "pipeline_stages": starts}
    return nnscaler.ComputeConfig(WORLD, WORLD, use_end2end=True, pas_config=pas)


def ours_step(args: argparse.Namespace, schedule: str, gen: str, timer: ComputeTimer) -> Callable[[], float]:
    import re

    import nnscaler
    from nnscaler.runtime.pipeline import PipelineStep

    for name in [n for n in vars(PipelineStep) if n.startswith("backward")]:
        setattr(PipelineStep, name, timer.wrap(getattr(PipelineStep, name)))
    data = micro_batches(args)
    pm = nnscaler.parallelize(build_llama(args), data[0], "pp", _ours_config(args, schedule), gen_savedir=gen)
    for name in dir(type(pm)):
        if re.fullmatch(r"stage\d+", name):  # instance attributes shadow the generated methods
            setattr(pm, name, timer.wrap(getattr(pm, name)))
    opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def step() -> float:
        with timer.window():
            losses = pm.train_step(data)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(sum(float(x) for x in losses) / len(losses))

    return step


def torch_step(args: argparse.Namespace, schedule: str, timer: ComputeTimer) -> Callable[[], float]:
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining.stage import _PipelineStageBase

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(_PipelineStageBase, name, timer.wrap(getattr(_PipelineStageBase, name)))
    cls_name, per_rank, placement = TORCH_SCHEDULES[schedule]
    nstages = WORLD * per_rank
    model = build_llama(args)
    starts = stage_starts(args.layers, nstages) + [args.layers]
    rank = dist.get_rank()
    stages = []
    for s in stage_ids(rank, per_rank, placement):
        module = LlamaStage(model, starts[s], starts[s + 1], first=s == 0, last=s == nstages - 1)
        stages.append(pipelining.PipelineStage(module, s, nstages, torch.device("cpu")))
    del model  # the layers of other ranks' stages are freed: each rank holds its stages only
    gc.collect()
    cls = getattr(pipelining, cls_name)
    sched = cls(stages[0] if cls_name == "Schedule1F1B" else stages, args.nmicros, loss_fn=lm_loss)
    opt = torch.optim.AdamW([p for stage in stages for p in stage.submod.parameters()], lr=1e-4)
    data = micro_batches(args)
    ids = torch.cat([d["input_ids"] for d in data])
    labels = torch.cat([d["labels"] for d in data])
    mine = stage_ids(rank, per_rank, placement)
    holds_first, holds_last = 0 in mine, nstages - 1 in mine

    def step() -> float:
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if holds_last else {}
        with timer.window():
            sched.step(ids, **kwargs) if holds_first else sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        dist.broadcast(mean, src=_last_rank(per_rank, placement))
        return float(mean)

    return step


def _last_rank(per_rank: int, placement: str) -> int:
    nstages = WORLD * per_rank
    return next(r for r in range(WORLD) if nstages - 1 in stage_ids(r, per_rank, placement))


def worker(
    rank: int, world: int, tmp: str, args: argparse.Namespace, side: str, schedule: str, gen: str
) -> None:
    baseline = init_rank(rank, world, tmp, args.threads)
    timer = ComputeTimer()
    if side == "ours":
        step = ours_step(args, schedule, gen, timer)
    else:
        step = torch_step(args, schedule, timer)

    compute: list[float] = []

    def timed_step() -> float:
        timer.seconds = 0.0
        loss = step()
        compute.append(timer.seconds / timer.window_s)
        return loss

    out = measure(timed_step, args, baseline)
    timed = compute[args.warmup :]
    out["bubble_share"] = round(1 - statistics.fmean(timed), 4)
    finish_rank(tmp, rank, out)


def pending_reason(schedule: str) -> str | None:
    from nnscaler.policies.plan import SCHEDULERS

    if schedule not in SCHEDULERS:
        return (
            f"pending: our pipeline_scheduler {schedule!r} is not in nnscaler.policies.plan.SCHEDULERS "
            f"{list(SCHEDULERS)} yet (zero-bubble schedules are being added under issue 44)"
        )
    return None


def _with_bubble(summary: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    summary["bubble_share_per_rank"] = [r["bubble_share"] for r in ranks]
    summary["bubble_share_mean"] = round(statistics.fmean(r["bubble_share"] for r in ranks), 4)
    return summary


def run_schedule(args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    import nnscaler

    cls_name, per_rank, _ = TORCH_SCHEDULES[schedule]
    row: dict[str, Any] = {"schedule": schedule, "torch_schedule": cls_name, "stages": WORLD * per_rank}
    reason = pending_reason(schedule)
    if reason:  # torch's side alone, for when ours lands
        theirs_ranks = launch(worker, WORLD, args, "torch", schedule, "")
        return {**row, "status": reason, "torch": _with_bubble(side_summary(theirs_ranks), theirs_ranks)}
    with tempfile.TemporaryDirectory() as gen:
        data = micro_batches(args)
        nnscaler.parallelize(
            build_llama(args), data[0], "pp", _ours_config(args, schedule), gen_savedir=gen, load_module=False
        )
        try:
            ours_ranks = launch(worker, WORLD, args, "ours", schedule, gen)
        except Exception as e:  # noqa: BLE001  a failing row is reported, the others still run
            return {**row, "status": f"ours failed: {type(e).__name__}: {str(e).strip()[-600:]}"}
    theirs_ranks = launch(worker, WORLD, args, "torch", schedule, "")
    ours = _with_bubble(side_summary(ours_ranks), ours_ranks)
    theirs = _with_bubble(side_summary(theirs_ranks), theirs_ranks)
    row.update(compare(ours, theirs), ours=ours, torch=theirs)
    print(f"[vs_torch_pp] {schedule}: ratio {row['ratio']}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_args(parser, layers=8)
    parser.add_argument("--nmicros", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument(
        "--schedules", nargs="+", default=list(TORCH_SCHEDULES), choices=list(TORCH_SCHEDULES)
    )
    args = parser.parse_args(argv)
    before = machine()
    rows = [run_schedule(args, s) for s in args.schedules]
    result = {
        "benchmark": "nnscaler pp vs torch.distributed.pipelining",
        "model": describe_llama(args),
        "params": build_llama(args).lm.num_parameters(),
        "pipeline_ranks": WORLD,
        "nmicros": args.nmicros,
        "micro_batch": args.micro_batch,
        "stage_split": "stage k of n starts at layer k*layers/n on both sides (ours: pipeline_stages)",
        "backend": "gloo (CPU)",
        "threads_per_process": args.threads,
        "optimizer": "AdamW(lr=1e-4)",
        "timing": f"{args.warmup} warm-up steps, median of {args.steps} timed train steps (slowest rank), "
        "one process launch per side",
        "bubble": "1 - (wall time in stage forwards/backwards) / wall time of the pipeline step (optimizer step excluded), per rank, mean of timed steps",
        "target": 1.0,
        "rows": rows,
        "machine_before": before,
        "machine_after": machine(),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
