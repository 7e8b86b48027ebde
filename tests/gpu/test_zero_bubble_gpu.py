"""Zero-bubble pipeline schedules on CUDA (issue 44; skipped elsewhere, saying so).

One GPU: a stage's backward split into B (input gradients) and W (weight gradients,
nnscaler/runtime/grads/split_backward.py) gives the full backward's gradients on CUDA, with the
gradient hooks firing in W.
Two or more GPUs: zb_h1, zbv and dualpipev under NCCL (2 ranks; the V-shaped ones 2 stages per rank)
train a GPT with a tied embedding like one device (SGD, every parameter), each printing its step time.

    pytest -m gpu tests/gpu/test_zero_bubble_gpu.py -s
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

NMICROS = 8


def test_split_backward_matches_the_full_backward_on_cuda():
    from nnscaler.runtime.grads.split_backward import backward_inputs, backward_weights

    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True).cuda()
    params = list(block.parameters())
    hooked = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: hooked.append(p))
    x0, g = torch.randn(4, 64, 256, device="cuda"), torch.randn(4, 64, 256, device="cuda")
    x = x0.clone().requires_grad_(True)
    torch.autograd.backward([block(x)], [g])
    ref, ref_x = [p.grad.clone() for p in params], x.grad.clone()
    for p in params:
        p.grad = None
    hooked.clear()
    x = x0.clone().requires_grad_(True)
    pending = backward_inputs([block(x)], [g], [x], params)
    assert all(p.grad is None for p in params) and not hooked  # B leaves the weights alone
    torch.testing.assert_close(x.grad, ref_x)
    backward_weights(pending)
    assert len(hooked) == len(params)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r)


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    import nnscaler
    from tests import zoo

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 parity
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    nnscaler.init()
    out = {}
    for scheduler in ("zb_h1", "zbv", "dualpipev"):
        model, make_batch = zoo.build("gpt_deep")
        eager, _ = zoo.build("gpt_deep")
        eager = eager.cuda()
        pas = {"pipeline_nmicros": NMICROS, "pipeline_scheduler": scheduler}
        cfg = nnscaler.ComputeConfig(world, world, use_end2end=True, pas_config=pas)
        dummy = {k: v.cuda() for k, v in make_batch(12345, 4).items()}
        pm = nnscaler.parallelize(model, dummy, "pp", cfg, gen_savedir=f"{tmp}/gen_{scheduler}")
        opt = nnscaler.build_optimizer(pm, torch.optim.SGD, lr=0.1)
        eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
        times = []
        for step in range(3):
            micro = [{k: v.cuda() for k, v in make_batch(100 * step + m, 4).items()} for m in range(NMICROS)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pm.train_step(micro)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            opt.step()
            opt.zero_grad()
            for batch in micro:
                zoo.extract_loss(eager(**batch)).backward()
            eager_opt.step()
            eager_opt.zero_grad()
        state = {k: v.detach().cpu() for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}
        states: list = [None] * world
        dist.all_gather_object(states, state)
        merged = nnscaler.merge_state_dicts(states)[0]
        diffs = {
            n: float((merged[n].float() - p.detach().cpu()).abs().max()) for n, p in eager.named_parameters()
        }
        out[scheduler] = {
            "max_param_diff": max(diffs.values()),
            "worst": max(diffs, key=diffs.get),
            "step_s": times,
        }
    if rank == 0:
        with open(f"{tmp}/result.json", "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="pipelines under NCCL need at least 2 GPUs (NCCL refuses two ranks on one)",
)
def test_zero_bubble_schedules_under_nccl_match_one_device(tmp_path):
    mp.start_processes(_worker, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    result = json.loads((tmp_path / "result.json").read_text())
    print(json.dumps(result))
    for scheduler, r in result.items():
        assert r["max_param_diff"] < 1e-4, (scheduler, r)
