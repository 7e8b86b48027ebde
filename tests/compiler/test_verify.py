"""parallelize(..., verify=...): the captured program is checked against the eager model at compile time.

Correct models pass and are left as they were (buffers, .grad, RNG stream); planted faults, one in
the converter's graph, one in codegen and one lost in-place write, are caught and the error names
the module and the source line; verify=False lets the fault through; verify=True refuses meta weights.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnscaler.parallel.compile as compile_mod
from nnscaler import ComputeConfig, parallelize
from nnscaler.codegen import expr
from nnscaler.errors import CompileError, ConfigError
from nnscaler.graph.ir import Ref, map_refs
from nnscaler.parallel.verify import verify_capture
from tests import zoo

_SOURCE = Path(__file__).read_text().splitlines()


def _line(marker: str) -> str:
    """'test_verify.py:<n>' of the line of this file that holds `marker`."""
    found = [i + 1 for i, text in enumerate(_SOURCE) if marker in text and "_line(" not in text]
    assert len(found) == 1, marker
    return f"test_verify.py:{found[0]}"


class Shift(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.center = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.center  # MARK-SUB


class ShiftNet(nn.Module):
    """linear -> shift (a subtraction in its own module) -> linear -> loss."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shift = Shift(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.relu(self.shift(self.inp(x)))), y)


class Clear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        z = y.clone()
        z[:, 0] = 0  # MARK-WRITE
        return z * 2


class ClearNet(nn.Module):
    """A module writing into a slice of an activation."""

    def __init__(self):
        super().__init__()
        self.block = Clear()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))  # a tuple-free tensor output: the loss is a random projection


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x)))).sum()


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 4, generator=g)}


def _compile(model, batch, tmp_path, **kw):
    torch.manual_seed(0)
    return parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, load_module=False, **kw)


def _patch_graph(monkeypatch, edit) -> None:
    """Capture as usual, then `edit(graph)` (a new graph: the IR is immutable): a fault planted after
    torch.export, as a converter bug would."""
    real = compile_mod.capture

    def faulty(*args, **kwargs):
        return edit(real(*args, **kwargs))

    monkeypatch.setattr(compile_mod, "capture", faulty)


def _with_node(graph, node, **changes):
    """`graph` with `node` replaced by a copy with `changes`."""
    return replace(graph, nodes=[replace(n, **changes) if n is node else n for n in graph.nodes])


def _swap_sub(graph):
    node = next(n for n in graph.nodes if n.op == "aten.sub.Tensor")
    return _with_node(graph, node, args=(node.args[1], node.args[0], *node.args[2:]))


def _drop_writes(graph):
    """Lose every write into a view: readers of a `*_scatter` read its base, then dead nodes go."""
    for node in reversed(graph.nodes):
        if node.op.endswith("_scatter.default"):
            swap = lambda r, base=node.args[0], out=node.outputs[0]: base if r.name == out else r  # noqa: E731
            nodes = [
                replace(n, args=map_refs(n.args, swap), kwargs=map_refs(n.kwargs, swap)) for n in graph.nodes
            ]
            graph = replace(graph, nodes=nodes, outputs=map_refs(graph.outputs, swap))
    used = True
    while used:
        read = {r for n in graph.nodes for r in n.input_names()} | set(graph.output_names())
        dead = [n for n in graph.nodes if not any(o in read for o in n.outputs)]
        used = bool(dead)
        graph = replace(graph, nodes=[n for n in graph.nodes if n not in dead])
    assert not any(n.source.startswith(_line("MARK-WRITE")) for n in graph.nodes)
    assert isinstance(graph.outputs[0], Ref)
    return graph


# ---- correct models pass, and are left as they were ------------------------------------------------


def test_gpt_and_llama_pass(zoo_graphs):
    for name in ("gpt", "llama"):
        graph, model, make_batch = zoo_graphs[name]
        report = verify_capture(model, make_batch(12345, 4), graph)
        assert report.backward and report.modes[0] == "train", name
        assert all(p.grad is None for p in model.parameters())


