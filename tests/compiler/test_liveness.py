"""The generated forward frees what it no longer needs (issue 9): the liveness pass of codegen puts a
`del` after each intermediate's last use, in plain forwards, in recompute functions and in pipeline
stage methods, and the generated module still computes what the model computes."""

from __future__ import annotations

import ast
import glob
import os
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.codegen.liveness import add_dels, aliasing_op, dels_after, line_uses
from tests.dist_util import spawn

# ---- the liveness function -------------------------------------------------------------------------


def _uses(*codes: str):
    return [line_uses(c) for c in codes]


def test_line_uses_reads_and_binds():
    assert line_uses("a, b = f(x, self.w, n=y)") == (["f", "x", "self", "y"], ["a", "b"])
    assert line_uses("x = x + 1") == (["x"], ["x"])
    assert line_uses("def recompute_h_0(a, b):") == ([], ["recompute_h_0"])
    assert line_uses("return a, b") == (["a", "b"], [])


def test_names_deleted_after_last_use_outputs_and_outside_names_kept():
    lines = _uses(
        "a = f(x)",  # x: bound outside (an argument): never deleted
        "b = g(a)",
        "c = h(a, b)",
        "unused = k(c)",  # bound and never read: deleted at once
        "out = m(c, n)",  # n: bound outside
    )
    assert dels_after(lines, keep=["out"]) == [[], [], ["a", "b"], ["unused"], ["c"]]
    # without keep, the last value dies on its own line
    assert dels_after(lines)[-1] == ["c", "out"]


def test_views_are_deleted_with_their_base():
    lines = _uses(
        "lin = F.linear(x, self.w)",
        "q, k = lin.split(4, dim=-1)",
        "qt = q.transpose(1, 2)",
        "y = attn(qt, k)",
        "z = y + 1",
    )
    alias_of = [None, "lin", "q", None, None]
    assert dels_after(lines, keep=["z"], alias_of=alias_of) == [[], [], [], ["lin", "q", "k", "qt"], ["y"]]
    # a view of a name not deleted here (an argument, an output) is deleted on its own
    lines = _uses("v = x.view(-1)", "t = v.t()", "w = g(t)", "r = w.view(-1)", "s = r * 2")
    assert dels_after(lines, keep=["w"], alias_of=["x", "v", None, "w", None]) == [
        [],
        [],
        ["v", "t"],
        [],
        ["r", "s"],
    ]


def test_rebound_names():
    lines = _uses("a = f(x)", "b = g(a)", "a = h(b)", "c = a + 1")
    assert dels_after(lines, keep=["c"]) == [[], ["a"], ["b"], ["a"]]


class _Line(types.SimpleNamespace):
    pass


def _line(code: str, indent: int = 0, context: str = "") -> _Line:
    return _Line(code=code, indent=indent, context=context)


def test_recompute_closures():
    """Names the nested function reads from the forward stay (backward runs it again); its own
    intermediates go inside it; what it returns stays until the return."""
    lines = [
        _line("a = f(x)"),
        _line("s = size(a)"),
        _line("def recompute_h_0(a):"),
        _line("b = g(a, s)", 1),
        _line("c = k(b)", 1),
        _line("d = m(c, b)", 1),
        _line("e = d * 2", 1),
        _line("return d, e", 1),
        _line("d, e = ckpt.checkpoint(recompute_h_0, a, use_reentrant=False)"),
        _line("out = d + e", 0, "rng.shard_rng(tp, self.device)"),
    ]
    sections = [types.SimpleNamespace(lines=lines[:5]), types.SimpleNamespace(lines=lines[5:])]
    add_dels(sections, keep=["out"], make_del=lambda code, indent: _line(code, indent))
    got = [("    " * line.indent) + line.code for s in sections for line in s.lines]
    assert got == [
        "a = f(x)",
        "s = size(a)",
        "def recompute_h_0(a):",
        "    b = g(a, s)",
        "    c = k(b)",
        "    d = m(c, b)",
        "    del b, c",
        "    e = d * 2",
        "    return d, e",
        "d, e = ckpt.checkpoint(recompute_h_0, a, use_reentrant=False)",
        "del a",  # `s` is captured by the closure: never deleted
        "out = d + e",
        "del d, e",
    ]


def test_aliasing_ops():
    assert aliasing_op("aten.view.default") and aliasing_op("aten.transpose.int")
    assert aliasing_op("aten.split.Tensor")
    assert not aliasing_op("aten.reshape.default")  # copies a non-contiguous input
    assert not aliasing_op("aten.contiguous.default")
    assert not aliasing_op("aten.linear.default")
    assert not aliasing_op("mylib.op.default") and not aliasing_op("aten.no_such_op.default")


# ---- a model compiled end to end -------------------------------------------------------------------

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, with_logits: bool = False) -> None:
        super().__init__()
        self.with_logits = with_logits
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return (loss, logits) if self.with_logits else loss


