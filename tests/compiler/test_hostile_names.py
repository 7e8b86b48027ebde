"""Names from the user's model are text, never code (issue 10): ModuleDict keys, parameter names and
module paths with quotes, newlines, backslashes, triple quotes and unicode go through codegen into
string literals and comments, and the generated module still computes the model."""

from __future__ import annotations

import ast

import torch
import torch.nn as nn

import nnscaler

PAYLOAD = 'x"); open("PWNED", "w"); ("'
KEYS = [PAYLOAD, "line\nbreak", 'tri"""ple', "back\\slash", "ünïcode", "class", "tp"]


class Hostile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({k: nn.Linear(8, 8) for k in KEYS})
        self.register_parameter("scale'\"\n", nn.Parameter(torch.ones(8)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in KEYS:
            x = torch.relu(self.layers[k](x))
        return (x * getattr(self, "scale'\"\n")).sum()


def test_hostile_names_stay_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = Hostile()
    dummy = {"x": torch.randn(4, 8)}
    for policy, ngpus in (("dp", 1),):
        pm = nnscaler.parallelize(
            model, dummy, policy, nnscaler.ComputeConfig(ngpus, ngpus), gen_savedir=tmp_path / "gen"
        )
        src = next((tmp_path / "gen").rglob("gencode0.py")).read_text()
        tree = ast.parse(src)  # the file parses: nothing broke out of a literal or a comment
        strings = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        assert any(PAYLOAD in s for s in strings), "the hostile key must survive as a string literal"
        assert "scale'\"\n" in strings
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert not any(isinstance(c.func, ast.Name) and c.func.id == "open" for c in calls)
        assert not (tmp_path / "PWNED").exists()
        x = torch.randn(3, 8)
        torch.testing.assert_close(pm(x=x), model(x=x))
        merged = pm.state_dict()
        assert f"layers.{PAYLOAD}.weight" in merged and "layers.line\nbreak.bias" in merged
