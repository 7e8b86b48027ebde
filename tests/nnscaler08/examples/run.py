"""Run nnScaler 0.8's examples (a fresh adapted copy, see adapt.py) against the installed nnscaler on
CPU with gloo and print a table: example, changes, loss first -> last, time. Called by
tests/nnscaler08/run_examples.sh; not part of the test suite."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from adapt import Adapter  # noqa: E402

LOSS_LINE = re.compile(r"# train_loss\s+(?:\d+\s+)?([-+0-9.eE]+|nan|inf)\s*$")


@dataclass
class Run:
    """One row: commands run in `cwd` (under the adapted copy); the last command's losses reported."""

    name: str
    cwd: str
    commands: list[list[str]]
    args: str = ""
    """The run-size options given on the command line (the examples' own flags), for the table."""
    shims: bool = False
    """Run with shims/sitecustomize.py (nnScaler 0.8 internals the example imports; listed there)."""
    tb_dir: str | None = None
    """Read losses from TensorBoard event files under cwd/tb_dir (else from '# train_loss' lines)."""
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    status: str = "not run"


def torchrun(n: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *argv]


def cli_sizes() -> list[str]:
    """nanoGPT's train_cli_args.yaml sized for 2 CPU cores, through the Trainer's CLI overrides."""
    sizes = {
        "max_train_steps": 20,
        "val_every_n_train_steps": 10,
        "max_val_steps": 2,
        "micro_batch_size": 16,
        "model.args.n_layer": 2,
        "model.args.n_head": 2,
        "model.args.n_embd": 64,
        "model.args.block_size": 64,
        "dataset.train_args.block_size": 64,
        "dataset.val_args.block_size": 64,
        "lr_scheduler.args.warmup_iters": 5,
        "enable_progress_bar": "false",
    }
    return [x for k, v in sizes.items() for x in (f"--{k}", str(v))]


def runs(train_cli: str) -> list[Run]:
    cli = cli_sizes()
    size_note = "20 steps, 2 layers x 64, block 64, micro-batch 16, warmup 5"
    lightning = [
        "--max_iters=20",
        "--eval_interval=5",
        "--eval_iters=2",
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=64",
        "--batch_size=16",
        "--warmup_iters=2",
        "--lr_decay_iters=20",
    ]
    llama = ["--max_seq_len=64", "--num_hidden_layers=2", "--from_scratch"]
    return [
        Run(
            "nanogpt_cli plan 1",
            "examples/nanogpt",
            [
                torchrun(
                    1,
                    train_cli,
                    "-f",
                    "train_cli_args.yaml",
                    *cli,
                    "--gen_savedir",
                    "gen1",
                    "--checkpoint.save_dir",
                    "ckpt1",
                )
            ],
            size_note,
        ),
        Run(
            "nanogpt_cli plan 2",
            "examples/nanogpt",
            [
                torchrun(
                    2,
                    train_cli,
                    "-f",
                    "train_cli_args.yaml",
                    *cli,
                    "--gen_savedir",
                    "gen2",
                    "--checkpoint.save_dir",
                    "ckpt2",
                    "--compute_config.plan_ngpus",
                    "2",
                    "--compute_config.runtime_ngpus",
                    "2",
                )
            ],
            size_note + "; plan_ngpus 2 on 2 ranks",
        ),
        Run(
            "nanogpt_lightning",
            "examples/nanogpt",
            [torchrun(1, "train_nnscaler.py", "nanoGPT/config/train_shakespeare_char.py", *lightning)],
            " ".join(lightning),
            tb_dir="lightning_logs",
        ),
        Run(
            "llama3_demo 2 ranks",
            "examples/llama3_demo",
            [
                [sys.executable, "train.py", "--prepare_data", "--max_seq_len=64"],
                torchrun(2, "train.py", *llama, "--max_train_steps=6"),
            ],
            " ".join(llama) + " --max_train_steps=6",
            tb_dir="runs",
        ),
        Run(
            "llama3_demo resume",
            "examples/llama3_demo",
            [torchrun(2, "train.py", *llama, "--resume_from=last", "--max_train_steps=12")],
            "--resume_from=last --max_train_steps=12",
            tb_dir="runs",
        ),
        Run(
            "vit_cli",
            "examples/vit",
            [torchrun(1, train_cli, "-f", "train_cli_args.yaml", "--enable_progress_bar", "false")],
            "as shipped (3 epochs of the 180 synthetic training images)",
        ),
        Run(
            "compile_hf tiny Llama",
            "examples/huggingface_nlp",
            [torchrun(1, "compile_hf.py", "-m", "{assets}/tiny_llama_hf", "-d", "hf_cache", "-l", "hf_logs")],
            "-m <tiny llama> (compile + 10 train steps, as shipped)",
            shims=True,
        ),
        Run(
            "swin megatron tp 2",
            ".",
            [torchrun(2, "examples/vision/swin/train.py", "--policy", "megatron", "--tp_size", "2")],
            "--policy megatron --tp_size 2",
            shims=True,
        ),
        Run(
            "swin mesh_shard tp 2",
            ".",
            [torchrun(2, "examples/vision/swin/train.py", "--policy", "mesh_shard", "--tp_size", "2")],
            "--policy mesh_shard --tp_size 2",
            shims=True,
        ),
        Run(
            "swin 1f1b pp 2",
            ".",
            [
                torchrun(
                    2, "examples/vision/swin/train.py", "--policy", "1f1b", "--pp_size", "2", "--gbs", "8"
                )
            ],
            "--policy 1f1b --pp_size 2 --gbs 8",
            shims=True,
        ),
    ]


