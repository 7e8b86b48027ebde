"""autodist vs the best standard recipe under the same cost model (issue 12's plan-quality table).

For each row: the model is built from its config on the meta device and traced; autodist plans for
the cluster offline (plan size, pipeline, tensor-parallel degree, micro-batches, recompute searched);
the recipes are DP + ZeRO 1/2/3 and Megatron TP x PP x DP (1F1B) over every valid degree, at the
same global batch and micro-batch count. Prints one JSON object per row, then a summary.

    python benchmarks/plan_quality.py [--rows gpt3-xl,llama3-8b-8k] [--layers N]

`--layers` shrinks every model's depth (quick runs; the folded search does not depend on depth).

Issue 28's rows: Llama-3-405B at 16K on 2,048 H100 (256 nodes), GPT-3 175B on 1,024 A100 with
Megatron-LM's published TP8 x PP16 x DP8 as an extra recipe, and a token FFN on a slow-link cluster
where autodist with 2-D meshes is also compared with its own best 1-D plan (pas_config tp_mesh 'off').
Each row names the mesh of the chosen plan (`autodist_mesh`, [] for 1-D splits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from dataclasses import dataclass, field, replace  # noqa: E402

from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.graph.capture import capture  # noqa: E402
from nnscaler.policies.autodist import load_cluster  # noqa: E402
from nnscaler.policies.autodist.context import stage_context, transient_bytes  # noqa: E402
from nnscaler.policies.autodist.evaluate import evaluate_nodes  # noqa: E402
from nnscaler.policies.autodist.layers import layer_instances  # noqa: E402
from nnscaler.policies.autodist.offline import plan_offline  # noqa: E402
from nnscaler.policies.autodist.recipes import Recipe, standard_recipes  # noqa: E402
from nnscaler.policies.stage_balance import balanced_starts  # noqa: E402
from nnscaler.policies.tp import pas_tp  # noqa: E402


def _lm(config_cls_name: str, model_cls_name: str, **cfg):
    import transformers

    config = getattr(transformers, config_cls_name)(use_cache=False, **cfg)
    with torch.device("meta"):
        return getattr(transformers, model_cls_name)(config).train()


def _tokens(batch: int, seq: int, **extra) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids, **extra}


def gpt3_xl(layers):
    m = _lm(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=50257,
        n_embd=2048,
        n_layer=layers or 24,
        n_head=16,
        n_positions=2048,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return m, _tokens(8, 2048)


def _llama(layers, seq, batch, hidden=4096, inter=14336, heads=32, kv=8, nlayers=32):
    m = _lm(
        "LlamaConfig",
        "LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers or nlayers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return m, _tokens(batch, seq)


def t5_large_512k(layers):
    m = _lm(
        "T5Config",
        "T5ForConditionalGeneration",
        vocab_size=512 * 1024,
        d_model=1024,
        d_ff=2816,
        num_layers=layers or 24,
        num_decoder_layers=layers or 24,
        num_heads=16,
        d_kv=64,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids = torch.zeros(8, 512, dtype=torch.long, device="meta")
    return m, {"input_ids": ids, "labels": ids}


def mixtral(layers):
    """Mixtral-like: 8 experts, top-2, 32 layers, expert width 7168 (about 24B parameters; Mixtral-8x7B's
    47B with Adam in mixed precision needs 94 GB per device on 8 GPUs even fully sharded)."""
    m = _lm(
        "MixtralConfig",
        "MixtralForCausalLM",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=7168,
        num_hidden_layers=layers or 32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
    )
    return m, _tokens(8, 4096)


def llama3_405b_16k(layers):
    """Llama-3-405B (hidden 16384, 126 layers, 128 heads, 8 KV heads, FFN 53248) at 16K sequence, global
    batch 1024 sequences (16M tokens per step, Llama 3's batch)."""
    return _llama(layers, 16384, 1024, 16384, 53248, 128, 8, 126)


def gpt3_175b(layers):
    """GPT-3 175B at sequence 2048, global batch 1536 (Megatron-LM's run); vocab 50257 padded to 51200
    as Megatron pads it (divisible by 8 x 128)."""
    m = _lm(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=51200,
        n_embd=12288,
        n_layer=layers or 96,
        n_head=96,
        n_positions=2048,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return m, _tokens(1536, 2048)


class TokenFFN(torch.nn.Module):
    """Pre-norm feed-forward blocks over (batch, tokens, width) (tests/mesh2d_policy.py's model at
    benchmark size): weights and activations of about the same size, where a 2-D split (batch x
    hidden) halves both collectives of 1-D data or tensor parallelism."""

    def __init__(self, width: int, hidden: int, blocks: int):
        super().__init__()
        nn = torch.nn
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(blocks))
        self.ups = nn.ModuleList(nn.Linear(width, hidden) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(hidden, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        return torch.nn.functional.mse_loss(x, y)


def token_ffn(layers, width=8192, hidden=32768, batch=1, tokens=32768):
    """One block whatever `--layers` says (no pipeline split), one sequence of 32K tokens (no data
    parallelism): weights and activations of the same size (268M elements), so 1-D plans pay one of
    them in full (tensor parallel: the activations' all-reduce; tokens split: the weights')."""
    with torch.device("meta"):
        model = TokenFFN(width, hidden, 1).train()
    x = torch.zeros(batch, tokens, width, device="meta")
    return model, {"x": x, "y": x}


CLUSTERS: dict[str, dict] = {
    # Issue 28's large clusters, built here (not shipped): same links as h100x64_ib, 256 nodes.
    "h100x2048_ib": {
        "name": "2048x H100 SXM, 256 nodes over 400 Gb/s InfiniBand",
        "device": "h100",
        "nodes": 256,
        "devices_per_node": 8,
        "intra_node": {"bandwidth_gbs": 450, "latency_us": 3},
        "inter_node": {"bandwidth_gbs": 50, "latency_us": 6},
    },
    # Megatron-LM's Selene: DGX A100 80GB nodes, NVLink 3 (600 GB/s bidirectional per GPU), eight
    # 200 Gb/s HDR InfiniBand NICs per node (25 GB/s per GPU).
    "a100x1024_ib": {
        "name": "1024x A100 80GB, 128 nodes over 200 Gb/s InfiniBand",
        "device": "a100",
        "nodes": 128,
        "devices_per_node": 8,
        "intra_node": {"bandwidth_gbs": 300, "latency_us": 3},
        "inter_node": {"bandwidth_gbs": 25, "latency_us": 6},
    },
    # Fast devices on a slow link: H100 PCIe cards over PCIe Gen5 (64 GB/s per direction);
    # collectives cost their bytes, so a split that halves them pays.
    "h100pcie_x8": {
        "name": "8x H100 PCIe, one node over PCIe Gen5",
        "device": "h100",
        "nodes": 1,
        "devices_per_node": 8,
        "intra_node": {"bandwidth_gbs": 64, "latency_us": 3},
        "inter_node": {"bandwidth_gbs": 12.5, "latency_us": 10},
    },
}


@dataclass(frozen=True)
class Row:
    build: object
    """layers -> (model on the meta device, its inputs: the global batch of one step)."""
    cluster: str
    """A shipped cluster's name or a key of CLUSTERS."""
    ndevices: int
    pinned: tuple[tuple[str, int, int], ...] = ()
    """Published recipes costed beside the standard ones: (name, tp, pp), micro-batch 1, recompute."""
    compare_1d: bool = False
    """Also plan with pas_config tp_mesh 'off' (the best 1-D plan autodist finds)."""
    plan_ngpus: int | None = None
    """Pin the plan size (plan_offline's argument), e.g. all devices where the batch allows no dp."""
    max_dp: int | None = None
    """Most data-parallel replicas the global batch allows (its samples): recipes with more are left
    out (plan_offline and standard_recipes do not refuse them yet)."""
    pas: dict = field(default_factory=dict)


ROWS = {
    "gpt3-xl": Row(lambda n: gpt3_xl(n), "h100x8", 8),
    "llama3-8b-8k": Row(lambda n: _llama(n, 8192, 8), "h100x8", 8),
    "llama3-8b-128k": Row(lambda n: _llama(n, 131072, 1), "h100x8", 8),
    "llama3-70b": Row(lambda n: _llama(n, 8192, 64, 8192, 28672, 64, 8, 80), "h100x64_ib", 64),
    "t5-large-512k-vocab": Row(lambda n: t5_large_512k(n), "h100x8", 8),
    "mixtral-like-24b": Row(lambda n: mixtral(n), "h100x8", 8),
    "llama3-405b-16k": Row(llama3_405b_16k, "h100x2048_ib", 2048),
    # Megatron-LM's GPT-3 175B layout (examples/gpt3/train_gpt3_175b_distributed.sh; Narayanan et al.
    # 2021): TP8 x PP16 x DP8 on 1,024 A100, micro-batch 1, activation checkpointing.
    "gpt3-175b": Row(gpt3_175b, "a100x1024_ib", 1024, pinned=(("Megatron-LM published", 8, 16),)),
    # A batch of one sequence: the plan takes all 8 devices (pinned through plan_offline's plan_ngpus).
    "token-ffn-2d": Row(token_ffn, "h100pcie_x8", 8, compare_1d=True, plan_ngpus=8, max_dp=1),
}


def cluster_spec(name: str):
    return load_cluster(CLUSTERS.get(name, name))


def pinned_recipe(graph, setup, name: str, tp: int, pp: int, ndevices: int) -> Recipe:
    """A published TP x PP x DP layout that recipes.py does not enumerate as such (its micro-batch count
    is the published one, micro-batch 1; recipes.py searches powers of four), costed through the
    same offline API: Megatron's splits (pas_tp), balanced stages of whole layers, every layer
    recomputed, the same global batch and memory model (ZeRO stage included) as autodist's plan."""
    dp = ndevices // (tp * pp)
    nmicros = max(1, setup.traced_batch // dp)  # micro-batch 1
    s = replace(setup, plan_ngpus=tp * pp, dp_size=dp, batch_scale=1.0 / (dp * nmicros))
    _, instances = layer_instances(graph, s.pivots)
    layers = tuple(p for p, _ in instances)
    starts = balanced_starts(graph, [idx[0] for _, idx in instances][1:], pp)
    nodes = pas_tp(graph, ComputeConfig(tp, tp)).nodes
    cand = evaluate_nodes(graph, s, nodes, pp=pp, starts=starts, nmicros=nmicros, recompute=layers)
    transient = transient_bytes(graph, stage_context(s, tp), s)
    label = f"{name}: TP{tp} x PP{pp} x DP{dp} + recompute, {nmicros} micro-batches"
    return Recipe(label, cand, cand.memory + transient <= s.mem_limit)


def run_row(name: str, layers: int | None) -> dict:
    spec = ROWS[name]
    t0 = time.perf_counter()
    model, inputs = spec.build(layers)
    graph = capture(model, inputs, both_modes=False)  # planning costs the own (train) mode
    trace_s = time.perf_counter() - t0
    cluster = cluster_spec(spec.cluster)
    pas = {"use_bf16": True, **spec.pas}
    result = plan_offline(graph, cluster, spec.ndevices, plan_ngpus=spec.plan_ngpus, pas_config=pas)
    best = result.best
    recipes = standard_recipes(graph, result.setup, spec.ndevices, best.nmicros)
    if spec.max_dp:
        recipes = [r for r in recipes if spec.ndevices // (r.candidate.tp * r.candidate.pp) <= spec.max_dp]
    row = {
        "row": name,
        "cluster": spec.cluster,
        "devices": spec.ndevices,
        "nodes": len(graph.nodes),
        "trace_s": round(trace_s, 1),
        "plan_s": round(result.seconds, 1),
        "autodist": best.label() + f" plan_ngpus={result.setup.plan_ngpus}",
        "autodist_mesh": list(result.plan.mesh),
        "autodist_step_ms": round(best.step_time * 1e3, 3),
        "autodist_mem_gb": round(best.memory / 1e9, 2),
        "autodist_fits": best.memory <= result.setup.mem_limit,
        "autodist_2d_ops": sum(1 for p in best.spmd.plans.values() if p.mesh_splits) if best.spmd else 0,
    }
    for label, tp, pp in spec.pinned:
        try:
            pinned = pinned_recipe(graph, result.setup, label, tp, pp, spec.ndevices)
        except Exception as exc:  # e.g. fewer layers (--layers) than the published stages
            row.setdefault("pinned_errors", []).append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        recipes.append(pinned)
        row.setdefault("pinned", []).append(_recipe_json(pinned))
    if spec.compare_1d:
        row.update(_best_1d(graph, cluster, spec, pas, best.step_time))
    return {**row, **_vs_recipes(best, recipes)}


def _recipe_json(recipe: Recipe) -> dict:
    c = recipe.candidate
    return {
        "name": recipe.name,
        "step_ms": round(c.step_time * 1e3, 3),
        "mem_gb": round(c.memory / 1e9, 2),
        "fits": recipe.fits,
    }


def _best_1d(graph, cluster, spec: Row, pas: dict, step_time: float) -> dict:
    """autodist's best plan without 2-D meshes (every op split along one axis of its stage)."""
    pas = {**pas, "tp_mesh": "off"}
    one_d = plan_offline(graph, cluster, spec.ndevices, plan_ngpus=spec.plan_ngpus, pas_config=pas)
    return {
        "best_1d": one_d.best.label() + f" plan_ngpus={one_d.setup.plan_ngpus}",
        "best_1d_step_ms": round(one_d.best.step_time * 1e3, 3),
        "beats_every_1d": step_time < one_d.best.step_time * (1 - 1e-9),
    }


def _vs_recipes(best, recipes: list[Recipe]) -> dict:
    fitting = [r for r in recipes if r.fits and not math.isnan(r.candidate.step_time)]
    best_recipe = min(fitting, key=lambda r: r.candidate.step_time) if fitting else None
    row = {
        "best_recipe": best_recipe.name if best_recipe else None,
        "best_recipe_step_ms": round(best_recipe.candidate.step_time * 1e3, 3) if best_recipe else None,
        "recipes_fitting": len(fitting),
        "recipes_total": len(recipes),
    }
    if best_recipe:
        row["autodist_le_recipe"] = best.step_time <= best_recipe.candidate.step_time * (1 + 1e-9)
        row["speedup_vs_recipe"] = round(best_recipe.candidate.step_time / best.step_time, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS), help=f"any of {','.join(ROWS)}")
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    out = []
    for name in args.rows.split(","):
        try:
            row = run_row(name, args.layers)
        except Exception as exc:  # a row that cannot be traced or planned is reported, not hidden
            row = {"row": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in out if "autodist_le_recipe" in r]
    print(
        json.dumps(
            {
                "summary": {
                    "rows": len(out),
                    "autodist_le_best_recipe": sum(r["autodist_le_recipe"] for r in ok),
                    "strictly_better": [r["row"] for r in ok if r["speedup_vs_recipe"] > 1.0],
                    "beats_every_1d": [r["row"] for r in out if r.get("beats_every_1d")],
                    "errors": [r["row"] for r in out if "error" in r],
                }
            }
        )
    )


if __name__ == "__main__":
    main()
