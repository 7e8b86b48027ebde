"""Every environment variable nnscaler reads is registered (nnscaler.env_vars) and refuses a bad value
with a ConfigError naming the variable, the value and the fix (issue 41). A scan of nnscaler/ fails on a
read that does not go through the registry, and on an NNSCALER_ name the registry does not know.
NNSCALER_FAULT_INJECT naming a rank the run lacks, or set on a run without data-parallel replicas, is
refused on real gloo ranks."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import torch

from nnscaler import env_vars
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.runtime import ParallelModule, build_optimizer
from nnscaler.runtime.grads.fault_inject import FAULT_ENV, from_env
from tests.dist_util import spawn
from tests.runtime.test_robust_convergence import D_IN, D_OUT, Lin, _batch

SRC = Path(__file__).resolve().parents[2] / "nnscaler"

_SECONDS_BAD = ["ten", "0", "-5", "nan", "inf"]
_FLAG_BAD = ["2", "maybe", "enabled"]
INVALID: dict[str, list[str]] = {
    "NNSCALER_TIMEOUT": _SECONDS_BAD,
    "NNSCALER_COMPILE_TIMEOUT": _SECONDS_BAD,
    "NNSCALER_ARRIVAL_TIMEOUT": _SECONDS_BAD,
    "NNSCALER_HEARTBEAT_TIMEOUT": _SECONDS_BAD,
    "NNSCALER_STRICT_P2P_TIMEOUT": _SECONDS_BAD,
    "NNSCALER_STRICT_P2P": _FLAG_BAD,
    "NNSCALER_AUTODIST_NATIVE": _FLAG_BAD,
    "NNSCALER_BACKEND": ["mpi", "cuda"],
    "NNSCALER_LOG": ["chatty", "5x"],
    "NNSCALER_NODE_SIZE": ["0", "-8", "eight", "2.5"],
    "NNSCALER_INTRA_NODE_GBPS": ["0", "-1", "fast", "nan"],
    "NNSCALER_INTER_NODE_GBPS": ["0", "-1", "fast", "inf"],
    "NNSCALER_FAULT_INJECT": [
        "rank=3",  # no kind
        "kind=nan",  # no rank
        "rank=3,kind=melt",  # unknown kind
        "rank=x,kind=nan",
        "rank=-1,kind=nan",  # a rank no run has
        "rank=1,kind=nan,often=2",  # unknown key
        "rank=1,kind=nan,every=0",
        "rank=1,kind=nan,start=-1",
        "rank=1,kind=noise,scale=nan",
        "kind",
    ],
    "RANK": ["-1", "zero"],
    "LOCAL_RANK": ["-1", "0.5"],
    "WORLD_SIZE": ["0", "-2", "two"],
    "LOCAL_WORLD_SIZE": ["0", "many"],
    "TORCH_NCCL_ENABLE_TIMING": _FLAG_BAD,
    "TORCHELASTIC_RESTART_COUNT": ["-1", "once"],
    "TORCHELASTIC_MAX_RESTARTS": ["-3", "3.5"],
    "TORCHELASTIC_USE_AGENT_STORE": _FLAG_BAD,
}
ACCEPTED_ANY: dict[str, str] = {
    "NNSCALER_TIMELINE": "a file path: any non-empty text names a file (its directory is created at write)",
    "CUDA_VISIBLE_DEVICES": "only quoted in an error message; CUDA itself interprets it",
    "NNSCALER_SNAPSHOT_DIR": "a directory path: created at the first snapshot",
    "TORCHELASTIC_RUN_ID": "torchrun's --rdzv-id: any text names the run",
}
VALID: dict[str, tuple[str, object]] = {
    "NNSCALER_TIMEOUT": ("7.5", 7.5),
    "NNSCALER_STRICT_P2P": ("off", False),
    "NNSCALER_BACKEND": ("GLOO", "gloo"),
    "NNSCALER_NODE_SIZE": ("8", 8),
    "NNSCALER_FAULT_INJECT": (
        "rank=0+1,kind=stuck,every=2",
        {"ranks": {0, 1}, "kind": "stuck", "scale": 1.0, "every": 2, "start": 0},
    ),
}


def test_every_registered_variable_has_a_row() -> None:
    rows = set(INVALID) | set(ACCEPTED_ANY)
    assert rows == set(env_vars.REGISTRY), (
        f"variables without a row: {sorted(set(env_vars.REGISTRY) - rows)}; rows of unregistered "
        f"variables: {sorted(rows - set(env_vars.REGISTRY))}"
    )
    assert not set(INVALID) & set(ACCEPTED_ANY)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in INVALID.items() for v in vs])
def test_an_invalid_value_is_refused_naming_the_variable_and_the_fix(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        env_vars.read(name, {name: value})
    msg = str(err.value)
    assert f"{name}={value!r}" in msg and "set it to" in msg, msg
    assert len(msg.splitlines()) == 1


@pytest.mark.parametrize("name", sorted(ACCEPTED_ANY))
def test_free_text_variables_take_any_value(name: str) -> None:
    assert env_vars.read(name, {name: "x/y"}) == "x/y"


@pytest.mark.parametrize("name", sorted(VALID))
def test_a_valid_value_parses_and_unset_or_empty_is_none(name: str) -> None:
    raw, want = VALID[name]
    assert env_vars.read(name, {name: raw}) == want
    assert env_vars.read(name, {}) is None and env_vars.read(name, {name: "  "}) is None


def test_read_sites_refuse_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each former ad-hoc read now refuses what it once took silently (or crashed on with a bare error)."""
    from nnscaler.cli.peers import heartbeat_timeout
    from nnscaler.runtime.dist.p2p import strict_p2p
    from nnscaler.runtime.grads.hierarchy import _bandwidths

    monkeypatch.setenv("NNSCALER_STRICT_P2P", "no")  # was taken as "on": anything but "" and "0" was
    assert strict_p2p() is False
    monkeypatch.setenv("NNSCALER_STRICT_P2P", "maybe")
    with pytest.raises(ConfigError, match="NNSCALER_STRICT_P2P='maybe'"):
        strict_p2p()
    monkeypatch.setenv("NNSCALER_INTER_NODE_GBPS", "-3")  # was used as a negative bandwidth
    with pytest.raises(ConfigError, match="NNSCALER_INTER_NODE_GBPS='-3'"):
        _bandwidths()
    monkeypatch.setenv("NNSCALER_HEARTBEAT_TIMEOUT", "inf")  # was a heartbeat that never times out
    with pytest.raises(ConfigError, match="NNSCALER_HEARTBEAT_TIMEOUT='inf'"):
        heartbeat_timeout()
    monkeypatch.setenv("WORLD_SIZE", "two")  # was a bare int() ValueError
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        ComputeConfig(1)


