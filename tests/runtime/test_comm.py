"""Autograd-aware collectives on real gloo groups: values and gradients against one-process references."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler import runtime
from nnscaler.runtime import comm, shard_slice
from nnscaler.runtime.dist.groups import create_groups, get_group

try:
    from .dist_util import run_dist
except ImportError:
    from dist_util import run_dist


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def check_megatron_mlp(group: dist.ProcessGroup, n: int, r: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, w1, w2, gy = (torch.randn(s, generator=g) for s in [(5, 8), (6 * n, 8), (8, 6 * n), (5, 8)])
    xr, w1r, w2r = _leaf(x), _leaf(w1), _leaf(w2)
    yr = torch.tanh(xr @ w1r.T) @ w2r.T
    (yr * gy).sum().backward()
    col, row = (0, r, n, 1), (1, r, n, 1)
    xp, w1p, w2p = _leaf(x), _leaf(shard_slice(w1, col)), _leaf(shard_slice(w2, row))
    h = torch.tanh(comm.copy_to_group(xp, group) @ w1p.T)  # column-parallel
    yp = comm.reduce_from_group(h @ w2p.T, group)  # row-parallel
    (yp * gy).sum().backward()
    _close(yp, yr, "mlp output")
    _close(xp.grad, xr.grad, "input grad (copy_to_group backward all-reduce)")
    _close(w1p.grad, shard_slice(w1r.grad, col), "column weight grad")
    _close(w2p.grad, shard_slice(w2r.grad, row), "row weight grad")


def check_gather_split_reduce_scatter(group: dist.ProcessGroup, n: int, r: int) -> None:
    g = torch.Generator().manual_seed(1)
    shape = (6 * n, 6 * n, 2 * n)
    for dim, blocks in [(0, 1), (0, 3), (1, 3), (2, 1), (-1, 2)]:
        spec = (dim, r, n, blocks)
        full, gout = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        inputs = [torch.randn(shape, generator=g) for _ in range(n)]
        what = f"dim={dim} blocks={blocks}"

        piece = _leaf(shard_slice(full, spec))
        out = comm.gather_from_group(piece, dim, group, blocks=blocks)
        _close(out, full, f"gather {what}")
        (out * gout).sum().backward()
        _close(piece.grad, shard_slice(gout, spec), f"gather grad {what}")

        whole = _leaf(full)
        out = comm.split_to_group(whole, dim, group, blocks=blocks)
        _close(out, shard_slice(full, spec), f"split {what}")
        (out * shard_slice(gout, spec)).sum().backward()
        _close(whole.grad, gout, f"split grad {what}")

        mine = _leaf(inputs[r])
        out = comm.reduce_scatter_to_group(mine, dim, group, blocks=blocks)
        _close(out, shard_slice(sum(inputs), spec), f"reduce_scatter {what}")
        (out * shard_slice(gout, spec)).sum().backward()
        _close(mine.grad, gout, f"reduce_scatter grad {what}")


def check_all_to_all(group: dist.ProcessGroup, n: int, r: int) -> None:
    g = torch.Generator().manual_seed(2)
    shape = (2 * n, 3 * n, 2 * n)
    for src, dst in [(0, 1), (1, 2), (2, 0), (-1, 1)]:
        full, gout = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        local = _leaf(shard_slice(full, (src, r, n, 1)))
        out = comm.all_to_all_in_group(local, src, dst, group)
        _close(out, shard_slice(full, (dst, r, n, 1)), f"all_to_all {src}->{dst}")
        _close(comm.all_to_all_in_group(out, dst, src, group), local, f"all_to_all round trip {src}->{dst}")
        (out * shard_slice(gout, (dst, r, n, 1))).sum().backward()
        _close(local.grad, shard_slice(gout, (src, r, n, 1)), f"all_to_all grad {src}->{dst}")


def check_vocab_parallel(group: dist.ProcessGroup, n: int, r: int) -> None:
    g = torch.Generator().manual_seed(3)
    vocab, rows = 5 * n, 5
    weight, idx = torch.randn(vocab, 6, generator=g), torch.randint(0, vocab, (3, 7), generator=g)
    idx[0, :3] = 2
    gemb = torch.randn(3, 7, 6, generator=g)
    wr = _leaf(weight)
    (F.embedding(idx, wr, padding_idx=2) * gemb).sum().backward()
    ws = _leaf(weight[r * rows : (r + 1) * rows])
    emb = comm.reduce_from_group(comm.vocab_parallel_embedding(idx, ws, r * rows, padding_idx=2), group)
    _close(emb, F.embedding(idx, weight), "vocab-parallel embedding")
    (emb * gemb).sum().backward()
    _close(ws.grad, wr.grad[r * rows : (r + 1) * rows], "vocab-parallel embedding grad")

    for shape, scale, ignore in [((11,), 5.0, -100), ((2, 5), 100.0, -1)]:
        logits = torch.randn(*shape, vocab, generator=g) * scale
        target = torch.randint(0, vocab, shape, generator=g)
        target.view(-1)[[1, 4]] = ignore
        weights = torch.randn(shape, generator=g)
        for reduction in ["mean", "sum", "none"]:
            for eps in [0.0, 0.1]:
                what = f"vocab CE {shape} {reduction} eps={eps}"
                lr = _leaf(logits)
                ref = F.cross_entropy(
                    lr.reshape(-1, vocab),
                    target.reshape(-1),
                    ignore_index=ignore,
                    reduction=reduction,
                    label_smoothing=eps,
                )
                ref = ref.view(shape) if reduction == "none" else ref
                (ref * weights if reduction == "none" else ref).sum().backward()
                lp = _leaf(shard_slice(logits, (-1, r, n, 1)))
                loss = comm.vocab_parallel_cross_entropy(
                    lp, target, r * rows, group, ignore_index=ignore, reduction=reduction, label_smoothing=eps
                )
                _close(loss, ref.detach(), what)
                (loss * weights if reduction == "none" else loss).sum().backward()
                _close(lp.grad, shard_slice(lr.grad, (-1, r, n, 1)), f"{what} grad")


def check_batch_parallel_ce(group: dist.ProcessGroup, n: int, r: int) -> None:
    g = torch.Generator().manual_seed(4)
    batch = 4 * n
    logits, target = torch.randn(batch, 7, generator=g), torch.randint(0, 7, (batch,), generator=g)
    target[[0, 1, 2, batch - 1]] = -100  # uneven: most ignored targets sit on rank 0
    rows = (0, r, n, 1)
    for reduction, eps in [("mean", 0.0), ("mean", 0.2), ("sum", 0.0), ("sum", 0.1)]:
        what = f"batch CE {reduction} eps={eps}"
        lr = _leaf(logits)
        ref = F.cross_entropy(lr, target, reduction=reduction, label_smoothing=eps)
        ref.backward()
        lp = _leaf(shard_slice(logits, rows))
        part = comm.batch_parallel_cross_entropy(
            lp, shard_slice(target, rows), group, reduction=reduction, label_smoothing=eps
        )
        total = comm.reduce_from_group(part, group)
        _close(total, ref.detach(), what)
        total.backward()
        _close(lp.grad, shard_slice(lr.grad, rows), f"{what} grad")
    none = comm.batch_parallel_cross_entropy(
        shard_slice(logits, rows), shard_slice(target, rows), group, reduction="none"
    )
    _close(none, shard_slice(F.cross_entropy(logits, target, reduction="none"), rows), "batch CE none")


def _all_checks(group: dist.ProcessGroup, ranks: list[int]) -> list[str]:
    n, r = len(ranks), ranks.index(dist.get_rank())
    assert (comm.group_size(group), comm.rank_in_group(group)) == (n, r)
    done = []
    for check in [
        check_megatron_mlp,
        check_gather_split_reduce_scatter,
        check_all_to_all,
        check_vocab_parallel,
        check_batch_parallel_ce,
    ]:
        check(group, n, r)
        done.append(f"{check.__name__}@{n}")
    return done


def comm_worker(rank: int, world_size: int) -> list[str]:
    if not dist.is_initialized():  # started without a process group: nnscaler.runtime.init() makes one
        runtime.init()
        runtime.init()  # idempotent
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_rank() == rank
        assert runtime.runtime_device() == torch.device("cpu")
        done = _comm_checks(rank, world_size)
        runtime.uninit()
        assert not dist.is_initialized()
        runtime.uninit()
        return [*done, "init/uninit"]
    return _comm_checks(rank, world_size)


def _comm_checks(rank: int, world_size: int) -> list[str]:
    half = [[0, 1], [2, 3]]
    create_groups([*half, [0, 2], [1, 3], [0, 1, 2, 3]] if world_size == 4 else [[0, 1]])
    done = _all_checks(get_group(list(range(world_size))), list(range(world_size)))
    if world_size == 4:
        mine = half[rank // 2]
        done += _all_checks(get_group(mine), mine)
        assert get_group([rank]) is None
        try:
            get_group([0, 3])
        except KeyError:
            done.append("uncreated group raises")
        else:
            raise AssertionError("get_group of an uncreated group must raise")
    return done


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives(world_size: int) -> None:
    # 2 ranks start their process group with nnscaler.runtime.init() (torchrun-style env), 4 ranks
    # with a FileStore
    results = run_dist(comm_worker, world_size, timeout=80, init=world_size == 4)
    assert len(results) == world_size
    for done in results:
        assert len(done) == (6 if world_size == 2 else 11), done


def test_no_group_is_local() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    assert comm.copy_to_group(x, None) is x
    assert comm.reduce_from_group(x, None) is x
    assert comm.gather_from_group(x, 1, None, blocks=3) is x
    assert comm.split_to_group(x, 0, None) is x
    assert comm.reduce_scatter_to_group(x, 0, None) is x
    assert comm.all_to_all_in_group(x, 0, 1, None) is x
    assert (comm.rank_in_group(None), comm.group_size(None)) == (0, 1)
    logits, target = torch.randn(5, 9), torch.tensor([1, -100, 3, 8, 0])
    _close(comm.vocab_parallel_cross_entropy(logits, target, 0, None), F.cross_entropy(logits, target), "CE")
    _close(
        comm.batch_parallel_cross_entropy(logits, target, None), F.cross_entropy(logits, target), "batch CE"
    )
