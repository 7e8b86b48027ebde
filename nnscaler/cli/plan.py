"""The planning command, `python -m nnscaler.plan`: plan a model for a described cluster and print
the report, without compiling code (offline planning for a cluster you do not have).

    python -m nnscaler.plan --model tests.zoo.build_llama --cluster h100x8
    python -m nnscaler.plan --hf-config llama70b.json --seq 8192 --cluster h100x64_ib --bf16
    python -m nnscaler.plan --model tests.zoo.build_gpt --cluster h100x8 --at idx_size0=16,targets_size0=16
    python -m nnscaler.plan --model tests.zoo.build_llama --cluster h100x8 --mesh 2x4

`--model` and `--hf-config` are read by `nnscaler.cli.model_builder`.
"""

from __future__ import annotations

import argparse
import math
import sys

from nnscaler.atomic_files import write_atomic
from nnscaler.cli.model_builder import build_model
from nnscaler.cli.plan_checks import (
    EXIT_USAGE,
    FlagError,
    FlagParser,
    check_cluster_fit,
    check_flags,
    parse_mesh,
    parse_sizes,
)
from nnscaler.errors import ConfigError, PlanError
from nnscaler.graph.capture import capture

__all__ = ["main"]


def _at_sizes(graph, result, specs: list[str]) -> str:
    """The chosen plan re-costed at other input sizes (symbolic shapes, no new trace)."""
    from dataclasses import replace

    from nnscaler.policies.autodist.cost import traced_batch_size
    from nnscaler.policies.autodist.cp_search import evaluate_any_plan
    from nnscaler.policies.autodist.symbolic import flops_expr, graph_at_sizes

    lines = [f"\nForward FLOPs of one call: {flops_expr(graph)}\n"]
    for spec in specs:
        resized = graph_at_sizes(graph, parse_sizes(spec))
        setup = replace(result.setup, traced_batch=traced_batch_size(resized))
        cand = evaluate_any_plan(resized, setup, result.plan)
        fits = "fits" if cand.memory <= setup.mem_limit else "does NOT fit"
        lines.append(
            f"At {spec}: predicted step {cand.step_time * 1e3:.3f} ms, {cand.memory / 1e9:.3f} GB on the "
            f"fullest device ({fits} in {setup.mem_limit / 1e9:.1f} GB)\n"
        )
    return "".join(lines)


def _mesh_line(result) -> str:
    """Which mesh the plan's 2-D splits use, and what the search tried."""
    tried = result.best.spmd.stats.get("meshes") or {}
    costs = ", ".join(
        f"{m} {'infeasible' if t is None else t if isinstance(t, str) else f'{t / 1e3:.3f} ms'}"
        for m, t in tried.items()
    )
    chosen = "x".join(map(str, result.plan.mesh)) if result.plan.mesh else "none (1-D splits only)"
    return f"\nMesh of each stage's devices: {chosen}" + (f" (searched: {costs})" if costs else "") + "\n"


def _parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m nnscaler.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="dotted builder, e.g. tests.zoo.build_llama")
    p.add_argument("--hf-config", help="a transformers config.json (built on the meta device)")
    p.add_argument("--cluster", default="cpu_gloo", help="cluster YAML or shipped example name")
    p.add_argument("--devices", type=int, help="devices to plan for (default: all of the cluster)")
    p.add_argument("--plan-ngpus", type=int, help="fix the plan size (default: searched)")
    p.add_argument("--max-plan-ngpus", type=int, help="largest plan size to try")
    p.add_argument("--batch", type=int, default=4, help="global batch of one micro-step")
    p.add_argument("--seq", type=int, help="sequence length (with --hf-config; default 2048)")
    p.add_argument("--nmicros", type=int, help="micro-batches per step (default: searched)")
    p.add_argument("--no-pipeline", action="store_true", help="do not consider pipeline stages")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage to assume (default: searched)")
    p.add_argument("--bf16", action="store_true", help="cost as bf16 training")
    p.add_argument("--mem", type=float, help="GB per device a plan may use")
    p.add_argument("--recompute", help="recompute_modules")
    p.add_argument("--save-plan", help="write the plan JSON here")
    p.add_argument("--out", help="write the report here as well as printing it")
    p.add_argument(
        "--at",
        action="append",
        default=[],
        metavar="NAME=SIZE,...",
        help="also cost the chosen plan at these input sizes without tracing again (repeatable); "
        "the size names are printed with the model's FLOPs",
    )
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        metavar="AxB[xC]",
        help="pin the mesh of a stage's devices (pas_config['tp_mesh']; the plan size defaults to the "
        "product of the axes); "
        "default: searched",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Plan and print; 0 on success, 2 (one line on stderr naming the flag) for a refused value."""
    from nnscaler.policies.autodist import load_cluster

    p = _parser()
    args = p.parse_args(argv)
    try:
        check_flags(args)
        try:
            cluster = load_cluster(args.cluster)
        except ConfigError as err:
            raise FlagError("--cluster", args.cluster, str(err)) from None
        check_cluster_fit(args, cluster.ndevices)
        return _plan(args, cluster)
    except (ConfigError, PlanError) as err:  # a refused flag, or no plan: one message, no traceback
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _plan(args: argparse.Namespace, cluster) -> int:
    from nnscaler.policies.autodist.offline import plan_offline
    from nnscaler.policies.autodist.plan_files import save_plan
    from nnscaler.policies.autodist.report import plan_report
    from nnscaler.policies.autodist.symbolic import graph_at_sizes

    module, inputs = build_model(args.model, args.hf_config, args.batch, args.seq or 2048)
    # planning costs the module's own mode at the traced sizes: sizes stay open only for --at (costed
    # at other sizes) and --save-plan (its node names must be the compile's, traced with sizes open);
    # a fixed-size trace is 2x faster (Llama-3-405B: 15 s, against 30 s of budget then 15 s)
    open_sizes = bool(args.at or args.save_plan)
    graph = capture(module, inputs, static_shapes=not open_sizes, both_modes=False)
    for spec in args.at:  # the size names are known now: refuse an unknown one before the search
        try:
            graph_at_sizes(graph, parse_sizes(spec))
        except PlanError as err:
            raise FlagError("--at", repr(spec), str(err)) from None
    pas = {
        "pipeline_nmicros": args.nmicros,
        "zero_stage": args.zero,
        "use_bf16": args.bf16,
        "mem_constraint": args.mem,
    }
    if args.no_pipeline:
        pas["pipeline_nstages"] = 1
    if args.recompute:
        pas["recompute_modules"] = args.recompute
    if args.mesh:
        pas["tp_mesh"] = args.mesh
    pas = {k: v for k, v in pas.items() if v is not None and v is not False}  # --zero 0 stays
    result = plan_offline(
        graph,
        cluster,
        args.devices,
        plan_ngpus=args.plan_ngpus or (math.prod(args.mesh) if args.mesh else None),
        end2end=not args.no_pipeline,
        pas_config=pas,
        max_plan_ngpus=args.max_plan_ngpus,
    )
    text = plan_report(graph, result.plan, result.setup, result.scored)
    text += _mesh_line(result)
    text += f"\nPlanned in {result.seconds:.1f} s ({len(graph.nodes)} traced ops).\n"
    if args.at:
        text += _at_sizes(graph, result, args.at)
    print(text, end="")
    if args.out:
        write_atomic(args.out, text)
    if args.save_plan:
        save_plan(
            result.plan,
            args.save_plan,
            {"config": result.best.label(), "step_seconds": result.best.step_time},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
