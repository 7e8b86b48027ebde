"""Step time of `ComputeConfig(torch_compile=...)` against the same generated code run eagerly.

One process: the nanoGPT example model (benchmarks/common.py's ~20M-parameter GPT by default) is
parallelized twice with `ComputeConfig(1, 1)`, once plain and once with `torch_compile` (inductor by
default), from the same weights; both train with AdamW on the same batch, warm-up steps first (the
compiled module compiles in its first one: reported as `compile_s`), then timed steps alternating
between the two (`common.time_alternating`). Data is made once, before; warm-up and compilation are
not timed. Prints JSON; the headline is `ratio` = compiled / eager median step time (target <= 0.85),
next to `cpu_ratio`, the same for process CPU time (the fairer figure on a shared machine, where
wall-clock time mostly measures the other jobs).

Why the ratio is what it is: after timing, one more eager step runs under torch.profiler and
`eager_gemm_share` is the part of its CPU time spent in matrix multiplications (aten mm / addmm /
bmm; for tiny models the profiler's per-op overhead inflates the rest), and
`eager_gemm_and_attention_share` adds the CPU fused-attention kernels (forward and backward).
On a CPU, inductor compiles a training step's GEMMs to calls of the same ATen (MKL / oneDNN) kernels
as eager mode (its C++ GEMM template is used only for constant weights, i.e. frozen inference), so it
can speed up only the rest: fused elementwise, norms, softmax / loss; scaled_dot_product_attention
also stays the same ATen kernel. The compiled / eager ratio cannot go below
`eager_gemm_and_attention_share` there. `phases_cpu_s` splits a step's CPU time into
forward, backward and optimizer (the optimizer is not compiled in either arm).

The model runs on `--threads` torch threads (default 1 on CPU, so that runs compare; printed).

    python benchmarks/compile_speed.py [--steps 10] [--backend inductor] [--mode max-autotune]
    python benchmarks/compile_speed.py --device cuda            # bf16 on one GPU
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET = 0.85


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--mode", default=None, help="torch.compile mode (e.g. max-autotune)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on cpu, bf16 on cuda"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: 1 on cpu, torch's on cuda)"
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "compile_speed.py: --device cuda given but torch sees no CUDA device\n")
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.threads is None and args.device == "cpu":
        args.threads = 1
    return args


def compile_value(args: argparse.Namespace) -> dict[str, Any]:
    """`ComputeConfig.torch_compile` from the command line."""
    value: dict[str, Any] = {"backend": args.backend}
    if args.mode:
        value["mode"] = args.mode
    return value


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The matrix multiplications a GPT's linear layers and their gradients run as."""
ATTENTION_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)
"""CPU fused attention: inductor calls the same ATen kernel (forward and backward) in both arms."""


def stepper(module: torch.nn.Module, opt: torch.optim.Optimizer, data: dict, sync: Callable[[], None]):
    """One training step of `module`; records the losses it sees and each phase's process CPU time."""
    losses: list[float] = []
    phases: list[tuple[float, float, float]] = []

    def step() -> None:
        c0 = time.process_time()
        loss = module(**data)
        c1 = time.process_time()
        loss.backward()
        c2 = time.process_time()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        phases.append((c1 - c0, c2 - c1, time.process_time() - c2))

    step.losses = losses  # type: ignore[attr-defined]
    step.phases = phases  # type: ignore[attr-defined]
    return step


def kernel_shares(step: Callable[[], None]) -> dict[str, float]:
    """The parts of one step's profiled CPU time spent in GEMM kernels and in GEMM + attention
    kernels, the ATen calls a compiled CPU step makes alike (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS)
    return {"gemm": round(gemm / total, 3), "gemm_and_attention": round((gemm + attention) / total, 3)}


def median_phases(phases: list[tuple[float, float, float]]) -> dict[str, float]:
    """Median forward / backward / optimizer CPU seconds over the timed steps."""
    columns = list(zip(*phases))
    return {k: round(statistics.median(c), 4) for k, c in zip(("forward", "backward", "optimizer"), columns)}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    import nnscaler
    from nnscaler import ComputeConfig

    model = build_gpt(args).to(dtype=dtype)
    data = {k: v.to(device) for k, v in batch(args, seed=1000).items()}
    value = compile_value(args)
    modules = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in (
            ("eager", ComputeConfig(1, 1)),
            ("compiled", ComputeConfig(1, 1, torch_compile=value)),
        ):
            pm = nnscaler.parallelize(
                copy.deepcopy(model), data, "dp", cfg, gen_savedir=tmp, instance_name=name
            )
            modules[name] = pm.to(device)
    systems = {}
    for name, pm in modules.items():
        opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, lr=args.lr)
        systems[name] = stepper(pm, opt, data, sync)
    t0 = time.perf_counter()
    systems["compiled"]()  # the first call compiles (forward and backward)
    compile_s = time.perf_counter() - t0
    systems["eager"]()  # so both have taken one step before the warm-up
    untimed = {k: len(s.phases) for k, s in systems.items()}
    times = time_alternating(systems, args.warmup, args.steps, args.rounds, barrier=sync)
    untimed = {k: n + args.warmup for k, n in untimed.items()}  # compile / first step and warm-up
    phases = {k: median_phases(s.phases[untimed[k] :]) for k, s in systems.items()}
    shares = None if cuda else kernel_shares(systems["eager"])  # host-side times say nothing of GPU kernels
    first = {k: s.losses[0] for k, s in systems.items()}
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * max(1.0, abs(first["eager"]))
    out = {
        "benchmark": "ComputeConfig(1, 1, torch_compile=...) vs the same generated code eager",
        "model": f"nanoGPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, block {args.block}",
        "params": nparams(model),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "torch_compile": value,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "compile_s": round(compile_s, 2),
        **summarize(times, "compiled", "eager"),
        "target": TARGET,
        "phases_cpu_s": phases,
        "eager_gemm_share": shares and shares["gemm"],
        # a floor for `ratio` on a CPU: what it would be if compiling made everything else free
        "eager_gemm_and_attention_share": shares and shares["gemm_and_attention"],
        "first_loss": {k: round(v, 5) for k, v in first.items()},
        "first_loss_equal": abs(first["compiled"] - first["eager"]) < tol,
        "machine": load_note(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
