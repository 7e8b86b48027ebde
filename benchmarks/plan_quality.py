"""autodist vs the best standard recipe under the same cost model (issue 12's plan-quality table).

For each row: the model is built from its config on the meta device and traced; autodist plans for
the cluster offline (plan size, pipeline, tensor-parallel degree, micro-batches, recompute searched);
the recipes are DP + ZeRO 1/2/3 and Megatron TP x PP x DP (1F1B) over every valid degree, at the
same global batch and micro-batch count. Prints one JSON object per row, then a summary.

    python benchmarks/plan_quality.py [--rows gpt3-xl,llama3-8b-8k] [--layers N]

`--layers` shrinks every model's depth (quick runs; the folded search does not depend on depth).
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

from nnscaler.graph.capture import capture  # noqa: E402
from nnscaler.policies.autodist import load_cluster  # noqa: E402
from nnscaler.policies.autodist.offline import plan_offline  # noqa: E402
from nnscaler.policies.autodist.recipes import standard_recipes  # noqa: E402


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


ROWS = {
    "gpt3-xl": (lambda n: gpt3_xl(n), "h100x8", 8),
    "llama3-8b-8k": (lambda n: _llama(n, 8192, 8), "h100x8", 8),
    "llama3-8b-128k": (lambda n: _llama(n, 131072, 1), "h100x8", 8),
    "llama3-70b": (lambda n: _llama(n, 8192, 64, 8192, 28672, 64, 8, 80), "h100x64_ib", 64),
    "t5-large-512k-vocab": (lambda n: t5_large_512k(n), "h100x8", 8),
    "mixtral-like-24b": (lambda n: mixtral(n), "h100x8", 8),
}


def run_row(name: str, layers: int | None) -> dict:
    build, cluster_name, ndev = ROWS[name]
    t0 = time.perf_counter()
    model, inputs = build(layers)
    graph = capture(model, inputs, both_modes=False)  # planning costs the own (train) mode
    trace_s = time.perf_counter() - t0
    cluster = load_cluster(cluster_name)
    result = plan_offline(graph, cluster, ndev, pas_config={"use_bf16": True})
    best = result.best
    recipes = standard_recipes(graph, result.setup, ndev, best.nmicros)
    fitting = [r for r in recipes if r.fits and not math.isnan(r.candidate.step_time)]
    best_recipe = min(fitting, key=lambda r: r.candidate.step_time) if fitting else None
    row = {
        "row": name,
        "cluster": cluster_name,
        "devices": ndev,
        "nodes": len(graph.nodes),
        "trace_s": round(trace_s, 1),
        "plan_s": round(result.seconds, 1),
        "autodist": best.label() + f" plan_ngpus={result.setup.plan_ngpus}",
        "autodist_step_ms": round(best.step_time * 1e3, 3),
        "autodist_mem_gb": round(best.memory / 1e9, 2),
        "autodist_fits": best.memory <= result.setup.mem_limit,
        "autodist_2d_ops": sum(1 for p in best.spmd.plans.values() if p.mesh_splits) if best.spmd else 0,
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
    ap.add_argument("--rows", default=",".join(ROWS))
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
                    "errors": [r["row"] for r in out if "error" in r],
                }
            }
        )
    )


if __name__ == "__main__":
    main()
