"""A tiny Qwen2-VL for tests, unmodified: its data-dependent methods run as opaque ops, the rest splits.

    model, make_batch = build_qwen2_vl(seed=0)      # "tests.zoo_vl:build_qwen2_vl" for the harness
    loss = model(**make_batch(seed=1, batch_size=2)).loss

Each sequence holds one image of `_GRID` patches (t, h, w), merged 2x2 into `_IMAGE_TOKENS` image
tokens between vision start / end tokens. The model is transformers' own, called as a user would
(`mm_token_type_ids` from the processor, no precomputed positions). Two of Qwen2VLModel's methods read
input values, which torch.export cannot trace: `get_image_features` (the vision tower, whose rotary
positions and attention windows come from `image_grid_thw.tolist()`, then the features split per image
by sizes read from `image_grid_thw`) and `get_rope_index` (3-D positions from loops over
`.tolist()`). Each runs as one opaque op; the text model around them is captured and split.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["build_qwen2_vl", "IMAGE_TOKEN_ID"]

IMAGE_TOKEN_ID = 64
_VIDEO, _VISION_START, _VISION_END = 65, 66, 67
_VOCAB = 72
_GRID = (1, 4, 4)  # temporal, height, width patches per image
_IMAGE_TOKENS = _GRID[0] * _GRID[1] * _GRID[2] // 4  # after the 2x2 spatial merge
_PATCH_DIM = 3 * 1 * 2 * 2  # channels * temporal_patch_size * patch_size**2
_SEQ = 12


def _config() -> Any:
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": _VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "use_cache": False,
            "bos_token_id": None,
            "eos_token_id": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 2,
            "temporal_patch_size": 1,
            "spatial_merge_size": 2,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=_VIDEO,
        vision_start_token_id=_VISION_START,
        vision_end_token_id=_VISION_END,
        use_cache=False,
    )
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "sdpa"
    return config


def build_qwen2_vl(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A 2-layer Qwen2-VL (hidden 32) with a 1-block vision tower; batches of one image per sequence."""
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(_config())
    model.loss_type = "ForCausalLM"
    model = model.float().train()

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, IMAGE_TOKEN_ID, (batch_size, _SEQ), generator=g)
        ids[:, 1] = _VISION_START
        ids[:, 2 : 2 + _IMAGE_TOKENS] = IMAGE_TOKEN_ID
        ids[:, 2 + _IMAGE_TOKENS] = _VISION_END
        return {
            "input_ids": ids,
            "pixel_values": torch.randn(batch_size * _GRID[0] * _GRID[1] * _GRID[2], _PATCH_DIM, generator=g),
            "image_grid_thw": torch.tensor([_GRID] * batch_size),
            "mm_token_type_ids": (
                ids == IMAGE_TOKEN_ID
            ).int(),  # as the processor gives it: 1 for image tokens
            "labels": ids.clone(),
        }

    return model, make_batch
