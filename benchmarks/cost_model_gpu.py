"""autodist's cost model on one real device: predicted vs measured training step of a Llama model.

One process (NCCL on a GPU, gloo on a CPU) compiles a Llama built from a config (Llama-3-8B's layer
shapes by default, a few layers) with ComputeConfig(1, 1), times forward + backward of the generated
code, and prints beside it:
- `analytic_ms`: the cost model with the device table only (`--cluster`, default h100x8: its H100);
- `measured_db_ms`: the cost model fed with this device's op timings (`nnscaler.profiler`);
- `eager_ms`: the same model stepped by plain PyTorch (what the generated code should match);
- peak device memory of the step (weights, gradients, Adam's state, activations) beside the memory
  model's figure for the same.

    python benchmarks/cost_model_gpu.py [--seqs 2048,8192] [--layers 2] [--tiny]

`--tiny` runs a small model (for a CPU check of the script). No weights or data are downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.graph.ir import graph_from_json  # noqa: E402
from nnscaler.policies import Plan  # noqa: E402
from nnscaler.policies.autodist import planner_setup  # noqa: E402
from nnscaler.policies.autodist.evaluate import evaluate_plan  # noqa: E402
from nnscaler.profiler import profile_graph  # noqa: E402
from tests.zoo import extract_loss  # noqa: E402


def _model(args: argparse.Namespace, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(int(s) for s in args.seqs.split(",")),
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype=getattr(torch, args.dtype)).train()


def _batch(args: argparse.Namespace, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(args.vocab, (args.batch, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": torch.roll(ids, -1, dims=1).to(device)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(module, batch: dict, device: torch.device, warmup: int, steps: int) -> tuple[float, float]:
    """Median seconds of forward + backward and the peak device memory (bytes; 0 on the CPU) of a
    training step: gradients and Adam's state stay allocated, as in training (the optimizer's own
    update is not timed: the cost model leaves it out)."""
    opt = torch.optim.Adam(module.parameters(), lr=1e-6)

    def step() -> None:
        extract_loss(module(**batch)).backward()

    for i in range(warmup):
        step()
        if i == 0:
            opt.step()  # Adam's state exists from here on
        module.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=False)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del opt
    return statistics.median(times), float(peak)


def _one_length(args: argparse.Namespace, seq: int, device: torch.device, tmp: Path) -> dict:
    import nnscaler

    model = _model(args, device)
    batch = _batch(args, seq, device)
    outdir = tmp / f"seq{seq}"
    t0 = time.perf_counter()
    pm = nnscaler.parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=str(outdir))
    compile_s = time.perf_counter() - t0

    gen_s, gen_peak = _time_steps(pm, batch, device, args.warmup, args.steps)
    del pm
    written = next(outdir.rglob("graph.json")).parent  # gen_savedir/_parallel_modules/...
    graph = graph_from_json((written / "graph.json").read_text())
    plan = Plan.from_json((written / "plan.json").read_text())
    cluster = {"cluster": args.cluster}
    analytic = evaluate_plan(graph, planner_setup(graph, ComputeConfig(1, 1, pas_config=cluster)), plan)
    t0 = time.perf_counter()
    db = profile_graph(graph, ways=(1,), repeats=args.repeats, device=device)
    profile_s = time.perf_counter() - t0
    db_path = db.save(tmp / f"ops_seq{seq}.json")
    measured_cfg = ComputeConfig(1, 1, pas_config={**cluster, "profile_db_path": str(db_path)})
    measured = evaluate_plan(graph, planner_setup(graph, measured_cfg), plan)

    eager_s, eager_peak = _time_steps(model.to(device), batch, device, args.warmup, args.steps)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "seq": seq,
        "batch": args.batch,
        "ops": len(graph.nodes),
        "compile_s": round(compile_s, 1),
        "profile_s": round(profile_s, 1),
        "measured_ms": round(gen_s * 1e3, 2),
        "eager_ms": round(eager_s * 1e3, 2),
        "analytic_ms": round(analytic.step_time * 1e3, 2),
        "analytic_ratio": round(analytic.step_time / gen_s, 3),
        "measured_db_ms": round(measured.step_time * 1e3, 2),
        "measured_db_ratio": round(measured.step_time / gen_s, 3),
        "peak_memory_gb": round(gen_peak / 2**30, 2),
        "eager_peak_memory_gb": round(eager_peak / 2**30, 2),
        "predicted_memory_gb": round(analytic.memory / 2**30, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seqs", default="2048,8192", help="sequence lengths, one compile each")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cluster", default="h100x8", help="cluster file (its device) for the analytic model")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5, help="timings per op in the profile")
    ap.add_argument("--tiny", action="store_true", help="a small model (a CPU check of this script)")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, 256
        args.seqs, args.dtype, args.cluster, args.steps = "32,64", "float32", "cpu_gloo", 3
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1
        )
        import nnscaler

        nnscaler.init()
        try:  # an error must end the script: a process group left open keeps NCCL's threads (and it) alive
            rows = [_one_length(args, int(s), device, Path(tmp)) for s in args.seqs.split(",")]
        finally:
            nnscaler.uninit()
            if dist.is_initialized():
                dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(
        json.dumps(
            {
                "benchmark": "cost model vs one device's measured training step (forward + backward)",
                "device": name,
                "torch": torch.__version__,
                "model": {
                    k: getattr(args, k)
                    for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "dtype")
                },
                "cluster": args.cluster,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
