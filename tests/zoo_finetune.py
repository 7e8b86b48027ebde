"""Fine-tuning models for tests: some parameters frozen (`requires_grad=False`) before compiling.

Every builder follows tests/zoo.py's convention, `(model, make_batch) = build_x(seed)`, and is reached
by the parity harness as `"tests.zoo_finetune:build_x"`. The freezing is part of the builder, so the
parallel ranks and the single-device reference freeze the same parameters. No weights are downloaded.

- `build_gpt_frozen_pos`: nanoGPT with its position table frozen (a frozen weight tied to nothing),
  and a frozen parameter forward never reads.
- `build_gpt_frozen_embeddings`: nanoGPT with the token embedding (tied to the LM head) and the
  position table frozen.
- `build_lora_llama`: a tiny transformers Llama (hidden 32, 2 layers, vocab 64) with LoRA adapters on
  the attention projections through peft: every base weight frozen, only the adapters train;
  `build_lora_llama_last_layer`: adapters on the last layer only.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from examples.nanogpt.model import GPT, GPTConfig
from tests.zoo import MakeBatch, _settle, _settle_model, _token_batch

__all__ = [
    "FINETUNE_MODELS",
    "build_gpt_frozen_pos",
    "build_gpt_frozen_embeddings",
    "build_lora_llama",
    "build_lora_llama_last_layer",
    "frozen_names",
    "FrozenPosGPT",
    "LORA_VOCAB",
]

LORA_VOCAB = 64


def frozen_names(model: nn.Module) -> list[str]:
    """State-dict names of the frozen parameters of `model` (tied names once, as named_parameters)."""
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def _gpt(seed: int) -> nn.Module:
    config = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    torch.manual_seed(seed)
    return GPT(config).train()


def build_gpt_frozen_pos(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """nanoGPT (2 layers, width 32) whose position table `transformer.wpe.weight` is frozen, plus a
    frozen parameter `spare` that forward does not use."""
    model = _gpt(seed)
    model.transformer.wpe.weight.requires_grad_(False)
    # a frozen table that forward never reads: kept, saved and loaded all the same
    model.spare = nn.Parameter(torch.randn(4, 32), requires_grad=False)
    return model, _token_batch(64, 8, "idx", "targets", shift=True)


def build_gpt_frozen_embeddings(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """nanoGPT whose token embedding (tied to `lm_head.weight`) and position table are frozen."""
    model = _gpt(seed)
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.wpe.weight.requires_grad_(False)
    return model, _token_batch(64, 8, "idx", "targets", shift=True)


def build_lora_llama(seed: int = 0, layers: list[int] | None = None) -> tuple[nn.Module, MakeBatch]:
    """LoRA (rank 4 on q_proj and v_proj, peft's `get_peft_model`) over a tiny Llama: the base model
    is frozen, the adapters train (on the decoder layers `layers`; None: all). peft starts each `lora_B`
    at zero; it is drawn here at small random values instead, so that the first step already trains
    `lora_A` too."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=LORA_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    _settle(config)
    torch.manual_seed(seed)
    base = _settle_model(LlamaForCausalLM(config))
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias="none",
        layers_to_transform=layers,
    )
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model.train(), _token_batch(LORA_VOCAB, 8, "input_ids", "labels", shift=False)


def build_lora_llama_last_layer(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """`build_lora_llama` with adapters on the last decoder layer only: the embedding and the whole
    first layer are frozen (a first pipeline stage holding no trainable parameter at all)."""
    return build_lora_llama(seed, layers=[1])


class FrozenPosGPT(GPT):
    """For the trainer's `model.type`: nanoGPT built from `config` with its position table frozen."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.transformer.wpe.weight.requires_grad_(False)


FINETUNE_MODELS = {
    "gpt_frozen_pos": "tests.zoo_finetune:build_gpt_frozen_pos",
    "gpt_frozen_embeddings": "tests.zoo_finetune:build_gpt_frozen_embeddings",
    "lora_llama": "tests.zoo_finetune:build_lora_llama",
    "lora_llama_last_layer": "tests.zoo_finetune:build_lora_llama_last_layer",
}
"""Short name -> the name `tests.zoo.build` (and the parity harness) takes."""
