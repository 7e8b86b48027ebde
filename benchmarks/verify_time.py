"""What `parallelize(..., verify=...)` costs: capture time vs the time the check adds, per model.

Prints JSON: per model, parameters, graph nodes, capture seconds (both modes, as parallelize traces),
verify seconds (single-device codegen; eager and generated forward and backward in the model's mode,
forward in the other mode where the graph follows train()/eval()), their ratio in wall-clock and in
process CPU time (less sensitive to other load on the machine), and the modes checked. Target: verify < 1.5x capture for models under 100M
parameters. Each timing is the median of `--repeats` runs.

    python benchmarks/verify_time.py [--rows llama-tiny,gpt-20m,gpt-50m,llama-30m] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.common import load_note, nparams
from nnscaler.graph.capture import capture
from nnscaler.parallel.verify import verify_capture


def _llama_tiny() -> tuple[torch.nn.Module, dict]:
    from tests.zoo import build

    model, make_batch = build("llama")
    return model, make_batch(0, 2)


def _gpt(
    layers: int, embd: int, heads: int, vocab: int, block: int, batch: int
) -> tuple[torch.nn.Module, dict]:
    from examples.nanogpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=block, vocab_size=vocab, n_layer=layers, n_head=heads, n_embd=embd, dropout=0.1)
    )
    idx = torch.randint(vocab, (batch, block), generator=torch.Generator().manual_seed(1))
    return model.train(), {"idx": idx, "targets": torch.roll(idx, -1, dims=1)}


def _llama(hidden: int, layers: int, vocab: int, seq: int, batch: int) -> tuple[torch.nn.Module, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=seq,
        use_cache=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().train()
    ids = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


ROWS: dict[str, Callable[[], tuple[torch.nn.Module, dict]]] = {
    "llama-tiny": _llama_tiny,
    "gpt-20m": lambda: _gpt(6, 512, 8, 8192, 128, 2),
    "gpt-50m": lambda: _gpt(8, 640, 10, 32000, 128, 2),
    "llama-30m": lambda: _llama(512, 6, 32000, 128, 2),
}


def _median(fn: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Median wall-clock and process CPU seconds of `repeats` calls, and the last result."""
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), out


def row(name: str, repeats: int) -> dict:
    model, batch = ROWS[name]()
    capture_s, capture_cpu, graph = _median(lambda: capture(model, batch), repeats)
    verify_s, verify_cpu, report = _median(lambda: verify_capture(model, batch, graph), repeats)
    return {
        "model": name,
        "params_m": round(nparams(model) / 1e6, 1),
        "nodes": len(graph.nodes),
        "dummy_shapes": {k: list(v.shape) for k, v in batch.items()},
        "capture_s": round(capture_s, 3),
        "verify_s": round(verify_s, 3),
        "verify_over_capture": round(verify_s / capture_s, 3),
        "cpu_verify_over_capture": round(verify_cpu / capture_cpu, 3),
        "modes": report.modes,
        "backward": report.backward,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: torch's default); 1 is steadier on a busy machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row(name, args.repeats) for name in args.rows.split(",")]
    print(
        json.dumps(
            {
                "benchmark": "verify time vs capture time",
                "rows": rows,
                "target": {"verify_over_capture": 1.5, "params_under_m": 100},
                "torch_threads": torch.get_num_threads(),
                "machine": load_note(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
