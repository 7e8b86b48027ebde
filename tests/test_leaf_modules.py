"""Opaque leaf modules: code the trace cannot capture runs eagerly as one op (docs/inputs.md).

A submodule that loops over `sizes.tolist()` cannot be traced: it runs as one op, chosen by capture
(data-dependent failure) or named in pas_config['leaf_modules'], and the compiled module matches eager
PyTorch in forward and gradients. Qwen2-VL's vision tower (rotary positions and attention windows
from `image_grid_thw.tolist()`) runs that way while the text model is split: dp and tp parity.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError, TraceError
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.leaf_modules import LeafModuleWarning
from nnscaler.policies.options import PasConfigError, leaf_module_options
from nnscaler.runtime import leaf
from tests.parity import ParityCase, run_parity_many


class SegmentPool(nn.Module):
    """Mean of each segment of `x`, segment lengths read from `sizes` (data-dependent)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x, sizes):
        h = torch.tanh(self.proj(x))
        pooled, start = [], 0
        for n in sizes.tolist():
            pooled.append(h[start : start + n].mean(0))
            start += n
        return torch.stack(pooled), h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.pool = SegmentPool()
        self.head = nn.Linear(6, 2)

    def forward(self, x, sizes, y):
        pooled, h = self.pool(self.embed(x), sizes)
        return ((self.head(pooled) - y) ** 2).mean() + 0.1 * h.square().mean()


def _batch(seed: int, rows: int = 7, sizes: tuple[int, int] = (3, 4)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, 3, generator=g),
        "sizes": torch.tensor(sizes),
        "y": torch.randn(2, 2, generator=g),
    }


def _check_against_eager(pm, model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    loss = pm(**batch)
    loss.backward()
    ref = model(**batch)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    names = pm.dist_param_map
    for local, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, model.get_parameter(names[local]).grad, msg=names[local])


@pytest.mark.parametrize("leaf_modules", [None, ["pool"], "SegmentPool"])
def test_data_dependent_submodule_runs_eagerly_and_matches(leaf_modules, tmp_path):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    pas = {} if leaf_modules is None else {"leaf_modules": leaf_modules}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = nnscaler.parallelize(
            model, _batch(0), "dp", ComputeConfig(1, 1, pas_config=pas), gen_savedir=tmp_path
        )
    message = next(str(w.message) for w in caught if issubclass(w.category, LeafModuleWarning))
    assert message.startswith("pool (SegmentPool) runs as one opaque op"), message
    if leaf_modules is None:
        assert (
            "data-dependent control flow at test_leaf_modules.py" in message and "sizes.tolist()" in message
        )
    else:
        assert "pas_config['leaf_modules']" in message
    assert type(pm).leaf_modules == ("pool",)
    # its parameters are registered under their own names, whole, and get gradients
    assert {"pool.proj.weight", "pool.proj.bias"} <= set(pm.dist_param_map.values())
    _check_against_eager(pm, reference, _batch(1, rows=9, sizes=(5, 4)))  # other rows: x's dim 0 stays open


def test_leaf_in_generated_code_and_its_checkpoint_names(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeafModuleWarning)
        pm = nnscaler.parallelize(
            model,
            _batch(0),
            "dp",
            ComputeConfig(1, 1, pas_config={"leaf_modules": "pool"}),
            gen_savedir=tmp_path,
        )
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    assert 'nnscaler.runtime.leaf.call(self, "pool", linear, sizes)' in source, source
    state = pm.state_dict()
    assert torch.equal(state["pool.proj.weight"], model.pool.proj.weight)
    # without its structure the module says what is missing
    bare = type(pm)(init_params=False)
    with pytest.raises(RuntimeError, match=r"runs 'pool' eagerly .*attach_leaf_modules"):
        bare(**_batch(0))


