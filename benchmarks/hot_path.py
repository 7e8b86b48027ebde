"""Host syncs per training step of a compiled module, for dp, tp, pp and ZeRO 1/2/3.

Two gloo processes (spawned here, FileStore rendezvous) compile a small nanoGPT under each
configuration, run one warm-up step, then count the host reads of tensor values
(`nnscaler.runtime.dist.host_syncs.count_host_syncs`: `item`, `tolist`, `__bool__`, `__float__`,
`__int__`, `__index__`, `cpu`, `numpy`) in the next step's forward, backward and optimizer step
(`clip_gnorm(1.0)` + `step()` + `zero_grad()`) separately. Each of them is a GPU sync on CUDA
(there `torch.cuda.set_sync_debug_mode("warn")` is the real check; with --cuda on a GPU machine
the warnings are counted too). A pipeline's `train_step` runs forward and backward together:
counted as `forward_backward`. Reads made by torch.optim itself (AdamW's `step` counters, on the
CPU even under CUDA) are reported apart (`*_torch_optim_cpu_reads`), as are reads of values that live
on the host under CUDA too (`*_host_only_reads`: the per-call input-shape check of a multi-device
plan, exchanged over a gloo twin of the plan group). Prints one JSON line per configuration with the counts and the
code sites (target: 0 in forward / backward, at most 1 per optimizer step).

    python benchmarks/hot_path.py [--configs dp,tp,pp,zero1,zero2,zero3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.nanogpt.model import GPT, GPTConfig  # noqa: E402

WORLD = 2
CONFIGS = ("dp", "tp", "pp", "zero1", "zero2", "zero3")


def _compute_config(name: str) -> tuple[str, Any]:
    from nnscaler import ComputeConfig

    if name == "dp":
        return "dp", ComputeConfig(1, WORLD)
    if name == "tp":
        return "tp", ComputeConfig(WORLD, WORLD)
    if name == "pp":
        pas = {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}
        return "pp", ComputeConfig(WORLD, WORLD, use_end2end=True, pas_config=pas)
    if name.startswith("zero"):
        return "dp", ComputeConfig(1, WORLD, use_zero=True, zero_stage=int(name[-1]))
    raise ValueError(f"unknown configuration {name!r}: choose from {', '.join(CONFIGS)}")


class _Counter:
    """Counts host reads (CPU wrapper) and, on CUDA, sync warnings, per phase."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.result: dict[str, Any] = {"sites": {}}

    def phase(self, name: str, fn: Any) -> Any:
        from nnscaler.runtime.dist.host_syncs import count_host_syncs

        with warnings.catch_warnings(record=True) as caught, count_host_syncs() as syncs:
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn()
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode(0)
        self.result[name] = syncs.count
        if self.cuda:
            self.result[f"{name}_cuda_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
        if syncs.torch_optim:
            self.result[f"{name}_torch_optim_cpu_reads"] = syncs.torch_optim
        if syncs.host_only:  # reads of CPU tensors (gloo-side checks): no device sync under CUDA either
            self.result[f"{name}_host_only_reads"] = syncs.host_only
        if syncs.sites:
            self.result["sites"][name] = dict(syncs.sites)
        return out


def _run(name: str, rank: int, tmp: str, args: argparse.Namespace) -> dict[str, Any]:
    import nnscaler

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.block, vocab_size=args.vocab, n_layer=2, n_head=2, n_embd=args.embd)
    model = GPT(cfg)
    device = "cuda" if args.cuda else "cpu"

    def batch(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(args.vocab, (2, args.block), generator=g)
        return {"idx": idx.to(device), "targets": torch.roll(idx, -1, dims=1).to(device)}

    policy, config = _compute_config(name)
    data = [batch(1), batch(2)]
    pm = nnscaler.parallelize(model, data[0], policy, config, gen_savedir=os.path.join(tmp, name))
    opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    counter = _Counter(args.cuda)

    def opt_step() -> None:
        opt.clip_gnorm(1.0)  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()

    for step in range(2):  # the first step is warm-up (first-call checks, lazy state)
        dist.barrier()
        measure = counter.phase if step else (lambda _phase, fn: fn())
        if name == "pp":
            measure("forward_backward", lambda: pm.train_step(data))
        else:
            loss = measure("forward", lambda: pm(**data[0]))
            measure("backward", loss.backward)
        measure("optimizer_step", opt_step)
    return {"config": name, "rank": rank, **counter.result}


def worker(rank: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if args.cuda:  # untested here (no GPU): one GPU per process, NCCL
        torch.cuda.set_device(rank)
    backend = "nccl" if args.cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    results = [_run(name, rank, tmp, args) for name in args.configs.split(",")]
    with open(os.path.join(tmp, f"result{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--cuda", action="store_true", help="tensors on CUDA, NCCL (one GPU per process)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp, args), nprocs=WORLD, join=True)
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"result{rank}.json")) as f:
                for entry in json.load(f):
                    print(json.dumps(entry))


if __name__ == "__main__":
    main()
