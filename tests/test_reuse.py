"""Reuse of generated code is safe: the fingerprint covers the sources of every module class of the
model and the helpers they call from the model's own package, parameter and input specs, policy
and ComputeConfig; `reuse='match'` names what changed, `'moo'` regenerates, `'graph'` checks the
saved graph against the model (issue 9)."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import ConfigError
from nnscaler.parallel import fingerprint as fp_mod
from nnscaler.parallel import sources

BLOCK = """\
import torch
from torch import nn

from {pkg}.util import act


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return {body}
"""

UTIL = """\
import torch

SCALE = {scale}


def act(x):
    return torch.relu(x) * SCALE
"""

MODEL = """\
import torch
from torch import nn

from {pkg}.block import Block


class Top(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.block = Block(dim)

    def forward(self, x):
        return self.block(self.inp(x)).sum(dim=-1)
"""


class TmpPackage:
    """A package on sys.path in tmp_path whose files a test edits and reloads."""

    def __init__(self, root: Path):
        self.name = f"reusepkg_{uuid.uuid4().hex[:8]}"
        self.dir = root / self.name
        self.dir.mkdir(parents=True)
        (self.dir / "__init__.py").write_text("")
        self.write("util", UTIL.format(scale="1.0"))
        self.write("block", BLOCK.format(pkg=self.name, body="act(self.fc(x))"))
        self.write("model", MODEL.format(pkg=self.name))
        sys.path.insert(0, str(root))
        self.root = root

    def write(self, name: str, text: str) -> None:
        path = self.dir / f"{name}.py"
        old = path.stat().st_mtime if path.exists() else 0.0
        path.write_text(text)
        # a new mtime even within the same clock tick, so linecache and the bytecode cache see the edit
        if old:
            os.utime(path, (old + 10, old + 10))
        shutil.rmtree(self.dir / "__pycache__", ignore_errors=True)

    def reload(self):
        """(Re)import util, block, model in dependency order; return the model module."""
        importlib.invalidate_caches()
        out = None
        for name in ("util", "block", "model"):
            full = f"{self.name}.{name}"
            out = (
                importlib.reload(sys.modules[full]) if full in sys.modules else importlib.import_module(full)
            )
        return out

    def close(self) -> None:
        sys.path.remove(str(self.root))
        for key in [k for k in sys.modules if k == self.name or k.startswith(self.name + ".")]:
            del sys.modules[key]


@pytest.fixture
def pkg(tmp_path):
    package = TmpPackage(tmp_path / "src")
    yield package
    package.close()


def _top(mod, seed=0, **kwargs):
    torch.manual_seed(seed)
    return mod.Top(**kwargs)


def _x(seed=1, dim=8):
    return {"x": torch.randn(4, dim, generator=torch.Generator().manual_seed(seed))}


def test_edit_submodule_forward_match_raises_moo_regenerates(pkg, tmp_path):
    save = tmp_path / "gen"
    model = _top(pkg.reload())
    pm = parallelize(model, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save)
    torch.testing.assert_close(pm(**_x(2)), model(**_x(2)))

    # edit a submodule in another file than the top model
    pkg.write("block", BLOCK.format(pkg=pkg.name, body="torch.tanh(self.fc(x)) * 2.0"))
    new_model = _top(pkg.reload())
    with pytest.raises(ConfigError, match=rf"source of {pkg.name}\.block\.Block changed") as info:
        parallelize(new_model, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save)
    assert "reuse='moo'" in str(info.value)  # says how to regenerate
    assert f"{pkg.name}.model.Top" not in str(info.value)  # only what changed

    pm = parallelize(new_model, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="moo")
    expected = new_model(**_x(2))
    torch.testing.assert_close(pm(**_x(2)), expected)
    # the new code computes the new function, not the old one
    assert not torch.allclose(expected, model(**_x(2)))
    # and now it matches: reused without regenerating
    parallelize(new_model, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, load_module=False)


def test_edit_helper_function_or_constant_is_detected(pkg):
    model = _top(pkg.reload())
    before = fp_mod.fingerprint(model, _x(), "dp", ComputeConfig(1, 1), "v")
    helpers = before["helper_sources"]
    assert f"{pkg.name}.util.act" in helpers and helpers[f"{pkg.name}.util.SCALE"] == "1.0"

    pkg.write("util", UTIL.format(scale="3.0"))
    after = fp_mod.fingerprint(_top(pkg.reload()), _x(), "dp", ComputeConfig(1, 1), "v")
    assert fp_mod.describe_differences(before, after) == [
        f"source (or value) of {pkg.name}.util.SCALE changed"
    ]

    pkg.write("util", UTIL.format(scale="3.0").replace("torch.relu(x)", "torch.sigmoid(x)"))
    edited = fp_mod.fingerprint(_top(pkg.reload()), _x(), "dp", ComputeConfig(1, 1), "v")
    assert fp_mod.describe_differences(after, edited) == [f"source (or value) of {pkg.name}.util.act changed"]
    # comments and moved lines are not a change of code
    edited_text = UTIL.format(scale="3.0").replace("torch.relu(x)", "torch.sigmoid(x)")
    pkg.write("util", edited_text.replace("def act", "# the activation\n\n\ndef act"))
    same = fp_mod.fingerprint(_top(pkg.reload()), _x(), "dp", ComputeConfig(1, 1), "v")
    assert same == edited


def test_fingerprint_covers_specs_policy_config_versions_not_values(pkg):
    mod = pkg.reload()
    base = fp_mod.fingerprint(_top(mod), _x(), "dp", ComputeConfig(1, 1), "1.0")
    # values of weights and inputs do not count; their specs do
    assert fp_mod.fingerprint(_top(mod, seed=5), _x(seed=9), "dp", ComputeConfig(1, 1), "1.0") == base

    def diff(**change):
        args = {
            "module": _top(mod),
            "dummy_forward_args": _x(),
            "policy": "dp",
            "cfg": ComputeConfig(1, 1),
            "version": "1.0",
        }
        args.update(change)
        return fp_mod.describe_differences(base, fp_mod.fingerprint(**args))

    assert diff(module=_top(mod, dim=16), dummy_forward_args=_x(dim=16))[:1] == [
        'parameter inp.weight: [shape, dtype...] [[8, 8], "float32", true] -> [[16, 16], "float32", true]'
    ]
    assert diff(dummy_forward_args={"x": torch.randn(4, 8, dtype=torch.float64)}) == [
        'dummy input x: {"tensor": [4, 8], "dtype": "float32"} -> {"tensor": [4, 8], "dtype": "float64"}'
    ]
    assert diff(module=_top(mod).eval()) == ["the model was in train mode, now in eval mode"]
    assert diff(policy="data") == [
        'policy: {"name": "dp", "source": null} -> {"name": "data", "source": null}'
    ]
    assert diff(cfg=ComputeConfig(1, 1, pas_config={"recompute_modules": "Block"})) == [
        "ComputeConfig.pas_config['recompute_modules'] is new"
    ]
    assert diff(cfg=ComputeConfig(1, 2)) == ["ComputeConfig.runtime_ngpus: 1 -> 2"]
    assert diff(version="1.1") == ['nnscaler: "1.0" -> "1.1"']
    other_torch = dict(base, torch="0.0")
    assert fp_mod.describe_differences(other_torch, base) == [f'torch: "0.0" -> "{torch.__version__}"']

    def my_policy(graph, cfg):
        from nnscaler.policies import BUILTIN_POLICIES

        return BUILTIN_POLICIES["dp"](graph, cfg)

    custom = fp_mod.fingerprint(_top(mod), _x(), my_policy, ComputeConfig(1, 1), "1.0")
    assert custom["policy"]["source"] == sources.digest(my_policy)


def test_reuse_graph_with_another_model_raises(pkg, tmp_path):
    save = tmp_path / "gen"
    mod = pkg.reload()
    parallelize(_top(mod), _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, load_module=False)

    # same class (so the same output directory), other sizes: the saved graph is not this model's
    with pytest.raises(ConfigError, match=r"reuse='graph'.*parameter inp\.weight.*\[8, 8\].*\[16, 16\]"):
        parallelize(_top(mod, dim=16), _x(dim=16), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="graph")
    # other dummy inputs
    with pytest.raises(ConfigError, match=r"dummy input x: the saved graph was traced with shape \[4, 8\]"):
        parallelize(
            _top(mod), {"x": torch.randn(6, 8)}, "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="graph"
        )
    # edited source
    pkg.write("block", BLOCK.format(pkg=pkg.name, body="torch.tanh(self.fc(x))"))
    edited = _top(pkg.reload())
    with pytest.raises(ConfigError, match=rf"reuse='graph'.*source of {pkg.name}\.block\.Block changed"):
        parallelize(edited, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="graph")
    # moo traces again; after that the graph matches and reuse='graph' replans from it
    parallelize(edited, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="moo", load_module=False)
    pm = parallelize(edited, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="graph")
    torch.testing.assert_close(pm(**_x(3)), edited(**_x(3)))


def test_source_digest_is_the_same_in_every_process():
    """A set literal in a membership test compiles to a frozenset constant whose order follows the
    string hash seed: the digest must not (reuse='match' would refuse code compiled by another process)."""
    import subprocess
    import sys

    code = (
        "from nnscaler.parallel import sources\n"
        "def f(x):\n"
        "    return x in {'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta'}\n"
        "print(sources.digest(f))\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()
        for seed in (1, 2, 3)
    }
    assert len(digests) == 1, digests
