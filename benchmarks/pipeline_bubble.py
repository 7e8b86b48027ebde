"""Measured pipeline bubble of nnscaler's pipeline schedules, next to the simulated and textbook ones.

Four gloo processes (spawned here, FileStore rendezvous, one torch thread each) compile a nanoGPT
(examples/nanogpt/model.py) with `nnscaler.parallelize(model, dummy, 'pp', ComputeConfig(4, 4,
use_end2end=True, pas_config={'pipeline_nmicros': m, 'pipeline_scheduler': s}))` into 4 pipeline
ranks (8 virtual stages with '1f1b_interleaved', and in a V with the zero-bubble 'zbv' and 'dualpipev'),
and time `pm.train_step(micro_batches)` for every scheduler in (gpipe, 1f1b, 1f1b_interleaved, zb_h1,
zbv, dualpipev) and every m in (4, 8, 16) (dualpipev from 8): all are compiled and warmed up first, then timed one train_step each per round, in alternating order, so that changes in
the machine's load hit all of them alike.

Each rank's compute time is the wall time spent inside the generated module's `stage*` methods
(forwards) and inside `PipelineStep.backward` / `PipelineStep.backward_loss` (backwards; for the
zero-bubble schedules also their split halves `backward_inputs` / `backward_loss_inputs` (B) and
`backward_weights` (W)), timed by
wrappers installed in this benchmark's processes (the library is not changed). Its idle fraction
in one step is 1 - compute / (wall time of train_step), averaged over the measured steps. Printed
as JSON for each (scheduler, nmicros), per rank: the measured idle fraction, the idle fraction that
`nnscaler.policies.schedules.simulate` predicts (forward 1, backward 2 time units), the textbook
bubble (p - 1) / (v * m + p - 1), and the step time.

The 4 processes share the machine's cores (see `cpu_count` in the output): with fewer cores than
ranks a rank that could compute may wait for a core, so the measured figures mix the schedule's
bubble with CPU contention; `core_share_while_computing` is the CPU time a rank got per second of
wall time spent computing (1.0: a core of its own), and `idle_breakdown_mean` splits the idle time
into blocking receives, sends, `PipelineStep.finish` and the rest. As a control, `--sleep-ms X` adds a
sleep of X ms to every rank's forward of a micro-batch (2X to its backward; split over its virtual
stages), compute that needs no core: with X well above the GPT's own compute the measured idle
fraction shows the schedule's bubble with little CPU contention.

    python benchmarks/pipeline_bubble.py [--quick] [--layers 8 --embd 256 --block 64 --micro-batch 4]
                                         [--sleep-ms 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import build_gpt, load_note, nparams  # noqa: E402

WORLD = 4
"""Pipeline ranks (processes); one pipeline stage each, two with '1f1b_interleaved'."""
SCHEDULERS = ("gpipe", "1f1b", "1f1b_interleaved", "zb_h1", "zbv", "dualpipev")
"""zbv and dualpipev run 8 stages in a V (two per rank); dualpipev needs nmicros >= 8 (skipped below)."""
NMICROS = (4, 8, 16)


KINDS = ("fwd", "bwd", "recv", "send", "finish")
"""What the timers tell apart: forwards and backwards (compute), blocking receives, sends, finish."""


class _Timers:
    """Wall and thread-CPU seconds spent in each of KINDS since the last `reset`."""

    def __init__(self) -> None:
        self.depth = 0  # a stage method that calls another is timed once
        self.sleep = dict.fromkeys(KINDS, 0.0)  # seconds of emulated compute per call (--sleep-ms)
        self.reset()

    def reset(self) -> None:
        self.wall = dict.fromkeys(KINDS, 0.0)
        self.cpu = dict.fromkeys(KINDS, 0.0)

    def wrap(self, fn: Callable[..., Any], kind: str, sleep_share: float = 1.0) -> Callable[..., Any]:
        """sleep_share: the part of the kind's --sleep-ms this call emulates (half for a split backward's B
        and W each)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                if self.sleep[kind]:
                    time.sleep(self.sleep[kind] * sleep_share)
                return fn(*args, **kwargs)
            finally:
                self.wall[kind] += time.perf_counter() - t0
                self.cpu[kind] += time.thread_time() - c0
                self.depth -= 1

        return timed


def _micro_batches(args: argparse.Namespace, nmicros: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000)
    out = []
    for _ in range(nmicros):
        idx = torch.randint(args.vocab, (args.micro_batch, args.block), generator=g)
        out.append({"idx": idx, "targets": torch.roll(idx, -1, dims=1)})
    return out