# ---- the source scan -----------------------------------------------------------------------------

ALLOWED_DIRECT = {
    ("nnscaler/env_vars.py", "get"): "the registry itself",
    ("nnscaler/cli/arg_parser.py", "in"): "`$(NAME)` in a config refers to any variable the user names",
    ("nnscaler/cli/arg_parser.py", "subscript"): "the same `$(NAME)` reference, read after the check",
    ("nnscaler/runtime/dist/timeline.py", "setdefault"): "a write: turns on torch's NCCL timing for the run",
}


def _environ_uses(tree: ast.AST) -> list[tuple[str, int]]:
    """(kind, line) of each use of os.environ / os.getenv in a module."""
    out = []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        is_environ = isinstance(node, ast.Attribute) and node.attr == "environ"
        if isinstance(node, ast.Attribute) and node.attr in ("getenv", "getenvb"):
            out.append(("getenv", node.lineno))
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            out += [("from os import", node.lineno) for a in node.names if a.name in ("environ", "getenv")]
        if not is_environ:
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute):
            out.append((parent.attr, node.lineno))
        elif isinstance(parent, ast.Subscript):
            out.append(("subscript", node.lineno))
        elif isinstance(parent, ast.Compare):
            out.append(("in", node.lineno))
        else:
            out.append(("other", node.lineno))
    return out


