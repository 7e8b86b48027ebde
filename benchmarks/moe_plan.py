"""autodist with expert parallelism searched (issue 30): the plan it picks for Mixtral-8x7B,
DeepSeek-V3 and a smaller DeepSeek-V3-shaped model on 64 and 256 H100 (`h100x64_ib`, `h100x256_ib`),
its predicted step time and tokens/s/GPU, beside every standard recipe under the same cost model
(autodist/recipes.py: DP + ZeRO, Megatron TP x PP x DP with the experts split by tp on their
intermediate features, and EP x TP x DP), and where autodist is strictly better.

Rows (models built from transformers config classes on the meta device, planned offline as `python
-m nnscaler.plan` does, at each of a few plan sizes (the fastest taken): data parallelism, pipeline,
tensor parallelism, micro-batches, recompute, ZeRO and the ep degree searched):
- `mixtral-64` / `mixtral-256`: Mixtral-8x7B (hidden 4096, 32 layers, 8 experts top-2, intermediate
  14336, vocab 32000), sequence 4096, 256 / 1024 sequences per step, plan_ngpus 8, 16, 32;
- `deepseek-64` / `deepseek-256`: DeepSeek-V3 (hidden 7168, 61 layers, the first 3 dense, 256
  routed experts top-8 + 1 shared, moe_intermediate 2048, MLA), sequence 4096, 256 / 1024
  sequences per step, plan_ngpus 16, 64 / 8, 16, 32, 64 (671B parameters with Adam need ~10.7 TB:
  64 H100 cannot hold them, and the row says so);
- `deepseek-small-64`: DeepSeek-V3's architecture at a size that trains on 64 H100 (58.4B parameters,
  ~0.93 TB with Adam): hidden 4096, 28 layers (the first 3 dense, intermediate 11264), 32 MLA heads,
  128 routed experts top-8 + 1 shared, moe_intermediate 1408, group-limited routing (8 groups, top
  4), vocab 129280; sequence 4096, 256 sequences per step, plan_ngpus 8, 16, 32, 64.

SHORTCUT, stated in the JSON too: capture and search of the full depth are too slow on a 2-core
machine, so each model is planned with `--layers` layers (default 4; DeepSeek: the first dense, the
rest MoE) under a memory limit and transient buffers scaled by layers / full layers (the planned slice
keeps that share of the budget; its embedding and head weigh more in it than in the full model: a
conservative limit), and the predicted step time is scaled by full layers / layers (embedding and
head scaled with it: an over-estimate, the same for autodist and every recipe; it weighs most where
the non-expert weights are replicated, i.e. against low tp, and for DeepSeek-V3 whose slice's
embedding and head are 60% of its non-expert weights, against 11% in the full model). Everything here
is a PREDICTION of autodist's analytic cost model (no GPU). The experts op is costed as grouped GEMMs,
a roofline each with a small-GEMM efficiency (autodist/expert_gemm.py), so fine-grained experts split
by tp pay for their small, memory-bound GEMMs.

Last run (`--layers 4`, predictions; tokens/s/GPU, autodist vs the best fitting recipe):
- mixtral-64: plan 16 x dp 4, pp 2 ep 8 tp 1, 16 micro, ZeRO-2: 4,619 vs EP4 x TP2 x DP8 4,360 (1.06x);
- mixtral-256: plan 16 x dp 16, pp 2 ep 4 tp 2, 16 micro, ZeRO-2: 4,231 vs EP4 x TP2 x DP32 3,676 (1.15x);
- deepseek-64: no plan (10.7 TB of Adam state > 5.12 TB of H100 memory);
- deepseek-256: plan 8 x dp 32, ep 2 tp 4, 4 micro, recompute, ZeRO-3: 445 vs EP2 x TP4 x DP32 376
  (1.18x); before the grouped-GEMM cost: tp 8, ep 1, 532 (its tp-split experts were costed as large
  GEMMs); wider ep loses to ZeRO-3's per-micro-batch gathers of the non-expert weights over 256
  replicas, which the 4-layer slice over-weights (see above);
- deepseek-small-64: plan 16 x dp 4, pp 2 ep 8 tp 1, 16 micro, ZeRO-2: 4,411 vs EP4 x TP2 x DP8 +
  recompute 3,310 (1.33x); before the grouped-GEMM cost: ep 4 tp 2, 4,875.
mixtral-256 took tp 8, ep 1 (4,593) before the grouped-GEMM cost.
Autodist is strictly faster than every fitting recipe in every row that plans.

    python benchmarks/moe_plan.py [--rows mixtral-64,deepseek-256] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from nnscaler.errors import PlanError  # noqa: E402
from nnscaler.graph.capture import capture  # noqa: E402
from nnscaler.policies.autodist import load_cluster  # noqa: E402
from nnscaler.policies.autodist.offline import plan_offline  # noqa: E402
from nnscaler.policies.autodist.recipes import standard_recipes  # noqa: E402

SEQ = 4096
H100_MEM_GB = 80
H100_MEM_LIMIT_GB = 0.8 * H100_MEM_GB
ADAM_BYTES = 16
"""Training state per parameter with Adam in mixed precision: bf16 weight and gradient, fp32 master
weight and two moments."""


@dataclass(frozen=True)
class Row:
    model: str
    cluster: str
    ndevices: int
    batch: int
    plan_sizes: tuple[int, ...]
    """plan_ngpus values searched (the rest of the devices data parallel); the fastest is autodist's."""


