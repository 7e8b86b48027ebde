"""Model families beyond the decoder LMs, each built fresh from its library's config class.

Every builder follows tests/zoo.py's convention, `(model, make_batch) = build_x(seed)`, and is
reached by the parity harness as `"tests.zoo_families:build_x"`. Sizes are tiny (a few thousand
parameters) so that several families train side by side in one CI run; no weights are downloaded.

The families are the ones a new user meets first and the ones whose code paths the decoder zoo
does not take: encoder-decoders that build their decoder input by writing into a slice (T5, BART,
Whisper), latent attention with unequal splits and a mixture of experts (DeepSeek-V3, Qwen2-MoE),
a state-space model with a depthwise convolution (Mamba), a diffusion UNet, a ViT and ModernBERT.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.zoo import MakeBatch, _generator, _settle, _settle_model

__all__ = [
    "FAMILIES",
    "build_t5",
    "build_bart",
    "build_whisper",
    "build_deepseek_v3",
    "build_qwen2_moe",
    "build_mamba",
    "build_unet",
    "build_hf_vit",
    "build_modernbert",
]

VOCAB = 64
SEQ = 8


def _tokens(seed: int, batch_size: int, length: int, low: int = 3) -> torch.Tensor:
    return torch.randint(low, VOCAB, (batch_size, length), generator=_generator(seed))


def _lm_batch(input_key: str = "input_ids") -> MakeBatch:
    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        ids = _tokens(seed, batch_size, SEQ + 1, low=0)
        return {input_key: ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}

    return make_batch


def _seq2seq_batch(seed: int, batch_size: int) -> dict[str, Any]:
    """Source tokens and target labels: the model builds its decoder input by shifting the labels."""
    return {
        "input_ids": _tokens(seed, batch_size, SEQ),
        "labels": _tokens(seed + 7919, batch_size, SEQ - 2),
    }


def _build(model_cls, config, seed: int, attention: bool = True) -> nn.Module:
    if attention:
        _settle(config)
    else:  # no attention to choose an implementation for
        config.loss_type = "ForCausalLM"
    config.use_cache = False
    torch.manual_seed(seed)
    return _settle_model(model_cls(config))


def build_t5(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Encoder-decoder with relative position buckets; `_shift_right` writes into a slice."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = _build(T5ForConditionalGeneration, config, seed)
    model.loss_type = None
    return model, _seq2seq_batch


def build_bart(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Encoder-decoder with learned positions; `shift_tokens_right` writes into slices."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    model = _build(BartForConditionalGeneration, config, seed)
    model.loss_type = None
    return model, _seq2seq_batch


def build_whisper(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Speech encoder (two convolutions over mel frames) and a text decoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    model = _build(WhisperForConditionalGeneration, config, seed)
    model.loss_type = None

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        features = torch.randn(batch_size, 8, 16, generator=_generator(seed))
        return {"input_features": features, "labels": _tokens(seed + 7919, batch_size, SEQ - 2)}

    return model, make_batch


def build_deepseek_v3(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Multi-head latent attention (unequal splits, K/V filled into slices) and routed + shared experts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return _build(DeepseekV3ForCausalLM, config, seed), _lm_batch()


def build_qwen2_moe(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Routed experts plus a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return _build(Qwen2MoeForCausalLM, config, seed), _lm_batch()


def build_mamba(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Selective state-space model: depthwise conv1d, unequal split of x_proj, a sequential scan."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=4, use_mambapy=False, tie_word_embeddings=False,
    )  # fmt: skip
    return _build(MambaForCausalLM, config, seed, attention=False), _lm_batch()


class UNetDenoiser(nn.Module):
    """A diffusers UNet2DConditionModel trained to predict the noise (the loss inside forward)."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
            attention_head_dim=8, norm_num_groups=8,
        )  # fmt: skip

    def forward(self, sample, timestep, context, noise):
        pred = self.unet(sample, timestep, encoder_hidden_states=context).sample
        return F.mse_loss(pred, noise)


def build_unet(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    torch.manual_seed(seed)
    model = UNetDenoiser().float().train()

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        g = _generator(seed)
        return {
            "sample": torch.randn(batch_size, 4, 8, 8, generator=g),
            "timestep": torch.randint(0, 1000, (batch_size,), generator=g),
            "context": torch.randn(batch_size, 4, 16, generator=g),
            "noise": torch.randn(batch_size, 4, 8, 8, generator=g),
        }

    return model, make_batch


def build_hf_vit(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """transformers' ViT image classifier (patch convolution, CLS token, pooled head)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    _settle(config)
    config.loss_type = None
    torch.manual_seed(seed)
    model = ViTForImageClassification(config).float().train()

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        g = _generator(seed)
        return {
            "pixel_values": torch.randn(batch_size, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 5, (batch_size,), generator=g),
        }

    return model, make_batch


def build_modernbert(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Masked LM with alternating local (sliding window) and global attention and rotary embeddings."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    config = ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, pad_token_id=0, global_attn_every_n_layers=2, local_attention=4,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = _build(ModernBertForMaskedLM, config, seed)
    model.loss_type = None

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        ids = _tokens(seed, batch_size, SEQ, low=1)
        return {"input_ids": ids, "labels": _tokens(seed + 7919, batch_size, SEQ, low=1)}

    return model, make_batch


FAMILIES = {
    "t5": "tests.zoo_families:build_t5",
    "bart": "tests.zoo_families:build_bart",
    "whisper": "tests.zoo_families:build_whisper",
    "deepseek_v3": "tests.zoo_families:build_deepseek_v3",
    "qwen2_moe": "tests.zoo_families:build_qwen2_moe",
    "mamba": "tests.zoo_families:build_mamba",
    "unet": "tests.zoo_families:build_unet",
    "hf_vit": "tests.zoo_families:build_hf_vit",
    "modernbert": "tests.zoo_families:build_modernbert",
}
"""Family name -> the harness's builder name."""


def build_mamba2(seed: int = 0) -> tuple[nn.Module, MakeBatch]:
    """Mamba2: multi-head state space with a chunked scan (segment sums, cumulative sums)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
        num_heads=8, head_dim=8, n_groups=1, chunk_size=4, time_step_rank=4, tie_word_embeddings=False,
    )  # fmt: skip
    return _build(Mamba2ForCausalLM, config, seed, attention=False), _lm_batch()


FAMILIES["mamba2"] = "tests.zoo_families:build_mamba2"
