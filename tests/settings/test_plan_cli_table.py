"""Every flag of `python -m nnscaler.plan` either applies or is refused (issue 41): a table of invalid
values per flag (a flag of the parser without a row fails), each exiting non-zero with at most two
lines on stderr that name the flag, never a traceback. The cluster file is checked field by field at
load (`memory_gb: 0` was accepted and the plan then said "no partition fits"). Run in-process."""

from __future__ import annotations

import contextlib
import io
import json
import traceback
from pathlib import Path

import pytest
import yaml

from nnscaler.cli import plan as plan_cli
from nnscaler.policies.autodist.cluster import CLUSTER_FIELDS

BASE = ["--model", "tests.zoo.build_mlp", "--cluster", "cpu_gloo"]
"""A valid command (8 CPU devices); each row adds or replaces flags."""

GOOD_CLUSTER = {
    "name": "mine",
    "device": "h100",
    "nodes": 1,
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 450, "latency_us": 3},
    "inter_node": {"bandwidth_gbs": 50, "latency_us": 6},
    "memory_gb": 80,
}

# cluster-file field -> invalid values (each written into an otherwise good file)
CLUSTER_INVALID: dict[str, list[object]] = {
    "name": [5, ["a"]],
    "device": [
        "tpu",
        {"bf16_tflops": 5},
        {"name": "h100", "memory_gb": 0},
        {"name": "h100", "matmul_efficiency": 1.5},
    ],
    "nodes": [0, -1, 1.5, "two"],
    "devices_per_node": [0, 2.5, True],
    "intra_node": [
        {"bandwidth_gbs": 0},
        {"bandwidth_gbs": 10, "latency_us": -1},
        {"bandwidth_gbs": 10, "latency": 3},
        "fast",
    ],
    "inter_node": [{"bandwidth_gbs": float("inf")}, {"bandwidth_gbs": -5}, {"latency_us": 3}],
    "memory_gb": [0, -1, "80GB", float("nan")],
    "gpus": [8],  # an unknown key
}

# flag -> rows of (extra argv, a tmp-path factory or None); '{tmp}' in argv is replaced by tmp_path
FLAG_INVALID: dict[str, list[list[str]]] = {
    "--model": [
        ["--model", "nodots"],
        ["--model", "tests.zoo.no_such_builder"],
        ["--model", "no_such_package_xyz.build"],
        ["--model", "tests.zoo.PARITY_MODELS"],  # not callable
        ["--model", "tests.zoo.build_mlp", "--hf-config", "{tmp}/llama.json"],  # both
    ],
    "--hf-config": [
        ["--model!", "--hf-config", "{tmp}/missing.json"],
        ["--model!", "--hf-config", "{tmp}/not_json.json"],
        ["--model!", "--hf-config", "{tmp}/no_type.json"],
        ["--model!", "--hf-config", "{tmp}/unknown_type.json"],
    ],
    "--cluster": [
        ["--cluster", "no_such_cluster"],
        ["--cluster", "{tmp}/not_yaml.yaml"],
        ["--cluster", "{tmp}/list.yaml"],
    ],
    "--devices": [["--devices", "0"], ["--devices", "-2"], ["--devices", "abc"], ["--devices", "16"]],
    "--plan-ngpus": [
        ["--plan-ngpus", "0"],
        ["--plan-ngpus", "x"],
        ["--plan-ngpus", "3"],
        ["--plan-ngpus", "8", "--mesh", "2x2"],
    ],
    "--max-plan-ngpus": [["--max-plan-ngpus", "0"], ["--max-plan-ngpus", "4", "--plan-ngpus", "2"]],
    "--batch": [["--batch", "0"], ["--batch", "-1"], ["--batch", "b"]],
    "--seq": [
        ["--seq", "0"],
        ["--seq", "128"],
        ["--seq", "long"],
    ],  # 128: --seq does nothing without --hf-config
    "--nmicros": [["--nmicros", "0"], ["--nmicros", "two"]],
    "--no-pipeline": [["--no-pipeline=yes"]],
    "--zero": [["--zero", "4"], ["--zero", "-1"], ["--zero", "one"]],
    "--bf16": [["--bf16=1"]],
    "--mem": [["--mem", "0"], ["--mem", "-3"], ["--mem", "nan"], ["--mem", "inf"], ["--mem", "lots"]],
    "--recompute": [["--recompute", ""], ["--recompute", " "]],
    "--save-plan": [["--save-plan", "{tmp}"], ["--save-plan", "{tmp}/no_dir/plan.json"]],
    "--out": [["--out", "{tmp}"], ["--out", "{tmp}/no_dir/report.md"]],
    "--at": [
        ["--at", "foo"],
        ["--at", "x_size0=0"],
        ["--at", "foo=3"],
    ],  # foo=3: no such size (after tracing)
    "--mesh": [["--mesh", "4"], ["--mesh", "2x1"], ["--mesh", "2x2x2x2"], ["--mesh", "axb"]],
}
ACCEPTED: dict[str, str] = {
    "--help": "prints the help and exits 0; it takes no value",
}


