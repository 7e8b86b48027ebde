"""Train a small character-level GPT with nnscaler on CPU (gloo) or GPU (NCCL).

    torchrun --nproc_per_node 4 examples/nanogpt/train.py --plan_ngpus 2 --runtime_ngpus 4
    torchrun --nproc_per_node 4 examples/nanogpt/train.py --plan_ngpus 4 --policy pp --nmicros 4

The data is tinyshakespeare as characters (examples/nanogpt/prepare.py; without a network, or with
--offline, the docstrings of the Python standard library). Missing data is prepared first, by the
first process to take the data dir's file lock. Each data-parallel replica (runtime_ngpus /
plan_ngpus of them) draws its own random windows of train.bin; the ranks of one replica run the
plan's tensor-parallel pieces on the same batch. With --policy pp / hybrid the model runs as
pipeline stages (end-to-end mode): each step is one `train_step` over --nmicros micro-batches of
--batch_size rows each, under --scheduler.

Rank 0 shows a progress bar (or a line every tenth of the run when stdout is not a terminal), then
the first and last training loss, the validation loss before and after, and a sample of generated
text (the trained shards merged into a plain GPT with `merge_state_dicts`). The generated code lands
in {gen_savedir}/_parallel_modules/examples/nanogpt/model/GPT/_/gencode{rank}.py
(./.nnscaler/_parallel_modules/... by default).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2])
)  # run from a checkout without installing examples

import nnscaler  # noqa: E402
from examples.nanogpt.generate import eval_loss, generate, get_batch, merged_gpt  # noqa: E402
from examples.nanogpt.model import GPT, GPTConfig  # noqa: E402
from examples.nanogpt.prepare import DEFAULT_DATA_DIR, decode, encode, ensure_data, load_meta  # noqa: E402
from nnscaler import ComputeConfig, build_optimizer, parallelize  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # the summary lines below stand in for the bar
    tqdm = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan_ngpus", type=int, default=2)
    p.add_argument("--runtime_ngpus", type=int, default=-1, help="-1: $WORLD_SIZE")
    p.add_argument("--policy", default="tp", choices=["dp", "data", "tp", "pp", "hybrid"])
    p.add_argument("--nmicros", type=int, default=4, help="micro-batches per step (pp, hybrid)")
    p.add_argument("--scheduler", default="1f1b", choices=["gpipe", "1f1b", "1f1b_interleaved"])
    p.add_argument("--nstages", default="auto", help="pipeline stages (pp, hybrid)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=16, help="rows per (micro-)batch on one replica")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--eval_iters", type=int, default=8, help="batches of val.bin for the validation loss")
    p.add_argument(
        "--sample_tokens", type=int, default=200, help="characters to generate at the end (0: none)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--offline", action="store_true", help="prepare data without trying the download")
    p.add_argument("--gen_savedir", default="./.nnscaler")
    return p.parse_args(argv)


def check_same_data(meta: dict) -> None:
    """Every rank must read the same corpus (machines without a shared data dir prepare their own;
    one may have downloaded Shakespeare while another fell back to the offline corpus)."""
    if not dist.is_initialized():
        return
    mine = (meta["source"], meta["chars"], "".join(meta["itos"]))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if any(s != seen[0] for s in seen):
        kinds = sorted({f"{s[0]} ({s[1]} characters)" for s in seen})
        raise RuntimeError(
            f"the ranks read different data in --data_dir: {kinds}; prepare it once "
            "(examples/nanogpt/prepare.py) and copy it to every machine, or pass --offline everywhere"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    nnscaler.init()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    runtime = world if args.runtime_ngpus == -1 else args.runtime_ngpus
    # the first process to take the data dir's file lock prepares missing data, the others reuse it
    ensure_data(args.data_dir, offline=args.offline, verbose=rank == 0)
    meta = load_meta(args.data_dir)
    check_same_data(meta)
    train_data = np.memmap(Path(args.data_dir) / "train.bin", dtype=np.uint16, mode="r")
    val_data = np.memmap(Path(args.data_dir) / "val.bin", dtype=np.uint16, mode="r")

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=meta["vocab_size"],
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
    )
    model = GPT(config)
    val_before = (
        eval_loss(model, val_data, args.block_size, args.batch_size, args.eval_iters) if rank == 0 else 0.0
    )

    replica = rank // args.plan_ngpus
    # one stream of batches per data-parallel replica: the ranks of a replica draw the same windows
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + replica)
    batch = lambda: get_batch(train_data, args.block_size, args.batch_size, g)
    idx, targets = batch()
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
            f"compiled {model.num_params() / 1e6:.2f}M-parameter GPT (vocab {config.vocab_size}, "
            f"{meta['source']}) with policy {args.policy!r}, ComputeConfig({cfg.plan_ngpus}, "
            f"{cfg.runtime_ngpus}) in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
    optimizer = build_optimizer(pm, torch.optim.AdamW, lr=args.lr)
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=None) if rank == 0 and tqdm else None
    show_lines = rank == 0 and (bar is None or bar.disable)
    every = max(args.steps // 10, 1)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if pipelined:
            micro = []
            for _ in range(args.nmicros):
                idx, targets = batch()
                micro.append({"idx": idx.to(pm.device), "targets": targets.to(pm.device)})
            loss = torch.stack(pm.train_step(micro)).mean()
        else:
            idx, targets = batch()
            loss = pm(idx.to(pm.device), targets.to(pm.device))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if show_lines and (step % every == 0 or step == args.steps - 1):
            print(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t0

    plain = merged_gpt(pm, config)  # every rank sends its shards; rank 0 gets the single-device GPT
    if rank == 0:
        val_after = eval_loss(plain, val_data, args.block_size, args.batch_size, args.eval_iters)
        print(
            f"train loss: first {losses[0]:.4f}  last {losses[-1]:.4f}  ({args.steps} steps in {train_s:.1f}s)"
        )
        print(f"val loss: before {val_before:.4f}  after {val_after:.4f}")
        if args.sample_tokens > 0:
            prompt = "\n" if "\n" in meta["stoi"] else meta["itos"][0]
            ids = generate(plain, encode(prompt, meta["stoi"]), args.sample_tokens, seed=args.seed)
            print(
                f"sample ({args.sample_tokens} characters, top-10 sampling):\n{decode(ids, meta['itos'])}\n---"
            )
        out = Path(args.gen_savedir).resolve() / "_parallel_modules/examples/nanogpt/model/GPT/_"
        print(f"generated code: {out}/gencode{{0..{runtime - 1}}}.py", flush=True)
    nnscaler.uninit()


if __name__ == "__main__":
    main()
