"""Bytes expert parallelism sends through all-to-all per MoE layer, against the minimum.

Four gloo processes (spawned here, FileStore rendezvous) compile a tiny Mixtral (transformers'
MixtralConfig: 8 experts, top-2) with the `tp` policy and `pas_config={"ep_size": ep}` for ep 2
(ComputeConfig(2, 4): two data-parallel replicas of an ep-2 plan) and ep 4 (ComputeConfig(4, 4)),
run one forward and backward, and count every `torch.distributed.all_to_all_single` call of each
rank (`AllToAllCounter` wraps it; nnscaler/runtime/moe/dispatch.py calls it). Prints JSON.

What is counted, per rank, MoE layer and direction (forward, backward):
- `payload_bytes`: the whole send buffer of the hidden-state all-to-alls (dispatch and combine), rows
  addressed to the rank itself included (the collective copies them locally), as the formula counts;
- `off_rank_bytes`: the part of it addressed to other ranks (what crosses a link);
- `count_bytes`: the small int64 exchange of per-expert counts (forward only; backward reuses them).

The minimum: every (token, slot) assignment's hidden row must reach its expert and its output come
back, so over the ep group each direction moves 2 x tokens x top_k x hidden x dtype bytes, i.e. per
rank on average `minimum = 2 x tokens_per_rank x top_k x hidden x dtype_bytes` (the issue's formula).
A single rank sends its own T x k assignments plus the outputs of the R_r assignments its experts
received (`exact_minimum = (T x k + R_r) x hidden x dtype_bytes`): equal to `minimum` when routing is
balanced, and the mean over the ranks of `exact_minimum` is `minimum` for any routing. In backward the
gradients retrace the same rows (combine's backward sends T x k, dispatch's R_r). A token with two of
its k experts on one rank is sent once per assignment, as the formula counts; `dedup_bytes` says what
sending it once per destination rank would take (not done: the formula's minimum is the target here).

    python benchmarks/moe_alltoall_bytes.py [--hidden 128 --seq 64 --seqs-per-rank 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["AllToAllCall", "AllToAllCounter", "layer_bytes", "build_mixtral"]


@dataclass(frozen=True)
class AllToAllCall:
    """One `all_to_all_single` call of this rank."""

    phase: str
    """'forward' or 'backward' (set by the caller on the counter)."""
    kind: str
    """'payload' (floating rows) or 'counts' (the integer count exchange)."""
    sent_bytes: int
    """The whole send buffer, rows to this rank included."""
    off_rank_bytes: int
    """The rows addressed to other ranks."""
    rows_sent: int
    rows_received: int
    row_bytes: int


@dataclass
class AllToAllCounter:
    """Inside `with counter:`, every `torch.distributed.all_to_all_single` call is recorded (and run)."""

    phase: str = "forward"
    calls: list[AllToAllCall] = field(default_factory=list)
    _inner: Any = None

    def __enter__(self) -> AllToAllCounter:
        self._inner = dist.all_to_all_single
        signature = inspect.signature(self._inner)

        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self._record(bound.arguments)
            return self._inner(*args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._inner

    def _record(self, a: dict[str, Any]) -> None:
        x, out, group = a["input"], a["output"], a["group"]
        n, me = dist.get_world_size(group), dist.get_rank(group)
        send = a["input_split_sizes"] or [x.shape[0] // n] * n
        recv = a["output_split_sizes"] or [out.shape[0] // n] * n
        rows = max(x.shape[0], 1)
        row_bytes = x.numel() // rows * x.element_size() if x.shape[0] else 0
        kind = "payload" if x.is_floating_point() else "counts"
        sent = x.numel() * x.element_size()
        self.calls.append(
            AllToAllCall(self.phase, kind, sent, sent - send[me] * row_bytes, sum(send), sum(recv), row_bytes)
        )


def layer_bytes(calls: list[AllToAllCall], layers: int) -> list[dict[str, dict[str, int]]]:
    """Per MoE layer (program order), per direction: payload, off-rank and count bytes, rows received by
    this rank's experts (R_r). Forward calls come as (counts, dispatch, combine) per layer; backward as
    (combine's backward, dispatch's backward) per layer in reverse; anything else raises."""
    fwd = [c for c in calls if c.phase == "forward"]
    bwd = [c for c in calls if c.phase == "backward"]
    if [c.kind for c in fwd] != ["counts", "payload", "payload"] * layers or len(bwd) != 2 * layers:
        raise RuntimeError(
            f"expected {layers} MoE layers of (counts, dispatch, combine) all-to-alls in forward and "
            f"2 each in backward; got forward {[c.kind for c in fwd]}, backward {[c.kind for c in bwd]}"
        )
    out = []
    for i in range(layers):
        counts, dispatch, combine = fwd[3 * i : 3 * i + 3]
        back = bwd[2 * (layers - 1 - i) : 2 * (layers - i)]
        out.append(
            {
                "forward": {
                    "payload_bytes": dispatch.sent_bytes + combine.sent_bytes,
                    "off_rank_bytes": dispatch.off_rank_bytes + combine.off_rank_bytes,
                    "count_bytes": counts.sent_bytes,
                    "received_rows": dispatch.rows_received,
                },
                "backward": {
                    "payload_bytes": sum(c.sent_bytes for c in back),
                    "off_rank_bytes": sum(c.off_rank_bytes for c in back),
                    "count_bytes": 0,
                    "received_rows": dispatch.rows_received,
                },
            }
        )
    return out


def dedup_rows(top_k_index: torch.Tensor, local_experts: int) -> int:
    """Rows a rank would dispatch sending each token once per destination rank of its experts."""
    dest = top_k_index // local_experts
    return sum(len(set(row.tolist())) for row in dest)


def build_mixtral(args: argparse.Namespace, seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).float().train()


def _batch(args: argparse.Namespace, size: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, args.vocab, (size, args.seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _measure(rank: int, world: int, ep: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Compile with ep, run one counted forward + backward; this rank's per-layer figures."""
    import nnscaler
    from nnscaler import ComputeConfig
    from nnscaler.runtime.moe import routing_log

    size = ep * args.seqs_per_rank  # per replica: every rank of the plan gets seqs_per_rank sequences
    cfg = ComputeConfig(ep, world, pas_config={"ep_size": ep})
    model = build_mixtral(args)
    pm = nnscaler.parallelize(
        model, _batch(args, size, 0), "tp", cfg, gen_savedir=os.path.join(tmp, "gen"), instance_name=f"ep{ep}"
    )
    batch = _batch(args, size, 1 + rank // ep)
    routing_log.calls = []
    with AllToAllCounter() as counter:
        loss = pm(**batch).loss
        counter.phase = "backward"
        loss.backward()
    routing, routing_log.calls = routing_log.calls, None
    layers = layer_bytes(counter.calls, args.layers)
    local = args.experts // ep
    for per_layer, index in zip(layers, routing):
        per_layer["tokens"] = int(index.shape[0])
        per_layer["dedup_rows"] = dedup_rows(index, local)
    return {"rank": rank, "layers": layers}


def _summary(ranks: list[dict[str, Any]], ep: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Per direction: the mean over MoE layers and ranks against the minimum; whether every rank's every
    layer sent exactly its own minimum; each rank's payload per layer."""
    dtype_bytes, k, h = 4, args.top_k, args.hidden
    tokens = ranks[0]["layers"][0]["tokens"]
    minimum = 2 * tokens * k * h * dtype_bytes
    out: dict[str, Any] = {
        "ep": ep,
        "compute_config": f"ComputeConfig({ep}, {world})",
        "tokens_per_rank": tokens,
        "moe_layers": args.layers,
        "minimum_bytes": minimum,
        "formula": "2 x tokens_per_rank x top_k x hidden x dtype_bytes, per rank, MoE layer and direction",
    }
    cells = [(r, layer) for r in ranks for layer in r["layers"]]
    for phase in ("forward", "backward"):
        payload = sum(layer[phase]["payload_bytes"] for _, layer in cells) / len(cells)
        exact = [
            (layer["tokens"] * k + layer[phase]["received_rows"]) * h * dtype_bytes for _, layer in cells
        ]
        out[phase] = {
            "payload_bytes_mean": payload,
            "ratio_to_minimum": round(payload / minimum, 4),
            "off_rank_bytes_mean": sum(layer[phase]["off_rank_bytes"] for _, layer in cells) / len(cells),
            "count_bytes_mean": sum(layer[phase]["count_bytes"] for _, layer in cells) / len(cells),
            "every_rank_equals_exact_minimum": all(
                layer[phase]["payload_bytes"] == e for (_, layer), e in zip(cells, exact)
            ),
            "per_rank_payload_bytes": [
                [layer[phase]["payload_bytes"] for layer in r["layers"]] for r in ranks
            ],
        }
    dedup = sum(layer["dedup_rows"] for _, layer in cells) / len(cells)
    out["dedup_dispatch_bytes"] = dedup * h * dtype_bytes
    out["dispatch_bytes"] = tokens * k * h * dtype_bytes
    return out


def worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    import nnscaler

    nnscaler.init()
    results = []
    for ep in args.ep:
        mine = _measure(rank, world, ep, args, tmp)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        results.append(_summary(everyone, ep, world, args))
    if rank == 0:
        report = {
            "benchmark": "MoE all-to-all bytes per rank and MoE layer vs the minimum (expert parallelism)",
            "model": f"Mixtral {args.layers} layers, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}",
            "dtype": "float32",
            "processes": world,
            "backend": "gloo (CPU)",
            "results": results,
        }
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seqs-per-rank", type=int, default=2)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, tmp, args), nprocs=world, start_method="spawn")
        with open(os.path.join(tmp, "result.json")) as f:
            print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