def _files(tmp: Path) -> None:
    (tmp / "llama.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    (tmp / "not_json.json").write_text("model_type: llama\n")
    (tmp / "no_type.json").write_text(json.dumps({"hidden_size": 16}))
    (tmp / "unknown_type.json").write_text(json.dumps({"model_type": "not_a_model_zz"}))
    (tmp / "not_yaml.yaml").write_text("device: [h100\n")
    (tmp / "list.yaml").write_text("- h100\n")


def _argv(extra: list[str], tmp: Path) -> list[str]:
    argv = list(BASE)
    extra = [a.replace("{tmp}", str(tmp)) for a in extra]
    if extra and extra[0] == "--model!":  # drop the base --model
        argv, extra = argv[2:], extra[1:]
    if "--model" in extra:
        argv = argv[2:]
    if "--cluster" in extra:
        argv = [a for i, a in enumerate(argv) if a != "--cluster" and (i == 0 or argv[i - 1] != "--cluster")]
    return argv + extra


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m nnscaler.plan argv`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = plan_cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            if not isinstance(exit_.code, int) and exit_.code is not None:
                print(exit_.code, file=err)
        except Exception:
            print(traceback.format_exc(), file=err)
            code = 1
    return code, out.getvalue(), err.getvalue()


def _flags() -> set[str]:
    out = set()
    for action in plan_cli._parser()._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs:
            out.add(longs[0])
    return out


def test_every_flag_has_a_row() -> None:
    rows = set(FLAG_INVALID) | set(ACCEPTED)
    assert rows == _flags(), (
        f"flags without a row: {sorted(_flags() - rows)}; rows of no flag: {sorted(rows - _flags())}"
    )


def _assert_refused(code: int, out: str, err: str, flag: str) -> None:
    lines = err.strip().splitlines()
    assert code != 0, f"{flag}: accepted (exit 0); printed {out[-300:]!r}"
    assert "Traceback" not in err, f"{flag}: a traceback:\n{err}"
    assert 1 <= len(lines) <= 2, f"{flag}: {len(lines)} lines on stderr:\n{err}"
    assert flag in lines[0], f"{flag}: the message does not name the flag: {lines[0]!r}"


@pytest.mark.parametrize(
    ("flag", "extra"), [(f, row) for f, rows in FLAG_INVALID.items() for row in rows], ids=lambda x: str(x)
)
def test_an_invalid_flag_value_is_refused_in_one_or_two_lines(
    flag: str, extra: list[str], tmp_path: Path
) -> None:
    _files(tmp_path)
    _assert_refused(*run_cli(_argv(extra, tmp_path)), flag)


@pytest.mark.parametrize(
    ("field", "value"), [(f, v) for f, vs in CLUSTER_INVALID.items() for v in vs], ids=lambda x: str(x)
)
def test_a_bad_cluster_file_is_refused_at_load_naming_the_file_and_the_field(
    field: str, value: object, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({**GOOD_CLUSTER, field: value}))
    code, out, err = run_cli(["--model", "tests.zoo.build_mlp", "--cluster", str(path)])
    _assert_refused(code, out, err, "--cluster")
    assert str(path) in err and field.split(".")[0] in err, err


def test_every_cluster_field_has_a_row() -> None:
    assert set(CLUSTER_FIELDS) <= set(CLUSTER_INVALID), sorted(set(CLUSTER_FIELDS) - set(CLUSTER_INVALID))


def test_memory_gb_zero_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "zero.yaml"
    path.write_text(yaml.safe_dump({**GOOD_CLUSTER, "memory_gb": 0}))
    code, _, err = run_cli(["--model", "tests.zoo.build_mlp", "--cluster", str(path)])
    assert code == 2 and "memory_gb must be > 0" in err and "leave it out" in err, err
    assert "no partition fits" not in err


def test_help_prints_and_exits_zero() -> None:
    code, out, _ = run_cli(["--help"])
    assert code == 0 and "--hf-config" in out


def test_a_good_cluster_file_and_zero_stage_0_reach_the_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--zero 0` was dropped (0 == False in the filter of unset values) and the stage searched instead."""
    import nnscaler.policies.autodist.offline as offline

    seen = {}

    def fake_plan(graph, cluster, ndevices, **kwargs):
        seen.update(kwargs, cluster=cluster, ndevices=ndevices)
        raise offline.PlanError("stop here")

    monkeypatch.setattr(offline, "plan_offline", fake_plan)
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(GOOD_CLUSTER))
    code, _, err = run_cli(
        ["--model", "tests.zoo.build_mlp", "--cluster", str(path), "--zero", "0", "--devices", "4"]
    )
    assert code == 2 and "stop here" in err, err
    assert seen["pas_config"]["zero_stage"] == 0, seen
    assert seen["cluster"].device.memory_gb == 80 and seen["ndevices"] == 4
