"""Optimizer state and gradient memory of a LoRA fine-tune against full training. Prints JSON.

The same Llama (built from `LlamaConfig`, random weights) is compiled twice with
`nnscaler.parallelize(model, batch, 'dp', ComputeConfig(1, N))` on N gloo processes (spawned here,
FileStore rendezvous) and trained one AdamW step through `nnscaler.build_optimizer`:
- `full`: every parameter trainable;
- `lora`: peft's `get_peft_model(model, LoraConfig(r, target_modules=q/k/v/o_proj))`, so every base
  weight is frozen (`requires_grad=False`) and only the adapters train.

Per rank, after the step: the bytes of the optimizer's state tensors (AdamW's `exp_avg`,
`exp_avg_sq`, `step`; this rank's slices under `--zero`), the bytes of the gradients the optimizer
reads (the reducer's buckets; under `--zero` the reduced slices), and the parameter counts. A frozen
parameter should cost neither: ratio = lora / full, close to trainable_lora / params_full.

    python benchmarks/lora_memory.py [--procs 2] [--layers 4 --hidden 256 --vocab 8192] [--rank 8] [--zero]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_note, nparams  # noqa: E402


def build(args: argparse.Namespace, lora: bool) -> torch.nn.Module:
    """The Llama (same seed both times), with LoRA adapters on the attention projections if asked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    config.loss_type = "ForCausalLM"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets))


def tensor_bytes(tree: Any) -> int:
    """Bytes of the distinct tensor storages in a nested structure."""
    seen: dict[int, int] = {}
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr() + t.storage_offset()] = t.numel() * t.element_size()
    return sum(seen.values())


def grad_bytes(pm: Any) -> int:
    """Bytes of the gradients the optimizer reads after a synced backward: the reducer's buckets (its
    owned slices under ZeRO), plus `.grad` of parameters outside it (one process: no reducer)."""
    red = pm.reducer
    if red is not None:
        held = red.nbytes()
        return held.get("grads", 0) + held.get("grad_slices", 0)
    return sum(p.grad.numel() * p.grad.element_size() for p in pm.parameters() if p.grad is not None)


def measure(args: argparse.Namespace, rank: int, world: int, tmp: str, lora: bool) -> dict[str, Any]:
    import nnscaler
    from nnscaler import ComputeConfig

    model = build(args, lora)
    total, trainable = nparams(model), sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    data = {"input_ids": ids, "labels": ids.clone()}
    cfg = ComputeConfig(1, world, use_zero=args.zero)
    name = "lora" if lora else "full"
    pm = nnscaler.parallelize(model, data, "dp", cfg, gen_savedir=os.path.join(tmp, f"gen_{name}"))
    del model
    opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    out = pm(**data)
    out.loss.backward()
    pm.sync_grad()
    grads = grad_bytes(pm)
    opt.step()
    state = tensor_bytes([dict(s) for s in opt.state.values()])
    opt.zero_grad()
    return {
        "params": total,
        "trainable_params": trainable,
        "optimizer_params": sum(len(group["params"]) for group in opt.state_dict()["param_groups"]),
        "optimizer_state_bytes": state,
        "grad_bytes": grads,
        "loss": round(float(out.loss), 4),
    }


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    import nnscaler

    nnscaler.init()
    full = measure(args, rank, world, tmp, lora=False)
    lora = measure(args, rank, world, tmp, lora=True)
    if rank == 0:
        result = {
            "benchmark": "optimizer state and gradient bytes per rank: LoRA fine-tune vs full training",
            "model": (
                f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; "
                f"LoRA r={args.rank} on q/k/v/o_proj (peft)"
            ),
            "processes": world,
            "backend": "gloo (CPU)",
            "policy": "dp" + (" + ZeRO-1" if args.zero else ""),
            "optimizer": "AdamW (fp32)",
            "full": full,
            "lora": lora,
            "optimizer_state_ratio": round(lora["optimizer_state_bytes"] / full["optimizer_state_bytes"], 5),
            "grad_ratio": round(lora["grad_bytes"] / max(full["grad_bytes"], 1), 5),
            "trainable_ratio": round(lora["trainable_params"] / full["params"], 5),
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
    parser.add_argument("--procs", type=int, default=2, help="gloo processes (data-parallel replicas)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--zero", action="store_true", help="ComputeConfig(use_zero=True)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.procs, tmp, args), nprocs=args.procs, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