def test_generated_class_gets_its_leaf_structure(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeafModuleWarning)
        torch.manual_seed(0)
        cls = nnscaler.parallelize(Net, _batch(0), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    pm = cls()  # the weights rank 0 built (seed 0)
    torch.manual_seed(0)
    _check_against_eager(pm, Net(), _batch(2))


def test_leaf_modules_naming_nothing_is_a_clear_error(tmp_path):
    bad = ComputeConfig(1, 1, pas_config={"leaf_modules": ["pool", "visual"]})
    with pytest.raises(
        ConfigError, match=r"names 'visual', which is neither a submodule path .* nor the class"
    ):
        nnscaler.parallelize(Net(), _batch(0), "dp", bad, gen_savedir=tmp_path)
    with pytest.raises(ConfigError, match=r"did you mean 'pool\.proj'"):
        capture(Net(), _batch(0), leaf_modules=["pool.prj"])


class Box:
    """Not a tensor: a module returning it cannot run as an opaque op."""

    def __init__(self, value):
        self.value = value


class Counter(nn.Module):
    def forward(self, x, sizes):
        return Box(torch.stack([x[:n].sum(0) for n in sizes.tolist()]))


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = Counter()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, sizes):
        return self.lin(self.count(x, sizes).value)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wrap = Wrapper()

    def forward(self, x, sizes):
        return self.wrap(x, sizes).square().mean()


def test_a_submodule_returning_other_objects_gives_way_to_its_parent():
    inputs = {"x": torch.randn(5, 3), "sizes": torch.tensor([2, 3])}
    with pytest.warns(
        LeafModuleWarning, match=r"^wrap \(Wrapper\) runs as one opaque op: forward has data-dep"
    ):
        graph = capture(Outer(), inputs, both_modes=False)
    assert [n.kwargs["leaf"] for n in graph.nodes if n.op == "nnscaler_leaf.call.default"] == ["wrap"]
    with pytest.raises(
        TraceError, match=r"wrap\.count \(Counter\) cannot run as an opaque op: its output holds a Box"
    ):
        capture(Outer(), inputs, both_modes=False, leaf_modules=["wrap.count"])


def test_leaf_module_options_are_typed():
    assert leaf_module_options({"leaf_modules": "a.b, Block", "pipeline_nmicros": 2}) == (
        ["a.b", "Block"],
        True,
    )
    assert leaf_module_options({"auto_leaf_modules": False}) == ([], False)
    with pytest.raises(PasConfigError, match=r"pas_config\['leaf_modules'\] .* must be str or a list of str"):
        leaf_module_options({"leaf_modules": 3})


def test_without_automatic_leaves_the_data_dependent_line_is_named():
    with pytest.raises(
        TraceError, match=r"data-dependent control flow at test_leaf_modules.py:\d+ `for n in sizes"
    ):
        capture(Net(), _batch(0), auto_leaf_modules=False, both_modes=False)


