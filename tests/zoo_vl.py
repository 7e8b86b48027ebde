"""A tiny Qwen2-VL for tests: a vision tower whose code reads input values (opaque leaf module).

    model, make_batch = build_qwen2_vl(seed=0)      # "tests.zoo_vl:build_qwen2_vl" for the harness
    loss = model(**make_batch(seed=1, batch_size=2)).loss

Each sequence holds one image of `_GRID` patches (t, h, w), merged 2x2 into `_IMAGE_TOKENS` image
tokens between vision start / end tokens. Qwen2-VL's vision tower (`model.visual`) computes its
rotary positions and attention windows from `image_grid_thw.tolist()`, which torch.export cannot
trace: it runs as one opaque op. The 3-D (multimodal RoPE) positions are computed when the batch is
made, as a data pipeline would (`get_rope_index` loops over token types in Python), and passed batch
first: the parity harness concatenates batches on dim 0, Qwen2-VL takes them as (3, batch, seq).
"""

from __future__ import annotations

import types
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


def _model_class() -> type:
    from transformers import Qwen2VLForConditionalGeneration

    class Qwen2VLBatchFirst(Qwen2VLForConditionalGeneration):
        """Qwen2-VL taking its 3-D positions batch first, (batch, 3, seq)."""

        def forward(self, input_ids, pixel_values, image_grid_thw, position_ids, labels):  # noqa: D102
            return super().forward(
                input_ids=input_ids,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                position_ids=position_ids.transpose(0, 1),
                labels=labels,
            )

    return Qwen2VLBatchFirst


def _image_features(self, pixel_values, image_grid_thw=None, return_dict=True, **kwargs):
    """Qwen2VLModel.get_image_features without splitting the features per image: forward concatenates
    the pieces again at once, and the split (by `image_grid_thw.tolist()`) would read input values in
    Qwen2VLModel's own code, outside the vision tower, which would then make all of it opaque."""
    out = self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw, **kwargs)
    out.pooler_output = (out.pooler_output,)
    return out


def build_qwen2_vl(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A 2-layer Qwen2-VL (hidden 32) with a 1-block vision tower; batches of one image per sequence."""
    torch.manual_seed(seed)
    model = _model_class()(_config())
    model.loss_type = "ForCausalLM"
    model.model.get_image_features = types.MethodType(_image_features, model.model)
    model = model.float().train()

    def make_batch(seed: int, batch_size: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, IMAGE_TOKEN_ID, (batch_size, _SEQ), generator=g)
        ids[:, 1] = _VISION_START
        ids[:, 2 : 2 + _IMAGE_TOKENS] = IMAGE_TOKEN_ID
        ids[:, 2 + _IMAGE_TOKENS] = _VISION_END
        grid = torch.tensor([_GRID] * batch_size)
        pixels = torch.randn(batch_size * _GRID[0] * _GRID[1] * _GRID[2], _PATCH_DIM, generator=g)
        with torch.no_grad():
            mm = (ids == IMAGE_TOKEN_ID).int()
            positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid)
        return {
            "input_ids": ids,
            "pixel_values": pixels,
            "image_grid_thw": grid,
            "position_ids": positions.transpose(0, 1).contiguous(),
            "labels": ids.clone(),
        }

    return model, make_batch
