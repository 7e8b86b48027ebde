"""The analytic cost model beside published training runs (issue 42: held-aside median error <= 10%,
worst <= 20%).

Every row of benchmarks/published_runs.yaml: the model is built on the meta device at full size and
captured once per (architecture, sequence) at batch 2; the PUBLISHED layout is pinned and costed with
the planner's own model (evaluate_nodes: the tp policy's Megatron splits over the row's tp degree,
balanced pipeline stages of whole decoder layers, dp replicas with the row's ZeRO stage, micro-batch
size through batch_scale, its micro-batch count, every decoder layer recomputed under `full`, halfway
under `selective_op`, Llama 3's interleaved schedule with pp x vpp stages); the
predicted step time is turned into the row's published figure with the source's FLOPs convention.

Prints one JSON line per row (predicted, published, ratio = predicted / published, memory per GPU and
whether it fits the device), then one summary line per split: median and worst |ratio - 1|.

    python benchmarks/cost_model_vs_published.py [--rows id,id] [--split held_aside]

No GPU is used.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.plan_quality import _lm, _tokens  # noqa: E402
from benchmarks.published_runs import PublishedRun, load_rows  # noqa: E402
from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.graph.capture import capture  # noqa: E402
from nnscaler.policies.autodist import load_cluster, planner_setup  # noqa: E402
from nnscaler.policies.autodist.context import stage_context, transient_bytes  # noqa: E402
from nnscaler.policies.autodist.devices import DEVICES  # noqa: E402
from nnscaler.policies.autodist.evaluate import evaluate_nodes  # noqa: E402
from nnscaler.policies.autodist.layers import layer_instances  # noqa: E402
from nnscaler.policies.stage_balance import balanced_starts  # noqa: E402
from nnscaler.policies.tp import pas_tp  # noqa: E402

CAPTURE_BATCH = 2
"""Sequences in the captured batch (the row's micro-batch is reached through batch_scale)."""


def build_model(run: PublishedRun):
    """The row's model on the meta device and its inputs (CAPTURE_BATCH sequences)."""
    m = run.model
    if m["family"] == "gpt2":
        model = _lm(
            "GPT2Config",
            "GPT2LMHeadModel",
            vocab_size=m["vocab"],
            n_embd=m["hidden"],
            n_layer=m["layers"],
            n_head=m["heads"],
            n_inner=m["ffn"],
            n_positions=run.seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            # the published runs fuse GELU and attention (Megatron's fused bias-GELU, flash attention):
            # one GELU op and torch's fused attention keep what those kernels keep, where GPT-2's
            # tanh-approximated GELU traces into six elementwise ops that each save a tensor
            activation_function="gelu",
            attn_implementation="sdpa",
        )
    elif m["family"] == "llama":
        model = _lm(
            "LlamaConfig",
            "LlamaForCausalLM",
            vocab_size=m["vocab"],
            hidden_size=m["hidden"],
            intermediate_size=m["ffn"],
            num_hidden_layers=m["layers"],
            num_attention_heads=m["heads"],
            num_key_value_heads=m["kv_heads"],
            max_position_embeddings=run.seq,
            tie_word_embeddings=False,
            attention_dropout=0.0,
            attn_implementation="sdpa",
        )
    else:
        raise ValueError(f"row {run.id}: unknown model family {m['family']!r} (gpt2, llama)")
    return model, _tokens(CAPTURE_BATCH, run.seq)


class Captures:
    """One captured graph (and parameter count) per (architecture, sequence), reused across rows."""

    def __init__(self):
        self._graphs: dict[tuple, tuple] = {}

    def get(self, run: PublishedRun):
        key = run.model_key
        if key not in self._graphs:
            model, inputs = build_model(run)
            params = sum(p.numel() for p in model.parameters())
            graph = capture(
                model, inputs, both_modes=False, static_shapes=True
            )  # costing needs no open sizes
            self._graphs[key] = (graph, params)
        return self._graphs[key]


def cluster_of(run: PublishedRun, device_overrides: dict | None = None):
    """The row's cluster: device kind with its caps and changed figures, nodes, links."""
    hw = run.hardware
    device = {"name": hw["device"]}
    for key in ("power_w", "clock_mhz", "memory_gb", "mem_bw_gbs"):
        if key in hw:
            device[key] = hw[key]
    device.update(device_overrides or {})
    return load_cluster(
        {
            "name": run.id,
            "device": device,
            "nodes": hw["nodes"],
            "devices_per_node": hw["devices_per_node"],
            "intra_node": {"bandwidth_gbs": hw["intra_gbs"], "latency_us": 3},
            "inter_node": {"bandwidth_gbs": hw["inter_gbs"], "latency_us": 6},
        }
    )


def _scheduler_supported() -> bool:
    return "scheduler" in inspect.signature(evaluate_nodes).parameters


def cost_row(run: PublishedRun, graph, device_overrides: dict | None = None, overlap=None):
    """(Candidate, setup, transient bytes) of the row's published layout (`overlap`: an OverlapModel in
    place of the planner's default, for what-if runs)."""
    lay = run.layout
    tp, pp = lay["tp"], lay["pp"]
    cluster = cluster_of(run, device_overrides)
    cfg = ComputeConfig(
        tp * pp,
        run.hardware["gpus"],
        use_end2end=pp > 1,
        pas_config={"use_bf16": run.precision == "bf16", "zero_stage": lay["zero"], "tp_mesh": "off"},
    )
    setup = planner_setup(graph, cfg, cluster=cluster)
    setup = replace(
        setup,
        batch_scale=lay["micro_batch"] / setup.traced_batch,
        nmicros=run.nmicros,
        mem_limit=cluster.device.memory_gb * 1e9,
    )
    if overlap is not None:
        setup = replace(setup, overlap=overlap)
    _, instances = layer_instances(graph, setup.pivots)
    layers = tuple(path for path, _ in instances)
    nodes = pas_tp(graph, ComputeConfig(tp, tp)).nodes if tp > 1 else {}
    kwargs = {}
    if pp > 1:
        interleaved = lay["scheduler"] == "1f1b_interleaved" and lay["vpp"] > 1 and _scheduler_supported()
        nstages = pp * lay["vpp"] if interleaved else pp
        firsts = [idx[0] for _, idx in instances]
        if lay.get("edge_chunks") and nstages == len(firsts) + 2:
            # the embedding and the output head each a stage of their own, one layer per stage between
            # (Llama 3: "the first model chunk on the first stage has only the embedding, and the last
            # model chunk on the last stage has only output projection and loss calculation")
            kwargs["starts"] = [0, *firsts, instances[-1][1][-1] + 1]
        else:
            kwargs["starts"] = balanced_starts(graph, firsts[1:], nstages)
        if interleaved:
            kwargs["scheduler"] = "1f1b_interleaved"
    recompute = layers if lay["recompute"] in ("full", "selective_op") else ()
    cand = evaluate_nodes(graph, setup, nodes, pp=pp, nmicros=run.nmicros, recompute=recompute, **kwargs)
    if lay["recompute"] == "selective_op":  # half the forward recomputed: halfway between none and full
        none = evaluate_nodes(graph, setup, nodes, pp=pp, nmicros=run.nmicros, **kwargs)
        cand = replace(
            cand,
            step_time=(cand.step_time + none.step_time) / 2,
            memory=(cand.memory + none.memory) / 2,
        )
    transient = transient_bytes(graph, stage_context(setup, tp, pp > 1), setup)
    return cand, setup, transient


def predicted_figure(run: PublishedRun, step: float, params: int) -> float:
    """The row's published metric from a predicted step time (the source's FLOPs convention)."""
    m, lay, kind = run.model, run.layout, run.published["kind"]
    gpus, batch, s = run.hardware["gpus"], lay["global_batch"], run.seq
    h, layers, vocab = m["hidden"], m["layers"], m["vocab"]
    peak = DEVICES[run.hardware["device"]].bf16_tflops * 1e12  # the datasheet peak MFU is quoted against
    if kind == "tokens_per_s_per_gpu":
        return batch * s / (step * gpus)
    if kind == "step_s":
        return step
    if kind == "tflops_per_gpu_hw":
        flops = 96 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))
        return flops / (step * gpus) / 1e12
    if kind == "mfu_megatron":
        flops = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
        return flops / (step * gpus * peak)
    if kind == "mfu_6n":
        flops = (6 * params + 12 * layers * h * s) * batch * s
        return flops / (step * gpus * peak)
    raise ValueError(f"row {run.id}: unknown published kind {kind!r}")


