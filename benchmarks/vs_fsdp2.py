"""Step time and memory of nnscaler's ZeRO stage 3 against torch FSDP2 (`fully_shard`).

Two gloo processes (spawned here, FileStore rendezvous) train the same ~20M-parameter nanoGPT with
AdamW on the same batches: once compiled with `nnscaler.parallelize(model, dummy, 'dp',
ComputeConfig(1, 2, use_zero=True, zero_stage=3))` and `nnscaler.build_optimizer`, once with
`torch.distributed.fsdp.fully_shard` applied to every transformer block and then to the root.

Timing: both systems live in the same two processes and run alternating rounds (common.py). Memory:
each system again alone in two fresh processes, started with glibc's mmap threshold fixed at 64 KiB
(so freed tensors go back to the OS and RSS follows the live bytes), measures
- `state_bytes`: bytes per rank held by parameters, gradients and optimizer state after a step
  (counted from the tensors: shards, gradient slices, AdamW moments; distinct storages);
- `peak_rss_delta_bytes`: the process's peak resident memory during the measured steps (VmHWM, reset
  through /proc/self/clear_refs after warm-up) minus its resident memory before the model was built:
  parameters, gradients, optimizer state, gathered parameters, activations and communication buffers
  together, as the OS sees them (imports happen before the baseline, the same for both systems).
Prints JSON: median step times and their ratio (target nnscaler / FSDP2 <= 1.0), and both memory
figures with their ratios (target <= 1.0).

    python benchmarks/vs_fsdp2.py [--steps 10] [--layers 6 --embd 512 --vocab 8192 --block 128]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_model_args,
    batch,
    build_gpt,
    load_note,
    nparams,
    summarize,
    time_alternating,
)

SYSTEMS = ("nnscaler", "fsdp2")


def _init(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)


def build_fsdp2(model: torch.nn.Module, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _config(world: int) -> Any:
    from nnscaler import ComputeConfig

    return ComputeConfig(1, world, use_zero=True, zero_stage=3)


def build_nnscaler(
    model: torch.nn.Module, data: dict[str, torch.Tensor], world: int, gen_savedir: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import nnscaler
    from nnscaler.runtime.grads.zero3 import Zero3Reducer

    pm = nnscaler.parallelize(model, data, "dp", _config(world), gen_savedir=gen_savedir)
    opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    assert isinstance(pm.reducer, Zero3Reducer), type(pm.reducer)
    return pm, opt


def stepper(module: torch.nn.Module, opt: torch.optim.Optimizer, data: dict[str, torch.Tensor], losses: list):
    def step() -> None:
        loss = module(**data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return step


# ---- timing ------------------------------------------------------------------------------------------


def time_worker(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    _init(rank, world, tmp, args)
    model = build_gpt(args)
    data = batch(args, seed=1000 + rank)
    fsdp, fsdp_opt = build_fsdp2(copy.deepcopy(model), world)
    pm, nn_opt = build_nnscaler(model, data, world, os.path.join(tmp, "gen"))
    n = nparams(model)
    del model
    losses: dict[str, list[float]] = {"nnscaler": [], "fsdp2": []}
    times = time_alternating(
        {
            "nnscaler": stepper(pm, nn_opt, data, losses["nnscaler"]),
            "fsdp2": stepper(fsdp, fsdp_opt, data, losses["fsdp2"]),
        },
        args.warmup,
        args.steps,
        args.rounds,
        barrier=dist.barrier,
    )
    if rank == 0:
        result = {
            "benchmark": "nnscaler dp + ZeRO-3 vs torch FSDP2 (fully_shard per block + root)",
            "model": f"nanoGPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, block {args.block}",
            "params": n,
            "processes": world,
            "backend": "gloo (CPU)",
            "threads_per_process": args.threads,
            "batch_per_rank": args.batch,
            "optimizer": "AdamW(lr=1e-4)",
            **summarize(times, "nnscaler", "fsdp2"),
            "target": 1.0,
            # the same weights and batches: the first step's losses agree (rounding aside)
            "first_loss_equal": abs(losses["nnscaler"][0] - losses["fsdp2"][0]) < 1e-4,
            "machine": load_note(),
        }
        with open(os.path.join(tmp, "time.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- memory ------------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _storage_bytes(tensors: list[Any]) -> int:
    storages: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def state_bytes(system: str, module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (after a step)."""
    inner = getattr(opt, "inner", opt)
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    params = list(module.parameters())
    if system.startswith("nnscaler"):
        red = module.reducer
        flats = [f.shard for f in red.flats]
        grads = [b.shard_grads for b in red.buckets] + [b.grads for b in red.buckets]
        grads += [b._scatter_out for b in red.buckets]
        out = {"params": _storage_bytes(params + flats), "grads": _storage_bytes(grads)}
    else:
        out = {"params": _storage_bytes(params), "grads": _storage_bytes([p.grad for p in params])}
    out["optimizer_state"] = _storage_bytes(state)
    out["total"] = sum(out.values())
    return out


