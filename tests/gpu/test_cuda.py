"""On a CUDA device (skipped elsewhere, saying so): the profiler times kernels to completion, and the
generated code of a plan runs under NCCL and matches the eager model step for step."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from nnscaler.graph.capture import capture
from nnscaler.profiler import profile_graph

pytestmark = pytest.mark.gpu


class _BigLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4096, 4096, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).float().pow(2).mean()


def test_profiler_times_cuda_kernels_to_completion():
    """CUDA queues kernels and returns at once: an entry timed without waiting for them would be a
    launch's few microseconds, below what any GPU can do for this matmul."""
    model = _BigLinear().to(torch.bfloat16)
    x = torch.randn(4, 1024, 4096, dtype=torch.bfloat16)
    graph = capture(model, {"x": x}, both_modes=False)
    db = profile_graph(graph, ways=(1,), repeats=3, device="cuda")
    assert db.device == "cuda"
    linear = [k for k in db.entries if k.startswith("aten.linear")]
    assert linear, sorted(db.entries)
    flops = 3 * 2 * 4 * 1024 * 4096 * 4096  # forward + the two backward matmuls
    fastest_gpu = 2e15  # FLOP/s: above any GPU's dense bf16 peak today
    assert db.entries[linear[0]] >= flops / fastest_gpu


def _train(rank: int, store_path: str, result_path: str) -> None:
    import os

    import torch.distributed as dist

    import nnscaler
    from tests import zoo

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=0, world_size=1)
    nnscaler.init()
    model, make_batch = zoo.build("llama", seed=0)
    eager, _ = zoo.build("llama", seed=0)
    eager = eager.cuda()
    batches = [{k: v.cuda() for k, v in make_batch(s, 4).items()} for s in (1, 2, 3)]
    pm = nnscaler.parallelize(
        model, batches[0], "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=os.path.dirname(store_path)
    )
    assert next(pm.parameters()).is_cuda
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        loss = zoo.extract_loss(pm(**batch))
        loss.backward()
        pm.sync_grad()
        opt.step()
        opt.zero_grad()
        ref = zoo.extract_loss(eager(**batch))
        ref.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        losses.append((loss.item(), ref.item()))
    torch.save(losses, result_path)
    nnscaler.uninit()


def test_generated_code_under_nccl_matches_eager(tmp_path):
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_train, args=(0, str(tmp_path / "store"), str(tmp_path / "losses.pt")))
    proc.start()
    proc.join(240)
    assert proc.exitcode == 0, f"the NCCL worker exited with {proc.exitcode}"
    losses = torch.load(tmp_path / "losses.pt")
    for ours, ref in losses:
        assert ours == pytest.approx(ref, rel=1e-4, abs=1e-5), losses