def _batch(seed: int, batch: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(VOCAB, (batch, SEQ), generator=g)
    return {"idx": idx, "targets": torch.roll(idx, -1, dims=1)}


def _model(with_logits: bool = False) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(with_logits)


def _gencode(savedir: str, rank: int = 0) -> str:
    (path,) = glob.glob(os.path.join(savedir, "**", f"gencode{rank}.py"), recursive=True)
    with open(path) as f:
        return f.read()


def _function_body(code: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == name)


def _own_nodes(fn: ast.FunctionDef) -> list[ast.AST]:
    """The nodes of a function, without those of the functions nested in it."""
    out, todo = [], list(fn.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _deleted(fn: ast.FunctionDef) -> set[str]:
    return {
        t.id
        for n in _own_nodes(fn)
        if isinstance(n, ast.Delete)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def _returned(fn: ast.FunctionDef) -> set[str]:
    returns = [n for n in _own_nodes(fn) if isinstance(n, ast.Return)]
    return {n.id for r in returns for n in ast.walk(r) if isinstance(n, ast.Name)}


def _local_grads(pm) -> dict[str, torch.Tensor]:
    names = pm.dist_param_map
    return {names[n]: p.grad for n, p in pm.named_parameters() if n in names and p.grad is not None}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_generated_forward_deletes_and_matches(recompute, tmp_path):
    from nnscaler import ComputeConfig, parallelize

    model = _model(with_logits=True)
    pas = {"recompute_modules": "Block"} if recompute else {}
    cfg = ComputeConfig(1, 1, pas_config=pas)
    pm = parallelize(model, _batch(0), "dp", cfg, gen_savedir=str(tmp_path))
    code = _gencode(str(tmp_path))
    forward = _function_body(code, "forward")
    deleted = _deleted(forward)
    assert deleted, "the generated forward deletes nothing"
    # arguments, outputs, input sizes and the process group are never deleted
    assert not deleted & ({"idx", "targets", "tp", "self"} | _returned(forward))
    assert not any(n.endswith(("_size0", "_size1")) for n in deleted)
    if recompute:
        # each block is recomputed by checkpointing the blocks' shared layer function
        assert code.count("ckpt.checkpoint(self._layer_Block, ") == LAYERS
        inner = _function_body(code, "_layer_Block")
        assert _deleted(inner), "the recomputed function deletes nothing"
        params = {a.arg for a in inner.args.args}
        assert not _deleted(inner) & (params | _returned(inner))

    for seed in (1, 2):
        batch = _batch(seed, batch=3)  # another batch size than traced
        model.zero_grad()
        pm.zero_grad()
        loss, logits = model(**batch)
        loss.backward()
        gen_loss, gen_logits = pm(**batch)
        gen_loss.backward()
        torch.testing.assert_close(gen_loss, loss)
        torch.testing.assert_close(gen_logits, logits)
        expected = dict(model.named_parameters())
        grads = _local_grads(pm)
        assert len(grads) == len(expected)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-5, atol=1e-6, msg=name)
        with torch.no_grad():
            torch.testing.assert_close(pm(**batch)[0], loss.detach())


def _pipeline(rank: int, world_size: int, gen_savedir: str) -> dict:
    import nnscaler
    from nnscaler import ComputeConfig, parallelize

    nnscaler.init()
    model = _model()
    pas = {"pipeline_nmicros": 2, "recompute_modules": "Block"}
    cfg = ComputeConfig(2, world_size, use_end2end=True, pas_config=pas)
    pm = parallelize(model, _batch(0), "pp", cfg, gen_savedir=gen_savedir)
    samples = [_batch(10 + m) for m in range(2)]
    losses = [float(x) for x in pm.train_step(samples)]
    grads = {k: v.clone() for k, v in _local_grads(pm).items()}
    inferred = [float(x) for x in pm.infer_step(samples)]
    return {"losses": losses, "inferred": inferred, "grads": grads, "code": _gencode(gen_savedir, rank)}


def test_pipeline_stages_delete_and_match(tmp_path):
    results = spawn(_pipeline, 2, tmp_path, str(tmp_path / "gen"))
    model = _model()
    samples = [_batch(10 + m) for m in range(2)]
    expected = []
    for s in samples:
        loss = model(**s)
        loss.backward()  # train_step adds up micro-batch gradients
        expected.append(loss.item())
    params = dict(model.named_parameters())
    seen = set()
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(expected, rel=1e-5)
        assert r["inferred"] == pytest.approx(expected, rel=1e-5)
        stage = _function_body(r["code"], f"stage{rank}")
        assert _deleted(stage), f"stage{rank} deletes nothing"
        assert not _deleted(stage) & ({"x", "tp", "self"} | _returned(stage))
        # the recomputed blocks: nested functions of the stage, or the layer function they share
        inner = [n for n in ast.walk(ast.parse(r["code"])) if isinstance(n, ast.FunctionDef)]
        inner = [n for n in inner if n.name.startswith(("recompute_", "_layer_"))]
        assert any(_deleted(n) for n in inner)
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, params[name].grad, rtol=1e-5, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(params)
