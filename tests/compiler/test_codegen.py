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
from nnscaler.runtime import ParallelModule
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
    with pytest.raises(ConfigError, match=r"dummy input x: .*\[4, 16\].*\[8, 16\].*reuse='moo'"):
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


def test_reuse_graph_replans_from_saved_graph(tmp_path, monkeypatch):
    model, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, load_module=False)
    outdir = tmp_path / "_parallel_modules" / "tests" / "zoo" / type(model).__qualname__ / "_"
    saved_graph = (outdir / "graph.json").read_text()

    def no_trace(*args, **kwargs):
        raise AssertionError("reuse='graph' traced the model again")

    monkeypatch.setattr("nnscaler.parallel.compile.capture", no_trace)
    # another plan (2 plan devices, the batch split) from the same saved graph, without tracing
    pm = parallelize(
        model, batch, "data", ComputeConfig(2, 2), gen_savedir=tmp_path, reuse="graph", load_module=False
    )
    assert pm is None
    assert (outdir / "graph.json").read_text() == saved_graph
    assert '"data"' in (outdir / "plan.json").read_text() and (outdir / "gencode1.py").exists()
    pm = parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, reuse="graph")
    other = make_batch(1, 4)
    torch.testing.assert_close(pm(**other), model(**other))
    # without a saved graph, or with reuse='match' and a mismatch, tracing would be needed: it is called
    with pytest.raises(AssertionError, match="traced the model again"):
        parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path / "fresh", reuse="graph")


def test_parallelize_class_returns_generated_class(tmp_path):
    model, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    cls = parallelize(
        type(model), batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, module_fn=lambda: model
    )
    assert isinstance(cls, type) and cls.__name__ == "GenModel" and issubclass(cls, ParallelModule)
    for name in ("forward", "train_step", "infer_step", "sync_grad", "clip_gnorm", "load_merged_state_dict"):
        assert callable(getattr(cls, name)), name
    assert cls.rank == 0 and cls.compute_config == ComputeConfig(1, 1)
    # init_params=True starts from the weights of the module rank 0 built (module_fn): same function
    pm = cls()
    assert {info.original_name for info in pm.fullmap.values()} == set(model.state_dict())
    other = make_batch(1, 4)
    torch.testing.assert_close(pm(**other), model(**other))
    # init_params=False leaves them to the caller
    pm = cls(init_params=False)
    pm.load_merged_state_dict(model.state_dict())
    torch.testing.assert_close(pm(**other), model(**other))
