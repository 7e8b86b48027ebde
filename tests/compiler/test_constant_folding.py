"""ComputeConfig(constant_folding=True), as in nnScaler 0.8: the sizes the generated code computes with
(view shapes, arange ends, split sizes) are written as their traced values and the input dims they
come from are checked at the forward's entry; dims the code never computes with take any size. A
model that cannot be traced with open sizes is traced with every size fixed, as before."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import nnscaler
from nnscaler.errors import TraceError
from tests.dist_util import spawn
from tests.parity import run_parity


class LinearStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(input)))


class UsesSizes(torch.nn.Module):
    """Computes with its input's sizes: `view(x.size(0), -1)` and `arange(x.size(1))`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).view(x.size(0), -1)
        pos = torch.arange(x.size(1), dtype=x.dtype).repeat_interleave(16)
        return y * pos


class NeedsFixedSizes(torch.nn.Module):
    """Code that only runs on plain int sizes (as some libraries are): torch.export cannot trace it with
    sizes left open, only with the dummy's sizes fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input.shape[0], int):
            raise TypeError("this model needs plain int sizes")
        return self.a(input)


def _parallelize(model, dummy, tmp_path, name, policy="dp", plan=1, runtime=1, folding=True):
    cfg = nnscaler.ComputeConfig(plan, runtime, constant_folding=folding)
    pm = nnscaler.parallelize(model, dummy, policy, cfg, gen_savedir=str(tmp_path), instance_name=name)
    src = next(Path(tmp_path).rglob(f"{name}/gencode{pm.rank}.py")).read_text()
    return pm, src


def _grads(module: torch.nn.Module, names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    return {(names or {}).get(n, n): p.grad.clone() for n, p in module.named_parameters()}


def _run(module, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    module.zero_grad()
    out = module(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad


# ---- one process: sizes the code never computes with stay open -------------------------------------


def test_unused_sizes_stay_open(tmp_path):
    torch.manual_seed(0)
    model = LinearStack()
    pm, src = _parallelize(model, {"input": torch.randn(100, 16)}, tmp_path, "stack")
    assert 'self.input_sizes("input", input, (None, 16))' in src, src
    assert "100" not in src.split("def forward", 1)[1]
    for rows in (2, 7, 100):
        x = torch.randn(rows, 16)
        out, xgrad = _run(pm, x)
        ref, ref_xgrad = _run(model, x)
        assert torch.equal(out, ref) and torch.equal(xgrad, ref_xgrad)
        grads = _grads(pm, pm.dist_param_map)
        assert grads.keys() == _grads(model).keys()
        for name, g in _grads(model).items():
            assert torch.equal(grads[name], g), name


def test_used_sizes_are_folded_and_checked(tmp_path):
    torch.manual_seed(0)
    model = UsesSizes()
    x = torch.randn(6, 5, 16)
    pm, src = _parallelize(model, {"x": x}, tmp_path, "uses")
    forward = src.split("def forward", 1)[1]
    # written as the traced sizes, and both dims fixed at the entry
    assert "reshape([6, -1])" in forward and "torch.arange(5," in forward, forward
    assert 'self.input_sizes("x", x, (6, 5, 16), static=(0, 1))' in forward, forward
    assert torch.equal(pm(x), model(x))
    with pytest.raises(ValueError, match=re.escape("x has shape [4, 5, 16], but dim 0 must be 6")) as e:
        pm(torch.randn(4, 5, 16))
    assert "constant_folding=True" in str(e.value)
    with pytest.raises(ValueError, match=re.escape("x has shape [6, 3, 16], but dim 1 must be 5")):
        pm(torch.randn(6, 3, 16))


def test_without_folding_the_same_model_takes_other_sizes(tmp_path):
    torch.manual_seed(0)
    model = UsesSizes()
    pm, src = _parallelize(model, {"x": torch.randn(6, 5, 16)}, tmp_path, "open", folding=False)
    assert "reshape([x_size0, -1])" in src, src
    x = torch.randn(3, 4, 16)
    assert torch.equal(pm(x), model(x))


def test_model_needing_fixed_sizes_falls_back(tmp_path):
    torch.manual_seed(0)
    model = NeedsFixedSizes()
    x = torch.randn(100, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm, src = _parallelize(model, {"input": x}, tmp_path, "fixed")
    assert any("could not be traced with input sizes left open" in str(w.message) for w in caught)
    assert 'self.input_sizes("input", input, (100, 16), static=True)' in src, src
    assert torch.equal(pm(x), model(x))
    with pytest.raises(ValueError, match=r"dim 0 must be 100.*constant_folding=True"):
        pm(torch.randn(2, 16))


def test_capture_retries_with_fixed_sizes(monkeypatch):
    """A conversion failure with open sizes (a size export cannot name) is retried with sizes fixed."""
    from nnscaler.graph import capture as capture_mod

    real, calls = capture_mod._capture, []

    def open_sizes_fail(module, args, static_shapes, *rest):
        calls.append(static_shapes)
        if not static_shapes:
            raise TraceError("size depends on tensor values")
        return real(module, args, static_shapes, *rest)

    monkeypatch.setattr(capture_mod, "_capture", open_sizes_fail)
    graph = capture_mod.capture(LinearStack(), {"input": torch.randn(8, 16)}, constant_folding=True)
    assert calls == [False, True]
    assert graph.static_shapes and not graph.size_names


def test_folding_graph_keeps_open_sizes():
    from nnscaler.graph.capture import capture

    graph = capture(LinearStack(), {"input": torch.randn(8, 16)}, constant_folding=True, both_modes=False)
    assert graph.static_shapes  # fingerprint / verify_program see constant_folding=True
    assert list(graph.size_names) == ["input_size0"]


# ---- two ranks --------------------------------------------------------------------------------------


def test_linear_stack_tp_parity_other_batches(tmp_path):
    """Traced at 100 rows, trained at 2 and 7 rows under a 2-way tensor-parallel plan (SGD: the merged
    weights match one-device training only if every gradient does)."""
    run_parity(
        "mlp",
        "tp",
        2,
        2,
        tmp_path=tmp_path,
        optimizer="sgd",
        atol=1e-6,
        batch_size=100,
        config_kwargs={"constant_folding": True},
        shapes=[(2, None), (7, None)],
    )


def _data_split_rank(rank: int, world_size: int, gen: str) -> dict[str, object]:
    nnscaler.init()
    out: dict[str, object] = {}

    def call(pm, model, x) -> str:
        try:
            got = pm(x).detach()
        except ValueError as e:
            return str(e)
        # each rank multiplies its half of the rows: BLAS may round a 1-row product differently
        ref = model(x).detach()
        return "matches" if torch.allclose(got, ref, rtol=1e-6, atol=1e-6) else f"differs: {got} vs {ref}"

    torch.manual_seed(0)
    stack = LinearStack()
    pm, _ = _parallelize(stack, {"input": torch.randn(100, 16)}, gen, "stack", "data", 2, 2)
    out["stack_2"], out["stack_7"] = call(pm, stack, torch.randn(2, 16)), call(pm, stack, torch.randn(7, 16))
    torch.manual_seed(0)
    uses = UsesSizes()
    pm, src = _parallelize(uses, {"x": torch.randn(6, 5, 16)}, gen, "uses", "data", 2, 2)
    out["uses_src"] = src
    out["uses_6"], out["uses_4"] = (
        call(pm, uses, torch.randn(6, 5, 16)),
        call(pm, uses, torch.randn(4, 5, 16)),
    )
    return out


def test_data_split_under_folding(tmp_path):
    """The `data` policy splits the batch over the plan's 2 ranks: a model that never computes with the
    batch size takes any even batch; one that does is fixed to the traced batch."""
    for r in spawn(_data_split_rank, 2, tmp_path, str(tmp_path / "gen")):
        assert r["stack_2"] == "matches", r["stack_2"]
        assert "input has shape [7, 16]" in r["stack_7"] and "input_size0 % 2 == 0" in r["stack_7"], r
        assert "reshape([3, -1])" in r["uses_src"], r["uses_src"]
        assert r["uses_6"] == "matches", r["uses_6"]
        assert "x has shape [4, 5, 16], but dim 0 must be 6" in r["uses_4"], r["uses_4"]
        assert "constant_folding=True" in r["uses_4"]


def test_pipeline_stages_fold_their_buffers(tmp_path):
    """Pipeline stages allocate the activations they receive: under folding those shapes are literals
    too, and the stages read no run-time sizes."""
    from nnscaler.config import ComputeConfig
    from nnscaler.parallel.compile import compile_module
    from tests import zoo

    model, make_batch = zoo.build("gpt")
    cfg = ComputeConfig(2, 2, constant_folding=True, use_end2end=True, pas_config={"pipeline_nmicros": 2})
    compile_module(model, make_batch(0, 4), "pp", cfg, tmp_path, "test")
    for rank in (0, 1):
        src = (tmp_path / f"gencode{rank}.py").read_text()
        assert "TensorSpec((4, 16, 64)," in src and 'mb["idx_size0"]' not in src, src
        assert 'self.input_sizes("idx", idx, (4, 16), static=(0, 1))' in src, src
