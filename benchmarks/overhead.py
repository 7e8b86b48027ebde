"""Overhead of a compiled module on one process: `ComputeConfig(1, 1)` against the plain module.

Trains the same ~20M-parameter nanoGPT with AdamW twice in one process: the plain module with a
plain optimizer, and `nnscaler.parallelize(model, dummy, 'dp', ComputeConfig(1, 1))` with
`nnscaler.build_optimizer`. Prints JSON with the median step times and their ratio (target <= 1.02).

    python benchmarks/overhead.py [--steps 10] [--layers 6 --embd 512 --vocab 8192 --block 128]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import nnscaler
    from nnscaler import ComputeConfig

    model = build_gpt(args)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    data = batch(args, seed=1000)
    with tempfile.TemporaryDirectory() as tmp:
        pm = nnscaler.parallelize(model, data, "dp", ComputeConfig(1, 1), gen_savedir=tmp)
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
        {"nnscaler": stepper("nnscaler", pm, nn_opt), "plain": stepper("plain", plain, plain_opt)},
        args.warmup,
        args.steps,
        args.rounds,
    )
    print(
        json.dumps(
            {
                "benchmark": "ComputeConfig(1, 1) parallelized module vs the plain module",
                "model": f"nanoGPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, block {args.block}",
                "params": n,
                "threads": torch.get_num_threads(),
                "batch": args.batch,
                **summarize(times, "nnscaler", "plain"),
                "target": 1.02,
                "first_loss_equal": abs(losses["nnscaler"] - losses["plain"]) < 1e-5,
                "machine": load_note(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
