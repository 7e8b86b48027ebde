"""Compile-time benchmark: Llama-3-8B built from its config on the meta device, `tp` over 8 ranks.

Prints JSON with seconds per stage (capture, plan, partition, codegen), the total, peak RSS and the
size of the generated code (lines of gencode0.py, and its layer functions: repeated layers written once). No weights are materialised. Targets: total < 30 s, peak RSS < 4 GB.

    python benchmarks/compile_time.py [--layers 32] [--plan-ngpus 8] [--policy tp]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch


def llama3_8b(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        use_cache=False,
        attention_dropout=0.0,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--plan-ngpus", type=int, default=8)
    parser.add_argument("--runtime-ngpus", type=int, default=None)
    parser.add_argument("--policy", default="tp")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()

    from nnscaler import ComputeConfig
    from nnscaler.parallel import compile_module
    from nnscaler.version import __version__

    t0 = time.perf_counter()
    model = llama3_8b(args.layers)
    build_s = time.perf_counter() - t0
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    dummy = {"input_ids": ids, "labels": ids.clone()}
    cfg = ComputeConfig(args.plan_ngpus, args.runtime_ngpus or args.plan_ngpus)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = compile_module(model, dummy, args.policy, cfg, Path(tmp), __version__)
        total = time.perf_counter() - t0
        files = sorted(Path(tmp).glob("gencode*.py"))
        text = files[0].read_text()
        lines = len(text.splitlines())
        layer_functions = text.count("\n    def _layer_")  # repeated layers written once
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        json.dumps(
            {
                "model": f"Llama-3-8B ({args.layers} layers, meta device)",
                "policy": args.policy,
                "plan_ngpus": cfg.plan_ngpus,
                "runtime_ngpus": cfg.runtime_ngpus,
                "nodes": len(result.graph.nodes),
                "build_model_s": round(build_s, 2),
                **{f"{k}_s": round(v, 2) for k, v in result.seconds.items()},
                "compile_total_s": round(total, 2),
                "peak_rss_gb": round(peak_rss_gb, 2),
                "files": len(files),
                "gencode0_lines": lines,
                "gencode0_layer_functions": layer_functions,
                "targets": {"compile_total_s": 30, "peak_rss_gb": 4},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
