"""Peak memory of forward + backward of an LM head with cross-entropy: chunked
(`nnscaler.chunk_linear_cross_entropy`) against unchunked (`F.linear` + `F.cross_entropy`). Prints JSON.

Counted as in benchmarks/forward_memory.py: `LiveBytes` adds up the bytes of tensor storages created
during the call (forward, loss, backward, and the gradients it leaves) that are alive at once; the
inputs and the weight, which exist before, are not counted. The custom op's own body is counted too
(a dispatch mode would otherwise see the op's output only). On CUDA (`--device cuda`),
`torch.cuda.max_memory_allocated` above what was allocated before.

ratio = chunked / unchunked (target <= 0.25 at N=4096, K=512, V=32768, chunk 512).

    python benchmarks/chunked_loss_memory.py [--tokens 4096] [--hidden 512] [--vocab 32768] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.forward_memory import LiveBytes, cuda_peak  # noqa: E402
from nnscaler.runtime import chunked_loss  # noqa: E402


class _SeeThrough(LiveBytes):
    """LiveBytes that also counts what the chunked custom op allocates inside its body."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.nnscaler.chunk_linear_cross_entropy.default:
            with self:
                return chunked_loss._chunk_ce_op._init_fn(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def live_peak(fn: Callable[[], torch.Tensor]) -> int:
    with _SeeThrough() as mem:
        out = fn()
    del out
    return mem.peak


def _step(loss_fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Callable:
    """Forward + backward of the mean loss over non-ignored tokens; returns the loss."""

    def run() -> torch.Tensor:
        hidden.grad = weight.grad = None
        losses = loss_fn(hidden, weight, labels)
        loss = losses.sum() / (labels != -100).sum()
        loss.backward()
        return loss.detach()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    labels[::16] = -100
    systems = {
        "unchunked": lambda h, w, t: F.cross_entropy(F.linear(h, w), t, reduction="none"),
        "chunked": lambda h, w, t: chunked_loss.chunk_linear_cross_entropy(h, w, t, chunk_size=args.chunk),
    }
    counter = cuda_peak if device.type == "cuda" else live_peak
    result: dict[str, object] = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "chunk": args.chunk,
        "device": str(device),
        "counter": "cuda_max_allocated" if device.type == "cuda" else "live_bytes",
        "logits_mib": args.tokens * args.vocab * 4 / 2**20,
    }
    losses, grads = {}, {}
    for name, fn in systems.items():
        step = _step(fn, hidden, weight, labels)
        t0 = time.perf_counter()
        peak = counter(step)
        result[f"{name}_seconds"] = round(time.perf_counter() - t0, 2)
        result[f"{name}_peak_mib"] = round(peak / 2**20, 1)
        losses[name] = step()
        grads[name] = (hidden.grad.clone(), weight.grad.clone())
    result["ratio"] = round(result["chunked_peak_mib"] / result["unchunked_peak_mib"], 4)
    result["max_abs_diff"] = {
        "loss": float((losses["chunked"] - losses["unchunked"]).abs()),
        "d_hidden": float((grads["chunked"][0] - grads["unchunked"][0]).abs().max()),
        "d_weight": float((grads["chunked"][1] - grads["unchunked"][1]).abs().max()),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