class Ragged(nn.Module):
    """The first `n` rows of `x` for each `n` in `sizes`: an output size that depends on input values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x, sizes):
        return torch.cat([self.proj(x[:n]) for n in sizes.tolist()])


class RaggedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.ragged = Ragged()

    def forward(self, x, sizes):
        return self.ragged(x, sizes).sum(0)


def test_value_dependent_output_sizes_come_from_a_real_run(tmp_path):
    inputs = {"x": torch.randn(5, 3), "sizes": torch.tensor([2, 3])}
    with pytest.warns(LeafModuleWarning, match=r"output sizes depend on input values: they are fixed"):
        graph = capture(RaggedNet(), inputs, both_modes=False)
    (node,) = [n for n in graph.nodes if n.op == "nnscaler_leaf.call.default"]
    assert graph.values[node.outputs[0]].meta.shape == (5, 3)
    with torch.device("meta"):
        model = RaggedNet()
    with pytest.raises(
        TraceError, match=r"opaque leaf module ragged: its output sizes depend on input values .*meta"
    ):
        capture(model, inputs, both_modes=False)


def test_structure_copy_holds_no_weights():
    model = Net()
    copied = leaf.structure_copy(model.pool)
    assert all(t.is_meta for t in (*copied.parameters(), *copied.buffers()))
    assert copied.proj.weight.shape == model.pool.proj.weight.shape and not model.pool.proj.weight.is_meta


# ---- Qwen2-VL, unmodified: two of its methods opaque, the text model split ---------------------------

_QWEN_LEAVES = ("model.get_image_features()", "model.get_rope_index()")


@pytest.mark.slow
def test_qwen2_vl_data_dependent_methods_are_found_and_compile(tmp_path):
    """Not the whole Qwen2VLModel (whose methods hold the `.tolist()`s): only the two methods run whole."""
    from tests.zoo_vl import build_qwen2_vl

    model, make_batch = build_qwen2_vl(seed=0)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = ComputeConfig(1, 1, constant_folding=True)  # the leaves' sizes are written as numbers
        pm = nnscaler.parallelize(model, make_batch(0, 2), "dp", cfg, gen_savedir=tmp_path)
    leaves = sorted(str(w.message) for w in caught if issubclass(w.category, LeafModuleWarning))
    assert len(leaves) == 2, "\n".join(m[:200] for m in leaves)
    assert leaves[0].startswith(
        "model.get_image_features() (Qwen2VLModel.get_image_features) runs as one opaque op: "
        "get_image_features() has data-dependent control flow at modeling_qwen2_vl.py:"
    ), leaves
    assert "the 19 parameters (8688 elements) it uses" in leaves[0]  # the vision tower's, no others
    assert leaves[1].startswith(
        "model.get_rope_index() (Qwen2VLModel.get_rope_index) runs as one opaque op: get_rope_index() has "
    ), leaves
    assert type(pm).leaf_modules == _QWEN_LEAVES
    used = set(type(pm).leaf_state["model.get_image_features()"])  # by name in Qwen2VLModel
    assert {n.removeprefix("model.") for n, _ in model.named_parameters() if ".visual." in n} <= used
    assert all(n.startswith("visual.") for n in used), used
    batch = make_batch(5, 2)
    out = pm(**batch)
    out.loss.backward()
    ref = reference(**batch)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss)
    names = pm.dist_param_map
    for local, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, reference.get_parameter(names[local]).grad, msg=names[local])


@pytest.mark.slow
def test_qwen2_vl_trains_like_one_device_under_every_policy(tmp_path):
    """Unmodified Qwen2-VL: under tp its text model's weights split while the vision tower (inside the
    opaque get_image_features) stays whole on every rank. Naming the tower as a leaf (by class, by path)
    changes nothing. SGD, so a wrong gradient scale shows."""
    model = "tests.zoo_vl:build_qwen2_vl"
    by_path = {"pas_config": {"leaf_modules": ["model.visual"]}}
    by_class = {"pas_config": {"leaf_modules": "Qwen2VisionTransformerPretrainedModel"}}
    cases = [
        ParityCase(model, "dp", 1, config_kwargs=by_class, optimizer="sgd"),
        ParityCase(model, "tp", 2, optimizer="sgd"),
        ParityCase(model, "autodist", 2, config_kwargs=by_path, optimizer="sgd"),
        ParityCase(
            model,
            "pp",
            2,
            config_kwargs={"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}},
            nmicros=2,
            optimizer="sgd",
        ),
    ]
    dp, tp, _, _ = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
    tower = "model.visual.blocks.0.attn.qkv.weight"
    for r in dp:  # the tower's gradients are averaged over the replicas like any other weight's
        assert tower in r["reduced"] and tower in r["optimizer_names"], r["rank"]
    fractions = [round(r["local_param_fraction"], 3) for r in tp]
    print(f"qwen2-vl under tp 2: parameters per rank {fractions}")
    assert all(f < 0.7 for f in fractions), fractions  # the whole model opaque kept 0.95
    assert all(tower in r["optimizer_names"] for r in tp)  # whole on each rank of the plan
