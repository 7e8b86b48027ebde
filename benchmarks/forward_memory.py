"""Peak memory of the generated forward against the plain module, at a long sequence. Prints JSON.

The model is compiled with `parallelize(model, batch, 'dp', ComputeConfig(1, 1))` (one process) and
both forwards are measured twice: in training (trainable parameters, so autograd keeps what it saves
for backward) and under torch.no_grad() (inference). What the generated forward holds beyond the
eager module (intermediates it no longer needs) shows as a ratio above 1.

- every device: `LiveBytes` (below) counts the bytes of live tensor storages created during the
  forward: a TorchDispatchMode adds up the bytes of every storage an op creates and subtracts them
  when the storage is freed (weakref finalizers). Storages that existed before (parameters, inputs)
  are not counted, nor are outputs that alias an input (views, in-place ops); autograd's saved
  tensors keep storages alive, so they count until the graph is freed, as in the allocator.
  Allocator- and RSS-noise free.
- CUDA (when available, `--device cuda`): `torch.cuda.max_memory_allocated` minus the memory
  allocated before the call.

ratio = generated / eager (target <= 1.02).

    python benchmarks/forward_memory.py [--model gpt|llama] [--seq 2048] [--layers 4] [--device cpu]

Llama with grouped-query attention (the default, --kv-heads 0) keeps SDPA's `enable_gqa`, as in eager
mode, so the generated forward saves the same grouped keys and values (ratio 1.00 in training at
seq 2048 on CPU; it was 1.02 when the trace went through transformers' repeat_kv).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [
        t.untyped_storage() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and not t.is_meta
    ]


class LiveBytes(TorchDispatchMode):
    """`live`: bytes of tracked storages alive now; `peak`: the most alive at once since entering."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(s) for s in _storages((args, kwargs))}
        out = func(*args, **kwargs)
        for s in _storages(out):
            key = id(s)  # stable while the storage lives (its Python object is preserved)
            if key in inputs or key in self._tracked:
                continue
            nbytes = s.nbytes()
            self._tracked.add(key)
            self.live += nbytes
            weakref.finalize(s, self._release, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model and one batch of `args.seq` tokens (batch 1)."""
    torch.manual_seed(0)
    if args.model == "gpt":
        from examples.nanogpt.model import GPT, GPTConfig

        cfg = GPTConfig(
            block_size=args.seq,
            vocab_size=args.vocab,
            n_layer=args.layers,
            n_head=args.heads,
            n_embd=args.embd,
            dropout=0.0,
        )
        model, keys = GPT(cfg), ("idx", "targets")
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.embd,
            intermediate_size=4 * args.embd,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads or max(1, args.heads // 2),
            max_position_embeddings=args.seq,
            use_cache=False,
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = "sdpa"
        model, keys = LlamaForCausalLM(cfg), ("input_ids", "labels")
    tokens = torch.randint(0, args.vocab, (2, 1, args.seq))
    return model.train(), {keys[0]: tokens[0], keys[1]: tokens[1]}


def live_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes of tensors created during `fn()` and alive at once (outputs and saved tensors included)."""
    gc.collect()
    with LiveBytes() as mem:
        out = fn()
    del out
    return mem.peak


def _under_grad(fn: Callable[[], Any], grad: bool) -> Callable[[], Any]:
    """`fn` run with autograd recording (a training forward) or under torch.no_grad() (inference)."""

    def run() -> Any:
        with torch.set_grad_enabled(grad):
            return fn()

    return run


def cuda_peak(fn: Callable[[], Any]) -> int:
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0: heads / 2)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    import nnscaler
    from nnscaler import ComputeConfig

    model, batch = build(args)
    with tempfile.TemporaryDirectory() as savedir:
        pm = nnscaler.parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=savedir)
    device = torch.device(args.device)
    model, pm = model.to(device), pm.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    result: dict[str, Any] = {
        "model": args.model,
        "batch": 1,
        "seq": args.seq,
        "layers": args.layers,
        "embd": args.embd,
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
    }
    counters: dict[str, Callable[[Callable[[], Any]], int]] = {"live_bytes": live_peak}
    if device.type == "cuda":
        counters["cuda_max_allocated"] = cuda_peak
    for mode in ("train", "no_grad"):
        run_eager = _under_grad(lambda: model(**batch), mode == "train")
        run_gen = _under_grad(lambda: pm(**batch), mode == "train")
        for fn in (run_eager, run_gen):  # warm-up: lazy state (reducer, kernels) outside the measurement
            fn()
        result[mode] = {}
        for name, peak in counters.items():
            eager, gen = peak(run_eager), peak(run_gen)
            result[mode][name] = {
                "eager_mib": round(eager / 2**20, 2),
                "generated_mib": round(gen / 2**20, 2),
                "ratio": round(gen / eager, 4),
            }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
