"""Step time and peak memory of nnscaler's tensor parallelism against torch's own
(`torch.distributed.tensor.parallel.parallelize_module`), side by side on this CPU.

The same ~50M-parameter Llama (vs_torch_common.LlamaLM: transformers' LlamaForCausalLM, loss written
out), the same batch on every rank, AdamW, gloo, one thread per process; tp 2 and tp 4:
- ours: `nnscaler.parallelize(model, batch, 'tp', ComputeConfig(tp, tp))` (code generated beforehand
  in the parent, as a job reusing generated code would) and `nnscaler.build_optimizer`;
- torch: `parallelize_module` on a DeviceMesh over gloo with Megatron's plan, as torchtitan writes
  it: q/k/v, gate and up projections `ColwiseParallel`, o and down projections `RowwiseParallel`, the
  token embedding `RowwiseParallel` (vocab-split), the head `ColwiseParallel` with vocab-sharded
  logits and torch's `loss_parallel` (vocab-parallel cross entropy, as ours does); the sequence-
  parallel rows add `SequenceParallel` on the RMS norms and shard the activations between blocks.

Our `tp` policy has no sequence-parallel mode (nnscaler/policies/tp.py, options.py: no such key), so
the sequence-parallel rows compare torch's SP against our plain tp (the same launch as the tp row).

Each side runs in its own process launch: warm-up steps, then 5 timed steps; the median of the
slowest rank's step time and each rank's peak resident memory are printed as JSON with the ratios
ours / torch (target <= 1.0).

    python benchmarks/vs_torch_tp.py [--tp 2 4] [--no-sp] [--profile] [--layers 10 --hidden 512 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

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
    nparams,
    side_summary,
)

SP_NOTE = (
    "nnscaler's tp policy has no sequence-parallel mode (no such pas_config key in "
    "nnscaler/policies/options.py TpOptions; norms and residuals run replicated on every tp rank): "
    "the 'ours' figures of this row are those of plain tp (the same launch as the row without SP)"
)


def torch_tp_plan(model: torch.nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """torch's tensor-parallel plan of LlamaLM (torchtitan's Llama plan, written for transformers'
    module names)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # the layout of activations between blocks
    plan: dict[str, Any] = {
        "lm.model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm.lm_head": ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        plan["lm.model.norm"] = SequenceParallel()
    for i in range(len(model.lm.model.layers)):
        p = f"lm.model.layers.{i}."
        plan.update(
            {
                p + "self_attn.q_proj": ColwiseParallel(),
                p + "self_attn.k_proj": ColwiseParallel(),
                p + "self_attn.v_proj": ColwiseParallel(),
                p + "self_attn.o_proj": RowwiseParallel(output_layouts=between),
                p + "mlp.gate_proj": ColwiseParallel(),
                p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(output_layouts=between),
            }
        )
        if sp:
            plan.update(
                {
                    p + "input_layernorm": SequenceParallel(),
                    p + "post_attention_layernorm": SequenceParallel(),
                    p + "self_attn": PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    ),
                    p + "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
    return plan


def torch_step(args: argparse.Namespace, world: int, sequence_parallel: bool) -> tuple[Any, int]:
    """torch's side: the model parallelized with `parallelize_module`, AdamW; returns (step, params)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = build_llama(args)
    n = nparams(model)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, torch_tp_plan(model, sequence_parallel))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = llama_batch(args)

    def step() -> float:
        with loss_parallel():
            loss = model(**data)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return step, n


def ours_step(args: argparse.Namespace, world: int, gen: str) -> tuple[Any, int]:
    """Our side: the model compiled by `nnscaler.parallelize` with the `tp` policy."""
    import nnscaler

    model = build_llama(args)
    n = nparams(model)
    data = llama_batch(args)
    pm = nnscaler.parallelize(model, data, "tp", nnscaler.ComputeConfig(world, world), gen_savedir=gen)
    del model
    opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def step() -> float:
        loss = pm(**data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, n


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace, side: str, gen: str) -> None:
    baseline = init_rank(rank, world, tmp, args.threads)
    if side == "ours":
        step, n = ours_step(args, world, gen)
    else:
        step, n = torch_step(args, world, sequence_parallel=side == "torch_sp")
    finish_rank(tmp, rank, {"params": n, **measure(step, args, baseline)})


def generate(args: argparse.Namespace, world: int, gen: str) -> None:
    """Compile our side in this process (the workers reuse the generated code)."""
    import nnscaler

    nnscaler.parallelize(
        build_llama(args),
        llama_batch(args),
        "tp",
        nnscaler.ComputeConfig(world, world),
        gen_savedir=gen,
        load_module=False,
    )


def run_tp(args: argparse.Namespace, world: int, with_sp: bool) -> list[dict[str, Any]]:
    """The rows of one tp degree: plain tp, and (with_sp) torch's sequence parallelism."""
    with tempfile.TemporaryDirectory() as gen:
        generate(args, world, gen)
        ours_ranks = launch(worker, world, args, "ours", gen)
    ours = side_summary(ours_ranks)
    rows = []
    for sp in (False, True) if with_sp else (False,):
        theirs = side_summary(launch(worker, world, args, "torch_sp" if sp else "torch", ""))
        row = {"tp": world, "sequence_parallel": sp, **compare(ours, theirs), "ours": ours, "torch": theirs}
        if sp:
            row["note"] = SP_NOTE
        rows.append(row)
        print(f"[vs_torch_tp] tp {world} sp {sp}: ratio {row['ratio']}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_args(parser)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-sp", action="store_true", help="skip the sequence-parallel rows")
    args = parser.parse_args(argv)
    before = machine()
    rows = [row for world in args.tp for row in run_tp(args, world, with_sp=not args.no_sp)]
    result = {
        "benchmark": "nnscaler tp vs torch.distributed.tensor.parallel (parallelize_module)",
        "model": describe_llama(args),
        "params": build_llama(args).lm.num_parameters(),
        "batch": args.batch,
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