def _build(
    tmp: str, args: argparse.Namespace, timers: _Timers, scheduler: str, nmicros: int
) -> dict[str, Any]:
    """Compile the GPT for one (scheduler, nmicros) and wrap its stage methods in the timers."""
    import nnscaler
    from nnscaler import ComputeConfig

    model = build_gpt(args)
    data = _micro_batches(args, nmicros)
    cfg = ComputeConfig(
        WORLD,
        WORLD,
        use_end2end=True,
        pas_config={"pipeline_nmicros": nmicros, "pipeline_scheduler": scheduler},
    )
    t0 = time.perf_counter()
    pm = nnscaler.parallelize(
        model, data[0], "pp", cfg, gen_savedir=os.path.join(tmp, f"gen_{scheduler}_{nmicros}")
    )
    compile_s = time.perf_counter() - t0
    stages = sorted(int(m.group(1)) for name in dir(type(pm)) if (m := re.fullmatch(r"stage(\d+)", name)))
    for s in stages:  # instance attributes shadow the generated methods
        setattr(pm, f"stage{s}", timers.wrap(getattr(pm, f"stage{s}"), "fwd"))
    # --sleep-ms is per micro-batch through all of a rank's layers: split over its virtual stages
    sleep = {"fwd": args.sleep_ms / 1e3 / len(stages), "bwd": 2 * args.sleep_ms / 1e3 / len(stages)}
    return {"pm": pm, "data": data, "stages": stages, "compile_s": compile_s, "sleep": sleep, "steps": []}


def _step(run: dict[str, Any], timers: _Timers, timed: bool) -> None:
    """One train_step of a compiled configuration; when `timed`, its times go to run['steps']."""
    timers.sleep.update(run["sleep"])
    dist.barrier()  # every rank starts the step together
    timers.reset()
    t0 = time.perf_counter()
    losses = run["pm"].train_step(run["data"])
    wall = time.perf_counter() - t0
    run["pm"].zero_grad()
    run["loss"] = float(losses[0])
    if timed:
        run["steps"].append(
            {"wall": wall, **timers.wall, "compute_cpu": timers.cpu["fwd"] + timers.cpu["bwd"]}
        )