def test_no_environment_read_bypasses_the_registry() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).as_posix()
        for kind, line in _environ_uses(ast.parse(path.read_text(), rel)):
            if (rel, kind) not in ALLOWED_DIRECT and not (rel == "nnscaler/env_vars.py"):
                bad.append(f"{rel}:{line} ({kind})")
    assert not bad, (
        "environment reads outside nnscaler.env_vars (register the variable and use env_vars.read): "
        + ", ".join(bad)
    )


def test_every_nnscaler_name_in_the_source_is_registered() -> None:
    names = set()
    for path in SRC.rglob("*.py"):
        names |= set(re.findall(r"(?<![A-Za-z0-9_])NNSCALER_[A-Z][A-Z0-9_]*", path.read_text()))
    assert names, "the scan found no NNSCALER_ names at all"
    assert names <= set(env_vars.REGISTRY), (
        f"read but not registered: {sorted(names - set(env_vars.REGISTRY))}"
    )


def test_the_scan_catches_an_unregistered_read() -> None:
    tree = ast.parse(
        'import os\nx = os.environ.get("N")\ny = os.getenv("Z")\nz = "A" in os.environ\nfrom os import environ'
    )
    assert sorted(_environ_uses(tree)) == [("from os import", 5), ("get", 2), ("getenv", 3), ("in", 4)]


# ---- NNSCALER_FAULT_INJECT on real gloo ranks ----------------------------------------------------


class _NoReplicas(ParallelModule):
    """A plan over both ranks (plan_ngpus == runtime_ngpus): no data-parallel replicas."""

    forward_args = ("x", "t")

    def __init__(self, rank: int, world: int) -> None:
        ranks = list(range(world))
        super().__init__(
            rank=rank,
            world_size=world,
            plan_ngpus=world,
            groups={"tp": ranks},
            all_groups=[ranks],
        )
        self.add_shard("weight", "weight", (D_OUT, D_IN), torch.float32)
        self.load_shards(False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((x @ self.weight.T - t) ** 2).mean()


def _drill(rank: int, world: int, fault: str, replicas: bool) -> str | None:
    os.environ[FAULT_ENV] = fault
    try:
        pm = Lin(rank, world) if replicas else _NoReplicas(rank, world)
        pm.compute_config = ComputeConfig(1 if replicas else world, world)
        opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
        pm(**_batch(rank, 4)).backward()
        opt.step()
    except ConfigError as err:
        return str(err)
    finally:
        os.environ.pop(FAULT_ENV, None)
    return None


def fault_worker(rank: int, world: int) -> dict[str, str | None]:
    return {
        "rank=5": _drill(rank, world, "rank=5,kind=sign_flip", True),
        "rank=-1": _drill(rank, world, "rank=-1,kind=sign_flip", True),
        "no replicas": _drill(rank, world, "rank=1,kind=sign_flip", False),
        "rank=1 ok": _drill(rank, world, "rank=1,kind=sign_flip", True),
    }


def test_a_fault_drill_that_cannot_fire_is_refused_on_two_gloo_ranks(tmp_path) -> None:
    for rank, out in enumerate(spawn(fault_worker, 2, tmp_path, timeout=120)):
        assert out["rank=5"] and "names rank 5" in out["rank=5"] and "2 ranks" in out["rank=5"], (rank, out)
        assert out["rank=-1"] and "NNSCALER_FAULT_INJECT='rank=-1,kind=sign_flip'" in out["rank=-1"], out
        assert out["no replicas"] and "no data-parallel replicas" in out["no replicas"], (rank, out)
        assert out["rank=1 ok"] is None, (rank, out)


def test_from_env_checks_the_rank_against_the_world() -> None:
    env = {FAULT_ENV: "rank=2,kind=nan"}
    assert from_env(0, env, world_size=4) is None and from_env(2, env, world_size=4) is not None
    with pytest.raises(ConfigError, match="names rank 2, but this run has 2 ranks"):
        from_env(0, env, world_size=2)
    with pytest.raises(ConfigError, match="no data-parallel replicas"):
        from_env(0, env, world_size=4, replicas=False)
    assert from_env(0, {}, world_size=1, replicas=False) is None