ROWS = {
    "mixtral-64": Row("mixtral", "h100x64_ib", 64, 256, (8, 16, 32)),
    "mixtral-256": Row("mixtral", "h100x256_ib", 256, 1024, (8, 16, 32)),
    "deepseek-64": Row("deepseek", "h100x64_ib", 64, 256, (16, 64)),
    "deepseek-256": Row("deepseek", "h100x256_ib", 256, 1024, (8, 16, 32, 64)),
    "deepseek-small-64": Row("deepseek_small", "h100x64_ib", 64, 256, (8, 16, 32, 64)),
}
FULL_LAYERS = {"mixtral": 32, "deepseek": 61, "deepseek_small": 28}
DENSE_LAYERS = {"deepseek": 3, "deepseek_small": 3}
"""DeepSeek's first dense layers in the full model; a planned slice keeps one (the rest MoE)."""
MODELS = {
    "mixtral": "Mixtral-8x7B",
    "deepseek": "DeepSeek-V3 (671B)",
    "deepseek_small": "DeepSeek-V3-shaped, smaller: hidden 4096, 28 layers (3 dense), 128 routed experts "
    "top-8 + 1 shared, moe_intermediate 1408, MLA, group-limited routing (8 groups, top 4)",
}


def _settled(config_cls, model_cls, **cfg):
    from tests import zoo

    config = config_cls(use_cache=False, attention_dropout=0.0, tie_word_embeddings=False, **cfg)
    zoo._settle(config)
    with torch.device("meta"):
        return zoo._settle_model(model_cls(config))


def _mixtral(layers: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    return _settled(
        MixtralConfig,
        MixtralForCausalLM,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        sliding_window=None,
        router_jitter_noise=0.0,
    )


DEEPSEEK_SIZES = {
    "deepseek": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "heads": 128,
        "n_routed_experts": 256,
    },
    "deepseek_small": {
        "hidden_size": 4096,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "heads": 32,
        "n_routed_experts": 128,
    },
}


