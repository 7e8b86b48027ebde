"""autodist with context parallelism searched (issue 29): the plan it picks for Llama-3-8B at long
sequences, its predicted step time, tokens/s/GPU and MFU, beside the published figures, and the same
search with cp forced to 1.

Rows (models built from their configs on the meta device, planned offline as `python -m
nnscaler.plan` does: plan size, data parallelism, pipeline, tensor parallelism, micro-batches,
recompute, ZeRO and now the cp degree and kind searched):
- `8b-128k`: Llama-3-8B, sequence 131,072, global batch 8 (1M tokens per step) on `h100x8`;
- `8b-128k-batch1`: the same with one sequence per step (no data parallelism possible);
- `8b-1m`: Llama-3-8B, sequence 1,048,576, batch 1 on `h100x64_ib` (64 H100 over InfiniBand).
Each row runs twice: cp searched (`cp_size: auto`) and cp forced off (`cp_size: 1`).

Ours are PREDICTIONS of the analytic cost model (no GPU is used). Published figures, measured:
nnScaler 1,594 tokens/s/GPU (40.96 % MFU) and torchtitan ~1,071 tokens/s/GPU, both 8B at 128K on
8 H100. MFU = (6 x parameters + 12 x layers x hidden x sequence) FLOPs per token x tokens/s / the
H100's 989 dense bf16 TFLOP/s (the formula that gives nnScaler's 40.96 % from its 1,594 tokens/s).

    python benchmarks/context_parallel_plan.py [--rows 8b-128k,8b-1m] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.plan_quality import _llama  # noqa: E402
from nnscaler.errors import PlanError  # noqa: E402
from nnscaler.graph.capture import capture  # noqa: E402
from nnscaler.policies.autodist import load_cluster  # noqa: E402
from nnscaler.policies.autodist.offline import plan_offline  # noqa: E402

H100_BF16_TFLOPS = 989.0
ROWS = {
    "8b-128k": (131072, 8, "h100x8", 8),
    "8b-128k-batch1": (131072, 1, "h100x8", 8),
    "8b-1m": (1048576, 1, "h100x64_ib", 64),
}
PUBLISHED = {
    "8b-128k": {
        "nnscaler_tokens_per_s_per_gpu": 1594,
        "nnscaler_mfu_percent": 40.96,
        "torchtitan_tokens_per_s_per_gpu": 1071,
        "note": "measured, 8B at 128K on 8 H100",
    }
}


def _flops_per_token(graph, seq: int, layers: int, hidden: int = 4096) -> float:
    params = sum(v.meta.numel for v in graph.values.values() if v.kind == "param" and v.meta)
    return 6.0 * params + 12.0 * layers * hidden * seq


def _plan_row(graph, seq: int, batch: int, cluster_name: str, ndevices: int, cp: str | int) -> dict:
    pas = {"use_bf16": True, "cp_size": cp}
    t0 = time.perf_counter()
    try:
        result = plan_offline(graph, load_cluster(cluster_name), ndevices, pas_config=pas)
    except PlanError as exc:
        msg = str(exc)  # offline planning lists every plan size; the largest's reason is the telling one
        return {"cp_size_option": cp, "plan": None, "error": msg[msg.rfind("plan_ngpus=") :][:600]}
    best, setup = result.best, result.setup
    tokens = seq * batch
    rate = tokens / best.step_time / ndevices
    return {
        "cp_size_option": cp,
        "plan": {
            "cp": best.cp_size,
            "cp_kind": best.cp_label(),
            "tp": best.tp,
            "pp": best.pp,
            "dp": setup.dp_size,
            "plan_ngpus": setup.plan_ngpus,
            "nmicros": best.nmicros,
            "recompute": best.recompute,
            "zero": best.zero,
            "mesh": list(result.plan.mesh),
            "label": best.label(),
        },
        "predicted_step_s": round(best.step_time, 3),
        "predicted_cp_comm_s_per_device": round(best.cp_comm, 3),
        "predicted_cp_added_to_step_s": round(best.cp_exposed, 3),
        "predicted_memory_gb": round(best.memory / 1e9, 2),
        "predicted_tokens_per_s_per_gpu": round(rate, 1),
        "predicted_mfu_percent": round(
            100 * rate * _flops_per_token(graph, seq, 32) / (H100_BF16_TFLOPS * 1e12), 2
        ),
        "search_s": round(time.perf_counter() - t0, 1),
        "not_taken": [f"{k}: {w}" for k, w in best.cp_rejected][:6],
    }


def run_row(name: str, layers: int | None) -> dict:
    seq, batch, cluster_name, ndevices = ROWS[name]
    model, inputs = _llama(layers, seq, batch)
    t0 = time.perf_counter()
    graph = capture(model, inputs, both_modes=False)
    out = {
        "row": name,
        "model": f"Llama-3-8B{f' ({layers} layers)' if layers else ''}",
        "sequence": seq,
        "global_batch": batch,
        "tokens_per_step": seq * batch,
        "cluster": cluster_name,
        "devices": ndevices,
        "trace_s": round(time.perf_counter() - t0, 1),
        "ours_are": "predictions of autodist's analytic cost model",
        "autodist": _plan_row(graph, seq, batch, cluster_name, ndevices, "auto"),
        "autodist_cp_off": _plan_row(graph, seq, batch, cluster_name, ndevices, 1),
    }
    published = PUBLISHED.get(name.removesuffix("-batch1"))
    if published and not layers:
        out["published"] = published
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    p.add_argument("--layers", type=int, default=None, help="shrink the model's depth (quick runs)")
    args = p.parse_args(argv)
    for name in args.rows.split(","):
        print(json.dumps(run_row(name.strip(), args.layers), indent=1), flush=True)


if __name__ == "__main__":
    main()
