"""Layer functions: repeated layers that share their code are written once, as a method called per
layer (nnscaler.codegen.layer_functions), and their `add_shard` lines as a loop."""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.codegen import generate_code
from nnscaler.codegen.layer_names import readable_names
from nnscaler.codegen.shard_loops import ShardCall, shard_loop_lines
from nnscaler.graph.capture import capture
from nnscaler.partition import apply_pipeline, apply_plan
from nnscaler.policies import make_plan
from tests import zoo
from tests.parity import ParityCase, run_parity_many


def build_llama4(seed: int = 0):
    """The zoo's Llama with four layers (importable by spawned ranks)."""
    return zoo.build_llama(seed, num_hidden_layers=4)


def _shapes(graph) -> dict:
    return {k: v.meta.shape for k, v in graph.values.items() if v.meta is not None}


def _code(graph, plan, cfg, rank: int = 0, **kwargs) -> str:
    program = apply_pipeline(graph, plan) if plan.pipeline else apply_plan(graph, plan)
    return generate_code(
        program, rank, cfg, graph.module_class, plan.policy, _shapes(graph), "test", **kwargs
    )


def _functions(code: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}


def _sections(code: str) -> dict[str, str]:
    """Section title -> its lines, for the sections of forward and the stage methods."""
    out, title = {}, None
    for line in code.splitlines():
        m = re.match(r"\s+# ---- (\S+) ", line)
        if m:
            title = m.group(1)
            out[title] = ""
        elif line.lstrip().startswith("def "):
            title = None
        elif title is not None:
            out[title] += line + "\n"
    return out