def memory_worker(
    rank: int, world: int, tmp: str, args: argparse.Namespace, system: str, gen_savedir: str
) -> None:
    _init(rank, world, tmp, args)
    import torch.distributed.fsdp  # noqa: F401

    import nnscaler  # noqa: F401  imported by both, before the baseline

    data = batch(args, seed=1000 + rank)
    dist.barrier()
    _trim()
    baseline = _status_kb("VmRSS")
    model = build_gpt(args)
    if system == "fsdp2":
        module, opt = build_fsdp2(model, world)
    else:  # "nnscaler": the code was generated beforehand; "nnscaler-compiling": rank 0 compiles here
        module, opt = build_nnscaler(model, data, world, gen_savedir if system == "nnscaler" else tmp)
        del model
    losses: list[float] = []
    step = stepper(module, opt, data, losses)
    for _ in range(2):
        step()
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    for _ in range(args.memory_steps):
        dist.barrier()
        step()
    peak = _status_kb("VmHWM")
    # one more step, stopped before zero_grad, to count what the three kinds of state hold
    loss = module(**data)
    loss.backward()
    opt.step()
    held = state_bytes(system, module, opt)
    opt.zero_grad(set_to_none=True)
    result = {"peak_rss_delta_bytes": (peak - baseline) * 1024, "state_bytes": held}
    with open(os.path.join(tmp, f"memory_{system}_{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _memory(world: int, args: argparse.Namespace) -> dict[str, Any]:
    import nnscaler

    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    found: dict[str, list[dict[str, Any]]] = {}
    try:
        with tempfile.TemporaryDirectory() as gen:
            # generate the code first (as a training job that reuses generated code would), so that
            # the compiler's own memory stays out of the "nnscaler" figure
            nnscaler.parallelize(
                build_gpt(args),
                batch(args, seed=1000),
                "dp",
                _config(world),
                gen_savedir=gen,
                load_module=False,
            )
            for system in (*SYSTEMS, "nnscaler-compiling"):
                with tempfile.TemporaryDirectory() as tmp:
                    mp.start_processes(
                        memory_worker,
                        args=(world, tmp, args, system, gen),
                        nprocs=world,
                        start_method="spawn",
                    )
                    found[system] = [
                        json.load(open(os.path.join(tmp, f"memory_{system}_{r}.json"))) for r in range(world)
                    ]
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    peak = {s: max(r["peak_rss_delta_bytes"] for r in found[s]) for s in found}
    state = {s: max(r["state_bytes"]["total"] for r in found[s]) for s in found}
    return {
        "memory_measures": {
            "state_bytes": "per rank (max over ranks): parameters + gradients + optimizer state, counted "
            "from the tensors after a step (distinct storages; DTensor local shards for FSDP2)",
            "peak_rss_delta_bytes": "per rank (max over ranks): peak RSS (VmHWM) over "
            f"{args.memory_steps} steps minus RSS before the model was built; each system alone in fresh "
            "processes with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors leave the RSS; nnscaler "
            "runs code generated beforehand (nnscaler-compiling: rank 0 traces and compiles in the process, "
            "whose leftovers stay in its RSS)",
        },
        "nnscaler_state_bytes": state["nnscaler"],
        "fsdp2_state_bytes": state["fsdp2"],
        "state_bytes_ratio": round(state["nnscaler"] / state["fsdp2"], 4),
        "nnscaler_state_breakdown": found["nnscaler"][0]["state_bytes"],
        "fsdp2_state_breakdown": found["fsdp2"][0]["state_bytes"],
        "nnscaler_peak_rss_delta_bytes": peak["nnscaler"],
        "fsdp2_peak_rss_delta_bytes": peak["fsdp2"],
        "peak_rss_delta_ratio": round(peak["nnscaler"] / peak["fsdp2"], 4),
        "nnscaler_compiling_peak_rss_delta_bytes": peak["nnscaler-compiling"],
        "peak_rss_delta_ratio_compiling": round(peak["nnscaler-compiling"] / peak["fsdp2"], 4),
        "peak_rss_delta_per_rank": {s: [r["peak_rss_delta_bytes"] for r in found[s]] for s in found},
        "memory_target": 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps measured for peak memory")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    world = 2
    result: dict[str, Any] = {}
    if not args.skip_time:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(time_worker, args=(world, tmp, args), nprocs=world, start_method="spawn")
            with open(os.path.join(tmp, "time.json")) as f:
                result.update(json.load(f))
    if not args.skip_memory:
        result.update(_memory(world, args))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
