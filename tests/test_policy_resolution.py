"""parallelize resolves its policy and validates pas_config once per call and hands the result on:
the fingerprint and the compile neither look the policy up again nor validate pas_config again."""

from __future__ import annotations

import pytest
import torch

import nnscaler.parallel.resolved_policy as resolved_policy
import nnscaler.policies as policies
import nnscaler.policies.registry as registry
from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import PlanError
from nnscaler.parallel.resolved_policy import ResolvedPolicy, resolve_pas_policy


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def test_one_resolution_and_one_validation_per_parallelize_call(tmp_path, monkeypatch):
    lookups: list[object] = []
    validations: list[object] = []
    real_resolve, real_validate = registry.resolve_policy, registry.validate_pas_config

    def counting_resolve(policy):
        lookups.append(policy)
        return real_resolve(policy)

    def counting_validate(policy, pas_config):
        validations.append(policy)
        return real_validate(policy, pas_config)

    for module in (registry, policies, resolved_policy):  # every place the names are looked up
        monkeypatch.setattr(module, "resolve_policy", counting_resolve)
        monkeypatch.setattr(module, "validate_pas_config", counting_validate)
    cfg = ComputeConfig(1, 1, pas_config={"recompute_modules": None})
    x = torch.randn(4, 8)
    for reuse in ("override", "match"):  # a compile, then a reuse of its code
        lookups.clear()
        validations.clear()
        parallelize(_Mlp(), {"x": x}, "tp", cfg, gen_savedir=tmp_path, reuse=reuse, verify=False)
        tp = registry.BUILTIN_POLICIES["tp"]
        assert validations == [tp], reuse  # once, given the function already resolved
        by_name = [p for p in lookups if not callable(p)]
        assert by_name == ["tp"], reuse  # the name is looked up once ...
        assert all(p is tp for p in lookups if callable(p)), reuse  # ... later stages get the function


def test_the_resolved_policy_carries_what_the_stages_read():
    resolved = resolve_pas_policy("tp", {"leaf_modules": "a.b, Block", "auto_leaf_modules": False})
    assert isinstance(resolved, ResolvedPolicy)
    assert (resolved.name, resolved.fn, resolved.builtin) == ("tp", registry.BUILTIN_POLICIES["tp"], True)
    assert resolved.leaf_modules == ("a.b", "Block") and resolved.auto_leaf_modules is False
    assert resolve_pas_policy(resolved, {"ignored": 1}) is resolved  # resolved once, passed on as it is

    def custom(graph, cfg):
        raise AssertionError("not called")

    mine = resolve_pas_policy(custom, {"anything": object()})  # a custom policy reads pas_config itself
    assert (mine.name, mine.builtin, mine.options) == ("custom", False, None)


def test_a_dotted_path_to_something_not_callable_is_refused():
    with pytest.raises(PlanError, match=r"names a str, not a policy function"):
        resolve_pas_policy("nnscaler.version.__version__", {})
