"""Step time and peak memory of nnscaler's context parallelism against torch's
(`torch.distributed.tensor.experimental.context_parallel`), side by side on this CPU where torch's runs.

The same Llama (vs_torch_common.LlamaLM), one long-ish sequence per step, AdamW, gloo, one thread per
process; cp 2 and 4:
- ours: `nnscaler.parallelize(model, batch, 'tp', ComputeConfig(cp, cp, pas_config={'cp_size': cp,
  'cp_kind': kind}))` (code generated beforehand in the parent) and `nnscaler.build_optimizer`;
- torch: the model wrapped in DistributedDataParallel over the cp ranks (gradients summed over the
  sequence shards, as torchtitan's FSDP over its cp axis does) and each step run inside
  `context_parallel(mesh, buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1])`
  (the sequence sharded with torch's head-tail load balancing, SDPA swapped for ring attention).

torch's context parallelism handles only the CUDA SDPA kernels (flash, memory-efficient, cuDNN): on CPU
SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`, which has no DTensor sharding strategy,
so torch's side raises at the first attention. The script first runs one causal SDPA under torch's
context_parallel on every rank (the same call transformers makes); where that raises it prints the
error, where it was raised, and torch's table of the kernels its context parallelism handles, and the
rows carry ours alone; where it runs, torch's side is timed like ours.

    python benchmarks/vs_torch_cp.py [--cp 2 4] [--cp-kind zigzag] [--seq 512] [--profile]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist

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


def ours_config(world: int, kind: str) -> Any:
    import nnscaler

    return nnscaler.ComputeConfig(world, world, pas_config={"cp_size": world, "cp_kind": kind})


def ours_step(args: argparse.Namespace, world: int, gen: str) -> Any:
    import nnscaler

    data = llama_batch(args)
    pm = nnscaler.parallelize(
        build_llama(args), data, "tp", ours_config(world, args.cp_kind), gen_savedir=gen
    )
    opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def step() -> float:
        loss = pm(**data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def torch_step(args: argparse.Namespace, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.parallel.DistributedDataParallel(build_llama(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = llama_batch(args)
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)

    def step() -> float:
        ids, labels, pos = data["input_ids"].clone(), data["labels"].clone(), positions.clone()
        with context_parallel(
            mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={ids, labels, pos}
        ):
            loss = model(input_ids=ids, labels=labels, position_ids=pos)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # each rank's loss is over its tokens; equal shares
        return float(mean) / world

    return step


def probe_context_parallel(world: int) -> None:
    """One causal SDPA (forward and backward) under torch's context_parallel, before the model: where
    torch's cannot run, every rank raises here alike (inside the model one rank may raise while another
    is already in a collective, and the launch would hang)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * world, 8, generator=g) for _ in range(3))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        for t in (q, k, v):
            t.requires_grad_()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace, side: str, gen: str) -> None:
    baseline = init_rank(rank, world, tmp, args.threads)
    if side == "ours":
        finish_rank(tmp, rank, measure(ours_step(args, world, gen), args, baseline))
        return
    try:
        probe_context_parallel(world)  # raises on CPU: see the module docstring
        step = torch_step(args, world)
    except Exception as e:  # noqa: BLE001  reported, not hidden: the row says torch's side cannot run
        frames = traceback.extract_tb(e.__traceback__)
        torch_root = os.path.dirname(torch.__file__)
        where = [
            f"{os.path.relpath(f.filename, torch_root)}:{f.lineno}"
            for f in frames
            if f.filename.startswith(torch_root)
        ]
        finish_rank(tmp, rank, {"error": f"{type(e).__name__}: {e}".strip()[:400], "raised_at": where[-3:]})
        return
    finish_rank(tmp, rank, measure(step, args, baseline))


def cp_kernel_table() -> str:
    """Where torch lists the SDPA kernels its context parallelism handles (file:line)."""
    from torch.distributed.tensor.experimental import _attention as public

    module = sys.modules.get("torch.distributed.tensor.experimental._context_parallel._attention", public)
    source, _ = inspect.getsourcelines(module)  # a module's source starts at line 1
    line = next((i + 1 for i, text in enumerate(source) if text.startswith("custom_ops = {")), 0)
    return f"{os.path.relpath(inspect.getfile(module), os.path.dirname(torch.__file__))}:{line}"


def run_cp(args: argparse.Namespace, world: int) -> dict[str, Any]:
    import nnscaler

    with tempfile.TemporaryDirectory() as gen:
        nnscaler.parallelize(
            build_llama(args),
            llama_batch(args),
            "tp",
            ours_config(world, args.cp_kind),
            gen_savedir=gen,
            load_module=False,
        )
        ours = side_summary(launch(worker, world, args, "ours", gen))
    theirs_ranks = launch(worker, world, args, "torch", "")
    row: dict[str, Any] = {"cp": world, "cp_kind_ours": args.cp_kind}
    if "error" in theirs_ranks[0]:
        row.update(
            ours=ours,
            torch="cannot run on CPU",
            torch_error=theirs_ranks[0]["error"],
            torch_raised_at=theirs_ranks[0]["raised_at"],
            note=(
                "torch's context_parallel dispatches only the CUDA SDPA kernels (flash, efficient, cuDNN; "
                f"the table at torch/{cp_kernel_table()}); on CPU SDPA runs "
                "aten._scaled_dot_product_flash_attention_for_cpu, which has no DTensor sharding strategy, "
                "so torch's side raises at the first attention: ours alone"
            ),
        )
    else:
        theirs = side_summary(theirs_ranks)
        row.update(compare(ours, theirs), ours=ours, torch=theirs)
    print(f"[vs_torch_cp] cp {world}: {row.get('ratio', 'ours alone')}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_args(parser)
    parser.set_defaults(seq=512, batch=1)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cp-kind", default="zigzag", choices=["zigzag", "ring", "ulysses"])
    args = parser.parse_args(argv)
    before = machine()
    rows = [run_cp(args, world) for world in args.cp]
    result = {
        "benchmark": "nnscaler context parallelism vs torch.distributed.tensor.experimental.context_parallel",
        "model": describe_llama(args),
        "params": build_llama(args).lm.num_parameters(),
        "batch": args.batch,
        "torch_version": torch.__version__,
        "backend": "gloo (CPU)",
        "threads_per_process": args.threads,
        "optimizer": "AdamW(lr=1e-4)",
        "timing": f"{args.warmup} warm-up steps, median of {args.steps} timed steps (slowest rank), "
        "one process launch per side",
        "target": 1.0,
        "rows": rows,
        "machine_before": before,
        "machine_after": machine(),
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