def _deepseek(layers: int, model: str = "deepseek", dense: int = 1):
    """DeepSeek-V3's architecture at the widths of DEEPSEEK_SIZES[model], `dense` dense layers first."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    sizes = dict(DEEPSEEK_SIZES[model])
    heads = sizes.pop("heads")
    return _settled(
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        vocab_size=129280,
        **sizes,
        num_hidden_layers=layers,
        first_k_dense_replace=dense,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=SEQ,
        rope_scaling=None,
    )


def _candidate_json(c, scale: float, tokens: int, ndevices: int) -> dict:
    step = c.step_time * scale
    return {
        "predicted_step_s": round(step, 3),
        "predicted_tokens_per_s_per_gpu": round(tokens / step / ndevices, 1),
        "predicted_memory_gb_planned_layers": round(c.memory / 1e9, 2),
    }


def _plan(graph, row: Row, layers: int, scale: float) -> tuple[dict, object, object]:
    frac = layers / FULL_LAYERS[row.model]  # the planned slice of the model: its memory budget too
    pas = {"use_bf16": True, "mem_constraint": H100_MEM_LIMIT_GB * frac, "transient_mem_coef": 2.0 * frac}
    cluster = load_cluster(row.cluster)
    t0 = time.perf_counter()
    results, sizes = [], {}
    for p in row.plan_sizes:
        try:
            r = plan_offline(graph, cluster, row.ndevices, plan_ngpus=p, pas_config=pas)
        except PlanError as exc:
            sizes[p] = "no plan: " + " | ".join(x.strip() for x in str(exc).splitlines())[:900]
            continue
        results.append(r)
        sizes[p] = f"{r.best.label()}: {r.best.step_time * scale:.3f} s"
    if not results:
        raise PlanError("; ".join(f"plan_ngpus={p}: {w}" for p, w in sizes.items()))
    result = min(results, key=lambda r: r.best.step_time)
    best, setup = result.best, result.setup
    out = {
        "label": best.label() + f" plan_ngpus={setup.plan_ngpus} dp={setup.dp_size}",
        "ep": best.ep,
        "tp": best.tp,
        "pp": best.pp,
        "dp": setup.dp_size,
        "nmicros": best.nmicros,
        "zero": best.zero,
        "predicted_ep_all_to_all_gb_per_step_per_device": round(best.ep_bytes * scale / 1e9, 3),
        "predicted_ep_all_to_all_s_per_step": round(best.ep_comm * scale, 3),
        **_candidate_json(best, scale, row.batch * SEQ, row.ndevices),
        "search_s": round(time.perf_counter() - t0, 1),
        "per_plan_size": {str(p): w for p, w in sizes.items()},
        "ep_not_taken": [f"{k}: {w}" for k, w in best.ep_rejected][:6],
    }
    return out, best, setup


def _recipes(graph, setup, best, row: Row, scale: float) -> tuple[list[dict], dict]:
    rows, fitting = [], []
    for r in standard_recipes(graph, setup, row.ndevices, best.nmicros):
        entry = {"name": r.name, "fits": r.fits}
        if not math.isnan(r.candidate.step_time):
            entry.update(_candidate_json(r.candidate, scale, row.batch * SEQ, row.ndevices))
        rows.append(entry)
        if r.fits:
            fitting.append(r)
    top = min(fitting, key=lambda r: r.candidate.step_time) if fitting else None
    verdict = {
        "best_fitting_recipe": top.name if top else None,
        "autodist_strictly_better_than_every_fitting_recipe": bool(
            top is None or best.step_time < top.candidate.step_time * (1 - 1e-9)
        ),
        "speedup_vs_best_fitting_recipe": round(top.candidate.step_time / best.step_time, 3) if top else None,
        "recipes_strictly_worse": [
            r.name for r in fitting if r.candidate.step_time > best.step_time * (1 + 1e-9)
        ],
    }
    return rows, verdict


def _build(model: str, layers: int, full: bool = False):
    """The model (on meta) with `layers` layers; a DeepSeek slice keeps one dense layer, `full` its own."""
    if model == "mixtral":
        return _mixtral(layers)
    return _deepseek(layers, model, DENSE_LAYERS[model] if full else 1)


def _parameters(model: str) -> float:
    """Parameters of the full-depth model (built on meta: no memory)."""
    return sum(p.numel() for p in _build(model, FULL_LAYERS[model], full=True).parameters())


def run_row(name: str, layers: int) -> dict:
    row = ROWS[name]
    t0 = time.perf_counter()
    model = _build(row.model, layers)
    ids = torch.zeros(row.batch, SEQ, dtype=torch.long, device="meta")
    graph = capture(model, {"input_ids": ids, "labels": ids}, both_modes=False)
    scale = FULL_LAYERS[row.model] / layers
    params = _parameters(row.model)
    out = {
        "row": name,
        "model": MODELS[row.model],
        "parameters_full_model_b": round(params / 1e9, 1),
        "adam_training_state_tb": round(params * ADAM_BYTES / 1e12, 2),
        "cluster_memory_tb": round(row.ndevices * H100_MEM_GB / 1e3, 2),
        "planned_layers": layers,
        "full_layers": FULL_LAYERS[row.model],
        "shortcut": f"planned with {layers} layers, memory limit and transient buffers "
        f"x{layers}/{FULL_LAYERS[row.model]}, step time x{scale:.2f}",
        "cluster": row.cluster,
        "devices": row.ndevices,
        "tokens_per_step": row.batch * SEQ,
        "trace_s": round(time.perf_counter() - t0, 1),
        "ours_are": "predictions of autodist's analytic cost model",
    }
    try:
        out["autodist"], best, setup = _plan(graph, row, layers, scale)
    except PlanError as exc:
        out["autodist"] = {"error": str(exc)[:2000]}
        if params * ADAM_BYTES > row.ndevices * H100_MEM_GB * 1e9:
            out["why_no_plan"] = (
                f"{params / 1e9:.0f}B parameters x {ADAM_BYTES} bytes (bf16 weights and gradients, fp32 "
                f"master weights and two Adam moments) = {params * ADAM_BYTES / 1e12:.1f} TB > "
                f"{row.ndevices} x {H100_MEM_GB:g} GB = {row.ndevices * H100_MEM_GB / 1e3:.2f} TB"
            )
        return out
    t1 = time.perf_counter()
    out["recipes"], verdict = _recipes(graph, setup, best, row, scale)
    out.update(verdict)
    out["recipes_s"] = round(time.perf_counter() - t1, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    p.add_argument(
        "--layers", type=int, default=4, help="layers planned (the step is scaled to the full depth)"
    )
    args = p.parse_args(argv)
    for name in args.rows.split(","):
        t0 = time.perf_counter()
        out = run_row(name.strip(), args.layers)
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
