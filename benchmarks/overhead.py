"""Overhead of a compiled module on one process: `ComputeConfig(1, 1)` against the plain module.

Trains the same model with AdamW twice in one process: the plain module with a plain optimizer, and
`nnscaler.parallelize(model, dummy, 'dp', ComputeConfig(1, 1))` with `nnscaler.build_optimizer`
(same optimizer class and arguments, same batch). Warm-up steps, then timed steps alternating
between the two (`common.time_alternating`). Prints JSON.

--model gpt (default): the ~20M-parameter nanoGPT; reports the median step times and their ratio
(target nnscaler / plain <= 1.02).

    python benchmarks/overhead.py [--steps 10] [--layers 6 --embd 512 --vocab 8192 --block 128]

--model llama1b: a ~1.1B-parameter Llama (transformers LlamaForCausalLM, random init built directly
in the chosen dtype on the device, sdpa attention; nothing is downloaded), bf16 by default, meant
for one GPU. Adds the model FLOPs utilisation (MFU) of both systems (target nnscaler MFU / plain MFU
>= 0.98) and their peak GPU memory. Fused AdamW on CUDA. A GPU is required unless `--tiny` shrinks
the model so that the code path can be checked on a CPU.

    python benchmarks/overhead.py --model llama1b [--batch 4 --seq 2048 --steps 20 --warmup 5]
    python benchmarks/overhead.py --model llama1b --tiny --steps 2 --warmup 1 [--peak_tflops 1]

MFU = model FLOPs per step / (median step time * peak FLOP/s). Model FLOPs per step (as in PaLM,
appendix B) = 6 * N * T + 12 * L * H * S * T with T = batch * seq tokens per step, N the parameters
that take part in matrix multiplies (every parameter except an untied input-embedding table, whose
lookup does no multiply; the lm_head and a tied table count), L layers, H hidden size, S sequence
length (attention scores and values counted over the full, not the causal, square). The peak is
the dense bf16 tensor-core figure of the GPU, from a table by device name; `--peak_tflops`
overrides it (and is the only source for fp32 or a CPU). Without a peak, MFU is null; the ratio of
the two MFUs does not depend on the peak and is always reported.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
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

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, matched in order against the CUDA device name.
PEAK_BF16_TFLOPS: list[tuple[tuple[str, ...], float]] = [
    (("H200",), 989.0),
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (("A100",), 312.0),
]

FLOPS_FORMULA = (
    "6 * N * T + 12 * L * H * S * T; T = batch * seq tokens per step, N = parameters in matrix "
    "multiplies (all but an untied input-embedding table; lm_head counted), L layers, H hidden size, "
    "S sequence length (full attention square, not halved for causal)"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--model", choices=["gpt", "llama1b"], default="gpt")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 for gpt, bf16 for llama1b"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="sequence length (default: --block for gpt, 2048 for llama1b)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="llama1b: 2 layers, hidden 128, so that it runs on a CPU"
    )
    parser.add_argument(
        "--peak_tflops", type=float, default=None, help="peak FLOP/s of the device, in TFLOP/s, for MFU"
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "overhead.py: --device cuda given but torch sees no CUDA device\n")
    if args.model == "llama1b" and args.device != "cuda" and not args.tiny:
        parser.exit(
            2,
            "overhead.py: --model llama1b needs a GPU (--device cuda; torch sees none here); "
            "add --tiny to check the code path on a CPU with a 2-layer model\n",
        )
    if args.dtype is None:
        args.dtype = "bf16" if args.model == "llama1b" else "fp32"
    if args.seq is None:
        args.seq = args.block if args.model == "gpt" else (64 if args.tiny else 2048)
    elif args.model == "gpt":
        args.block = args.seq
    return args


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    if args.tiny:
        dims = dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=2048,
        )
    else:  # ~1.10B parameters with untied embeddings (0.97B in the decoder layers)
        dims = dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
        )
    config = LlamaConfig(
        **dims,
        max_position_embeddings=max(args.seq, 2048),
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    # as tests/zoo.py `_settle`: fix choices transformers would otherwise make from the environment
    config._attn_implementation = "sdpa"
    config.loss_type = "ForCausalLM"
    return config


def build_llama(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random init, allocated directly in `dtype` on `device` (the rotary inv_freq buffer stays fp32)."""
    from transformers import LlamaForCausalLM

    config = llama_config(args)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.loss_type = "ForCausalLM"
    return model.train(), config


