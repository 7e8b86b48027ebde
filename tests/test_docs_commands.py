"""Every command in the documentation either runs here or is listed with the reason it does not.

Documents: README.md, docs/*.md, examples/*/README.md. Fenced code blocks are read in order.

Conventions (an HTML comment on the last non-blank line before a fence; invisible when rendered):

- ```python after `<!-- test: file NAME -->`: written to NAME in the document's scratch directory
  (one temporary directory per document, shared by its blocks, in document order), so later
  commands can run it.
- ```python after `<!-- test: run -->`: a complete script, run with `python -` in that directory
  (PYTHONPATH = repository root + the directory); it must exit 0 (the scripts assert what they show).
- ```python after `<!-- test: excerpt PATH -->`: lines copied from a file that an earlier command
  of the document generated (PATH, relative to the scratch directory); every line but `...` must
  occur in that file, in the same order (so docs quoting generated code follow the code generator).
- every other ```python block (excerpts aside) is a fragment: it must parse (`ast.parse`), nothing more.
- ```bash / ```console / ```sh / ```shell, and fences without a language whose lines start like
  a command (python, torchrun, nnscaler-train, pip, pytest, ls, cd; other lines are taken for
  output): every command (a line, `$ ` prompt and `# comment`
  removed, `\\` continuations joined, split on ` && `, runs of spaces made one) must be a key of RUN (run in the scratch
  directory, output checked against a regex) or of NOT_RUN (with the reason), or match one of
  NOT_RUN_PATTERNS (examples still being written alongside; with the reason). A new command that
  is in neither fails `test_every_doc_command_is_run_or_listed`: add it to one of them.

RUN maps the command as written to the command actually run: the same, or shortened (fewer steps,
fewer processes); `{python}` is this interpreter, `{repo}` the repository root. Substitutions made
for every run: `torchrun` is `python -m torch.distributed.run --standalone` (no rendezvous port to
pick); the working directory is the document's scratch directory, with the repository root on
PYTHONPATH (so `examples` imports as from the root); OMP_NUM_THREADS=1; NNSCALER_LOG unset unless
the command sets it. Budget: the whole file under a minute on 2 cores (tiny models, 2 processes).
Also checked: relative links resolve, docs/README.md lists every page, no page refers to files
users do not have.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").glob("*/README.md")])
SHELL = {"bash", "console", "sh", "shell"}

NANOGPT = "run by tests/examples/test_nanogpt.py (4 processes, a few steps, offline data)"
INSTALL = "installs packages: the test environment is already installed (.ci/run checks a fresh install)"
ELASTIC = (
    "several machines (or SLURM) under torchrun's elastic agent; the same launch on one machine (two agents as "
    "two nodes, c10d rendezvous) is run by tests/cli/test_elastic_drill.py and test_elastic_restarts.py"
)
TRAINER = "cfg.yaml is the partial example config above it; the Trainer is run by tests/cli/test_trainer.py"

# command as written -> (command run, regex its stdout+stderr must match)
RUN: dict[str, tuple[str, str]] = {
    "torchrun --nproc_per_node 2 train_mlp.py": (
        "{python} -m torch.distributed.run --standalone --nproc_per_node 2 train_mlp.py",
        r"step 4 loss",
    ),
    "ls .nnscaler/_parallel_modules/__main__/MLP/_/": (
        "ls .nnscaler/_parallel_modules/__main__/MLP/_/",
        r"(?s)compute_config\.json.*fingerprint\.json.*gencode0\.py.*gencode1\.py.*graph\.json.*plan\.json",
    ),
    "torchrun --nproc_per_node 2 train_policy.py": (
        "{python} -m torch.distributed.run --standalone --nproc_per_node 2 train_policy.py",
        r"loss fell",
    ),
    "NNSCALER_LOG=info python gen_gpt.py": (
        "NNSCALER_LOG=info {python} gen_gpt.py",
        r"(?s)compiled examples.nanogpt.model.GPT: policy 'tp' over plan_ngpus=2.*gen_pp/_parallel_modules/examples/nanogpt/model/GPT/_/gencode\{0..1\}.py",
    ),
    "torchrun --nproc_per_node 2 train_lightning.py": (
        "{python} -m torch.distributed.run --standalone --nproc_per_node 2 train_lightning.py",
        r"merged \['body.0.bias', 'body.0.weight', 'body.2.bias', 'body.2.weight'\] loss",
    ),
    "python -m nnscaler.profiler --model tests.zoo.build_gpt --ways 1,2 --out ops.json": (
        "{python} -m nnscaler.profiler --model tests.zoo.build_gpt --ways 1,2 --repeats 1 --out ops.json",
        r"\d+ op timings on cpu in ops.json",
    ),
    "python -m nnscaler.plan --model tests.zoo.build_gpt --cluster h100x8 --at idx_size0=16,targets_size0=16": (
        "{python} -m nnscaler.plan --model tests.zoo.build_gpt --cluster h100x8 --at idx_size0=16,targets_size0=16",
        r"Forward FLOPs of one call: .*idx_size0.*\nAt idx_size0=16,targets_size0=16: predicted step",
    ),
}

# command as written -> why it is not run here
NOT_RUN: dict[str, str] = {
    "pip install torch==2.13.0": INSTALL,
    "pip install -e .": INSTALL,
    "pip install -e .[test]": INSTALL,
    "pip install -e .[lightning]": INSTALL,
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": INSTALL,
    "pytest -q": "the whole test suite: this file is part of it",
    "torchrun --nproc_per_node 4 examples/nanogpt/train.py --plan_ngpus 2 --runtime_ngpus 4": NANOGPT,
    "torchrun --nproc_per_node 4 examples/nanogpt/train.py --plan_ngpus 4 --policy pp --nmicros 4": NANOGPT,
    "torchrun --nproc_per_node 4 -m nnscaler.cli.train -f examples/nanogpt/train_cli.yaml": NANOGPT,
    "python examples/nanogpt/prepare.py": NANOGPT,
    "python -m nnscaler.plan --model tests.zoo.build_llama --cluster h100x8": (
        "the same planner CLI as the build_gpt command of the same page, which is run (a Llama would add "
        "seconds); tests/compiler/test_autodist_report.py runs the CLI"
    ),
    "python -m nnscaler.plan --hf-config llama3_70b.json --seq 8192 --batch 64 --cluster h100x64_ib --bf16": (
        "needs a Llama-3-70B config.json the reader supplies (no download in tests); not covered by a test"
    ),
    "nnscaler-train -f cfg.yaml": TRAINER,
    "torchrun --nproc_per_node 4 -m nnscaler.cli.train -f cfg.yaml --compute_config.plan_ngpus 2": TRAINER,
    "nnscaler-train -f cfg.yaml --run_mode compile": TRAINER,
    "nnscaler-train merge checkpoints/last model.safetensors": "merges a checkpoint a training run wrote; run by tests/cli/test_checkpoint.py",
    "nnscaler-train merge checkpoints/last merged.ckpt": "merges a checkpoint a training run wrote; run by tests/cli/test_checkpoint.py",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job42 -m nnscaler.cli.train -f cfg.yaml": ELASTIC,
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": ELASTIC,
    'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': ELASTIC,
    "srun --ntasks-per-node 1 torchrun --nnodes 1:$SLURM_NNODES --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint $HEAD:29400 --rdzv-id $SLURM_JOB_ID -m nnscaler.cli.train -f cfg.yaml": ELASTIC,
}

# Whole families of commands, for examples still being written alongside these docs (their READMEs
# change daily): a command matching the pattern counts as listed, with the reason.
NOT_RUN_PATTERNS: list[tuple[str, str]] = [
    (
        r"\bexamples/nanogpt/train_nnscaler\.py",
        "run by tests/integration/test_lightning_nanogpt.py (tiny config, 2-stage pipeline, offline data)",
    ),
    (
        r"\bexamples/llama3_8B_128K/",
        "run by tests/examples/test_llama3.py (mini model, offline data); the Llama-3-8B commands need "
        "the model download and 8 GPUs",
    ),
]


def listed(command: str) -> bool:
    return command in RUN or command in NOT_RUN or any(re.search(p, command) for p, _ in NOT_RUN_PATTERNS)


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    text: str
    marker: str = ""
    commands: list[str] = field(default_factory=list)


FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
COMMAND_START = re.compile(r"^(\w+=\S+ )*(python|torchrun|nnscaler-train|pip|pytest|ls|cd)\b")
MARKER = re.compile(r"<!--\s*test:\s*(.*?)\s*-->")


def blocks(doc: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the test marker before each."""
    lines = doc.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]
        )
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mm = MARKER.search(prev)
        out.append(Block(doc, start + 1, lang, body + "\n", mm.group(1) if mm else ""))
        i = j + 1
    for b in out:
        if b.lang in SHELL:
            b.commands = shell_commands(b.text)
        elif not b.lang:  # a fence without a language: its command lines (the rest is their output)
            b.commands = [c for c in shell_commands(b.text) if COMMAND_START.match(c)]
    return out


