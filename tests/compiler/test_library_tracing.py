"""transformers models trace as they run eagerly with static shapes: causal attention without a
materialised mask (flash-attention eligible), explicit masks only where an input asks for one."""

from __future__ import annotations

import pytest
import torch

from nnscaler.graph.capture import capture
from tests import zoo


def _sdpa(graph):
    return [n for n in graph.nodes if n.op == "aten.scaled_dot_product_attention.default"]


def _mask_and_causal(node):
    args = node.args
    mask = args[3] if len(args) > 3 else node.kwargs.get("attn_mask")
    causal = args[5] if len(args) > 5 else node.kwargs.get("is_causal", False)
    return mask, causal


@pytest.mark.parametrize("batch", [1, 2])
def test_causal_llama_has_no_mask(batch):
    """Also under transformers 5.17, whose mask code took every call under torch.export for tracing
    (checked by hand with it installed: CI gets the newest)."""
    model, make_batch = zoo.build("llama")
    graph = capture(model, make_batch(1, batch))
    nodes = _sdpa(graph)
    assert len(nodes) == 2
    for node in nodes:
        mask, causal = _mask_and_causal(node)
        assert mask is None and causal is True
        q, k = (graph.values[r.name].meta.shape for r in node.args[:2])
        # grouped-query attention stays grouped, as transformers runs it eagerly: no repeated K/V heads
        assert (q[1], k[1]) == (4, 2) and node.kwargs.get("enable_gqa") is True


def test_padding_mask_input_still_masks():
    model, make_batch = zoo.build("llama")
    batch = make_batch(1, 2)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    graph = capture(model, batch)
    for node in _sdpa(graph):
        mask, _ = _mask_and_causal(node)
        assert mask is not None, "a padding mask given as input must reach attention"


def test_given_position_ids_keep_packed_sequence_handling():
    model, make_batch = zoo.build("llama")
    batch = make_batch(1, 2)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    graph = capture(model, batch)
    for node in _sdpa(graph):
        mask, _ = _mask_and_causal(node)
        assert mask is not None, "position ids may describe packed sequences: the mask must follow them"
