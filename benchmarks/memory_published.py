"""Published training runs' layouts must fit where they ran (issue 42): each costed by autodist's
memory model at full size (models on the meta device, layouts pinned through evaluate_nodes as in
benchmarks/cost_model_vs_published.py), beside the 80 GB of the H100s they ran on.

1. llm-foundry MPT-7B on 8 H100: FSDP full shard (ZeRO-3), bf16, sequence 2048, micro-batch 6, no
   activation checkpointing, flash attention. Built as a GPT-2-shaped model with MPT-7B's sizes
   (d_model 4096, 32 layers, 32 heads, vocab 50368, exact GELU, 4x MLP, scaled_dot_product_attention):
   transformers' MPT class materialises the attention scores (alibi) where llm-foundry runs flash.
2. torchtitan Llama-3.1-8B on 8 H100: FSDP, sequence 8192, local batch 2, every decoder layer
   checkpointed.
3. Megatron-LM GPT-3 175B: TP8 x PP8, micro-batch 1, sequence 2048, full recompute, distributed
   optimizer (ZeRO-1 over data-parallel replicas: 16 of them on 1,024 GPUs).
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks.plan_quality import _llama, _lm, _tokens
from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.policies.autodist import planner_setup
from nnscaler.policies.autodist.context import stage_context, transient_bytes
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.memory import MemoryModel

DEVICE_GB = 80.0
"""H100 SXM memory."""


def _row(name: str, graph, setup, cand, tp: int, recompute: tuple[str, ...]) -> dict:
    ctx = stage_context(setup, tp)
    transient = transient_bytes(graph, ctx, setup, recompute)
    total = cand.memory + transient
    return {
        "published": name,
        "predicted_gb": round(total / 1e9, 1),
        "kept_gb": round(cand.memory / 1e9, 1),
        "transient_gb": round(transient / 1e9, 1),
        "device_gb": DEVICE_GB,
        "fits": total <= DEVICE_GB * 1e9,
    }


def _layers(graph, cls: str) -> tuple[str, ...]:
    return tuple(p for p, c in graph.module_classes.items() if c == cls)


def mpt_7b() -> dict:
    model = _lm(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=50368,
        n_embd=4096,
        n_layer=32,
        n_head=32,
        n_positions=2048,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    graph = capture(model, _tokens(6, 2048), both_modes=False)
    cfg = ComputeConfig(1, 8, pas_config={"cluster": "h100x8", "use_bf16": True, "zero_stage": 3})
    setup = planner_setup(graph, cfg)
    cand = evaluate_nodes(graph, setup, {})
    return _row("llm-foundry MPT-7B 8xH100 FSDP mb6 seq2048 no recompute", graph, setup, cand, 1, ())


def llama_8b() -> dict:
    model, inputs = _llama(None, 8192, 2)
    graph = capture(model, inputs, both_modes=False)
    cfg = ComputeConfig(1, 8, pas_config={"cluster": "h100x8", "use_bf16": True, "zero_stage": 3})
    setup = planner_setup(graph, cfg)
    layers = _layers(graph, "LlamaDecoderLayer")
    cand = evaluate_nodes(graph, setup, {}, recompute=layers)
    return _row("torchtitan Llama-3.1-8B 8xH100 FSDP seq8192 lb2 recompute", graph, setup, cand, 1, layers)


def gpt3_175b() -> dict:
    from nnscaler.policies.stage_balance import balanced_starts
    from nnscaler.policies.staging import default_pivots, pivot_starts
    from nnscaler.policies.tp import pas_tp

    model = _lm(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=51200,
        n_embd=12288,
        n_layer=96,
        n_head=96,
        n_positions=2048,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    graph = capture(model, _tokens(1, 2048), both_modes=False)
    cfg = ComputeConfig(64, 1024, use_end2end=True, pas_config={"cluster": "h100x64_ib", "use_bf16": True})
    setup = replace(planner_setup(graph, cfg), memory=MemoryModel(1, mixed_precision=True))
    starts = [i for i, _ in pivot_starts(graph, default_pivots(graph))]
    stage_starts = balanced_starts(graph, starts[1:], 8)
    layers = _layers(graph, "GPT2Block")
    nodes = pas_tp(graph, ComputeConfig(8, 8)).nodes
    cand = evaluate_nodes(graph, setup, nodes, pp=8, starts=stage_starts, nmicros=64, recompute=layers)
    return _row("Megatron-LM GPT-3 175B TP8xPP8 mb1 seq2048 full recompute", graph, setup, cand, 8, layers)


def published_rows() -> list[dict]:
    out = []
    for fn in (mpt_7b, llama_8b, gpt3_175b):
        try:
            out.append(fn())
        except Exception as exc:  # one row failing does not hide the others
            out.append({"published": fn.__name__, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return out