ADAPT_STEP = {
    "nanogpt": "nanogpt",
    "llama3": "llama3_demo",
    "vit": "vit",
    "compile_hf": "compile_hf",
    "swin": "swin",
}
CHANGE_KEY = {
    "nanogpt_cli": "nanogpt_cli",
    "nanogpt_lightning": "nanogpt_lightning",
    "llama3_demo": "llama3_demo",
    "vit_cli": "vit_cli",
    "compile_hf": "compile_hf",
    "swin": "swin",
}


def tb_losses(root: Path, since: float) -> list[float]:
    """Training-loss scalars of TensorBoard files under `root` written after `since`, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for ev in sorted(root.rglob("events.out.tfevents.*")):
        if ev.stat().st_mtime < since:
            continue
        acc = EventAccumulator(str(ev))
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            train = "train" in f"{ev.parent.name}/{tag}" and "loss" in tag
            if train and (tag.endswith("epoch") or "train_loss_step" not in tag):
                out += [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]
    return [v for _, _, v in sorted(out)]


def execute(run: Run, ex: Path, logs: Path, env: dict[str, str], timeout: int) -> None:
    cwd = ex / run.cwd
    if run.shims:
        env = dict(env, PYTHONPATH=f"{HERE / 'shims'}:{HERE.parent}:{env['PYTHONPATH']}")
        env["NNSCALER08_UPSTREAM"] = str(ex)
    log = logs / f"{re.sub(r'[^a-z0-9]+', '_', run.name.lower())}.log"
    t0 = time.time()
    text = ""
    run.status = "ok"
    for cmd in run.commands:
        cmd = [c.replace("{assets}", str(ex.parent / "assets")) for c in cmd]
        try:
            res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            text = res.stdout + res.stderr
            failed = res.returncode != 0
        except subprocess.TimeoutExpired as err:
            text = f"{err.stdout or ''}{err.stderr or ''}\nTIMEOUT after {timeout}s"
            failed = True
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{text}\n")
        if failed:
            run.status = "FAILED: " + last_error(text)
            break
    run.seconds = time.time() - t0
    if run.tb_dir:
        run.losses = tb_losses(cwd / run.tb_dir, t0) if (cwd / run.tb_dir).exists() else []
    else:
        run.losses = [float(m.group(1)) for m in map(LOSS_LINE.search, text.splitlines()) if m]


def last_error(text: str) -> str:
    """The last line that names an exception (what a reader of the table needs first)."""
    lines = [
        ln.strip()
        for ln in text.splitlines()
        if re.search(r"(Error|Exception)\b.*:|error:", ln) and "ChildFailedError" not in ln
    ]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "?")[:300]


def table(rows: list[Run], changes: dict[str, list[str]]) -> str:
    out = ["| example | changes | loss first -> last | time | status |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        key = next((v for k, v in CHANGE_KEY.items() if r.name.startswith(k)), r.name)
        what = "; ".join(changes.get(key, []) + ([f"run: {r.args}"] if r.args else []))
        loss = f"{r.losses[0]:.4f} -> {r.losses[-1]:.4f} ({len(r.losses)} values)" if r.losses else "-"
        out.append(f"| {r.name} | {what} | {loss} | {r.seconds:.0f} s | {r.status} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", type=Path, required=True)
    ap.add_argument("--nanogpt", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--only", default="", help="comma-separated name prefixes of the rows to run")
    ap.add_argument("--timeout", type=int, default=900)
    opts = ap.parse_args()
    adapter = Adapter(opts.upstream, opts.nanogpt, opts.work)
    adapter.fresh_copy()
    for step in ADAPT_STEP.values():
        getattr(adapter, step)()
    env = dict(os.environ)
    paths = [str(adapter.ex), str(HERE), *filter(None, opts.pythonpath.split(":"))]
    env["PYTHONPATH"] = ":".join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    train_cli = shutil.which("nnscaler-train") or "nnscaler-train"
    logs = opts.work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    wanted = [w.strip() for w in opts.only.split(",") if w.strip()]
    rows = [r for r in runs(train_cli) if not wanted or any(r.name.startswith(w) for w in wanted)]
    for r in rows:
        print(f"== {r.name}", flush=True)
        execute(r, adapter.ex, logs, env, opts.timeout)
        print(f"   {r.status}; {len(r.losses)} losses; {r.seconds:.0f} s", flush=True)
    text = table(rows, adapter.changes)
    (opts.work / "table.md").write_text(text + "\n")
    print(text)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
