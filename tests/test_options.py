"""Every option does what it says or is refused (issue 9): pas_config validated per built-in policy,
the broadcast strategies send what their names say, inference_only makes a forward-only module."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import ConfigError, PlanError
from nnscaler.policies import BUILTIN_POLICIES, validate_pas_config
from nnscaler.policies.options import (
    POLICY_OPTIONS,
    HybridOptions,
    PpOptions,
    parse_pas_config,
)
from tests import zoo
from tests.dist_util import spawn

ROOT = Path(__file__).parent.parent

# ---- pas_config ----------------------------------------------------------------------------------


def test_every_builtin_policy_has_an_options_class():
    assert set(POLICY_OPTIONS) == set(BUILTIN_POLICIES)


def test_unknown_key_names_the_close_match():
    with pytest.raises(
        ValueError, match=r"'pipeline_nmicro' .* policy 'pp': did you mean 'pipeline_nmicros'\?"
    ):
        parse_pas_config("pp", {"pipeline_nmicro": 4})
    with pytest.raises(ConfigError, match=r"'recompute_module' .* did you mean 'recompute_modules'\?"):
        parse_pas_config("tp", {"recompute_module": "Block"})
    # a key of another policy says whose it is
    with pytest.raises(
        ConfigError, match=r"'pp_size' is not an option of policy 'pp': it is an option of 'hybrid'"
    ):
        parse_pas_config("pp", {"pp_size": 2, "pipeline_nmicros": 2})
    with pytest.raises(ConfigError, match="'seed'.*deterministic"):
        parse_pas_config("tp", {"seed": 1})
    # also a PlanError, as policies raised for pas_config before
    with pytest.raises(PlanError):
        parse_pas_config("dp", {"nonsense": 1})


def test_wrong_types_name_the_field():
    with pytest.raises(
        ConfigError, match=r"pas_config\['pipeline_nmicros'\] of policy 'pp' must be int or None, got '4'"
    ):
        parse_pas_config("pp", {"pipeline_nmicros": "4"})
    with pytest.raises(ConfigError, match=r"pas_config\['pipeline_nmicros'\].* must be >= 1, got 0"):
        parse_pas_config("pp", {"pipeline_nmicros": 0})
    with pytest.raises(ConfigError, match=r"pas_config\['pipeline_nstages'\].*int or 'auto', got True"):
        parse_pas_config("hybrid", {"pipeline_nstages": True})
    with pytest.raises(
        ConfigError,
        match=r"pipeline_scheduler.*'1f1b' or 'gpipe' or '1f1b_interleaved' or 'zb_h1' or 'zbv' or 'dualpipev', got 'zb'",
    ):
        parse_pas_config("pp", {"pipeline_scheduler": "zb"})
    with pytest.raises(ConfigError, match=r"pipeline_stages.*a list of str or None, got \['a', 3\]"):
        parse_pas_config("pp", {"pipeline_stages": ["a", 3]})


def test_valid_configs_parse_to_typed_options():
    opts = parse_pas_config(
        "hybrid",
        {"pipeline_nmicros": 4, "pp_size": 2, "pipeline_pivots": ("Block",), "_note": object()},
    )
    assert opts == HybridOptions(pipeline_nmicros=4, pp_size=2, pipeline_pivots=["Block"])
    assert parse_pas_config("pp", {}) == PpOptions()
    assert parse_pas_config(
        "pp", {"pipeline_nstages": "auto", "recompute_modules": ["Block"]}
    ).recompute_modules == ["Block"]
    # by name, dotted path or the function itself; custom callables are not validated
    assert isinstance(validate_pas_config("nnscaler.policies.pas_tp", {}), type(parse_pas_config("tp", {})))
    assert validate_pas_config(lambda graph, cfg: None, {"anything": object()}) is None


def test_parallelize_validates_before_tracing(tmp_path, monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("traced before validating pas_config")

    monkeypatch.setattr("nnscaler.parallel.compile.capture", no_trace)
    model, make_batch = zoo.build("mlp")
    cfg = ComputeConfig(1, 1, pas_config={"recompute_modles": "MLP"})
    with pytest.raises(ValueError, match="did you mean 'recompute_modules'"):
        parallelize(model, make_batch(0, 4), "dp", cfg, gen_savedir=tmp_path)


def test_custom_policy_gets_pas_config_unvalidated(tmp_path):
    seen = {}

    def my_policy(graph, cfg):
        seen.update(cfg.pas_config)
        return BUILTIN_POLICIES["dp"](graph, cfg)

    model, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    cfg = ComputeConfig(1, 1, pas_config={"my_knob": [1, 2], "pipeline_nmicro": "x"})
    pm = parallelize(model, batch, my_policy, cfg, gen_savedir=tmp_path)
    assert seen == {"my_knob": [1, 2], "pipeline_nmicro": "x"}
    torch.testing.assert_close(pm(**batch), model(**batch))


def test_every_pas_config_key_read_is_a_typed_and_documented_field():
    fields = {f.name for cls in POLICY_OPTIONS.values() for f in dataclasses.fields(cls)}
    read = set()
    for path in (ROOT / "nnscaler").rglob("*.py"):
        read |= set(re.findall(r"pas_config(?:\.get\(|\[)\s*[\"'](\w+)[\"']", path.read_text()))
    assert read <= fields, f"pas_config keys read but not in an options dataclass: {sorted(read - fields)}"
    doc = (ROOT / "docs" / "policies.md").read_text()
    missing = sorted(f for f in fields if f"`{f}`" not in doc)
    assert not missing, f"fields not listed in docs/policies.md: {missing}"
    assert "../shared" not in doc


# ---- broadcast_strategy --------------------------------------------------------------------------


def _broadcast_each_strategy(rank, world_size, tmp):
    # each rank its own disk, and each rank the writer of its machine (as on separate nodes)
    os.environ["LOCAL_RANK"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    model, make_batch = zoo.build("mlp")
    out = {}
    for strategy in ("none", "all", "no_weights", "code"):
        save = Path(tmp) / strategy / f"rank{rank}"
        cls = parallelize(
            type(model),
            make_batch(0, 4),
            "dp",
            ComputeConfig(1, world_size),
            gen_savedir=save,
            module_fn=lambda: model,
            broadcast_strategy=strategy,
            load_module=strategy == "all",
        )
        outdir = save / "_parallel_modules" / "tests" / "zoo" / "MLP" / "_"
        files = {p.name: p.read_bytes() for p in outdir.iterdir()} if outdir.exists() else {}
        out[strategy] = files
        if cls is not None:  # 'all': the weights came along, the class starts from them
            pm = cls()
            out["all_weights"] = {
                pm.fullmap[n].original_name: t.detach().clone() for n, t in pm.named_parameters()
            }
    return out


def test_broadcast_strategies_send_what_their_names_say(tmp_path):
    results = spawn(_broadcast_each_strategy, 2, tmp_path / "run", str(tmp_path / "gen"))
    sent, got = results[0], results[1]
    names = set(sent["all"])
    # rank 0 has code, weights (given a class) and the rest
    assert {
        "gencode0.py",
        "gencode1.py",
        "compute_config.json",
        "fullmodel.pt",
        "graph.json",
        "plan.json",
    } <= names
    code = {
        n
        for n in names
        if (n.startswith("gencode") and n.endswith(".py"))
        or n in ("compute_config.json", "constants.pt", "fingerprint.json")  # fingerprint: the sha256 of each
    }
    assert got["none"] == {}
    assert set(got["all"]) == names
    assert set(got["no_weights"]) == names - {"fullmodel.pt"}
    assert set(got["code"]) == code
    for strategy in ("all", "no_weights", "code"):
        for name, data in got[strategy].items():
            assert data == sent[strategy][name], (strategy, name)
    model, _ = zoo.build("mlp")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got["all_weights"][name], value)


# ---- inference_only ------------------------------------------------------------------------------


def _inference(rank, world_size, tmp):
    model, make_batch = zoo.build("mlp")
    batch = make_batch(1, 4)
    expected = model(**batch).detach()
    out = {}
    for name, policy, cfg in (
        ("tp", "tp", ComputeConfig(2, 2, inference_only=True)),
        ("dp", "dp", ComputeConfig(1, 2, inference_only=True)),  # a reducer would exist if training
    ):
        pm = parallelize(model, make_batch(0, 4), policy, cfg, gen_savedir=f"{tmp}/{name}")
        loss = pm(**batch)
        try:
            pm.train_step([batch])
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        out[name] = {
            "close": torch.allclose(loss, expected, rtol=1e-5, atol=1e-6),
            "requires_grad": [p.requires_grad for p in pm.parameters()] + [loss.requires_grad],
            "reducer": pm.reducer,
            "refused": refused,
            "nparams": len(list(pm.parameters())),
        }
    trained = parallelize(model, make_batch(0, 4), "dp", ComputeConfig(1, 2), gen_savedir=f"{tmp}/train")
    trained(**batch)
    out["training_has_reducer"] = trained.reducer is not None
    return out


def test_inference_only_is_forward_only_without_reducer(tmp_path):
    for out in spawn(_inference, 2, tmp_path / "run", str(tmp_path / "gen")):
        assert out["training_has_reducer"]  # so its absence below means something
        for name in ("tp", "dp"):
            r = out[name]
            assert r["close"], name
            assert r["nparams"] > 0 and not any(r["requires_grad"]), name
            assert r["reducer"] is None, name
            assert "inference_only=True" in r["refused"] and "train_step" in r["refused"], name


def test_inference_only_refuses_zero():
    with pytest.raises(ConfigError, match="inference_only=True.*use_zero=False"):
        ComputeConfig(1, 2, inference_only=True, use_zero=True)
