"""Generated files are verified before they are reused or imported (issue 10).

fingerprint.json records the sha256 of every file a compile writes and is written last; an edited,
truncated, forged or damaged file is named under reuse='match' and regenerated under 'moo'; a
graph.json is checked before reuse='graph' plans from it, and fields it writes as code must be plain;
paths stay under gen_savedir; compiles into one directory are serialised by a lock.
"""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import nnscaler.parallel.compile as compile_mod
from nnscaler import ComputeConfig, parallelize
from nnscaler.codegen import write_atomic
from nnscaler.errors import ConfigError
from nnscaler.graph.ir import UnsafeGraphError, graph_from_json
from nnscaler.parallel import load_generated_class, module_outdir
from nnscaler.parallel.artifacts import ARTIFACTS_KEY, check_artifacts, read_saved, record_artifacts
from nnscaler.parallel.dirlock import compile_lock

MARKER = "EXECUTED_FROM_GENERATED_CODE"
"""A file that code planted in a generated file would create (in the test's working directory)."""


class Tiny(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


HOSTILE_KEYS = ['x"); open("' + MARKER + '", "w"); ("', "line\nbreak", 'tri"""ple', "back\\slash"]


class HostileKeys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({k: nn.Linear(8, 8) for k in HOSTILE_KEYS})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in HOSTILE_KEYS:
            x = torch.relu(self.layers[k](x))
        return x.sum()


def _model(cls=Tiny, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return cls(**kwargs)


def _x(dim: int = 8) -> dict:
    return {"x": torch.randn(4, dim, generator=torch.Generator().manual_seed(1))}


def _compile(model, save, reuse="match", instance_name=None, load_module=True, dim=8):
    return parallelize(
        model,
        _x(dim),
        "dp",
        ComputeConfig(1, 1),
        gen_savedir=save,
        reuse=reuse,
        instance_name=instance_name,
        load_module=load_module,
    )


def _outdir(save, cls=Tiny, instance_name=None) -> Path:
    return module_outdir(save, cls, instance_name)


def _works(pm, model) -> None:
    torch.testing.assert_close(pm(**_x()), model(**_x()))


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a planted open(MARKER, "w") would land here
    yield
    assert not (tmp_path / MARKER).exists(), "code planted in a generated file ran"


# ---- edited, truncated, forged code --------------------------------------------------------------


def test_edited_gencode_is_named_under_match_and_regenerated_under_moo(tmp_path):
    save, model = tmp_path / "gen", _model()
    _compile(model, save)
    gencode = _outdir(save) / "gencode0.py"
    original = gencode.read_text()
    gencode.write_text(original + f'\nopen("{MARKER}", "w")\n')  # looks like a harmless edit

    with pytest.raises(ConfigError, match=r"gencode0\.py is not the file that was generated") as info:
        _compile(model, save)
    assert "reuse='moo'" in str(info.value) and str(_outdir(save)) in str(info.value)
    # importing it directly is refused as well (it is checked against fingerprint.json first)
    with pytest.raises(ConfigError, match=r"gencode0\.py is not the file that was generated"):
        load_generated_class(_outdir(save), 0)

    pm = _compile(model, save, reuse="moo")
    assert gencode.read_text() == original  # regenerated
    _works(pm, model)
    _works(_compile(model, save), model)  # and reused as it is now


def test_truncated_gencode_is_named_not_missing_genmodel(tmp_path):
    save, model = tmp_path / "gen", _model()
    _compile(model, save)
    gencode = _outdir(save) / "gencode0.py"
    full = gencode.read_bytes()
    gencode.write_bytes(full[: len(full) // 3])

    with pytest.raises(
        ConfigError, match=rf"gencode0\.py is truncated \({len(full) // 3} of {len(full)} bytes\)"
    ):
        _compile(model, save)
    with pytest.raises(ConfigError, match=r"gencode0\.py is truncated"):
        load_generated_class(_outdir(save), 0)
    gencode.unlink()
    with pytest.raises(ConfigError, match=r"gencode0\.py is missing"):
        _compile(model, save)
    _works(_compile(model, save, reuse="moo"), model)


def test_forged_fingerprint_is_caught_by_the_recorded_hashes(tmp_path):
    """Someone copies another compile's code in and edits fingerprint.json so that it describes the
    new model: the fingerprint now matches, the sha256 it records for gencode0.py does not."""
    save = tmp_path / "gen"
    small, big = _model(dim=8), _model(dim=16)
    _compile(small, save, instance_name="a", load_module=False)
    _compile(big, save, instance_name="b", load_module=False, dim=16)
    a, b = _outdir(save, instance_name="a"), _outdir(save, instance_name="b")
    forged = json.loads((b / "fingerprint.json").read_text())
    forged[ARTIFACTS_KEY] = json.loads((a / "fingerprint.json").read_text())[ARTIFACTS_KEY]
    (a / "fingerprint.json").write_text(json.dumps(forged))
    (a / "gencode0.py").write_bytes((b / "gencode0.py").read_bytes())

    with pytest.raises(ConfigError, match=r"gencode0\.py is not the file that was generated"):
        _compile(big, save, instance_name="a", dim=16)
    # a record from another directory does not vouch for this one's code either
    with pytest.raises(ConfigError, match=r"gencode0\.py is not the file"):
        load_generated_class(b, 0, read_saved(a).artifacts)


def test_corrupt_fingerprint_is_named_under_match_regenerated_under_moo_and_override(tmp_path):
    save, model = tmp_path / "gen", _model()
    _compile(model, save, load_module=False)
    fp_file = _outdir(save) / "fingerprint.json"
    good = fp_file.read_bytes()
    for damaged in (b"{not json", good[: len(good) // 2], b"[1, 2]", b"\xff\xfe"):
        fp_file.write_bytes(damaged)
        with pytest.raises(ConfigError, match=r"fingerprint\.json") as info:
            _compile(model, save)
        assert not isinstance(info.value, json.JSONDecodeError)
        assert "reuse='moo'" in str(info.value)
        with pytest.raises(ConfigError, match=r"fingerprint\.json.*cannot be checked before it is imported"):
            load_generated_class(_outdir(save), 0)
    _works(_compile(model, save, reuse="moo"), model)
    assert read_saved(_outdir(save)).problem is None
    fp_file.write_bytes(b"{not json")
    _works(_compile(model, save, reuse="override"), model)
    fp_file.write_bytes(b'{"format": 3, "module_sources": 5}')  # valid JSON, not a fingerprint
    _works(_compile(model, save, reuse="moo"), model)


def test_crash_mid_compile_leaves_no_fingerprint_claiming_completeness(tmp_path, monkeypatch):
    save, model = tmp_path / "gen", _model()
    _compile(model, save, load_module=False)
    outdir = _outdir(save)

    def crash(*args, **kwargs):
        raise RuntimeError("killed during codegen")

    monkeypatch.setattr(compile_mod, "generate_code", crash)
    with pytest.raises(RuntimeError, match="killed during codegen"):
        _compile(model, save, reuse="override", load_module=False)
    assert not (outdir / "fingerprint.json").exists()  # graph.json/plan.json may be new, code old
    assert not [p.name for p in outdir.iterdir() if p.name.endswith(".tmp")]  # no temporary left
    monkeypatch.undo()
    _works(_compile(model, save), model)  # nothing claimed to be complete: match generates again
    assert check_artifacts(outdir, read_saved(outdir).artifacts, ["gencode0.py", "plan.json"]) == []


# ---- reuse='graph' -------------------------------------------------------------------------------


def test_tampered_graph_json_is_refused_under_reuse_graph(tmp_path):
    save, model = tmp_path / "gen", _model()
    _compile(model, save, load_module=False)
    graph_file = _outdir(save) / "graph.json"
    original = graph_file.read_text()
    assert "aten.relu.default" in original
    graph_file.write_text(original.replace("aten.relu.default", "aten.sigmoid.default"))
    with pytest.raises(ConfigError, match=r"graph\.json is not the file that was generated"):
        _compile(model, save, reuse="graph")
    graph_file.write_text(original)
    _works(_compile(model, save, reuse="graph"), model)


def _hostile_graph(text: str) -> dict[str, str]:
    """graph.json texts, each with one field that codegen writes as code made hostile."""
    data = json.loads(text)
    act = next(v["name"] for v in data["values"] if v["kind"] == "activation")
    relu = next(n for n in data["nodes"] if n["op"] == "aten.relu.default")
    attack = f'__import__("os").system("touch {MARKER}")'
    out = {
        "value name": text.replace(f'"{act}"', json.dumps(f"{act} = {attack}\n{act}")),
        "value name with triple quotes": text.replace(f'"{act}"', json.dumps(f'{act}"""')),
        "op": text.replace(
            '"aten.relu.default"', json.dumps(f"aten.relu.default({act}) or {attack} or print")
        ),
    }
    edited = json.loads(text)
    next(v for v in edited["values"] if v["kind"] == "param")["meta"]["dtype"] = (
        f"float32); {attack}; (torch.float32"
    )
    out["dtype"] = json.dumps(edited)
    edited = json.loads(text)
    edited["shape_rules"] = [[f"{attack} == 0", "why"]]
    out["shape rule"] = json.dumps(edited)
    edited = json.loads(text)
    next(n for n in edited["nodes"] if n["name"] == relu["name"])["kwargs"] = {
        "dict": {"inplace=False, **{}) or (": 1}
    }
    out["keyword argument"] = json.dumps(edited)
    edited = json.loads(text)
    edited["forward_args"] = [f"x, y={attack}"]
    out["forward argument"] = json.dumps(edited)
    return out


def test_graph_fields_written_as_code_must_be_plain(tmp_path):
    """A graph.json whose hash was re-recorded (or that is loaded by hand) still cannot put code into
    gencode: value names, ops, dtypes, size expressions and argument names are checked on load."""
    save, model = tmp_path / "gen", _model()
    _compile(model, save, load_module=False)
    outdir = _outdir(save)
    text = (outdir / "graph.json").read_text()
    graph_from_json(text)  # the real one loads
    for what, hostile in _hostile_graph(text).items():
        with pytest.raises(UnsafeGraphError, match="cannot be used to generate code") as info:
            graph_from_json(hostile)
        assert "reuse='moo'" in str(info.value), what
    # through parallelize, with the record rewritten to match the hostile file (as a forger would)
    hostile = _hostile_graph(text)["value name"]
    write_atomic(outdir / "graph.json", hostile)
    saved = read_saved(outdir).data
    saved[ARTIFACTS_KEY].update(record_artifacts(outdir, ["graph.json"]))
    (outdir / "fingerprint.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"graph\.json.*value name .* is not a Python identifier"):
        _compile(model, save, reuse="graph")


def test_hostile_parameter_names_from_a_saved_graph_stay_text(tmp_path):
    """ModuleDict keys with quotes, newlines, backslashes and triple quotes come back from graph.json
    under reuse='graph' and still become string literals: nothing runs, the module computes the model."""
    save, model = tmp_path / "gen", _model(HostileKeys)
    _compile(model, save, load_module=False)
    outdir = _outdir(save, HostileKeys)
    saved_graph = json.loads((outdir / "graph.json").read_text())
    targets = [v["target"] for v in saved_graph["values"] if v["kind"] == "param"]
    assert f"layers.{HOSTILE_KEYS[0]}.weight" in targets  # the names really went through graph.json
    (outdir / "gencode0.py").unlink()

    pm = _compile(model, save, reuse="graph")
    _works(pm, model)
    assert f"layers.{HOSTILE_KEYS[1]}.bias" in pm.state_dict()
    tree = ast.parse((outdir / "gencode0.py").read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert f"layers.{HOSTILE_KEYS[0]}.weight" in strings and f"layers.{HOSTILE_KEYS[2]}.weight" in strings
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "open" not in calls


# ---- paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "..", "a/../../x", "<absolute>", "", "a//b", "a\\..\\x", "./a"])
def test_instance_name_must_stay_under_gen_savedir(tmp_path, name):
    save = tmp_path / "gen"
    name = str(tmp_path / "x") if name == "<absolute>" else name
    with pytest.raises(ConfigError, match=r"instance_name=.*must be a plain name"):
        _compile(_model(), save, instance_name=name, load_module=False)
    assert not (tmp_path / "x").exists() and not (save / "_parallel_modules").exists()


def test_plain_subdirectory_instance_names_and_links_out(tmp_path):
    save, model = tmp_path / "gen", _model()
    _works(_compile(model, save, instance_name="exp/run1"), model)
    assert (
        save / "_parallel_modules" / "tests" / "test_artifacts" / "Tiny" / "exp" / "run1" / "gencode0.py"
    ).exists()
    # a link inside gen_savedir that points out of it is refused, naming the resolved place
    outside = tmp_path / "outside"
    outside.mkdir()
    (_outdir(save)).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, _outdir(save).parent / "escape")
    with pytest.raises(ConfigError, match=r"outside gen_savedir"):
        _compile(model, save, instance_name="escape", load_module=False)
    assert list(outside.iterdir()) == []


def test_class_names_cannot_leave_gen_savedir(tmp_path):
    odd = type("Odd", (Tiny,), {"__module__": "../../evil", "__qualname__": ".."})
    outdir = module_outdir(tmp_path / "gen", odd, None)
    assert outdir.resolve().is_relative_to((tmp_path / "gen").resolve())
    assert ".." not in outdir.parts


# ---- atomic writes and the lock ------------------------------------------------------------------


def test_no_temporary_files_are_left_and_generated_files_are_readable(tmp_path):
    save = tmp_path / "gen"
    _compile(_model(), save, load_module=False)
    names = sorted(p.name for p in _outdir(save).iterdir())
    assert [n for n in names if n.startswith(".")] == []  # the lock is beside the directory
    assert {"fingerprint.json", "gencode0.py", "graph.json", "plan.json", "compute_config.json"} <= set(names)
    assert all(os.stat(_outdir(save) / n).st_mode & 0o044 == 0o044 for n in names if not n.startswith("."))


def test_a_held_lock_makes_a_second_compile_wait(tmp_path):
    save, model = tmp_path / "gen", _model()
    outdir = _outdir(save)
    result: dict = {}

    def second():
        try:
            result["pm"] = _compile(model, save)
        except BaseException as exc:  # reported below
            result["error"] = exc

    with compile_lock(outdir):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(timeout=3.0)
        assert thread.is_alive(), "the compile did not wait for the lock"
        assert not (outdir / "fingerprint.json").exists()
    thread.join(timeout=120)
    assert "error" not in result, result.get("error")
    _works(result["pm"], model)


def _slow_dp(graph, cfg):
    """The dp policy, slowly, noting when it planned: compiles that overlap would overlap here."""
    from nnscaler.policies import BUILTIN_POLICIES

    start = time.time()
    time.sleep(1.0)
    with open(os.environ["NNSCALER_TEST_PLAN_LOG"], "a") as f:
        f.write(f"{start} {time.time()}\n")
    return BUILTIN_POLICIES["dp"](graph, cfg)


def _compile_in_process(save: str, workdir: str, index: int) -> list:
    """A separate job: wait until the other one is ready too, then compile into the same directory."""
    torch.set_num_threads(1)
    os.environ["NNSCALER_TEST_PLAN_LOG"] = str(Path(workdir, f"plans{index}.log"))
    Path(workdir, f"ready{index}").touch()
    deadline = time.monotonic() + 60
    while len(list(Path(workdir).glob("ready*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    model = _model()
    cfg = ComputeConfig(1, 1)
    pm = parallelize(model, _x(), _slow_dp, cfg, gen_savedir=save, reuse="override")
    return [pm(**_x()).item(), model(**_x()).item()]


def test_two_processes_compiling_into_one_directory_both_succeed(tmp_path, monkeypatch):
    """Both regenerate (reuse='override') at once: the lock keeps their compiles apart in time, both
    load working code, and the directory ends consistent (its hashes verify, 'match' reuses it)."""
    save, work = tmp_path / "gen", tmp_path / "work"
    work.mkdir()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        jobs = [pool.apply_async(_compile_in_process, (str(save), str(work), i)) for i in range(2)]
        results = [job.get(timeout=240) for job in jobs]
    for got, expected in results:
        assert got == pytest.approx(expected, rel=1e-6)
    plans = sorted(
        tuple(map(float, line.split()))
        for p in work.glob("plans*.log")
        for line in p.read_text().splitlines()
    )
    assert len(plans) == 2, plans  # both compiled ...
    assert plans[0][1] <= plans[1][0], f"two compiles planned at once: {plans}"  # ... one after the other
    outdir = _outdir(save)
    saved = read_saved(outdir)
    assert saved.problem is None and saved.artifacts is not None
    assert check_artifacts(outdir, saved.artifacts, list(saved.artifacts)) == []
    monkeypatch.setenv("NNSCALER_TEST_PLAN_LOG", str(work / "plans_here.log"))
    model = _model()
    pm = parallelize(model, _x(), _slow_dp, ComputeConfig(1, 1), gen_savedir=save, load_module=True)
    _works(pm, model)  # reused as it is ('match'): nothing planned again
    assert len([line for p in work.glob("plans*.log") for line in p.read_text().splitlines()]) == 2