def llama_batch(args: argparse.Namespace, vocab: int, device: torch.device, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (args.batch, args.seq), generator=g)
    # labels are a separate tensor (torch.export would merge identical inputs); the model shifts them
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss: the output itself (nanoGPT) or its `.loss` / `["loss"]` (transformers)."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find a loss in a forward output of type {type(output).__name__}")


# ---------------------------------------------------------------------------------------------
# FLOPs, peaks, memory
# ---------------------------------------------------------------------------------------------
def matmul_params(model: torch.nn.Module, input_embedding: torch.nn.Parameter | None) -> int:
    """Parameters that take part in matrix multiplies: all but an input-embedding table that is not
    also the output projection (a lookup does no multiply)."""
    n = nparams(model)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = out is not None and out.weight is input_embedding
    if input_embedding is not None and not tied:
        n -= input_embedding.numel()
    return n


def flops_per_step(n_matmul: int, layers: int, hidden: int, seq: int, tokens: int) -> int:
    return 6 * n_matmul * tokens + 12 * layers * hidden * seq * tokens


def peak_tflops(args: argparse.Namespace, device: torch.device) -> tuple[float | None, str]:
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak_tflops"
    if device.type != "cuda":
        return None, "unknown for a CPU (pass --peak_tflops)"
    name = torch.cuda.get_device_name(device)
    if args.dtype != "bf16":
        return None, f"no {args.dtype} peak in the table for {name} (pass --peak_tflops)"
    upper = name.upper()
    for keys, tflops in PEAK_BF16_TFLOPS:
        if all(k in upper for k in keys):
            return tflops, f"table: {name}, dense bf16"
    return None, f"{name} is not in the table (pass --peak_tflops)"


def tensor_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, buffers and optimizer state (what a system keeps between steps)."""
    seen: set[int] = set()
    total = 0
    tensors = [*module.parameters(), *module.buffers()]
    for state in opt.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    for t in tensors:
        if t.device.type == "cuda" and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def sdpa_calls(gen_root: str) -> dict[str, int]:
    """How the generated code calls scaled_dot_product_attention: with an explicit `attn_mask` (no
    flash kernel on CUDA) or `is_causal=True`. Compare with the plain module's calls."""
    calls = [
        line
        for f in Path(gen_root).rglob("gencode*.py")
        for line in f.read_text().splitlines()
        if "scaled_dot_product_attention(" in line and not line.lstrip().startswith("#")
    ]
    return {
        "calls": len(calls),
        "with_attn_mask": sum("attn_mask=" in c and "attn_mask=None" not in c for c in calls),
        "is_causal": sum("is_causal=True" in c for c in calls),
        "enable_gqa": sum("enable_gqa=True" in c for c in calls),
    }


def spy_sdpa(counts: dict[str, int]) -> Callable[[], None]:
    """Count the plain module's scaled_dot_product_attention calls by kind; returns the undo."""
    orig = torch.nn.functional.scaled_dot_product_attention

    def spy(*a: Any, **k: Any) -> torch.Tensor:
        counts["calls"] += 1
        counts["with_attn_mask"] += (len(a) > 3 and a[3] is not None) or k.get("attn_mask") is not None
        counts["is_causal"] += bool(k.get("is_causal", False))
        counts["enable_gqa"] += bool(k.get("enable_gqa", False))
        return orig(*a, **k)

    torch.nn.functional.scaled_dot_product_attention = spy
    return lambda: setattr(torch.nn.functional, "scaled_dot_product_attention", orig)


