"""Reuse of generated code is safe: the fingerprint covers the sources of every module class of the
model and the helpers they call from the model's own package, parameter and input specs, policy
and ComputeConfig; `reuse='match'` names what changed, `'moo'` regenerates, `'graph'` checks the
saved graph against the model (issue 9)."""

from __future__ import annotations

import collections
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
    string hash seed: the digest must not (reuse='match' would refuse code compiled by another process).
    Nor may the attribute values: no value that follows the hash seed or an address (transformers'
    GenerationConfig hashes itself) may enter."""
    import subprocess
    import sys

    code = (
        "import json\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from nnscaler.parallel import sources\n"
        "from nnscaler.parallel.attributes import attribute_values\n"
        "def f(x):\n"
        "    return x in {'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta'}\n"
        "print(sources.digest(f))\n"
        f"print(json.dumps(attribute_values(LlamaForCausalLM(LlamaConfig(**{TINY_LLAMA!r})))))\n"
    )
    outputs = {
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
    assert len(outputs) == 1, outputs
    assert "rms_norm_eps" in outputs.pop()


# ---- attribute values (a constructor's scalars, a transformers config) ----------------------------


class Scale(torch.nn.Module):
    def __init__(self, dim: int, scale: float):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x):
        return self.fc(x) * self.scale


class Scaled(torch.nn.Module):
    """Its code and parameter shapes do not depend on `scale`; the traced program does."""

    def __init__(self, scale: float = 2.0, helper: object = None):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Scale(8, scale)])
        self.helper = helper

    def forward(self, x):
        return self.blocks[0](x).sum(dim=-1)


class Opaque:
    """An arbitrary object: the fingerprint cannot record what it holds."""

    def __init__(self):
        self.state = {"opened": True}


class Stateless:
    """No state of its own (like diffusers' attention processors): its class's code says what it does."""

    def __call__(self, x):
        return x


def _scaled(scale: float, helper: object = None) -> Scaled:
    torch.manual_seed(0)
    return Scaled(scale, helper)


def test_changed_constructor_scalar_match_raises_moo_regenerates_graph_refuses(tmp_path):
    save = tmp_path / "gen"
    old = _scaled(2.0)
    parallelize(old, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, load_module=False)
    new = _scaled(3.0)
    with pytest.raises(
        ConfigError, match=r"model attribute `blocks\.0\.scale` changed: 2\.0 -> 3\.0"
    ) as info:
        parallelize(new, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save)
    assert "reuse='moo'" in str(info.value)
    with pytest.raises(
        ConfigError, match=r"reuse='graph'.*model attribute `blocks\.0\.scale` changed: 2\.0 -> 3\.0"
    ):
        parallelize(new, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="graph")
    pm = parallelize(new, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, reuse="moo")
    expected = new(**_x(2))
    torch.testing.assert_close(pm(**_x(2)), expected)  # computes with 3.0, not the old code's 2.0
    torch.testing.assert_close(expected, old(**_x(2)) * 1.5)
    parallelize(new, _x(), "dp", ComputeConfig(1, 1), gen_savedir=save, load_module=False)  # now it matches


def test_unfingerprintable_attribute_is_named_in_one_warning(tmp_path):
    from nnscaler.parallel.attributes import AttributeWarning

    with pytest.warns(AttributeWarning) as record:
        parallelize(
            _scaled(2.0, Opaque()), _x(), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, load_module=False
        )
    mine = [w for w in record if issubclass(w.category, AttributeWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert f"`helper` ({__name__}.Opaque)" in str(mine[0].message)
    # left out: the fingerprint is the same whatever the object holds; plain values are recorded
    with pytest.warns(AttributeWarning):
        values = fp_mod.fingerprint(_scaled(2.0, Opaque()), _x(), "dp", ComputeConfig(1, 1), "v")[
            "attributes"
        ]
    assert "helper" not in values and values["blocks.0.scale"] == "2.0"


def test_attribute_values_of_containers_configs_and_tensors():
    import dataclasses
    import enum

    from nnscaler.parallel.attributes import attribute_values

    class Mode(enum.Enum):
        A = 1

    @dataclasses.dataclass
    class Cfg:
        heads: int = 4
        dims: tuple = (8, 16)

    module = torch.nn.Linear(2, 2)
    module.cfg, module.other = Cfg(), Cfg()
    module.table = {"a": [1, 2.5], "b": {"c": Mode.A}}
    module.mask = torch.ones(3, 4)
    module.tags = {"y", "x"}
    module.processor = Stateless()  # a strategy object: recorded by its class
    module.ordered = collections.OrderedDict(a=1)  # a dict subclass: by its items
    values = attribute_values(module, warn=False)
    assert values["cfg.heads"] == "4" and values["cfg.dims"] == "(8, 16)"
    assert values["other"] == "same as cfg"  # an equal config is listed once
    assert values["table['a']"] == "[1, 2.5]"
    assert values["table['b']['c']"].endswith("Mode.A")
    assert values["mask"] == "tensor [3, 4] float32"  # shape and dtype, never values
    assert values["tags"] == "{'x', 'y'}" and values["in_features"] == "2"
    assert values["processor"].startswith(f"object {__name__}.Stateless ") and values["ordered['a']"] == "1"
    assert not any(k in values for k in ("training", "_parameters", "weight"))


TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def _tiny_llama(**change):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, **change))


def test_changed_transformers_config_value_is_caught():
    ids = {"input_ids": torch.randint(0, 64, (2, 8))}
    base = fp_mod.fingerprint(_tiny_llama(), ids, "dp", ComputeConfig(1, 1), "v")
    eps = fp_mod.fingerprint(_tiny_llama(rms_norm_eps=1e-5), ids, "dp", ComputeConfig(1, 1), "v")
    lines = fp_mod.describe_differences(base, eps)
    assert lines[0] == "model attribute `config.rms_norm_eps` changed: 1e-06 -> 1e-05", lines
    assert "model attribute `model.norm.variance_epsilon` changed: 1e-06 -> 1e-05" in lines
    theta = {"rope_theta": 500000.0, "rope_type": "default"}
    rope = fp_mod.fingerprint(_tiny_llama(rope_parameters=theta), ids, "dp", ComputeConfig(1, 1), "v")
    assert fp_mod.describe_differences(base, rope, fp_mod.GRAPH_KEYS) == [
        "model attribute `config.rope_parameters['rope_theta']` changed: 10000.0 -> 500000.0"
    ]
