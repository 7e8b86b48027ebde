"""The smallest opaque region: a method that reads split sizes from a tensor runs eagerly, alone.

A vision-language model written for this test (tests/zoo_regions.py) splits its vision features per
image by `grid.prod(-1).tolist()` in a method of the top module (`merge_images`). Only that method
becomes an opaque op (taking the parameters it uses: the projector's and `image_gate`, not the whole
model's); the vision encoder and the text decoder are captured and split. Under dp (1, 2), tp (2, 2),
pp (2, 2), autodist (2, 2) and cp 2 (zigzag, ulysses) it trains exactly as on one device (SGD, every
parameter), and under tp 2 a rank holds at most 60% of the parameters.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.leaf_modules import LeafModuleWarning
from tests.parity import ParityCase, run_parity_many
from tests.zoo_regions import build_vlm

VLM = "tests.zoo_regions:build_vlm"
PIPELINE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}


def _compile(tmp_path, pas_config=None):
    model, make_batch = build_vlm(seed=0)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = nnscaler.parallelize(
            model,
            make_batch(0, 4),
            "dp",
            ComputeConfig(1, 1, pas_config=pas_config or {}),
            gen_savedir=tmp_path,
        )
    leaves = [str(w.message) for w in caught if issubclass(w.category, LeafModuleWarning)]
    return pm, reference, make_batch, leaves


def test_a_method_reading_sizes_is_the_only_opaque_op(tmp_path):
    pm, reference, make_batch, leaves = _compile(tmp_path)
    assert len(leaves) == 1, leaves
    assert leaves[0].startswith(
        "merge_images() (VisionLanguageModel.merge_images) runs as one opaque op: merge_images() has "
        "data-dependent control flow at zoo_regions.py:"
    ), leaves
    assert "`sizes = grid.prod(-1).tolist()`" in leaves[0] and "the 3 parameters (288 elements)" in leaves[0]
    assert type(pm).leaf_modules == ("merge_images()",)
    assert type(pm).leaf_state == {"merge_images()": ("image_gate", "projector.bias", "projector.weight")}
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    assert 'nnscaler.runtime.leaf.call(self, "merge_images()", ' in source
    assert "F.scaled_dot_product_attention" in source or "scaled_dot_product_attention" in source
    # another batch (other image sizes): forward and every gradient as eager PyTorch
    batch = make_batch(7, 4)
    loss = pm(**batch)
    loss.backward()
    ref = reference(**batch)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    names = pm.dist_param_map
    for local, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, reference.get_parameter(names[local]).grad, msg=names[local])


def test_a_method_can_be_named_as_a_leaf(tmp_path):
    pm, _, _, leaves = _compile(tmp_path, {"leaf_modules": ["merge_images()"], "auto_leaf_modules": False})
    assert len(leaves) == 1 and "named in pas_config['leaf_modules']" in leaves[0], leaves
    assert type(pm).leaf_modules == ("merge_images()",)
    model, make_batch = build_vlm(seed=0)
    with pytest.raises(ConfigError, match=r"names 'merge_image\(\)', which is neither"):
        capture(model, make_batch(0, 4), leaf_modules=["merge_image()"], both_modes=False)


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class Segments(nn.Module):
    """Two methods under one decorator (their wrappers share one code object); one reads sizes."""

    def __init__(self):
        super().__init__()
        self.proj, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

    @_logged
    def scale(self, x):
        return 2 * x

    @_logged
    def pooled(self, x, sizes):
        return torch.stack([self.proj(p).mean(0) for p in torch.split(x, sizes.tolist())])

    def forward(self, x, sizes):
        return self.pooled(self.scale(x), sizes) + self.unused(x).sum()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Segments()
        self.head = nn.Linear(3, 1)

    def forward(self, x, sizes):
        return self.head(self.inner(x, sizes)).square().mean()


def test_the_decorated_method_itself_is_the_region_with_the_weights_it_uses():
    inputs = {"x": torch.randn(5, 3), "sizes": torch.tensor([2, 3])}
    with pytest.warns(LeafModuleWarning) as caught:
        graph = capture(Outer(), inputs, both_modes=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, LeafModuleWarning)]
    assert len(messages) == 1 and messages[0].startswith(
        "inner.pooled() (Segments.pooled) runs as one opaque op: pooled() has data-dependent control flow at "
        "test_leaf_regions.py:"
    ), messages
    (node,) = [n for n in graph.nodes if n.op == "nnscaler_leaf.call.default"]
    assert node.kwargs["leaf"] == "inner.pooled()" and node.kwargs["state"] == ["proj.weight", "proj.bias"]
    assert node.module_path == "inner"


class CheckedHead(nn.Module):
    """A value check that only raises (traced as a run-time check, graph/capture/value_checks.py)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(3, 4)

    def forward(self, h, labels):
        if labels.max() >= 4:
            raise ValueError("labels must be < 4")
        return nn.functional.cross_entropy(self.out(h), labels)


class PooledClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Segments()
        self.head = CheckedHead()

    def forward(self, x, sizes, labels):
        return self.head(self.inner(x, sizes), labels)


def test_a_value_check_beside_a_size_read_stays_a_check():
    """The real run that places size reads before tracing again leaves truth tests to the trace."""
    inputs = {"x": torch.randn(5, 3), "sizes": torch.tensor([2, 3]), "labels": torch.tensor([1, 3])}
    with pytest.warns(LeafModuleWarning) as caught:
        graph = capture(PooledClassifier(), inputs, both_modes=False)
    leaves = [n.kwargs["leaf"] for n in graph.nodes if n.op == "nnscaler_leaf.call.default"]
    assert leaves == ["inner.pooled()"], [str(w.message) for w in caught]
    assert any(n.op == "nnscaler_check.value_check.default" for n in graph.nodes)


def test_the_vlm_trains_like_one_device_under_every_policy(tmp_path):
    cases = [
        ParityCase(VLM, "dp", 1, optimizer="sgd"),
        ParityCase(VLM, "tp", 2, optimizer="sgd"),
        ParityCase(VLM, "pp", 2, config_kwargs=PIPELINE, nmicros=2, optimizer="sgd"),
        ParityCase(VLM, "autodist", 2, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
    tp = results[1]
    fractions = [round(r["local_param_fraction"], 3) for r in tp]
    print(f"vlm under tp 2: parameters per rank {fractions}")
    assert all(f <= 0.6 for f in fractions), f"under tp 2 a rank keeps {max(fractions):.0%} of the parameters"


def test_the_vlm_splits_its_sequence_under_cp(tmp_path):
    cases = [
        ParityCase(VLM, "tp", 2, {"pas_config": {"cp_size": 2, "cp_kind": kind}}, optimizer="sgd")
        for kind in ("zigzag", "ulysses")
    ]
    run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
