"""Train a small GPT with nnscaler on CPU (gloo) or GPU (NCCL), on synthetic tokens made locally.

    torchrun --nproc_per_node 4 examples/nanogpt/train.py --plan_ngpus 2 --runtime_ngpus 4
    torchrun --nproc_per_node 4 examples/nanogpt/train.py --plan_ngpus 4 --policy pp --nmicros 4

With --policy pp / hybrid the model runs as pipeline stages (end-to-end mode): each step is one
`train_step` over --nmicros micro-batches of --batch_size rows each, under --scheduler.

Each data-parallel replica (runtime_ngpus / plan_ngpus of them) reads its own batches; the ranks of one
replica run the plan's tensor-parallel pieces. The generated code lands in
./.nnscaler/_parallel_modules/examples/nanogpt/model/GPT/_/gencode{rank}.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2])
)  # run from a checkout without installing examples

import nnscaler  # noqa: E402
from examples.nanogpt.model import GPT, GPTConfig  # noqa: E402
from nnscaler import ComputeConfig, build_optimizer, parallelize  # noqa: E402


def synthetic_tokens(vocab: int, block: int, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable toy language: each sequence counts upward from a random start, modulo the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    seq = (start + torch.arange(block + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--plan_ngpus", type=int, default=2)
    parser.add_argument("--runtime_ngpus", type=int, default=-1, help="-1: $WORLD_SIZE")
    parser.add_argument("--policy", default="tp", choices=["dp", "data", "tp", "pp", "hybrid"])
    parser.add_argument("--nmicros", type=int, default=4, help="micro-batches per step (pp, hybrid)")
    parser.add_argument("--scheduler", default="1f1b", choices=["gpipe", "1f1b", "1f1b_interleaved"])
    parser.add_argument("--nstages", default="auto", help="pipeline stages (pp, hybrid)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--gen_savedir", default="./.nnscaler")
    args = parser.parse_args()

    nnscaler.init()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    runtime = world if args.runtime_ngpus == -1 else args.runtime_ngpus
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    model = GPT(config)
    idx, targets = synthetic_tokens(config.vocab_size, config.block_size, args.batch_size, seed=0)
    pipelined = args.policy in ("pp", "hybrid")
    pas = {"pipeline_nmicros": args.nmicros, "pipeline_scheduler": args.scheduler}
    if args.nstages != "auto":
        pas["pipeline_nstages"] = int(args.nstages)
    cfg = ComputeConfig(args.plan_ngpus, runtime, use_end2end=pipelined, pas_config=pas if pipelined else {})
    t0 = time.perf_counter()
    pm = parallelize(
        model, {"idx": idx, "targets": targets}, args.policy, cfg, gen_savedir=args.gen_savedir, reuse="moo"
    )
    if rank == 0:
        print(
            f"compiled {model.num_params() / 1e6:.2f}M-parameter GPT with policy {args.policy!r}, "
            f"ComputeConfig({cfg.plan_ngpus}, {cfg.runtime_ngpus}) in {time.perf_counter() - t0:.1f}s"
        )
    optimizer = build_optimizer(pm, torch.optim.AdamW, lr=3e-3)
    replica = rank // args.plan_ngpus
    for step in range(args.steps):
        seed = 1 + step * cfg.dp_size + replica
        if pipelined:
            micro = []
            for m in range(args.nmicros):
                idx, targets = synthetic_tokens(
                    config.vocab_size, config.block_size, args.batch_size, seed=seed * 1000 + m
                )
                micro.append({"idx": idx.to(pm.device), "targets": targets.to(pm.device)})
            loss = torch.stack(pm.train_step(micro)).mean()
        else:
            idx, targets = synthetic_tokens(config.vocab_size, config.block_size, args.batch_size, seed=seed)
            loss = pm(idx.to(pm.device), targets.to(pm.device))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        out = Path(args.gen_savedir).resolve() / "_parallel_modules/examples/nanogpt/model/GPT/_"
        print(f"generated code: {out}/gencode{{0..{runtime - 1}}}.py")
    nnscaler.uninit()


if __name__ == "__main__":
    main()
