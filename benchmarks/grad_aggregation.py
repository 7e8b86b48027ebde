"""Step time and bytes moved of each `ComputeConfig.grad_aggregation` mode against `mean`.

Four gloo processes (spawned here, FileStore rendezvous) train the same nanoGPT under the `dp` policy
with SGD, once per mode (`mean`, `median`, `trimmed_mean`, `zeno`; byzantine_b=1), without ZeRO and
with ZeRO stage 2, the steps of all modes alternating (benchmarks/common.py). Zeno scores on a fixed
validation micro-batch (`set_zeno_batch`). Bytes moved are counted by wrapping the collectives and
charging each what its ring algorithm sends per rank: all-reduce 2(n-1)/n of the tensor, all-gather,
reduce-scatter and all-to-all (n-1)/n of the whole buffer. Prints JSON.

    python benchmarks/grad_aggregation.py [--steps 6] [--layers 2 --embd 256 --vocab 4096 --block 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_model_args, batch, build_gpt, load_note, nparams, time_alternating  # noqa: E402

MODES = ("mean", "median", "trimmed_mean", "zeno")
SENT: dict[str, float] = {"bytes": 0.0}


def _count_collectives(world: int) -> None:
    """Wrap the collectives the reducer uses so each call adds its ring-algorithm bytes per rank."""
    share = (world - 1) / world

    def wrap(name: str, factor: float, arg: int) -> None:
        inner = getattr(dist, name, None)
        if inner is None:
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[arg]
            SENT["bytes"] += factor * share * t.numel() * t.element_size()
            return inner(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_reduce", 2.0, 0)
    for name in ("all_gather_into_tensor", "all_gather_single"):  # comm.py takes the latter where it exists
        wrap(name, 1.0, 0)  # the output: the whole gathered buffer
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        wrap(name, 1.0, 1)  # the input: the whole buffer
    wrap("all_to_all_single", 1.0, 1)


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    import nnscaler
    from nnscaler import ComputeConfig

    data = batch(args, seed=1000 + rank)
    held = batch(args, seed=999)
    systems, counters, n = {}, {}, 0
    for zero in (False, True):
        for mode in MODES:
            model = build_gpt(args)
            n = nparams(model)
            extra = {"use_zero": True, "zero_stage": 2} if zero else {}
            cfg = ComputeConfig(1, world, grad_aggregation=mode, byzantine_b=1, **extra)
            name = f"{mode}{' zero2' if zero else ''}"
            pm = nnscaler.parallelize(
                model,
                data,
                "dp",
                cfg,
                gen_savedir=os.path.join(tmp, "gen"),
                instance_name=name.replace(" ", "_"),
            )
            if mode == "zeno":
                pm.set_zeno_batch(held)
            opt = nnscaler.build_optimizer(pm, torch.optim.SGD, lr=1e-3)

            def step(pm=pm, opt=opt) -> None:
                pm(**data).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            systems[name] = step
    _count_collectives(world)
    for name, step in systems.items():  # one counted step each (after the reducers exist)
        step()
        dist.barrier()
        SENT["bytes"] = 0.0
        step()
        counters[name] = SENT["bytes"]
    times = time_alternating(systems, args.warmup, args.steps, args.rounds, barrier=dist.barrier)
    if rank == 0:
        med = {name: statistics.median(t["wall"]) for name, t in times.items()}
        rows = {}
        for name in systems:
            base = "mean zero2" if name.endswith("zero2") else "mean"
            rows[name] = {
                "step_s": round(med[name], 4),
                "vs_mean": round(med[name] / med[base], 3),
                "mb_sent_per_rank_per_step": round(counters[name] / 2**20, 3),
                "bytes_vs_mean": round(counters[name] / max(counters[base], 1), 3),
            }
        result = {
            "benchmark": "robust gradient aggregation vs mean (grad_aggregation, byzantine_b=1)",
            "model": f"nanoGPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, block {args.block}",
            "params": n,
            "gradient_mb": round(n * 4 / 2**20, 3),
            "processes": world,
            "backend": "gloo (CPU)",
            "threads_per_process": args.threads,
            "timed_steps_per_mode": len(next(iter(times.values()))["wall"]),
            "modes": rows,
            "machine": load_note(),
        }
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.set_defaults(layers=2, embd=256, heads=4, vocab=4096, block=64, steps=6, rounds=3, warmup=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, tmp, args), nprocs=world, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
