"""Peak activation memory per rank under context parallelism vs one device, at the same sequence. Prints JSON.

A Llama (HF, sdpa, grouped-query attention; the forward returns the mean token loss, as
examples/llama3_8B_128K trains it) is compiled twice: `dp` on one process (cp 1), and `tp` with
`pas_config={"cp_size": N, "cp_kind": KIND}` on N gloo processes (spawned here, FileStore rendezvous).
Each runs one training forward + backward of one sequence of --seq tokens; the peak is `LiveBytes`
(benchmarks/forward_memory.py): the bytes of tensor storages created during the step and alive at once
(activations saved for backward, the kernels' buffers, the gradients), counted by a TorchDispatchMode, so
allocator and RSS noise do not enter. Parameters and inputs, which exist before, are not counted.

ratio = max over ranks of the cp-N peak / the cp-1 peak (issue target at cp 4: <= 0.3).

    python benchmarks/context_parallel_memory.py [--seq 8192] [--cp 4] [--kind zigzag] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_note  # noqa: E402
from benchmarks.forward_memory import live_peak  # noqa: E402


class LossOnly(torch.nn.Module):
    """The model's mean token loss only, as examples/llama3_8B_128K trains it (no logits returned whole)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state
        logits = self.lm.lm_head(hidden)
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.embd,
        intermediate_size=4 * args.embd,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=args.seq,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LossOnly(LlamaForCausalLM(cfg)).train()
    tokens = torch.randint(0, args.vocab, (2, 1, args.seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": tokens[0], "labels": tokens[1]}


def step_peak(pm: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(peak live bytes, loss) of one forward + backward."""
    losses: list[float] = []

    def step():
        loss = pm(**batch)
        loss.backward()
        losses.append(float(loss.detach()))

    step()  # warm-up: lazy state (groups, reducer) outside the measurement
    pm.zero_grad(set_to_none=True)
    peak = live_peak(step)
    return peak, losses[-1]


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store{world}", rank=rank, world_size=world)
    import nnscaler
    from nnscaler import ComputeConfig

    nnscaler.init()
    model, batch = build(args)
    if world == 1:
        policy, cfg = "dp", ComputeConfig(1, 1)
    else:
        policy, cfg = "tp", ComputeConfig(world, world, pas_config={"cp_size": world, "cp_kind": args.kind})
    pm = nnscaler.parallelize(model, batch, policy, cfg, gen_savedir=os.path.join(tmp, f"gen{world}"))
    peak, loss = step_peak(pm, batch)
    with open(os.path.join(tmp, f"rank{world}_{rank}.json"), "w") as f:
        json.dump({"peak": peak, "loss": loss}, f)
    dist.barrier()
    nnscaler.uninit()


def _run(world: int, tmp: str, args: argparse.Namespace) -> list[dict]:
    if world == 1:
        mp.start_processes(worker, args=(1, tmp, args), nprocs=1, start_method="spawn")
    else:
        mp.start_processes(worker, args=(world, tmp, args), nprocs=world, start_method="spawn")
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"rank{world}_{r}.json")) as f:
            out.append(json.load(f))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--kind", default="zigzag", choices=["zigzag", "ring", "ulysses", "hybrid"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = _run(1, tmp, args)[0]
        many = _run(args.cp, tmp, args)
    peaks = [r["peak"] for r in many]
    result = {
        "benchmark": "peak live tensor bytes per rank of one training step: context parallel vs one device",
        "model": f"Llama {args.layers} layers, hidden {args.embd}, {args.heads} heads, vocab {args.vocab}",
        "seq": args.seq,
        "cp": args.cp,
        "kind": args.kind,
        "cp1_peak_mib": round(one["peak"] / 2**20, 2),
        "cp_peak_mib_per_rank": [round(p / 2**20, 2) for p in peaks],
        "ratio": round(max(peaks) / one["peak"], 4),
        "target_ratio": 0.3,
        "loss_cp1": round(one["loss"], 5),
        "loss_cp": round(many[0]["loss"], 5),
        "machine": load_note(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
