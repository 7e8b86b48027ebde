"""Run nnScaler 0.8's policies (up_policies, up_gallery) as custom pas_policy functions against the
single-device model and print a table. Started by run_policies.sh (not by CI)."""

from __future__ import annotations

import os
import shutil
import sys
import time
import traceback
from pathlib import Path

E2E = {"use_end2end": True, "pas_config": {"pipeline_nstages": 2, "pipeline_nmicros": 2}}
CASES = [
    # (policy, model, plan_ngpus, ComputeConfig kwargs, micro-batches)
    ("up_policies.pas_dp", "mlp", 1, {}, None),
    ("up_policies.pas_tp", "mlp", 2, {}, None),
    ("up_policies.pas_tp", "gpt", 2, {}, None),
    ("up_policies.pas_data", "mlp", 2, {}, None),
    ("up_policies.pas_data", "gpt", 2, {}, None),
    ("up_policies.pas_pp", "gpt", 2, E2E, 2),
    ("up_policies.pas_hybrid", "gpt", 2, E2E, 2),
    ("up_policies.pas_tp", "llama", 2, {}, None),
    ("up_policies.pas_data", "llama", 2, {}, None),
    ("up_policies.pas_hybrid", "llama", 2, E2E, 2),
    ("up_gallery.swin_megatron", "swin_tiny", 2, {}, None),
    ("up_gallery.swin_mesh_shard", "swin_tiny", 2, {}, None),
    ("up_gallery.swin_1f1b", "swin_tiny", 2, E2E, 2),
]


def _run(work: Path, k: int, case) -> tuple[str, str, float]:
    from tests.parity import run_parity

    policy, model, plan_ngpus, kwargs, nmicros = case
    if policy.startswith("up_gallery."):  # a function object: unpickling it imports up_gallery (the model)
        import up_gallery

        policy = getattr(up_gallery, policy.split(".")[1])
    shutil.rmtree(work / f"case{k}", ignore_errors=True)  # a fresh compile every run
    start = time.monotonic()
    try:
        results = run_parity(
            model,
            policy,
            plan_ngpus,
            2,
            steps=3,
            tmp_path=work / f"case{k}",
            optimizer="sgd",
            config_kwargs=kwargs,
            nmicros=nmicros,
        )
        losses = results[0]["losses"]
        return "parity ok", f"{losses[0]:.4f} -> {losses[-1]:.4f}", time.monotonic() - start
    except Exception as exc:  # a row of the table, not the end of the run
        text = str(exc).strip().splitlines()
        last = next((ln for ln in reversed(text) if "Error" in ln), text[-1] if text else repr(exc))
        (work / f"case{k}.log").write_text(traceback.format_exc())
        return "FAILED: " + last.strip()[:160], "", time.monotonic() - start


def main(work: str) -> None:
    work_dir = Path(work)
    os.environ["NNSCALER08_UPSTREAM"] = str(work_dir / "upstream")
    rows = []
    for k, case in enumerate(CASES):
        result, losses, seconds = _run(work_dir, k, case)
        rows.append(
            (
                case[0],
                case[1],
                f"plan {case[2]}, 2 ranks" + (", end2end" if case[3] else ""),
                result,
                losses,
                seconds,
            )
        )
        print(f"[{k + 1}/{len(CASES)}] {case[0]} on {case[1]}: {result} ({seconds:.0f} s)", flush=True)
    print("\n| policy | model | run | result | loss first -> last (rank 0) | time |")
    print("|---|---|---|---|---|---|")
    for policy, model, run, result, losses, seconds in rows:
        print(f"| {policy} | {model} | {run} | {result} | {losses} | {seconds:.0f} s |")
    print(f"\nfailure tracebacks: {work_dir}/case<k>.log")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/nns08_policies")