GIB = 2**30


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    # the original output (nanoGPT in fp32 on a CPU) keeps its fields; anything else adds more
    extended = args.model != "gpt" or cuda or args.dtype != "fp32"

    import nnscaler
    from nnscaler import ComputeConfig

    if args.model == "gpt":
        model = build_gpt(args).to(device=device, dtype=dtype)
        data = {k: v.to(device) for k, v in batch(args, seed=1000).items()}
        desc = f"nanoGPT {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, block {args.block}"
        layers, hidden = args.layers, args.embd
        n_matmul = matmul_params(model, model.transformer.wpe.weight)  # wte is tied to lm_head
    else:
        model, config = build_llama(args, device, dtype)
        data = llama_batch(args, config.vocab_size, device, seed=1000)
        layers, hidden = config.num_hidden_layers, config.hidden_size
        desc = (
            f"Llama{' (tiny)' if args.tiny else ''} {layers} layers, hidden {hidden}, "
            f"{config.num_attention_heads} heads, {config.num_key_value_heads} kv heads, intermediate "
            f"{config.intermediate_size}, vocab {config.vocab_size}, untied, sdpa, seq {args.seq}"
        )
        n_matmul = matmul_params(model, model.get_input_embeddings().weight)
    opt_kwargs: dict[str, Any] = {"lr": args.lr}
    if cuda:
        opt_kwargs["fused"] = True

    plain = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), **opt_kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        pm = nnscaler.parallelize(model, data, "dp", ComputeConfig(1, 1), gen_savedir=tmp)
        nn_sdpa = sdpa_calls(tmp)
    plain_sdpa = dict.fromkeys(nn_sdpa, 0)
    if extended:  # one forward of the plain module, outside the timing
        undo = spy_sdpa(plain_sdpa)
        try:
            with torch.no_grad():
                plain(**data)
        finally:
            undo()
    # one process without a NCCL group: the generated module allocates on the CPU; move it (before
    # the optimizer and the first forward build anything over its parameters)
    pm = pm.to(device)
    nn_opt = nnscaler.build_optimizer(pm, torch.optim.AdamW, **opt_kwargs)
    n = nparams(model)
    del model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses: dict[str, float] = {}
    transient: dict[str, int] = {}  # peak allocation above what was allocated when a step began

    def stepper(name: str, module: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            if cuda:
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss = loss_of(module(**data))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            first = name not in losses
            if first:
                losses[name] = loss.item()
            del loss
            if cuda:
                torch.cuda.synchronize()
            if cuda and not first:  # the first step also allocates the optimizer state (resident)
                peak = torch.cuda.max_memory_allocated()
                transient[name] = max(transient.get(name, 0), peak - before)
                transient["process"] = max(transient.get("process", 0), peak)

        return step

    systems = {"nnscaler": stepper("nnscaler", pm, nn_opt), "plain": stepper("plain", plain, plain_opt)}
    barrier = torch.cuda.synchronize if cuda else (lambda: None)
    times = time_alternating(systems, args.warmup, args.steps, args.rounds, barrier=barrier)
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * max(1.0, abs(losses["plain"]))
    out: dict[str, Any] = {
        "benchmark": "ComputeConfig(1, 1) parallelized module vs the plain module",
        "model": desc,
        "params": n,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        **summarize(times, "nnscaler", "plain"),
        "target": 1.02,
        "first_loss_equal": abs(losses["nnscaler"] - losses["plain"]) < tol,
        "machine": load_note(),
    }
    if extended:
        med = {k: statistics.median(v["wall"]) for k, v in times.items()}
        tokens = args.batch * args.seq
        flops = flops_per_step(n_matmul, layers, hidden, args.seq, tokens)
        peak, peak_source = peak_tflops(args, device)
        mfu = {k: (flops / (t * peak * 1e12) if peak else None) for k, t in med.items()}
        resident = {"nnscaler": tensor_bytes(pm, nn_opt), "plain": tensor_bytes(plain, plain_opt)}
        out.update(
            {
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "dtype": args.dtype,
                "seq": args.seq,
                "tokens_per_step": tokens,
                "optimizer": f"torch.optim.AdamW({', '.join(f'{k}={v}' for k, v in opt_kwargs.items())})",
                "first_loss": {k: round(v, 5) for k, v in losses.items()},
                "sdpa_calls_per_forward": {"nnscaler": nn_sdpa, "plain": plain_sdpa},
                "matmul_params": n_matmul,
                "flops_formula": FLOPS_FORMULA,
                "model_flops_per_step": flops,
                "peak_tflops": peak,
                "peak_source": peak_source,
                "nnscaler_tflops": round(flops / med["nnscaler"] / 1e12, 3),
                "plain_tflops": round(flops / med["plain"] / 1e12, 3),
                "nnscaler_mfu": None if mfu["nnscaler"] is None else round(mfu["nnscaler"], 4),
                "plain_mfu": None if mfu["plain"] is None else round(mfu["plain"], 4),
                # = plain step time / nnscaler step time: independent of the peak
                "mfu_ratio": round(med["plain"] / med["nnscaler"], 4),
                "mfu_target": 0.98,
                "peak_mem_gib": (
                    {k: round((resident[k] + transient.get(k, 0)) / GIB, 3) for k in ("nnscaler", "plain")}
                    if cuda
                    else None
                ),
                "process_peak_mem_gib": round(transient.get("process", 0) / GIB, 3) if cuda else None,
                "peak_mem_note": (
                    "per system: its parameters + buffers + optimizer state (CUDA tensors) plus the most "
                    "torch.cuda.max_memory_allocated rose above memory_allocated during one of its steps "
                    "(all but its first); "
                    "both systems stay resident in this one process, so the process-wide figure holds both"
                    if cuda
                    else "CPU: not measured"
                ),
            }
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
