"""Mixture of experts on CUDA (skipped elsewhere, saying so).

One GPU: the experts op (`torch.ops.nnscaler.moe_experts`) in bf16 takes the `torch._grouped_mm` path
and matches a naive per-expert loop in fp32, forward and backward; a tiny Mixtral's forward + backward
through the op matches transformers' own experts, and both tokens/s are printed.
Two or more GPUs: expert parallelism under NCCL (ep = the GPUs, up to 4) trains like one device.

    pytest -m gpu tests/gpu/test_moe_gpu.py -s      # -s shows the printed figures
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _ep_ranks() -> int:
    """GPUs an ep run uses: 4 or 2 (the test Mixtral's 4 experts must divide by it), else how many there are."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 4 if n >= 4 else min(n, 2)


def _loop_experts(hidden, index, weights, gate_up, down):
    """The experts layer written plainly: for each expert, its tokens through its gated MLP."""
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        token, slot = (index == e).nonzero(as_tuple=True)
        if token.numel():
            gate, up = (hidden[token] @ gate_up[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ down[e].t()
            out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_experts_op_grouped_mm_bf16_matches_a_loop(monkeypatch):
    import nnscaler.runtime.moe  # noqa: F401  (registers torch.ops.nnscaler.moe_experts)

    if not hasattr(torch, "_grouped_mm"):
        pytest.fail(f"torch {torch.__version__} has no torch._grouped_mm: the bf16 experts path needs it")
    real, calls = torch._grouped_mm, []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    tokens, hidden, inner, experts, k = 4096, 512, 1024, 8, 2
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    x, gate_up, down = (
        rand(tokens, hidden),
        rand(experts, 2 * inner, hidden, scale=0.05),
        rand(experts, hidden, inner, scale=0.05),
    )
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    top, index = logits.softmax(-1).topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).bfloat16()
    grad_out = rand(tokens, hidden)
    ours = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    out = torch.ops.nnscaler.moe_experts(ours[0], index, ours[1], ours[2], ours[3], "silu", None)
    out.backward(grad_out)
    assert calls, "the bf16 CUDA experts op did not call torch._grouped_mm"
    ref = [t.float().clone().requires_grad_() for t in (x, weights, gate_up, down)]
    want = _loop_experts(ref[0], index, ref[1], ref[2], ref[3])
    want.backward(grad_out.float())
    errors = {"out": _rel(out, want)}
    errors.update(
        {name: _rel(a.grad, b.grad) for name, a, b in zip(("x", "weights", "gate_up", "down"), ours, ref)}
    )
    print(json.dumps({"grouped_mm_calls": len(calls), "relative_errors_vs_fp32_loop": errors}))
    assert all(err < 2e-2 for err in errors.values()), errors  # bf16 rounding: ~4e-3 per product


def _tiny_mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
        router_jitter_noise=0.0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).cuda().bfloat16().train()


def _tokens_per_second(model, ids: torch.Tensor, steps: int = 10) -> tuple[float, float]:
    """(tokens/s of forward + backward, the first step's loss)."""
    first = None
    for i in range(steps + 2):  # two warm-up steps
        if i == 2:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
    torch.cuda.synchronize()
    return ids.numel() * steps / (time.perf_counter() - t0), first


def test_tiny_mixtral_through_the_experts_op_tokens_per_second():
    from nnscaler.graph.capture.moe import use_moe_op

    ids = torch.randint(
        0, 4096, (8, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)
    )
    hf_tps, hf_loss = _tokens_per_second(_tiny_mixtral(), ids)
    model = _tiny_mixtral()
    assert len(use_moe_op(model)) == 4, "the 4 Mixtral experts modules were not recognised"
    op_tps, op_loss = _tokens_per_second(model, ids)
    print(
        json.dumps(
            {
                "model": "Mixtral 4 layers, hidden 512, 8 experts, top-2, bf16",
                "tokens_per_step": ids.numel(),
                "transformers_experts_tokens_per_s": round(hf_tps),
                "nnscaler_moe_op_tokens_per_s": round(op_tps),
                "device": torch.cuda.get_device_name(),
            }
        )
    )
    assert op_loss == pytest.approx(hf_loss, rel=2e-2), (op_loss, hf_loss)


def _ep_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    import nnscaler
    from tests import zoo
    from tests.models_moe import build_mixtral

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 parity
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    nnscaler.init()
    model, make_batch = build_mixtral(seed=0)
    eager, _ = build_mixtral(seed=0)
    eager = eager.cuda()
    cfg = nnscaler.ComputeConfig(world, world, pas_config={"ep_size": world})
    dummy = {k: v.cuda() for k, v in make_batch(12345, 4).items()}
    pm = nnscaler.parallelize(model, dummy, "tp", cfg, gen_savedir=f"{tmp}/gen")
    opt = nnscaler.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        batch = {k: v.cuda() for k, v in make_batch(step, 4).items()}
        for module, optimizer in ((pm, opt), (eager, eager_opt)):
            loss = zoo.extract_loss(module(**batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    state = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in pm.state_dict().items()}
    states: list = [None] * world
    dist.all_gather_object(states, state)
    if rank == 0:
        merged = nnscaler.merge_state_dicts(states)[0]
        diffs = {
            n: float((merged[n].float() - p.detach().cpu()).abs().max()) for n, p in eager.named_parameters()
        }
        with open(f"{tmp}/result.json", "w") as f:
            json.dump(
                {"losses": losses, "max_param_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get)},
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    _ep_ranks() < 2,
    reason="expert parallelism under NCCL needs at least 2 GPUs (NCCL refuses two ranks on one)",
)
def test_expert_parallel_under_nccl_matches_one_device(tmp_path):
    world = _ep_ranks()
    mp.start_processes(_ep_worker, args=(world, str(tmp_path)), nprocs=world, start_method="spawn")
    result = json.loads((tmp_path / "result.json").read_text())
    print(json.dumps({"ep": world, **result}))
    ours, ref = result["losses"][0::2], result["losses"][1::2]
    assert ours == pytest.approx(ref, rel=1e-4, abs=1e-5), result["losses"]
    assert result["max_param_diff"] < 1e-4, result
