"""Chunked linear + cross-entropy (nnscaler.runtime.chunked_loss): equal to the unchunked loss and its
gradients, one node under torch.export, vocab-parallel over gloo ranks, and compiled under `tp`
(vocabulary split) and `data` (tokens split) with parity against the single-device model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import nnscaler
from nnscaler.runtime.chunked_loss import (
    chunk_linear_cross_entropy,
    vocab_parallel_chunk_linear_cross_entropy,
)
from tests.dist_util import spawn
from tests.parity import run_parity

K, V = 12, 40


def _case(n: int, seed: int = 0, ignore_index: int = -100) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, K, dtype=torch.float64, generator=g)
    weight = torch.randn(V, K, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[:: max(1, n // 3)] = ignore_index  # some ignored rows (the first always)
    grad = torch.randn(n, dtype=torch.float64, generator=g)
    return hidden, weight, labels, grad


def _reference(hidden, weight, labels, grad, ignore_index: int = -100) -> tuple[torch.Tensor, ...]:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, reduction="none", ignore_index=ignore_index)
    loss.backward(grad)
    return loss.detach(), h.grad, w.grad


def _chunked(hidden, weight, labels, grad, **kw) -> tuple[torch.Tensor, ...]:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunk_linear_cross_entropy(h, w, labels, **kw)
    loss.backward(grad)
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("n", [1, 5, 16, 37, 64])
def test_values_and_grads_match_unchunked(n: int) -> None:
    """N below, equal to, a multiple of and not a multiple of chunk_size 16; ignored rows give 0."""
    hidden, weight, labels, grad = _case(n, seed=n)
    got = _chunked(hidden, weight, labels, grad, chunk_size=16)
    want = _reference(hidden, weight, labels, grad)
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert (got[0][labels == -100] == 0).all()
    assert (got[1][labels == -100] == 0).all(), "ignored rows must get no hidden gradient"


def test_custom_ignore_index_and_float32() -> None:
    hidden, weight, labels, grad = _case(23, seed=3, ignore_index=7)
    got = _chunked(hidden.float(), weight.float(), labels, grad.float(), ignore_index=7, chunk_size=4)
    want = _reference(hidden, weight, labels, grad, ignore_index=7)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_gradcheck() -> None:
    hidden, weight, labels, _ = _case(9, seed=5)
    fn = lambda h, w: chunk_linear_cross_entropy(h, w, labels, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()))


def test_bad_shapes_are_named() -> None:
    hidden, weight, labels, _ = _case(8)
    with pytest.raises(ValueError, match="flatten the leading dims"):
        chunk_linear_cross_entropy(hidden.view(2, 4, K), weight, labels)
    with pytest.raises(ValueError, match="share K"):
        chunk_linear_cross_entropy(hidden[:, :5], weight, labels)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        chunk_linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def test_public_name_and_export_one_node() -> None:
    assert nnscaler.chunk_linear_cross_entropy is chunk_linear_cross_entropy

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(V, K))

        def forward(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return nnscaler.chunk_linear_cross_entropy(h, self.weight, t, chunk_size=8).sum()

    ep = torch.export.export(Head(), (torch.randn(20, K), torch.randint(0, V, (20,))), strict=False)
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert ops == ["nnscaler.chunk_linear_cross_entropy.default", "aten.sum.default"], ops


# ---- vocab-parallel on gloo ranks ----------------------------------------------------------------------


def _vocab_parallel(rank: int, world: int, n: int, chunk: int) -> tuple[torch.Tensor, ...]:
    hidden, weight, labels, grad = _case(n, seed=11)
    rows = V // world
    h = hidden.clone().requires_grad_()
    w = weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    loss = vocab_parallel_chunk_linear_cross_entropy(
        h, w, labels, rank * rows, dist.group.WORLD, chunk_size=chunk
    )
    loss.backward(grad)
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_single_process(world: int, tmp_path: Path) -> None:
    n, chunk = 29, 8
    results = spawn(_vocab_parallel, world, tmp_path, n, chunk)
    loss, d_hidden, d_weight = _reference(*_case(n, seed=11))
    rows = V // world
    for rank, (got_loss, got_dh, got_dw) in enumerate(results):
        torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_dh, d_hidden, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_dw, d_weight[rank * rows : (rank + 1) * rows], rtol=1e-12, atol=1e-12)


def test_vocab_parallel_one_rank_without_group() -> None:
    hidden, weight, labels, grad = _case(13, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = vocab_parallel_chunk_linear_cross_entropy(h, w, labels, 0, None, chunk_size=5)
    loss.backward(grad)
    for a, b in zip((loss.detach(), h.grad, w.grad), _reference(hidden, weight, labels, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- compiled: a tiny LM whose head goes through chunk_linear_cross_entropy -----------------------------


class ChunkedLM(nn.Module):
    """Embedding -> two linears -> LM head weight used by chunk_linear_cross_entropy; mean over tokens."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 32)
        self.fc2 = nn.Linear(32, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.embed(idx))))
        flat = labels.reshape(-1)
        losses = chunk_linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.head.weight, flat, chunk_size=8)
        return losses.sum() / (flat != -100).sum()


def build_chunked_lm(seed: int = 0):
    """A zoo builder (`tests.test_chunked_loss:build_chunked_lm`) for the parity harness."""
    torch.manual_seed(seed)
    model = ChunkedLM()

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, 64, (batch_size, 12), generator=g)
        labels = torch.randint(0, 64, (batch_size, 12), generator=g)
        labels[:, :2] = -100  # a prompt that is not trained on
        return {"idx": idx, "labels": labels}

    return model.train(), make_batch


@pytest.mark.parametrize("policy", ["tp", "data"])
def test_compiled_parity(policy: str, tmp_path: Path) -> None:
    """`tp` splits the vocabulary (vocab-parallel chunked loss), `data` the tokens; SGD checks the
    gradients' scale (a d_hidden summed twice over the vocabulary group would show)."""
    run_parity(
        "tests.test_chunked_loss:build_chunked_lm",
        policy,
        2,
        2,
        steps=3,
        optimizer="sgd",
        optimizer_kwargs={"lr": 1.0},  # large steps: a wrong gradient scale shows far above round-off
        tmp_path=tmp_path,
    )
    code = (next((tmp_path / "gen").rglob("gencode0.py"))).read_text()
    if policy == "tp":
        assert "comm.vocab_parallel_chunk_linear_cross_entropy(" in code, code
    else:
        assert "torch.ops.nnscaler.chunk_linear_cross_entropy.default(" in code, code
    assert "F.cross_entropy" not in code, "the logits must not be formed whole"