def _summarize(scheduler: str, nmicros: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One (scheduler, nmicros) entry of the output from every rank's step times."""
    from nnscaler.policies.schedules import simulate, theoretical_bubble

    nstages = sum(len(r["stages"]) for r in ranks)
    mean = statistics.fmean
    nsteps = len(ranks[0]["steps"])
    step_s = [max(r["steps"][i]["wall"] for r in ranks) for i in range(nsteps)]

    def fraction(r: dict[str, Any], *kinds: str) -> float:
        """Mean over the measured steps of the share of the step's wall time spent in `kinds`."""
        return mean(sum(s[k] for k in kinds) / s["wall"] for s in r["steps"])

    idle = [1 - fraction(r, "fwd", "bwd") for r in ranks]
    compute = [sum(s["fwd"] + s["bwd"] for s in r["steps"]) for r in ranks]
    share = [sum(s["compute_cpu"] for s in r["steps"]) / c for r, c in zip(ranks, compute)]
    breakdown = {k: mean(fraction(r, k) for r in ranks) for k in ("recv", "send", "finish")}
    breakdown["other"] = mean(1 - fraction(r, *KINDS) for r in ranks)
    # one rank's forward (backward) of one micro-batch through all the layers it holds
    fwd = [mean(s["fwd"] for s in r["steps"]) / nmicros for r in ranks]
    bwd = [mean(s["bwd"] for s in r["steps"]) / nmicros for r in ranks]
    sim = simulate(scheduler, nstages, WORLD, nmicros).idle_fraction

    def r4(xs: list[float] | tuple[float, ...]) -> list[float]:
        return [round(x, 4) for x in xs]

    return {
        "scheduler": scheduler,
        "nmicros": nmicros,
        "nstages": nstages,
        "stages_per_rank": [r["stages"] for r in ranks],
        "measured_idle_per_rank": r4(idle),
        "measured_idle_mean": round(mean(idle), 4),
        "simulated_idle_per_rank": r4(sim),
        "simulated_idle_mean": round(mean(sim), 4),
        "theoretical_bubble": round(theoretical_bubble(scheduler, nstages, WORLD, nmicros), 4),
        "idle_breakdown_mean": {k: round(v, 4) for k, v in breakdown.items()},
        "step_s_median": round(statistics.median(step_s), 4),
        "step_s": r4(step_s),
        "fwd_ms_per_micro_per_rank": [round(x * 1e3, 2) for x in fwd],
        "bwd_ms_per_micro_per_rank": [round(x * 1e3, 2) for x in bwd],
        "core_share_while_computing_per_rank": r4(share),
        "compile_s": round(ranks[0]["compile_s"], 2),
        "first_micro_batch_loss": round(ranks[-1]["loss"], 4),
    }


def worker(rank: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD)
    )
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    from nnscaler.runtime.pipeline import PipelineStep

    timers = _Timers()
    PipelineStep.backward = timers.wrap(PipelineStep.backward, "bwd")
    PipelineStep.backward_loss = timers.wrap(PipelineStep.backward_loss, "bwd")
    for name in ("backward_inputs", "backward_loss_inputs", "backward_weights"):  # zero-bubble B and W
        setattr(PipelineStep, name, timers.wrap(getattr(PipelineStep, name), "bwd", 0.5))
    for name, kind in [
        ("recv_forward", "recv"),
        ("recv_backward", "recv"),
        ("send_forward", "send"),
        ("send_backward", "send"),
        ("finish", "finish"),
    ]:
        setattr(PipelineStep, name, timers.wrap(getattr(PipelineStep, name), kind))

    configs = [
        (scheduler, nmicros)
        for scheduler in args.schedulers
        for nmicros in args.nmicros
        if scheduler != "dualpipev"
        or nmicros >= 2 * WORLD  # DualPipeV: at least as many micro-batches as stages
    ]
    runs = {c: _build(tmp, args, timers, *c) for c in configs}
    for run in runs.values():
        for _ in range(args.warmup):
            _step(run, timers, timed=False)
    # the timed steps go round the configurations (in alternating order), so that changes in the
    # machine's load over the run hit every configuration alike
    for i in range(args.steps):
        for c in configs if i % 2 == 0 else configs[::-1]:
            _step(runs[c], timers, timed=True)

    results = []
    for scheduler, nmicros in configs:
        run = runs[scheduler, nmicros]
        mine = {k: run[k] for k in ("stages", "compile_s", "steps", "loss")}
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            results.append(_summarize(scheduler, nmicros, gathered))
            r = results[-1]
            print(
                f"[pipeline_bubble] {scheduler} nmicros={nmicros}: measured idle "
                f"{r['measured_idle_mean']:.3f}, simulated {r['simulated_idle_mean']:.3f}, "
                f"step {r['step_s_median']:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    if rank == 0:
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=8, help="transformer blocks (>= 8 for 8 virtual stages)"
    )
    parser.add_argument(
        "--embd",
        type=int,
        default=256,
        help="width; 256 makes a stage's forward ~10 ms of CPU, long against the OS scheduler's time slices",
    )
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--block", type=int, default=64, help="sequence length")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed train_steps per configuration")
    parser.add_argument(
        "--steps", type=int, default=4, help="timed train_steps per configuration (one per round)"
    )
    parser.add_argument("--nmicros", type=int, nargs="+", default=list(NMICROS))
    parser.add_argument("--schedulers", nargs="+", default=list(SCHEDULERS), choices=SCHEDULERS)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: nmicros 4 and 8, 1 warm-up and 2 timed steps"
    )
    parser.add_argument("--only-8", action="store_true", help="nmicros 8 only (the issue's comparison)")
    parser.add_argument(
        "--sleep-ms",
        type=float,
        default=0.0,
        help="control: a sleep added to a rank's forward of a micro-batch (twice that to its backward)",
    )
    args = parser.parse_args()
    if args.quick:
        args.nmicros, args.warmup, args.steps = [4, 8], 1, 2
    if args.only_8:
        args.nmicros = [8]
    start, load_before = time.perf_counter(), load_note()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(tmp, args), nprocs=WORLD, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            results = json.load(f)
    gpt = build_gpt(args)
    out = {
        "benchmark": "pipeline bubble: measured vs simulated idle fraction per pipeline rank",
        "model": (
            f"nanoGPT {args.layers} layers, n_embd {args.embd}, {args.heads} heads, vocab {args.vocab}, "
            f"block {args.block}"
        ),
        "params": nparams(gpt),
        "micro_batch": args.micro_batch,
        "sleep_ms_per_forward": args.sleep_ms,
        "policy": "pp",
        "pipeline_ranks": WORLD,
        "backend": "gloo (CPU)",
        "threads_per_process": 1,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "cpu_count": os.cpu_count(),
        "note": (
            f"{WORLD} processes share cpu_count={os.cpu_count()} CPU cores (with whatever else runs on the "
            "machine, see machine_before/after): a rank whose input is ready may wait for a core, and its "
            "peers wait on it in recv, which inflates the measured idle fraction above the schedule's own "
            "bubble (core_share_while_computing: CPU seconds per wall second inside compute, 1.0 = a core "
            "of its own). idle = 1 - (wall time in stage forwards + PipelineStep.backward/backward_loss) / "
            "train_step wall time; idle_breakdown_mean splits the rest into blocking receives, sends, "
            "finish (wait for sends, tied-weight gradient all-reduce, loss broadcast) and other. "
            "simulated = schedules.simulate with forward 1, backward 2 time units; theoretical = "
            "(p-1)/(v*m+p-1)."
        ),
        "machine_before": load_before,
        "machine_after": load_note(),
        "results": results,
        "total_s": round(time.perf_counter() - start, 1),
    }
    print(_dumps(out))


def _dumps(value: Any, indent: int = 0) -> str:
    """JSON with one line per field of a dict, and lists without dicts and flat dicts on one line."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and any(isinstance(v, (dict, list)) for v in value.values()):
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(pad + _dumps(v, indent + 1) for v in value) + "\n" + " " * indent + "]"
    return json.dumps(value)


if __name__ == "__main__":
    main()
