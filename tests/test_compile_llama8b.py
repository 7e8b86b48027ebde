"""Llama-3-8B built on the meta device compiles with tp over 8 ranks without materialising weights."""

from __future__ import annotations

import torch

from nnscaler import ComputeConfig, parallelize


def test_llama3_8b_meta_tp8(tmp_path):
    from benchmarks.compile_time import llama3_8b

    model = llama3_8b(layers=2)  # two layers keep CI fast; benchmarks/compile_time.py runs all 32
    ids = torch.zeros(1, 128, dtype=torch.long)
    parallelize(
        model,
        {"input_ids": ids, "labels": ids.clone()},
        "tp",
        ComputeConfig(8, 8),
        gen_savedir=tmp_path,
        load_module=False,
    )
    assert all(p.is_meta for p in model.parameters()), "compiling must not materialise weights"
    outdir = next(tmp_path.glob("_parallel_modules/**/LlamaForCausalLM/_"))
    files = sorted(p.name for p in outdir.glob("gencode*.py"))
    assert files == [f"gencode{r}.py" for r in range(8)]
    from nnscaler.policies import Plan

    plan = Plan.from_json((outdir / "plan.json").read_text())
    notes = [p.note for p in plan.nodes.values()]
    assert notes.count("column-parallel") == 2 * 5 + 1 and notes.count("row-parallel") == 2 * 2
    text = (outdir / "gencode5.py").read_text()
    assert "shard=(0, 5, 8, 1))" in text  # rank 5 holds the sixth slice of the column-split weights
    # both layers call one layer function: attention + MLP reductions written once, + the embedding's
    assert text.count("self._layer_LlamaDecoderLayer(_LayerParams(self, ") == 2
    assert text.count("comm.reduce_from_group(") == 2 + 1
