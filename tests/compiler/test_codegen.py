"""Generated files: output layout, determinism, reuse modes, and a golden file for readability."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.codegen import generate_code
from nnscaler.errors import ConfigError
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from tests import zoo

GOLDEN = Path(__file__).parent.parent / "golden"


def _code(graph, policy, cfg, rank):
    program = apply_plan(graph, make_plan(graph, policy, cfg))
    shapes = {k: v.meta.shape for k, v in graph.values.items() if v.meta is not None}
    return generate_code(program, rank, cfg, graph.module_class, policy, shapes, "test")


def test_same_graph_and_plan_give_byte_identical_code(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    assert _code(graph, "tp", ComputeConfig(2, 4), 3) == _code(graph, "tp", ComputeConfig(2, 4), 3)


def test_golden_gpt_tp_rank0(zoo_graphs):
    """The readable shape of generated tp code; regenerate with NNSCALER_UPDATE_GOLDEN=1 after a deliberate change."""
    text = _code(zoo_graphs["gpt"][0], "tp", ComputeConfig(2, 4), 0)
    golden = GOLDEN / "gpt_tp_2_4_rank0.py"
    if os.environ.get("NNSCALER_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_output_directory_layout_and_reuse(tmp_path):
    model, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    pm = parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, instance_name="first")
    outdir = tmp_path / "_parallel_modules" / "tests" / "zoo" / type(model).__qualname__ / "first"
    names = {p.name for p in outdir.iterdir()}
    assert {"gencode0.py", "plan.json", "graph.json", "compute_config.json", "fingerprint.json"} <= names
    torch.testing.assert_close(pm(**batch), model(**batch))
    stamp = (outdir / "gencode0.py").stat().st_mtime_ns
    # match: same inputs reuse the files untouched
    parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, instance_name="first")
    assert (outdir / "gencode0.py").stat().st_mtime_ns == stamp
    # match: a different dummy batch shape is an error that says how to proceed
    other = make_batch(0, 8)
    with pytest.raises(ConfigError, match="reuse='moo'"):
        parallelize(model, other, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, instance_name="first")
    # moo regenerates; override always regenerates
    pm = parallelize(
        model, other, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, instance_name="first", reuse="moo"
    )
    torch.testing.assert_close(pm(**other), model(**other))
    parallelize(
        model, other, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, instance_name="first", reuse="override"
    )
    assert (outdir / "gencode0.py").stat().st_mtime_ns != stamp


def test_reuse_graph_replans_from_saved_graph(tmp_path):
    model, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, load_module=False)
    pm = parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, reuse="graph")
    torch.testing.assert_close(pm(**batch), model(**batch))


def test_parallelize_class_returns_generated_class(tmp_path):
    model, make_batch = zoo.build("mlp")
    cls = parallelize(type(model), make_batch(0, 4), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    assert isinstance(cls, type) and cls.__name__ == "GenModel"
