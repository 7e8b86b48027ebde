"""Shared pieces of the step-time benchmarks: the ~20M-parameter GPT, its batches, and a timer that
alternates between the systems under test so that drift in machine load hits both alike."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from examples.nanogpt.model import GPT, GPTConfig


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per system")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument(
        "--rounds", type=int, default=10, help="timed steps are split into alternating rounds"
    )


def build_gpt(args: argparse.Namespace, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        block_size=args.block,
        vocab_size=args.vocab,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
        dropout=0.0,
    )
    return GPT(cfg)


def batch(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(args.vocab, (args.batch, args.block), generator=g)
    return {"idx": idx, "targets": torch.roll(idx, -1, dims=1)}


def nparams(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def time_alternating(
    systems: dict[str, Callable[[], None]],
    warmup: int,
    steps: int,
    rounds: int,
    barrier: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, list[float]]]:
    """Wall-clock and process CPU seconds of each timed step of each system: warm-up steps, then
    `rounds` rounds in which every system runs `steps / rounds` steps in turn (the order flips every
    round), so that drifts in machine load hit all systems alike."""
    for step in systems.values():
        for _ in range(warmup):
            step()
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in systems}
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        order = list(systems.items()) if r % 2 == 0 else list(systems.items())[::-1]
        for name, step in order:
            for _ in range(per_round):
                barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                times[name]["wall"].append(time.perf_counter() - t0)
                times[name]["cpu"].append(time.process_time() - c0)
    return times


def summarize(times: dict[str, dict[str, list[float]]], ours: str, theirs: str) -> dict[str, object]:
    """Median step times, their ratio (the headline figure), the median of per-round paired ratios,
    and the same ratio for process CPU time (less sensitive to other load on the machine)."""
    a, b = times[ours], times[theirs]
    med = statistics.median
    return {
        f"{ours}_step_s": round(med(a["wall"]), 4),
        f"{theirs}_step_s": round(med(b["wall"]), 4),
        "ratio": round(med(a["wall"]) / med(b["wall"]), 4),
        "paired_ratio_median": round(med([x / y for x, y in zip(a["wall"], b["wall"])]), 4),
        "cpu_ratio": round(med(a["cpu"]) / med(b["cpu"]), 4),
        "timed_steps": len(a["wall"]),
        f"{ours}_steps_s": [round(t, 4) for t in a["wall"]],
        f"{theirs}_steps_s": [round(t, 4) for t in b["wall"]],
    }


def load_note() -> str:
    """The machine's load average while the benchmark ran (other processes skew wall-clock times)."""
    try:
        one, five, fifteen = os.getloadavg()
        return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"
    except OSError:
        return "unknown"