def test_32_layer_llama_tp8_is_written_once_per_layer_kind():
    """Acceptance: a 32-layer Llama under tp over 8 ranks fits in 800 lines (all layers inline: ~4,100)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=128,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    graph = capture(model, {"input_ids": ids, "labels": ids.clone()})
    cfg = ComputeConfig(8, 8)
    code = _code(graph, make_plan(graph, "tp", cfg), cfg)
    assert len(code.splitlines()) <= 800
    functions = _functions(code)
    assert [n for n in functions if n.startswith("_layer_")] == ["_layer_LlamaDecoderLayer"]
    calls = re.findall(r'self\._layer_LlamaDecoderLayer\(_LayerParams\(self, "model_layers_(\d+)_"\)', code)
    assert calls == [str(i) for i in range(32)]
    assert "for i in range(32):  # model.layers.0 .. model.layers.31: 9 tensors each" in code
    body = ast.unparse(functions["_layer_LlamaDecoderLayer"])
    assert body.count("comm.reduce_from_group(") == 2  # attention and MLP, written once
    assert "# modeling_llama.py:" in code.split("def _layer_LlamaDecoderLayer", 1)[1]  # source comments kept


def test_layers_split_differently_are_not_merged():
    model, make_batch = zoo.build_gpt(0, n_layer=3)
    graph = capture(model, make_batch(1, 2))
    cfg = ComputeConfig(2, 2)
    plan = make_plan(graph, "tp", cfg)
    replicated = {n.name for n in graph.nodes if n.module_path.startswith("transformer.h.2.mlp")}
    assert replicated
    plan = dataclasses.replace(plan, nodes={k: v for k, v in plan.nodes.items() if k not in replicated})
    code = _code(graph, plan, cfg)
    sections = _sections(code)
    for i in (0, 1):
        assert f'self._layer_Block(_LayerParams(self, "transformer_h_{i}_")' in sections[f"transformer.h.{i}"]
    assert "_layer_" not in sections["transformer.h.2"]  # its MLP is replicated: its own inline code
    assert "F.linear(layer_norm_5, self.transformer_h_2_mlp_c_fc_weight" in sections["transformer.h.2"]
    assert "for i in range(2):  # transformer.h.0 .. transformer.h.1" in code  # h.2's weights: own lines
    assert 'self.add_shard("transformer_h_2_mlp_c_fc_weight"' in code


def test_a_layer_cut_by_a_stage_boundary_keeps_its_code():
    model, make_batch = zoo.build_gpt(0, n_layer=4)
    graph = capture(model, make_batch(1, 2))
    pas = {"pipeline_nmicros": 2, "pipeline_stages": ["transformer.h.1.mlp"]}
    cfg = ComputeConfig(2, 2, use_end2end=True, pas_config=pas)
    plan = make_plan(graph, "pp", cfg)
    first, second = (_code(graph, plan, cfg, rank) for rank in (0, 1))
    assert "_layer_" not in first  # h.0 whole and h.1's attention: no two alike
    sections = _sections(second)
    assert "_layer_" not in sections["transformer.h.1"]  # h.1's MLP only
    for i in (2, 3):
        assert f'self._layer_Block(_LayerParams(self, "transformer_h_{i}_")' in sections[f"transformer.h.{i}"]


def test_without_layer_functions_every_layer_is_inline(zoo_graphs):
    graph = zoo_graphs["gpt"][0]
    cfg = ComputeConfig(2, 2)
    plan = make_plan(graph, "tp", cfg)
    assert "def _layer_Block(" in _code(graph, plan, cfg)
    inline = _code(graph, plan, cfg, layer_functions=False)
    assert "_layer_" not in inline and "_LayerParams" not in inline
    assert "self.transformer_h_1_mlp_c_fc_weight" in inline


@pytest.mark.parametrize(
    "recompute", [None, "LlamaDecoderLayer", "LlamaMLP"], ids=["plain", "whole-layers", "inside-layers"]
)
def test_layer_functions_compute_the_model(recompute, tmp_path):
    """One process, one device: the generated module (layer functions, checkpointed or with checkpointed
    parts) gives the model's loss and gradients."""
    model, make_batch = build_llama4()
    pas = {"recompute_modules": recompute} if recompute else {}
    pm = parallelize(model, make_batch(0, 2), "dp", ComputeConfig(1, 1, pas_config=pas), gen_savedir=tmp_path)
    code = next(tmp_path.rglob("gencode0.py")).read_text()
    assert code.count('_LayerParams(self, "model_layers_') == 4  # one call per layer
    if recompute == "LlamaDecoderLayer":
        assert code.count("ckpt.checkpoint(self._layer_LlamaDecoderLayer, ") == 4
    if recompute == "LlamaMLP":
        layer = code.split("def _layer_LlamaDecoderLayer", 1)[1]
        assert "def recompute_mlp(" in layer and "ckpt.checkpoint(recompute_mlp, " in layer
    batch = make_batch(3, 3)
    loss = model(**batch).loss
    loss.backward()
    gen_loss = zoo.extract_loss(pm(**batch))
    gen_loss.backward()
    torch.testing.assert_close(gen_loss, loss)
    names = pm.dist_param_map
    grads = {names[n]: p.grad for n, p in pm.named_parameters() if n in names}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_layer_functions_parity_tp2_pp2_recompute(tmp_path):
    """Parity on 2 gloo ranks with layer functions in use: tensor parallel, two pipeline stages of two
    layers each, whole layers recomputed, and parts of layers recomputed inside the layer function."""
    llama = f"{__name__}:build_llama4"
    cases = [
        ParityCase(llama, "tp", 2),
        ParityCase(llama, "pp", 2, {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}, nmicros=2),
        ParityCase(llama, "tp", 2, {"pas_config": {"recompute_modules": "LlamaDecoderLayer"}}),
        ParityCase("gpt", "tp", 2, {"pas_config": {"recompute_modules": "MLP"}}),
    ]
    run_parity_many(cases, 2, tmp_path=tmp_path)
    for k in range(len(cases)):
        for path in sorted((tmp_path / "gen" / f"case{k}").rglob("gencode*.py")):
            assert re.search(r"def _layer_\w+\(self, p, ", path.read_text()), path


def test_shard_loop_needs_consecutive_layers_stored_alike():
    def calls(layers, shape=lambda i: (4,)):
        return [
            ShardCall(f"h_{i}_{w}", f"h.{i}.{w}", f", {shape(i)}, torch.float32)", "replicated")
            for i in layers
            for w in ("a", "b")
        ]

    lines = shard_loop_lines(calls([0, 1, 2]))
    assert [line.code for line in lines][:2] == [
        "for i in range(3):",
        'self.add_shard(f"h_{i}_a", f"h.{i}.a", (4,), torch.float32)',
    ]
    assert [line.indent for line in lines] == [0, 1, 1]
    assert len(shard_loop_lines(calls([0, 2]))) == 4  # not consecutive: one line each
    assert len(shard_loop_lines(calls([0, 1], shape=lambda i: (4 + i,)))) == 4  # other shapes
    hostile = [ShardCall(f"h_{i}_a", f'h.{i}.a"b', ", (4,), torch.float32)", "") for i in range(3)]
    assert [line.indent for line in shard_loop_lines(hostile)] == [0, 0, 0]  # names not plain: no loop


def test_readable_names_renumber_and_keep_derived_names():
    names = readable_names(["add_6", "to_8", "mul_16", "mul_16_tp", "linear_7", "pow_3"], {"pow", "tp"})
    assert names == {
        "add_6": "add",
        "to_8": "to",
        "mul_16": "mul",
        "linear_7": "linear",
        "pow_3": "pow_1",
        "mul_16_tp": "mul_tp",
    }
