"""Shared pieces of the side-by-side benchmarks against torch's own parallelism (vs_torch_tp.py,
vs_torch_pp.py, vs_torch_cp.py): the Llama both sides train, one gloo process launch per side, the
step timer with the peak resident memory of each rank, an optional cProfile table per rank, and
the JSON row comparing the two sides.

Memory: every rank records its resident memory (VmRSS) after imports and process-group setup, before
the model is built; after the warm-up steps glibc's free lists are trimmed and the kernel's
high-water mark is reset (/proc/self/clear_refs), and `peak_rss_delta_mb` is the high-water mark
over the timed steps (VmHWM) minus that baseline: parameters, gradients, optimizer state,
activations and communication buffers together, as the OS sees them. Processes start with glibc's
mmap threshold fixed at 64 KiB, so that freed tensors leave the RSS.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import importlib
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

Step = Callable[[], float]
"""One training step of one side; returns the step's loss."""


# ---- the model ---------------------------------------------------------------------------------------


def add_llama_args(parser: argparse.ArgumentParser, layers: int = 10) -> None:
    """The Llama's sizes (defaults: ~50M parameters) and the timing options."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side (the median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the timed steps; a top-cost table per rank"
    )


class LlamaLM(nn.Module):
    """transformers' LlamaForCausalLM with the loss written out: mean cross entropy of the logits
    against already-shifted labels. Positions are passed to the Llama explicitly so that torch's
    sequence parallelism (which hands the model sequence shards) sees the whole sequence's positions;
    `position_ids` (default: 0..S-1) lets torch's context parallelism pass each rank's positions."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.lm = LlamaForCausalLM(config)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        positions = position_ids
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        logits = self.lm(input_ids=input_ids, position_ids=positions).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build_llama(args: argparse.Namespace, seed: int = 0) -> LlamaLM:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 64),
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaLM(config).float().train()


def llama_batch(
    args: argparse.Namespace, batch: int | None = None, seed: int = 1000
) -> dict[str, torch.Tensor]:
    """Token ids and next-token labels (a separate tensor: torch.export would merge identical inputs)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(args.vocab, ((batch or args.batch), args.seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}


def nparams(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe_llama(args: argparse.Namespace) -> str:
    return (
        f"transformers LlamaForCausalLM: {args.layers} layers, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, {args.heads} heads ({args.kv_heads} KV), vocab {args.vocab}, seq {args.seq}, "
        "untied head, sdpa attention, fp32"
    )


# ---- processes ---------------------------------------------------------------------------------------


def init_rank(rank: int, world: int, tmp: str, threads: int) -> int:
    """Join the gloo group of this launch; returns the resident memory (KiB) before any model."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for name in (
        "nnscaler",
        "transformers",
        "torch.distributed.pipelining",
        "torch.distributed.tensor.parallel",
    ):
        importlib.import_module(name)  # imported on both sides before the baseline

    dist.barrier()
    _trim()
    return _status_kb("VmRSS")


def finish_rank(tmp: str, rank: int, result: dict[str, Any]) -> None:
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def launch(worker: Callable[..., None], world: int, *args: Any) -> list[dict[str, Any]]:
    """One process launch of one side: `worker(rank, world, tmp, *args)` in `world` spawned
    processes; returns what each rank passed to `finish_rank`."""
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(world, tmp, *args), nprocs=world, start_method="spawn")
            out = []
            for r in range(world):
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    out.append(json.load(f))
            return out
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


# ---- timing ------------------------------------------------------------------------------------------


def measure(step: Step, args: argparse.Namespace, baseline_kb: int) -> dict[str, Any]:
    """Warm-up steps, then the timed steps (each after a barrier): their wall times, losses, the peak
    resident memory over them minus `baseline_kb`, and (with --profile) the top costs."""
    losses = [step() for _ in range(args.warmup)]
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    times: list[float] = []
    prof = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        losses.append(step())
        if prof is not None:
            prof.disable()
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "step_s": times,
        "losses": losses,
        "peak_rss_delta_mb": round((_status_kb("VmHWM") - baseline_kb) / 1024, 1),
    }
    if prof is not None:
        out["profile"] = top_costs(prof, args.steps)
    return out


def top_costs(prof: cProfile.Profile, steps: int, n: int = 12) -> list[str]:
    """The `n` functions with the most own time, per step: 'ms/step  calls/step  function'."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(file)}:{line}({name})" if line else name
        rows.append((tottime, cumtime, ncalls, where))
    rows.sort(reverse=True)
    return [
        f"{t / steps * 1e3:8.1f} ms own {c / steps * 1e3:8.1f} ms cum {k / steps:7.0f} calls  {w}"
        for t, c, k, w in rows[:n]
    ]


def side_summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures: the median over timed steps of the slowest rank's step time."""
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    out = {
        "step_s_median": round(statistics.median(steps), 4),
        "step_s": [round(s, 4) for s in steps],
        "peak_rss_delta_mb_per_rank": [r["peak_rss_delta_mb"] for r in ranks],
        "first_loss": round(ranks[-1]["losses"][0], 5),
    }
    if "profile" in ranks[0]:
        out["profile_rank0"] = ranks[0]["profile"]
    return out


def compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The ratios ours / torch: step time (target <= 1.0) and the largest rank's peak memory."""
    return {
        "ratio": round(ours["step_s_median"] / theirs["step_s_median"], 4),
        "peak_mem_ratio": round(
            max(ours["peak_rss_delta_mb_per_rank"]) / max(max(theirs["peak_rss_delta_mb_per_rank"]), 1e-9), 4
        ),
        "first_loss_agrees": abs(ours["first_loss"] - theirs["first_loss"]) < 1e-3,
    }


def machine() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"
    except OSError:
        return "unknown"