def shell_commands(text: str) -> list[str]:
    """Commands of a shell block: prompts and comments dropped, continuations joined, split on &&."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"^\s*\$ ", "", line)
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        out.extend(" ".join(c.split()) for c in line.split(" && ") if c.strip())
    return out


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]


def _rel(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def test_every_doc_command_is_run_or_listed():
    missing = [f"{_rel(b.doc)}:{b.line}: {c}" for b in ALL_BLOCKS for c in b.commands if not listed(c)]
    assert not missing, (
        "commands in the docs that tests/test_docs_commands.py neither runs (RUN) nor lists with a "
        "reason (NOT_RUN):\n" + "\n".join(missing)
    )
    unknown_markers = [
        f"{_rel(b.doc)}:{b.line}: {b.marker}"
        for b in ALL_BLOCKS
        if b.marker
        and (b.lang != "python" or not (b.marker == "run" or b.marker.startswith(("file ", "excerpt "))))
    ]
    assert not unknown_markers, f"unknown test markers, or markers on non-python blocks: {unknown_markers}"


def test_the_lists_name_only_commands_the_docs_have():
    """A command removed from the docs is removed from RUN / NOT_RUN too (no stale entries)."""
    present = {c for b in ALL_BLOCKS for c in b.commands}
    stale = sorted(set(RUN) - present) + sorted(set(NOT_RUN) - present)
    assert not stale, f"RUN / NOT_RUN list commands no document has: {stale}"


def test_python_fragments_parse():
    bad = []
    for b in ALL_BLOCKS:
        if b.lang == "python" and not b.marker.startswith("excerpt "):
            try:
                ast.parse(b.text)
            except SyntaxError as exc:
                bad.append(f"{_rel(b.doc)}:{b.line + (exc.lineno or 0)}: {exc.msg}")
    assert not bad, "python blocks that do not parse:\n" + "\n".join(bad)


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(workdir), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("NNSCALER_LOG", None)
    return env


def _runnable_docs() -> list[Path]:
    return [
        doc
        for doc in DOCS
        if any(b.marker == "run" or any(c in RUN for c in b.commands) for b in blocks(doc))
    ]


def _check_excerpt(where: str, excerpt: str, path: Path) -> None:
    assert path.exists(), f"{where}: the excerpt's file {path.name} was not generated"
    lines = path.read_text().splitlines()
    at = 0
    for want in excerpt.splitlines():
        if want.strip() in ("", "..."):
            continue
        found = next((i for i in range(at, len(lines)) if lines[i] == want), None)
        assert found is not None, f"{where}: the excerpt line\n{want}\nis not in {path} (after line {at})"
        at = found + 1


@pytest.mark.parametrize("doc", _runnable_docs(), ids=_rel)
def test_doc_runs(doc: Path, tmp_path: Path):
    """The doc's files are written, its scripts and RUN commands run, in document order."""
    env = _env(tmp_path)
    for b in blocks(doc):
        where = f"{_rel(doc)}:{b.line}"
        if b.lang == "python" and b.marker.startswith("file "):
            (tmp_path / b.marker[5:].strip()).write_text(b.text)
        elif b.lang == "python" and b.marker.startswith("excerpt "):
            _check_excerpt(where, b.text, tmp_path / b.marker[8:].strip())
        elif b.lang == "python" and b.marker == "run":
            proc = subprocess.run(
                [sys.executable, "-"],
                input=b.text,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, f"{where}: the script failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        for command in b.commands:
            if command not in RUN:
                continue
            cmd, expect = RUN[command]
            cmd = cmd.format(python=sys.executable, repo=REPO)
            proc = subprocess.run(
                cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            out = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"{where}: `{cmd}` failed:\n{out[-4000:]}"
            assert re.search(expect, out), f"{where}: `{cmd}` printed no match for {expect!r}:\n{out[-4000:]}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_links_resolve_and_the_index_lists_every_page():
    """Relative links point at files that exist; docs/README.md lists every page; nothing points at
    material users do not have."""
    broken = []
    for doc in DOCS:
        text = doc.read_text()
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{_rel(doc)}: {target}")
        assert "DESIGN.md" not in text and "shared/" not in text, (
            f"{_rel(doc)} refers to files users never have"
        )
    assert not broken, f"broken links: {broken}"
    index = (REPO / "docs" / "README.md").read_text()
    unlisted = [
        p.name
        for p in sorted((REPO / "docs").glob("*.md"))
        if p.name != "README.md" and f"]({p.name})" not in index
    ]
    assert not unlisted, f"docs/README.md does not list {unlisted}"