def run_row(
    run: PublishedRun, captures: Captures, device_overrides: dict | None = None, overlap=None
) -> dict:
    """One row's JSON object."""
    graph, params = captures.get(run)
    cand, setup, transient = cost_row(run, graph, device_overrides, overlap)
    predicted = predicted_figure(run, cand.step_time, params)
    published = run.published["value"]
    memory = cand.memory + transient
    return {
        "row": run.id,
        "split": run.split,
        "kind": run.published["kind"],
        "predicted": round(predicted, 4 if predicted < 10 else 1),
        "published": published,
        "ratio": round(predicted / published, 3),
        "step_s": round(cand.step_time, 4),
        "memory_gb": round(memory / 1e9, 1),
        "fits": memory <= setup.mem_limit,
    }


def summary(rows: list[dict]) -> list[dict]:
    """Median and worst |ratio - 1| per split."""
    out = []
    for split in ("calibrate", "held_aside"):
        errs = [abs(r["ratio"] - 1) for r in rows if r.get("split") == split and "ratio" in r]
        if errs:
            out.append(
                {
                    "summary": split,
                    "rows": len(errs),
                    "median_error": round(statistics.median(errs), 3),
                    "worst_error": round(max(errs), 3),
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--split", default="", help="calibrate or held_aside (default: both)")
    ap.add_argument("--overlap-intra", type=float, default=None, help="what-if: OverlapModel.intra_node")
    ap.add_argument("--overlap-inter", type=float, default=None, help="what-if: OverlapModel.inter_node")
    args = ap.parse_args()
    overlap = None
    if args.overlap_intra is not None or args.overlap_inter is not None:
        from nnscaler.policies.autodist.overlap import OverlapModel

        base = OverlapModel()
        overlap = replace(
            base,
            intra_node=base.intra_node if args.overlap_intra is None else args.overlap_intra,
            inter_node=base.inter_node if args.overlap_inter is None else args.overlap_inter,
        )
    runs = load_rows(split=args.split or None)
    if args.rows:
        wanted = args.rows.split(",")
        runs = [r for r in runs if r.id in wanted]
    runs.sort(key=lambda r: r.model_key)  # captures are reused in order
    captures, rows, t0 = Captures(), [], time.perf_counter()
    for run in runs:
        try:
            row = run_row(run, captures, overlap=overlap)
        except Exception as exc:  # a row that cannot be costed is reported, not hidden
            row = {"row": run.id, "split": run.split, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for line in summary(rows):
        print(json.dumps(line), flush=True)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
