"""Step time of nnscaler's data parallelism against torch DistributedDataParallel.

Two gloo processes (spawned here, FileStore rendezvous) train the same ~20M-parameter nanoGPT with
AdamW: once compiled with `nnscaler.parallelize(model, dummy, 'dp', ComputeConfig(1, 2))` (defaults:
overlapped bucketed reduction) and `nnscaler.build_optimizer`, once wrapped in
`torch.nn.parallel.DistributedDataParallel`. Prints JSON with the median step times and their
ratio (target: nnscaler / DDP <= 1.0).

    python benchmarks/vs_ddp.py [--steps 10] [--layers 6 --embd 512 --vocab 8192 --block 128]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_model_args,
    batch,
    build_gpt,
    load_note,
    nparams,
    summarize,
    time_alternating,
)


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    import nnscaler
    from nnscaler import ComputeConfig

    model = build_gpt(args)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    data = batch(args, seed=1000 + rank)
    cfg = ComputeConfig(1, world, reducer_bucket_cap_mb=args.bucket_cap_mb)
    pm = nnscaler.parallelize(model, data, "dp", cfg, gen_savedir=os.path.join(tmp, "gen"))
    nn_opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    n = nparams(model)
    del model

    losses: dict[str, float] = {}

    def stepper(name: str, module: torch.nn.Module, opt: torch.optim.Optimizer):
        def step() -> None:
            loss = module(**data)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.setdefault(name, loss.item())

        return step

    times = time_alternating(
        {"nnscaler": stepper("nnscaler", pm, nn_opt), "ddp": stepper("ddp", ddp, ddp_opt)},
        args.warmup,
        args.steps,
        args.rounds,
        barrier=dist.barrier,
    )
    if rank == 0:
        result = {
            "benchmark": "nnscaler dp vs torch DistributedDataParallel",
            "model": f"nanoGPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, block {args.block}",
            "params": n,
            "processes": world,
            "backend": "gloo (CPU)",
            "threads_per_process": args.threads,
            "batch_per_rank": args.batch,
            **summarize(times, "nnscaler", "ddp"),
            "target": 1.0,
            "first_loss_equal": abs(losses["nnscaler"] - losses["ddp"]) < 1e-5,
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
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    args = parser.parse_args()
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, tmp, args), nprocs=world, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
