"""swin's policy gallery (examples/vision/swin/policy/gallery.py of nnScaler 0.8) and its model, imported
unchanged from the checkout in $NNSCALER08_UPSTREAM, with the model's Config made tiny and its
dropout rates 0 (so parity against one device holds). The `swin_*` functions call the gallery's
policies; they live here so spawned ranks that unpickle them import this module (shims, model) first."""

from __future__ import annotations

import types

import upstream_shims

upstream_shims.install()

import torch  # noqa: E402

import nnscaler  # noqa: E402
import nnscaler.runtime  # noqa: E402

if not hasattr(nnscaler.runtime, "function"):  # swin's model calls nnscaler.runtime.function.anchor
    nnscaler.runtime.function = types.SimpleNamespace(anchor=nnscaler.anchor)

from examples.vision.swin.model import Config, SwinTransformer  # noqa: E402
from examples.vision.swin.policy.gallery import pas_1f1b, pas_megatron, pas_mesh_shard  # noqa: E402
from nnscaler.graph import IRGraph  # noqa: E402
from tests import zoo  # noqa: E402

TINY = dict(embed_dim=32, depths=[2, 2], num_heads=[4, 8], img_size=32, window_size=4, num_classes=10)
NO_DROPOUT = dict(drop_rate=0.0, drop_path_rate=0.0, attn_drop_rate=0.0)


def build_swin_tiny(seed: int = 0):
    for key, value in {**TINY, **NO_DROPOUT}.items():
        setattr(Config, key, value)
    model = SwinTransformer()  # seeds itself (torch.manual_seed(0)) as swin's train.py relies on

    def make_batch(seed: int, batch_size: int) -> dict:
        return {"x": torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(seed))}

    return model.train(), make_batch


zoo.MODELS.setdefault("swin_tiny", build_swin_tiny)


def swin_megatron(graph: IRGraph, cfg):
    return pas_megatron(graph, cfg)


def swin_mesh_shard(graph: IRGraph, cfg):
    return pas_mesh_shard(graph, cfg)


def swin_1f1b(graph: IRGraph, cfg):
    return pas_1f1b(graph, cfg)


__all__ = ["pas_megatron", "pas_mesh_shard", "pas_1f1b", "swin_megatron", "swin_mesh_shard", "swin_1f1b"]
