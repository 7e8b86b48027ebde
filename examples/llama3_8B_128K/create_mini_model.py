"""Create a small Llama-3-style model (GQA, SwiGLU, RMSNorm, rotary) from a LlamaConfig, without
downloading anything, and save its config and random weights (safetensors) for train.py --model_id.

    python examples/llama3_8B_128K/create_mini_model.py --output_dir ./llama3_mini

The default vocabulary (264) holds the offline byte tokenizer's 258 ids, padded to a multiple of 8
so tensor parallelism can split the embedding and the output layer.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--intermediate_size", type=int, default=448, help="3.5 x hidden, as Llama-3-8B")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2, help="grouped-query attention")
    p.add_argument("--vocab_size", type=int, default=264)
    p.add_argument("--max_position_embeddings", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> LlamaConfig:
    args = parse_args(argv)
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.output_dir)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"saved a {n / 1e6:.2f}M-parameter Llama ({args.layers} layers, hidden {args.hidden_size}) to {args.output_dir}"
    )
    return config


if __name__ == "__main__":
    main()