def test_cnn_batch_norm_in_train_mode_passes_and_keeps_buffers(tmp_path):
    model, make_batch = zoo.build("cnn")
    batch = make_batch(0, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    _compile(model, batch, tmp_path, verify=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats, num_batches_tracked
    assert model.training and model.bn1.training
    assert all(p.grad is None for p in model.parameters())
    torch.set_rng_state(rng)  # _compile seeded; the check itself must not draw from the caller's stream


def test_check_leaves_the_rng_stream_alone(zoo_graphs):
    graph, model, make_batch = zoo_graphs["gpt"]
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    verify_capture(model, make_batch(12345, 4), graph)
    torch.testing.assert_close(torch.rand(3), expected)


def test_dropout_masks_match(tmp_path):
    torch.manual_seed(0)
    model = DropNet().train()
    report = verify_capture(model, {"x": torch.randn(4, 8)}, _capture(model, {"x": torch.randn(4, 8)}))
    assert report.modes == ["train", "eval"]  # dropout follows train()/eval(): both modes are checked


def _capture(model, batch):
    from nnscaler.graph.capture import capture

    return capture(model, batch)


def test_slice_write_model_passes(tmp_path):
    torch.manual_seed(0)
    _compile(ClearNet(), {"x": torch.randn(4, 8)}, tmp_path, verify=True)


# ---- planted faults are caught, and named -----------------------------------------------------------


def test_wrong_graph_op_names_module_and_line(tmp_path, monkeypatch):
    _patch_graph(monkeypatch, _swap_sub)
    with pytest.raises(CompileError) as info:
        _compile(ShiftNet(), _batch(), tmp_path)
    text = str(info.value)
    assert "first module whose values differ: `shift` (Shift)" in text
    assert f"first differing graph node: `sub` (aten.sub.Tensor) at {_line('MARK-SUB')}" in text
    assert "verify=False" in text
    assert not list(tmp_path.rglob("fingerprint.json"))  # nothing claims to be a finished compile


def test_wrong_codegen_step_names_module_and_line(tmp_path, monkeypatch):
    monkeypatch.setitem(expr._BINARY, "aten.sub.Tensor", "+")  # codegen writes x + c for x - c
    with pytest.raises(CompileError) as info:
        _compile(ShiftNet(), _batch(), tmp_path)
    text = str(info.value)
    assert "`shift` (Shift)" in text and _line("MARK-SUB") in text


def test_lost_slice_write_names_module_and_line(tmp_path, monkeypatch):
    _patch_graph(monkeypatch, _drop_writes)
    torch.manual_seed(0)
    with pytest.raises(CompileError) as info:
        _compile(ClearNet(), {"x": torch.randn(4, 8)}, tmp_path)
    text = str(info.value)
    assert "first module whose values differ: `block` (Clear)" in text
    assert re.search(rf"eager writes into a tensor at {_line('MARK-WRITE')}  z\[:, 0\] = 0", text)


def test_lost_gradient_names_the_parameter_and_its_reader(tmp_path, monkeypatch):
    def detach_head(graph):  # as if a no_grad region grew
        return _with_node(graph, next(n for n in graph.nodes if n.module_path == "out"), no_grad=True)

    _patch_graph(monkeypatch, detach_head)
    with pytest.raises(CompileError) as info:
        _compile(ShiftNet(), _batch(), tmp_path)
    text = str(info.value)
    assert "gradient of out.weight (none where eager has one)" in text
    assert "the gradients part first at out.weight, which is read by `out` (Linear)" in text


def test_verify_false_lets_the_fault_through(tmp_path, monkeypatch):
    _patch_graph(monkeypatch, _swap_sub)
    _compile(ShiftNet(), _batch(), tmp_path, verify=False)
    assert list(tmp_path.rglob("gencode0.py"))


def test_verify_true_refuses_meta_weights(tmp_path):
    with torch.device("meta"):
        model = ShiftNet()
    with pytest.raises(ConfigError, match=r"verify=True .* meta device \(e\.g\. inp\.weight\).*verify=False"):
        _compile(model, _batch(), tmp_path, verify=True, init_module_params=False)
    _compile(model, _batch(), tmp_path, init_module_params=False)  # verify=None: skipped, compiles
    with pytest.raises(ConfigError, match="verify='yes'"):
        _compile(model, _batch(), tmp_path, verify="yes")
